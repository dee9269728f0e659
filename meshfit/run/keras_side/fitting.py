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
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from meshfit import __version__, recipes
from meshfit.data import splits as data
from meshfit.errors import MeshfitError, TrainingDiverged
from meshfit.files import atomic_path
from meshfit.fit import memory_plan, out_of_memory, sharded_init, tf_microbatch
from meshfit.parallel import cluster, planning, stall
from meshfit.run import checkpoint_format, local_copies, models, rundir, spec
from meshfit.run.keras_side import checkpoint_restore
from meshfit.run.keras_side.fit_and_score import fit_run, score_and_write
from meshfit.run.keras_side.scores import accuracy_metric, is_classifier, outputs_of
from meshfit.run.spec import RunSpec
from meshfit.watch import goodput


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
        with rundir.lock(asked.run) if chief else contextlib.nullcontext(), \
                contextlib.closing(local_copies.Host(asked.run)) as local:
            if run_spec.local_copy_every or os.path.isdir(local.folder):
                local.take()  # one process per host writes the copies (and removes them)
            ledger = goodput.ledger()
            began = time.monotonic()
            with ledger.part("checkpoint"):
                resume_state = (restore(model, asked.run, run_spec.steps_per_epoch,
                                        data.labels(dataset.train), asked.checkpoint,
                                        dataset.num_classes, local)
                                if asked.saved is not None else None)
            if resume_state is not None:  # config.json's "resumed" record keeps it (a mesh change's part)
                resume_state["restore_seconds"] = round(time.monotonic() - began, 2)
            local.drop_newer(resumed_step(resume_state, run_spec.steps_per_epoch))
            again = own_ledger(ledger, asked.run, strategy.info.process_index, resume_state,
                               run_spec.steps_per_epoch)
            if resume_state is not None:  # config.json's "resumed" record (the launcher reads it)
                resume_state["steps_run_again"] = again
            if chief:
                write_recipe(asked.run, asked.recipe)
                write_config(asked.run, run_spec, asked.saved_config, resume_state, command)
                with contextlib.suppress(FileNotFoundError):  # this session trains it anew
                    os.remove(os.path.join(asked.run, rundir.DIVERGED))
                if asked.options.verbose:
                    announce(asked.run, run_spec, asked.saved, resume_state,
                             has_test=dataset.test is not None,
                             validation_given=dataset.validation_given)
            try:
                history, report = fit_run(asked, strategy, model, batches, dataset, run_spec,
                                          resume_state, local.folder if local.writer else None)
                metrics = score_and_write(asked, model, history, dataset, run_spec, chief,
                                          report.peak)
            except TrainingDiverged as diverged:
                local.remove()  # copies newer than the last checkpoint may hold the NaN state
                if chief:  # for `meshfit runs` (its status) until a resumed session starts
                    rundir.write_json(os.path.join(asked.run, rundir.DIVERGED),
                                      {"step": diverged.step, "variable": diverged.variable,
                                       "error": str(diverged)})
                raise
            except Exception as error:
                oom = out_of_memory.run_error(error, asked.run)
                if oom is None:
                    raise
                raise oom from error
            local.remove()  # the run finished: its copies are of no more use
            return metrics


def resumed_step(resume_state: dict | None, steps_per_epoch: int) -> int:
    """The global step a run starts from (0: a new run)."""
    if resume_state is None:
        return 0
    return resume_state["epoch"] * steps_per_epoch + resume_state["step"]


class _RunLedger:
    """Closed when the run ends (finished or not): the ledger is no longer the run's."""

    def close(self) -> None:
        goodput.end_run()


def own_ledger(ledger: goodput.Ledger, run: str, process_index: int, resume_state: dict | None,
               steps_per_epoch: int) -> int:
    """Make the goodput ledger this run's: kept in the run directory from now on and, on a
    resume, continuing the stopped run's (its parts, and the time the interruption lost).
    Returns the steps this resume runs again (goodput's count: the steps the stopped run's ledger
    had done past the checkpoint; 0 where it left none, so it had trained none)."""
    ledger.owner = "run"
    path = goodput.run_file(run, process_index)
    lost = None
    if resume_state is not None:
        lost = ledger.resume(path, resume_state["epoch"] * steps_per_epoch + resume_state["step"],
                             checkpoint_train(resume_state))
    ledger.persist_to = path
    ledger.write()
    return lost["recomputed_steps"] if lost else 0


