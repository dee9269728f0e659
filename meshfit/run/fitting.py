"""A run once its engine is chosen: the steps of meshfit.run.train.train() after connect().

run() = choose the sharding (the memory plan) -> build the model, its batches and the run's
specification -> open the run directory (config.json) -> restore the newest checkpoint (when
resuming) -> fit with the run's callbacks -> score on the test set -> write the results.
The run owns the process's goodput ledger (meshfit.watch.goodput): kept in RUN/goodput.json while
it trains, continued by a resumed run, and written into metrics.json at the end.
This module imports Keras at its top: meshfit.run.train imports it only after connect().
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from meshfit import __version__, recipes
from meshfit.data import splits as data
from meshfit.errors import MeshfitError
from meshfit.fit import jax_loop, memory_plan, set_random_seed, tf_microbatch
from meshfit.parallel import cluster, planning, stall
from meshfit.run import checkpoints, models, rundir, spec
from meshfit.run.callbacks import RecipeCallbacks
from meshfit.run.evaluate import headline, score_line
from meshfit.run.results import totals, write_metrics, write_results
from meshfit.run.scores import evaluate_model, is_classifier, score
from meshfit.run.spec import RunSpec, profiling_steps
from meshfit.watch import goodput, profiling, progress, progress_bar
from meshfit.watch.report import EpochReport
from meshfit.watch.tensorboard import TensorBoardLog


def run(asked, strategy, dataset, stream, batch_plan: planning.BatchPlan, command: str) -> dict[str, Any]:
    """The run of meshfit.run.train.train() from the sharding on (asked: its train.Asked);
    returns the metrics."""
    strategy = plan_sharding(asked, strategy, dataset, batch_plan)
    stall.set_resume_hint(f"its committed checkpoints are intact: continue with meshfit train "
                          f"--resume {asked.run}")
    guard = stall.watching() if strategy.engine == "jax" else contextlib.nullcontext()
    with guard, strategy.scope(), contextlib.closing(_RunLedger()):
        model, batches, run_spec = build_run(asked, strategy, dataset, stream, batch_plan, command)
        chief = strategy.info.process_index == 0
        cluster.barrier("meshfit: run directory checked")  # before process 0 writes into it
        with rundir.lock(asked.run) if chief else contextlib.nullcontext():
            ledger = goodput.ledger()
            with ledger.part("checkpoint"):
                resume_state = (restore(model, asked.run, run_spec.steps_per_epoch,
                                        data.labels(dataset.train), asked.checkpoint,
                                        dataset.num_classes)
                                if asked.saved is not None else None)
            own_ledger(ledger, asked.run, strategy.info.process_index, resume_state,
                       run_spec.steps_per_epoch)
            if chief:
                write_recipe(asked.run, asked.recipe)
                write_config(asked.run, run_spec, asked.saved_config, resume_state, command)
                if asked.options.verbose:
                    announce(asked.run, run_spec, asked.saved, resume_state,
                             has_test=dataset.test is not None)
            history, report = fit_run(asked, strategy, model, batches, dataset, run_spec,
                                      resume_state)
            return score_and_write(asked, model, history, dataset, run_spec, chief, report.peak)


class _RunLedger:
    """Closed when the run ends (finished or not): the ledger is no longer the run's."""

    def close(self) -> None:
        goodput.end_run()


def own_ledger(ledger: goodput.Ledger, run: str, process_index: int, resume_state: dict | None,
               steps_per_epoch: int) -> None:
    """Make the goodput ledger this run's: kept in the run directory from now on and, on a
    resume, continuing the stopped run's (its parts, and the time the interruption lost)."""
    ledger.owner = "run"
    path = goodput.run_file(run, process_index)
    if resume_state is not None:
        ledger.resume(path, resume_state["epoch"] * steps_per_epoch + resume_state["step"])
    ledger.persist_to = path
    ledger.write()


