"""The memory plan: bytes per device of a model's train step, replicated ("data") and sharded
("fsdp"), from XLA's memory analysis of the compiled step; which mode fits; the largest batch;
for 'auto' with no model_parallel given, the model parallelism K when neither mode fits.

The model's own stateless `train_step` is lowered and compiled (never run) with abstract
`jax.ShapeDtypeStruct` arguments carrying each mode's shardings (the batch split over the devices,
every variable laid out by meshfit.parallel.sharding), so nothing is allocated for the mode not in use.
Per device: weights and optimizer state (the variables' shards), the step's temporary memory
(XLA's `temp_size_in_bytes`: activations, gradients, gathered weights) and the batch; total =
XLA's arguments + outputs not aliased to them (the state is donated) + temporaries. With each
plan, XLA's cost analysis of the same compiled step (flops, bytes accessed) and the collectives
in its per-device program (their count and result bytes): shown, and the bytes the collectives
exchange choose between data and fsdp x model K where both fit (model_parallel_plans).
JAX engine only.

One function per question: `plan_memory` (both modes' bytes for a built model), `auto_sharding`
(what 'auto' picks from them), `model_parallel_plans` (data or fsdp x model K when neither fits) and
`choose_sharding` (the strategy a run trains with: 'auto' decided here, for `meshfit train`,
`meshfit bench` and `meshfit plan`; `plan_build` for `meshfit.plan`, `plan_at_first_fit` for a
plain `fit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshfit.errors import MeshfitError
from meshfit.fit import keras_internals, sources
from meshfit.fit.keras_internals import global_state  # Keras' list of variables awaiting values
from meshfit.parallel import devices, sharding
from meshfit.watch import report


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
    model_parallel: int = 1  # K: the mesh (devices/K) x K planned on
    flops: float | None = None  # per device and step, XLA's cost analysis of the compiled step
    bytes_accessed: float | None = None  # per device and step, same source (memory traffic)
    collectives: int | None = None  # collective operations in the compiled per-device step
    collective_bytes: int | None = None  # the sum of their results' bytes, per device and step

    @property
    def replicated_share(self) -> float:
        """Share of the whole state that is replicated on every device (0..1)."""
        return self.replicated / self.state if self.state else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The plan as plan_memory's result holds it: its fields and replicated_share."""
        return {**dataclasses.asdict(self), "replicated_share": self.replicated_share}


def step_arguments(model, global_batch: int, mesh=None, specs: dict | None = None,
                   one_hot: bool = False, data=None, input_shapes=None) -> tuple:
    """(state, data) of the model's stateless `train_step` as abstract arrays for a global batch.

    mesh: a jax Mesh to give them shardings on (the batch split along axis 'batch'; variable
    `v` laid out by `specs[id(v)]`, replicated when absent); None: no shardings.
    data: the batch as fit reads it ((x, y) or (x, y, sample_weight): any structure of arrays or
    jax.ShapeDtypeStruct, whose first dimension is replaced by global_batch); None: made from the
    model's inputs and outputs, their unknown dimensions taken from `input_shapes`
    (see `input_structs`), with labels of the outputs' shape (one_hot: float, like the outputs;
    else sparse integer labels without the last axis).
    """
    def placed(spec):
        return None if mesh is None else NamedSharding(mesh, PartitionSpec(*spec))

    def variable(v):
        spec = (specs or {}).get(id(v), [None] * len(v.shape))
        return jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=placed(spec))

    def batch(shape, dtype):
        shape = (global_batch,) + tuple(shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed(["batch"] + [None] * (len(shape) - 1)))

    state = tuple([variable(v) for v in group] for group in state_groups(model))
    if data is not None:
        return state, jax.tree.map(lambda a: batch(a.shape, a.dtype), data)
    x = input_structs(model, input_shapes)
    known = next(iter(jax.tree.leaves(x)), None)
    def label(o):  # unknown output dimensions (a sequence) as the first input's
        shape = [d if d is not None else (known.shape[i] if known is not None and i < len(known.shape)
                                          else None) for i, d in enumerate(o.shape)]
        if any(d is None for d in shape[1:]):
            raise MeshfitError(f"cannot plan for an output of shape {tuple(o.shape)}: give its "
                               "unknown dimensions in input_shapes (e.g. input_shapes={'token_ids': (1024,)})")
        return batch(shape, "float32") if one_hot else batch(shape[:-1], "int32")
    x = jax.tree.map(lambda a: batch(a.shape, a.dtype), x)
    y = [label(o) for o in model.outputs]
    return state, (x, y[0] if len(y) == 1 else y)


