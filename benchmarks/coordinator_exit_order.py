"""A JAX job's process 0 leaving first aborts the others: a reproduction with plain JAX.

Two processes join with `jax.distributed.initialize` on this machine, pass a barrier, and leave
with `os._exit` (as a stopped or failed process of a job must, not to wait for the others), process
1 three seconds after process 0. Process 0 hosts the coordination service; once it is gone,
process 1's coordination agent polls an error and JAX ends it with SIGABRT (exit code 134, "F...
client.h] Terminating process because the JAX distributed service detected fatal errors ... Socket
closed"), although nothing failed. With --shutdown both call `jax.distributed.shutdown()` first
(its barrier waits for every process) and both exit with code 143.

The abort is the default of jaxlib's `missed_heartbeat_callback`
(`get_distributed_runtime_client`'s parameter, which jax.distributed.initialize does not pass).
With --callback each process gives it a Python function (jaxlib's function wrapped as
meshfit.parallel.jax_internals.gloo_on_loopback wraps another) that would print one line and exit
with code 3: process 1 still aborts, now with "terminate called after throwing an instance of
'std::bad_cast'" (SIGABRT; the function is never called), since jaxlib cannot hand it the
absl::Status it is called with. So a survivor of a lost process 0 outside `meshfit launch`
(srun, a TPU slice's hosts) cannot end with a line of its own; the launcher reads the abort.

    python benchmarks/coordinator_exit_order.py [--shutdown | --callback]

Seen with jax and jaxlib 0.10.2 on CPU; --callback also with 0.12.0.1 (2026-11-29). meshfit leaves this way after a stop on a signal
(meshfit.parallel.cluster.exit_failed(together=True)).
"""

import argparse
import os
import socket
import subprocess
import sys
import time

LATE_SECONDS = 3  # process 1 leaves this long after process 0


def member(process_id: int, port: int, shutdown: bool, callback: bool) -> None:
    """One process of the job: join, line up, leave with code 143."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if callback:
        import functools

        from jax._src.lib import _jax

        def lost(*status):
            print(f"process {process_id}: the job lost a process: {status}", flush=True)
            os._exit(3)

        _jax.get_distributed_runtime_client = functools.partial(
            _jax.get_distributed_runtime_client, missed_heartbeat_callback=lost)
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
    parser.add_argument("--callback", action="store_true",
                        help="a Python missed_heartbeat_callback in place of the abort")
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        return member(args.member, args.port, args.shutdown, args.callback)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flag = ["--shutdown"] if args.shutdown else ["--callback"] if args.callback else []
    jobs = [subprocess.Popen([sys.executable, __file__, "--member", str(i), "--port", str(port), *flag],
                             stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    for i, job in enumerate(jobs):
        _, err = job.communicate(timeout=300)
        fatal = [line for line in err.splitlines()
                 if "Terminating process" in line or "std::bad_cast" in line]
        print(f"process {i}: exit code {job.returncode}" + (f"; {fatal[0][:160]}" if fatal else ""))


if __name__ == "__main__":
    main()
