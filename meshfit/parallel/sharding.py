"""How each variable is laid out on the devices: replicated ("data") or sharded ("fsdp").

- data: every variable is replicated on every device; each device takes 1/N of the batch.
- fsdp (fully sharded data parallel, ZeRO-3 style): every floating-point variable of at least
  `fsdp_min_bytes` (default 1 MiB) is split over all N devices along its largest dimension that N
  divides (on a tie, the trailing one); smaller, integer and indivisible variables stay
  replicated. The batch is still split over the same device axis ('batch'), and XLA gathers each
  weight for the step that uses it. Keras creates an optimizer variable with its weight's layout
  (`add_variable_from_reference`), so Adam's moments are sharded like their weights.
- auto: data-parallel when the memory plan (meshfit.fit.memory_plan) says the replicated step fits
  each device, else fsdp; data when the device memory is unknown.

Here the rule is pure functions of shapes and dtypes; meshfit.fit.strategy.FsdpParallel applies it
per variable through Keras' `Distribution.get_variable_layout` (a `DataParallel` subclass), so it
works for any Keras model. A user's `LayoutMap` entries win.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from meshfit.errors import MeshfitError

SHARDINGS = ("auto", "data", "fsdp")
DEFAULT_SHARDING = "auto"
# Small variables stay whole: sharding every variable of the tutorial CNN (threshold 1 byte)
# cost ~10% per step in gathers (BENCHMARKS.md, section 2b).
DEFAULT_FSDP_MIN_BYTES = 1 << 20
REPLICATED_WARN_SHARE = 0.02  # above this share of the state left replicated under fsdp: a warning
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9,
          "gb": 10 ** 9, "t": 10 ** 12, "tb": 10 ** 12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def check_sharding(sharding: str | None) -> str:
    """`sharding` ('auto', 'data' or 'fsdp'; None: the default, 'auto') checked, lower-cased."""
    name = str(sharding or DEFAULT_SHARDING).strip().lower()
    if name not in SHARDINGS:
        raise MeshfitError(f"unknown sharding {sharding!r}; use one of: {', '.join(SHARDINGS)} "
                           "(e.g. --sharding fsdp)")
    return name


def parse_fsdp_min_bytes(size: str | int | None) -> int:
    """The fsdp threshold in bytes: `size` ('1MiB', a byte count) parsed, None the default."""
    parsed = parse_size(size, "--fsdp-min-bytes")
    return DEFAULT_FSDP_MIN_BYTES if parsed is None else parsed


def parse_size(text: str | int | None, flag: str = "--device-memory") -> int | None:
    """A size in bytes from '48MB', '16GB', '1MiB', '512k' or a plain byte count (None stays None).

    KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024.
    """
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise MeshfitError(f"{flag} {text!r} is not a size; use e.g. 48MB, 16GB or 1MiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise MeshfitError(f"{flag} must be at least 1 byte, got {text!r}")
    return value


def format_bytes(count: float | None) -> str:
    """'12.3 MB' style (powers of 1000), 'n/a' for None."""
    if count is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def is_float(dtype: Any) -> bool:
    """True for floating-point dtypes (given as a name or a numpy/JAX dtype)."""
    return "float" in str(getattr(dtype, "name", dtype))


def itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype`."""
    import numpy as np

    name = str(getattr(dtype, "name", dtype))
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def shard_axis(shape: Sequence[int], dtype: Any, devices: int, fsdp_min_bytes: int) -> int | None:
    """The axis fsdp splits a variable of `shape` and `dtype` along over `devices`, or None
    (replicated): floating point, at least `fsdp_min_bytes`, and some dimension divisible by
    `devices`; the largest such dimension, the trailing one on a tie."""
    if devices < 2 or not is_float(dtype) or not shape:
        return None
    if math.prod(shape) * itemsize(dtype) < fsdp_min_bytes:
        return None
    axes = [i for i, size in enumerate(shape) if size >= devices and size % devices == 0]
    return max(axes, key=lambda i: (shape[i], i)) if axes else None


def partition(shape: Sequence[int], dtype: Any, sharding: str, devices: int, fsdp_min_bytes: int,
              axis_name: str = "batch") -> list[str | None]:
    """The per-axis partition spec of a variable under `sharding` ('data' or 'fsdp')."""
    spec: list[str | None] = [None] * len(shape)
    axis = shard_axis(shape, dtype, devices, fsdp_min_bytes) if sharding == "fsdp" else None
    if axis is not None:
        spec[axis] = axis_name
    return spec


def bytes_per_device(shape: Sequence[int], dtype: Any, spec: Sequence[str | None],
                     devices: int) -> int:
    """Bytes one device holds of a variable laid out by `spec` (from `partition`)."""
    count = math.prod(shape) * itemsize(dtype)
    return count // devices if any(spec) else count