def input_structs(model, input_shapes=None):
    """The model's inputs as jax.ShapeDtypeStruct (batch dimension 1, replaced later), in the
    structure the model takes them (a dict by name for keras-hub models). input_shapes: each
    input's shape without the batch dimension, for the dimensions `keras.Input` leaves unknown
    (None, e.g. a sequence length): a dict by input name, a list in the inputs' order, or one
    shape for every input. A MeshfitError names an input whose shape is still unknown."""
    inputs = model.inputs
    names = [t.name for t in inputs]
    structure = getattr(model, "_inputs_struct", None)
    if isinstance(input_shapes, dict):
        given = [input_shapes.get(name) for name in names]
    elif input_shapes is not None and all(isinstance(d, int) for d in input_shapes):
        given = [input_shapes] * len(inputs)
    else:
        given = list(input_shapes) if input_shapes is not None else [None] * len(inputs)
    structs = {}
    for t, name, shape in zip(inputs, names, given):
        shape = tuple(t.shape[1:]) if shape is None else tuple(shape)
        if any(d is None for d in shape):
            raise MeshfitError(f"cannot plan for input {name!r} of shape {tuple(t.shape)}: give its "
                               f"unknown dimensions, e.g. input_shapes={{{name!r}: (1024,)}} (without "
                               "the batch)")
        structs[id(t)] = jax.ShapeDtypeStruct((1,) + shape, t.dtype)
    if structure is not None:
        return keras.tree.map_structure(lambda t: structs[id(t)], structure)
    leaves = [structs[id(t)] for t in inputs]
    return leaves[0] if len(leaves) == 1 else leaves


def state_groups(model) -> tuple:
    """The train step's state: trainable, non-trainable, optimizer and metrics variables."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
            model.metrics_variables)


def _specs(model, mode: str, strategy) -> dict[int, list]:
    """Each variable's partition spec under `mode`: meshfit.parallel.sharding's rule, except
    where it is laid out otherwise (a LayoutMap's entry, or an optimizer slot of one), which
    keeps its layout, as Strategy.relayout keeps it. A variable laid out on a mesh of another
    shape than this strategy's (a plain fit's model planned for another K) takes the user's
    layout_map entry there, else the rule."""
    specs = {}
    distribution = strategy.distribution
    for group in state_groups(model):
        for v in group:
            shape = tuple(v.shape)
            if distribution is None:
                specs[id(v)] = [None] * len(shape)
                continue
            layout = getattr(v, "_layout", None)
            mesh = getattr(layout, "device_mesh", None)
            if layout is None or (mesh is not None and tuple(mesh.shape) != tuple(distribution.device_mesh.shape)):
                entry = distribution._layout_map[v.path]
                specs[id(v)] = (list(entry.axes) if entry is not None
                                else distribution.spec(shape, v.dtype, mode))
                continue
            # The layout, not the value's sharding: an abstract model's (plan_build) variables
            # have no value, and reading .value would make one.
            specs[id(v)] = distribution.axes_under(shape, v.dtype, getattr(layout, "axes", None) or [], mode)
    return specs


def axis_sizes(strategy) -> dict[str, int]:
    """The mesh's axis sizes by name ({'batch': 1} without a distribution)."""
    return strategy.distribution.axis_sizes if strategy.distribution is not None else {"batch": 1}


# The collectives of a compiled (per-device) HLO program and their result type: `%name = TYPE
# all-reduce(`; an asynchronous one is counted at its -done, whose type is its result alone.
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(-done)?\(", re.MULTILINE)
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)[a-z\d]*)\[([\d,]*)\]")  # f32[64,128], bf16[8], pred[4]


