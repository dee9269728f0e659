"""The train-step timing of `meshfit bench` inside its worker process, once the engine is chosen
(meshfit.commands.bench.step.measure chooses it, then imports this module, which imports Keras at
its top). One row per precision, global batch and steps per dispatch: see the step module.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from typing import Any

import jax
import keras
import numpy as np

from meshfit import recipes
from meshfit.commands.bench import worker
from meshfit.errors import MeshfitError
from meshfit.fit import memory_plan, tf_microbatch
from meshfit.fit.strategy import Strategy
from meshfit.parallel import devices as devices_lib
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import modes, planning
from meshfit.run import options
from meshfit.run.keras_side import fitting
from meshfit.watch import goodput
from meshfit.watch.keras_side import profiling
from meshfit.watch.keras_side.report import EpochReport, train_step_flops, wait_for_device
from meshfit.watch.keras_side.tensorboard import TensorBoardLog
from meshfit.watch.peak import peak_of

PLAIN, TENSORBOARD_PATH = "plain", "meshfit+tensorboard"


@dataclass(frozen=True)
class RandomData:
    """The bench's random images and labels, as meshfit.run.keras_side.fitting.build reads a
    run's data: input_shape (height, width, channels), num_classes, class_names (the labels are
    classes: the model is compiled with accuracy, as `meshfit train` compiles it), and train =
    (x, y) for a recipe's prepare."""

    input_shape: tuple[int, ...]
    num_classes: int
    train: tuple

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(self.num_classes))


def class_count(recipe: recipes.Recipe) -> int:
    """Classes of the random labels: a built-in dataset's; for the "synthetic" dataset the model's
    own head (the default of build_model's second argument, see recipes.resnet50_synthetic); else 10."""
    names = recipes.dataset_class_names(recipe.dataset)
    if names:
        return len(names)
    if recipe.dataset == "synthetic":
        arguments = list(inspect.signature(recipe.build_model).parameters.values())
        if len(arguments) < 2 or arguments[1].default is inspect.Parameter.empty:
            raise MeshfitError(f"recipe {recipe.name}: a synthetic dataset's build_model needs a "
                               "default number of classes (its second argument)")
        return int(arguments[1].default)
    return 10


def default_batch(recipe: recipes.Recipe, strategy) -> int:
    """The recipe's global batch on the strategy's devices, as `meshfit train` would use it."""
    return planning.plan_global_batch(strategy, recipe_batch=recipe.global_batch,
                                      per_core_batch=recipe.per_core_batch)


def _fresh_session(strategy=None) -> None:
    """A fresh Keras session, with `strategy` active when given. Not fitting.start_session: its
    seeding imports TensorFlow under JAX and its op determinism would change what is timed."""
    keras.backend.clear_session()
    if strategy is not None:
        strategy.activate()


class EpochTimer(keras.callbacks.Callback):
    """Seconds of each epoch, between device synchronizations."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        wait_for_device(self.model)
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        wait_for_device(self.model)
        self.seconds.append(time.perf_counter() - self._start)


def _wait_each_dispatch(info) -> list:
    """On several CPU devices, a callback finishing each dispatch, as meshfit's train function does.

    XLA:CPU collectives can deadlock with several programs in flight when the machine has fewer
    cores than (simulated) devices, so plain Keras needs the same wait to finish at all.
    """
    if info.platform != "cpu" or info.device_count == 1:
        return []
    return [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: jax.block_until_ready(logs))]


def describe_machine(info, auto_engine: str) -> dict[str, Any]:
    """The machine line of bench.json."""
    return {"platform": info.platform, "device_kind": info.device_kind,
            "devices": info.device_count, "simulated": info.simulated,
            "cpu": devices_lib.cpu_model(), "auto_engine": auto_engine,
            "keras": keras.__version__, "python": sys.version.split()[0]}


def strategy_for(spec: dict, info, precision: str) -> Strategy:
    """The replicas, batch plan and peak FLOP/s of the path: the plain path reads them and never
    activates it (plain Keras stays data-parallel); the meshfit path trains with it."""
    if spec["path"] == PLAIN:
        return Strategy(info, spec["engine"], precision, modes.DATA)
    return Strategy(info, spec["engine"], precision, spec["sharding"], spec["fsdp_min_bytes"],
                    spec["device_memory"])


def random_data(recipe: recipes.Recipe, steps: int, global_batch: int) -> tuple:
    """(x, y, RandomData) of `steps` batches of random uint8 images of the recipe's shape."""
    shape, classes = recipes.input_shape(recipe), class_count(recipe)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (steps * global_batch, *shape), dtype=np.uint8)
    y = rng.integers(0, classes, steps * global_batch).astype(np.int32)
    return x, y, RandomData(shape, classes, (x, y))


def fit_plain(spec: dict, info, model, x, y, timer: EpochTimer, fit: dict, peak) -> tuple:
    """Raw Keras' fit (the model built under Keras' own DataParallel on several JAX devices);
    returns (FLOPs per step or None, micro-batches: always 1)."""
    model.fit(x, y, callbacks=[timer] + _wait_each_dispatch(info), **fit)
    return (train_step_flops(model, fit["batch_size"]) if peak else None), 1


