"""The data of a run: its train, validation and test splits, and their batches.

A recipe's `dataset` is a built-in name (loaded whole into memory by meshfit.datasets), a folder of
images with one sub-folder per class (streamed from disk by meshfit.imagefolder, never loaded
whole), or a callable returning arrays (kept in memory). Either way a split is (x, y) arrays or an
imagefolder.Folder, and its batches follow the same rule: batch (epoch, step) is a pure function of
(seed, epoch, step), so a resumed run sees exactly the batches an uninterrupted one would.

Validation: with `validation_split` F > 0, a share F of the training data (drawn with the seed) is
held out for the per-epoch val_* metrics and the test set is scored once at the end. With F = 0,
the test set is evaluated every epoch, as the tutorials did. A folder with train/ and test/ (or
val/) sub-folders is used as given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from meshfit import datasets
from meshfit.errors import MeshfitError

Split = Any  # (x, y) numpy arrays, or a meshfit.imagefolder.Folder


@dataclass(frozen=True, eq=False)
class RunData:
    """The splits of a run's data. `source` is what config.json records as the dataset: a
    built-in name, a folder's absolute path, or "callable:NAME"."""

    source: str
    class_names: tuple[str, ...]
    input_shape: tuple[int, int, int]  # (height, width, channels) in pixels
    train: Split
    validation: Split | None
    test: Split | None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def streamed(self) -> bool:
        """True when the images are read from disk batch by batch."""
        return not isinstance(self.train, tuple)

    @property
    def per_epoch(self) -> tuple[str, Split] | None:
        """("validation" or "test", the split) evaluated at every epoch end, or None."""
        if self.validation is not None:
            return "validation", self.validation
        return ("test", self.test) if self.test is not None else None


def kind(dataset: str | Callable) -> str:
    """"builtin", "callable" or "folder": how a recipe's `dataset` is read."""
    if callable(dataset):
        return "callable"
    if str(dataset).lower().replace("-", "_") in datasets.NAMES:
        return "builtin"
    return "folder"


def folder_path(dataset: str, recipe_file: str | None) -> str:
    """A recipe's folder as an absolute path (a relative one is taken from the recipe file's folder,
    or the current directory for recipes without a file)."""
    base = os.path.dirname(recipe_file) if recipe_file else os.getcwd()
    return os.path.normpath(os.path.join(base, os.path.expanduser(dataset)))


def source_of(recipe) -> str:
    """What config.json records as the recipe's dataset (see RunData.source)."""
    how = kind(recipe.dataset)
    if how == "callable":
        return f"callable:{getattr(recipe.dataset, '__qualname__', 'dataset')}"
    if how == "folder":
        return folder_path(recipe.dataset, recipe.file)
    return recipe.dataset


def load(recipe, data_dir: str | None, seed: int, source: str | None = None) -> RunData:
    """The recipe's data split into train, validation and test.

    source: the dataset recorded by a resumed run (a folder keeps its recorded absolute path,
    as the recipe file was copied and a relative path would no longer resolve).
    """
    how = kind(recipe.dataset)
    if how == "folder":
        path = source if source and os.path.isabs(source) else folder_path(recipe.dataset, recipe.file)
        return _folder(recipe, path, seed)
    if how == "callable":
        loaded = _call(recipe.dataset, seed)
        name = source_of(recipe)
    else:
        loaded = datasets.load(recipe.dataset, data_dir)
        name = recipe.dataset
    train = (loaded.x_train, loaded.y_train)
    validation = None
    if recipe.validation_split:
        train, validation = split_arrays(*train, recipe.validation_split, seed)
    test = (loaded.x_test, loaded.y_test) if len(loaded.x_test) else None
    return RunData(name, tuple(loaded.class_names), loaded.input_shape, train, validation, test)


