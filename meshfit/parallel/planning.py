"""Planning from the hardware, one function per question: the batch of a run (`plan_batch`, with
`plan_global_batch`, the one route to a global batch, and `plan_steps_per_dispatch`), the
precision (`resolve_precision`, decided once, by connect()) and peak FLOP/s. Pure functions of the devices' description: no Keras.

Peak figures are dense (no sparsity) FLOP/s per JAX device at the compute precision, from the
vendors' data sheets. On TPU v2/v3 a JAX device is one core (half a chip); from v4 on it is a chip.
For float32 on GPUs the peak is TF32's, which XLA uses for float32 matmuls by default; on TPUs
float32 matmuls run as one bfloat16 pass by default, so the bfloat16 peak applies.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from meshfit.errors import MeshfitError, troubleshooting

PRECISIONS = ("auto", "float32", "bfloat16", "float16")
DEFAULT_PRECISION = "auto"  # not given: the recipe's, else the hardware's (resolve_precision)
DEFAULT_PER_CORE_BATCH = 128  # the tutorials' per-core batch: one pass of a 128x128 matrix unit
AUTO_STEPS_PER_DISPATCH = 32  # on accelerators: at most this many train steps per dispatch
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}

# (substring of the lower-cased device kind, per-core batch multiple, {precision: peak FLOP/s}).
# The first matching row wins, so more specific names come first.
_HARDWARE = (
    ("tpu v2", 128, {"bfloat16": 22.5e12, "float32": 22.5e12}),
    ("tpu v3", 128, {"bfloat16": 61.5e12, "float32": 61.5e12}),
    ("tpu v4", 128, {"bfloat16": 275e12, "float32": 275e12}),
    ("tpu v5 lite", 128, {"bfloat16": 197e12, "float32": 197e12}),
    ("tpu v5e", 128, {"bfloat16": 197e12, "float32": 197e12}),
    ("tpu v5", 128, {"bfloat16": 459e12, "float32": 459e12}),
    ("tpu v6", 256, {"bfloat16": 918e12, "float32": 918e12}),
    ("h100 pcie", 8, {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("h100", 8, {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12}),
    ("h200", 8, {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12}),
    ("a100", 8, {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("v100", 8, {"float16": 125e12, "float32": 15.7e12}),
    ("t4", 8, {"float16": 65e12, "float32": 8.1e12}),
)


def _row(platform: str, device_kind: str):
    kind = device_kind.lower()
    for key, multiple, peaks in _HARDWARE:
        if key in kind:
            return multiple, peaks
    return {"tpu": 128, "gpu": 8}.get(platform, 1), {}


def batch_multiple(platform: str, device_kind: str) -> int:
    """Per-core batch multiple: 128 on TPU v2-v5 matrix units, 256 on v6e, 8 on GPUs, 1 on CPU."""
    return _row(platform, device_kind)[0]


def peak_flops(platform: str, device_kind: str, precision: str) -> float | None:
    """Peak FLOP/s of one device at `precision`, or None where it is not known (CPUs)."""
    if platform == "cpu":
        return None
    return _row(platform, device_kind)[1].get(precision)


def precision_name(requested: str | None) -> str:
    """`requested` checked and named canonically: 'auto', 'float32', 'bfloat16' or 'float16'
    (aliases such as 'bf16' and 'mixed_float16' accepted; None is 'auto'). The one check of a
    precision on every route."""
    if not requested:
        return DEFAULT_PRECISION
    name = _ALIASES.get(str(requested).lower(), str(requested).lower())
    if name not in PRECISIONS:
        raise MeshfitError(
            f"unknown precision {requested!r}; use one of: {', '.join(PRECISIONS)}"
        )
    return name


def resolve_precision(requested: str | None, platform: str, compute_capability: str | None = None,
                      recipe: str | None = DEFAULT_PRECISION) -> str:
    """The compute precision: 'float32', 'bfloat16' or 'float16'.

    'auto' (the one meaning on every route: train, bench, plan, connect) is the recipe's precision
    when it names one, else the hardware's: bfloat16 on TPUs and GPUs from compute capability 8,
    float16 on older GPUs, float32 on CPUs.
    """
    name = precision_name(requested)
    if name == "auto":
        name = precision_name(recipe)
    if name != "auto":
        return name
    if platform == "tpu":
        return "bfloat16"
    if platform == "gpu":
        major = int(str(compute_capability or "8.0").split(".")[0])
        return "bfloat16" if major >= 8 else "float16"
    return "float32"


def asked_precision(requested: str | None, recipe: str | None = DEFAULT_PRECISION) -> str:
    """What to ask connect() for: `requested`, or 'auto' for the recipe's when it names one (the
    hardware then decides only when neither does; see resolve_precision)."""
    name = precision_name(requested)
    return precision_name(recipe) if name == "auto" else name


def keras_policy(precision: str) -> str:
    """The Keras dtype policy: variables stay float32, compute in `precision`."""
    return {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}[precision]


def round_per_core(per_core: int, multiple: int) -> int:
    """`per_core` rounded to the nearest multiple of the hardware multiple (at least one)."""
    if per_core < 1:
        raise MeshfitError(f"batch size must be at least 1, got {per_core}")
    return max(multiple, multiple * round(per_core / multiple))


def split_global_batch(global_batch: int, replicas: int, rounding: bool = True) -> int:
    """The global batch, checked to split evenly across replicas (rounded up with a warning)."""
    if global_batch < 1:
        raise MeshfitError(f"batch size must be at least 1, got {global_batch}")
    if global_batch % replicas == 0:
        return global_batch
    lower = (global_batch // replicas) * replicas
    upper = math.ceil(global_batch / replicas) * replicas
    if not rounding:
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise MeshfitError(
            f"global batch {global_batch} does not split evenly across {replicas} replicas; "
            f"use a multiple of {replicas} ({hint}) or allow rounding", see="batch-does-not-split"
        )
    warnings.warn(f"global batch {global_batch} rounded up to {upper} to split across {replicas} "
                  f"replicas{troubleshooting('batch-does-not-split')}", stacklevel=2)
    return upper


def plan_global_batch(hardware, *, global_batch: int | None = None, recipe_batch: int | None = None,
                      per_core_batch: int | None = None, samples: int | None = None,
                      rounding: bool = True) -> int:
    """The global batch over all replicas of `hardware` (a Strategy: replicas, platform,
    device_kind): the one route to it, for train, plan, bench and Strategy.global_batch.

    `global_batch` (asked for), else the recipe's `recipe_batch`, split evenly across the
    replicas; else `per_core_batch` (default DEFAULT_PER_CORE_BATCH) rounded to the hardware
    multiple times the replicas, lowered to a quarter of the training `samples` at most when
    neither that nor a per-core batch was given (fit_batch_to_data). With rounding off, a batch
    that needs rounding is a MeshfitError.
    """
    replicas = hardware.replicas
    asked = global_batch or recipe_batch
    if asked:
        return split_global_batch(asked, replicas, rounding)
    per_core = per_core_batch or DEFAULT_PER_CORE_BATCH
    multiple = batch_multiple(hardware.platform, hardware.device_kind)
    rounded = round_per_core(per_core, multiple)
    if rounded != per_core:
        if not rounding:
            raise MeshfitError(f"per-core batch {per_core} is not a multiple of {multiple} on "
                               f"{hardware.device_kind}; use {rounded} or allow rounding")
        warnings.warn(f"per-core batch {per_core} rounded to {rounded}, a multiple of {multiple} "
                      f"on {hardware.device_kind}", stacklevel=2)
    if samples is not None and not per_core_batch:
        return fit_batch_to_data(rounded * replicas, samples, replicas)
    return rounded * replicas


def dividing_steps(steps_per_epoch: int, wanted: int) -> int:
    """The largest count of steps per dispatch <= `wanted` that divides `steps_per_epoch` (>= 1)."""
    check_steps_per_dispatch(wanted)
    return max(k for k in range(1, min(wanted, max(steps_per_epoch, 1)) + 1) if steps_per_epoch % k == 0)


def check_steps_per_dispatch(steps: int) -> None:
    """A MeshfitError unless `steps` (train steps per dispatch) is a whole number >= 1."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise MeshfitError(f"steps per dispatch must be a whole number of at least 1, got {steps!r}")


