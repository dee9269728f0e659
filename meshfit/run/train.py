"""Training and evaluation of a recipe: the life of a run, one named step after another.

train() = specify (TrainOptions settled) -> connect -> load the data -> plan (planning.plan) ->
build the model -> open the run directory (config.json) -> restore the newest checkpoint (when
resuming) -> fit -> score on the test set -> write the results. The run directory's files are described in
meshfit.run.rundir, the specification in meshfit.run.spec. Only process 0 prints and writes.

Training is deterministic for a given seed: weights start from `keras.utils.set_random_seed`, the
data order and augmentation are functions of (seed, epoch, step) (meshfit.data.arrays), Dropout's
random state is checkpointed, and TensorFlow runs with op determinism. So `--resume` of a killed
run ends with the same weights as an uninterrupted run on the same engine and devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfit import __version__, recipes
from meshfit.data import datasets, splits as data
from meshfit.run import models, rundir, spec
from meshfit.run.evaluate import evaluate_model, headline, score
from meshfit.run.results import totals, write_results
from meshfit.parallel import engine, planning
from meshfit.errors import MeshfitError
from meshfit.run.options import TrainOptions, at_least_one, check_fraction
from meshfit.run.spec import RunSpec, profiling_steps


# ------------------------------------------------------------------------------- evaluation and plots


# ---------------------------------------------------------------------------------- the steps

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
    resume, checkpoint = rundir.resume_target(options.resume) if options.resume else (None, None)
    saved, saved_config = spec.read(resume) if resume is not None else (None, None)
    if saved is not None:
        the_recipe = resumed_recipe(recipe, options, resume, saved)
    else:
        if isinstance(recipe, str) and recipes.is_file(recipe):
            from meshfit.parallel.distribution import start_engine

            start_engine(options.simulate_devices, options.engine, options.require)
        the_recipe = recipe if isinstance(recipe, recipes.Recipe) else recipes.load(recipe)
        changes = {"steps_per_epoch": options.steps_per_epoch,
                   "validation_split": options.validation_split}
        the_recipe = dataclasses.replace(the_recipe, **{k: v for k, v in changes.items() if v is not None})
    check_recipe(the_recipe)
    options = settle(options, the_recipe, saved)
    run = resume or rundir.new(options.out, the_recipe.name)  # checked before any slow work
    if resume:
        rundir.check_writable(resume)
    return Asked(the_recipe, options, run, saved, saved_config, checkpoint)


def resumed_recipe(recipe: str | recipes.Recipe | None, options: TrainOptions, resume: str,
                   saved: RunSpec) -> recipes.Recipe:
    """The recipe a resumed run trains (its own copy of a recipe file), checked against what
    was asked."""
    from_python = isinstance(recipe, recipes.Recipe) and not saved.recipe_file
    if saved.recipe_file:
        from meshfit.parallel.distribution import start_engine

        start_engine(options.simulate_devices or saved.simulated_devices,
                     options.engine or saved.engine, options.require)
    the_recipe = recipe if from_python else models.recipe_of_run(resume, saved)
    the_recipe = dataclasses.replace(the_recipe, steps_per_epoch=saved.steps_per_epoch,
                                     validation_split=saved.validation_split)
    asked = recipe.name if isinstance(recipe, recipes.Recipe) else recipe
    if asked and recipes.is_file(asked):  # the run's own copy trains; the file only names it
        same = (saved.recipe_sha256 and os.path.isfile(asked)
                and rundir.file_sha256(asked) == saved.recipe_sha256)
        asked = saved.recipe if same else recipes.load_file(asked).name
    spec.check_resume(saved, resume, recipe=asked, batch_size=options.batch_size,
                      seed=options.seed, precision=options.precision)
    return the_recipe


def check_recipe(recipe: recipes.Recipe) -> None:
    """The recipe's own settings checked as the flags that override them are."""
    at_least_one("steps_per_epoch", recipe.steps_per_epoch)
    check_fraction("validation_split", recipe.validation_split)
    planning.precision_name(recipe.precision)
    if recipe.dataset == "synthetic":
        raise MeshfitError(f"recipe {recipe.name} trains on random data to measure speed; "
                           f"time it with: meshfit bench {recipe.name}")