def step_cost(compiled) -> dict[str, Any]:
    """XLA's cost estimate of a compiled step per device: flops and bytes accessed (its cost
    analysis; None where the backend gives none), and the collectives in its program: how many,
    and the bytes of their results (what the devices exchange, as XLA compiled it)."""
    try:
        cost = compiled.cost_analysis()
        cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    except Exception:  # a backend without a cost model
        cost = {}
    count, moved = 0, 0
    try:
        text = compiled.as_text()
    except Exception:
        text = ""
    for result, _, _ in _COLLECTIVE.findall(text):
        count += 1
        for dtype, bits, dims in _ARRAY.findall(result):
            size = 1 if dtype == "pred" else max(int(bits) // 8, 1)
            moved += math.prod(int(d) for d in dims.split(",") if d) * size
    flops, accessed = cost.get("flops"), cost.get("bytes accessed")
    return {"flops": None if flops is None else float(flops),
            "bytes_accessed": None if accessed is None else float(accessed),
            "collectives": count if text else None, "collective_bytes": moved if text else None}


def _compiled_bytes(model, global_batch: int, mesh, specs, data=None,
                    input_shapes=None) -> tuple[int, int, dict]:
    """(total, temporaries, step_cost) per device of the compiled step for a global batch."""
    last_error = None
    for one_hot in (False, True) if data is None else (False,):  # sparse labels first, as meshfit's recipes use
        arguments = step_arguments(model, global_batch, mesh, specs, one_hot, data, input_shapes)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # donation notes
                compiled = report.lower_train_step(model, *arguments, donate_argnums=0).compile()
            stats = compiled.memory_analysis()
            break
        except Exception as error:  # a loss wanting the other label shape
            last_error = error
    else:
        raise MeshfitError(f"cannot plan the memory of this model's train step "
                           f"({str(last_error).splitlines()[0] if str(last_error) else type(last_error).__name__})")
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    return int(total), int(stats.temp_size_in_bytes), step_cost(compiled)


def plan_mode(model, strategy, mode: str, global_batch: int, device_memory: int | None,
              largest: bool = False, data=None, input_shapes=None) -> ModePlan:
    """The plan of one mode for `model` (built and compiled) on `strategy`'s devices.

    largest: also find the largest per-core batch that fits (one more compile, at twice the
    batch; the step's memory is taken as linear in the batch). data, input_shapes: the batch to
    plan for (see `step_arguments`).
    """
    devices = max(strategy.replicas, 1)
    mesh = strategy.distribution.device_mesh.backend_mesh if strategy.distribution else None
    specs = _specs(model, mode, strategy)
    sizes = axis_sizes(strategy)
    groups = state_groups(model)

    def held(variables):
        return sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, specs[id(v)], sizes)
                   for v in variables)

    weights = held(groups[0]) + held(groups[1])
    optimizer = held(groups[2])
    state_vars = [v for g in groups[:3] for v in g]
    whole = sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, [], 1) for v in state_vars)
    replicated = sum(sharding.bytes_per_device(tuple(v.shape), v.dtype, [], 1)
                     for v in state_vars if not any(specs[id(v)]))
    total, temp, cost = _compiled_bytes(model, global_batch, mesh, specs, data, input_shapes)
    per_core = global_batch // devices
    batch = _batch_bytes(model, per_core, data, input_shapes)
    best = None
    if largest and device_memory is not None:
        total2, _, _ = _compiled_bytes(model, 2 * global_batch, mesh, specs, data, input_shapes)
        slope = (total2 - total) / per_core  # bytes per sample per device
        if slope > 0:
            multiple = strategy.per_core_multiple
            best = int((device_memory - (total - slope * per_core)) // slope) // multiple * multiple
            best = best if best >= multiple else 0
    return ModePlan(mode, weights, optimizer, temp, batch, total, replicated, whole,
                    None if device_memory is None else total <= device_memory, best,
                    strategy.model_parallel, **cost)


def _batch_bytes(model, rows: int, data=None, input_shapes=None) -> int:
    """Bytes of `rows` samples of the model's inputs (labels not counted)."""
    x = data[0] if data is not None else input_structs(model, input_shapes)
    return sum(rows * math.prod(t.shape[1:]) * sharding.itemsize(t.dtype) for t in jax.tree.leaves(x))


def plan_memory(model, strategy, global_batch: int, device_memory: int | None,
                largest: bool = False, *, data=None, input_shapes=None) -> dict[str, Any]:
    """Both modes' plans for `model` on `strategy`'s devices, and the mode `auto` picks.

    data: a batch as fit reads it ((x, y) or (x, y, sample_weight), arrays or
    jax.ShapeDtypeStruct) to plan with; input_shapes: else the inputs' shapes without the batch,
    for dimensions `keras.Input` leaves unknown, e.g. {'token_ids': (1024,)} (see input_structs).
    Returns {"device_memory", "global_batch", "devices", "modes": {mode: ModePlan as dict},
    "choice": 'data' or 'fsdp', "why": one line}.
    """
    modes = ("data", "fsdp") if strategy.distribution is not None else ("data",)
    plans = {mode: plan_mode(model, strategy, mode, global_batch, device_memory, largest, data,
                             input_shapes)
             for mode in modes}
    choice, why = auto_sharding(plans, device_memory)
    return {"device_memory": device_memory, "global_batch": global_batch, "devices": strategy.replicas,
            "model_parallel": strategy.model_parallel,
            "modes": {m: p.as_dict() for m, p in plans.items()},
            "choice": choice, "why": why}


def auto_sharding(plans: dict[str, ModePlan], device_memory: int | None) -> tuple[str, str]:
    """The mode `auto` picks from the plans and why: data when it fits or memory is unknown."""
    data = plans["data"]
    fsdp = plans.get("fsdp")
    if device_memory is None:
        return "data", "device memory unknown (set --device-memory): data-parallel"
    if data.fits or fsdp is None:
        return "data", (f"the replicated step fits: {sharding.format_bytes(data.total)} of "
                        f"{sharding.format_bytes(device_memory)} per device")
    needs = (f"the replicated step needs {sharding.format_bytes(data.total)} per device, more than "
             f"{sharding.format_bytes(device_memory)}")
    if fsdp.fits:
        return "fsdp", f"{needs}; sharded: {sharding.format_bytes(fsdp.total)}"
    return "fsdp", f"{needs}, and sharded it needs {sharding.format_bytes(fsdp.total)}: neither fits"


def model_parallel_candidates(strategy) -> list[int]:
    """The model parallelism 'auto' may try: the divisors K > 1 of the device count, smallest first."""
    count = len(strategy.info.devices)
    return [k for k in range(2, count + 1) if count % k == 0]


def weighs_model_parallel(strategy, result: dict) -> bool:
    """True where 'auto' chooses K after `result` (plan_memory's, K = 1): sharding 'auto',
    model_parallel not given, several devices on JAX, a known device memory, and neither data
    nor fsdp fits it."""
    return (strategy.sharding_asked == "auto" and strategy.model_parallel_asked is None
            and strategy.distribution is not None and result["device_memory"] is not None
            and all(p["fits"] is False for p in result["modes"].values()))


def model_parallel_plans(strategy, plan_on: Callable[[Any, str], ModePlan], result: dict) -> dict:
    """'auto' choosing the model parallelism K where neither data nor fsdp fits (`result` from
    plan_memory, made with K = 1; see weighs_model_parallel): data x model K and fsdp x model K
    are planned, by `plan_on(candidate, mode)` inside `candidate.scope()` (the ModePlan of the
    model on `candidate`, the strategy in `mode` on the mesh (devices/K) x K), for the divisors
    K > 1 of the devices, smallest first, up to the first K where one fits; where both fit, the
    one whose step exchanges fewer bytes in its collectives (XLA's compiled program), data x
    model on a tie. `result` gets "model_parallel_plans" ({'data x model K': the plan as a dict,
    ...} for each one tried) and, where one fits, "model_parallel" K, "choice" (its mode) and
    "why"; else "why" says that none does. Returns it.

    The smallest K that fits, not the fastest or the largest: splitting a block's kernels over
    'model' puts collectives inside every block (a reduction after each attention and MLP
    block, forward and backward, as Megatron-LM pairs them), on the critical path of every step,
    and leaves fewer model replicas (N/K) to split the batch; fsdp's gathers of whole weights
    do not grow with K. At one K the two layouts differ only on 'batch': data x model holds its
    share of every weight whole there and all-reduces the gradients, fsdp x model gathers each
    weight where it is used and reduce-scatters the gradients, which XLA's count of the bytes
    exchanged weighs. Its flops and bytes accessed are shown, not used: they count operations
    and bytes, not the time a link takes (ICI, NVLink, a network), nor what overlaps with compute.
    """
    memory = result["device_memory"]
    data, fsdp = result["modes"]["data"], result["modes"].get("fsdp")
    tried = result.setdefault("model_parallel_plans", {})
    for k in model_parallel_candidates(strategy):
        plans = {}
        for mode in ("data", "fsdp"):
            candidate, name = strategy.with_sharding(mode, k), f"{mode} x model {k}"
            with candidate.scope():
                plans[name] = plan_on(candidate, mode)
            tried[name] = plans[name].as_dict()
        fitting = [name for name, plan in plans.items() if plan.fits]
        if not fitting:
            continue
        exchanged = {name: plans[name].collective_bytes for name in fitting}
        name = min(fitting, key=lambda n: (exchanged[n] is None, exchanged[n] or 0, not n.startswith("data")))
        why = (f"model parallel {k}: fsdp needs {sharding.format_bytes(fsdp['total'])} per device "
               f"(data {sharding.format_bytes(data['total'])}), more than "
               f"{sharding.format_bytes(memory)}; {name} needs {sharding.format_bytes(plans[name].total)} "
               f"({cost_text(tried[name])})")
        other = next(n for n in plans if n != name)
        if other in fitting:
            why += (f", {other} {sharding.format_bytes(plans[other].total)} (its collectives "
                    f"exchange {sharding.format_bytes(exchanged[other])})")
        else:
            why += f"; {other} needs {sharding.format_bytes(plans[other].total)}"
        result.update(model_parallel=k, choice=plans[name].mode, why=why)
        return result
    if tried:
        least = min(tried, key=lambda n: tried[n]["total"])
        ks = ", ".join(str(k) for k in model_parallel_candidates(strategy))
        result["why"] += (f"; nor data or fsdp x model {ks} (the least "
                          f"{sharding.format_bytes(tried[least]['total'])}, {least})")
    return result


def cost_text(plan: dict) -> str:
    """A plan's step cost per device as text: XLA's flops and bytes accessed, the collectives."""
    parts = []
    if plan.get("flops") is not None:
        parts.append(f"each step {plan['flops']:.3g} flops")
    if plan.get("bytes_accessed") is not None:
        parts.append(f"{sharding.format_bytes(plan['bytes_accessed'])} accessed")
    if plan.get("collectives") is not None:
        parts.append(f"{plan['collectives']} collective{'' if plan['collectives'] == 1 else 's'} of "
                     f"{sharding.format_bytes(plan['collective_bytes'])}")
    return ", ".join(parts) or "no cost analysis"


def plan_used(result: dict, mode: str) -> dict:
    """The plan (a dict) of what a run trains with: `mode` on the planned mesh, or `mode` x model K
    where 'auto' chose K (model_parallel_plans)."""
    chosen = result.get("model_parallel_plans", {}).get(
        f"{result['choice']} x model {result.get('model_parallel')}")
    return chosen if chosen is not None and mode == result["choice"] else result["modes"][mode]


def largest_global_batch(result: dict, mode: str) -> int | None:
    """The largest global batch whose step in `mode` fits (from `plan_memory(..., largest=True)`): 0 when
    none does, None when unknown."""
    per_core = result["modes"].get(mode, {}).get("largest_per_core_batch")
    return None if per_core is None else per_core * result["devices"]


def sharding_to_use(result: dict, asked: str) -> str:
    """The mode a run trains with: `asked` ('data' or 'fsdp'), or for 'auto' the plan's choice."""
    return result["choice"] if asked == "auto" else asked


def check_fits(result: dict, mode: str) -> None:
    """A MeshfitError when `mode` ('data' or 'fsdp') does not fit the device memory of `result`
    (from `plan_memory`), naming the bytes needed, the bytes there are and the fix."""
    memory = result["device_memory"]
    chosen = plan_used(result, mode) if mode in result["modes"] else None
    if memory is None or chosen is None or chosen["fits"]:
        return
    need, have = sharding.format_bytes(chosen["total"]), sharding.format_bytes(memory)
    fsdp = result["modes"].get("fsdp")
    largest = largest_global_batch(result, mode)
    if mode == "data" and fsdp and fsdp["fits"]:
        fix = f"use --sharding fsdp (or auto), which needs {sharding.format_bytes(fsdp['total'])}"
    elif largest:
        fix = (f"use --global-batch {largest} or less (the largest global batch that fits, "
               f"{largest // result['devices']} per device), more devices or a smaller model")
    elif largest == 0:
        fix = "no batch fits: use more devices, or a smaller model"
    else:
        fix = "use a smaller --global-batch, more devices or a smaller model"
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
    k = next(iter(result["modes"].values())).get("model_parallel", 1)  # the mesh the modes were planned on
    on = f"{result['devices']} device(s)" if k == 1 else f"{result['devices']} x {k} devices (batch x model)"
    lines = [f"memory per device (of {sharding.format_bytes(memory)}), global batch "
             f"{result['global_batch']} on {on}:"]
    rows = list(result["modes"].items()) + list(result.get("model_parallel_plans", {}).items())
    width = max(len(name) for name, _ in rows)
    for name, p in rows:
        fits = {True: "fits", False: "does not fit", None: "fit unknown"}[p["fits"]]
        lines.append(f"  {name:<{width}} weights {sharding.format_bytes(p['weights'])}  optimizer "
                     f"{sharding.format_bytes(p['optimizer'])}  step {sharding.format_bytes(p['step_temp'])}"
                     f"  total {sharding.format_bytes(p['total'])}  ({fits}; "
                     f"{p['replicated_share']:.1%} of the state replicated)")
        if p.get("largest_per_core_batch") is not None:
            lines[-1] += f"  largest per-core batch {p['largest_per_core_batch'] or 'none'}"
        if result.get("model_parallel_plans"):  # where model parallelism was weighed: the step's cost
            lines[-1] += f"  [{cost_text(p)}]"
    used = mode if result.get("model_parallel", k) == k else f"{mode} x model {result['model_parallel']}"
    fits = plan_used(result, mode)["fits"] is not False
    if mode != result["choice"]:
        lines.append(f"  using {used}: as asked" if fits else f"  {used} (as asked) does not fit")
    else:  # auto's choice: where nothing fits, no mode is claimed (a run would refuse: check_fits)
        lines.append(f"  {'using ' + used if fits else 'nothing fits'}: {result['why']}")
    largest = largest_global_batch(result, mode)
    if not fits and largest is not None:
        lines[-1] += (f"; the largest global batch that fits is {largest} (--global-batch {largest})"
                      if largest else "; no batch fits: use more devices or a smaller model")
    return lines


def replicated_warning(result: dict, mode: str) -> str | None:
    """A warning when fsdp leaves more than 2% of the state replicated, else None."""
    p = plan_used(result, mode) if mode in result["modes"] else None
    if mode != "fsdp" or p is None or p["replicated_share"] <= sharding.REPLICATED_WARN_SHARE:
        return None
    return (f"fsdp leaves {p['replicated_share']:.1%} of the state "
            f"({sharding.format_bytes(p['replicated'])}) replicated on every device: variables "
            f"under --fsdp-min-bytes or with no dimension divisible by {result['devices']}")


def choose_sharding(strategy, make_model: Callable[[], Any], global_batch: int,
                    fresh_session: Callable[[Any], None], verbose: bool = True,
                    largest: bool = False, always: bool = False):
    """The strategy to train with, and its memory plan (None where none was made): the one place
    where 'auto' is decided.

    'auto' becomes fsdp when the device memory is known and the replicated step does not fit,
    else data; when neither fits and model_parallel was not given, data or fsdp x model K for the
    smallest K that fits (model_parallel_plans), on a mesh (devices/K) x K. An asked mode that
    does not fit is a MeshfitError (see `check_fits`). The plan is made on a model built by
    `make_model()` under fsdp (which allocates the least), after `fresh_session(strategy)`;
    build the model again under the returned strategy. Without several JAX devices, or for
    data-parallel with unknown device memory, nothing is planned unless `always` (then the plan
    is shown, not enforced: `meshfit plan`). largest: see plan_mode.
    """
    device_memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    skip = strategy.distribution is None or (strategy.sharding_asked != "fsdp" and device_memory is None)
    if skip and not always:
        return strategy, None

    def built(on):
        # Under fsdp, and with abstract variables (no values: see abstract_model) where the model
        # builds so; else built for real under fsdp, the layout that allocates the least.
        fresh_session(on)
        model = abstract_model(on, make_model, fallback=True)
        if model is None:
            with on.scope():
                model = make_model()
        return model

    planned = strategy.with_sharding("fsdp") if strategy.distribution is not None else strategy
    model = built(planned)
    result = plan_memory(model, planned, global_batch, device_memory, largest)
    if weighs_model_parallel(strategy, result):
        model = None  # each candidate builds its own, on its mesh
        model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            built(candidate), candidate, mode, global_batch, device_memory), result)
    mode = sharding_to_use(result, strategy.sharding_asked)
    if plan_used(result, mode)["fits"] is False and not largest:
        # the refusal names the batch that fits (on the mesh planned first)
        model = model if model is not None else built(planned)
        result = {**plan_memory(model, planned, global_batch, device_memory, largest=True),
                  **{key: result[key] for key in ("why", "model_parallel_plans") if key in result}}
    del model  # its variables would hold device memory while the run builds its own
    result["sharding"] = mode
    chosen_k = result["model_parallel"]
    if always:
        return strategy, result
    check_fits(result, mode)
    if verbose and strategy.info.process_index == 0:
        print("\n".join(summary_lines(result, mode)), flush=True)
    warning = replicated_warning(result, mode)
    if warning:
        warnings.warn(warning, stacklevel=2)
    if (mode, chosen_k) == (strategy.sharding, strategy.model_parallel):
        strategy.distribution.spill_after = None  # decided: the run's variables follow `mode` alone
        return strategy, result
    return strategy.with_sharding(mode, chosen_k), result


