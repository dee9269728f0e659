"""`meshfit export`: a trained model as a float32 model for CPU serving, in Keras or ONNX format.

A model trained in mixed precision (bfloat16 or float16 compute, float32 variables) is rebuilt
from its config with every layer's dtype policy set to float32 and its weights copied over, so the
exported model computes in float32 on any CPU.

ONNX export is Keras' own `model.export(format="onnx")` on the TensorFlow backend (tf2onnx). The
.keras file is backend-independent, so a model trained on JAX exports the same way; when this
process already runs Keras on another backend the export runs in a child process with
KERAS_BACKEND=tensorflow. Every ONNX file is checked against Keras on random images before it is
written (max difference of probabilities <= 1e-4) and carries meshfit's metadata: class names,
input shape and the SHA-256 of the .keras file it came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np

from meshfit.errors import MeshfitError
from meshfit.files import atomic_path
from meshfit.parallel.engine import installed, loaded_backend
from meshfit.run import models, rundir
from meshfit.run.models import check_keras_file, import_keras, load_keras_model, on_cpu
from meshfit.watch import progress

FORMATS = ("keras", "onnx")
# Max |probability difference| allowed between ONNX Runtime and Keras: float rounding of different
# kernels (oneDNN in TF, MLAS in ONNX Runtime) reached 1.3e-5 on a CIFAR-10 CNN on an AMD EPYC; a
# wrong conversion differs by 1e-3 or more.
ONNX_TOLERANCE = 1e-4
_LOW_PRECISION = {"mixed_bfloat16", "mixed_float16", "bfloat16", "float16"}
METADATA_KEY = "meshfit"  # ONNX metadata entry: JSON with class_names, input_shape, source_sha256
_ONNX_PACKAGES = ("tensorflow", "tf2onnx", "onnx", "onnxruntime")


# ----------------------------------------------------------------------------------- Keras side

def load_float32(files: rundir.ModelFiles):
    """The model of `files` on the CPU computing in float32: rebuilt by its run's recipe (under
    Keras' float32 default), or loaded and converted with float32_model."""
    run = models.run_of(files.keras_path, files.config)
    model = load_keras_model(files.keras_path, run)
    rebuilt = run is not None and models.needs_recipe(files.keras_path)
    return model if rebuilt else float32_model(model)


def float32_model(model):
    """`model` computing in float32: rebuilt from its config with float32 dtype policies and its
    weights copied, or `model` itself when no layer computes in lower precision."""
    keras = import_keras()
    serialized = keras.saving.serialize_keras_object(model)
    if not _set_float32(serialized):
        return model
    with on_cpu(keras):
        rebuilt = keras.saving.deserialize_keras_object(serialized)
        rebuilt.set_weights(model.get_weights())
    return rebuilt


def _set_float32(config) -> bool:
    """Set every low-precision dtype policy in a serialized Keras config to float32, in place;
    True when one was changed."""
    changed = False
    if isinstance(config, dict):
        inner = config.get("config")
        if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy") and \
                isinstance(inner, dict) and inner.get("name") in _LOW_PRECISION:
            inner["name"] = "float32"
            return True
        for key, value in config.items():
            if key == "dtype" and isinstance(value, str) and value in _LOW_PRECISION:
                config[key] = "float32"
                changed = True
            elif _set_float32(value):
                changed = True
    elif isinstance(config, list):
        for value in config:
            if _set_float32(value):
                changed = True
    return changed


# ----------------------------------------------------------------------------------- exports

def export_keras(source: str | os.PathLike, out: str | None = None) -> str:
    """Write a float32 .keras copy of a run's model without optimizer state; returns its path.

    Default out: RUN/model-float32.keras, or X-float32.keras beside a bare X.keras.
    """
    files = _keras_source(source)
    out = out or os.path.splitext(files.keras_path)[0] + "-float32.keras"
    if not out.endswith(".keras"):
        raise MeshfitError(f"--out {out} must end in .keras for --format keras")
    _refuse_to_overwrite(files, out)
    keras = import_keras()
    model = load_float32(files)
    why = models.unsaveable(model)
    if why:
        raise MeshfitError(f"Keras cannot save model {type(model).__name__} as a .keras file of "
                           f"its own ({why}); give its classes a get_config(), or use --format "
                           "onnx")
    with atomic_path(out, ".keras") as tmp, on_cpu(keras):
        model.save(tmp)
    return out


def export_onnx(source: str | os.PathLike, out: str | None = None) -> str:
    """Write a float32 ONNX copy of a run's model, checked against Keras; returns its path.

    Default out: RUN/model.onnx, or X.onnx beside a bare X.keras (where `meshfit predict` looks).
    Runs in a child process with KERAS_BACKEND=tensorflow when Keras is already loaded on another
    backend here.
    """
    files = _keras_source(source)
    if out is None and os.path.exists(files.onnx_path) and not written_by_meshfit(files.onnx_path):
        raise MeshfitError(f"{files.onnx_path} exists and was not written by meshfit; it is left "
                           "alone: choose where to write with --out X.onnx")
    out = out or files.onnx_path
    if not out.endswith(".onnx"):
        raise MeshfitError(f"--out {out} must end in .onnx for --format onnx")
    _refuse_to_overwrite(files, out)
    missing = [m for m in _ONNX_PACKAGES if not installed(m)]
    if missing:
        raise MeshfitError(f"ONNX export needs {', '.join(missing)}: pip install 'meshfit[onnx]'",
                           see="onnx-not-installed")
    with progress.task(f"exporting {files.keras_path} to ONNX"):  # one long step: time so far
        if loaded_backend() in (None, "tensorflow"):
            _export_onnx_here(files, out)
        else:
            _export_onnx_in_child(files, out)
    return out