def start_session(strategy, seed: int) -> None:
    """A fresh Keras session with this strategy active, seeded, deterministic on TensorFlow."""
    # Whatever was built before (the memory plan's model), the run's model starts from the
    # weights its seed gives: a resumed run then loads into the same variables.
    keras.backend.clear_session()
    strategy.activate()
    set_random_seed(seed)
    if strategy.engine == "tensorflow":
        import tensorflow as tf  # only on the TensorFlow engine

        tf.config.experimental.enable_op_determinism()  # bit-identical resume on TensorFlow


def plan_sharding(asked, strategy, dataset, batch_plan: planning.BatchPlan):
    """The strategy in the sharding whose train step fits the device memory ('auto' decided by
    memory_plan.choose_sharding), its session started."""
    seed, epochs = asked.options.seed, asked.options.epochs
    strategy, _ = memory_plan.choose_sharding(
        strategy, lambda: build(asked.recipe, dataset, batch_plan.steps_per_epoch or 1, epochs,
                                batch_plan.steps_per_dispatch),
        batch_plan.global_batch, lambda s: start_session(s, seed), asked.options.verbose)
    start_session(strategy, seed)
    return strategy


def memory_plan_of(recipe: recipes.Recipe, dataset, strategy, global_batch: int, largest: bool,
                   verbose: bool = True) -> dict[str, Any]:
    """`meshfit plan`'s memory plan of the recipe's train step on these devices, shown (when
    verbose), not enforced; 'auto' decided as plan_sharding decides it."""
    _, result = memory_plan.choose_sharding(
        strategy, lambda: build(recipe, dataset, 1, recipe.epochs, 1), global_batch,
        lambda s: start_session(s, 0), verbose=False, largest=largest, always=True)
    result["fits"] = memory_plan.plan_used(result, result["sharding"])["fits"]
    if verbose:
        print("\n".join(memory_plan.summary_lines(result, result["sharding"])), flush=True)
    return result


def build(recipe: recipes.Recipe, dataset, steps_per_epoch: int, epochs: int, steps_per_dispatch: int):
    """The recipe's model, built, prepared and compiled (call inside the strategy's scope).
    dataset: anything with input_shape, num_classes and class_names (a data.RunData)."""
    model = recipe.build_model(tuple(recipe.input_shape or dataset.input_shape), dataset.num_classes)
    if recipe.compile is None:
        check_compile_signature(model)  # before prepare(), which may train a teacher first
    if recipe.prepare is not None:
        recipe.prepare(model, dataset)
    optimizer = recipe.optimizer(steps_per_epoch, epochs)
    if recipe.compile is None:
        # a model that is no classifier (a regression) has no accuracy: argmax would make one up
        metric = "accuracy" if is_classifier(model, dataset.class_names) else "mae"
        model.compile(optimizer=optimizer, loss=recipe.make_loss(), metrics=[metric],
                      steps_per_execution=steps_per_dispatch)
    else:  # the model's own compile signature (a subclassed model's)
        recipe.compile(model, optimizer)
        model.steps_per_execution = steps_per_dispatch
    return model


def check_compile_signature(model) -> None:
    """A one-line MeshfitError for a model whose own compile() cannot take meshfit's arguments
    (optimizer, loss, metrics, steps_per_execution), as keras-io's Distiller's: its recipe must
    say how to compile it."""
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


def build_run(asked, strategy, dataset, stream, batch_plan: planning.BatchPlan, command: str):
    """The batches, the compiled model and the run's specification (inside the strategy's scope)."""
    o, r, global_batch = asked.options, asked.recipe, batch_plan.global_batch
    batches = stream if stream is not None else data.train_batches(
        dataset, r, global_batch, o.seed, batch_plan.steps_per_epoch)
    steps = batches.steps_per_epoch
    model = build(r, dataset, steps, o.epochs, batch_plan.steps_per_dispatch)
    check_saveable(model, r)
    micro_batches = tf_microbatch.plan_micro_batches(model, global_batch, batch_plan.micro_batches,
                                                     strategy.engine)
    if stream is not None:  # every batch needs a row per slice
        micro_batches = stream.micro_batches = min(micro_batches, stream.smallest_batch or micro_batches)
    run_spec = make_spec(asked, strategy, dataset, steps_per_epoch=steps, global_batch=global_batch,
                         steps_per_dispatch=batch_plan.steps_per_dispatch,
                         micro_batches=micro_batches, command=command,
                         class_names=class_names_of(model, dataset))
    return model, batches, run_spec