def settle(asked: TrainOptions, recipe: recipes.Recipe, saved: RunSpec | None) -> TrainOptions:
    """The options with their defaults filled in; on --resume the saved run's batch, seed and
    precision, and its other settings where not given again."""
    o = asked
    if saved is not None:
        o = dataclasses.replace(
            o, batch_size=saved.global_batch, seed=saved.seed, precision=saved.precision,
            batch_rounding=False,  # the data order depends on the batch: never round it
            epochs=saved.epochs if o.epochs is None else o.epochs,
            data_dir=o.data_dir or saved.data_dir, engine=o.engine or saved.engine,
            simulate_devices=o.simulate_devices or saved.simulated_devices,
            checkpoint_every=o.checkpoint_every or saved.checkpoint_every,
            keep_checkpoints=(saved.keep_checkpoints if o.keep_checkpoints is None
                              else o.keep_checkpoints),
            sharding=o.sharding or saved.sharding,
            fsdp_min_size=o.fsdp_min_size or saved.fsdp_min_bytes)  # the same program
        if o.micro_batches is None and saved.micro_batches and o.engine == "tensorflow":
            o = dataclasses.replace(o, micro_batches=saved.micro_batches)  # keeps its slices
    return dataclasses.replace(
        o, epochs=int(recipe.epochs if o.epochs is None else o.epochs),
        seed=spec.check_seed(o.seed), sharding=o.sharding or "auto",
        checkpoint_every=str(o.checkpoint_every or spec.DEFAULT_CHECKPOINT_EVERY),
        keep_checkpoints=(spec.DEFAULT_KEEP_CHECKPOINTS if o.keep_checkpoints is None
                          else o.keep_checkpoints),
        micro_batches=o.micro_batches or "auto")


def connect_devices(asked: Asked):
    """connect() with the run's engine, devices, precision and sharding: the Strategy."""
    from meshfit.parallel import sharding as sharding_lib
    from meshfit.parallel.distribution import connect  # no Keras until an engine is chosen

    o = asked.options
    return connect(require=o.require, simulate=o.simulate_devices, engine=o.engine,
                   precision=planning.asked_precision(o.precision, asked.recipe.precision),
                   verbose=o.verbose, sharding=o.sharding,
                   fsdp_min_bytes=o.fsdp_min_size or sharding_lib.DEFAULT_FSDP_MIN_BYTES,
                   device_memory=o.device_memory)


def check_batch(asked: Asked, strategy) -> None:
    """A batch that cannot split across the replicas fails now, before the data loads (slow);
    plan() decides the batch (and warns of rounding) once the data is known."""
    o, r = asked.options, asked.recipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planning.plan_global_batch(strategy.replicas, strategy.platform, strategy.device_kind,
                                   global_batch=o.batch_size or r.global_batch,
                                   per_core_batch=r.per_core_batch, rounding=o.batch_rounding)


def load_data(asked: Asked, strategy):
    """The run's data (data.RunData) and, for a streamed source, its batches (else None)."""
    o, r = asked.options, asked.recipe
    dataset = data.load(r, o.data_dir, o.seed, asked.saved.dataset if asked.saved else None)
    stream = (data.stream_batches(dataset, o.seed, strategy.replicas, r.steps_per_epoch)
              if dataset.from_source else None)  # the source sets the batch and the steps
    return dataset, stream


def plan(asked: Asked, strategy, dataset, stream) -> planning.Plan:
    """Batch, steps, steps per dispatch, precision and micro-batches of this run on these devices."""
    o, r = asked.options, asked.recipe
    return planning.plan(
        strategy, samples=None if stream else data.size(dataset.train), batch_size=o.batch_size,
        recipe_batch=r.global_batch, per_core_batch=r.per_core_batch,
        recipe_steps=r.steps_per_epoch,
        stream=(stream.global_batch, stream.steps_per_epoch) if stream else None,
        dispatch=o.steps_per_dispatch, precision=o.precision, recipe_precision=r.precision,
        micro_batches=o.micro_batches, rounding=o.batch_rounding)