def plan_steps_per_dispatch(platform: str, engine: str, steps_per_epoch: int,
                            wanted: int | None = None) -> int:
    """Train steps per dispatch: `wanted`, or by default up to AUTO_STEPS_PER_DISPATCH on a GPU or
    TPU with JAX (2+ dispatches per epoch, so compilation is timed apart) and 1 otherwise; lowered
    to divide the epoch's steps so that no dispatch runs into the next epoch."""
    if wanted is None:
        if platform == "cpu" or engine != "jax":
            return 1
        # Two dispatches per epoch at least: the first holds the compilation, timed apart.
        wanted = min(AUTO_STEPS_PER_DISPATCH, max(steps_per_epoch // 2, 1))
    return dividing_steps(steps_per_epoch, wanted)


def check_micro_batches(micro_batches: int | str) -> int | str:
    """`micro_batches` (gradient slices per batch) checked: 'auto' or a whole number >= 1 (both
    engines slice: meshfit.fit.tf_microbatch, meshfit.fit.jax_microbatch)."""
    if micro_batches != "auto" and (not isinstance(micro_batches, int) or isinstance(micro_batches, bool)
                                    or micro_batches < 1):
        raise MeshfitError(f"micro-batches must be a whole number of at least 1 or 'auto', got "
                           f"{micro_batches!r}")
    return micro_batches


def fit_batch_to_data(global_batch: int, samples: int, replicas: int) -> int:
    """A planned global batch lowered to at most a quarter of the training `samples`, in whole
    samples per replica, so that a small folder still gets several steps per epoch."""
    if global_batch * 4 <= samples:
        return global_batch
    return max(samples // 4 // replicas, 1) * replicas


@dataclass(frozen=True)
class BatchPlan:
    """How a run's batches go on these devices: sizes in samples and steps."""

    global_batch: int  # samples per step over all replicas
    steps_per_epoch: int | None  # None: fewer training samples than one batch
    steps_per_dispatch: int  # train steps per call into the devices
    micro_batches: int | str  # gradient slices per batch, or 'auto' (cache-sized per model)


def plan_batch(hardware, *, samples: int | None = None, global_batch: int | None = None,
               recipe_batch: int | None = None, per_core_batch: int | None = None,
               recipe_steps: int | None = None, stream: tuple[int, int] | None = None,
               steps_per_dispatch: int | None = None, micro_batches: int | str | None = "auto",
               rounding: bool = True) -> BatchPlan:
    """The global batch, steps per epoch, steps per dispatch and micro-batches of a run on
    `hardware` (a Strategy: replicas, platform, device_kind, engine).

    global_batch: plan_global_batch's, from the one asked for, the recipe's `recipe_batch`,
    `per_core_batch` and the `samples`. Steps per epoch: the recipe's `recipe_steps`,
    at most one pass over `samples`. stream: (global batch, steps per epoch) that a streamed
    source sets instead. steps_per_dispatch: asked for (see the function of that name).
    micro_batches: a number is checked; 'auto' is decided per model
    (meshfit.fit.tf_microbatch.plan_micro_batches). The compute precision is not planned here:
    connect() resolves it once (resolve_precision).
    """
    replicas = hardware.replicas
    if stream is not None:
        planned, steps = stream
        if global_batch and global_batch != planned:
            raise MeshfitError(f"the recipe's train source yields batches of {planned} samples "
                               f"on {replicas} replica(s), not --global-batch {global_batch}; "
                               "batch the source itself")
    else:
        planned = plan_global_batch(hardware, global_batch=global_batch, recipe_batch=recipe_batch,
                                    per_core_batch=per_core_batch, samples=samples,
                                    rounding=rounding)
        full_steps = (samples or 0) // planned
        steps = min(recipe_steps or full_steps, full_steps) or None
    return BatchPlan(global_batch=planned, steps_per_epoch=steps,
                     steps_per_dispatch=plan_steps_per_dispatch(hardware.platform, hardware.engine,
                                                                steps or 1, steps_per_dispatch),
                     micro_batches=check_micro_batches(micro_batches or "auto"))