def class_names_of(model, dataset) -> tuple[str, ...]:
    """The class names a run records: its data's where the model outputs one value per class
    (a classifier, or a subclassed model that does not say), none where it outputs another
    number of values (a regression's one), which `meshfit predict` then prints as they are."""
    names = tuple(dataset.class_names)
    return names if is_classifier(model, names) else ()


def make_spec(asked, strategy, dataset, *, steps_per_epoch: int, global_batch: int,
              steps_per_dispatch: int, micro_batches: int, command: str,
              class_names: tuple[str, ...]) -> RunSpec:
    """The run specification of this run on these devices (class_names: see class_names_of)."""
    r, o = asked.recipe, asked.options
    per_epoch = dataset.per_epoch
    return RunSpec(
        recipe=r.name, dataset=dataset.source, class_names=class_names,
        input_shape=tuple(r.input_shape or dataset.input_shape), num_classes=dataset.num_classes,
        epochs=o.epochs, steps_per_epoch=steps_per_epoch, global_batch=global_batch,
        steps_per_dispatch=steps_per_dispatch, micro_batches=micro_batches, seed=o.seed,
        precision=strategy.precision, engine=strategy.engine, replicas=strategy.replicas,
        platform=strategy.platform, device_kind=strategy.device_kind,
        simulate_devices=strategy.info.devices_per_host if strategy.info.simulated else None,
        data_dir=spec.absolute(o.data_dir), validation_split=r.validation_split,
        evaluated_on=per_epoch[0] if per_epoch else "none",
        recipe_file=rundir.RECIPE if r.text is not None else None,
        recipe_sha256=rundir.text_sha256(r.text) if r.text is not None else None,
        recipe_source=r.file, augment=r.augment, crop_padding=r.crop_padding,
        flips=r.flips, tta_flip=r.tta_flip, checkpoint_every=o.checkpoint_every,
        keep_checkpoints=o.keep_checkpoints, meshfit_version=__version__,
        keras_version=keras.__version__, command=command, sharding=strategy.sharding,
        fsdp_min_bytes=strategy.fsdp_min_bytes, model_parallel=strategy.model_parallel)


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
    """Create the compiled metrics' variables now (Keras/TF makes them at the first step), so
    that the checkpoint's running totals of a cut epoch can be put back into them."""
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


# ---------------------------------------------------------------------------------- fit

class _EpochEnd:
    """At each epoch end: evaluate on the validation split, or the test set (adds val_loss and
    val_accuracy, or a model's that is no classifier val_mae, to the logs)."""

    def __init__(self, model, batches, labels, loss, tta_flip, report, classifier=True):
        self.model, self.batches, self.labels, self.loss = model, batches, labels, loss
        self.tta_flip, self.report, self.classifier = tta_flip, report, classifier

    def __call__(self, epoch, logs):
        self.report.on_test_begin()  # the epoch's training clock stops before validation
        with goodput.ledger().part("eval"):
            scores = evaluate_model(self.model, self.batches, self.labels, self.loss, self.tta_flip,
                                    classifier=self.classifier)
        logs.update({f"val_{key}": value for key, value in scores.items()})


