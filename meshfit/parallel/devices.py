"""Device discovery: which accelerator is here, how many cores, how many hosts.

JAX is imported inside the functions, never at module import, because simulated devices
(`--xla_force_host_platform_device_count`) must be configured before JAX starts its backends.
"""

from __future__ import annotations

import os
import platform as _platform
import re
from dataclasses import dataclass, field
from typing import Any

from meshfit.parallel import cluster
from meshfit import env
from meshfit.errors import MeshfitError

_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's YNNPACK fusions, on by default in jaxlib 0.9.2 to 0.10.x (at least), compute wrong
# gradients in some programs whose weights are sharded: a 784-1024-1024-10 MLP under fsdp on 8
# simulated devices got gradients 2e-3 off in its first step (widths 256-1024 and inputs of 512 to
# 1024 were exact), data parallelism was exact, and without these fusions fsdp is exact too.
# Turning them off costs a data-parallel CNN about 8% (BENCHMARKS.md, section 2b). The flag is set
# only for simulated devices (by meshfit, or by the user's own XLA_FLAGS device count when JAX has
# not started yet) and only where XLA knows it (an unknown flag aborts the process): jaxlib 0.9.2
# and later.
_NO_YNN_FUSIONS = "--xla_cpu_experimental_ynn_fusion_type="
_NO_YNN_FUSIONS_SINCE = (0, 9, 2)


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


def simulate_devices(count: int) -> None:
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
            return
        from meshfit.watch import progress

        where = ("restart the kernel and call" if progress.notebook() else
                 f"set {env.SIMULATE_DEVICES}={count} before starting Python, or call")
        raise MeshfitError(
            f"cannot simulate {count} devices: JAX already started with {len(have)} "
            f"{have[0].platform} device(s) in this process; {where} "
            f"meshfit.connect(simulate={count}) before anything else uses JAX"
        )
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = _without_ynn_fusions(f"{flags} {_COUNT_FLAG}={count}".strip())
    os.environ["JAX_PLATFORMS"] = "cpu"


def _without_ynn_fusions(flags: str) -> str:
    """XLA_FLAGS `flags` with YNNPACK fusions off where this jaxlib knows the flag (see
    _NO_YNN_FUSIONS), unless `flags` sets it already (the user's own setting wins)."""
    if _NO_YNN_FUSIONS.rstrip("=") in flags or _jaxlib_version() < _NO_YNN_FUSIONS_SINCE:
        return flags
    return f"{flags} {_NO_YNN_FUSIONS}".strip()


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


def requested_simulation(simulate: int | None) -> int | None:
    """The simulated device count asked for by argument, else by $MESHFIT_SIMULATE_DEVICES."""
    if simulate is not None:
        return simulate
    return env.read_int(env.SIMULATE_DEVICES, example=8)


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


def discover(simulate: int | None = None, require: str | None = None) -> DeviceInfo:
    """Find the devices JAX sees (TPU before GPU before CPU) and describe them."""
    simulate = requested_simulation(simulate)
    if simulate is not None:
        simulate_devices(simulate)
    elif _COUNT_FLAG in os.environ.get("XLA_FLAGS", "") and not cluster.jax_started():
        os.environ["XLA_FLAGS"] = _without_ynn_fusions(os.environ["XLA_FLAGS"])  # devices simulated by hand
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
        simulated=simulate is not None,
        devices=devices,
    )
