"""`meshfit train` and `meshfit eval`: train a recipe into a run directory, evaluate it again.

A run directory (default runs/<recipe>-<YYYYmmdd-HHMMSS>/) holds
  config.json   everything needed to repeat the run (written first, so a killed run can resume)
  checkpoints/  the full training state, see meshfit.checkpoints
  model.keras   the trained model (raw 0-255 pixels in, class probabilities out)
  history.json  per-epoch train and test loss/accuracy, time, samples/s, MFU
  metrics.json  the final figures (test accuracy and loss, speed, hardware, settings)
  curves.png    loss and accuracy per epoch, train and test
Only process 0 prints epoch lines and writes files.

Training is deterministic for a given seed: weights start from `keras.utils.set_random_seed`, the
data order and augmentation are functions of (seed, epoch, step) (meshfit.pipeline), Dropout's
random state is checkpointed, and TensorFlow runs with op determinism. So `--resume` of a killed
run ends with the same weights as an uninterrupted run on the same engine and devices.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shlex
import sys
import time
from typing import Any

import numpy as np

from meshfit import __version__, datasets, recipes
from meshfit.errors import MeshfitError

DEFAULT_RECIPE = "fashion-mnist-cnn"
DEFAULT_CHECKPOINT_EVERY = "60s"
AUTO_STEPS_PER_DISPATCH = 32  # on accelerators: at most this many steps per dispatch, 2+ per epoch
CONFIG, HISTORY, METRICS = "config.json", "history.json", "metrics.json"
MODEL, CURVES = "model.keras", "curves.png"
CHECKPOINTS = "checkpoints"


# -------------------------------------------------------------------------------------- helpers

def parse_every(text: str | int | None) -> tuple[int | None, float | None, bool]:
    """`--checkpoint-every` as (every N steps, every S seconds, also at epoch ends).

    "200": every 200 steps; "60s", "5m", "1h": every so many seconds, minutes, hours; "epoch":
    only at epoch ends; "off": never (a SIGTERM/SIGINT still saves before stopping). Epoch ends
    are saved unless "off".
    """
    value = str(DEFAULT_CHECKPOINT_EVERY if text is None else text).strip().lower()
    if value in ("off", "none", "never"):
        return None, None, False
    if value == "epoch":
        return None, None, True
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh]?)", value)
    if not match or float(match.group(1)) <= 0 or (not match.group(2) and "." in match.group(1)):
        raise MeshfitError(f"--checkpoint-every {text!r} is not understood; use a step count (200), "
                           "a time (60s, 5m, 1h), 'epoch' or 'off'")
    number, unit = match.groups()
    if not unit:
        return int(number), None, True
    return None, float(number) * {"s": 1, "m": 60, "h": 3600}[unit], True


def _read_json(path: str) -> Any:
    """A JSON file's contents; an unreadable file is a one-line MeshfitError."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise MeshfitError(f"cannot read {path} ({e}); pass a run directory written by "
                           "meshfit train") from e


def _write_json(path: str, data: Any) -> None:
    """Write JSON to `path` atomically (a temporary file renamed into place)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def recipe_loss(recipe: recipes.Recipe):
    """The recipe's loss: a Keras loss name or object as given, else the result of calling it."""
    import keras

    if isinstance(recipe.loss, (str, keras.losses.Loss)):
        return recipe.loss
    return recipe.loss()


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


def _new_run_dir(out: str | None, recipe: str) -> str:
    """The run directory to create: `out`, or runs/<recipe>-<time> (made unique)."""
    if out:
        if os.path.isfile(os.path.join(out, CONFIG)):
            raise MeshfitError(f"{out} already holds a run; continue it with --resume {out} or "
                               "choose another --out")
        return out
    return timestamped_dir(recipe)


