"""The per-mode plan: one mode's bytes per device of a model's train step (`ModePlan`, from
`plan_mode`), and the memory plan of a run (`MemoryPlan`: every mode planned, the choice and why).

Per device: weights and optimizer state (the variables' shards), the step's temporary memory
(XLA's `temp_size_in_bytes`: activations, gradients, gathered weights) and the batch; total =
XLA's arguments + outputs not aliased to them (the state is donated) + temporaries. With each
plan, XLA's cost analysis of the same compiled step and its collectives (meshfit.fit.memory_plan
.lowering).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Mapping

from meshfit.fit.memory_plan.lowering import (axis_sizes, batch_bytes, compiled_bytes, state_groups,
                                              variable_specs)
from meshfit.parallel import sharding
from meshfit.parallel.modes import mode_named


@dataclass(frozen=True)
class ModePlan:
    """One mode's bytes per device (sizes in bytes)."""

    mode: str  # a registered mode's name (meshfit.parallel.modes)
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
        """The plan as `meshfit plan --json` writes it: its fields and replicated_share."""
        return {**dataclasses.asdict(self), "replicated_share": self.replicated_share}


@dataclass(frozen=True)
class MemoryPlan:
    """The memory plan of a model's train step on a strategy's devices: each mode's plan, the
    mode 'auto' chooses and why (see meshfit.fit.memory_plan.choice)."""

    device_memory: int | None  # bytes per device; None when unknown
    global_batch: int
    devices: int  # the replicas the batch is split over
    model_parallel: int  # K: the planned mesh's, or the one 'auto' chose (model_parallel_plans)
    modes: Mapping[str, ModePlan]  # 'data' (and 'fsdp' with several devices) on the planned mesh
    choice: str  # the name of the mode 'auto' picks
    why: str  # one line saying why
    # 'data x model K': plan, for each K tried where neither mode fit; None where none was weighed.
    model_parallel_plans: Mapping[str, ModePlan] | None = None
    sharding: str | None = None  # the mode the run trains with, once decided
    recipe: str | None = None  # the recipe planned (`meshfit plan`)

    def __post_init__(self):
        # Frozen through: the plans' mappings are read-only views too.
        object.__setattr__(self, "modes", types.MappingProxyType(dict(self.modes)))
        if self.model_parallel_plans is not None:
            object.__setattr__(self, "model_parallel_plans",
                               types.MappingProxyType(dict(self.model_parallel_plans)))

    def used(self, mode: str) -> ModePlan:
        """The plan of what a run trains with: `mode` on the planned mesh, or `mode` x model K
        where 'auto' chose K (model_parallel_plans)."""
        chosen = (self.model_parallel_plans or {}).get(
            mode_named(self.choice).layout_name(self.model_parallel or 1))
        return chosen if chosen is not None and mode == self.choice else self.modes[mode]

    @property
    def fits(self) -> bool | None:
        """Whether the step of the mode decided (`sharding`) fits the device memory: False where
        nothing fits, None where the memory is unknown."""
        return self.used(self.sharding).fits

    def largest_global_batch(self, mode: str) -> int | None:
        """The largest global batch whose step in `mode` fits (planned with largest=True): 0 when
        none does, None when unknown."""
        plan = self.modes.get(mode)
        per_core = None if plan is None else plan.largest_per_core_batch
        return None if per_core is None else per_core * self.devices

    def as_dict(self) -> dict[str, Any]:
        """The plan as `meshfit plan --json` writes it, in plain types (the keys, and their order,
        of the dict the plan was before it was a type): "model_parallel_plans" only where they
        were weighed, "sharding" and "fits" once decided, "recipe" where one was planned."""
        out = {"device_memory": self.device_memory, "global_batch": self.global_batch,
               "devices": self.devices, "model_parallel": self.model_parallel,
               "modes": {m: p.as_dict() for m, p in self.modes.items()},
               "choice": self.choice, "why": self.why}
        if self.model_parallel_plans is not None:
            out["model_parallel_plans"] = {n: p.as_dict() for n, p in self.model_parallel_plans.items()}
        if self.sharding is not None:
            out.update(sharding=self.sharding, fits=self.fits)
        if self.recipe is not None:
            out["recipe"] = self.recipe
        return out


def plan_mode(model, strategy, mode: str, global_batch: int, device_memory: int | None,
              largest: bool = False, data=None, input_shapes=None) -> ModePlan:
    """The plan of one mode for `model` (built and compiled) on `strategy`'s devices.

    largest: also find the largest per-core batch that fits (one more compile, at twice the
    batch; the step's memory is taken as linear in the batch). data, input_shapes: the batch to
    plan for (see lowering.step_arguments).
    """
    devices = max(strategy.replicas, 1)
    mesh = strategy.distribution.device_mesh.backend_mesh if strategy.distribution else None
    specs = variable_specs(model, mode, strategy)
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
    total, temp, cost = compiled_bytes(model, global_batch, mesh, specs, data, input_shapes)
    per_core = global_batch // devices
    batch = batch_bytes(model, per_core, data, input_shapes)
    best = None
    if largest and device_memory is not None:
        total2, _, _ = compiled_bytes(model, 2 * global_batch, mesh, specs, data, input_shapes)
        slope = (total2 - total) / per_core  # bytes per sample per device
        if slope > 0:
            multiple = strategy.per_core_multiple
            best = int((device_memory - (total - slope * per_core)) // slope) // multiple * multiple
            best = best if best >= multiple else 0
    return ModePlan(mode_named(mode).name, weights, optimizer, temp, batch, total, replicated, whole,
                    None if device_memory is None else total <= device_memory, best,
                    strategy.model_parallel, **cost)