def first_fit_batch(arguments: dict[str, Any]) -> tuple[Any, int] | None:
    """(the batch fit will read, as jax.ShapeDtypeStruct (x, y[, sample_weight]); the global
    batch) from `model.fit`'s arguments, or None where that cannot be known without using up the
    source: arrays (numpy, JAX, dicts and lists of them) say their shapes; a source that can be
    read again (a tf.data.Dataset, a grain dataset as keras-hub's fit makes, a PyDataset) gives
    its first batch to a fresh iterator; a generator or other iterator, read only once, does not."""
    x, y, weights = arguments.get("x"), arguments.get("y"), arguments.get("sample_weight")

    def struct(a):
        return jax.ShapeDtypeStruct(tuple(a.shape), np.dtype(getattr(a.dtype, "as_numpy_dtype", a.dtype)))

    if x is None:
        return None
    if sources.is_arrays(x, y, weights):
        data = jax.tree.map(struct, tuple(a for a in (x, y, weights) if a is not None))
        rows = jax.tree.leaves(data)[0].shape[0]
        return data, min(arguments.get("batch_size") or sources.KERAS_BATCH, rows)
    if sources.is_one_shot(x):
        return None
    try:
        first = x[0] if isinstance(x, keras.utils.PyDataset) else next(iter(x))
    except (TypeError, StopIteration, IndexError):
        return None
    data = jax.tree.map(struct, tuple(first) if isinstance(first, (tuple, list)) else (first,))
    return data, jax.tree.leaves(data)[0].shape[0]


