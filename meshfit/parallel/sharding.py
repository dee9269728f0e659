"""The partition rules of the sharding modes (meshfit.parallel.modes) as pure functions of a
variable's shape and dtype, and sizes in bytes.

- data (`replicated_spec`): every variable is whole on every device of 'batch'; each device takes
  1/N of the batch.
- fsdp (`fsdp_spec`; fully sharded data parallel, ZeRO-3 style): every floating-point variable of
  at least `fsdp_min_bytes` (default 1 MiB) is split over all N devices along its largest
  dimension that N divides (on a tie, the trailing one); smaller, integer and indivisible
  variables stay replicated. The batch is still split over the same device axis ('batch'), and
  XLA gathers each weight for the step that uses it. Keras creates an optimizer variable with its
  weight's layout (`add_variable_from_reference`), so Adam's moments are sharded like their weights.

- model parallelism K (`connect(model_parallel=K)`): the devices form a mesh (N/K) x K with axes
  'batch' and 'model'. Every floating-point kernel (2 dimensions or more) is split over 'model'
  along an axis chosen from its shape alone (`model_axis`), so that the layers pair as in
  Megatron-LM: an up-projection (in < out, e.g. an MLP's first kernel, a language model's output
  head) is split along its output, a down-projection (in > out, the MLP's second kernel, an
  embedding table of vocabulary x hidden) along its input, and a 3-D attention kernel along its
  heads; XLA then inserts one reduction per block. fsdp then shards each variable's largest
  remaining divisible dimension over 'batch' (N/K devices); data keeps it whole there. What
  'model' leaves whole under fsdp (a vector, a single key/value head's kernel) is split over
  both axes at once (('batch', 'model'), all N devices) where N divides a dimension, and a
  kernel whose other dimensions 'batch' does not divide has its 'model' dimension split over
  both, so that each device holds about 1/N of the state, not 1/(N/K) of those variables.
- A kernel of 4 dimensions or more is a convolution's (window..., in, out): only its channels
  are split, never its window (`splittable_axes`).

meshfit.fit.strategy.MeshParallel applies a mode's rule per variable through Keras'
`Distribution.get_variable_layout` (a `ModelParallel` subclass), so it works for any Keras model.
A user's `LayoutMap` entries win.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from meshfit.errors import MeshfitError

# Small variables stay whole: sharding every variable of the tutorial CNN (threshold 1 byte)
# cost ~10% per step in gathers (BENCHMARKS.md, section 2b).
DEFAULT_FSDP_MIN_BYTES = 1 << 20
REPLICATED_WARN_SHARE = 0.02  # above this share of the state left replicated under fsdp: a warning
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9,
          "gb": 10 ** 9, "t": 10 ** 12, "tb": 10 ** 12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def check_model_parallel(model_parallel: int | str | None) -> int:
    """`model_parallel` (devices per model replica; None: 1) checked to be a whole number >= 1."""
    try:
        value = int(str(1 if model_parallel is None else model_parallel).strip())
    except ValueError:
        value = 0
    if value < 1 or (isinstance(model_parallel, float) and model_parallel != value):
        raise MeshfitError(f"--model-parallel {model_parallel!r} is not a whole number of devices "
                           "of at least 1; use e.g. --model-parallel 2")
    return value


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
    `devices`; the largest such dimension (of a convolution kernel, a channel one: see
    `splittable_axes`), the trailing one on a tie."""
    if devices < 2 or not is_float(dtype) or not shape:
        return None
    if math.prod(shape) * itemsize(dtype) < fsdp_min_bytes:
        return None
    axes = [i for i in splittable_axes(shape) if shape[i] >= devices and shape[i] % devices == 0]
    return max(axes, key=lambda i: (shape[i], i)) if axes else None


def splittable_axes(shape: Sequence[int]) -> range:
    """The axes the rule may split: every one, but of a kernel of 4 dimensions or more (a
    convolution's (window..., in, out)) only the channels, the last two. XLA's SPMD partitioner
    (jaxlib 0.10.2) computed twice the gradient of a keras-hub ViT's patch-embedding kernel
    (4, 4, 3, 32) when fsdp split its window (docs/reference/xla-conv-window-gradient.md)."""
    return range(len(shape) - 2, len(shape)) if len(shape) >= 4 else range(len(shape))