class _EarlierSessions(keras.callbacks.Callback):
    """The steps and training seconds that the earlier sessions of a run resumed in mid-epoch
    trained of that epoch (each checkpoint keeps them, "epoch_so_far"): its record counts every
    session's steps, not only the last one's (train_seconds, samples, hence `meshfit runs`)."""

    def __init__(self, report, resume_state: dict | None):
        super().__init__()
        self.report = report
        cut = resume_state is not None and resume_state["step"] > 0
        self.epoch = resume_state["epoch"] if cut else None
        self.carried = dict(resume_state.get("epoch_so_far") or {}) if cut else {}
        self._current = None

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch

    def of(self, epoch: int | None) -> tuple[int, float]:
        """(steps, training seconds) the earlier sessions trained of `epoch`."""
        if epoch is None or epoch != self.epoch:
            return 0, 0.0
        return int(self.carried.get("steps") or 0), float(self.carried.get("train_seconds") or 0.0)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the epoch in progress' steps and seconds so far, every session's."""
        steps, seconds = self.of(self._current)
        mine_steps, mine_seconds = self.report.so_far()
        return {"steps": steps + mine_steps, "train_seconds": seconds + mine_seconds}


class _History:
    """At each epoch end: one record of the epoch's metrics and the EpochReport's figures."""

    def __init__(self, records: list[dict[str, Any]], report, global_batch: int,
                 earlier: _EarlierSessions | None = None):
        self.records, self.report, self.global_batch = records, report, global_batch
        self.earlier = earlier

    def __call__(self, epoch, logs):
        stats = self.report.epochs[-1] if self.report.epochs else {}
        record = {"epoch": epoch + 1}
        record.update({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})
        record.update({k: stats.get(k) for k in ("train_seconds", "compile_seconds", "ms_per_step",
                                                  "samples_per_second", "mfu", "input_wait_seconds")})
        record["samples"] = stats.get("steps", 0) * self.global_batch
        steps, seconds = self.earlier.of(epoch) if self.earlier else (0, 0.0)
        if steps:  # a cut epoch: the steps its earlier sessions trained count too
            record["samples"] += steps * self.global_batch
            record["train_seconds"] = (record["train_seconds"] or 0.0) + seconds
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
    logdir = os.path.join(run, rundir.TENSORBOARD)
    before, after = [], []
    if profile_steps:
        before.append(profiling.Profile(logdir, *profile_steps, steps_per_epoch=steps))
    if verbose and progress.live():
        before.append(progress_bar.ProgressBar(global_batch))
    if tensorboard:
        after.append(TensorBoardLog(logdir, log_every=log_every, report=report,
                                    global_batch=global_batch, steps_per_epoch=steps))
    return Monitoring(before, after)


class _RunEpochs(keras.callbacks.Callback):
    """First among the callbacks of a cut epoch's fit (one epoch, `epochs=epoch + 1`): the params
    Keras gives them (one dict, shared) say the run's epochs, so the bar and the epoch line show
    "epoch 1/3", not "epoch 1/1"."""

    def __init__(self, epochs: int):
        super().__init__()
        self.epochs = epochs

    def set_params(self, params):
        if params:
            params["epochs"] = self.epochs
        super().set_params(params)


def fit(strategy, model, batches, callbacks: list, checkpointer, start: tuple[int, int],
        epochs: int, micro_batches: int = 1) -> None:
    """Fit from (epoch, step) `start` to the end: the rest of a cut epoch first, then whole ones.

    The rest of a cut epoch runs with steps per dispatch dividing its step count, so that no
    dispatch runs into the next epoch. SIGTERM/SIGINT make the checkpointer save and raise
    TrainingInterrupted.
    """
    epoch, step = start
    steps, dispatch = batches.steps_per_epoch, model.steps_per_execution
    with checkpoints.stop_on_signals(checkpointer):
        if step and epoch < epochs:
            if (steps - step) % dispatch:  # a dispatch must end where the cut epoch ends
                jax_loop.install(model, planning.dividing_steps(steps - step, dispatch))
            strategy.fit(model, batches.iterate(epoch, step), epochs=epoch + 1, initial_epoch=epoch,
                         steps_per_epoch=steps - step, shuffle=False,
                         callbacks=[_RunEpochs(epochs), *callbacks],
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


def recipe_callbacks(recipe: recipes.Recipe, resume_state: dict | None, epochs: int):
    """The recipe's own callbacks (with their saved state on --resume), or None."""
    if recipe.callbacks is None:
        return None
    return RecipeCallbacks(recipe.callbacks(), resume_state.get("callbacks") if resume_state else None,
                           resume_state.get("extra_arrays") if resume_state else None, epochs=epochs)


