"""Training and evaluation of a recipe: the life of a run, one named step after another.

train() = specify -> connect -> plan the batch -> load the data -> plan the steps -> build the
model -> open the run directory (config.json) -> restore the newest checkpoint (when resuming)
-> fit -> score on the test set -> write the results. The run directory's files are described in
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
from meshfit.data import splits as data
from meshfit.run import models, rundir, spec
from meshfit.run.evaluate import evaluate_model, headline, score
from meshfit.run.results import totals, write_results
from meshfit.parallel import planning
from meshfit.errors import MeshfitError
from meshfit.run.spec import RunSpec, profiling_steps


# ------------------------------------------------------------------------------- evaluation and plots


# ---------------------------------------------------------------------------------- the steps

@dataclass(frozen=True)
class Request:
    """What the caller asked for, merged with the saved specification when resuming."""

    recipe: recipes.Recipe
    epochs: int
    batch_size: int | None
    seed: int
    precision: str
    data_dir: str | None
    engine: str | None
    simulate_devices: int | None
    checkpoint_every: str
    keep_checkpoints: int
    micro_batches: int | str


def specify(the_recipe: recipes.Recipe, *, epochs: int | None, batch_size: int | None, seed: int | None,
            precision: str | None, data_dir: str | None, engine: str | None,
            simulate_devices: int | None, checkpoint_every: str | int | None,
            keep_checkpoints: int | None, micro_batches: int | str | None,
            saved: RunSpec | None) -> Request:
    """The request checked, and with `saved` (a resumed run's specification) its gaps filled."""
    for flag, value in (("--epochs", epochs), ("--batch-size", batch_size),
                        ("--keep-checkpoints", keep_checkpoints)):
        if value is not None and value < 1:
            raise MeshfitError(f"{flag} must be at least 1, got {value}")
    if saved is not None:
        batch_size, seed, precision = saved.global_batch, saved.seed, saved.precision
        epochs = epochs if epochs is not None else saved.epochs
        data_dir = data_dir or saved.data_dir
        engine = engine or saved.engine
        simulate_devices = simulate_devices or saved.simulated_devices
        checkpoint_every = checkpoint_every or saved.checkpoint_every
        keep_checkpoints = keep_checkpoints if keep_checkpoints is not None else saved.keep_checkpoints
        if micro_batches is None and saved.micro_batches and engine == "tensorflow":
            micro_batches = saved.micro_batches  # a resumed run keeps its slices where it can
    if the_recipe.steps_per_epoch is not None and the_recipe.steps_per_epoch < 1:
        raise MeshfitError(f"--steps-per-epoch must be at least 1, got {the_recipe.steps_per_epoch}")
    if not 0 <= the_recipe.validation_split < 1:
        raise MeshfitError(f"--validation-split must be at least 0 and below 1, got "
                           f"{the_recipe.validation_split}")
    if the_recipe.dataset == "synthetic":
        raise MeshfitError(f"recipe {the_recipe.name} trains on random data to measure speed; "
                           f"time it with: meshfit bench {the_recipe.name}")
    epochs = int(the_recipe.epochs if epochs is None else epochs)
    spec.parse_every(checkpoint_every)  # checked now, before any slow work
    if micro_batches not in (None, "auto"):
        from meshfit.fit import tf_microbatch

        tf_microbatch.check(None, micro_batches)
    precision = the_recipe.precision if precision in (None, "auto") else precision
    return Request(the_recipe, epochs, batch_size, spec.check_seed(seed),
                   planning.check_precision(precision), data_dir, engine, simulate_devices,
                   str(checkpoint_every or spec.DEFAULT_CHECKPOINT_EVERY),
                   spec.DEFAULT_KEEP_CHECKPOINTS if keep_checkpoints is None else keep_checkpoints,
                   micro_batches or "auto")


def plan_steps(recipe: recipes.Recipe, samples: int, global_batch: int) -> int | None:
    """Train steps per epoch: the recipe's, at most one pass over `samples` (None: too few)."""
    full_steps = samples // global_batch
    return min(recipe.steps_per_epoch or full_steps, full_steps) or None


def fit_batch_to_data(global_batch: int, samples: int, replicas: int, planned: bool) -> int:
    """A planned (not asked-for) global batch lowered to at most a quarter of the training samples,
    in whole samples per replica, so that a small folder still gets several steps per epoch."""
    if not planned or global_batch * 4 <= samples:
        return global_batch
    return max(samples // 4 // replicas, 1) * replicas


def start_session(strategy, seed: int) -> None:
    """A fresh Keras session with this strategy active, seeded, deterministic on TensorFlow."""
    import keras

    keras.backend.clear_session()
    strategy.activate()
    keras.utils.set_random_seed(seed)
    if strategy.engine == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()  # bit-identical resume on TensorFlow


def build(recipe: recipes.Recipe, dataset, steps: int, epochs: int, dispatch_steps: int):
    """The recipe's model, built, prepared and compiled (call inside the strategy's scope).
    dataset: anything with input_shape and num_classes (a data.RunData)."""
    model = recipe.build_model(tuple(recipe.input_shape or dataset.input_shape), dataset.num_classes)
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


def check_saveable(model, recipe: recipes.Recipe) -> None:
    """A one-line MeshfitError, before training, for a model that could not be written at the
    end: one Keras cannot serialize, from a recipe without a file to rebuild it from (see
    meshfit.run.models)."""
    why = models.unsaveable(model) if recipe.text is None else None
    if why:
        raise MeshfitError(f"Keras cannot save model {type(model).__name__} ({why}); give its "
                           "classes a get_config(), or train it from a recipe file, whose run "
                           "rebuilds it with build_model")


def make_spec(request: Request, strategy, dataset, *, steps: int, global_batch: int,
              dispatch: int, slices: int, command: str) -> RunSpec:
    """The run specification of this run on these devices."""
    import keras

    r = request.recipe
    per_epoch = dataset.per_epoch
    return RunSpec(
        recipe=r.name, dataset=dataset.source, class_names=tuple(dataset.class_names),
        input_shape=tuple(r.input_shape or dataset.input_shape), num_classes=dataset.num_classes,
        epochs=request.epochs, steps_per_epoch=steps, global_batch=global_batch,
        steps_per_dispatch=dispatch, micro_batches=slices, seed=request.seed,
        precision=strategy.precision, engine=strategy.engine, replicas=strategy.replicas,
        platform=strategy.platform, device_kind=strategy.device_kind,
        simulated_devices=strategy.info.devices_per_host if strategy.info.simulated else None,
        data_dir=spec.absolute(request.data_dir), validation_split=r.validation_split,
        evaluated_on=per_epoch[0] if per_epoch else "none",
        recipe_file=rundir.RECIPE if r.text is not None else None,
        recipe_sha256=rundir.text_sha256(r.text) if r.text is not None else None,
        recipe_source=r.file, augment=r.augment, crop_padding=r.crop_padding,
        flips=r.flips, tta_flip=r.tta_flip, checkpoint_every=request.checkpoint_every,
        keep_checkpoints=request.keep_checkpoints, meshfit_version=__version__,
        keras_version=keras.__version__, command=command, sharding=strategy.sharding)


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
    one with its epochs updated and this resumption appended to "resumed"."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    if saved_config is None:
        config = {**run_spec.to_dict(), "started": now}
    else:
        config = {**saved_config, "epochs": run_spec.epochs}
        config.setdefault("resumed", []).append({
            "command": command, "at": now, "checkpoint": os.path.basename(resume_state["path"]),
            "engine": run_spec.engine, "replicas": run_spec.replicas,
            "steps_per_dispatch": run_spec.steps_per_dispatch, "micro_batches": run_spec.micro_batches})
    rundir.write_json(os.path.join(run, rundir.CONFIG), config)


EVALUATION_NOTES = {  # what announce says about the per-epoch val_* metrics
    "test": "val_* on the test set each epoch, as the tutorials did; ",
    "validation": "val_* on a held-out validation split, the test set scored at the end; ",
    "none": "no validation data (set validation_split); ",
    "test-own": "val_* on the test set each epoch (no validation split or source given); "}


def evaluation_note(run_spec: RunSpec) -> str:
    """What the start line says about val_*: built-in recipes follow the tutorials, recipe files do not."""
    own = run_spec.evaluated_on == "test" and run_spec.recipe_file
    return EVALUATION_NOTES.get("test-own" if own else run_spec.evaluated_on, "")


def announce(run: str, run_spec: RunSpec, saved: RunSpec | None, resume_state) -> None:
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
          f"{evaluation_note(run_spec)}run directory {run}", flush=True)


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

def train(recipe: str | recipes.Recipe | None = None, *, epochs: int | None = None, batch_size: int | None = None,
          precision: str | None = None, data_dir: str | None = None, out: str | None = None,
          seed: int | None = None, simulate_devices: int | None = None, engine: str | None = None,
          require: str | None = None, resume: str | None = None,
          checkpoint_every: str | int | None = None, keep_checkpoints: int | None = None,
          steps_per_dispatch: int | None = None, micro_batches: int | str | None = None,
          batch_rounding: bool = True, callbacks: list | None = None, verbose: bool = True,
          command: str | None = None, tensorboard: bool = True, log_every: int = 10,
          profile: str | None = None, steps_per_epoch: int | None = None,
          validation_split: float | None = None, sharding: str | None = None,
          fsdp_min_size: int | str | None = None,
          device_memory: int | str | None = None) -> dict[str, Any]:
    """Train `recipe` (default fashion-mnist-cnn), write its run directory, return its metrics.

    recipe: a built-in recipe's name, a recipe file's path, or a Recipe.

    epochs, batch_size (global, over all replicas), precision, steps_per_epoch, validation_split:
      override the recipe's.
    data_dir: where the dataset is (see meshfit.data.datasets.load). out: the run directory.
    seed: weights, data order, augmentation and dropout all follow from it (default 0).
    simulate_devices, engine, require: as for meshfit.connect.
    resume: a run directory; training continues from its newest checkpoint with its settings
      (recipe, batch, seed, precision, data) and, unless given here, its engine and device count.
      A different replica count is accepted: the data order and random numbers do not depend on
      it, so only floating-point summation order differs from the original run. --epochs may
      extend a finished run.
    checkpoint_every: "200" (steps), "60s"/"5m" (time, default 60 s), "epoch" or "off".
    keep_checkpoints: how many checkpoints to keep (default 3). steps_per_dispatch: train steps
      per call into the devices (default: see planning.steps_per_dispatch). micro_batches: slices
      of each batch whose gradients are summed, for cache locality on a CPU (default 'auto', see
      meshfit.fit.tf_microbatch; 1 = whole batches). batch_rounding: False makes a global batch that
      does not split across the replicas an error instead of rounding it up.
    callbacks: extra Keras callbacks for fit. command: the command line to record.
    tensorboard: write TensorBoard scalars to RUN/tensorboard (train/* every `log_every` steps,
      epoch/*, speed/*). profile: "START:STOP" traces those global train steps into
      RUN/tensorboard/plugins/profile. A live progress bar is drawn when stdout is a terminal.
    sharding, fsdp_min_size, device_memory: as for meshfit.connect (a resumed run keeps its
      sharding unless given); 'auto' (default) trains fsdp when the device memory is known and
      the replicated step does not fit (meshfit.parallel.memory_plan), and a mode that cannot fit is refused.
    Raises TrainingInterrupted (a MeshfitError; exit_code 143 or 130) after SIGTERM/SIGINT,
    once the state is saved.
    """
    command = command or spec.python_command(recipe=recipe, epochs=epochs, batch_size=batch_size,
                                             precision=precision, data_dir=data_dir, out=out,
                                             seed=seed, resume=resume)
    from meshfit.parallel.distribution import connect, start_engine  # no Keras until an engine is chosen

    resume, resume_checkpoint = rundir.resume_target(resume) if resume else (resume, None)
    saved, saved_config = spec.read(resume) if resume is not None else (None, None)
    if saved is not None:
        from_python = isinstance(recipe, recipes.Recipe) and not saved.recipe_file
        if saved.recipe_file:
            start_engine(simulate_devices or saved.simulated_devices, engine or saved.engine,
                         require)
        the_recipe = recipe if from_python else models.recipe_of_run(resume, saved)
        the_recipe = dataclasses.replace(the_recipe, steps_per_epoch=saved.steps_per_epoch,
                                         validation_split=saved.validation_split)
        asked = recipe.name if isinstance(recipe, recipes.Recipe) else recipe
        if asked and recipes.is_file(asked):  # the run's own copy trains; the file only names it
            same = (saved.recipe_sha256 and os.path.isfile(asked)
                    and rundir.file_sha256(asked) == saved.recipe_sha256)
            asked = saved.recipe if same else recipes.load_file(asked).name
        spec.check_resume(saved, resume, recipe=asked, batch_size=batch_size, seed=seed,
                          precision=precision)
    else:
        if isinstance(recipe, str) and recipes.is_file(recipe):
            start_engine(simulate_devices, engine, require)
        the_recipe = recipe if isinstance(recipe, recipes.Recipe) else recipes.load(recipe)
        changes = {"steps_per_epoch": steps_per_epoch, "validation_split": validation_split}
        the_recipe = dataclasses.replace(the_recipe, **{k: v for k, v in changes.items() if v is not None})
    request = specify(the_recipe, epochs=epochs, batch_size=batch_size, seed=seed, precision=precision,
                      data_dir=data_dir, engine=engine, simulate_devices=simulate_devices,
                      checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                      micro_batches=micro_batches, saved=saved)
    the_recipe = request.recipe
    profile_steps = profiling_steps(profile)
    if log_every < 1:
        raise MeshfitError(f"--log-every must be at least 1, got {log_every}")
    run = resume or rundir.new(out, the_recipe.name)  # checked before any slow work
    if resume:
        rundir.check_writable(resume)

    from meshfit.parallel import memory_plan, sharding as sharding_lib

    strategy = connect(require=require, simulate=request.simulate_devices, engine=request.engine,
                       precision=request.precision, verbose=verbose,
                       sharding=sharding or (saved.sharding if saved else "auto"),
                       fsdp_min_bytes=fsdp_min_size or sharding_lib.DEFAULT_FSDP_MIN_BYTES,
                       device_memory=device_memory)
    chief = strategy.info.process_index == 0
    asked_batch = request.batch_size or the_recipe.global_batch
    global_batch = planning.plan_global_batch(
        strategy.replicas, strategy.platform, strategy.device_kind, global_batch=asked_batch,
        per_core_batch=the_recipe.per_core_batch, rounding=batch_rounding and saved is None)
    dataset = data.load(the_recipe, request.data_dir, request.seed, saved.dataset if saved else None)
    stream = None
    if dataset.from_source:  # the source sets the batch and, counted, the steps
        stream = data.stream_batches(dataset, request.seed, strategy.replicas,
                                     the_recipe.steps_per_epoch)
        if request.batch_size and request.batch_size != stream.global_batch:
            raise MeshfitError(f"the recipe's train source yields batches of {stream.global_batch} "
                               f"samples on {strategy.replicas} replica(s), not --batch-size "
                               f"{request.batch_size}; batch the source itself")
        global_batch, steps = stream.global_batch, stream.steps_per_epoch
    else:
        train_samples = data.size(dataset.train)
        global_batch = fit_batch_to_data(global_batch, train_samples, strategy.replicas,
                                         planned=not asked_batch and not the_recipe.per_core_batch)
        steps = plan_steps(the_recipe, train_samples, global_batch)
    dispatch = planning.steps_per_dispatch(strategy.platform, strategy.engine, steps or 1,
                                           steps_per_dispatch)
    strategy, _ = memory_plan.settle(
        strategy, lambda: build(the_recipe, dataset, steps or 1, request.epochs, dispatch),
        global_batch, lambda s: start_session(s, request.seed), verbose)
    start_session(strategy, request.seed)

    import keras

    from meshfit.run import checkpoints
    from meshfit.parallel import cluster
    from meshfit.fit import tf_microbatch
    from meshfit.watch.report import EpochReport

    with strategy.scope():
        batches = stream if stream is not None else data.train_batches(
            dataset, the_recipe, global_batch, request.seed, steps)
        steps = batches.steps_per_epoch
        model = build(the_recipe, dataset, steps, request.epochs, dispatch)
        check_saveable(model, the_recipe)
        slices = tf_microbatch.choose(model, global_batch, request.micro_batches, strategy.engine)
        if stream is not None:  # every batch needs a row per slice
            slices = stream.slices = min(slices, stream.smallest_batch or slices)
        run_spec = make_spec(request, strategy, dataset, steps=steps, global_batch=global_batch,
                             dispatch=dispatch, slices=slices, command=command)

        cluster.barrier("meshfit: run directory checked")  # before process 0 writes into it
        with rundir.lock(run) if chief else contextlib.nullcontext():
            resume_state = (restore(model, run, steps, data.labels(dataset.train),
                                    resume_checkpoint, dataset.num_classes)
                            if saved is not None else None)
            history = list(resume_state["history"]) if resume_state else []
            own_callbacks = None
            if the_recipe.callbacks is not None:
                from meshfit.run.callbacks import RecipeCallbacks

                own_callbacks = RecipeCallbacks(
                    the_recipe.callbacks(), resume_state.get("callbacks") if resume_state else None,
                    resume_state.get("extra_arrays") if resume_state else None, epochs=request.epochs)
            if chief:
                write_recipe(run, the_recipe)
                write_config(run, run_spec, saved_config, resume_state, command)
                if verbose:
                    announce(run, run_spec, saved, resume_state)

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
            loss = the_recipe.make_loss()
            watch = monitoring(run, chief, verbose, report, global_batch, steps, tensorboard,
                               log_every, profile_steps)
            per_epoch = dataset.per_epoch
            evaluation = [keras.callbacks.LambdaCallback(on_epoch_end=_EpochEnd(
                model, data.eval_batches(dataset, per_epoch[1], global_batch),
                data.labels(per_epoch[1]), loss, the_recipe.tta_flip, report))] if per_epoch else []
            fit_callbacks = [
                *watch.before, *evaluation, report, *watch.after,
                keras.callbacks.LambdaCallback(on_epoch_end=_History(history, report, global_batch)),
                *([own_callbacks] if own_callbacks else []), checkpointer, *(callbacks or [])]
            start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
            try:
                fit(strategy, model, batches, fit_callbacks, checkpointer, start, request.epochs,
                    slices)
            except Exception as error:
                # TensorFlow hands a streamed folder's unreadable file on wrapped in its own error.
                failure = getattr(batches, "failure", None)
                if failure is not None and not isinstance(error, MeshfitError):
                    raise failure from None
                raise
            finally:
                watch.close()

            scores = score(model, history, dataset, global_batch, loss, the_recipe.tta_flip,
                           request.epochs)
            metrics = {**scores, **totals(history), **run_spec.to_dict(),
                       "resumed": saved is not None, "run_dir": run}
            if chief:
                write_results(run, model, history, metrics)
                if verbose:
                    name, accuracy, loss_value, samples = headline(scores)
                    shown = (f"{name} accuracy {accuracy:.4f}  {name} loss {loss_value:.4f}  "
                             f"({samples} images); " if accuracy is not None else "")
                    print(f"{shown}wrote {run}", flush=True)
    return metrics


# ----------------------------------------------------------------------------------------- eval


