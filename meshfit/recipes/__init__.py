"""Recipes: a model, its data and its hyperparameters, one readable file each.

Each recipe module defines `RECIPE`, a `Recipe`, and states in its docstring the expected result
measured on named hardware. `get(name)` finds one; `names()` lists them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from meshfit.errors import MeshfitError
from meshfit.pipeline import CROP_PADDING

DEFAULT = "fashion-mnist-cnn"  # what `meshfit train` and `meshfit bench` run without a name
_MODULES = {
    "fashion-mnist-cnn": "fashion_mnist_cnn",
    "cifar10-cnn": "cifar10_cnn",
    "mnist-mlp-bf16": "mnist_mlp_bf16",
    "cifar10-fast": "cifar10_fast",
    "resnet50-synthetic": "resnet50_synthetic",
}


@dataclass(frozen=True)
class Recipe:
    """Everything needed to train one model: see any recipe module for a filled-in example.

    build_model(input_shape, num_classes) returns an uncompiled Keras model that takes raw
    uint8-valued pixels (scaling lives in the model, so inference needs no preprocessing);
    optimizer(steps_per_epoch, epochs) returns a Keras optimizer (schedules need the step count).
    global_batch is the batch over all replicas; per_core_batch, when set, wins and is
    multiplied by the replicas after rounding to the hardware multiple.
    loss: a Keras loss name, or a callable returning a loss object.
    augment: "none", or "flip-crop" (random crop after crop_padding pixels of reflect padding,
    i.e. translations up to that many pixels, and horizontal flips, on the device); flips:
    "random", or "alternate" (each image mirrored every other epoch; see meshfit.pipeline).
    prepare(model, dataset): optional, called after the model is built and before training
    (e.g. a data-dependent first-layer initialization).
    tta_flip: evaluate on each image and its mirror image, averaging the probabilities.
    """

    name: str
    dataset: str
    build_model: Callable[..., Any]
    optimizer: Callable[[int, int], Any]
    epochs: int
    global_batch: int | None = None
    per_core_batch: int | None = None
    steps_per_epoch: int | None = None
    precision: str = "auto"
    loss: Any = "sparse_categorical_crossentropy"
    augment: str = "none"
    crop_padding: int = CROP_PADDING
    flips: str = "random"
    prepare: Callable[..., None] | None = None
    tta_flip: bool = False
    input_shape: tuple[int, ...] | None = None
    doc: str = ""

    def make_loss(self) -> Any:
        """The loss to compile with: a Keras loss name or object as given, else loss()'s result."""
        import keras

        if isinstance(self.loss, (str, keras.losses.Loss)):
            return self.loss
        return self.loss()


def names() -> list[str]:
    """All recipe names."""
    return list(_MODULES)


def get(name: str) -> Recipe:
    """The recipe called `name`; an unknown name is a MeshfitError listing the known ones."""
    if name not in _MODULES:
        raise MeshfitError(f"unknown recipe {name!r}; choose one of: {', '.join(_MODULES)}")
    module = importlib.import_module(f"meshfit.recipes.{_MODULES[name]}")
    return module.RECIPE
