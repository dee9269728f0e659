"""Recipes: a model, its data and its hyperparameters, one readable file each.

Each recipe module defines `RECIPE`, a `Recipe`, and states in its docstring the expected result
measured on named hardware. `get(name)` finds a built-in one; `names()` lists them; `load(name or
path)` also reads a user's own recipe file (any .py file defining `RECIPE = meshfit.Recipe(...)`);
`source(name)` is a built-in recipe's file, to start one's own from (`meshfit recipe NAME`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

from meshfit.errors import MeshfitError
from meshfit.parallel import engine as _engine
from meshfit.parallel import planning as _planning
from meshfit.data import datasets, splits
from meshfit.data.arrays import CROP_PADDING

DATASET_SHAPES = {"mnist": (28, 28, 1), "fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}
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
    "random", or "alternate" (each image mirrored every other epoch; see meshfit.data.arrays).
    prepare(model, dataset): optional, called after the model is built and before training
    (e.g. a data-dependent first-layer initialization, or fitting a distillation teacher;
    dataset.train is the (x, y) training arrays).
    compile(model, optimizer): optional, compiles the model instead of meshfit's
    `model.compile(optimizer, loss=loss, metrics=["accuracy"])` (["mae"] for a model that is no
    classifier: see meshfit.run.keras_side.scores.is_classifier), for a model with its own
    compile signature (a subclassed Distiller); optimizer is optimizer()'s result.
    Custom layers and subclassed models (keras.ops code, train_step/compute_loss) train as any
    model; eval, predict and export rebuild them from the run's copy of the recipe file and load
    the trained weights (see meshfit.run.models: the copy is trusted code, it ran at training time).
    tta_flip: evaluate on each image and its mirror image, averaging the probabilities.
    tta_translate: also on its translations by this many pixels (airbench's multi-crop; see
    meshfit.fit.predict.tta_views); 0: none.
    dataset: a built-in name (mnist, fashion_mnist, cifar10), a folder of images with one
    sub-folder per class (a path relative to the recipe file, read from disk batch by batch; with
    train/ and test/ or val/ sub-folders used as given), or a callable `dataset(seed)` returning
    `((x_train, y_train), (x_test, y_test))` uint8 image arrays (N, H, W, C) and integer labels
    (N,) (whole-number floats too, under a sparse categorical loss; other floats are a
    regression's targets), as keras.datasets' load_data() does, a
    meshfit.data.datasets.Dataset, or a dict of streamed sources {"train": ..., "validation":
    ... or None, "test": ... or None, "class_names": [...]}
    (a PyDataset, tf.data.Dataset, Grain dataset or generator function each; see meshfit.data.streams).
    image_size: (height, width) pixels that folder images are resized to; channels: 1 (grey) or 3.
    validation_split: the share of the training data held out for the per-epoch val_* metrics
    (the test set is then scored once, at the end); 0 evaluates on the test set every epoch, as
    the tutorials did. Default (None): splits.default_validation_split, 0.2 for a folder (as
    `meshfit train --data`; its own val/ sub-folder, if any, is used instead), 0 otherwise.
    callbacks: optional `callbacks()` returning a list of Keras callbacks (EarlyStopping,
    ReduceLROnPlateau, ModelCheckpoint...); their state is saved in checkpoints and restored by
    --resume. meshfit chooses the Keras backend before it runs a recipe file, so the file may
    import keras at its top and define layer and model classes there.
    file, text: the recipe file it was read from and the text that ran (None for built-in
    recipes); a run copies the text into its directory, so it resumes after the file is moved.
    """

    name: str
    dataset: str
    build_model: Callable[..., Any]
    optimizer: Callable[[int, int], Any]
    epochs: int
    global_batch: int | None = None
    per_core_batch: int | None = None
    steps_per_epoch: int | None = None
    precision: str = _planning.DEFAULT_PRECISION
    loss: Any = "sparse_categorical_crossentropy"
    augment: str = "none"
    crop_padding: int = CROP_PADDING
    flips: str = "random"
    prepare: Callable[..., None] | None = None
    compile: Callable[[Any, Any], None] | None = None
    tta_flip: bool = False
    tta_translate: int = 0
    input_shape: tuple[int, ...] | None = None
    image_size: tuple[int, int] | None = None
    channels: int = 3
    validation_split: float | None = None  # None: set by __post_init__ (see above)
    callbacks: Callable[[], list] | None = None
    doc: str = ""
    file: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        for name, what in _FUNCTIONS.items():
            value = getattr(self, name)
            if not callable(value) or hasattr(value, "layers"):  # a built Keras model calls too
                raise MeshfitError(f"Recipe {name} must be a function {what}, got a "
                                   f"{type(value).__name__}; pass the function itself, not its result")
        if not isinstance(self.dataset, (str, os.PathLike)) and not callable(self.dataset):
            raise MeshfitError(f"Recipe dataset must be a built-in name, a folder of images or a "
                               f"function dataset(seed) returning ((x_train, y_train), (x_test, "
                               f"y_test)), got a {type(self.dataset).__name__}; pass the function "
                               "itself, not its result")
        if self.validation_split is None:  # one default per kind of dataset, on every route
            object.__setattr__(self, "validation_split",
                               splits.default_validation_split(self.dataset))

    def make_loss(self) -> Any:
        """The loss to compile with: a Keras loss name or object as given, else loss()'s result."""
        import keras

        if isinstance(self.loss, (str, keras.losses.Loss)):
            return self.loss
        return self.loss()


