"""'auto' in Python: a model's first `fit` under `connect(sharding="auto")` planned with fit's
real batch and laid out to fit before its first step (`plan_at_first_fit`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import keras
import numpy as np

from meshfit.errors import MeshfitError
from meshfit.fit import sources
from meshfit.fit.memory_plan.choice import model_parallel_plans, plan_memory, weighs_model_parallel
from meshfit.fit.memory_plan.plan import MemoryPlan, plan_mode
from meshfit.fit.memory_plan.words import summary_lines
from meshfit.parallel import devices
from meshfit.parallel.modes import AUTO


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


def plan_at_first_fit(strategy, model, arguments: dict[str, Any]) -> MemoryPlan | None:
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
    if (strategy.sharding_asked is not AUTO or strategy.distribution is None or device_memory is None
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
    if plan_mode(model, strategy, AUTO.first, global_batch, device_memory, data=data).fits:
        # The replicated step fits: nothing more is compiled, and only variables built sharded
        # (past MeshParallel.spill_after, e.g. a frozen backbone for LoRA) are gathered.
        strategy.relayout(model, AUTO.first)
        return None
    result = plan_memory(model, strategy, global_batch, device_memory, data=data)
    if weighs_model_parallel(strategy, result):  # this model's variables as built on each candidate's mesh
        result = model_parallel_plans(strategy, lambda candidate, mode: plan_mode(
            model, candidate, mode, global_batch, device_memory, data=data), result)
    k = result.model_parallel
    if k != strategy.model_parallel:
        # The mesh is the one the model was built on (its variables, and Keras' data placement,
        # belong to it): rather than move every variable to another mesh under a built model,
        # the user is told which model_parallel to connect with; nothing has trained.
        model._meshfit_planned = False  # a next fit plans (and refuses) again
        if chief:
            print("\n".join(summary_lines(result, result.choice)), flush=True)
        raise MeshfitError(f"sharding auto: {result.why}; pass model_parallel={k} to "
                           f"meshfit.connect() (with sharding='{result.choice}', as planned) "
                           "and build the model after it")
    mode = result.choice
    strategy.relayout(model, mode)
    result = dataclasses.replace(result, sharding=mode)
    if chief:
        print("\n".join(summary_lines(result, mode)), flush=True)
    if result.modes[mode].fits is False:
        warnings.warn(f"sharding auto: {result.why}; training {mode} anyway, expect the device "
                      "to run out of memory "
                      "(use a smaller batch, more devices or model_parallel)", stacklevel=3)
    return result