def make_checkpointer(run: str, run_spec: RunSpec, history: list, own_callbacks, resume_state,
                      chief: bool, earlier: _EarlierSessions | None = None) -> checkpoints.Checkpointer:
    """The run's Checkpointer: its policy from the spec; each checkpoint holds the seed, the
    history so far, the specification, the recipe callbacks' state and the epoch in progress'
    steps and training seconds so far (`earlier`)."""
    every_steps, every_seconds, at_epoch_end = spec.parse_every(run_spec.checkpoint_every)
    return checkpoints.Checkpointer(
        os.path.join(run, rundir.CHECKPOINTS), run_spec.steps_per_epoch, every_steps=every_steps,
        every_seconds=every_seconds, epoch_end=at_epoch_end, keep=run_spec.keep_checkpoints,
        resume_state=resume_state, write=chief,
        extra=lambda: {"seed": run_spec.seed, "history": history, "config": run_spec.to_dict(),
                       "callbacks": own_callbacks.state() if own_callbacks else [],
                       "epoch_so_far": earlier.state() if earlier else {}},
        extra_arrays=lambda: own_callbacks.arrays() if own_callbacks else {})


_CHECKPOINT_HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_epoch_end",
                     "on_train_end")


def charged_to_checkpoint(checkpointer: checkpoints.Checkpointer) -> checkpoints.Checkpointer:
    """The checkpointer, its hooks' time (saves, waits for a background save, the stop vote)
    charged to the goodput ledger's checkpoint part, but a save's wait for the steps already
    dispatched charged to train: that is the devices' training work, which the save only
    waited for (the instance's methods wrapped: Keras and stop_on_signals keep the same object)."""
    ledger = goodput.ledger()

    def charged(method, part):
        def hook(*args, **kwargs):
            with ledger.part(part):
                return method(*args, **kwargs)
        return hook

    for name in _CHECKPOINT_HOOKS:
        setattr(checkpointer, name, charged(getattr(checkpointer, name), "checkpoint"))
    checkpointer.wait_for_device = charged(checkpointer.wait_for_device, "train")
    return checkpointer


def epoch_evaluation(model, dataset, recipe: recipes.Recipe, global_batch: int, report,
                     classifier: bool) -> list:
    """The callback scoring each epoch on the split behind val_* (none without one); classifier:
    whether the run records class names (class_names_of), as the end-of-run score reads it."""
    per_epoch = dataset.per_epoch
    if not per_epoch:
        return []
    return [keras.callbacks.LambdaCallback(on_epoch_end=_EpochEnd(
        model, data.eval_batches(dataset, per_epoch[1], global_batch), data.labels(per_epoch[1]),
        recipe.make_loss(), recipe.tta_flip, report, classifier))]


@contextlib.contextmanager
def source_failure_raised(batches):
    """Inside: an error of fit caused by a streamed source's failure is raised as that failure;
    TensorFlow hands a streamed folder's unreadable file on wrapped in its own error."""
    try:
        yield
    except Exception as error:
        failure = getattr(batches, "failure", None)
        if failure is not None and not isinstance(error, MeshfitError):
            raise failure from None
        raise


def fit_run(asked, strategy, model, batches, dataset, run_spec: RunSpec,
            resume_state: dict | None) -> tuple[list[dict[str, Any]], EpochReport]:
    """Fit with the run's callbacks (evaluation, report, monitoring, the recipe's, checkpoints);
    return the history of every epoch, the resumed ones included, and the epoch report."""
    o, run, global_batch = asked.options, asked.run, run_spec.global_batch
    chief = strategy.info.process_index == 0
    history = list(resume_state["history"]) if resume_state else []
    own_callbacks = recipe_callbacks(asked.recipe, resume_state, o.epochs)
    report = EpochReport(global_batch=global_batch, strategy=strategy,
                         stream=None if chief else io.StringIO())  # one epoch line per job
    report.input_source = input_source(batches)
    earlier = _EarlierSessions(report, resume_state)
    checkpointer = charged_to_checkpoint(
        make_checkpointer(run, run_spec, history, own_callbacks, resume_state, chief, earlier))
    watch = monitoring(run, chief, o.verbose, report, global_batch, run_spec.steps_per_epoch,
                       o.tensorboard, o.log_every, profiling_steps(o.profile))
    # Keras calls these in order at each epoch end: the evaluation adds val_* to the logs before
    # the report prints them and the history and TensorBoard record them, and the checkpointer
    # saves a history that already holds the epoch.
    callbacks = [
        *watch.before, *epoch_evaluation(model, dataset, asked.recipe, global_batch, report,
                                          bool(run_spec.class_names)),
        report, *watch.after,
        earlier, keras.callbacks.LambdaCallback(on_epoch_end=_History(history, report, global_batch,
                                                                      earlier)),
        *([own_callbacks] if own_callbacks else []), checkpointer, *(o.callbacks or [])]
    start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
    try:
        with source_failure_raised(batches):
            fit(strategy, model, batches, callbacks, checkpointer, start, o.epochs,
                run_spec.micro_batches)
    finally:
        watch.close()
        goodput.ledger().write()  # stopped (a signal, an error): the ledger as of now
    return history, report