def timestamped_dir(name: str) -> str:
    """A new directory path runs/<name>-<YYYYmmdd-HHMMSS>, with a suffix if that exists."""
    base = os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def _resume_config(run: str, recipe: str | None, batch_size: int | None, seed: int | None,
                   precision: str | None) -> dict[str, Any]:
    """The run's config.json, after checking that the requested settings do not contradict it."""
    from meshfit import planning

    path = os.path.join(run, CONFIG)
    if not os.path.isfile(path):
        raise MeshfitError(f"{run} has no {CONFIG}; pass a run directory written by meshfit train")
    config = _read_json(path)
    hint = f"resume without it, or start a new run instead of --resume {run}"
    if recipe and recipe != config["recipe"]:
        raise MeshfitError(f"{run} was trained with recipe {config['recipe']}, not {recipe}; {hint}")
    if batch_size and batch_size != config["global_batch"]:
        raise MeshfitError(f"{run} was trained with global batch {config['global_batch']}, not "
                           f"{batch_size} (the data order depends on it); {hint}")
    if seed is not None and seed != config["seed"]:
        raise MeshfitError(f"{run} was trained with seed {config['seed']}, not {seed}; {hint}")
    if precision not in (None, "auto") and \
            planning.resolve_precision(precision, "cpu") != config["precision"]:
        raise MeshfitError(f"{run} was trained in {config['precision']}, not {precision}; {hint}")
    return config


def _build_metrics(model, labels: np.ndarray) -> None:
    """Create the compiled metrics' variables now (Keras/TF makes them at the first step)."""
    outputs = np.zeros((len(labels),) + tuple(model.output_shape[1:]), "float32")
    model.compute_metrics(None, labels, outputs)


def _python_command(**kwargs) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)
    return f"meshfit.training.train({shown})"


# ---------------------------------------------------------------------------------------- train

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


def _global_batch(strategy, recipe: recipes.Recipe, batch_size: int | None, rounding: bool) -> int:
    """The global batch: asked for, or the recipe's; checked to split across the replicas."""
    if batch_size or recipe.global_batch:
        return strategy.check_batch(batch_size or recipe.global_batch, rounding=rounding)
    return strategy.global_batch(recipe.per_core_batch or 128, rounding=rounding)


