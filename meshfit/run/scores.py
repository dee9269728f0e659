"""A model's scores: accuracy and mean loss over a split, and the end-of-run scores of a run.

This module imports Keras at its top: it runs after connect() (meshfit.run.fitting during
training, meshfit.run.evaluate for `meshfit eval`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from meshfit.data import splits as data
from meshfit.fit.predict import predict


def _loss_value(loss, labels: np.ndarray, outputs: np.ndarray) -> float:
    """The mean of `loss` over all samples (loss: a Keras loss name or object)."""
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    return float(np.mean(keras.ops.convert_to_numpy(fn(labels, outputs))))


def evaluate_model(model, batches, labels: np.ndarray, loss, tta_flip: bool = False,
                   advance=None) -> dict[str, float]:
    """{"accuracy", "loss"}: accuracy and mean loss over every sample of `batches` (a
    arrays.EvalBatches or folders.FolderEvalBatches); advance: see meshfit.fit.predict."""
    outputs = predict(model, batches, tta_flip=tta_flip, advance=advance)
    if labels.size == np.prod(outputs.shape[:-1]):  # a label per position (a language model's
        labels = labels.reshape(outputs.shape[:-1])  # next tokens), flattened with the data
    accuracy = float(np.mean(np.argmax(outputs, axis=-1) == labels.reshape(outputs.shape[:-1])))
    return {"accuracy": accuracy, "loss": _loss_value(loss, labels, outputs)}


def score(model, history: list[dict[str, Any]], dataset, global_batch: int, loss, tta_flip: bool,
          epochs: int) -> dict[str, float]:
    """test_accuracy/test_loss and validation_accuracy/validation_loss, for the splits the data
    has: the last epoch's evaluation where it ran on that split, else evaluated now."""
    final = history[-1] if history else {}
    done = final.get("epoch") == epochs and "val_accuracy" in final
    scores = {}
    for name, split in (("test", dataset.test), ("validation", dataset.validation)):
        if split is None:
            continue
        if done and dataset.per_epoch[0] == name:
            result = {"accuracy": final["val_accuracy"], "loss": final["val_loss"]}
        else:
            result = evaluate_model(model, data.eval_batches(dataset, split, global_batch),
                                    data.labels(split), loss, tta_flip)
        scores.update({f"{name}_accuracy": result["accuracy"], f"{name}_loss": result["loss"],
                       f"{name}_samples": data.size(split)})
    return scores
