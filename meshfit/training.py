"""Training and evaluation of a recipe: the life of a run, one named step after another.

train() = specify -> connect -> plan the batch -> load the data -> plan the steps -> build the
model -> open the run directory (config.json) -> restore the newest checkpoint (when resuming)
-> fit -> score on the test set -> write the results. The run directory's files are described in
meshfit.rundir, the specification in meshfit.spec. Only process 0 prints and writes.

Training is deterministic for a given seed: weights start from `keras.utils.set_random_seed`, the
data order and augmentation are functions of (seed, epoch, step) (meshfit.pipeline), Dropout's
random state is checkpointed, and TensorFlow runs with op determinism. So `--resume` of a killed
run ends with the same weights as an uninterrupted run on the same engine and devices.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshfit import __version__, checkpoints, datasets, planning, recipes, rundir, spec
from meshfit.errors import MeshfitError
from meshfit.profiling import profiling_steps
from meshfit.spec import RunSpec


# ------------------------------------------------------------------------------- evaluation and plots

def _loss_value(loss, labels: np.ndarray, outputs: np.ndarray) -> float:
    """The mean of `loss` over all samples (loss: a Keras loss name or object)."""
    import keras

    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    return float(np.mean(keras.ops.convert_to_numpy(fn(labels, outputs))))


def evaluate_model(model, batches, labels: np.ndarray, loss,
                   tta_flip: bool = False) -> dict[str, float]:
    """Test accuracy and mean loss over every sample of `batches` (a pipeline.EvalBatches)."""
    from meshfit import pipeline

    outputs = pipeline.predict(model, batches, tta_flip=tta_flip)
    accuracy = float(np.mean(np.argmax(outputs, axis=-1) == labels.reshape(-1)))
    return {"test_accuracy": accuracy, "test_loss": _loss_value(loss, labels, outputs)}


def plot_curves(history: list[dict[str, Any]], path: str, title: str) -> None:
    """Save loss and accuracy per epoch (train and test) as a two-panel PNG."""
    from matplotlib.figure import Figure

    epochs = [record["epoch"] for record in history]
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    for axes, metric in zip(figure.subplots(1, 2), ("loss", "accuracy")):
        for key, label in ((metric, "train"), (f"val_{metric}", "test")):
            values = [record.get(key) for record in history]
            if any(v is not None for v in values):
                axes.plot(epochs, [np.nan if v is None else v for v in values], marker="o", label=label)
        axes.set_xlabel("epoch")
        axes.set_ylabel(metric)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.savefig(path)


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


def specify(recipe: str | None, *, epochs: int | None, batch_size: int | None, seed: int | None,
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
        recipe, batch_size, seed, precision = saved.recipe, saved.global_batch, saved.seed, saved.precision
        epochs = epochs if epochs is not None else saved.epochs
        data_dir = data_dir or saved.data_dir
        engine = engine or saved.engine
        simulate_devices = simulate_devices or saved.simulated_devices
        checkpoint_every = checkpoint_every or saved.checkpoint_every
        keep_checkpoints = keep_checkpoints if keep_checkpoints is not None else saved.keep_checkpoints
        if micro_batches is None and saved.micro_batches and engine == "tensorflow":
            micro_batches = saved.micro_batches  # a resumed run keeps its slices where it can
    the_recipe = recipes.get(recipe or recipes.DEFAULT)
    if the_recipe.dataset == "synthetic":
        raise MeshfitError(f"recipe {the_recipe.name} trains on random data to measure speed; "
                           f"time it with: meshfit bench {the_recipe.name}")
    epochs = int(the_recipe.epochs if epochs is None else epochs)
    spec.parse_every(checkpoint_every)  # checked now, before any slow work
    if micro_batches not in (None, "auto"):
        from meshfit import tf_microbatch

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
    """The recipe's model, built, prepared and compiled (call inside the strategy's scope)."""
    model = recipe.build_model(tuple(recipe.input_shape or dataset.input_shape), dataset.num_classes)
    if recipe.prepare is not None:
        recipe.prepare(model, dataset)
    model.compile(optimizer=recipe.optimizer(steps, epochs), loss=recipe.make_loss(),
                  metrics=["accuracy"], steps_per_execution=dispatch_steps)
    return model


def make_spec(request: Request, strategy, dataset, *, steps: int, global_batch: int,
              dispatch: int, slices: int, command: str) -> RunSpec:
    """The run specification of this run on these devices."""
    import keras

    r = request.recipe
    return RunSpec(
        recipe=r.name, dataset=r.dataset, class_names=tuple(dataset.class_names),
        input_shape=tuple(r.input_shape or dataset.input_shape), num_classes=dataset.num_classes,
        epochs=request.epochs, steps_per_epoch=steps, global_batch=global_batch,
        steps_per_dispatch=dispatch, micro_batches=slices, seed=request.seed,
        precision=strategy.precision, engine=strategy.engine, replicas=strategy.replicas,
        platform=strategy.platform, device_kind=strategy.device_kind,
        simulated_devices=strategy.info.devices_per_host if strategy.info.simulated else None,
        data_dir=spec.absolute(request.data_dir), augment=r.augment, crop_padding=r.crop_padding,
        flips=r.flips, tta_flip=r.tta_flip, checkpoint_every=request.checkpoint_every,
        keep_checkpoints=request.keep_checkpoints, meshfit_version=__version__,
        keras_version=keras.__version__, command=command)


def restore(model, run: str, steps: int, labels: np.ndarray) -> dict[str, Any]:
    """Load the run's newest checkpoint into the model; return its state (see checkpoints.restore)."""
    directory = os.path.join(run, rundir.CHECKPOINTS)
    newest = checkpoints.latest(directory)
    if newest is None:
        raise MeshfitError(f"{directory} has no checkpoint to resume from; start a new run")
    state = checkpoints.restore(model, newest)
    if state["steps_per_epoch"] != steps:
        raise MeshfitError(f"{newest} was taken at {state['steps_per_epoch']} steps per epoch but "
                           f"this run has {steps}; resume with the same data")
    _build_metrics(model, labels[:1])
    state["path"] = newest
    return state


