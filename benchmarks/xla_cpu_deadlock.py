"""XLA:CPU deadlocks in a collective on several CPU devices: a reproduction with plain JAX.

N simulated devices (`--xla_force_host_platform_device_count=N`), a batch sharded over them, and a
loop of small eager operations: a matmul, a sum over the sharded axis (an all-reduce) and an update
of replicated weights. Python dispatches these faster than 2 cores run them, the client's launch
threads block on its per-device limit of 32 queued programs, and the all-reduce running then never
gets the threads its last device parts need: XLA ends the process after 40 s ("Termination timeout
for 'all reduce' ... Expected N threads to join the rendezvous"). See docs/reference/xla-cpu-deadlock.md.

    python benchmarks/xla_cpu_deadlock.py [--devices 8] [--steps 3000] [--threads T | --meshfit]

--threads T sets PJRT_NPROC=T (the client's pool; XLA's default is max(cores, N)); --meshfit
starts JAX through meshfit.connect(simulate=N), which sizes the pool itself. Prints "done" and
the time, or dies with SIGABRT (exit code 134).
"""

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--threads", type=int, help="PJRT_NPROC: the CPU client's thread pool")
    how.add_argument("--meshfit", action="store_true", help="start JAX through meshfit.connect()")
    args = parser.parse_args()
    n = args.devices
    if args.meshfit:
        import meshfit

        meshfit.connect(simulate=n, engine="jax", verbose=False)
    else:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
        os.environ["JAX_PLATFORMS"] = "cpu"
        if args.threads:
            os.environ["PJRT_NPROC"] = str(args.threads)

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices(), ("batch",))
    x = jax.device_put(jnp.ones((64 * n, 256)), NamedSharding(mesh, PartitionSpec("batch")))
    w = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, PartitionSpec()))
    start = time.perf_counter()
    for _ in range(args.steps):
        total = jnp.sum(x @ w, axis=0)  # an all-reduce over the devices
        w = w - 1e-9 * total[None, :]
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s, w[0, 0] = {float(w[0, 0]):.6f}",
          flush=True)


if __name__ == "__main__":
    main()