def _folder(recipe, path: str, seed: int) -> RunData:
    from meshfit import imagefolder

    if not recipe.image_size:
        raise MeshfitError(f"recipe {recipe.name} reads the image folder {path} but sets no "
                           "image_size; add image_size=(height, width) to its Recipe")
    if recipe.channels not in (1, 3):
        raise MeshfitError(f"channels must be 1 (grey) or 3 (RGB), got {recipe.channels}")
    splits = imagefolder.layout(path, recipe.validation_split, seed)
    height, width = (int(s) for s in recipe.image_size)
    return RunData(path, splits["train"].class_names, (height, width, recipe.channels),
                   splits["train"], splits["validation"], splits["test"])


def _call(function: Callable, seed: int) -> datasets.Dataset:
    """A recipe's dataset callable's result as a Dataset (class names "0".."K-1" unless given)."""
    result = function(seed)
    if isinstance(result, datasets.Dataset):
        return result
    try:
        (x_train, y_train), (x_test, y_test) = result
    except (TypeError, ValueError) as e:
        raise MeshfitError(f"the recipe's dataset callable returned {type(result).__name__}; return "
                           "((x_train, y_train), (x_test, y_test)) arrays or a "
                           "meshfit.datasets.Dataset") from e
    arrays = [np.asarray(a) for a in (x_train, y_train, x_test, y_test)]
    for i in (0, 2):
        if arrays[i].ndim == 3:  # grey images without a channel axis, as keras.datasets.mnist's
            arrays[i] = arrays[i][..., None]
    if arrays[0].ndim != 4 or arrays[0].dtype != np.uint8 or arrays[2].dtype != np.uint8:
        raise MeshfitError(f"the recipe's dataset callable returned {arrays[0].dtype} images of shape "
                           f"{arrays[0].shape}; return uint8 arrays (N, height, width, channels)")
    labels = np.concatenate([arrays[1].reshape(-1), arrays[3].reshape(-1)]).astype(np.int64)
    classes = int(labels.max()) + 1 if len(labels) else 0
    if len(labels) and labels.min() < 0:
        raise MeshfitError("the recipe's dataset callable returned negative labels; use 0..K-1")
    return datasets.Dataset(arrays[0], arrays[1].reshape(-1).astype(np.int32), arrays[2],
                            arrays[3].reshape(-1).astype(np.int32),
                            tuple(str(i) for i in range(classes)), "callable")


def split_arrays(x: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    """((x, y) for training, (x, y) held out): round(N * fraction) samples drawn with `seed`."""
    if not 0.0 < fraction < 1.0:
        raise MeshfitError(f"validation_split must be between 0 and 1, got {fraction}")
    held = min(max(int(len(x) * fraction + 0.5), 1), len(x) - 1)
    order = np.random.default_rng(seed).permutation(len(x))
    keep, out = np.sort(order[held:]), np.sort(order[:held])
    return (x[keep], y[keep]), (x[out], y[out])


def size(split: Split) -> int:
    """Samples in a split."""
    return len(split[0]) if isinstance(split, tuple) else len(split)


def labels(split: Split) -> np.ndarray:
    """The int32 labels of every sample of a split, in order."""
    return split[1] if isinstance(split, tuple) else split.labels


def train_batches(data: RunData, recipe, global_batch: int, seed: int, steps: int | None):
    """The training batches: pipeline.TrainBatches in memory, imagefolder.FolderTrainBatches from disk."""
    options = dict(augment=recipe.augment, crop_padding=recipe.crop_padding, flips=recipe.flips)
    if data.streamed:
        from meshfit import imagefolder

        return imagefolder.FolderTrainBatches(data.train, data.input_shape[:2], data.input_shape[2],
                                              global_batch, seed, steps, **options)
    from meshfit import pipeline

    return pipeline.TrainBatches(*data.train, global_batch, seed, steps, **options)


def eval_batches(data: RunData, split: Split, batch: int):
    """Batches covering every sample of `split` once (the last one zero-padded)."""
    if data.streamed:
        from meshfit import imagefolder

        return imagefolder.FolderEvalBatches(split, data.input_shape[:2], data.input_shape[2], batch)
    from meshfit import pipeline

    return pipeline.EvalBatches(split[0], batch)
