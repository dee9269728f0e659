"""A JAX job's process 0 leaving first aborts the others: a reproduction with plain JAX.

Two processes join with `jax.distributed.initialize` on this machine, pass a barrier, and leave
with `os._exit` (as a stopped or failed process of a job must, not to wait for the others), process
1 three seconds after process 0. Process 0 hosts the coordination service; once it is gone,
process 1's coordination agent polls an error and JAX ends it with SIGABRT (exit code 134, "F...
client.h] Terminating process because the JAX distributed service detected fatal errors ... Socket
closed"), although nothing failed. With --shutdown both call `jax.distributed.shutdown()` first
(its barrier waits for every process) and both exit with code 143.

    python benchmarks/coordinator_exit_order.py [--shutdown]

Seen with jax and jaxlib 0.10.2 on CPU. meshfit leaves this way after a stop on a signal
(meshfit.parallel.cluster.exit_failed(together=True)).
"""

import argparse
import os
import socket
import subprocess
import sys
import time

LATE_SECONDS = 3  # process 1 leaves this long after process 0


def member(process_id: int, port: int, shutdown: bool) -> None:
    """One process of the job: join, line up, leave with code 143."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.experimental import multihost_utils

    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    multihost_utils.sync_global_devices("all here")
    if process_id == 1:
        time.sleep(LATE_SECONDS)
    if shutdown:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(143)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shutdown", action="store_true", help="jax.distributed.shutdown() first")
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        return member(args.member, args.port, args.shutdown)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flag = ["--shutdown"] if args.shutdown else []
    jobs = [subprocess.Popen([sys.executable, __file__, "--member", str(i), "--port", str(port), *flag],
                             stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    for i, job in enumerate(jobs):
        _, err = job.communicate(timeout=300)
        fatal = [line for line in err.splitlines() if "Terminating process" in line]
        print(f"process {i}: exit code {job.returncode}" + (f"; {fatal[0][:160]}" if fatal else ""))


if __name__ == "__main__":
    main()
