"""Where a run's sharding is decided from its memory plan, before its model is built:
`choose_sharding` for `meshfit train`, `meshfit bench` and `meshfit plan` (its model made by a
`ModelBuilder`), and `plan_build` for `meshfit.plan` (on an abstract model)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Protocol

from meshfit.fit.memory_plan.abstract import abstract_model
from meshfit.fit.memory_plan.choice import (model_parallel_plans, plan_memory, sharding_to_use,
                                            weighs_model_parallel)
from meshfit.fit.memory_plan.plan import MemoryPlan, plan_mode
from meshfit.fit.memory_plan.words import check_fits, replicated_warning, summary_lines
from meshfit.parallel import devices
from meshfit.parallel.modes import FSDP, ShardingMode


class ModelBuilder(Protocol):
    """What choose_sharding needs of its caller (meshfit.run.keras_side.fitting, meshfit bench):
    a fresh Keras session for a strategy, and the run's model."""

    def fresh_session(self, strategy) -> None:
        """Start a fresh Keras session with `strategy` active."""

    def build_model(self) -> Any:
        """The run's model, built and compiled (called inside a strategy's scope)."""


def choose_sharding(strategy, builder: ModelBuilder, global_batch: int, verbose: bool = True,
                    largest: bool = False, always: bool = False) -> tuple[Any, MemoryPlan | None]:
    """The strategy to train with, and its memory plan (None where none was made): the one place
    where 'auto' is decided.

    'auto' becomes fsdp when the device memory is known and the replicated step does not fit,
    else data; when neither fits and model_parallel was not given, data or fsdp x model K for the
    smallest K that fits (model_parallel_plans), on a mesh (devices/K) x K. An asked mode that
    does not fit is a MeshfitError (see `check_fits`). The plan is made on a model built by
    `builder.build_model()` under fsdp (which allocates the least), after
    `builder.fresh_session(strategy)`; build the model again under the returned strategy. Without
    several JAX devices, or for data-parallel with unknown device memory, nothing is planned unless
    `always` (then the plan is shown, not enforced: `meshfit plan`). largest: see plan_mode.
    """
    device_memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    splits = isinstance(strategy.sharding_asked, ShardingMode) and strategy.sharding_asked.splits_state
    skip = strategy.distribution is None or (not splits and device_memory is None)
    if skip and not always:
        return strategy, None

    def built(on):
        # Under fsdp, and with abstract variables (no values: see abstract_model) where the model
        # builds so; else built for real under fsdp, the layout that allocates the least.
        builder.fresh_session(on)
        model = abstract_model(on, builder.build_model, fallback=True)
        if model is None:
            with on.scope():
                model = builder.build_model()
        return model

    planned = strategy.with_sharding(FSDP) if strategy.distribution is not None else strategy
    model = built(planned)
    result = plan_memory(model, planned, global_batch, device_memory, largest)
    if weighs_model_parallel(strategy, result):
        model = None  # each candidate builds its own, on its mesh
        result = model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            built(candidate), candidate, mode, global_batch, device_memory), result)
    mode = sharding_to_use(result, strategy.sharding_asked)
    if result.used(mode).fits is False and not largest:
        # the refusal names the batch that fits (on the mesh planned first)
        model = model if model is not None else built(planned)
        result = dataclasses.replace(plan_memory(model, planned, global_batch, device_memory, largest=True),
                                     why=result.why, model_parallel_plans=result.model_parallel_plans)
    del model  # its variables would hold device memory while the run builds its own
    result = dataclasses.replace(result, sharding=mode)
    chosen_k = result.model_parallel
    if always:
        return strategy, result
    check_fits(result, mode)
    if verbose and strategy.info.process_index == 0:
        print("\n".join(summary_lines(result, mode)), flush=True)
    warning = replicated_warning(result, mode)
    if warning:
        warnings.warn(warning, stacklevel=2)
    if (mode, chosen_k) == (strategy.sharding.name, strategy.model_parallel):
        strategy.distribution.spill_after = None  # decided: the run's variables follow `mode` alone
        return strategy, result
    return strategy.with_sharding(mode, chosen_k), result


def plan_build(strategy, build: Callable[[], Any], global_batch: int, input_shapes=None,
               verbose: bool = True) -> MemoryPlan:
    """`meshfit.plan`: the memory plan of the model `build()` returns (compiled, with its
    optimizer), for `global_batch` on `strategy`'s devices and device memory, without allocating
    its weights: the model is built in a Keras `StatelessScope`, where variables get a shape, a
    dtype and a layout but no value, and its train step is compiled (never run) on abstract
    arrays. So a 7-billion-parameter configuration plans on a laptop. input_shapes: the inputs'
    shapes without the batch where `keras.Input` leaves them unknown (see lowering.input_structs).
    With sharding 'auto', model_parallel not given to connect() and neither mode fitting,
    data and fsdp x model K are planned too (model_parallel_plans): `model_parallel` is then the K
    to pass to connect() (printed as such).
    Returns plan_memory's MemoryPlan, its sharding decided; printed (summary_lines) when `verbose`."""
    device_memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    model = abstract_model(strategy, build)
    result = plan_memory(model, strategy, global_batch, device_memory, input_shapes=input_shapes)
    if weighs_model_parallel(strategy, result):
        result = model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            abstract_model(candidate, build), candidate, mode, global_batch, device_memory,
            input_shapes=input_shapes), result)
    mode = sharding_to_use(result, strategy.sharding_asked)
    result = dataclasses.replace(result, sharding=mode)
    if verbose and strategy.info.process_index == 0:
        lines = summary_lines(result, mode)
        if result.model_parallel != strategy.model_parallel:
            lines.append(f"  to train so: meshfit.connect(..., sharding={mode!r}, "
                         f"model_parallel={result.model_parallel})")
        print("\n".join(lines), flush=True)
    return result
