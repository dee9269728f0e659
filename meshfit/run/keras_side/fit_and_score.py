"""A run's fit and its end, after meshfit.run.keras_side.fitting built and restored it: the
callbacks around Keras' fit (each epoch's evaluation, the history, the checkpointer, the bar,
TensorBoard and the profiler), the fit itself (`fit_run`), then the score on the test set and the
files written (`score_and_write`) with the run's MFU and goodput. This module imports Keras at its
top: only meshfit.run.keras_side.fitting imports it.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from meshfit import recipes
from meshfit.data import splits as data
from meshfit.errors import MeshfitError
from meshfit.fit import jax_loop
from meshfit.parallel import planning
from meshfit.run import rundir, spec
from meshfit.run.evaluate import headline, score_line
from meshfit.run.keras_side import checkpoint_save, checkpoints, divergence
from meshfit.run.keras_side.callbacks import RecipeCallbacks
from meshfit.run.keras_side.scores import evaluate_model, score
from meshfit.run.results import totals, write_metrics, write_results
from meshfit.run.spec import RunSpec, profiling_steps
from meshfit.watch import goodput, progress
from meshfit.watch.keras_side import profiling, progress_bar
from meshfit.watch.keras_side.report import EpochReport
from meshfit.watch.keras_side.tensorboard import TensorBoardLog


class _EpochEnd:
    """At each epoch end: evaluate on the validation split, or the test set (adds val_loss and
    val_accuracy, or a model's that is no classifier val_mae, to the logs)."""

    def __init__(self, model, batches, labels, loss, tta, report, classifier=True):
        self.model, self.batches, self.labels, self.loss = model, batches, labels, loss
        self.tta, self.report, self.classifier = tta, report, classifier  # (tta_flip, tta_translate)

    def __call__(self, epoch, logs):
        self.report.on_test_begin()  # the epoch's training clock stops before validation
        with goodput.ledger().part("eval"):
            scores = evaluate_model(self.model, self.batches, self.labels, self.loss, self.tta[0],
                                    classifier=self.classifier, tta_translate=self.tta[1])
        logs.update({f"val_{key}": value for key, value in scores.items()})


class _EarlierSessions(keras.callbacks.Callback):
    """The steps, training and input wait seconds that the earlier sessions of a run resumed in
    mid-epoch trained of that epoch (each checkpoint keeps them, "epoch_so_far"): the epoch
    report counts them in that epoch's figures (its line, its record: samples, train_seconds,
    hence `meshfit runs`), not only the last sitting's."""

    def __init__(self, report, resume_state: dict | None):
        super().__init__()
        self.report = report
        cut = resume_state is not None and resume_state["step"] > 0
        self.epoch = resume_state["epoch"] if cut else None
        self.carried = dict(resume_state.get("epoch_so_far") or {}) if cut else {}
        self._current = None

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch

    def of(self, epoch: int | None) -> tuple[int, float, float]:
        """(steps, training seconds, input wait seconds) the earlier sessions trained of `epoch`."""
        if epoch is None or epoch != self.epoch:
            return 0, 0.0, 0.0
        return (int(self.carried.get("steps") or 0), float(self.carried.get("train_seconds") or 0.0),
                float(self.carried.get("input_wait_seconds") or 0.0))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the epoch in progress' steps and seconds so far, every session's."""
        steps, seconds, waited = self.of(self._current)
        mine = self.report.so_far()
        return {"steps": steps + mine.get("steps", 0),
                "train_seconds": seconds + mine.get("train_seconds", 0.0),
                "input_wait_seconds": waited + mine.get("input_wait_seconds", 0.0)}


class _History:
    """At each epoch end: one record of the epoch's metrics and the EpochReport's figures (of the
    whole epoch: a cut epoch's earlier sittings are in them, see _EarlierSessions)."""

    def __init__(self, records: list[dict[str, Any]], report, global_batch: int):
        self.records, self.report, self.global_batch = records, report, global_batch

    def __call__(self, epoch, logs):
        stats = self.report.epochs[-1] if self.report.epochs else {}
        record = {"epoch": epoch + 1}
        record.update({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})
        record.update({k: stats.get(k) for k in ("train_seconds", "compile_seconds", "ms_per_step",
                                                  "samples_per_second", "mfu", "input_wait_seconds",
                                                  "checkpoint_seconds")})
        record["samples"] = stats.get("steps", 0) * self.global_batch
        if stats.get("sitting"):  # resumed in its middle: what the last sitting trained of it
            record["sitting"] = stats["sitting"]
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
                      chief: bool, earlier: _EarlierSessions | None = None,
                      local_folder: str | None = None) -> checkpoints.Checkpointer:
    """The run's Checkpointer: its policy from the spec; each checkpoint holds the seed, the
    history so far, the specification, the recipe callbacks' state and the epoch in progress'
    steps and training seconds so far (`earlier`). local_folder: where this process writes the
    run's local copies (its host's writer; meshfit.run.local_copies), else None."""
    every_steps, every_seconds, at_epoch_end = spec.parse_every(run_spec.checkpoint_every)
    return checkpoints.Checkpointer(
        os.path.join(run, rundir.CHECKPOINTS), run_spec.steps_per_epoch, every_steps=every_steps,
        every_seconds=every_seconds, epoch_end=at_epoch_end, keep=run_spec.keep_checkpoints,
        resume_state=resume_state, write=chief, local_every=run_spec.local_copy_every,
        local_directory=local_folder,
        extra=lambda: {"seed": run_spec.seed, "history": history, "config": run_spec.to_dict(),
                       "callbacks": own_callbacks.state() if own_callbacks else [],
                       # a recipe callback (EarlyStopping) ended training at this save
                       "stopped": bool(own_callbacks and own_callbacks.stopped),
                       "epoch_so_far": earlier.state() if earlier else {}},
        extra_arrays=lambda: own_callbacks.arrays() if own_callbacks else {})


_CHECKPOINT_HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_epoch_end",
                     "on_train_end")


