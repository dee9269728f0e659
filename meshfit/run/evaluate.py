"""`meshfit eval`: a run's model on its test set, its validation split, or another folder; and
the headline score of a run. The scoring itself is meshfit.run.keras_side.scores (Keras side),
reached after connect()."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import meshfit
from meshfit.data import datasets, folder_scan, splits as data
from meshfit.data.arrays import tta_views
from meshfit.errors import MeshfitError
from meshfit.run import models, rundir, spec
from meshfit.watch import progress


def headline(scores: dict[str, Any]) -> tuple[str, float | None, float | None, int | None]:
    """(split name, accuracy, loss, samples) to show: the test set's, else the validation's
    (accuracy None for a model that is no classifier)."""
    name = "test" if "test_loss" in scores else "validation"
    return (name, scores.get(f"{name}_accuracy"), scores.get(f"{name}_loss"),
            scores.get(f"{name}_samples"))


def score_line(scores: dict[str, Any]) -> str:
    """What was measured on the headline split: "test accuracy 0.9012  test loss 0.2741", or a
    model's that is no classifier "test mae 0.1234  test loss 0.0301"."""
    name = headline(scores)[0]
    return "  ".join(f"{name} {key} {scores[f'{name}_{key}']:.4f}" for key in ("accuracy", "mae", "loss")
                     if scores.get(f"{name}_{key}") is not None)


def evaluate(run_or_model: str, data_dir: str | None = None, *, folder: str | None = None,
             simulate_devices: int | None = None, engine: str | None = None,
             require: str | None = None, verbose: bool = False) -> dict[str, Any]:
    """Accuracy and loss of a trained run (its directory or model.keras) on its test set, or on
    its validation split when its data has no test set: {"test_accuracy", "test_loss"} (or
    validation_*; a model that is no classifier: "test_mae" for the accuracy), with "split", "samples", "data" (what was scored) and the devices used.

    data_dir: where a built-in dataset is (default: the one recorded in the run's config.json).
    folder: score on this folder of class sub-folders instead (as the test split; its class
    folders named as the run's classes, images resized to the run's input shape).
    Uses the run's recipe (its copy of a recipe file: loss, test-time flips), seed, validation
    split and global batch.
    """
    if folder is not None and data_dir is not None:
        raise MeshfitError("give --data FOLDER (a folder of class sub-folders) or --data-dir DIR "
                           "(where a built-in dataset is), not both")
    datasets.check_data_dir(data_dir)
    if folder is not None:
        folder_scan.check_folder(folder)  # before connecting
    run, model_path = rundir.locate_run(run_or_model)
    saved, _ = spec.read(run)

    strategy = meshfit.connect(require=require, simulate_devices=simulate_devices, engine=engine,
                               verbose=verbose)
    recipe = models.recipe_of_run(run, saved)  # a recipe file runs after Keras has its engine
    recipe = dataclasses.replace(recipe, validation_split=saved.validation_split)  # as trained
    from meshfit.run.keras_side import scores  # the engine line: Keras is imported (connect ran)

    if folder is not None:
        dataset = data.other_folder(folder, saved.class_names, saved.input_shape)
    else:
        dataset = data.load(recipe, data_dir or saved.data_dir, saved.seed, saved.dataset)
    name, split = ("test", dataset.test) if dataset.test is not None else ("validation", dataset.validation)
    if split is None:
        raise MeshfitError(f"{run}'s data has no test set and no validation split to evaluate on; "
                           f"score it on other data: meshfit eval {run} --data FOLDER")
    global_batch = math.ceil(saved.global_batch / strategy.replicas) * strategy.replicas
    with strategy.scope():
        model = models.load_keras_model(model_path, run if saved.recipe_file else None, recipe,
                                        distributed=True)
        batches = data.eval_batches(dataset, split, global_batch)
        passes = len(tta_views(recipe.tta_flip, recipe.tta_translate))
        with progress.task("evaluating", total=len(batches) * passes) as advance:
            result = scores.evaluate_model(model, batches, data.labels(split), recipe.make_loss(),
                                           recipe.tta_flip, advance,
                                           scores.is_classifier(model, saved.class_names),
                                           recipe.tta_translate)
    return {**{f"{name}_{key}": value for key, value in result.items()}, "split": name,
            "samples": data.size(split), "sample_name": saved.sample_name, "data": dataset.source,
            "recipe": recipe.name, "model": model_path, "engine": strategy.engine,
            "replicas": strategy.replicas, "platform": strategy.platform}
