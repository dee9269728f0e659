"""A run's model.keras, also for models whose code lives in the recipe file.

A recipe file's custom layers and subclassed models are Python code that a .keras file only
names, so Keras cannot load them alone (and not at all in safe mode); a model whose __init__ takes
other models or arrays has no config, so Keras cannot even save it.

Design: rebuild, don't register. A model.keras whose config names a class from outside Keras is
loaded by running the run's own copy of the recipe file (RUN/recipe.py, checked against its
SHA-256 in config.json), calling its build_model(input_shape, num_classes) and loading the trained
weights from model.keras. Registering the recipe's classes as custom_objects would still fail for
subclassed models that Keras cannot rebuild from their config (a Distiller holding a student and
a teacher) or that have none; rebuilding needs only the weights, so it covers every model that
trained. The recipe copy is trusted code (it ran at training time); other .keras files still load
in Keras' safe mode. A model without a config is saved as a .keras archive holding its weights and
a config naming its recipe (RECIPE_MODULE), so every run has a model.keras to hash and export.

Loading a model (`load_keras_model`) lives here too, for `meshfit eval`, predict and export: on the
CPU or under the run's distribution, in Keras' safe mode unless its run's recipe rebuilds it.
Keras is imported inside the functions: `meshfit predict` on ONNX never loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import zipfile
from typing import Iterator

from meshfit.errors import MeshfitError
from meshfit.parallel import engine
from meshfit.run import rundir, spec

RECIPE_MODULE = "meshfit.recipe"  # the config's module of a model only its recipe can rebuild
_KERAS_MODULES = ("keras", "builtins")  # modules of the objects Keras saves itself
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class ModelUnreadable(MeshfitError):
    """A .keras file that is not a Keras 3 model meshfit can load (safely)."""


def unsaveable(model) -> str | None:
    """Why Keras cannot save `model` (no get_config() somewhere in it), or None when it can."""
    import keras

    try:
        keras.saving.serialize_keras_object(model)
    except Exception as e:  # NotImplementedError (no get_config), TypeError (not JSON), ...
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"{type(e).__name__}: {first.strip()}"
    return None


def save(model, path: str) -> None:
    """Write `model` to the .keras file `path`: Keras' own archive, or, for a model Keras cannot
    serialize, one holding its weights and a config that names the recipe to rebuild it from."""
    if unsaveable(model) is None:
        model.save(path)
        return
    import keras

    config = {"module": RECIPE_MODULE, "class_name": type(model).__name__,
              "config": {"rebuild": "build_model() of the run's recipe.py"}}
    metadata = {"keras_version": keras.__version__, "saved_by": "meshfit (weights only)"}
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "model.weights.h5")
        model.save_weights(weights)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("config.json", json.dumps(config))
            archive.writestr("metadata.json", json.dumps(metadata))
            archive.write(weights, "model.weights.h5")


def needs_recipe(keras_path: str) -> bool:
    """Whether the .keras file's model config names a class from outside Keras (a recipe's own;
    the loss and optimizer in its compile config are not loaded, so they do not count)."""
    try:
        with zipfile.ZipFile(keras_path) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return False  # not readable as such: Keras' own loader says why
    config.pop("compile_config", None)
    return any(module.split(".")[0] not in _KERAS_MODULES for module in _modules(config))


def _modules(config):
    """Every "module" named by the serialized objects in a Keras config."""
    if isinstance(config, dict):
        if isinstance(config.get("module"), str):
            yield config["module"]
        for value in config.values():
            yield from _modules(value)
    elif isinstance(config, list):
        for value in config:
            yield from _modules(value)


def rebuild(run: str, keras_path: str, recipe=None):
    """The model of `run` (trained from a recipe file) built by that file's build_model, with
    the weights of `keras_path`, computing in the active dtype policy (float32 unless a strategy
    set another).

    recipe: the run's recipe, when already loaded (else its copy, RUN/recipe.py, is run).
    """
    saved, _ = spec.read(run)
    recipe = recipe or recipe_of_run(run, saved)
    shape = tuple(saved.input_shape)
    try:
        model = recipe.build_model(shape, saved.num_classes)
        if not model.built:
            model.build((None, *shape))
        model.load_weights(keras_path)
    except Exception as e:  # the user's code or a file that does not fit it
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MeshfitError(f"cannot rebuild the model of {run} from its {saved.recipe_file} and "
                           f"load {keras_path} into it ({type(e).__name__}: {why})") from e
    return model


def run_of(keras_path: str, config: dict) -> str | None:
    """The run directory of a model.keras beside the config.json of a run trained from a recipe
    file (config), else None."""
    return os.path.dirname(os.path.abspath(keras_path)) if config.get("recipe_file") else None


def recipe_of_run(run: str, saved):
    """The recipe a run was trained with: its own copy of a recipe file, else the built-in one.

    saved: the run's RunSpec (config.json).
    """
    from meshfit import recipes  # start-up: `meshfit predict` on ONNX loads no recipes or datasets

    if not saved.recipe_file:
        return recipes.get(saved.recipe)
    path = os.path.join(run, saved.recipe_file)
    if not os.path.isfile(path):
        raise MeshfitError(f"{path} is missing (the run was trained from {saved.recipe_source}); "
                           "copy that recipe file there")
    if saved.recipe_sha256 and rundir.file_sha256(path) != saved.recipe_sha256:
        raise MeshfitError(f"{path} was changed after the run started (its SHA-256 differs from "
                           "config.json's); undo the change, or train the edited file as a new run")
    return recipes.load_file(path)


# ---------------------------------------------------------------------------------- loading

@contextlib.contextmanager
def without_distribution() -> Iterator[None]:
    """No Keras distribution inside the block (the previous one is restored on exit).

    For host-local Keras work on one process: saving a model under the multi-host mesh would
    create cross-host variables and wait for processes that are not saving; CPU inference and
    export want plain single-device variables.
    """
    import keras

    active = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(active)


def import_keras(backend: str | None = None):
    """Keras: the one already imported, else imported now with `backend` (default: meshfit's
    choice for one CPU device: $MESHFIT_ENGINE, $KERAS_BACKEND, else TensorFlow when installed,
    which loads and runs a model far sooner than JAX, else JAX)."""
    if "keras" not in sys.modules:
        engine.activate(backend or engine.choose_engine(None, "cpu", 1))
    with engine.tensorflow_notices_dropped(os.environ.get("KERAS_BACKEND") == "tensorflow"):
        import keras
    return keras


@contextlib.contextmanager
def on_cpu(keras) -> Iterator[None]:
    """Place variables and computation on the first CPU device, outside any data-parallel
    distribution that training set (restored on exit)."""
    # Entering a device scope when the default device is the CPU anyway would only make JAX
    # compile every initializer again (its caches are keyed by the device scope).
    with without_distribution(), \
            contextlib.nullcontext() if _default_device_is_cpu(keras) else keras.device("cpu:0"):
        yield


def _default_device_is_cpu(keras) -> bool:
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.devices()[0].platform == "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.config.list_logical_devices("GPU")
    return False


def check_keras_file(path: str) -> None:
    """A ModelUnreadable unless `path` is a readable zip archive, as every .keras file is
    (Keras' own message for other files is 'File not found')."""
    hint = "pass a .keras file written by Keras 3"
    try:
        with open(path, "rb") as f:
            head = f.read(len(_HDF5_SIGNATURE))
        archive = zipfile.is_zipfile(path)
    except OSError as e:
        raise ModelUnreadable(f"cannot read Keras model {path} ({e.strerror or e}); {hint}") from None
    if head == _HDF5_SIGNATURE:
        raise ModelUnreadable(f"{path} is an HDF5 file (Keras 2's .h5 format), not a .keras "
                              "archive; save it as .keras with Keras 3 first")
    if not archive:
        raise ModelUnreadable(f"{path} is not a .keras model (a zip archive); {hint}")


def load_keras_model(path: str, run: str | None = None, recipe=None,
                     distributed: bool = False):
    """A .keras model without its optimizer, loaded on the CPU (distributed: under the active
    distribution instead), in Keras' safe mode (no Python code from the file, such as Lambda
    layers, is run); one naming classes of its run's recipe file is rebuilt by that recipe
    (see the module docstring).

    run: the run directory whose model.keras `path` is (None for a bare .keras file); recipe: the
    run's recipe when already loaded.
    """
    check_keras_file(path)
    keras = import_keras()
    with contextlib.nullcontext() if distributed else on_cpu(keras):
        if run is not None and needs_recipe(path):
            return rebuild(run, path, recipe)
        try:
            return keras.saving.load_model(path, compile=False, safe_mode=True)
        except Exception as e:  # Keras raises many kinds for bad files (ValueError, OSError, ...)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelUnreadable(f"cannot load Keras model {path} ({why}); pass a .keras file "
                                  "written by Keras 3, or the run directory it came from") from e