def fit_meshfit(spec: dict, strategy: Strategy, model, x, y, timer: EpochTimer, fit: dict,
                row: str) -> tuple:
    """`Strategy.fit` with the per-epoch report (and, on the tensorboard path, the TensorBoard log
    of every `meshfit train`; with spec's profile, a trace into profile_dir/row); returns (FLOPs
    per step or None, micro-batches installed)."""
    report = EpochReport(global_batch=fit["batch_size"], strategy=strategy, stream=io.StringIO())
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-tb-") as logdir:
        logs = []
        if spec["path"] == TENSORBOARD_PATH:
            logs = [TensorBoardLog(logdir, options.default("log_every"), report=report,
                                   global_batch=fit["batch_size"])]
        if spec.get("profile"):
            logs.append(profiling.Profile(os.path.join(spec["profile_dir"], row), *spec["profile"]))
        strategy.fit(model, x, y, callbacks=[timer, report, *logs], **fit)
    return report.flops_per_step, tf_microbatch.installed(model)


def time_one(spec: dict, info, recipe: recipes.Recipe, strategy: Strategy, precision: str,
             global_batch: int, steps_per_dispatch: int) -> dict[str, Any]:
    """One row: `repeats` timed epochs (after one of warm-up) of the recipe's model on random data."""
    repeats = spec["repeats"]
    steps = -(-spec["steps"] // steps_per_dispatch) * steps_per_dispatch  # whole dispatches
    x, y, data = random_data(recipe, steps, global_batch)

    def build():
        return fitting.build(recipe, data, steps, repeats + 1, steps_per_dispatch)

    _fresh_session()
    chosen = None
    if spec["path"] == PLAIN:
        keras.config.set_dtype_policy(planning.keras_policy(precision))
        if spec["engine"] == "jax" and strategy.replicas > 1:
            keras.distribution.set_distribution(keras.distribution.DataParallel())
    else:
        builder = types.SimpleNamespace(fresh_session=_fresh_session, build_model=build)  # a ModelBuilder
        chosen, _ = memory_plan.choose_sharding(strategy, builder, global_batch, verbose=False)
        _fresh_session(chosen)
    model = build()
    timer = EpochTimer()
    fit = dict(batch_size=global_batch, epochs=repeats + 1, shuffle=False, verbose=0)
    peak_found = peak_of(strategy)  # a data sheet's, or a CPU's measured (cached) peak
    peak = peak_found["flops"]
    before = goodput.ledger().totals()["seconds"]
    if chosen is None:
        flops, micro_batches = fit_plain(spec, info, model, x, y, timer, fit, peak)
    else:  # Strategy.fit runs k steps per dispatch (meshfit.fit.jax_loop)
        row = f"{spec['engine']}-{spec['path']}-{precision}-batch{global_batch}-x{steps_per_dispatch}"
        flops, micro_batches = fit_meshfit(spec, chosen, model, x, y, timer, fit, row)
    after = goodput.ledger().totals()["seconds"]
    median = statistics.median(timer.seconds[1:])  # epoch 0 holds the compilation (compile_s)
    step_seconds = median / steps
    return {"recipe": recipe.name, "engine": spec["engine"], "path": spec["path"],
            "precision": precision, "global_batch": global_batch,
            "steps_per_dispatch": steps_per_dispatch, "micro_batches": micro_batches,
            "sharding": (chosen or strategy).sharding.name, "replicas": (chosen or strategy).replicas,
            "ms_per_step": 1000 * step_seconds, "samples_per_s": global_batch / step_seconds,
            "mfu": flops / step_seconds / peak if (flops and peak) else None,
            "compile_s": max(timer.seconds[0] - median, 0.0), "flops_per_step": flops or None,
            "auto_engine": engine_lib.fastest(info.platform, info.device_count),
            "platform": info.platform, "device_kind": info.device_kind, "repeats": repeats,
            "steps_per_repeat": steps, "epoch_seconds": timer.seconds,
            "peak_flops": peak, "peak_source": peak_found["source"],
            "goodput_seconds": {p: after[p] - before[p] for p in goodput.PARTS}}


def measure(spec: dict, info) -> None:
    """Time one engine and path (spec) for every precision, global batch and steps per dispatch
    on the devices `info`; each row is handed to the parent as it is measured."""
    recipe = recipes.load(spec["recipe"])
    worker.emit_machine(describe_machine(info, engine_lib.fastest(info.platform, info.device_count)))
    count = spec.get("scaling_devices")
    if count and count < info.device_count:  # bench --scaling: the first `count` devices
        info = dataclasses.replace(info, devices=tuple(info.devices[:count]), devices_per_host=count)
    dispatches = spec["steps_per_dispatch"] or ([1] if info.platform == "cpu" else [1, 8])
    for name in spec["precisions"] or [recipe.precision]:
        precision = planning.resolve_precision(name, info.platform, info.compute_capability,
                                                recipe.precision)
        strategy = strategy_for(spec, info, precision)
        global_batches = ([strategy.check_batch(b) for b in spec["global_batches"] or []]
                          or [default_batch(recipe, strategy)])
        for global_batch in global_batches:
            for k in dispatches:
                row = time_one(spec, info, recipe, strategy, precision, global_batch, k)
                worker.emit_row(row)
                print(f"bench: {spec['engine']} {spec['path']} {precision} batch {global_batch} "
                      f"x{k}: {row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:,.0f} "
                      f"samples/s (+{row['compile_s']:.1f} s compile)", file=sys.stderr, flush=True)
