"""The peak FLOP/s that MFU is measured against, and where it comes from.

TPUs and GPUs: the vendors' data sheets (meshfit.parallel.planning's table). CPUs publish no such
figure, so it is measured: a short matrix-multiply probe in the precision in use, run on every
device of this process at once (a batch of n x n products sharded over the devices, so the
figure is what the devices in use reach together, cores shared as in training), timed for at
least PROBE_SECONDS a round, the best of PROBE_ROUNDS rounds kept (a busy machine only lowers a
round). Kept in $XDG_CACHE_HOME/meshfit/peak.json (default ~/.cache), keyed by CPU model, cores,
devices, precision and engine, with whether the probe ran on quiet cores.

A probe that shares the cores with other work is low, and a low peak makes MFU read high. So each
probe also measures the share of its cores' time that other processes took (Linux: /proc/stat
against this process's own CPU time). A peak probed under load (more than LOADED_SHARE) is used,
said so where it is shown, and probed again by a later run (REPROBE_SECONDS on), until a quiet
probe confirms it; a quiet one is used from the cache without probing. An MFU above 100% probes again at once
(`peak_of(..., again=True)`). The cache keeps the highest figure ever measured: load only lowers a
probe. Light at import: JAX or TensorFlow are imported inside the probe, which runs after
connect().
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit.parallel import devices as devices_lib
from meshfit.watch import kept

# n of the n x n products. 512 left TensorFlow's oneDNN matmul below its rate: on the 2-core EPYC
# VM (2026-11-27, one process, sizes alternating) 125 GFLOP/s at 512 against 143 at 1024 (JAX:
# 153 and 165), and 68 against 77-79 in a busier minute.
PROBE_SIZE = 1024
PROBE_SECONDS = 0.15  # each round repeats products for at least this long
PROBE_ROUNDS = 5
# Other processes' share of the probe's cores above which the probe counts as taken under load.
# Measured on the 2-core VM (2026-11-27): 0.005-0.017 quiet (probes of 99-135 GFLOP/s); 0.66-0.75
# beside two test runs (load average 12), where the probe fell to 40-79 GFLOP/s.
LOADED_SHARE = 0.2
# A figure probed under load is probed again by the first run this long after it (not by every
# run: on a machine that is always busy, such as a test suite's, each process would pay the ~1 s).
REPROBE_SECONDS = 600

_measured: dict[str, tuple[float, str]] = {}  # this process's peaks and how found, by cache key


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
    flops, how = cpu_peak(local, precision, strategy.engine, again)
    total = flops * strategy.hosts  # every host probes its own devices; hosts alike
    return {"flops": total, "precision": precision,
            "source": f"matmul probe of {len(local)} CPU device(s) on "
                      f"{devices_lib.cpu_model()}, {how}, kept in {cache_path()}"}


def _key(devices: int, precision: str, engine: str) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{devices_lib.cpu_model()}|{cores} cores|{devices} devices|{precision}|{engine}"


def cpu_peak(devices: list, precision: str, engine: str = "jax",
             again: bool = False) -> tuple[float, str]:
    """(FLOP/s of `devices` together at `precision`, how it was found: "cached" or "measured
    now", with the other work's share of the cores where the figure was probed under load);
    again: probe anew. The higher figure is kept."""
    key = _key(len(devices), precision, engine)
    if key in _measured and not again:
        return _measured[key]
    known = _kept_entry(key)
    if known["flops"] and not again and (known["quiet"] or time.time() - known["at"] < REPROBE_SECONDS):
        _measured[key] = known["flops"], _how("cached", known)
        return _measured[key]
    use = CoreUse()
    measured = probe(devices, precision, engine)
    others = use.others_share()
    entry = {"flops": max(measured, known["flops"]), "at": time.time(), "others": others,
             # unknown (not Linux): taken as quiet
             "quiet": known["quiet"] or others is None or others <= LOADED_SHARE}
    kept.keep("peak", key, entry)
    _measured[key] = entry["flops"], _how("measured now", entry)
    return _measured[key]


def _how(found: str, entry: dict[str, Any]) -> str:
    """`found`, and where no quiet probe confirms the figure, the load it was probed under."""
    if entry["quiet"]:
        return found
    return (f"{found}, probed while other work used {entry['others']:.0%} of the cores (MFU may "
            "read high; probed again in a later run)")


def _kept_entry(key: str) -> dict[str, Any]:
    """The cache's {"flops", "quiet", "others", "at"} for `key` (zeros when none). A bare number,
    as kept before 2026-11-27, is not known to be quiet and is probed again."""
    entry = kept.read("peak").get(key)
    if isinstance(entry, (int, float)):
        entry = {"flops": entry}
    try:
        return {"flops": float(entry["flops"]), "quiet": bool(entry.get("quiet")),
                "others": float(entry.get("others") or 0.0), "at": float(entry.get("at") or 0.0)}
    except (TypeError, KeyError, ValueError):
        return {"flops": 0.0, "quiet": False, "others": 0.0, "at": 0.0}


class CoreUse:
    """How much of this process's CPU cores other processes used since it was made (Linux's
    /proc/stat per core, less this process's own CPU time; steal time counts as other work)."""

    def __init__(self):
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(busy seconds of our cores, this process's CPU seconds, wall seconds), or None."""
        try:
            with open("/proc/stat") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = 0
        names = {f"cpu{c}" for c in self.cores}
        for line in lines:
            fields = line.split()
            if fields and fields[0] in names:
                # user nice system idle iowait irq softirq steal ...: busy is all but idle, iowait
                numbers = [int(x) for x in fields[1:9]]
                busy += sum(numbers) - numbers[3] - numbers[4]
        own = os.times()
        return busy / tick, own.user + own.system, time.perf_counter()

    def others_share(self) -> float | None:
        """Other processes' share of our cores' time since __init__, 0 to 1 (None: unknown)."""
        end = self._sample()
        if self.start is None or end is None or not self.cores:
            return None
        wall = end[2] - self.start[2]
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return min(max(others / (wall * len(self.cores)), 0.0), 1.0) if wall > 0 else None


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
