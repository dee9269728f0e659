"""The choice: both modes planned and the mode 'auto' picks (`plan_memory`, `auto_sharding`),
and, where neither fits and model_parallel was not given, the model parallelism K
(`model_parallel_plans`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from meshfit.fit.memory_plan.plan import MemoryPlan, ModePlan, plan_mode
from meshfit.fit.memory_plan.words import cost_text
from meshfit.parallel import sharding
from meshfit.parallel.modes import AUTO, sharding_named, weighed

# The plan of the model on a candidate strategy, in a mode: (candidate, mode) -> ModePlan.
PlanOn = Callable[[Any, str], ModePlan]


def plan_memory(model, strategy, global_batch: int, device_memory: int | None,
                largest: bool = False, *, data=None, input_shapes=None) -> MemoryPlan:
    """Both modes' plans for `model` on `strategy`'s devices, and the mode `auto` picks.

    data: a batch as fit reads it ((x, y) or (x, y, sample_weight), arrays or
    jax.ShapeDtypeStruct) to plan with; input_shapes: else the inputs' shapes without the batch,
    for dimensions `keras.Input` leaves unknown, e.g. {'token_ids': (1024,)} (see
    lowering.input_structs). largest: see plan_mode. The modes planned: auto's and the one asked.
    """
    modes = [m.name for m in weighed(strategy.sharding_asked, strategy.distribution is not None)]
    plans = {mode: plan_mode(model, strategy, mode, global_batch, device_memory, largest, data,
                             input_shapes)
             for mode in modes}
    choice, why = auto_sharding(plans, device_memory)
    return MemoryPlan(device_memory, global_batch, strategy.replicas, strategy.model_parallel,
                      plans, choice, why)


def auto_sharding(plans: dict[str, ModePlan], device_memory: int | None) -> tuple[str, str]:
    """The mode `auto` picks from the plans and why: data when it fits or memory is unknown, else
    fsdp where it fits, else the smaller of the two."""
    data = plans[AUTO.first.name]
    fsdp = plans.get(AUTO.fallback.name)
    if device_memory is None:
        return data.mode, "device memory unknown (set --device-memory): data-parallel"
    if data.fits or fsdp is None:
        return data.mode, (f"the replicated step fits: {sharding.format_bytes(data.total)} of "
                        f"{sharding.format_bytes(device_memory)} per device")
    needs = (f"the replicated step needs {sharding.format_bytes(data.total)} per device, more than "
             f"{sharding.format_bytes(device_memory)}")
    if fsdp.fits:
        return fsdp.mode, f"{needs}; sharded: {sharding.format_bytes(fsdp.total)}"
    # Neither fits: the smaller, the nearer to fitting (a small model's fsdp step, gathering
    # every weight where it is used, can need more than its replicated one).
    nearer = data if data.total < fsdp.total else fsdp
    return nearer.mode, f"{needs}, and sharded it needs {sharding.format_bytes(fsdp.total)}: neither fits"


def sharding_to_use(plan: MemoryPlan, asked) -> str:
    """The name of the mode a run trains with: `asked` (a mode or its name), or for 'auto' the
    plan's choice."""
    asked = sharding_named(asked)
    return plan.choice if asked is AUTO else asked.name


def model_parallel_candidates(strategy) -> list[int]:
    """The model parallelism 'auto' may try: the divisors K > 1 of the device count, smallest first."""
    count = len(strategy.info.devices)
    return [k for k in range(2, count + 1) if count % k == 0]


def weighs_model_parallel(strategy, plan: MemoryPlan) -> bool:
    """True where 'auto' chooses K after `plan` (plan_memory's, K = 1): sharding 'auto',
    model_parallel not given, several devices on JAX, a known device memory, and neither data
    nor fsdp fits it."""
    return (strategy.sharding_asked is AUTO and strategy.model_parallel_asked is None
            and strategy.distribution is not None and plan.device_memory is not None
            and all(p.fits is False for p in plan.modes.values()))


def model_parallel_plans(strategy, plan_on: PlanOn, plan: MemoryPlan) -> MemoryPlan:
    """'auto' choosing the model parallelism K where neither data nor fsdp fits (`plan` from
    plan_memory, made with K = 1; see weighs_model_parallel): data x model K and fsdp x model K
    are planned, by `plan_on(candidate, mode)` inside `candidate.scope()` (the ModePlan of the
    model on `candidate`, the strategy in `mode` on the mesh (devices/K) x K), for the divisors
    K > 1 of the devices, smallest first, up to the first K where one fits; where both fit, the
    one whose step exchanges fewer bytes in its collectives (XLA's compiled program), data x
    model on a tie. Returns `plan` with model_parallel_plans ({'data x model K': plan, ...} for
    each one tried) and, where one fits, model_parallel K, choice (its mode) and why; else a why
    that says none does.

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
    memory = plan.device_memory
    data, fsdp = plan.modes[AUTO.first.name], plan.modes.get(AUTO.fallback.name)
    tried = dict(plan.model_parallel_plans or {})
    for k in model_parallel_candidates(strategy):
        plans = {}
        for mode in AUTO.candidates:
            candidate, name = strategy.with_sharding(mode, k), mode.layout_name(k)
            with candidate.scope():
                plans[name] = plan_on(candidate, mode.name)
            tried[name] = plans[name]
        fitting = [name for name, p in plans.items() if p.fits]
        if not fitting:
            continue
        exchanged = {name: plans[name].collective_bytes for name in fitting}
        first = AUTO.first.layout_name(k)  # data x model K on a tie
        name = min(fitting, key=lambda n: (exchanged[n] is None, exchanged[n] or 0, n != first))
        why = (f"model parallel {k}: fsdp needs {sharding.format_bytes(fsdp.total)} per device "
               f"(data {sharding.format_bytes(data.total)}), more than "
               f"{sharding.format_bytes(memory)}; {name} needs {sharding.format_bytes(plans[name].total)} "
               f"({cost_text(plans[name])})")
        other = next(n for n in plans if n != name)
        if other in fitting:
            why += (f", {other} {sharding.format_bytes(plans[other].total)} (its collectives "
                    f"exchange {sharding.format_bytes(exchanged[other])})")
        else:
            why += f"; {other} needs {sharding.format_bytes(plans[other].total)}"
        return dataclasses.replace(plan, model_parallel_plans=tried, model_parallel=k,
                                   choice=plans[name].mode, why=why)
    why = plan.why
    if tried:
        least = min(tried, key=lambda n: tried[n].total)
        ks = ", ".join(str(k) for k in model_parallel_candidates(strategy))
        why += (f"; nor data or fsdp x model {ks} (the least "
                f"{sharding.format_bytes(tried[least].total)}, {least})")
    return dataclasses.replace(plan, model_parallel_plans=tried, why=why)
