"""`meshfit verify`'s training: K steps of one model under one configuration, in this process.

Every run starts from the same initial weights (the reference's, assigned variable by variable)
and the same Keras seed (the same dropout masks), reads the same global batches in the same order
and records, after each dispatch, the logs fit reports and every variable's value on the host.
Configurations take the first N of the devices JAX started (a Strategy on a subset of them), so
one process serves every device count up to those started. meshfit.run.verify compares the runs.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import keras
import numpy as np

import meshfit
from meshfit.errors import MeshfitError
from meshfit.fit import hooks
from meshfit.fit.strategy import Strategy
from meshfit.run.keras_side import checkpoint_restore, checkpoint_save, fitting

# The unit roundoff of each compute dtype: the floor run's weights are moved by this much
# (relative, random sign per element), one rounding of the arithmetic the model runs in.
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -11,
                 "float64": 2.0 ** -53}


@dataclass
class Trace:
    """One run: `steps` (1-based, the last step of each dispatch), the logs fit reported for each
    dispatch (its steps' mean), and every variable's value after it (`weights[i][j]`: variable j
    after dispatch i), with the variables' paths. The model's variables only: an optimizer's
    slots hold the gradients themselves (Adam's velocity their squares), which the summation
    order moves far more than the floor run moves the weights (200 x the floor in Adam's
    velocity: fashion-mnist-cnn, 8 devices, step 3 of 4); a slot, a step counter or a random
    state that a checkpoint loses shows in the weights of the next step."""

    steps: list[int] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    weights: list[list[np.ndarray]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    seconds: float = 0.0


def base_strategy(precision: str) -> Strategy:
    """The strategy whose devices verify takes: the active one (of the last meshfit.connect(), on
    JAX), in `precision`; connected now on what JAX started where none is active."""
    active = hooks.active() or meshfit.connect(engine="jax", precision=precision, verbose=False)
    if active.engine != "jax":
        raise MeshfitError("meshfit verify compares device counts on JAX; connect(engine='jax')")
    if precision in ("auto", active.precision):
        return active
    return Strategy(active.info, "jax", precision)


def builder(build) -> Callable[[], Any]:
    """The function that builds a run's model: `build` itself, or a recipe's (a
    meshfit.run.verify.RecipeModel) as `meshfit train` builds it."""
    if callable(build):
        return build
    return lambda: fitting.build(build.recipe, build.dataset, build.steps_per_epoch, build.epochs, 1)


def strategy_on(base: Strategy, devices: int, sharding: str, model_parallel: int = 1) -> Strategy:
    """A Strategy on the first `devices` of `base`'s devices, with this sharding (a mode's name)."""
    available = len(base.info.devices)
    if devices > available:
        raise MeshfitError(f"{devices} devices asked but JAX started with {available}; verify "
                           f"before anything starts JAX, or connect(simulate_devices={devices}) first")
    info = dataclasses.replace(base.info, devices=tuple(base.info.devices[:devices]),
                               devices_per_host=devices, hosts=1)
    return Strategy(info, base.engine, base.precision, sharding, base.fsdp_min_bytes,
                    model_parallel=model_parallel)


def _values(variables) -> list[np.ndarray]:
    """The variables' values on the host, whole: of an array spread over several processes (a job
    of `meshfit verify --processes`) gathered from all, so every process calls this together."""
    return [_whole(v.value) for v in variables]


def _whole(value) -> np.ndarray:
    if getattr(value, "is_fully_addressable", True):
        return np.array(keras.ops.convert_to_numpy(value))
    from jax.experimental import multihost_utils  # only in a job of several processes

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _assign(variables, values) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def _join(batches: list) -> Any:
    """Several global batches (x, y) as one (their samples one after another; a y of None,
    x alone, stays None)."""
    return keras.tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]),
                                    *batches, none_is_leaf=False)


def new_model(strategy: Strategy, build: Callable[[], Any], seed: int, first_batch) -> Any:
    """`build()` in a fresh Keras session under `strategy`, seeded; its variables made (a
    subclassed model is called once on the first batch's inputs)."""
    keras.backend.clear_session()  # the same layer names (variable paths) in every run
    strategy.activate()  # for the whole run: the data is read under it too, as after connect()
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = build()
        if not isinstance(model, keras.Model) or getattr(model, "optimizer", None) is None:
            raise MeshfitError("meshfit.verify: build_model must return a compiled Keras model "
                               "(call model.compile(...) in it)")
        if not model.built or not model.variables:
            model(first_batch[0])
    return model


def perturbed(values: list[np.ndarray], roundoff: float, seed: int) -> list[np.ndarray]:
    """Float values moved by `roundoff` relative, with a random sign per element."""
    rng = np.random.default_rng(seed)
    out = []
    for value in values:
        if np.issubdtype(value.dtype, np.floating):
            value = (value * (1 + roundoff * rng.choice([-1.0, 1.0], value.shape))).astype(value.dtype)
        out.append(value)
    return out


def initial_weights(strategy: Strategy, build, seed: int, first_batch) -> list[np.ndarray]:
    """The variables `build()` starts from on `strategy` with this seed: every run's start."""
    return _values(new_model(strategy, build, seed, first_batch).variables)


def train(strategy: Strategy, build: Callable[[], Any], source: Callable[[int], Iterator], *,
          steps: int, global_batch: int, seed: int, start: list[np.ndarray],
          micro_batches: int = 1, steps_per_dispatch: int = 1,
          resume_at: int | None = None) -> Trace:
    """`steps` steps of `build()`'s model under `strategy` from the weights `start`, the global
    batches read from `source(first_step)`; with resume_at, stopped after that many steps,
    checkpointed, restored into a model built anew (see _resumed) and continued on
    `source(resume_at)`."""
    begun = time.perf_counter()
    batches = source(0)
    first = next(iter(source(0)))
    model = _ready(new_model(strategy, build, seed, first), strategy, steps_per_dispatch)
    _assign(model.variables, start)
    trace = Trace(paths=[v.path for v in model.variables])
    done = 0
    while done < steps:
        if resume_at is not None and done == resume_at:
            model = _resumed(model, strategy, build, seed, first, steps_per_dispatch, done)
            batches = source(resume_at)
        chunk = [next(batches) for _ in range(steps_per_dispatch)]
        x, y = _join(chunk)
        history = strategy.fit(model, x, y, batch_size=global_batch, epochs=1, shuffle=False,
                               report=False, micro_batches=micro_batches, verbose=0)
        done += steps_per_dispatch
        trace.steps.append(done)
        trace.logs.append({name: float(values[-1]) for name, values in history.history.items()})
        trace.weights.append(_values(model.variables))
    trace.seconds = time.perf_counter() - begun
    return trace


def _ready(model, strategy: Strategy, steps_per_dispatch: int):
    """`model` with its optimizer's variables made (under `strategy`) and its steps per dispatch."""
    if steps_per_dispatch > 1:
        model.steps_per_execution = steps_per_dispatch
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    return model


def _resumed(model, strategy: Strategy, build, seed: int, first, steps_per_dispatch: int,
             step: int):
    """A model built anew (seed + 1: other weights and random state, so that a variable the
    checkpoint does not bring back shows) and restored from `model`'s checkpoint after `step`
    steps, written into a temporary folder and read back by meshfit's own checkpoint code
    (checkpoint_save.save, checkpoint_restore.restore: the files and format of `meshfit train`
    and `--resume`, orbax for the model's and optimizer's arrays on JAX)."""
    with tempfile.TemporaryDirectory(prefix="meshfit-verify-") as folder:
        path = checkpoint_save.save(folder, model, epoch=0, step=step, steps_per_epoch=step)
        model = _ready(new_model(strategy, build, seed + 1, first), strategy, steps_per_dispatch)
        checkpoint_restore.restore(model, path)
    return model
