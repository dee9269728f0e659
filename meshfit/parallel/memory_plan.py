"""The memory plan: bytes per device of a model's train step, replicated ("data") and sharded
("fsdp"), from XLA's memory analysis of the compiled step; which mode fits; the largest batch.

The model's own stateless `train_step` is lowered and compiled (never run) with abstract
`jax.ShapeDtypeStruct` arguments carrying each mode's shardings (the batch split over the devices,
every variable laid out by meshfit.parallel.sharding), so nothing is allocated for the mode not in use.
Per device: weights and optimizer state (the variables' shards), the step's temporary memory
(XLA's `temp_size_in_bytes`: activations, gradients, gathered weights) and the batch; total =
XLA's arguments + outputs not aliased to them (the state is donated) + temporaries.
JAX engine only; imports JAX and Keras inside the functions.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from meshfit.parallel import devices, sharding
from meshfit.errors import MeshfitError


@dataclass(frozen=True)
class ModePlan:
    """One mode's bytes per device (sizes in bytes)."""

    mode: str  # 'data' or 'fsdp'
    weights: int  # the model's variables (weights, batch-norm statistics)
    optimizer: int  # the optimizer's variables (Adam's moments, ...)
    step_temp: int  # XLA's temporary memory of the compiled step
    batch: int  # this device's rows of the batch (inputs and labels)
    total: int  # arguments + unaliased outputs + temporaries
    replicated: int  # state bytes each device holds whole (not sharded)
    state: int  # the whole state (weights + optimizer), unsharded
    fits: bool | None  # total <= device memory; None when that is unknown
    largest_per_core_batch: int | None = None  # that fits (a multiple of the hardware multiple)

    @property
    def replicated_share(self) -> float:
        """Share of the whole state that is replicated on every device (0..1)."""
        return self.replicated / self.state if self.state else 0.0


def step_arguments(model, batch_size: int, mesh=None, specs: dict | None = None,
                   one_hot: bool = False) -> tuple:
    """(state, data) of the model's stateless `train_step` as abstract arrays for a global batch.

    mesh: a jax Mesh to give them shardings on (the batch split along axis 'batch'; variable
    `v` laid out by `specs[id(v)]`, replicated when absent); None: no shardings.
    one_hot: labels shaped like the outputs (float), else sparse integer labels.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def placed(spec):
        return None if mesh is None else NamedSharding(mesh, PartitionSpec(*spec))

    def variable(v):
        spec = (specs or {}).get(id(v), [None] * len(v.shape))
        return jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=placed(spec))

    def batch(shape, dtype):
        shape = (batch_size,) + tuple(shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed(["batch"] + [None] * (len(shape) - 1)))

    state = tuple([variable(v) for v in group] for group in state_groups(model))
    x = [batch(t.shape, t.dtype) for t in model.inputs]
    y = [batch(o.shape, "float32") if one_hot else batch(tuple(o.shape[:-1]), "int32")
         for o in model.outputs]
    return state, (x[0] if len(x) == 1 else x, y[0] if len(y) == 1 else y)


def state_groups(model) -> tuple:
    """The train step's state: trainable, non-trainable, optimizer and metrics variables."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
            model.metrics_variables)


def _specs(model, mode: str, strategy) -> dict[int, list]:
    """Each variable's partition spec under `mode`: as laid out now when the model was built in
    that mode (a LayoutMap's entries included), else by meshfit.parallel.sharding's rule."""
    specs = {}
    devices = strategy.replicas
    for group in state_groups(model):
        for v in group:
            live = getattr(getattr(v.value, "sharding", None), "spec", None)
            if mode == strategy.sharding and live is not None:
                specs[id(v)] = list(live) + [None] * (len(v.shape) - len(live))
            else:
                specs[id(v)] = sharding.partition(tuple(v.shape), v.dtype, mode, devices,
                                                  strategy.fsdp_min_bytes)
    return specs


def _compiled_bytes(model, batch_size: int, mesh, specs) -> tuple[int, int]:
    """(total, temporaries) per device of the compiled step for a global batch."""
    import jax

    last_error = None
    for one_hot in (False, True):  # sparse labels first, as meshfit's recipes use
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # donation notes
                compiled = jax.jit(model.train_step, donate_argnums=0).lower(
                    *step_arguments(model, batch_size, mesh, specs, one_hot)).compile()
            stats = compiled.memory_analysis()
            break
        except Exception as error:  # a loss wanting the other label shape
            last_error = error
    else:
        raise MeshfitError(f"cannot plan the memory of this model's train step "
                           f"({str(last_error).splitlines()[0] if str(last_error) else type(last_error).__name__})")
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    return int(total), int(stats.temp_size_in_bytes)


