"""The peak FLOP/s that MFU is measured against, and where it comes from.

TPUs and GPUs: the vendors' data sheets (meshfit.parallel.planning's table). CPUs publish no such
figure, so it is measured: a short matrix-multiply probe in the precision in use, run on every
device of this process at once (a batch of n x n products sharded over the devices, so the
figure is what the devices in use reach together, cores shared as in training), timed for at
least PROBE_SECONDS a round, the best of PROBE_ROUNDS rounds kept (a busy machine only lowers a
round). Measured once per machine and cached in $XDG_CACHE_HOME/meshfit/peak.json (default
~/.cache), keyed by CPU model, cores, devices, precision and engine. A probe taken while other
work shared the cores is low, which shows as an MFU above 100%: the epoch report then probes
again (`peak_of(..., again=True)`), and the cache keeps the highest figure ever measured. Light at import: JAX or
TensorFlow are imported inside the probe, which runs after connect().
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit.parallel import devices as devices_lib
from meshfit.watch import kept

PROBE_SIZE = 512  # n of the n x n products: large enough for the BLAS kernels' peak rate
PROBE_SECONDS = 0.15  # each round repeats products for at least this long
PROBE_ROUNDS = 5

_measured: dict[str, float] = {}  # this process's probes, by cache key


def cache_path() -> str:
    """Where the peaks are kept: $XDG_CACHE_HOME/meshfit/peak.json (default ~/.cache)."""
    return kept.path("peak")


def peak_of(strategy, again: bool = False) -> dict[str, Any]:
    """{"flops": peak FLOP/s of all replicas together (None: unknown), "source": where it comes
    from, "precision"} for a meshfit Strategy; a CPU's is probed (or read from the cache;
    again: probed anew, the cache keeping the higher figure)."""
    precision = strategy.precision
    table = strategy.peak_flops
    if table:
        return {"flops": table, "source": f"data sheet of {strategy.device_kind}",
                "precision": precision}
    if strategy.platform != "cpu":
        return {"flops": None, "source": f"no data sheet figure for {strategy.device_kind}",
                "precision": precision}
    local = list(strategy.info.devices)
    local = [d for d in local if getattr(d, "process_index", 0) == strategy.info.process_index] or local
    flops, cached = cpu_peak(local, precision, strategy.engine, again)
    total = flops * strategy.hosts  # every host probes its own devices; hosts alike
    how = "cached" if cached else "measured now"
    return {"flops": total, "precision": precision,
            "source": f"matmul probe of {len(local)} CPU device(s) on "
                      f"{devices_lib.cpu_model()}, {how} in {cache_path()}"}


def _key(devices: int, precision: str, engine: str) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{devices_lib.cpu_model()}|{cores} cores|{devices} devices|{precision}|{engine}"


def cpu_peak(devices: list, precision: str, engine: str = "jax",
             again: bool = False) -> tuple[float, bool]:
    """(FLOP/s of `devices` together at `precision`, whether it came from the cache); again:
    probe anew and keep the higher of the new and the cached figure."""
    key = _key(len(devices), precision, engine)
    if key in _measured and not again:
        return _measured[key], True
    known = 0.0
    try:
        known = float(kept.read("peak")[key])
        if known > 0 and not again:
            _measured[key] = known
            return known, True
    except (KeyError, ValueError, TypeError):
        pass
    flops = max(probe(devices, precision, engine), known, _measured.get(key, 0.0))
    _measured[key] = flops
    kept.keep("peak", key, flops)
    return flops, False


def probe(devices: list, precision: str, engine: str = "jax", size: int = PROBE_SIZE,
          seconds: float = PROBE_SECONDS, rounds: int = PROBE_ROUNDS) -> float:
    """Measured FLOP/s of n x n matrix products at `precision` on `devices` at once: the best
    round of `rounds`, each repeating the products for at least `seconds`."""
    dtype = precision if precision in ("float32", "bfloat16", "float16") else "float32"
    run = _jax_products(devices, dtype, size) if engine == "jax" else _tf_products(dtype, size)
    flops_per_call = 2 * size ** 3 * (len(devices) if engine == "jax" else 1)
    run()  # compile and warm up
    best = 0.0
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            run()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, calls * flops_per_call / elapsed)
    return best


def _jax_products(devices: list, dtype: str, size: int):
    """A function computing one n x n product per device, sharded, and waiting for them."""
    import jax  # after connect(): the engine is chosen
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("d",))
    placement = NamedSharding(mesh, PartitionSpec("d"))
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((len(devices), size, size), dtype="float32"), placement)
    a = a.astype(dtype)
    product = jax.jit(lambda m: m @ m, out_shardings=placement)
    return lambda: product(a).block_until_ready()


def _tf_products(dtype: str, size: int):
    """A function computing one n x n product with TensorFlow on the CPU."""
    import numpy as np
    import tensorflow as tf  # the TensorFlow engine: already imported by Keras

    a = tf.constant(np.random.default_rng(0).standard_normal((size, size), dtype="float32"))
    a = tf.cast(a, dtype)
    product = tf.function(lambda m: tf.matmul(m, m), jit_compile=False)
    return lambda: product(a).numpy()
