"""A model's scores: accuracy (a classifier's; a model that is no classifier: mean absolute
error) and mean loss over a split, and the end-of-run scores of a run.

This module imports Keras at its top: it runs after connect() (meshfit.run.keras_side.fitting
during training, meshfit.run.evaluate for `meshfit eval`).
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


def is_classifier(model, class_names) -> bool:
    """Whether `model` outputs one value per class of `class_names` (a classifier, or a subclassed
    model that does not say its output shape), or one value for two classes (a binary
    classifier: a sigmoid's, or its logit); a model with another output width, or data with no
    classes (a regression's float targets), is no classifier: it has no accuracy to measure."""
    shape = model.output_shape if hasattr(model, "output_shape") else None
    width = shape[-1] if isinstance(shape, tuple) and shape else None
    return bool(class_names) and (width is None or width == len(class_names)
                                  or (width == 1 and len(class_names) == 2))


def outputs_of(model, class_names, loss) -> str:
    """What a classifier's outputs are, as config.json records them ("outputs") for inference,
    which turns them into probabilities (meshfit.serve.inference.probabilities): "probabilities"
    (a softmax's), "logits" (loss from_logits=True), "sigmoid" (one output for two classes: the
    second class's probability) or "sigmoid-logits" (its logit). The loss says, as it is what
    the outputs were trained for; a model that is no classifier: "values"."""
    if not is_classifier(model, class_names):
        return "values"
    shape = model.output_shape if hasattr(model, "output_shape") else None
    if isinstance(shape, tuple) and shape and shape[-1] == 1:
        return "sigmoid-logits" if from_logits(loss) else "sigmoid"
    return "logits" if from_logits(loss) else "probabilities"


def from_logits(loss) -> bool:
    """Whether a Keras loss (a name or object) takes logits (from_logits=True); names never do."""
    return bool(getattr(loss, "from_logits", False))


def accuracy_metric(outputs: str):
    """The metric compile() gets for a model's `outputs` (see outputs_of), named "accuracy" for
    every classifier (a binary one's threshold at its probability 0.5: 0 for a logit)."""
    if outputs.startswith("sigmoid"):
        threshold = 0.0 if outputs.endswith("logits") else 0.5
        return keras.metrics.BinaryAccuracy(name="accuracy", threshold=threshold)
    return "mae" if outputs == "values" else "accuracy"


def evaluate_model(model, batches, labels: np.ndarray, loss, tta_flip: bool = False,
                   advance=None, classifier: bool = True, tta_translate: int = 0) -> dict[str, float]:
    """{"accuracy", "loss"}: accuracy and mean loss over every sample of `batches` (a
    arrays.EvalBatches or folders.FolderEvalBatches); for a model that is no classifier
    {"mae", "loss"}: the mean absolute error of its outputs instead (argmax would make up an
    accuracy). advance, tta_flip, tta_translate: see meshfit.fit.predict."""
    outputs = predict(model, batches, tta_flip=tta_flip, advance=advance, tta_translate=tta_translate)
    if not classifier:
        outputs = np.asarray(outputs, np.float32)  # one target per output, else per sample
        shape = outputs.shape if labels.size == outputs.size else (len(outputs),) + (1,) * (outputs.ndim - 1)
        targets = labels.reshape(shape).astype(np.float32)
        return {"mae": float(np.mean(np.abs(outputs - targets))),
                "loss": _loss_value(loss, targets, outputs)}
    if outputs.shape[-1] == 1:  # a binary classifier's sigmoid (or logit): class 1 past 0.5 (0)
        chosen = (outputs[..., 0] > (0.0 if from_logits(loss) else 0.5)).astype(np.int64)
        accuracy = float(np.mean(chosen == labels.reshape(chosen.shape)))
        return {"accuracy": accuracy, "loss": _loss_value(loss, labels.reshape(outputs.shape), outputs)}
    if labels.size == np.prod(outputs.shape[:-1]):  # a label per position (a language model's
        labels = labels.reshape(outputs.shape[:-1])  # next tokens), flattened with the data
    accuracy = float(np.mean(np.argmax(outputs, axis=-1) == labels.reshape(outputs.shape[:-1])))
    return {"accuracy": accuracy, "loss": _loss_value(loss, labels, outputs)}


def score(model, history: list[dict[str, Any]], dataset, global_batch: int, loss, tta_flip: bool,
          epochs: int, classifier: bool = True, tta_translate: int = 0) -> dict[str, float]:
    """test_accuracy/test_loss and validation_accuracy/validation_loss (no classifier: test_mae
    and validation_mae for the accuracies), for the splits the data has: the last epoch's
    evaluation where it ran on that split, else evaluated now."""
    final = history[-1] if history else {}
    done = final.get("epoch") == epochs and "val_loss" in final
    scores = {}
    for name, split in (("test", dataset.test), ("validation", dataset.validation)):
        if split is None:
            continue
        if done and dataset.per_epoch[0] == name:
            result = {key: final[f"val_{key}"] for key in ("accuracy", "mae", "loss")
                      if f"val_{key}" in final}
        else:
            result = evaluate_model(model, data.eval_batches(dataset, split, global_batch),
                                    data.labels(split), loss, tta_flip, classifier=classifier,
                                    tta_translate=tta_translate)
        scores.update({f"{name}_{key}": value for key, value in result.items()})
        scores[f"{name}_samples"] = data.size(split)
    return scores