def charged_to_checkpoint(checkpointer: checkpoints.Checkpointer) -> checkpoints.Checkpointer:
    """The checkpointer, its hooks' time (saves, waits for a background save) charged to the
    goodput ledger's checkpoint part, but a save's wait for the steps already dispatched and
    the stop vote's (Checkpointer.vote) charged to train inside an epoch's training window:
    that is the devices' training work, which the save or the vote only waited for. Outside
    one (the save at an epoch's end) the steps were waited for when the window closed
    (meshfit.watch.keras_side.epoch_clock), and what remains is the save's: no train is charged
    where no epoch line counts it. (The instance's methods are wrapped: Keras and
    stop_on_signals keep the same object.)"""
    ledger = goodput.ledger()

    def charged(method, part):
        def hook(*args, **kwargs):
            with ledger.part(part if part != "train" or ledger.base == "train" else "checkpoint"):
                return method(*args, **kwargs)
        return hook

    for name in _CHECKPOINT_HOOKS:
        setattr(checkpointer, name, charged(getattr(checkpointer, name), "checkpoint"))
    checkpointer.wait_for_device = charged(checkpointer.wait_for_device, "train")
    checkpointer.vote = charged(checkpointer.vote, "train")  # waits for the steps dispatched
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
        recipe.make_loss(), (recipe.tta_flip, recipe.tta_translate), report, classifier))]


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
            resume_state: dict | None, local_folder: str | None = None
            ) -> tuple[list[dict[str, Any]], EpochReport]:
    """Fit with the run's callbacks (evaluation, report, monitoring, the recipe's, checkpoints
    and local copies into `local_folder`: see make_checkpointer); return the history of every
    epoch, the resumed ones included, and the epoch report."""
    o, run, global_batch = asked.options, asked.run, run_spec.global_batch
    chief = strategy.info.process_index == 0
    history = list(resume_state["history"]) if resume_state else []
    own_callbacks = recipe_callbacks(asked.recipe, resume_state, o.epochs)
    report = EpochReport(global_batch=global_batch, strategy=strategy,
                         stream=None if chief else io.StringIO())  # one epoch line per job
    report.input_source = input_source(batches)
    earlier = _EarlierSessions(report, resume_state)
    report.earlier = earlier.of
    checkpointer = charged_to_checkpoint(
        make_checkpointer(run, run_spec, history, own_callbacks, resume_state, chief, earlier,
                          local_folder))
    watch = monitoring(run, chief, o.verbose, report, global_batch, run_spec.steps_per_epoch,
                       o.tensorboard, o.log_every, profiling_steps(o.profile))
    # Keras calls these in order at each epoch end: the evaluation adds val_* to the logs before
    # the report prints them and the history and TensorBoard record them, and the checkpointer
    # saves a history that already holds the epoch.
    callbacks = [
        *watch.before, *epoch_evaluation(model, dataset, asked.recipe, global_batch, report,
                                          bool(run_spec.class_names)),
        report, *watch.after,
        earlier, keras.callbacks.LambdaCallback(on_epoch_end=_History(history, report, global_batch)),
        *([own_callbacks] if own_callbacks else []), checkpointer, *(o.callbacks or [])]
    start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
    if resume_state and resume_state.get("stopped"):  # as the run stopped: no epoch more
        start = (o.epochs, 0)
        if own_callbacks is not None:
            own_callbacks.end_as_stopped(model)
    try:
        with source_failure_raised(batches):
            fit(strategy, model, batches, callbacks, checkpointer, start, o.epochs,
                run_spec.micro_batches)
        # The last save checked the state it saved; this also covers --checkpoint-every off and
        # the steps after a save, before model.keras is written from it.
        divergence.check(model, len(history) * run_spec.steps_per_epoch,
                         run_spec.steps_per_epoch, checkpointer.directory, chief)
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
                       run_spec.epochs, classifier=bool(run_spec.class_names),
                       tta_translate=r.tta_translate)
    # metrics.json is config.json's specification plus the results (see meshfit.run.spec).
    metrics = {**scores, **totals(history), **run_spec.to_dict(),
               "resumed": asked.saved is not None, "run_dir": run}
    checkpoint_save.gather_for_saving(model)  # fsdp on several processes: every process
    metrics.update({"mfu": run_mfu(history), "peak_flops": (peak or {}).get("flops"),
                    "peak_source": (peak or {}).get("source")})
    with ledger.part("other"):  # the model, history and curves written count as part of the run
        if chief:
            write_results(run, model, history, metrics)
    mine = ledger.totals()
    metrics["goodput"] = job_goodput(mine)  # every process: a collective on several
    # One figure for compilation: this process's goodput compile part (every session's, and every
    # compilation's: training, evaluation, planning), not the sum of the epoch lines' "(+N s
    # compile)", which count only what compiled inside each epoch's training. A run whose train
    # step came from JAX's compile cache or the memory plan once wrote 0.0 here against
    # goodput's 4.2 s. On one host it is the goodput block's compile; on several, host 0's.
    metrics["compile_seconds"] = mine["seconds"]["compile"]
    ledger.finished = True
    ledger.write()
    if chief:
        write_metrics(run, metrics)
        if asked.options.verbose:
            name, _, _, samples = headline(scores)
            shown = (f"{score_line(scores)}  ({samples} {run_spec.sample_name}); "
                     if samples is not None else "")
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
    # each host's own sessions too: a process of an elastic generation continues its own
    # ledger, which may have missed generations
    row = np.array([mine["seconds"][p] for p in goodput.PARTS]
                   + [mine["wall_seconds"], mine["sessions"], mine["lost_steps"]], "float64")
    rows = np.asarray(multihost_utils.process_allgather(row))
    n = len(goodput.PARTS)
    # The steps run again are the run's (global steps, the same for every process that ran
    # them): process 0's count, which continues every session (another host's ledger may have
    # missed generations) and is the one the elastic launcher's "N steps run again" sums.
    return goodput.slowest([goodput.summary(dict(zip(goodput.PARTS, r[:n])), float(r[n]), int(r[n + 1]),
                                            int(rows[0][n + 2])) for r in rows])