def plan_at_first_fit(strategy, model, arguments: dict[str, Any]) -> dict | None:
    """'auto' in Python: at a model's first `fit` under an active strategy asked for 'auto' with
    several devices and a known device memory, plan its train step with fit's real batch shapes
    (so variable-length inputs plan) and lay the model's variables out as chosen before the
    first step (Strategy.relayout): fsdp, printing the plan, when the replicated step does not
    fit, else data (those built sharded past MeshParallel.spill_after gathered). When
    neither fits and model_parallel was not given to connect(), data and fsdp x model K are planned
    (model_parallel_plans): where some K fits, a MeshfitError names the model_parallel=K to
    connect with (the model's mesh is not changed under it); where none does, one warning says
    by how much. When the replicated step fits, nothing is printed and only that step was
    compiled (once more). A source whose shapes are unknown before it is
    read gets one line saying how to choose. Returns the plan when one was printed, else None."""
    device_memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    if (strategy.sharding_asked != "auto" or strategy.distribution is None or device_memory is None
            or getattr(model, "_meshfit_planned", False) or model.optimizer is None):
        return None
    model._meshfit_planned = True  # once per model: later fits keep the layout chosen
    chief = strategy.info.process_index == 0
    if strategy.hosts > 1:  # each process reads its own rows: they could decide differently
        if chief:
            print("meshfit: sharding auto on several hosts is planned by meshfit train (before the "
                  "model is built); in Python pass sharding='fsdp' or 'data' to connect()", flush=True)
        return None
    found = first_fit_batch(arguments)
    if found is None:
        if chief:
            print(f"meshfit: sharding auto: a {type(arguments.get('x')).__name__} does not say its "
                  f"batch shapes before it is read, so this model trains as built, unplanned; "
                  "pass sharding='fsdp' to connect() to shard it, or arrays or a tf.data.Dataset",
                  flush=True)
        return None
    data, global_batch = found
    if plan_mode(model, strategy, "data", global_batch, device_memory, data=data).fits:
        # The replicated step fits: nothing more is compiled, and only variables built sharded
        # (past MeshParallel.spill_after, e.g. a frozen backbone for LoRA) are gathered.
        strategy.relayout(model, "data")
        return None
    result = plan_memory(model, strategy, global_batch, device_memory, data=data)
    if weighs_model_parallel(strategy, result):  # this model's variables as built on each candidate's mesh
        model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            model, candidate, mode, global_batch, device_memory, data=data), result)
    k = result["model_parallel"]
    if k != strategy.model_parallel:
        # The mesh is the one the model was built on (its variables, and Keras' data placement,
        # belong to it): rather than move every variable to another mesh under a built model,
        # the user is told which model_parallel to connect with; nothing has trained.
        model._meshfit_planned = False  # a next fit plans (and refuses) again
        if chief:
            print("\n".join(summary_lines(result, result["choice"])), flush=True)
        raise MeshfitError(f"sharding auto: {result['why']}; pass model_parallel={k} to "
                           f"meshfit.connect() (with sharding='{result['choice']}', as planned) "
                           "and build the model after it")
    mode = result["choice"]
    strategy.relayout(model, mode)
    result["sharding"] = mode
    if chief:
        print("\n".join(summary_lines(result, mode)), flush=True)
    if result["modes"][mode]["fits"] is False:
        warnings.warn(f"sharding auto: {result['why']}; training {mode} anyway, expect the device "
                      "to run out of memory "
                      "(use a smaller batch, more devices or model_parallel)", stacklevel=3)
    return result


