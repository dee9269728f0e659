"""Device discovery: which accelerator is here, how many cores, how many hosts.

JAX is imported inside the functions, never at module import, because simulated devices
(`--xla_force_host_platform_device_count`) must be configured before JAX starts its backends.
"""

from __future__ import annotations

import os
import platform as _platform
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from meshfit.parallel import cluster, stall
from meshfit import env
from meshfit.errors import MeshfitError

_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's collective timeouts (see _prepare_cpu_client) exist from jaxlib 0.9.2 on (read from its
# binary); an older jaxlib aborts the process on a flag it does not know.
_COLLECTIVE_TIMEOUTS_SINCE = (0, 9, 2)
# XLA:CPU's YNNPACK dot fusions stay on (XLA's default): from 2026-11-24 to 11-28 meshfit turned them
# off for simulated devices, after fsdp's step of a 784-1024-1024-10 MLP differed from data
# parallelism's by 1.1e-4. That was not a wrong result: one pre-activation of that input lies
# 1.5e-7 from zero, within float32 rounding of a 1024-term sum, so any other summation order (YNNPACK
# or Eigen, another CPU, another XLA) can flip its ReLU, and each configuration equals the float64
# step with its own mask to 6e-9 (docs/reference/relu-kink.md, benchmarks/relu_kink.py).

# XLA:CPU runs the device parts of every program, and the launches of those parts, on one pool of
# max(cores, devices) threads ($PJRT_NPROC stands in for the cores), and two things block a pool
# thread: a collective waits until every device's part of its program has arrived, and a launch
# waits while its device already has 32 programs queued (XLA's in-flight limit). With as many
# threads as devices, Python running 32 small programs ahead (a busy machine, or Keras running a
# model op by op) makes launches take the threads that the collective running now still needs for
# its last parts: a deadlock, which XLA ends with SIGABRT after 40 s (docs/xla-cpu-deadlock.md has
# the reproduction). Enough threads make it impossible: XLA runs multi-device programs one at a time
# (each waits for the last), so at most N threads wait in that one program's collectives, and a
# dispatching thread has at most N launches out at once (Execute returns when they are done), so
# at most N more threads wait on the limit. THREADS_PER_DEVICE = 3 leaves room for two threads
# dispatching at once (the training thread and one more, e.g. a data or checkpoint thread). The
# larger pool also trains faster on a busy 2-core machine (BENCHMARKS.md, section 2).
THREADS_PER_DEVICE = 3
_POOL_VARIABLE = "PJRT_NPROC"  # read by XLA's DefaultThreadPoolSize() when the CPU client starts


@dataclass(frozen=True)
class DeviceInfo:
    """What was found: platform ('tpu', 'gpu' or 'cpu'), device kind and the device layout."""

    platform: str
    device_kind: str
    devices_per_host: int
    hosts: int
    process_index: int
    compute_capability: str | None = None
    simulated: bool = False
    devices: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def device_count(self) -> int:
        """Devices in use over all hosts."""
        return self.devices_per_host * self.hosts


MAX_SIMULATED = 1024  # JAX takes minutes to start with a million CPU devices


def use_simulated_devices(count: int) -> None:
    """Make JAX show `count` CPU devices standing in for accelerator cores.

    Must run before JAX starts; afterwards it only succeeds if JAX already has exactly
    `count` CPU devices.
    """
    if not 1 <= count <= MAX_SIMULATED:
        raise MeshfitError(f"--simulate-devices must be at least 1 and at most {MAX_SIMULATED}, "
                           f"got {count}")
    if cluster.jax_started():
        import jax

        have = jax.local_devices()  # this process's: a job of several has more in jax.devices()
        if have[0].platform == "cpu" and len(have) == count:
            _warn_if_pool_small(count)
            return
        where = ("restart the kernel and call" if env.notebook() else
                 f"set {env.SIMULATE_DEVICES}={count} before starting Python, or call")
        raise MeshfitError(
            f"cannot simulate {count} devices: JAX already started with {len(have)} "
            f"{have[0].platform} device(s) in this process; {where} "
            f"meshfit.connect(simulate_devices={count}) before anything else uses JAX"
        )
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported before (a spare, meshfit.launch.spares), but not started:
        sys.modules["jax"].config.update("jax_platforms", "cpu")  # it read JAX_PLATFORMS at import
    _prepare_cpu_client(count)