def plan_mode(model, strategy, mode: str, global_batch: int, memory: int | None,
              largest: bool = False) -> ModePlan:
    """The plan of one mode for `model` (built and compiled) on `strategy`'s devices.

    largest: also find the largest per-core batch that fits (one more compile, at twice the
    batch; the step's memory is taken as linear in the batch).
    """
    devices = max(strategy.replicas, 1)
    mesh = strategy.distribution.device_mesh.backend_mesh if strategy.distribution else None
    specs = _specs(model, mode, strategy)
    groups = state_groups(model)

    def held(variables):
        return sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, specs[id(v)], devices)
                   for v in variables)

    weights = held(groups[0]) + held(groups[1])
    optimizer = held(groups[2])
    state_vars = [v for g in groups[:3] for v in g]
    whole = sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, [], 1) for v in state_vars)
    replicated = sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, [], 1)
                     for v in state_vars if not any(specs[id(v)]))
    total, temp = _compiled_bytes(model, global_batch, mesh, specs)
    per_core = global_batch // devices
    batch = _batch_bytes(model, per_core)
    best = None
    if largest and memory is not None:
        total2, _ = _compiled_bytes(model, 2 * global_batch, mesh, specs)
        slope = (total2 - total) / per_core  # bytes per sample per device
        if slope > 0:
            multiple = strategy.per_core_multiple
            best = int((memory - (total - slope * per_core)) // slope) // multiple * multiple
            best = best if best >= multiple else 0
    return ModePlan(mode, weights, optimizer, temp, batch, total, replicated, whole,
                    None if memory is None else total <= memory, best)


def _batch_bytes(model, rows: int) -> int:
    """Bytes of `rows` samples of the model's inputs (labels not counted)."""
    import math

    return sum(rows * math.prod(t.shape[1:]) * sharding.itemsize(t.dtype) for t in model.inputs)


def plan(model, strategy, global_batch: int, memory: int | None, largest: bool = False) -> dict[str, Any]:
    """Both modes' plans for `model` on `strategy`'s devices, and the mode `auto` picks.

    Returns {"device_memory", "global_batch", "devices", "modes": {mode: ModePlan as dict},
    "choice": 'data' or 'fsdp', "why": one line}.
    """
    modes = ("data", "fsdp") if strategy.distribution is not None else ("data",)
    plans = {mode: plan_mode(model, strategy, mode, global_batch, memory, largest) for mode in modes}
    choice, why = choose(plans, memory)
    return {"device_memory": memory, "global_batch": global_batch, "devices": strategy.replicas,
            "modes": {m: {**dataclasses.asdict(p), "replicated_share": p.replicated_share}
                      for m, p in plans.items()},
            "choice": choice, "why": why}


def choose(plans: dict[str, ModePlan], memory: int | None) -> tuple[str, str]:
    """The mode `auto` picks from the plans and why: data when it fits or memory is unknown."""
    data = plans["data"]
    fsdp = plans.get("fsdp")
    if memory is None:
        return "data", "device memory unknown (set --device-memory): data-parallel"
    if data.fits or fsdp is None:
        return "data", (f"the replicated step fits: {sharding.format_bytes(data.total)} of "
                        f"{sharding.format_bytes(memory)} per device")
    needs = (f"the replicated step needs {sharding.format_bytes(data.total)} per device, more than "
             f"{sharding.format_bytes(memory)}")
    if fsdp.fits:
        return "fsdp", f"{needs}; sharded: {sharding.format_bytes(fsdp.total)}"
    return "fsdp", f"{needs}, and sharded it needs {sharding.format_bytes(fsdp.total)}: neither fits"


def largest_global_batch(result: dict, mode: str) -> int | None:
    """The largest global batch whose step in `mode` fits (from `plan(..., largest=True)`): 0 when
    none does, None when unknown."""
    per_core = result["modes"].get(mode, {}).get("largest_per_core_batch")
    return None if per_core is None else per_core * result["devices"]


def check_fits(result: dict, mode: str) -> None:
    """A MeshfitError when `mode` ('data' or 'fsdp') does not fit the device memory of `result`
    (from `plan`), naming the bytes needed, the bytes there are and the fix."""
    memory = result["device_memory"]
    chosen = result["modes"].get(mode)
    if memory is None or chosen is None or chosen["fits"]:
        return
    need, have = sharding.format_bytes(chosen["total"]), sharding.format_bytes(memory)
    fsdp = result["modes"].get("fsdp")
    largest = largest_global_batch(result, mode)
    if mode == "data" and fsdp and fsdp["fits"]:
        fix = f"use --sharding fsdp (or auto), which needs {sharding.format_bytes(fsdp['total'])}"
    elif largest:
        fix = (f"use --batch-size {largest} or less (the largest global batch that fits, "
               f"{largest // result['devices']} per device), more devices or a smaller model")
    elif largest == 0:
        fix = "no batch fits: use more devices, or a smaller model"
    else:
        fix = "use a smaller --batch-size, more devices or a smaller model"
    if mode == "fsdp" and not result["modes"]["data"]["fits"]:
        fix = f"it does not fit replicated either ({sharding.format_bytes(result['modes']['data']['total'])}); {fix}"
    raise MeshfitError(f"out of device memory: the model's train step needs {need} per device with "
                       f"--sharding {mode} "
                       f"(weights {sharding.format_bytes(chosen['weights'])}, optimizer "
                       f"{sharding.format_bytes(chosen['optimizer'])}, step "
                       f"{sharding.format_bytes(chosen['step_temp'])}) but a device has {have} of memory; {fix}",
                       see="out-of-device-memory")


def summary_lines(result: dict, mode: str) -> list[str]:
    """The plan as text lines: per mode its bytes per device, then the mode used and why."""
    memory = result["device_memory"]
    lines = [f"memory per device (of {sharding.format_bytes(memory)}), global batch "
             f"{result['global_batch']} on {result['devices']} device(s):"]
    for name, p in result["modes"].items():
        fits = {True: "fits", False: "does not fit", None: "fit unknown"}[p["fits"]]
        lines.append(f"  {name:<5} weights {sharding.format_bytes(p['weights'])}  optimizer "
                     f"{sharding.format_bytes(p['optimizer'])}  step {sharding.format_bytes(p['step_temp'])}"
                     f"  total {sharding.format_bytes(p['total'])}  ({fits}; "
                     f"{p['replicated_share']:.1%} of the state replicated)")
        if p.get("largest_per_core_batch") is not None:
            lines[-1] += f"  largest per-core batch {p['largest_per_core_batch'] or 'none'}"
    lines.append(f"  using {mode}: {result['why'] if mode == result['choice'] else 'as asked'}")
    largest = largest_global_batch(result, mode)
    if result["modes"][mode]["fits"] is False and largest is not None:
        lines[-1] += (f"; the largest global batch that fits is {largest} (--batch-size {largest})"
                      if largest else "; no batch fits: use more devices or a smaller model")
    return lines


def replicated_warning(result: dict, mode: str) -> str | None:
    """A warning when fsdp leaves more than 2% of the state replicated, else None."""
    p = result["modes"].get(mode)
    if mode != "fsdp" or p is None or p["replicated_share"] <= sharding.REPLICATED_WARN_SHARE:
        return None
    return (f"fsdp leaves {p['replicated_share']:.1%} of the state "
            f"({sharding.format_bytes(p['replicated'])}) replicated on every device: variables "
            f"under --fsdp-min-size or with no dimension divisible by {result['devices']}")


def settle(strategy, make_model, global_batch: int, reset, verbose: bool = True):
    """The strategy to train with, and its plan (None where none was made).

    'auto' becomes fsdp when the device memory is known and the replicated step does not fit,
    else data; an asked mode that does not fit is a MeshfitError (see `check_fits`). The plan is
    made on a model built by `make_model()` under fsdp (which allocates the least), after
    `reset(strategy)` (a fresh seeded session); build the model again under the returned strategy.
    Without several JAX devices, or for data-parallel with unknown device memory, nothing is planned.
    """
    memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    if strategy.distribution is None or (strategy.sharding_asked != "fsdp" and memory is None):
        return strategy, None
    sharded = strategy.with_sharding("fsdp")
    reset(sharded)
    with sharded.scope():
        model = make_model()
    result = plan(model, sharded, global_batch, memory)
    mode = result["choice"] if strategy.sharding_asked == "auto" else strategy.sharding_asked
    if result["modes"][mode]["fits"] is False:  # the refusal names the largest batch that fits
        result = plan(model, sharded, global_batch, memory, largest=True)
    del model
    check_fits(result, mode)
    if verbose and strategy.info.process_index == 0:
        print("\n".join(summary_lines(result, mode)), flush=True)
    warning = replicated_warning(result, mode)
    if warning:
        warnings.warn(warning, stacklevel=2)
    return (strategy if mode == strategy.sharding else strategy.with_sharding(mode)), result
