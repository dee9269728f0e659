"""The data of a run: its train, validation and test splits, and their batches.

A recipe's `dataset` is a built-in name (loaded whole into memory by meshfit.data.datasets), a folder of
images with one sub-folder per class (streamed from disk by meshfit.data.folders, never loaded
whole), or a callable `dataset(seed)` returning arrays (kept in memory) or a dict of streamed
sources (a PyDataset, tf.data, Grain or a generator function per split: see meshfit.data.streams).
A split is (x, y) arrays, a folder_scan.Folder, or a streams.Source (train) / streams.EvalSource
(validation, test). Arrays and folders follow one rule: batch (epoch, step) is a pure function of
(seed, epoch, step), so a resumed run sees exactly the batches an uninterrupted one would; so do
index-based streams (PyDataset, grain.MapDataset), while other streams resume by reading the
epoch again and skipping what was trained (exact when they are deterministic).

Validation: with `validation_split` F > 0, a share F of the training data (drawn with the seed) is
held out for the per-epoch val_* metrics and the test set is scored once at the end. With F = 0,
the test set is evaluated every epoch, as the tutorials did. A recipe that sets no
validation_split gets default_validation_split: FOLDER_VALIDATION_SPLIT for a folder (which has no
test set to evaluate on otherwise), 0 for built-in datasets and callables. A folder with train/
and test/ (or val/) sub-folders is used as given (without val/, the share is held out of train/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from meshfit.data import FOLDER_VALIDATION_SPLIT, arrays, datasets, folder_scan, folders, streams
from meshfit.errors import MeshfitError

Split = Any  # (x, y) numpy arrays, a meshfit.data.folder_scan.Folder, a streams.Source or EvalSource


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
        """True when the training data is read batch by batch (a folder or a recipe's source)."""
        return not isinstance(self.train, tuple)

    @property
    def from_source(self) -> bool:
        """True when the training data is a recipe's own streamed source (meshfit.data.streams)."""
        return isinstance(self.train, streams.Source)

    @property
    def validation_given(self) -> bool:
        """True when the validation data is the dataset's own (a val/ folder, a streamed
        "validation" source), not held out of the training data."""
        if isinstance(self.validation, streams.EvalSource):
            return True
        return getattr(self.validation, "root", None) not in (None, getattr(self.train, "root", None))

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


def default_validation_split(dataset: str | Callable) -> float:
    """The share held out for validation when a recipe sets none: FOLDER_VALIDATION_SPLIT for a
    folder, 0 for a built-in dataset or a callable (their test set is evaluated every epoch) and
    for "synthetic" (random data that only times the step)."""
    folder = kind(dataset) == "folder" and dataset != "synthetic"
    return FOLDER_VALIDATION_SPLIT if folder else 0.0


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
        result = recipe.dataset(seed)
        if streams.is_streams(result):
            return _streams(recipe, result, source_of(recipe))
        loaded = _arrays(result, recipe.loss)
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
    if not recipe.image_size:
        raise MeshfitError(f"recipe {recipe.name} reads the image folder {path} but sets no "
                           "image_size; add image_size=(height, width) to its Recipe")
    if recipe.channels not in (1, 3):
        raise MeshfitError(f"channels must be 1 (grey) or 3 (RGB), got {recipe.channels}")
    splits = folder_scan.layout(path, recipe.validation_split, seed)
    height, width = (int(s) for s in recipe.image_size)
    return RunData(path, splits["train"].class_names, (height, width, recipe.channels),
                   splits["train"], splits["validation"], splits["test"])


def other_folder(path: str, class_names: tuple[str, ...], input_shape: tuple[int, ...]) -> RunData:
    """A folder of class sub-folders to score a trained run on, as the test split: its images
    resized to input_shape (height, width, channels in pixels) and labelled by the run's
    class_names (every class folder must be one of them; the folder may have fewer)."""
    if len(input_shape) != 3 or input_shape[2] not in (1, 3):
        raise MeshfitError(f"the run's model takes inputs of shape {tuple(input_shape)}, not images "
                           "(height, width, 1 or 3 channels); score it on its own data instead")
    found = folder_scan.scan(path, training=False)  # new photos of one class score too
    unknown = [name for name in found.class_names if name not in class_names]
    if unknown:
        raise MeshfitError(f"{found.root} has the class folders {', '.join(found.class_names)} but "
                           f"the run's classes are {', '.join(class_names)}; give a folder whose "
                           "class sub-folders are named as the run's classes")
    index = np.asarray([class_names.index(name) for name in found.class_names], np.int32)
    test = folder_scan.Folder(found.root, tuple(class_names), found.files, index[found.labels],
                              found.skipped)
    return RunData(found.root, tuple(class_names), tuple(input_shape), test, None, test)


def _streams(recipe, parts: dict, name: str) -> RunData:
    """A recipe's streamed sources {"train", "validation", "test", "class_names"} as RunData."""
    unknown = sorted(set(map(str, parts)) - set(streams.KEYS))
    if unknown or parts.get("train") is None:
        problem = f"has the unknown keys {', '.join(unknown)}" if unknown else "has no \"train\" source"
        raise MeshfitError(f"the dict the recipe's dataset callable returned {problem}; give "
                           "{\"train\": ..., \"validation\": ... or None, \"test\": ... or None, "
                           "\"class_names\": [...]}")
    class_names = tuple(str(c) for c in parts.get("class_names") or ())
    if len(class_names) < 2:
        raise MeshfitError("the dict the recipe's dataset callable returned needs \"class_names\": "
                           "a list of at least two class names, one per label 0..K-1")
    if recipe.validation_split:
        raise MeshfitError("validation_split holds out arrays or folder images, not a streamed "
                           "source; return a \"validation\" source instead")
    if recipe.augment != "none":
        raise MeshfitError(f"augment={recipe.augment!r} applies to arrays and folders; augment "
                           "inside the recipe's streamed source")
    train = streams.Source(parts["train"], "train")
    x = train.first()[0]
    if recipe.input_shape is None and not hasattr(x, "shape"):
        raise MeshfitError("the recipe's train source yields x that is not one array; set "
                           "input_shape on the Recipe")
    input_shape = tuple(recipe.input_shape or x.shape[1:])
    evaluated = {key: streams.EvalSource(parts[key], key, len(class_names))
                 for key in ("validation", "test") if parts.get(key) is not None}
    return RunData(name, class_names, input_shape, train, evaluated.get("validation"),
                   evaluated.get("test"))


def _arrays(result, loss: Any = None) -> datasets.Dataset:
    """A recipe's dataset callable's arrays as a Dataset: integer labels are classes (named
    "0".."K-1" unless given), floating-point ones a regression's targets (kept, no classes),
    unless the recipe's `loss` is a sparse categorical one: then whole-number floats (labels read
    from a CSV file) are classes. Anything else is a one-line error naming the fix, before any
    training (it failed deep in Keras' first step)."""
    if isinstance(result, datasets.Dataset):
        return result
    try:
        (x_train, y_train), (x_test, y_test) = result
    except (TypeError, ValueError) as e:
        raise MeshfitError(f"the recipe's dataset callable returned {type(result).__name__}; return "
                           "((x_train, y_train), (x_test, y_test)) arrays, a "
                           "meshfit.data.datasets.Dataset or a dict of streamed sources "
                           "{\"train\": ..., \"test\": ..., \"class_names\": [...]}") from e
    arrays = [np.asarray(a) for a in (x_train, y_train, x_test, y_test)]
    for i in (0, 2):
        if arrays[i].ndim == 3:  # grey images without a channel axis, as keras.datasets.mnist's
            arrays[i] = arrays[i][..., None]
    if arrays[0].ndim != 4 or arrays[0].dtype != np.uint8 or arrays[2].dtype != np.uint8:
        raise MeshfitError(f"the recipe's dataset callable returned {arrays[0].dtype} images of shape "
                           f"{arrays[0].shape}; return uint8 arrays (N, height, width, channels)")
    if len(arrays[2]) and arrays[2].shape[1:] != arrays[0].shape[1:]:
        raise MeshfitError(f"the recipe's dataset callable returned test images of shape "
                           f"{arrays[2].shape[1:]} and training images of shape {arrays[0].shape[1:]}; "
                           "return test images of the training images' shape")
    for part, (x, y) in (("training", arrays[:2]), ("test", arrays[2:])):
        if len(y) != len(x):
            raise MeshfitError(f"the recipe's dataset callable returned {len(x)} {part} images and "
                               f"{len(y)} labels; return one label per image")
    floating, classifies = np.issubdtype(arrays[1].dtype, np.floating), _sparse_categorical(loss)
    if (classifies or not floating) and any(y.ndim > 1 and y.shape[1:] != (1,) for y in arrays[1::2]):
        raise MeshfitError(f"the recipe's dataset callable returned class labels of shape "
                           f"{arrays[1].shape} (one-hot?); return class indices 0..K-1 of shape "
                           "(N,), e.g. y.argmax(axis=1), for the loss sparse_categorical_crossentropy")
    if floating and classifies:
        if not all(np.array_equal(y, np.round(y)) for y in arrays[1::2]):
            raise MeshfitError("the recipe's dataset callable returned labels that are not whole "
                               "numbers for a sparse categorical loss; return class indices "
                               "0..K-1, or set a regression loss (e.g. loss=\"mse\") for targets")
    elif floating:  # targets of a regression: no classes
        return datasets.Dataset(arrays[0], arrays[1].astype(np.float32), arrays[2],
                                arrays[3].astype(np.float32), (), "callable")
    labels = np.concatenate([arrays[1].reshape(-1), arrays[3].reshape(-1)]).astype(np.int64)
    classes = int(labels.max()) + 1 if len(labels) else 0
    if len(labels) and labels.min() < 0:
        raise MeshfitError("the recipe's dataset callable returned negative labels; use 0..K-1")
    return datasets.Dataset(arrays[0], arrays[1].reshape(-1).astype(np.int32), arrays[2],
                            arrays[3].reshape(-1).astype(np.int32),
                            tuple(str(i) for i in range(classes)), "callable")


def _sparse_categorical(loss: Any) -> bool:
    """Whether a recipe's loss (a Keras loss name or object; a function: not known) takes class
    indices."""
    name = loss if isinstance(loss, str) else type(loss).__name__
    return "sparse_categorical" in name.lower() or "sparsecategorical" in name.lower()


def split_arrays(x: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    """((x, y) for training, (x, y) held out): round(N * fraction) samples drawn with `seed`."""
    if not 0.0 < fraction < 1.0:
        raise MeshfitError(f"validation_split must be between 0 and 1, got {fraction}")
    held = min(max(int(len(x) * fraction + 0.5), 1), len(x) - 1)
    order = np.random.default_rng(seed).permutation(len(x))
    keep, out = np.sort(order[held:]), np.sort(order[:held])
    return (x[keep], y[keep]), (x[out], y[out])


def size(split: Split) -> int:
    """Samples in a split (not for a streamed train source, whose size is not known)."""
    return len(split[0]) if isinstance(split, tuple) else len(split)


def labels(split: Split) -> np.ndarray:
    """The int32 labels of every sample of a split, in order (of a streamed train source: its
    first batch's)."""
    if isinstance(split, streams.Source):
        return np.asarray(split.first()[1]).reshape(-1).astype(np.int32)
    return split[1] if isinstance(split, tuple) else split.labels


def stream_batches(data: RunData, seed: int, replicas: int, steps: int | None):
    """The training batches of a recipe's streamed source (streams.TrainStream), planned: its
    global batch and steps per epoch come from the source."""
    return streams.TrainStream(data.train, seed, replicas, steps)


def train_batches(data: RunData, recipe, global_batch: int, seed: int, steps: int | None):
    """The training batches: arrays.TrainBatches in memory, folders.FolderTrainBatches from disk."""
    options = dict(augment=recipe.augment, crop_padding=recipe.crop_padding, flips=recipe.flips)
    if data.streamed:
        return folders.FolderTrainBatches(data.train, data.input_shape[:2], data.input_shape[2],
                                          global_batch, seed, steps, **options)
    return arrays.TrainBatches(*data.train, global_batch, seed, steps, **options)


def eval_batches(data: RunData, split: Split, global_batch: int):
    """Batches covering every sample of `split` once (the last one zero-padded)."""
    if isinstance(split, streams.EvalSource):
        return streams.EvalStream(split, global_batch)
    if data.streamed:
        return folders.FolderEvalBatches(split, data.input_shape[:2], data.input_shape[2],
                                         global_batch)
    return arrays.EvalBatches(split[0], global_batch)
