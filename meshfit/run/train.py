"""Training a recipe: the life of a run, one named step after another.

train() = specify (TrainOptions settled) -> connect -> load the data -> plan the batch
(planning.plan_batch) -> then, on the Keras side (meshfit.run.keras_side.fitting): choose the
sharding (the memory plan) -> build the model -> open the run directory (config.json) -> restore
the newest checkpoint (when resuming) -> fit -> score on the test set -> write the results. The
run directory's files are described in meshfit.run.rundir, the specification in meshfit.run.spec.
Only process 0 prints and writes.

This module runs before the engine is chosen (`meshfit train` imports it first), so it imports
no Keras: the steps after connect() live in meshfit.run.keras_side.fitting, imported once
connect() ran.

Training is deterministic for a given seed: weights start from `keras.utils.set_random_seed`, the
data order and augmentation are functions of (seed, epoch, step) (meshfit.data.arrays), Dropout's
random state is checkpointed, and TensorFlow runs with op determinism. So `--resume` of a killed
run ends with the same weights as an uninterrupted run on the same engine and devices.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

import meshfit
from meshfit import recipes
from meshfit.data import datasets, splits as data
from meshfit.errors import MeshfitError
from meshfit.parallel import devices, engine, planning
from meshfit.run import models, rundir, spec
from meshfit.run.options import TrainOptions, at_least_one, check_fraction, current_names
from meshfit.run.spec import RunSpec
from meshfit.watch import goodput

# Settings a resumed run keeps from its config.json unless given again (the same name on both).
RESUMED_SETTINGS = ("data_dir", "engine", "simulate_devices", "checkpoint_every", "sharding",
                    "fsdp_min_bytes", "model_parallel", "local_copy_every")


@dataclass(frozen=True)
class Asked:
    """The run asked for: its recipe and its options, with every default filled in and, on
    --resume, the saved run's settings."""

    recipe: recipes.Recipe
    options: TrainOptions
    run: str  # the run directory
    saved: RunSpec | None = None  # the resumed run's specification
    saved_config: dict | None = None  # and its whole config.json
    checkpoint: str | None = None  # the checkpoint --resume named (default: the newest)


def specify(recipe: str | recipes.Recipe | None, options: TrainOptions) -> Asked:
    """The recipe loaded (the resumed run's own), checked, and the options settled: a recipe
    file starts the engine first (it may import Keras)."""
    datasets.check_data_dir(options.data_dir)  # as given: a resumed run's own may have moved
    # $MESHFIT_SIMULATE_DEVICES counts as given: `meshfit launch` sets it per process, and a run
    # of one process resumed on two must run 2 x its share, not 2 x the saved count.
    options = dataclasses.replace(
        options, simulate_devices=devices.requested_simulation(options.simulate_devices))
    resume, checkpoint = rundir.resume_target(options.resume) if options.resume else (None, None)
    saved, saved_config = spec.read(resume) if resume is not None else (None, None)
    if saved is not None:
        the_recipe = resumed_recipe(recipe, options, resume, saved)
    else:
        the_recipe = load_recipe(recipe, options)
    check_recipe(the_recipe)
    options = settle_options(options, the_recipe, saved)
    run = resume or rundir.new(options.out, the_recipe.name)  # checked before any slow work
    if resume:
        rundir.check_writable(resume)
    return Asked(the_recipe, options, run, saved, saved_config, checkpoint)


def load_recipe(recipe: str | recipes.Recipe | None, options: TrainOptions) -> recipes.Recipe:
    """The recipe of a new run, with the options that override its own settings: a recipe file
    runs only after the engine is started, since it may import Keras at its top."""
    if isinstance(recipe, str) and recipes.is_file(recipe):
        recipes.check_file(recipe)
        start_engine_for_file(options.simulate_devices, options.engine, options.require)
    the_recipe = recipe if isinstance(recipe, recipes.Recipe) else recipes.load(recipe)
    changes = {"steps_per_epoch": options.steps_per_epoch,
               "validation_split": options.validation_split}
    return dataclasses.replace(the_recipe, **{k: v for k, v in changes.items() if v is not None})