def start_session(strategy, seed: int) -> None:
    """A fresh Keras session with this strategy active, seeded, deterministic on TensorFlow."""
    import keras

    keras.backend.clear_session()
    strategy.activate()
    engine.set_random_seed(seed)
    if strategy.engine == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()  # bit-identical resume on TensorFlow


def build(recipe: recipes.Recipe, dataset, steps: int, epochs: int, dispatch_steps: int):
    """The recipe's model, built, prepared and compiled (call inside the strategy's scope).
    dataset: anything with input_shape and num_classes (a data.RunData)."""
    model = recipe.build_model(tuple(recipe.input_shape or dataset.input_shape), dataset.num_classes)
    if recipe.compile is None:
        check_compile_signature(model)  # before prepare(), which may train a teacher first
    if recipe.prepare is not None:
        recipe.prepare(model, dataset)
    optimizer = recipe.optimizer(steps, epochs)
    if recipe.compile is None:
        model.compile(optimizer=optimizer, loss=recipe.make_loss(), metrics=["accuracy"],
                      steps_per_execution=dispatch_steps)
    else:  # the model's own compile signature (a subclassed model's)
        recipe.compile(model, optimizer)
        model.steps_per_execution = dispatch_steps
    return model


def check_compile_signature(model) -> None:
    """A one-line MeshfitError for a model whose own compile() cannot take meshfit's arguments
    (optimizer, loss, metrics, steps_per_execution), as keras-io's Distiller's: its recipe must
    say how to compile it."""
    import inspect

    parameters = inspect.signature(model.compile).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    missing = [name for name in ("optimizer", "loss", "metrics") if name not in parameters]
    if missing:
        own = ", ".join(name for name in parameters)
        raise MeshfitError(
            f"{type(model).__name__}.compile() has its own arguments ({own}) and no {missing[0]!r}; "
            f"say how to compile it in the recipe: meshfit.Recipe(..., compile=lambda model, "
            f"optimizer: model.compile(optimizer=optimizer, ...))")


def check_saveable(model, recipe: recipes.Recipe) -> None:
    """A one-line MeshfitError, before training, for a model that could not be written at the
    end: one Keras cannot serialize, from a recipe without a file to rebuild it from (see
    meshfit.run.models)."""
    why = models.unsaveable(model) if recipe.text is None else None
    if why:
        raise MeshfitError(f"Keras cannot save model {type(model).__name__} ({why}); give its "
                           "classes a get_config(), or train it from a recipe file, whose run "
                           "rebuilds it with build_model")


def make_spec(asked: Asked, strategy, dataset, *, steps: int, global_batch: int,
              dispatch: int, slices: int, command: str) -> RunSpec:
    """The run specification of this run on these devices."""
    import keras

    r, o = asked.recipe, asked.options
    per_epoch = dataset.per_epoch
    return RunSpec(
        recipe=r.name, dataset=dataset.source, class_names=tuple(dataset.class_names),
        input_shape=tuple(r.input_shape or dataset.input_shape), num_classes=dataset.num_classes,
        epochs=o.epochs, steps_per_epoch=steps, global_batch=global_batch,
        steps_per_dispatch=dispatch, micro_batches=slices, seed=o.seed,
        precision=strategy.precision, engine=strategy.engine, replicas=strategy.replicas,
        platform=strategy.platform, device_kind=strategy.device_kind,
        simulated_devices=strategy.info.devices_per_host if strategy.info.simulated else None,
        data_dir=spec.absolute(o.data_dir), validation_split=r.validation_split,
        evaluated_on=per_epoch[0] if per_epoch else "none",
        recipe_file=rundir.RECIPE if r.text is not None else None,
        recipe_sha256=rundir.text_sha256(r.text) if r.text is not None else None,
        recipe_source=r.file, augment=r.augment, crop_padding=r.crop_padding,
        flips=r.flips, tta_flip=r.tta_flip, checkpoint_every=o.checkpoint_every,
        keep_checkpoints=o.keep_checkpoints, meshfit_version=__version__,
        keras_version=keras.__version__, command=command, sharding=strategy.sharding,
        fsdp_min_bytes=strategy.fsdp_min_bytes)