def input_source(batches) -> str:
    """The kind of a run's batches for the input-bound line (goodput.input_fix): images read
    from a folder, a recipe's own source, or arrays."""
    module = type(batches).__module__
    if module.endswith("folders"):
        return "folder"
    if module.endswith("streams"):
        return "generator"
    return "arrays"


def score_and_write(asked, model, history: list, dataset, run_spec: RunSpec, chief: bool,
                    peak: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score on the test set, write the model, history and metrics.json (with the goodput of the
    whole run, its MFU and the peak it is against: `peak`, see meshfit.watch.peak); print the
    goodput block; return the metrics."""
    r, run = asked.recipe, asked.run
    ledger = goodput.ledger()
    with ledger.part("eval"):
        scores = score(model, history, dataset, run_spec.global_batch, r.make_loss(), r.tta_flip,
                       run_spec.epochs, classifier=bool(run_spec.class_names))
    # metrics.json is config.json's specification plus the results (see meshfit.run.spec).
    metrics = {**scores, **totals(history), **run_spec.to_dict(),
               "resumed": asked.saved is not None, "run_dir": run}
    checkpoints.gather_for_saving(model)  # fsdp on several processes: every process
    metrics.update({"mfu": run_mfu(history), "peak_flops": (peak or {}).get("flops"),
                    "peak_source": (peak or {}).get("source")})
    with ledger.part("other"):  # the model, history and curves written count as part of the run
        if chief:
            write_results(run, model, history, metrics)
    metrics["goodput"] = job_goodput(ledger.totals())  # every process: a collective on several
    ledger.finished = True
    ledger.write()
    if chief:
        write_metrics(run, metrics)
        if asked.options.verbose:
            name, _, _, samples = headline(scores)
            shown = f"{score_line(scores)}  ({samples} images); " if samples is not None else ""
            print(goodput.format_block(metrics["goodput"], metrics["mfu"], peak), flush=True)
            print(f"{shown}wrote {run}", flush=True)
    return metrics


def run_mfu(history: list[dict[str, Any]]) -> float | None:
    """MFU over every epoch of the run, resumed sessions' included: the epochs' MFU weighted by
    their training seconds (None where no epoch has one)."""
    timed = [(r["mfu"], r.get("train_seconds") or 0.0) for r in history if r.get("mfu") is not None]
    seconds = sum(s for _, s in timed)
    return sum(m * s for m, s in timed) / seconds if seconds else None


def job_goodput(mine: dict[str, Any]) -> dict[str, Any]:
    """This process's goodput on one host; on several, every host's (gathered) and the slowest's
    at the top (goodput.slowest)."""
    if jax.process_count() == 1:
        return mine
    row = np.array([mine["seconds"][p] for p in goodput.PARTS] + [mine["wall_seconds"]], "float64")
    rows = np.asarray(multihost_utils.process_allgather(row))
    return goodput.slowest([goodput.summary(dict(zip(goodput.PARTS, r[:-1])), float(r[-1]),
                                            mine["sessions"], mine["lost_steps"]) for r in rows])