@contextlib.contextmanager
def _abstract_variables():
    """Variables created inside get a shape, dtype and layout but no value: Keras'
    StatelessScope, left without initializing them. Keras' optimizer makes its step counter and
    learning rate from values (scalars), which that scope refuses, so an optimizer's __init__
    runs outside it (keras_internals)."""
    with (keras_internals.optimizers_made_outside_stateless_scope(),
          keras.StatelessScope(initialize_variables=False)):  # leaving it gives no values
        yield


def abstract_model(strategy, make_model: Callable[[], Any], fallback: bool = False):
    """The compiled model `make_model()` returns, built in `strategy`'s scope with variables that
    have a shape, dtype and layout but no value (its optimizer's too), so nothing of it is
    allocated. fallback: return None, rather than raise, for a model that cannot be built so (one
    that computes with its weights while being built)."""
    waiting = list(global_state.get_global_attribute("uninitialized_variables", []) or [])
    try:
        with strategy.scope(), _abstract_variables():
            model = make_model()
            if getattr(model, "optimizer", None) is None:
                raise MeshfitError("planning needs the model compiled (model.compile(optimizer=..., "
                                   "loss=...) where it is built)")
            state_groups(model)  # the optimizer's variables, abstract too
        return model
    except Exception:
        if fallback:
            return None
        raise
    finally:
        # Forget this model's variables before compiling: Keras initializes every variable on
        # its list when the train step's own StatelessScope ends (here with tracers, leaked).
        global_state.set_global_attribute("uninitialized_variables", waiting)