def write_recipe(run: str, recipe: recipes.Recipe) -> None:
    """RUN/recipe.py: the text of a recipe file (or of a generated recipe) as it was trained."""
    path = os.path.join(run, rundir.RECIPE)
    if recipe.text is not None and not os.path.exists(path):
        with rundir.atomic_path(path, ".py") as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(recipe.text)


def restore(model, run: str, steps: int, labels: np.ndarray, checkpoint: str | None = None,
            classes: int | None = None) -> dict[str, Any]:
    """Load a checkpoint into the model; return its state (see checkpoints.restore).

    checkpoint: the one to load (as named on --resume); default the newest intact one: a damaged
    newer one is skipped with a warning (the run then repeats the steps it had saved). A run
    stopped before its first checkpoint starts from the beginning (its weights are those of a
    new run with its seed), recorded as resumed from checkpoint "none". classes: the width of
    the outputs of a subclassed model, which has no output_shape.
    """
    from meshfit.run import checkpoints  # imports Keras: only after connect() chose the engine

    directory = os.path.join(run, rundir.CHECKPOINTS)
    candidates = [checkpoint] if checkpoint else checkpoints.list_checkpoints(directory)[::-1]
    if not candidates:  # stopped before its first checkpoint: nothing to load, start again
        warnings.warn(f"{run} has no checkpoint yet; training it from the start", stacklevel=2)
        return {"epoch": 0, "step": 0, "history": [], "metrics_values": [],
                "path": os.path.join(directory, "none")}
    for i, path in enumerate(candidates):
        try:
            state = checkpoints.restore(model, path)
            if not isinstance(state.get("history"), list):
                raise checkpoints.CheckpointDamaged(f"checkpoint {path} is damaged (its state.json "
                                                    "lacks the history)")
            break
        except checkpoints.CheckpointDamaged as e:
            if i + 1 == len(candidates):
                if checkpoint:
                    raise
                raise MeshfitError(f"no intact checkpoint in {directory} (the oldest: {e}); "
                                   "start a new run") from None
            warnings.warn(f"{e}; resuming from {os.path.basename(candidates[i + 1])} instead",
                          stacklevel=2)
    if state["steps_per_epoch"] != steps:
        raise MeshfitError(f"{path} was taken at {state['steps_per_epoch']} steps per epoch but "
                           f"this run has {steps}; resume with the same data")
    _build_metrics(model, labels[:1], classes)
    state["path"] = path
    return state


def _build_metrics(model, labels: np.ndarray, classes: int | None) -> None:
    """Create the compiled metrics' variables now (Keras/TF makes them at the first step)."""
    shape = model.output_shape[1:] if hasattr(model, "output_shape") else (classes,)
    outputs = np.zeros((len(labels),) + tuple(shape), "float32")
    model.compute_metrics(None, labels, outputs)