def checkpoint_train(resume_state: dict) -> float:
    """The training seconds a checkpoint's history holds: its epochs' and the epoch in progress'
    (every session's; the epoch lines count these, and the resumed ledger's train part too)."""
    history = resume_state.get("history") or []
    so_far = (resume_state.get("epoch_so_far") or {}) if resume_state.get("step") else {}
    return (sum(float(r.get("train_seconds") or 0.0) for r in history)
            + float(so_far.get("train_seconds") or 0.0))


def start_session(strategy, seed: int) -> None:
    """A fresh Keras session with this strategy active, seeded, deterministic on TensorFlow."""
    # Whatever was built before (the memory plan's model), the run's model starts from the
    # weights its seed gives: a resumed run then loads into the same variables.
    keras.backend.clear_session()
    strategy.activate()
    keras.utils.set_random_seed(seed)
    if strategy.engine == "tensorflow":
        import tensorflow as tf  # only on the TensorFlow engine

        tf.config.experimental.enable_op_determinism()  # bit-identical resume on TensorFlow


@dataclass(frozen=True)
class RecipeModels:
    """What memory_plan.choose_sharding builds its plan's model with (a memory_plan.ModelBuilder):
    the recipe's model for this dataset and schedule, in a session seeded by `seed`."""

    recipe: recipes.Recipe
    dataset: Any  # a data.RunData, or what `build` reads of one
    steps_per_epoch: int
    epochs: int
    steps_per_dispatch: int
    seed: int

    def fresh_session(self, strategy) -> None:
        start_session(strategy, self.seed)

    def build_model(self):
        return build(self.recipe, self.dataset, self.steps_per_epoch, self.epochs, self.steps_per_dispatch)


def plan_sharding(asked, strategy, dataset, batch_plan: planning.BatchPlan):
    """The strategy in the sharding whose train step fits the device memory ('auto' decided by
    memory_plan.choose_sharding), its session started."""
    seed, epochs = asked.options.seed, asked.options.epochs
    models = RecipeModels(asked.recipe, dataset, batch_plan.steps_per_epoch or 1, epochs,
                          batch_plan.steps_per_dispatch, seed)
    strategy, _ = memory_plan.choose_sharding(strategy, models, batch_plan.global_batch,
                                              asked.options.verbose)
    start_session(strategy, seed)
    return strategy


def memory_plan_of(recipe: recipes.Recipe, dataset, strategy, global_batch: int, largest: bool,
                   verbose: bool = True) -> memory_plan.MemoryPlan:
    """`meshfit plan`'s memory plan of the recipe's train step on these devices, shown (when
    verbose), not enforced; 'auto' decided as plan_sharding decides it."""
    models = RecipeModels(recipe, dataset, 1, recipe.epochs, 1, seed=0)
    _, result = memory_plan.choose_sharding(strategy, models, global_batch, verbose=False,
                                            largest=largest, always=True)
    if verbose:
        print("\n".join(memory_plan.summary_lines(result, result.sharding)), flush=True)
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
        loss = recipe.make_loss()
        metric = accuracy_metric(outputs_of(model, dataset.class_names, loss))
        model.compile(optimizer=optimizer, loss=loss, metrics=[metric],
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
    # A run resumed from a committed checkpoint (or one named) loads every variable from it next
    # (restore: else the run stops with an error), so its initial values are never read.
    restored = asked.saved is not None and bool(committed_candidates(asked.run, asked.checkpoint))
    with sharded_init.values_restored_later() if restored else contextlib.nullcontext():
        model = build(r, dataset, steps, o.epochs, batch_plan.steps_per_dispatch)
    check_saveable(model, r)
    # A resumed run asked for slices (an elastic generation keeping the per-core batch) trains a
    # model that cannot be sliced in whole batches, with one warning, rather than stopping.
    micro_batches = tf_microbatch.plan_micro_batches(model, global_batch, batch_plan.micro_batches,
                                                     strategy.engine,
                                                     whole_if_unsliceable=asked.saved is not None)
    if stream is not None and strategy.engine == "tensorflow":  # every batch needs a row per slice
        micro_batches = stream.micro_batches = min(micro_batches, stream.smallest_batch or micro_batches)
    run_spec = make_spec(asked, strategy, dataset, model, steps_per_epoch=steps, global_batch=global_batch,
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


def make_spec(asked, strategy, dataset, model, *, steps_per_epoch: int, global_batch: int,
              steps_per_dispatch: int, micro_batches: int, command: str,
              class_names: tuple[str, ...]) -> RunSpec:
    """The run specification of this run on these devices (class_names: see class_names_of)."""
    r, o = asked.recipe, asked.options
    per_epoch = dataset.per_epoch
    return RunSpec(
        recipe=r.name, dataset=dataset.source, class_names=class_names,
        outputs=outputs_of(model, class_names, r.make_loss()),
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
        flips=r.flips, tta_flip=r.tta_flip, tta_translate=r.tta_translate,
        checkpoint_every=o.checkpoint_every,
        keep_checkpoints=o.keep_checkpoints, local_copy_every=o.local_copy_every,
        meshfit_version=__version__,
        keras_version=keras.__version__, command=command, sharding=strategy.sharding.name,
        fsdp_min_bytes=strategy.fsdp_min_bytes, model_parallel=strategy.model_parallel)


def write_recipe(run: str, recipe: recipes.Recipe) -> None:
    """RUN/recipe.py: the text of a recipe file (or of a generated recipe) as it was trained."""
    path = os.path.join(run, rundir.RECIPE)
    if recipe.text is not None and not os.path.exists(path):
        with atomic_path(path, ".py") as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(recipe.text)


def committed_candidates(run: str, checkpoint: str | None) -> list[str]:
    """The committed checkpoints `restore` tries, in order: the one named on --resume,
    else the run's, newest first. Empty: a resume starts the run again."""
    if checkpoint:
        return [checkpoint]
    return rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))[::-1]