def written_by_meshfit(onnx_path: str) -> bool:
    """Whether `onnx_path` is an ONNX file carrying meshfit's export metadata (so meshfit may
    replace it); False for anyone else's file and for files that are not ONNX."""
    if not installed("onnx"):
        return False
    import onnx

    try:
        proto = onnx.load(onnx_path, load_external_data=False)
    except Exception:  # protobuf and OS errors of many kinds
        return False
    return any(p.key == METADATA_KEY for p in proto.metadata_props)


def _keras_source(source: str | os.PathLike) -> rundir.ModelFiles:
    files = rundir.locate_model(source)
    if files.keras_path is None:
        raise MeshfitError(f"{files.source} has no .keras model to export; pass a run directory "
                           "or a .keras file")
    check_keras_file(files.keras_path)  # before Keras and TensorFlow are imported
    return files


def _refuse_to_overwrite(files: rundir.ModelFiles, out: str) -> None:
    if os.path.exists(out) and os.path.samefile(out, files.keras_path):
        raise MeshfitError(f"--out {out} is the source model itself; choose another path")


def _export_onnx_here(files: rundir.ModelFiles, out: str) -> None:
    """ONNX export in this process, on the TensorFlow backend."""
    import onnx
    import onnxruntime as ort

    keras = import_keras("tensorflow")
    model = load_float32(files)
    shape = tuple(int(d) for d in files.config.get("input_shape") or model.input_shape[1:])
    x, expected = _check_input(model, shape, keras)
    classes = int(expected.shape[-1])
    names = files.config.get("class_names")  # [] for a model that is no classifier
    metadata = {
        "class_names": [str(n) for n in (range(classes) if names is None else names)],
        "outputs": files.config.get("outputs") or "probabilities",  # see inference.probabilities
        "input_shape": list(shape),
        "source": os.path.basename(files.keras_path),
        "source_sha256": rundir.file_sha256(files.keras_path),
        "recipe": files.config.get("recipe"),
        "dataset": files.config.get("dataset"),
    }
    with atomic_path(out, ".onnx") as tmp:
        with warnings.catch_warnings(), on_cpu(keras):
            warnings.simplefilter("ignore", FutureWarning)  # Keras' tf2onnx/numpy 2 patch
            try:
                model.export(tmp, format="onnx", verbose=False)
            except Exception as e:  # tf2onnx raises many kinds for layers it cannot convert
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise MeshfitError(f"tf2onnx cannot convert {files.keras_path} ({why}); "
                                   "use --format keras or --backend keras") from e
        proto = onnx.load(tmp)
        onnx.helper.set_model_props(proto, {METADATA_KEY: json.dumps(metadata)})
        onnx.save(proto, tmp)
        try:
            session = ort.InferenceSession(tmp, providers=["CPUExecutionProvider"])
            got = session.run(None, {session.get_inputs()[0].name: x})[0]
        except Exception as e:  # an op ONNX Runtime lacks (tf2onnx passed it on), ...
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MeshfitError(f"ONNX Runtime cannot run the ONNX export of {files.keras_path} "
                               f"({why[:200]}); use --format keras or --backend keras") from e
        diff = float(np.abs(got - expected).max())
        if not diff <= ONNX_TOLERANCE:
            raise MeshfitError(f"the ONNX export of {files.keras_path} differs from Keras by "
                               f"{diff:.2e} (> {ONNX_TOLERANCE:g}); use --format keras or "
                               "--backend keras")


def _check_input(model, shape: tuple[int, ...], keras) -> tuple[np.ndarray, np.ndarray]:
    """(x, Keras' output for x): 8 inputs of `shape` and of the model's input dtype (float32, or
    int32 token ids: the ONNX copy refuses another) to compare the ONNX copy on, random values
    0-255, or zeros for a model that takes no such values (token ids past an Embedding's range)."""
    inputs = getattr(model, "inputs", None)  # a subclassed model declares none: float32
    dtype = keras.backend.standardize_dtype(inputs[0].dtype) if inputs else "float32"
    pixels = np.random.default_rng(0).integers(0, 256, (8, *shape)).astype(dtype)
    for x in (pixels, np.zeros_like(pixels)):
        try:
            with on_cpu(keras):
                expected = np.asarray(model(x, training=False))  # also marks the model as called
        except Exception:  # e.g. an index out of an Embedding's range
            continue
        if np.all(np.isfinite(expected)):
            return x, expected
    raise MeshfitError(f"cannot check the ONNX export of {type(model).__name__}: it fails on random "
                       "pixels and on zeros; use --format keras or --backend keras")


def _export_onnx_in_child(files: rundir.ModelFiles, out: str) -> None:
    """ONNX export by `meshfit export` in a child process on the TensorFlow backend."""
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd = [sys.executable, "-m", "meshfit", "export", files.source, "--format", "onnx",
           "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        errors = [line.split("meshfit: error: ", 1)[1] for line in lines
                  if line.startswith("meshfit: error: ")]
        why = errors[-1] if errors else (lines[-1] if lines else f"exit code {proc.returncode}")
        raise MeshfitError(f"ONNX export of {files.source} failed: {why}")