def write_config(run: str, run_spec: RunSpec, saved_config: dict | None, resume_state, command: str) -> None:
    """config.json: the specification (and start time) of a new run; for a resumed run, the saved
    one with its epochs, sharding and fsdp threshold updated (a later --resume keeps them) and this
    resumption appended to "resumed"."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    if saved_config is None:
        config = {**run_spec.to_dict(), "started": now}
    else:
        config = {**saved_config, "epochs": run_spec.epochs, "sharding": run_spec.sharding,
                  "fsdp_min_bytes": run_spec.fsdp_min_bytes}
        config.setdefault("resumed", []).append({
            "command": command, "at": now, "checkpoint": os.path.basename(resume_state["path"]),
            "engine": run_spec.engine, "replicas": run_spec.replicas,
            "steps_per_dispatch": run_spec.steps_per_dispatch, "micro_batches": run_spec.micro_batches,
            "sharding": run_spec.sharding})
    rundir.write_json(os.path.join(run, rundir.CONFIG), config)


EVALUATION_NOTES = {  # what announce says about the per-epoch val_* metrics
    "test": "val_* on the test set each epoch, as the tutorials did; ",
    "validation": "val_* on a held-out validation split, the test set scored at the end; ",
    "validation-only": "val_* on a held-out validation split (no test set, so none is scored); ",
    "none": "no validation data (set validation_split); ",
    "test-own": "val_* on the test set each epoch (no validation split or source given); "}


def evaluation_note(run_spec: RunSpec, has_test: bool = True) -> str:
    """What the start line says about val_*: built-in recipes follow the tutorials, recipe files
    do not; a run without a test set (a folder without test/) says none is scored."""
    own = run_spec.evaluated_on == "test" and run_spec.recipe_file
    key = "test-own" if own else run_spec.evaluated_on
    return EVALUATION_NOTES.get("validation-only" if key == "validation" and not has_test else key, "")


def announce(run: str, run_spec: RunSpec, saved: RunSpec | None, resume_state,
             has_test: bool = True) -> None:
    """Print where training starts (resumed from which checkpoint) and what it will do."""
    if resume_state:
        note = ""
        if (saved.replicas, saved.engine) != (run_spec.replicas, run_spec.engine):
            note = (f" (the run began on {saved.replicas} replica(s) with {saved.engine}; "
                    "same data order, so results differ only by floating-point rounding)")
        print(f"resuming {run} from {os.path.basename(resume_state['path'])}: epoch "
              f"{resume_state['epoch'] + 1} step {resume_state['step']}{note}", flush=True)
    per_dispatch = (f", {run_spec.steps_per_dispatch} steps per dispatch"
                    if run_spec.steps_per_dispatch > 1 else "")
    if run_spec.micro_batches > 1:
        per_dispatch += f", gradients summed over {run_spec.micro_batches} cache-sized micro-batches"
    print(f"training {run_spec.recipe}: {run_spec.epochs} epoch(s) x {run_spec.steps_per_epoch} steps "
          f"of {run_spec.global_batch} images (global batch){per_dispatch}, seed {run_spec.seed}; "
          f"{evaluation_note(run_spec, has_test)}run directory {run}", flush=True)


class _EpochEnd:
    """At each epoch end: evaluate on the validation split, or the test set (adds val_loss and
    val_accuracy to the logs)."""

    def __init__(self, model, batches, labels, loss, tta_flip, report):
        self.model, self.batches, self.labels, self.loss = model, batches, labels, loss
        self.tta_flip, self.report = tta_flip, report

    def __call__(self, epoch, logs):
        self.report.on_test_begin()  # the epoch's training clock stops before validation
        scores = evaluate_model(self.model, self.batches, self.labels, self.loss, self.tta_flip)
        logs["val_loss"], logs["val_accuracy"] = scores["loss"], scores["accuracy"]


class _History:
    """At each epoch end: one record of the epoch's metrics and the EpochReport's figures."""

    def __init__(self, records: list[dict[str, Any]], report, global_batch: int):
        self.records, self.report, self.global_batch = records, report, global_batch

    def __call__(self, epoch, logs):
        stats = self.report.epochs[-1] if self.report.epochs else {}
        record = {"epoch": epoch + 1}
        record.update({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})
        record.update({k: stats.get(k) for k in ("train_seconds", "compile_seconds", "ms_per_step",
                                                  "samples_per_second", "mfu")})
        record["samples"] = stats.get("steps", 0) * self.global_batch
        self.records.append(record)


@dataclass
class Monitoring:
    """The callbacks that let people watch a run: `before` go first among fit's callbacks (the
    profiler, the transient progress bar), `after` after the EpochReport (TensorBoard reads it)."""

    before: list
    after: list

    def close(self) -> None:
        """Remove the bar and flush the logs, also after an interrupted fit."""
        for callback in self.before + self.after:
            if hasattr(callback, "close"):
                callback.close()


def monitoring(run: str, chief: bool, verbose: bool, report, global_batch: int, steps: int,
               tensorboard: bool, log_every: int, profile_steps: tuple[int, int] | None) -> Monitoring:
    """Profiler, progress bar and TensorBoard log for this run, on process 0 only."""
    if not chief:
        return Monitoring([], [])
    from meshfit.watch import profiling, progress, progress_bar

    logdir = os.path.join(run, rundir.TENSORBOARD)
    before, after = [], []
    if profile_steps:
        before.append(profiling.Profile(logdir, *profile_steps, steps_per_epoch=steps))
    if verbose and progress.live():
        before.append(progress_bar.ProgressBar(global_batch))
    if tensorboard:
        from meshfit.watch.tensorboard import TensorBoardLog

        after.append(TensorBoardLog(logdir, log_every=log_every, report=report,
                                    global_batch=global_batch, steps_per_epoch=steps))
    return Monitoring(before, after)


def fit(strategy, model, batches, callbacks: list, checkpointer, start: tuple[int, int],
        epochs: int, micro_batches: int = 1) -> None:
    """Fit from (epoch, step) `start` to the end: the rest of a cut epoch first, then whole ones.

    The rest of a cut epoch runs with steps per dispatch dividing its step count.
    SIGTERM/SIGINT make the checkpointer save and raise TrainingInterrupted.
    """
    from meshfit.run import checkpoints  # imports Keras: only after connect() chose the engine

    from meshfit.fit import jax_loop

    epoch, step = start
    steps, dispatch = batches.steps_per_epoch, model.steps_per_execution
    with checkpoints.stop_on_signals(checkpointer):
        if step and epoch < epochs:
            if (steps - step) % dispatch:
                jax_loop.install(model, planning.dividing_steps(steps - step, dispatch))
            strategy.fit(model, batches.iterate(epoch, step), epochs=epoch + 1, initial_epoch=epoch,
                         steps_per_epoch=steps - step, shuffle=False, callbacks=callbacks,
                         micro_batches=micro_batches)
            if model.steps_per_execution != dispatch:
                jax_loop.install(model, dispatch)
            epoch += 1
            if model.stop_training:  # a recipe callback (EarlyStopping) ended training
                return
        if epoch < epochs:
            strategy.fit(model, batches.iterate(epoch), epochs=epochs, initial_epoch=epoch,
                         steps_per_epoch=steps, shuffle=False, callbacks=callbacks,
                         micro_batches=micro_batches)


# ---------------------------------------------------------------------------------------- train

def train(recipe: str | recipes.Recipe | None = None, options: TrainOptions | None = None,
          **settings: Any) -> dict[str, Any]:
    """Train `recipe` (default fashion-mnist-cnn), write its run directory, return its metrics.

    recipe: a built-in recipe's name, a recipe file's path, or a Recipe.
    options: a meshfit.run.options.TrainOptions; `settings` are its fields by name (on top of
      `options` when both are given), e.g. epochs, batch_size (global, over all replicas),
      precision, steps_per_epoch and validation_split override the recipe's; data_dir, out,
      seed (default 0: weights, data order, augmentation and dropout all follow from it).
    resume: a run directory; training continues from its newest checkpoint with its settings
      (recipe, batch, seed, precision, data) and, unless given here, its engine and device count.
      A different replica count is accepted: the data order and random numbers do not depend on
      it, so only floating-point summation order differs from the original run. --epochs may
      extend a finished run.
    simulate_devices, engine, require, sharding, fsdp_min_size, device_memory: as for
      meshfit.connect (a resumed run keeps its sharding and fsdp threshold unless given); 'auto' sharding trains
      fsdp when the device memory is known and the replicated step does not fit
      (meshfit.parallel.memory_plan). checkpoint_every: "200" (steps), "60s"/"5m" (time, default
      60 s), "epoch" or "off"; keep_checkpoints (default 3); steps_per_dispatch, micro_batches,
      batch_rounding: see meshfit.parallel.planning.plan. callbacks: extra Keras callbacks for
      fit. command: the command line to record. tensorboard, log_every, profile: RUN/tensorboard
      scalars every `log_every` steps, and a trace of global train steps "START:STOP".
    Raises TrainingInterrupted (a MeshfitError; exit_code 143 or 130) after SIGTERM/SIGINT,
    once the state is saved.
    """
    options = dataclasses.replace(options, **settings) if options else TrainOptions(**settings)
    command = options.command or python_command(recipe, options)
    asked = specify(recipe, options)
    strategy = connect_devices(asked)
    check_batch(asked, strategy)
    dataset, stream = load_data(asked, strategy)
    the_plan = plan(asked, strategy, dataset, stream)
    strategy = settle_memory(asked, strategy, dataset, the_plan)
    from meshfit.parallel import cluster, stall

    stall.set_resume_hint(f"its committed checkpoints are intact: continue with meshfit train "
                          f"--resume {asked.run}")
    guard = stall.watching() if strategy.engine == "jax" else contextlib.nullcontext()
    with guard, strategy.scope():
        model, batches, run_spec = build_run(asked, strategy, dataset, stream, the_plan, command)
        chief = strategy.info.process_index == 0
        cluster.barrier("meshfit: run directory checked")  # before process 0 writes into it
        with rundir.lock(asked.run) if chief else contextlib.nullcontext():
            resume_state = (restore(model, asked.run, run_spec.steps_per_epoch,
                                    data.labels(dataset.train), asked.checkpoint,
                                    dataset.num_classes)
                            if asked.saved is not None else None)
            if chief:
                write_recipe(asked.run, asked.recipe)
                write_config(asked.run, run_spec, asked.saved_config, resume_state, command)
                if options.verbose:
                    announce(asked.run, run_spec, asked.saved, resume_state,
                             has_test=dataset.test is not None)
            history = fit_run(asked, strategy, model, batches, dataset, run_spec, resume_state)
            return score_and_write(asked, model, history, dataset, run_spec, chief)


def python_command(recipe: str | recipes.Recipe | None, options: TrainOptions) -> str:
    """How a run started from Python is recorded in config.json's `command`."""
    shown = ("epochs", "batch_size", "precision", "data_dir", "out", "seed", "resume")
    given = options.given()
    return spec.python_command(recipe=recipe, **{k: given[k] for k in shown if k in given})