def restore(model, run: str, steps: int, labels: np.ndarray, checkpoint: str | None = None,
            classes: int | None = None, local: local_copies.Host | None = None) -> dict[str, Any]:
    """Load a checkpoint into the model; return its state (see checkpoint_restore.restore).

    checkpoint: the one to load (as named on --resume); default the newest intact one: a damaged
    newer one is skipped with a warning (the run then repeats the steps it had saved), and a
    local copy newer than the newest committed one that every process has (`local`, see
    newest_local_copy; a collective: every process calls this) is taken first. A run
    stopped before its first checkpoint starts from the beginning (its weights are those of a
    new run with its seed), recorded as resumed from checkpoint "none". classes: the width of
    the outputs of a subclassed model, which has no output_shape.
    """
    directory = os.path.join(run, rundir.CHECKPOINTS)
    candidates = committed_candidates(run, checkpoint)
    copy = newest_local_copy(local, candidates) if local is not None and not checkpoint else None
    if copy is not None:
        candidates.insert(0, copy)
    if not candidates:  # stopped before its first checkpoint: nothing to load, start again
        warnings.warn(f"{run} has no checkpoint yet; training it from the start", stacklevel=2)
        return {"epoch": 0, "step": 0, "history": [], "metrics_values": [],
                "path": os.path.join(directory, "none")}
    for i, path in enumerate(candidates):
        try:
            state = checkpoint_restore.restore(model, path)
            if not isinstance(state.get("history"), list):
                raise checkpoint_format.CheckpointDamaged(f"checkpoint {path} is damaged (its state.json "
                                                          "lacks the history)")
            break
        except checkpoint_format.CheckpointDamaged as e:
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
    state["path"], state["local"] = path, path == copy
    return state


def newest_local_copy(local: local_copies.Host, committed: list[str]) -> str | None:
    """The newest local copy newer than the newest of `committed` (newest first) that every
    process of the job has (each reports its host's intact copies, all gathered), or None."""
    mine = local.steps()[-4:]  # a host keeps KEEP (2); a fixed-size row for the all-gather
    reports = [mine]
    if cluster.multi_process():
        from jax.experimental import multihost_utils

        row = np.array(mine + [-1] * (4 - len(mine)), "int64")
        reports = [list(r) for r in np.asarray(multihost_utils.process_allgather(row))]
    newest = local_copies.step_of(committed[0]) if committed else -1
    step = local_copies.agreed_step(reports, newest)
    return None if step is None else local.path(step)