def _prepare_cpu_client(count: int) -> None:
    """Settings for XLA's CPU client with `count` simulated devices, made before JAX starts it:
    a thread pool that cannot deadlock (see THREADS_PER_DEVICE), and XLA's own 40 s abort of a
    stuck collective moved behind meshfit's stall guard, which ends a stall with one line instead
    (meshfit.parallel.stall)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _jaxlib_version() >= _COLLECTIVE_TIMEOUTS_SINCE:
        for flag, seconds in stall.xla_collective_timeouts().items():
            flags = _with_flag(flags, f"{flag}={seconds}")
    os.environ["XLA_FLAGS"] = flags.strip()
    threads = THREADS_PER_DEVICE * count
    asked = env.read_int(_POOL_VARIABLE, example=threads)
    if asked is None or asked < threads:  # fewer can deadlock; more is the user's choice
        os.environ[_POOL_VARIABLE] = str(max(threads, os.cpu_count() or 1))


def _warn_if_pool_small(count: int) -> None:
    """One warning when JAX started its CPU client before meshfit could size its thread pool and
    the pool may be too small for `count` devices (see THREADS_PER_DEVICE)."""
    threads = THREADS_PER_DEVICE * count
    pool = env.read_int(_POOL_VARIABLE, example=threads) or os.cpu_count() or 1
    if count > 1 and max(pool, count) < threads:
        warnings.warn(f"JAX started before meshfit.connect(), so XLA's CPU thread pool has "
                      f"{max(pool, count)} threads for {count} devices and can deadlock on a busy "
                      f"machine; call meshfit.connect(simulate_devices={count}) before anything "
                      f"uses JAX, or set {_POOL_VARIABLE}={threads} before starting Python",
                      stacklevel=3)


def _with_flag(flags: str, flag: str) -> str:
    """XLA_FLAGS `flags` with `flag` ("--name=value") added, unless `flags` names it already (the
    user's own setting wins)."""
    name = flag.split("=", 1)[0]
    return flags if re.search(rf"{name}(=|\s|$)", flags) else f"{flags} {flag}".strip()


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version as numbers, e.g. (0, 10, 2); (0,) when unknown."""
    from importlib import metadata

    try:
        return tuple(int(part) for part in re.findall(r"\d+", metadata.version("jaxlib"))[:3])
    except metadata.PackageNotFoundError:
        return (0,)


def memory_bytes(info: DeviceInfo, asked: int | None = None) -> int | None:
    """Bytes of memory of one device: `asked` (--device-memory), else the device's own
    `memory_stats()['bytes_limit']` (TPUs and GPUs), else None (CPUs)."""
    if asked is not None:
        return asked
    try:
        stats = info.devices[0].memory_stats() if info.devices else None
        limit = (stats or {}).get("bytes_limit")
        return int(limit) if limit else None
    except Exception:  # a backend without memory statistics
        return None


def requested_simulation(simulate_devices: int | str | None) -> int | None:
    """The simulated device count asked for by argument (a whole number, or its digits: a
    program's `connect(simulate=sys.argv[1])`), else by $MESHFIT_SIMULATE_DEVICES."""
    if simulate_devices is None:
        return env.read_int(env.SIMULATE_DEVICES, example=8)
    text = str(simulate_devices).strip()
    if isinstance(simulate_devices, bool) or not text.lstrip("-").isdigit():
        raise MeshfitError(f"simulate_devices={simulate_devices!r} is not a whole number of "
                           "devices; give e.g. simulate_devices=8")
    return int(text)


def cpu_model() -> str:
    """The CPU's marketing name, e.g. 'AMD EPYC 7B13', from /proc/cpuinfo where available."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine() or "cpu"


def discover(simulate_devices: int | None = None, require: str | None = None) -> DeviceInfo:
    """Find the devices JAX sees (TPU before GPU before CPU) and describe them."""
    simulate_devices = requested_simulation(simulate_devices)
    if simulate_devices is not None:
        use_simulated_devices(simulate_devices)
    elif (by_hand := re.search(rf"{_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))) \
            and not cluster.jax_started():
        _prepare_cpu_client(int(by_hand.group(1)))  # devices simulated by hand
    cluster.join()  # a multi-host job must be joined before JAX starts its backends
    import jax

    devices = tuple(jax.devices())
    first = devices[0]
    platform = first.platform.lower()
    if platform in ("cuda", "rocm"):
        platform = "gpu"
    if require is not None:
        require = require.lower()
        if require not in ("tpu", "gpu", "cpu"):
            raise MeshfitError(f"unknown platform {require!r} for require; use tpu, gpu or cpu")
        if platform != require:
            raise MeshfitError(
                f"no {require.upper()} found (JAX sees {len(devices)} {platform} device(s)); "
                f"attach a {require.upper()} runtime and install "
                f"{'meshfit[tpu]' if require == 'tpu' else 'meshfit[cuda13] or meshfit[cuda12]'}",
                see="no-gpu-or-tpu-found")
    kind = cpu_model() if platform == "cpu" else first.device_kind
    return DeviceInfo(
        platform=platform,
        device_kind=kind,
        devices_per_host=jax.local_device_count(),
        hosts=jax.process_count(),
        process_index=jax.process_index(),
        compute_capability=getattr(first, "compute_capability", None),
        simulated=simulate_devices is not None,
        devices=devices,
    )