def resumed_recipe(recipe: str | recipes.Recipe | None, options: TrainOptions, resume: str,
                   saved: RunSpec) -> recipes.Recipe:
    """The recipe a resumed run trains (its own copy of a recipe file), checked against what
    was asked."""
    from_python = isinstance(recipe, recipes.Recipe) and not saved.recipe_file
    if saved.recipe_file:
        start_engine_for_file(options.simulate_devices or saved.simulate_devices,
                              options.engine or saved.engine, options.require)
    the_recipe = recipe if from_python else models.recipe_of_run(resume, saved)
    the_recipe = dataclasses.replace(the_recipe, steps_per_epoch=saved.steps_per_epoch,
                                     validation_split=saved.validation_split)
    asked = recipe.name if isinstance(recipe, recipes.Recipe) else recipe and recipes.builtin_name(recipe)
    if asked and recipes.is_file(asked):  # the run's own copy trains; the file only names it
        same = (saved.recipe_sha256 and os.path.isfile(asked)
                and rundir.file_sha256(asked) == saved.recipe_sha256)
        asked = saved.recipe if same else recipes.load_file(asked).name
    spec.check_resume(saved, resume, recipe=asked, global_batch=options.global_batch,
                      seed=options.seed, precision=options.precision)
    return the_recipe


def start_engine_for_file(simulate_devices: int | None, engine_name: str | None,
                          require: str | None) -> None:
    """Devices found and Keras imported on their engine before a recipe file runs: the file may
    import keras at its top, and Keras keeps the backend of its first import."""
    engine.start_engine(simulate_devices, engine_name, require)
    models.import_keras()


def check_recipe(recipe: recipes.Recipe) -> None:
    """The recipe's own settings checked as the flags that override them are."""
    at_least_one("steps_per_epoch", recipe.steps_per_epoch)
    check_fraction("validation_split", recipe.validation_split)
    planning.precision_name(recipe.precision)
    if recipe.dataset == "synthetic":
        raise MeshfitError(f"recipe {recipe.name} trains on random data to measure speed; "
                           f"time it with: meshfit bench {recipe.name}")


def settle_options(asked: TrainOptions, recipe: recipes.Recipe, saved: RunSpec | None) -> TrainOptions:
    """The options with their defaults filled in; on --resume the saved run's batch, seed and
    precision, and its other settings (RESUMED_SETTINGS) where not given again."""
    o = asked
    if saved is not None:
        kept = {name: getattr(saved, name) for name in RESUMED_SETTINGS if not getattr(o, name)}
        o = dataclasses.replace(
            o, global_batch=saved.global_batch, seed=saved.seed, precision=saved.precision,
            batch_rounding=False,  # the data order depends on the batch: never round it
            epochs=saved.epochs if o.epochs is None else o.epochs,
            keep_checkpoints=(saved.keep_checkpoints if o.keep_checkpoints is None
                              else o.keep_checkpoints), **kept)  # the same program
        # TensorFlow keeps its (cache-sized) slices; on JAX slices are for memory, asked anew by
        # each resumption (an elastic generation on fewer devices): the batches stay the same.
        if o.micro_batches is None and saved.micro_batches and o.engine == "tensorflow":
            o = dataclasses.replace(o, micro_batches=saved.micro_batches)  # keeps its slices
    return dataclasses.replace(
        o, epochs=int(recipe.epochs if o.epochs is None else o.epochs),
        seed=spec.check_seed(o.seed),
        checkpoint_every=str(o.checkpoint_every or spec.DEFAULT_CHECKPOINT_EVERY),
        keep_checkpoints=(spec.DEFAULT_KEEP_CHECKPOINTS if o.keep_checkpoints is None
                          else o.keep_checkpoints),
        local_copy_every=int(o.local_copy_every or 0),
        micro_batches=o.micro_batches or "auto")


def connect_devices(asked: Asked):
    """connect() with the run's engine, devices, precision and sharding: the Strategy."""
    o = asked.options
    return meshfit.connect(**{**o.connect_settings(), "precision": planning.asked_precision(
        o.precision, asked.recipe.precision)})


def check_batch(asked: Asked, strategy, warn: bool = False) -> int:
    """A batch that cannot split across the replicas fails now, before the data loads (slow);
    batch_plan() decides the batch (and warns of rounding) once the data is known. Returns the
    global batch as planned without the data (warn: say here when it is rounded)."""
    o, r = asked.options, asked.recipe
    with warnings.catch_warnings():
        if not warn:  # plan_batch warns of a rounding once the data is known: once, not twice
            warnings.simplefilter("ignore")
        return planning.plan_global_batch(strategy, global_batch=o.global_batch,
                                          recipe_batch=r.global_batch,
                                          per_core_batch=r.per_core_batch, rounding=o.batch_rounding)