def model_axis(shape: Sequence[int], dtype: Any, model_devices: int) -> int | None:
    """The axis tensor parallelism splits a variable of `shape` along over `model_devices`, or
    None (whole on every device of the 'model' axis): floating point, 2 dimensions or more.

    3 dimensions (keras-hub's attention kernels: (heads, hidden, head_dim), (hidden, heads,
    head_dim), (heads, head_dim, hidden)): the heads, i.e. the first axis that is not the hidden
    one (the largest); whole when the heads do not divide (a single key/value head stays whole, as
    Megatron-LM keeps it). Otherwise the last two axes are (in, out): an up-projection (in < out)
    is split along out, a down-projection (in > out, an embedding table) along in, so that each
    up-projection's split output feeds its down-projection's split input; a square kernel along
    out; the other axis when the preferred one does not divide.
    """
    if model_devices < 2 or not is_float(dtype) or len(shape) < 2:
        return None
    def divides(axis):
        return shape[axis] >= model_devices and shape[axis] % model_devices == 0
    if len(shape) == 3:
        hidden = max(range(3), key=lambda i: (shape[i], -i))
        heads = next(i for i in range(3) if i != hidden)
        return heads if divides(heads) else None
    out, into = len(shape) - 1, len(shape) - 2
    order = (into, out) if shape[into] > shape[out] else (out, into)
    return next((axis for axis in order if divides(axis)), None)


def replicated_spec(shape: Sequence[int], dtype: Any, devices: int, fsdp_min_bytes: int,
                    axis_name: str = "batch", model_devices: int = 1) -> list[Any]:
    """data's rule: the per-axis partition spec of a variable whole on every device of
    `axis_name`, split over 'model' only (`model_axis`, with `model_devices` > 1)."""
    spec: list[Any] = [None] * len(shape)
    taken = model_axis(shape, dtype, model_devices)
    if taken is not None:
        spec[taken] = "model"
    return spec


def fsdp_spec(shape: Sequence[int], dtype: Any, devices: int, fsdp_min_bytes: int,
              axis_name: str = "batch", model_devices: int = 1) -> list[Any]:
    """fsdp's rule: the per-axis partition spec of a variable on a mesh of `devices` along
    `axis_name` and `model_devices` along 'model' (1: no model axis): the 'model' axis from
    `model_axis`, then the largest remaining dimension `devices` divides (see `shard_axis`), or
    both axes on one dimension (an entry (axis_name, 'model') or ('model', axis_name)) as the
    module docstring says."""
    spec = replicated_spec(shape, dtype, devices, fsdp_min_bytes, axis_name, model_devices)
    taken = spec.index("model") if "model" in spec else None
    if shard_axis(shape, dtype, devices, fsdp_min_bytes) is None:
        return spec  # small, integer or indivisible: whole on 'batch'
    everywhere = devices * model_devices

    def largest(axes):
        return max(axes, key=lambda i: (shape[i], i))

    # Large enough and some axis divides: the largest one not taken, over 'batch'; where 'model'
    # took none, over both axes if all the devices divide one (else 'batch' alone).
    allowed = splittable_axes(shape)
    both = [i for i in allowed if shape[i] % everywhere == 0] if model_devices > 1 else []
    if taken is None and both:
        spec[largest(both)] = (axis_name, "model")
        return spec
    axes = [i for i in allowed if i != taken and shape[i] >= devices and shape[i] % devices == 0]
    if axes:
        spec[largest(axes)] = axis_name
    elif taken is not None and taken in both:  # 'batch' divides no other: the 'model' dimension, over both
        spec[taken] = ("model", axis_name)
    return spec


def bytes_per_device(shape: Sequence[int], dtype: Any, spec: Sequence[Any],
                     devices: int | dict[str, int]) -> int:
    """Bytes one device holds of a variable laid out by `spec` (a mode's `partition`); `devices`:
    the mesh's axis sizes by name, or one count for every named axis (a 1-D mesh)."""
    count = math.prod(shape) * itemsize(dtype)
    for entry in spec:
        for name in (entry if isinstance(entry, (tuple, list)) else (entry,)):
            if name is not None:
                count //= devices if isinstance(devices, int) else devices.get(name, 1)
    return count


def axis_parts(entry: Any, axis_sizes: dict[str, int]) -> int:
    """How many parts a dimension is split into by its spec entry (None, an axis name, or a tuple
    of names), the mesh's axis sizes by name."""
    names = entry if isinstance(entry, (tuple, list)) else (entry,)
    return math.prod(axis_sizes.get(n, 1) for n in names if n is not None)


def divisible_spec(shape: Sequence[int], spec: Sequence[Any], axis_sizes: dict[str, int]) -> list:
    """`spec` with every dimension the named mesh axes do not divide made whole (None): a batch
    of 3 rows on 8 devices is then held whole on each, as `predict` holds one (see
    meshfit.fit.hooks), rather than failing with JAX's IndivisibleError."""
    kept = list(spec) + [None] * (len(shape) - len(spec))
    for i, entry in enumerate(kept[:len(shape)]):
        parts = axis_parts(entry, axis_sizes)
        if parts > 1 and shape[i] % parts:
            kept[i] = None
    return kept[:len(shape)]