def settle_memory(asked: Asked, strategy, dataset, the_plan: planning.Plan):
    """The strategy in the sharding whose train step fits the device memory, its session started."""
    from meshfit.parallel import memory_plan

    seed, epochs = asked.options.seed, asked.options.epochs
    strategy, _ = memory_plan.settle(
        strategy, lambda: build(asked.recipe, dataset, the_plan.steps_per_epoch or 1, epochs,
                                the_plan.steps_per_dispatch),
        the_plan.global_batch, lambda s: start_session(s, seed), asked.options.verbose)
    start_session(strategy, seed)
    return strategy


def build_run(asked: Asked, strategy, dataset, stream, the_plan: planning.Plan, command: str):
    """The batches, the compiled model and the run's specification (inside the strategy's scope)."""
    from meshfit.fit import tf_microbatch

    o, r, global_batch = asked.options, asked.recipe, the_plan.global_batch
    batches = stream if stream is not None else data.train_batches(
        dataset, r, global_batch, o.seed, the_plan.steps_per_epoch)
    steps = batches.steps_per_epoch
    model = build(r, dataset, steps, o.epochs, the_plan.steps_per_dispatch)
    check_saveable(model, r)
    slices = tf_microbatch.choose(model, global_batch, the_plan.micro_batches, strategy.engine)
    if stream is not None:  # every batch needs a row per slice
        slices = stream.slices = min(slices, stream.smallest_batch or slices)
    run_spec = make_spec(asked, strategy, dataset, steps=steps, global_batch=global_batch,
                         dispatch=the_plan.steps_per_dispatch, slices=slices, command=command)
    return model, batches, run_spec