def _build_metrics(model, labels: np.ndarray) -> None:
    """Create the compiled metrics' variables now (Keras/TF makes them at the first step)."""
    outputs = np.zeros((len(labels),) + tuple(model.output_shape[1:]), "float32")
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
          f"run directory {run}", flush=True)


class _EpochEnd:
    """At each epoch end: evaluate on the test set (adds val_loss/val_accuracy to the logs)."""

    def __init__(self, model, batches, labels, loss, tta_flip, report):
        self.model, self.batches, self.labels, self.loss = model, batches, labels, loss
        self.tta_flip, self.report = tta_flip, report

    def __call__(self, epoch, logs):
        self.report.on_test_begin()  # the epoch's training clock stops before validation
        scores = evaluate_model(self.model, self.batches, self.labels, self.loss, self.tta_flip)
        logs["val_loss"], logs["val_accuracy"] = scores["test_loss"], scores["test_accuracy"]


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
    from meshfit import profiling, progress

    logdir = os.path.join(run, rundir.TENSORBOARD)
    before, after = [], []
    if profile_steps:
        before.append(profiling.Profile(logdir, *profile_steps, steps_per_epoch=steps))
    if verbose and progress.bars():
        before.append(progress.ProgressBar(global_batch))
    if tensorboard:
        from meshfit.tensorboard_log import TensorBoardLog

        after.append(TensorBoardLog(logdir, log_every=log_every, report=report,
                                    global_batch=global_batch, steps_per_epoch=steps))
    return Monitoring(before, after)


def fit(strategy, model, batches, callbacks: list, checkpointer, start: tuple[int, int],
        epochs: int, micro_batches: int = 1) -> None:
    """Fit from (epoch, step) `start` to the end: the rest of a cut epoch first, then whole ones.

    The rest of a cut epoch runs with steps per dispatch dividing its step count.
    SIGTERM/SIGINT make the checkpointer save and raise TrainingInterrupted.
    """
    from meshfit import jax_loop

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
        if epoch < epochs:
            strategy.fit(model, batches.iterate(epoch), epochs=epochs, initial_epoch=epoch,
                         steps_per_epoch=steps, shuffle=False, callbacks=callbacks,
                         micro_batches=micro_batches)