def choose_steps_per_dispatch(strategy, steps_per_epoch: int, wanted: int | None = None) -> int:
    """Train steps per dispatch: `wanted` (or, by default, up to 32 on a GPU or TPU and 1 on a
    CPU), lowered to divide the epoch's steps so that no dispatch runs into the next epoch."""
    from meshfit import jax_loop

    if wanted is None:
        if strategy.platform == "cpu" or strategy.engine != "jax":
            return 1
        wanted = min(AUTO_STEPS_PER_DISPATCH, max(steps_per_epoch // 2, 1))  # 2+ calls: compile apart
    return jax_loop.dividing_steps(steps_per_epoch, wanted)  # checks `wanted` too


def _build(strategy, recipe: recipes.Recipe, dataset, global_batch: int, steps: int, epochs: int,
           seed: int, dispatch_steps: int = 1):
    """Seeded model (built, prepared, compiled) and the train/test batches, on the strategy."""
    import keras

    from meshfit import pipeline

    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    if strategy.engine == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()  # bit-identical resume on TensorFlow
    with strategy.scope():
        batches = pipeline.TrainBatches(dataset.x_train, dataset.y_train, global_batch, seed,
                                        steps, recipe.augment, crop_padding=recipe.crop_padding,
                                        flips=recipe.flips)
        test_batches = pipeline.EvalBatches(dataset.x_test, global_batch)
        model = recipe.build_model(tuple(recipe.input_shape or dataset.input_shape),
                                   dataset.num_classes)
        if recipe.prepare is not None:
            recipe.prepare(model, dataset)
        loss = recipe_loss(recipe)
        model.compile(optimizer=recipe.optimizer(steps, epochs), loss=loss, metrics=["accuracy"],
                      steps_per_execution=dispatch_steps)
    return model, batches, test_batches, loss


def _restore(model, run: str, steps: int, labels: np.ndarray) -> dict[str, Any]:
    """Load the run's newest checkpoint into the model; return its state (see checkpoints.restore)."""
    from meshfit import checkpoints

    newest = checkpoints.latest(os.path.join(run, CHECKPOINTS))
    if newest is None:
        raise MeshfitError(f"{os.path.join(run, CHECKPOINTS)} has no checkpoint to resume from; "
                           "start a new run")
    state = checkpoints.restore(model, newest)
    if state["steps_per_epoch"] != steps:
        raise MeshfitError(f"{newest} was taken at {state['steps_per_epoch']} steps per epoch but "
                           f"this run has {steps}; resume with the same data")
    _build_metrics(model, labels[:1])
    state["path"] = newest
    return state


def _fit(strategy, model, batches, callbacks: list, checkpointer, start: tuple[int, int],
         epochs: int, micro_batches: int = 1) -> None:
    """Fit from (epoch, step) `start` to the end: the rest of a cut epoch first, then whole ones.

    The rest of a cut epoch runs with steps per dispatch dividing its step count.
    SIGTERM/SIGINT make the checkpointer save and raise TrainingInterrupted.
    """
    from meshfit import checkpoints, jax_loop

    epoch, step = start
    steps, dispatch = batches.steps_per_epoch, model.steps_per_execution
    with checkpoints.stop_on_signals(checkpointer):
        if step and epoch < epochs:
            if (steps - step) % dispatch:
                jax_loop.install(model, jax_loop.dividing_steps(steps - step, dispatch))
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


def _write_results(run: str, model, history: list, metrics: dict[str, Any]) -> None:
    """model.keras, history.json, metrics.json and curves.png in the run directory."""
    from meshfit import cluster

    tmp = os.path.join(run, f".tmp-{MODEL}")
    with cluster.outside_mesh():  # saving alone under the multi-host mesh would wait for the others
        model.save(tmp)
    os.replace(tmp, os.path.join(run, MODEL))
    _write_json(os.path.join(run, HISTORY), history)
    _write_json(os.path.join(run, METRICS), metrics)
    plot_curves(history, os.path.join(run, CURVES),
                f"{metrics['recipe']}: test accuracy {metrics['test_accuracy']:.2%}")


def train(recipe: str | None = None, *, epochs: int | None = None, batch_size: int | None = None,
          precision: str | None = None, data_dir: str | None = None, out: str | None = None,
          seed: int | None = None, simulate_devices: int | None = None, engine: str | None = None,
          require: str | None = None, resume: str | None = None,
          checkpoint_every: str | int | None = None, keep_checkpoints: int = 3,
          steps_per_dispatch: int | None = None, micro_batches: int | str | None = None,
          batch_rounding: bool = True, callbacks: list | None = None, verbose: bool = True,
          command: str | None = None) -> dict[str, Any]:
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
    keep_checkpoints: how many checkpoints to keep. steps_per_dispatch: train steps per call into
      the devices (default: see choose_steps_per_dispatch). micro_batches: slices of each batch
      whose gradients are summed, for cache locality on a CPU (default 'auto', see
      meshfit.tf_microbatch; 1 = whole batches). batch_rounding: False makes a global
      batch that does not split across the replicas an error instead of rounding it up.
    callbacks: extra Keras callbacks for fit. command: the command line to record.
    Raises TrainingInterrupted (a MeshfitError; exit_code 143 or 130) after SIGTERM/SIGINT,
    once the state is saved.
    """
    command = command or _python_command(recipe=recipe, epochs=epochs, batch_size=batch_size,
                                         precision=precision, data_dir=data_dir, out=out, seed=seed,
                                         resume=resume)
    config = None
    if resume is not None:
        config = _resume_config(resume, recipe, batch_size, seed, precision)
        recipe, batch_size, seed = config["recipe"], config["global_batch"], config["seed"]
        precision, epochs = config["precision"], epochs or config["epochs"]
        data_dir = data_dir or config.get("data_dir")
        engine = engine or config.get("engine")
        simulate_devices = simulate_devices or config.get("simulated_devices")
        checkpoint_every = checkpoint_every or config.get("checkpoint_every")
    the_recipe = recipes.get(recipe or DEFAULT_RECIPE)
    if the_recipe.dataset == "synthetic":
        raise MeshfitError(f"recipe {the_recipe.name} trains on random data to measure speed; "
                           f"time it with: meshfit bench {the_recipe.name}")
    seed = 0 if seed is None else int(seed)
    if not 0 <= seed < 2 ** 31:
        raise MeshfitError(f"seed {seed} is out of range; use 0 to {2 ** 31 - 1}")
    epochs = int(epochs or the_recipe.epochs)
    if epochs < 1:
        raise MeshfitError(f"--epochs must be at least 1, got {epochs}")
    every_steps, every_seconds, at_epoch_end = parse_every(checkpoint_every)
    if micro_batches not in (None, "auto"):
        from meshfit import tf_microbatch

        tf_microbatch.check(None, micro_batches)

    from meshfit.distribution import connect

    strategy = connect(require=require, simulate=simulate_devices, engine=engine, verbose=verbose,
                       precision=the_recipe.precision if precision in (None, "auto") else precision)
    chief = strategy.info.process_index == 0
    global_batch = _global_batch(strategy, the_recipe, batch_size, batch_rounding and resume is None)
    dataset = datasets.load(the_recipe.dataset, data_dir)
    full_steps = len(dataset.x_train) // global_batch
    steps = min(the_recipe.steps_per_epoch or full_steps, full_steps) or None
    dispatch = choose_steps_per_dispatch(strategy, steps or 1, steps_per_dispatch)
    model, batches, test_batches, loss = _build(strategy, the_recipe, dataset, global_batch, steps,
                                                epochs, seed, dispatch)
    steps = batches.steps_per_epoch
    if micro_batches is None:  # a resumed run keeps its slices where it can (same rounding)
        resumed = (config or {}).get("micro_batches")
        micro_batches = resumed if resumed and strategy.engine == "tensorflow" else "auto"
    slices = strategy.micro_batches(model, global_batch, micro_batches)

    import keras

    from meshfit import checkpoints, cluster
    from meshfit.report import EpochReport

    run = resume or _new_run_dir(out, the_recipe.name)
    cluster.barrier("meshfit: run directory checked")  # before process 0 writes into it
    resume_state = _restore(model, run, steps, dataset.y_train) if resume is not None else None
    history = list(resume_state["history"]) if resume_state else []
    settings = {
        "recipe": the_recipe.name, "dataset": the_recipe.dataset,
        "class_names": list(dataset.class_names),
        "input_shape": list(the_recipe.input_shape or dataset.input_shape),
        "num_classes": dataset.num_classes, "epochs": epochs, "steps_per_epoch": steps,
        "global_batch": global_batch, "steps_per_dispatch": dispatch, "micro_batches": slices,
        "seed": seed, "precision": strategy.precision, "engine": strategy.engine,
        "replicas": strategy.replicas,
        "platform": strategy.platform, "device_kind": strategy.device_kind,
        "simulated_devices": strategy.info.devices_per_host if strategy.info.simulated else None,
        "data_dir": os.path.abspath(data_dir) if data_dir else None,
        "augment": the_recipe.augment, "crop_padding": the_recipe.crop_padding,
        "flips": the_recipe.flips, "tta_flip": the_recipe.tta_flip,
        "checkpoint_every": str(checkpoint_every or DEFAULT_CHECKPOINT_EVERY),
        "meshfit_version": __version__, "keras_version": keras.__version__, "command": command,
    }
    if chief:
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        if config is None:
            config = {**settings, "started": now}
        else:
            config["epochs"] = epochs
            config.setdefault("resumed", []).append({
                "command": command, "at": now, "checkpoint": os.path.basename(resume_state["path"]),
                "engine": strategy.engine, "replicas": strategy.replicas,
                "steps_per_dispatch": dispatch, "micro_batches": slices})
        os.makedirs(run, exist_ok=True)
        _write_json(os.path.join(run, CONFIG), config)
    if verbose and chief and resume_state:
        note = ""
        if (config["replicas"], config["engine"]) != (strategy.replicas, strategy.engine):
            note = (f" (the run began on {config['replicas']} replica(s) with {config['engine']}; "
                    "same data order, so results differ only by floating-point rounding)")
        print(f"resuming {run} from {os.path.basename(resume_state['path'])}: epoch "
              f"{resume_state['epoch'] + 1} step {resume_state['step']}{note}", flush=True)
    if verbose and chief:
        per_dispatch = f", {dispatch} steps per dispatch" if dispatch > 1 else ""
        if slices > 1:
            per_dispatch += f", gradients summed over {slices} cache-sized micro-batches"
        print(f"training {the_recipe.name}: {epochs} epoch(s) x {steps} steps of {global_batch} "
              f"images (global batch){per_dispatch}, seed {seed}; run directory {run}", flush=True)

    report = EpochReport(batch_size=global_batch, strategy=strategy,
                         stream=None if chief else io.StringIO())
    recorder = _History(history, report, global_batch)
    checkpointer = checkpoints.Checkpointer(
        os.path.join(run, CHECKPOINTS), steps, every_steps=every_steps, every_seconds=every_seconds,
        epoch_end=at_epoch_end, keep=keep_checkpoints, resume_state=resume_state, write=chief,
        extra=lambda: {"seed": seed, "history": history, "config": settings})
    fit_callbacks = [
        keras.callbacks.LambdaCallback(on_epoch_end=_EpochEnd(
            model, test_batches, dataset.y_test, loss, the_recipe.tta_flip, report)),
        report,
        keras.callbacks.LambdaCallback(on_epoch_end=recorder),
        checkpointer, *(callbacks or [])]
    start = (resume_state["epoch"], resume_state["step"]) if resume_state else (0, 0)
    _fit(strategy, model, batches, fit_callbacks, checkpointer, start, epochs, slices)

    final = history[-1] if history else {}
    if final.get("epoch") == epochs and "val_accuracy" in final:  # the last epoch's evaluation
        scores = {"test_accuracy": final["val_accuracy"], "test_loss": final["val_loss"]}
    else:
        scores = evaluate_model(model, test_batches, dataset.y_test, loss, the_recipe.tta_flip)
    train_seconds = sum(r.get("train_seconds") or 0.0 for r in history)
    metrics = {
        **scores, "train_accuracy": final.get("accuracy"), "train_loss": final.get("loss"),
        "train_seconds": train_seconds,
        "compile_seconds": sum(r.get("compile_seconds") or 0.0 for r in history),
        "samples_per_second": (sum(r.get("samples") or 0 for r in history) / train_seconds
                               if train_seconds else None),
        "recipe": the_recipe.name, "epochs": epochs, "steps_per_epoch": steps,
        "global_batch": global_batch, "steps_per_dispatch": dispatch, "micro_batches": slices,
        "seed": seed, "platform": strategy.platform,
        "device_kind": strategy.device_kind, "replicas": strategy.replicas,
        "precision": strategy.precision, "engine": strategy.engine,
        "resumed": resume is not None, "run_dir": run,
    }
    if chief:
        _write_results(run, model, history, metrics)
        if verbose:
            print(f"test accuracy {scores['test_accuracy']:.4f}  test loss {scores['test_loss']:.4f}"
                  f"  ({len(dataset.x_test)} images); wrote {run}", flush=True)
    return metrics


# ----------------------------------------------------------------------------------------- eval

def _locate(run_or_model: str) -> tuple[str, str]:
    """(run directory, model file) for a run directory or its model.keras."""
    path = os.fspath(run_or_model)
    if os.path.isdir(path):
        run, model_path = path, os.path.join(path, MODEL)
    else:
        run, model_path = os.path.dirname(path) or ".", path
    hint = "pass a run directory written by meshfit train (or the model.keras inside it)"
    if not os.path.isfile(model_path):
        raise MeshfitError(f"{model_path} not found; {hint}")
    if not os.path.isfile(os.path.join(run, CONFIG)):
        raise MeshfitError(f"{run} has no {CONFIG}, so its dataset is unknown; {hint}")
    return run, model_path


def evaluate(run_or_model: str, data_dir: str | None = None, *, simulate_devices: int | None = None,
             engine: str | None = None, require: str | None = None,
             verbose: bool = False) -> dict[str, Any]:
    """Test accuracy and loss of a trained run (its directory or model.keras), on its test set.

    data_dir: where the dataset is (default: the one recorded in the run's config.json).
    Uses the run's recipe (loss, test-time flips) and global batch.
    """
    run, model_path = _locate(run_or_model)
    config = _read_json(os.path.join(run, CONFIG))
    recipe = recipes.get(config["recipe"])

    from meshfit.distribution import connect

    strategy = connect(require=require, simulate=simulate_devices, engine=engine, verbose=verbose)
    import keras

    from meshfit import pipeline

    dataset = datasets.load(config["dataset"], data_dir or config.get("data_dir"))
    batch = math.ceil(config["global_batch"] / strategy.replicas) * strategy.replicas
    with strategy.scope():
        model = keras.saving.load_model(model_path, compile=False)
        batches = pipeline.EvalBatches(dataset.x_test, batch)
        scores = evaluate_model(model, batches, dataset.y_test, recipe_loss(recipe), recipe.tta_flip)
    return {**scores, "samples": len(dataset.x_test), "recipe": recipe.name, "model": model_path,
            "engine": strategy.engine, "replicas": strategy.replicas, "platform": strategy.platform}


# ------------------------------------------------------------------------------------------ CLI

def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `meshfit train`."""
    from meshfit.cli import add_device_arguments

    parser.add_argument("recipe", nargs="?", metavar="RECIPE",
                        help=f"one of: {', '.join(recipes.names())} (default: {DEFAULT_RECIPE})")
    parser.add_argument("--epochs", type=int, metavar="N", help="epochs (default: the recipe's)")
    parser.add_argument("--batch-size", type=int, metavar="GLOBAL",
                        help="global batch over all replicas (default: the recipe's)")
    parser.add_argument("--data-dir", metavar="DIR", help="where the dataset is (see meshfit.datasets)")
    parser.add_argument("--out", metavar="DIR", help="the run directory (default: runs/<recipe>-<time>)")
    parser.add_argument("--seed", type=int, metavar="S", help="random seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print metrics.json as the last line")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    parser.add_argument("--checkpoint-every", metavar="EVERY",
                        help="steps (200), time (60s, 5m), 'epoch' or 'off' (default: 60s); "
                             "epoch ends are always saved unless 'off'")
    parser.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                        help="keep the newest K checkpoints (default: 3)")
    parser.add_argument("--steps-per-dispatch", type=int, metavar="K",
                        help="train steps per call into the devices, one compiled loop (default: "
                             f"up to {AUTO_STEPS_PER_DISPATCH} on a GPU or TPU, 1 on a CPU)")
    parser.add_argument("--micro-batches", type=int, metavar="K",
                        help="sum each batch's gradient over K slices, for cache locality on a CPU "
                             "(default: cache-sized on the TensorFlow engine; 1 = whole batches)")
    parser.add_argument("--no-batch-rounding", action="store_true",
                        help="fail instead of rounding a batch that does not split across replicas")
    add_device_arguments(parser)


def run_train(args: argparse.Namespace) -> int:
    """`meshfit train`."""
    command = shlex.join(["meshfit", *sys.argv[1:]])
    try:
        metrics = train(args.recipe, epochs=args.epochs, batch_size=args.batch_size,
                        precision=args.precision, data_dir=args.data_dir, out=args.out,
                        seed=args.seed, simulate_devices=args.simulate_devices, engine=args.engine,
                        require=args.require, resume=args.resume,
                        checkpoint_every=args.checkpoint_every,
                        keep_checkpoints=args.keep_checkpoints,
                        steps_per_dispatch=args.steps_per_dispatch,
                        micro_batches=args.micro_batches,
                        batch_rounding=not args.no_batch_rounding, verbose=True, command=command)
    except MeshfitError as err:
        if not hasattr(err, "exit_code"):  # only TrainingInterrupted has its own exit code
            raise
        print(f"meshfit: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    if args.json:
        print(json.dumps(metrics), flush=True)
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `meshfit eval`."""
    from meshfit.cli import add_device_arguments

    parser.add_argument("model", metavar="RUN_DIR_OR_MODEL",
                        help="a run directory written by meshfit train, or its model.keras")
    parser.add_argument("--data-dir", metavar="DIR", help="where the dataset is (default: the run's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON, last line")
    add_device_arguments(parser)


def run_eval(args: argparse.Namespace) -> int:
    """`meshfit eval`."""
    result = evaluate(args.model, args.data_dir, simulate_devices=args.simulate_devices,
                      engine=args.engine, require=args.require, verbose=not args.json)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"test accuracy {result['test_accuracy']:.4f}  test loss {result['test_loss']:.4f}"
              f"  ({result['samples']} images)")
    return 0