def load_data(asked: Asked, strategy):
    """The run's data (data.RunData) and, for a streamed source, its batches (else None)."""
    o, r = asked.options, asked.recipe
    dataset = data.load(r, o.data_dir, o.seed, asked.saved.dataset if asked.saved else None)
    stream = (data.stream_batches(dataset, o.seed, strategy.replicas, r.steps_per_epoch)
              if dataset.from_source else None)  # the source sets the batch and the steps
    return dataset, stream


def batch_plan(asked: Asked, strategy, dataset, stream) -> planning.BatchPlan:
    """Batch, steps per epoch, steps per dispatch and micro-batches of this run on these devices
    (planning.plan_batch with the run's options, its recipe's and its data's sizes)."""
    o, r = asked.options, asked.recipe
    return planning.plan_batch(
        strategy, samples=None if stream else data.size(dataset.train), global_batch=o.global_batch,
        recipe_batch=r.global_batch, per_core_batch=r.per_core_batch,
        recipe_steps=r.steps_per_epoch,
        stream=(stream.global_batch, stream.steps_per_epoch) if stream else None,
        steps_per_dispatch=o.steps_per_dispatch, micro_batches=o.micro_batches,
        rounding=o.batch_rounding)


def train(recipe: str | recipes.Recipe | None = None, options: TrainOptions | None = None,
          **settings: Any) -> dict[str, Any]:
    """Train `recipe` (default fashion-mnist-cnn), write its run directory, return its metrics.

    recipe: a built-in recipe's name, a recipe file's path, or a Recipe.
    options: a meshfit.run.options.TrainOptions; `settings` are its fields by name (on top of
      `options` when both are given; the older names batch_size and fsdp_min_size accepted),
      e.g. epochs, global_batch (over all replicas), precision, steps_per_epoch and
      validation_split override the recipe's; data_dir, out, seed (default
      meshfit.data.order.DEFAULT_SEED: weights, data order, augmentation and dropout all follow
      from it).
    resume: a run directory; training continues from its newest checkpoint with its settings
      (recipe, batch, seed, precision, data) and, unless given here, its engine and device count.
      A different replica count is accepted: the data order and random numbers do not depend on
      it, so only floating-point summation order differs from the original run. --epochs may
      extend a finished run.
    simulate_devices, engine, require, sharding, fsdp_min_bytes, device_memory, model_parallel: as
      for meshfit.connect (a resumed run keeps its sharding, fsdp threshold and model parallelism
      unless given); 'auto'
      sharding trains fsdp when the device memory is known and the replicated step does not fit
      (meshfit.fit.memory_plan). checkpoint_every: "200" (steps), "60s"/"5m" (time, default
      60 s), "epoch" or "off"; keep_checkpoints (default spec.DEFAULT_KEEP_CHECKPOINTS);
      local_copy_every: steps between copies of the state on each host's local disk (default 0:
      none; meshfit.run.local_copies);
      steps_per_dispatch, micro_batches, batch_rounding: see meshfit.parallel.planning.plan_batch. callbacks: extra Keras callbacks
      for fit. command: the command line to record. tensorboard, log_every, profile:
      RUN/tensorboard scalars every `log_every` steps, and a trace of global train steps
      "START:STOP".
    Raises meshfit.TrainingInterrupted (a MeshfitError; exit_code 143 or 130) after SIGTERM/SIGINT,
    once the state is saved.
    """
    settings = current_names(settings)
    options = dataclasses.replace(options, **settings) if options else TrainOptions(**settings)
    command = options.command or python_command(recipe, options)
    goodput.begin_run()  # the run's wall time starts here (or at the process's start)
    asked = specify(recipe, options)
    strategy = connect_devices(asked)
    check_batch(asked, strategy)
    dataset, stream = load_data(asked, strategy)
    the_plan = batch_plan(asked, strategy, dataset, stream)
    return keras_side().run(asked, strategy, dataset, stream, the_plan, command)


def keras_side():
    """meshfit.run.keras_side.fitting, the run's steps after connect(): call this only once
    connect() ran."""
    from meshfit.run.keras_side import fitting  # the engine line: Keras imported by connect()

    return fitting


def python_command(recipe: str | recipes.Recipe | None, options: TrainOptions) -> str:
    """How a run started from Python is recorded in config.json's `command`."""
    shown = ("epochs", "global_batch", "precision", "data_dir", "out", "seed", "resume")
    given = options.given()
    return spec.python_command(recipe=recipe, **{k: given[k] for k in shown if k in given})