def _build_metrics(model, labels: np.ndarray, classes: int | None) -> None:
    """Create the compiled metrics' variables now on TensorFlow (Keras makes them there at the
    first step), so that the checkpoint's running totals of a cut epoch can be put back into
    them (meshfit.run.keras_side.checkpoints, as fit's first epoch begins). On JAX, Keras' fit
    builds them before any callback runs (its symbolic build, nothing computed), while this
    computes every metric once: about 15 small programs on each device, which JAX's persistent
    cache keeps for process 0 only, 0.43 s of each other process's start of an elastic
    generation (2 x 4 CPU devices, cProfile, 2026-11-28)."""
    if keras.backend.backend() != "tensorflow":
        return
    shape = model.output_shape[1:] if hasattr(model, "output_shape") else (classes,)
    outputs = np.zeros((len(labels),) + tuple(shape), "float32")
    model.compute_metrics(None, labels, outputs)


def resumed_from(resume_state: dict[str, Any]) -> str:
    """What config.json's "resumed" record names: ckpt-<step>, or local:ckpt-<step> for a local
    copy (meshfit.launch.elastic reads the step after the last '-')."""
    name = os.path.basename(resume_state["path"])
    return local_copies.PREFIX + name if resume_state.get("local") else name


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
            "command": command, "at": now, "checkpoint": resumed_from(resume_state),
            "engine": run_spec.engine, "replicas": run_spec.replicas,
            "steps_per_dispatch": run_spec.steps_per_dispatch, "micro_batches": run_spec.micro_batches,
            "sharding": run_spec.sharding, "restore_seconds": resume_state.get("restore_seconds"),
            "steps_run_again": resume_state.get("steps_run_again")})
    rundir.write_json(os.path.join(run, rundir.CONFIG), config)


EVALUATION_NOTES = {  # what announce says about the per-epoch val_* metrics
    "test": "val_* on the test set each epoch, as the tutorials did; ",
    "validation": "val_* on a held-out validation split, the test set scored at the end; ",
    "validation-only": "val_* on a held-out validation split (no test set, so none is scored); ",
    "validation-given": "val_* on the dataset's validation data, the test set scored at the end; ",
    "validation-given-only": "val_* on the dataset's validation data (no test set, so none is scored); ",
    "none": "no validation data (set validation_split); ",
    "test-own": "val_* on the test set each epoch (no validation split or source given); "}


def evaluation_note(run_spec: RunSpec, has_test: bool = True, validation_given: bool = False) -> str:
    """What the start line says about val_*: built-in recipes follow the tutorials, recipe files
    do not; a run without a test set (a folder without test/) says none is scored; validation
    data of the dataset's own (a val/ folder, a streamed source) is not called held out."""
    own = run_spec.evaluated_on == "test" and run_spec.recipe_file
    key = "test-own" if own else run_spec.evaluated_on
    if key == "validation":
        key += ("-given" if validation_given else "") + ("" if has_test else "-only")
    return EVALUATION_NOTES.get(key, "")


def announce(run: str, run_spec: RunSpec, saved: RunSpec | None, resume_state,
             has_test: bool = True, validation_given: bool = False) -> None:
    """Print where training starts (resumed from which checkpoint) and what it will do."""
    if resume_state:
        note = ""
        if (saved.replicas, saved.engine) != (run_spec.replicas, run_spec.engine):
            note = (f" (the run began on {saved.replicas} replica(s) with {saved.engine}; "
                    "same data order, so results differ only by floating-point rounding)")
        where = os.path.basename(resume_state["path"])
        if resume_state.get("local"):
            where = (f"the local copy {where} (newer than the run's newest committed checkpoint; "
                     f"{os.path.dirname(resume_state['path'])})")
        print(f"resuming {run} from {where}: epoch "
              f"{resume_state['epoch'] + 1} step {resume_state['step']}{note}", flush=True)
    per_dispatch = (f", {run_spec.steps_per_dispatch} steps per dispatch"
                    if run_spec.steps_per_dispatch > 1 else "")
    if run_spec.micro_batches > 1:
        sized = " cache-sized" if run_spec.engine == "tensorflow" else " per-device"
        per_dispatch += f", gradients summed over {run_spec.micro_batches}{sized} micro-batches"
    print(f"training {run_spec.recipe}: {run_spec.epochs} epoch(s) x {run_spec.steps_per_epoch} steps "
          f"of {run_spec.global_batch} {run_spec.sample_name} (global batch){per_dispatch}, seed {run_spec.seed}; "
          f"{evaluation_note(run_spec, has_test, validation_given)}run directory {run}", flush=True)