def fit_run(asked: Asked, strategy, model, batches, dataset, run_spec: RunSpec,
            resume_state: dict | None) -> list[dict[str, Any]]:
    """Fit with the run's callbacks (evaluation, report, monitoring, the recipe's, checkpoints);
    return the history of every epoch, the resumed ones included."""
    import keras

    from meshfit.run import checkpoints
    from meshfit.watch.report import EpochReport

    o, r, run = asked.options, asked.recipe, asked.run
    chief = strategy.info.process_index == 0
    global_batch, steps = run_spec.global_batch, run_spec.steps_per_epoch
    history = list(resume_state["history"]) if resume_state else []
    own_callbacks = None
    if r.callbacks is not None:
        from meshfit.run.callbacks import RecipeCallbacks

        own_callbacks = RecipeCallbacks(
            r.callbacks(), resume_state.get("callbacks") if resume_state else None,
            resume_state.get("extra_arrays") if resume_state else None, epochs=o.epochs)
    every_steps, every_seconds, at_epoch_end = spec.parse_every(run_spec.checkpoint_every)
    report = EpochReport(batch_size=global_batch, strategy=strategy,
                         stream=None if chief else io.StringIO())
    checkpointer = checkpoints.Checkpointer(
        os.path.join(run, rundir.CHECKPOINTS), steps, every_steps=every_steps,
        every_seconds=every_seconds, epoch_end=at_epoch_end, keep=run_spec.keep_checkpoints,
        resume_state=resume_state, write=chief,
        extra=lambda: {"seed": run_spec.seed, "history": history, "config": run_spec.to_dict(),
                       "callbacks": own_callbacks.state() if own_callbacks else []},
        extra_arrays=lambda: own_callbacks.arrays() if own_callbacks else {})
    watch = monitoring(run, chief, o.verbose, report, global_batch, steps, o.tensorboard,
                       o.log_every, profiling_steps(o.profile))
    per_epoch = dataset.per_epoch
    evaluation = [keras.callbacks.LambdaCallback(on_epoch_end=_EpochEnd(
        model, data.eval_batches(dataset, per_epoch[1], global_batch),
        data.labels(per_epoch[1]), r.make_loss(), r.tta_flip, report))] if per_epoch else []
    fit_callbacks = [
        *watch.before, *evaluation, report, *watch.after,
        keras.callbacks.LambdaCallback(on_epoch_end=_History(history, report, global_batch)),
        *([own_callbacks] if own_callbacks else []), checkpointer, *(o.callbacks or [])]
    start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
    try:
        fit(strategy, model, batches, fit_callbacks, checkpointer, start, o.epochs,
            run_spec.micro_batches)
    except Exception as error:
        # TensorFlow hands a streamed folder's unreadable file on wrapped in its own error.
        failure = getattr(batches, "failure", None)
        if failure is not None and not isinstance(error, MeshfitError):
            raise failure from None
        raise
    finally:
        watch.close()
    return history


def score_and_write(asked: Asked, model, history: list, dataset, run_spec: RunSpec,
                    chief: bool) -> dict[str, Any]:
    """Score on the test set, write the model, history and metrics.json; return the metrics."""
    r, run = asked.recipe, asked.run
    scores = score(model, history, dataset, run_spec.global_batch, r.make_loss(), r.tta_flip,
                   run_spec.epochs)
    metrics = {**scores, **totals(history), **run_spec.to_dict(),
               "resumed": asked.saved is not None, "run_dir": run}
    from meshfit.run import checkpoints

    checkpoints.gather_for_saving(model)  # fsdp on several processes: every process
    if chief:
        write_results(run, model, history, metrics)
        if asked.options.verbose:
            name, accuracy, loss_value, samples = headline(scores)
            shown = (f"{name} accuracy {accuracy:.4f}  {name} loss {loss_value:.4f}  "
                     f"({samples} images); " if accuracy is not None else "")
            print(f"{shown}wrote {run}", flush=True)
    return metrics