def score(model, history: list[dict[str, Any]], test_batches, labels: np.ndarray, loss,
          tta_flip: bool, epochs: int) -> dict[str, float]:
    """Test accuracy and loss: the last epoch's evaluation when it ran, else evaluated now."""
    final = history[-1] if history else {}
    if final.get("epoch") == epochs and "val_accuracy" in final:
        return {"test_accuracy": final["val_accuracy"], "test_loss": final["val_loss"]}
    return evaluate_model(model, test_batches, labels, loss, tta_flip)


def totals(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The last epoch's training loss and accuracy, and time and speed summed over all epochs."""
    final = history[-1] if history else {}
    train_seconds = sum(r.get("train_seconds") or 0.0 for r in history)
    samples = sum(r.get("samples") or 0 for r in history)
    return {"train_accuracy": final.get("accuracy"), "train_loss": final.get("loss"),
            "train_seconds": train_seconds,
            "compile_seconds": sum(r.get("compile_seconds") or 0.0 for r in history),
            "samples_per_second": samples / train_seconds if train_seconds else None}


def write_results(run: str, model, history: list, metrics: dict[str, Any]) -> None:
    """model.keras, history.json, metrics.json and curves.png in the run directory."""
    from meshfit.distribution import without_distribution

    with rundir.atomic_path(os.path.join(run, rundir.MODEL), ".keras") as tmp:
        with without_distribution():  # saving alone under the multi-host mesh would wait for the others
            model.save(tmp)
    rundir.write_json(os.path.join(run, rundir.HISTORY), history)
    rundir.write_json(os.path.join(run, rundir.METRICS), metrics)
    plot_curves(history, os.path.join(run, rundir.CURVES),
                f"{metrics['recipe']}: test accuracy {metrics['test_accuracy']:.2%}")


# ---------------------------------------------------------------------------------------- train

def train(recipe: str | None = None, *, epochs: int | None = None, batch_size: int | None = None,
          precision: str | None = None, data_dir: str | None = None, out: str | None = None,
          seed: int | None = None, simulate_devices: int | None = None, engine: str | None = None,
          require: str | None = None, resume: str | None = None,
          checkpoint_every: str | int | None = None, keep_checkpoints: int | None = None,
          steps_per_dispatch: int | None = None, micro_batches: int | str | None = None,
          batch_rounding: bool = True, callbacks: list | None = None, verbose: bool = True,
          command: str | None = None, tensorboard: bool = True, log_every: int = 10,
          profile: str | None = None) -> dict[str, Any]:
    """Train `recipe` (default fashion-mnist-cnn), write its run directory, return its metrics.

    epochs, batch_size (global, over all replicas), precision: override the recipe's.
    data_dir: where the dataset is (see meshfit.datasets.load). out: the run directory.
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
      meshfit.tf_microbatch; 1 = whole batches). batch_rounding: False makes a global batch that
      does not split across the replicas an error instead of rounding it up.
    callbacks: extra Keras callbacks for fit. command: the command line to record.
    tensorboard: write TensorBoard scalars to RUN/tensorboard (train/* every `log_every` steps,
      epoch/*, speed/*). profile: "START:STOP" traces those global train steps into
      RUN/tensorboard/plugins/profile. A live progress bar is drawn when stdout is a terminal.
    Raises TrainingInterrupted (a MeshfitError; exit_code 143 or 130) after SIGTERM/SIGINT,
    once the state is saved.
    """
    command = command or spec.python_command(recipe=recipe, epochs=epochs, batch_size=batch_size,
                                             precision=precision, data_dir=data_dir, out=out,
                                             seed=seed, resume=resume)
    saved, saved_config = spec.read(resume) if resume is not None else (None, None)
    if saved is not None:
        spec.check_resume(saved, resume, recipe=recipe, batch_size=batch_size, seed=seed,
                          precision=precision)
    request = specify(recipe, epochs=epochs, batch_size=batch_size, seed=seed, precision=precision,
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

    from meshfit.distribution import connect

    strategy = connect(require=require, simulate=request.simulate_devices, engine=request.engine,
                       precision=request.precision, verbose=verbose)
    chief = strategy.info.process_index == 0
    global_batch = planning.plan_global_batch(
        strategy.replicas, strategy.platform, strategy.device_kind,
        global_batch=request.batch_size or the_recipe.global_batch,
        per_core_batch=the_recipe.per_core_batch, rounding=batch_rounding and saved is None)
    dataset = datasets.load(the_recipe.dataset, request.data_dir)
    steps = plan_steps(the_recipe, len(dataset.x_train), global_batch)
    dispatch = planning.steps_per_dispatch(strategy.platform, strategy.engine, steps or 1,
                                           steps_per_dispatch)
    start_session(strategy, request.seed)

    import keras

    from meshfit import cluster, pipeline, tf_microbatch
    from meshfit.report import EpochReport

    with strategy.scope():
        batches = pipeline.TrainBatches(dataset.x_train, dataset.y_train, global_batch, request.seed,
                                        steps, the_recipe.augment, crop_padding=the_recipe.crop_padding,
                                        flips=the_recipe.flips)
        test_batches = pipeline.EvalBatches(dataset.x_test, global_batch)
        steps = batches.steps_per_epoch
        model = build(the_recipe, dataset, steps, request.epochs, dispatch)
        slices = tf_microbatch.choose(model, global_batch, request.micro_batches, strategy.engine)
        run_spec = make_spec(request, strategy, dataset, steps=steps, global_batch=global_batch,
                             dispatch=dispatch, slices=slices, command=command)

        cluster.barrier("meshfit: run directory checked")  # before process 0 writes into it
        with rundir.lock(run) if chief else contextlib.nullcontext():
            resume_state = restore(model, run, steps, dataset.y_train) if saved is not None else None
            history = list(resume_state["history"]) if resume_state else []
            if chief:
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
                extra=lambda: {"seed": run_spec.seed, "history": history, "config": run_spec.to_dict()})
            loss = the_recipe.make_loss()
            watch = monitoring(run, chief, verbose, report, global_batch, steps, tensorboard,
                               log_every, profile_steps)
            fit_callbacks = [
                *watch.before,
                keras.callbacks.LambdaCallback(on_epoch_end=_EpochEnd(
                    model, test_batches, dataset.y_test, loss, the_recipe.tta_flip, report)),
                report, *watch.after,
                keras.callbacks.LambdaCallback(on_epoch_end=_History(history, report, global_batch)),
                checkpointer, *(callbacks or [])]
            start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
            try:
                fit(strategy, model, batches, fit_callbacks, checkpointer, start, request.epochs,
                    slices)
            finally:
                watch.close()

            scores = score(model, history, test_batches, dataset.y_test, loss, the_recipe.tta_flip,
                           request.epochs)
            metrics = {**scores, **totals(history), **run_spec.to_dict(),
                       "resumed": saved is not None, "run_dir": run}
            if chief:
                write_results(run, model, history, metrics)
                if verbose:
                    print(f"test accuracy {scores['test_accuracy']:.4f}  test loss "
                          f"{scores['test_loss']:.4f}  ({len(dataset.x_test)} images); wrote {run}",
                          flush=True)
    return metrics


# ----------------------------------------------------------------------------------------- eval

def evaluate(run_or_model: str, data_dir: str | None = None, *, simulate_devices: int | None = None,
             engine: str | None = None, require: str | None = None,
             verbose: bool = False) -> dict[str, Any]:
    """Test accuracy and loss of a trained run (its directory or model.keras), on its test set.

    data_dir: where the dataset is (default: the one recorded in the run's config.json).
    Uses the run's recipe (loss, test-time flips) and global batch.
    """
    run, model_path = rundir.locate_run(run_or_model)
    saved, _ = spec.read(run)
    recipe = recipes.get(saved.recipe)

    from meshfit.distribution import connect

    strategy = connect(require=require, simulate=simulate_devices, engine=engine, verbose=verbose)
    import keras

    from meshfit import pipeline

    dataset = datasets.load(saved.dataset, data_dir or saved.data_dir)
    batch = math.ceil(saved.global_batch / strategy.replicas) * strategy.replicas
    with strategy.scope():
        model = keras.saving.load_model(model_path, compile=False)
        batches = pipeline.EvalBatches(dataset.x_test, batch)
        scores = evaluate_model(model, batches, dataset.y_test, recipe.make_loss(), recipe.tta_flip)
    return {**scores, "samples": len(dataset.x_test), "recipe": recipe.name, "model": model_path,
            "engine": strategy.engine, "replicas": strategy.replicas, "platform": strategy.platform}
