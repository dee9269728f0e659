"""The words of a memory plan: its lines as `meshfit plan` and a run print them
(`summary_lines`), a step's cost (`cost_text`), the refusal of a mode that does not fit
(`check_fits`) and the warning of an fsdp that leaves much replicated (`replicated_warning`)."""

from __future__ import annotations

from meshfit.errors import MeshfitError
from meshfit.fit.memory_plan.plan import MemoryPlan, ModePlan
from meshfit.parallel import sharding
from meshfit.parallel.modes import AUTO, mode_named


def cost_text(plan: ModePlan) -> str:
    """A plan's step cost per device as text: XLA's flops and bytes accessed, the collectives."""
    parts = []
    if plan.flops is not None:
        parts.append(f"each step {plan.flops:.3g} flops")
    if plan.bytes_accessed is not None:
        parts.append(f"{sharding.format_bytes(plan.bytes_accessed)} accessed")
    if plan.collectives is not None:
        parts.append(f"{plan.collectives} collective{'' if plan.collectives == 1 else 's'} of "
                     f"{sharding.format_bytes(plan.collective_bytes)}")
    return ", ".join(parts) or "no cost analysis"


def check_fits(plan: MemoryPlan, mode: str) -> None:
    """A MeshfitError when `mode` (a mode's name) does not fit the device memory of `plan`
    (from `plan_memory`), naming the bytes needed, the bytes there are and the fix."""
    memory = plan.device_memory
    chosen = plan.used(mode) if mode in plan.modes else None
    if memory is None or chosen is None or chosen.fits:
        return
    need, have = sharding.format_bytes(chosen.total), sharding.format_bytes(memory)
    fsdp = plan.modes.get(AUTO.fallback.name)
    largest = plan.largest_global_batch(mode)
    if mode == AUTO.first.name and fsdp and fsdp.fits:
        fix = f"use --sharding {AUTO.fallback} (or auto), which needs {sharding.format_bytes(fsdp.total)}"
    elif largest:
        fix = (f"use --global-batch {largest} or less (the largest global batch that fits, "
               f"{largest // plan.devices} per device), more devices or a smaller model")
    elif largest == 0:
        fix = "no batch fits: use more devices, or a smaller model"
    else:
        fix = "use a smaller --global-batch, more devices or a smaller model"
    replicated = plan.modes[AUTO.first.name]
    if mode == AUTO.fallback.name and not replicated.fits:
        fix = f"it does not fit replicated either ({sharding.format_bytes(replicated.total)}); {fix}"
    raise MeshfitError(f"out of device memory: the model's train step needs {need} per device with "
                       f"--sharding {mode} "
                       f"(weights {sharding.format_bytes(chosen.weights)}, optimizer "
                       f"{sharding.format_bytes(chosen.optimizer)}, step "
                       f"{sharding.format_bytes(chosen.step_temp)}) but a device has {have} of memory; {fix}",
                       see="out-of-device-memory")


def summary_lines(plan: MemoryPlan, mode: str) -> list[str]:
    """The plan as text lines: per mode its bytes per device, then the mode used and why."""
    memory = plan.device_memory
    k = next(iter(plan.modes.values())).model_parallel  # the mesh the modes were planned on
    on = f"{plan.devices} device(s)" if k == 1 else f"{plan.devices} x {k} devices (batch x model)"
    lines = [f"memory per device (of {sharding.format_bytes(memory)}), global batch "
             f"{plan.global_batch} on {on}:"]
    rows = list(plan.modes.items()) + list((plan.model_parallel_plans or {}).items())
    width = max(len(name) for name, _ in rows)
    for name, p in rows:
        fits = {True: "fits", False: "does not fit", None: "fit unknown"}[p.fits]
        lines.append(f"  {name:<{width}} weights {sharding.format_bytes(p.weights)}  optimizer "
                     f"{sharding.format_bytes(p.optimizer)}  step {sharding.format_bytes(p.step_temp)}"
                     f"  total {sharding.format_bytes(p.total)}  ({fits}; "
                     f"{p.replicated_share:.1%} of the state replicated)")
        if p.largest_per_core_batch is not None:
            lines[-1] += f"  largest per-core batch {p.largest_per_core_batch or 'none'}"
        if plan.model_parallel_plans:  # where model parallelism was weighed: the step's cost
            lines[-1] += f"  [{cost_text(p)}]"
    used = mode_named(mode).layout_name(1 if plan.model_parallel == k else plan.model_parallel)
    fits = plan.used(mode).fits is not False
    if mode != plan.choice:
        lines.append(f"  using {used}: as asked" if fits else f"  {used} (as asked) does not fit")
    else:  # auto's choice: where nothing fits, no mode is claimed (a run would refuse: check_fits)
        lines.append(f"  {'using ' + used if fits else 'nothing fits'}: {plan.why}")
    largest = plan.largest_global_batch(mode)
    if not fits and largest is not None:
        lines[-1] += (f"; the largest global batch that fits is {largest} (--global-batch {largest})"
                      if largest else "; no batch fits: use more devices or a smaller model")
    return lines


def replicated_warning(plan: MemoryPlan, mode: str) -> str | None:
    """A warning when a mode that splits the state (fsdp) leaves more than 2% of it replicated,
    else None."""
    p = plan.used(mode) if mode in plan.modes else None
    if not mode_named(mode).splits_state or p is None or p.replicated_share <= sharding.REPLICATED_WARN_SHARE:
        return None
    return (f"{mode} leaves {p.replicated_share:.1%} of the state "
            f"({sharding.format_bytes(p.replicated)}) replicated on every device: variables "
            f"under --fsdp-min-bytes or with no dimension divisible by {plan.devices}")