def plan_build(strategy, build: Callable[[], Any], global_batch: int, input_shapes=None,
               verbose: bool = True) -> dict[str, Any]:
    """`meshfit.plan`: the memory plan of the model `build()` returns (compiled, with its
    optimizer), for `global_batch` on `strategy`'s devices and device memory, without allocating
    its weights: the model is built in a Keras `StatelessScope`, where variables get a shape, a
    dtype and a layout but no value, and its train step is compiled (never run) on abstract
    arrays. So a 7-billion-parameter configuration plans on a laptop. input_shapes: the inputs'
    shapes without the batch where `keras.Input` leaves them unknown (see input_structs).
    With sharding 'auto', model_parallel not given to connect() and neither mode fitting,
    data and fsdp x model K are planned too (model_parallel_plans): "model_parallel" is then the K to
    pass to connect() (printed as such).
    Returns plan_memory's dict; printed (summary_lines) when `verbose`."""
    device_memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    model = abstract_model(strategy, build)
    result = plan_memory(model, strategy, global_batch, device_memory, input_shapes=input_shapes)
    if weighs_model_parallel(strategy, result):
        model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            abstract_model(candidate, build), candidate, mode, global_batch, device_memory,
            input_shapes=input_shapes), result)
    mode = sharding_to_use(result, strategy.sharding_asked)
    result["sharding"] = mode
    if verbose and strategy.info.process_index == 0:
        lines = summary_lines(result, mode)
        if result["model_parallel"] != strategy.model_parallel:
            lines.append(f"  to train so: meshfit.connect(..., sharding={mode!r}, "
                         f"model_parallel={result['model_parallel']})")
        print("\n".join(lines), flush=True)
    return result