# A Recipe's fields that are functions, and what each is called with and returns.
_FUNCTIONS = {"build_model": "build_model(input_shape, num_classes) returning a Keras model",
              "optimizer": "optimizer(steps_per_epoch, epochs) returning a Keras optimizer, e.g. "
                           "lambda steps_per_epoch, epochs: keras.optimizers.Adam(1e-3)"}


def names() -> list[str]:
    """All recipe names."""
    return list(_MODULES)


def builtin_name(name: str) -> str:
    """The name of the built-in recipe `name` means: written with underscores too (its module's
    spelling, fashion_mnist_cnn for fashion-mnist-cnn); else `name` itself."""
    hyphens = name.replace("_", "-")
    return hyphens if hyphens in _MODULES else name


def get(name: str) -> Recipe:
    """The built-in recipe called `name` (see builtin_name); an unknown name is a MeshfitError
    naming the closest one, if any, and listing them all."""
    name = builtin_name(name)
    if name not in _MODULES:
        close = difflib.get_close_matches(name.lower(), list(_MODULES), n=1, cutoff=0.6)
        guess = f" (did you mean {close[0]}?)" if close else ""
        raise MeshfitError(f"unknown recipe {name!r}{guess}; choose one of: {', '.join(_MODULES)}, "
                           "or give a recipe file (path/to/recipe.py)")
    module = importlib.import_module(f"meshfit.recipes.{_MODULES[name]}")
    return module.RECIPE


def is_file(name: str) -> bool:
    """True when `name` names a recipe file rather than a built-in recipe."""
    return name.endswith(".py") or os.sep in name or (builtin_name(name) not in _MODULES
                                                      and os.path.exists(name))


def load(name: str | None) -> Recipe:
    """A built-in recipe by name, or the recipe a file defines (default: DEFAULT)."""
    name = name or DEFAULT
    return load_file(name) if is_file(name) else get(name)


def load_file(path: str | os.PathLike) -> Recipe:
    """The `RECIPE` a Python file defines, with `file` set to the file's absolute path.

    The file runs as a module of its own; an error in it is one line naming the file and line.
    """
    path = check_file(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    module = types.ModuleType("meshfit_recipe_" + hashlib.sha256(path.encode()).hexdigest()[:12])
    module.__file__ = path
    sys.modules[module.__name__] = module  # dataclasses look a class's module up by name
    try:
        exec(compile(text, path, "exec"), module.__dict__)
    except MeshfitError:
        raise
    except Exception as e:  # the user's code: any exception, reported at its line
        line = _error_line(e, path)
        raise MeshfitError(f"recipe file {path}{line} failed: {type(e).__name__}: {e}") from e
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise MeshfitError(f"recipe file {path} defines no RECIPE = meshfit.Recipe(...); "
                           "start from one: meshfit recipe fashion-mnist-cnn > my_recipe.py")
    return dataclasses.replace(recipe, file=path, text=text, doc=recipe.doc or (module.__doc__ or ""))


def check_file(path: str | os.PathLike) -> str:
    """The absolute path of the recipe file `path`, checked before anything slow starts (a
    recipe file runs after the engine): a MeshfitError when it is missing or a folder."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, "config.json")):  # a run directory (meshfit.run.rundir)
        raise MeshfitError(f"{path} is a run directory, not a recipe file; to train it on: meshfit "
                           f"train --resume {path} --epochs N (N: its epochs in all)")
    if os.path.isdir(path):  # as a new user tries first: `meshfit train my_images/`
        raise MeshfitError(f"{path} is a folder, not a recipe file; to train on the images in it "
                           f"(a sub-folder per class): meshfit train --data {path} --image-size "
                           "HEIGHT WIDTH")
    if not os.path.isfile(path):
        raise MeshfitError(f"recipe file {path} does not exist; give a .py file defining "
                           f"RECIPE = meshfit.Recipe(...), or one of: {', '.join(_MODULES)}")
    return path


def _error_line(error: BaseException, path: str) -> str:
    """':LINE' of the innermost frame of `error` in the file at `path` ('' when none)."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f":{error.lineno}"
    frames = [f for f in inspect.getinnerframes(error.__traceback__, 0) if f.filename == path]
    return f":{frames[-1].lineno}" if frames else ""


def source(name: str) -> str:
    """The text of built-in recipe `name`'s file: a starting point for a recipe of one's own."""
    get(name)  # an unknown name is a MeshfitError listing the known ones
    spec = importlib.util.find_spec(f"meshfit.recipes.{_MODULES[builtin_name(name)]}")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def input_shape(recipe: Recipe) -> tuple[int, ...]:
    """(height, width, channels) of the recipe's images, where the recipe or its dataset says."""
    if recipe.input_shape:
        return tuple(recipe.input_shape)
    if recipe.image_size:
        return (*recipe.image_size, recipe.channels)
    if recipe.dataset in DATASET_SHAPES:
        return DATASET_SHAPES[recipe.dataset]
    raise MeshfitError(f"recipe {recipe.name} does not say its image shape; set "
                       "input_shape=(height, width, channels) on its Recipe")


def dataset_class_names(dataset: Any) -> tuple[str, ...]:
    """The class names of a built-in dataset (by name), else ()."""
    return datasets.CLASS_NAMES.get(dataset, ()) if isinstance(dataset, str) else ()


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
