"""CPU inference: `meshfit predict` and the `load_predictor` API.

A model is a run directory written by `meshfit train` (model.keras + config.json with class names
and input shape), a bare .keras file (class names are then the class indices) or an .onnx file
written by `meshfit export`. Images go in as raw pixels (0..255, NHWC); scaling lives in the model,
which outputs softmax probabilities, or, where it is no classifier (no class names: a regression's
one output), values that are printed as they are.

Fast path: ONNX Runtime on an ONNX copy of the model, cached beside it (run/model.onnx, or X.onnx
beside a bare X.keras) and exported on first use. It imports no keras, jax or tensorflow, so a
cold `meshfit predict` answers in well under a second. The copy records the SHA-256 of the .keras
file it came from and is exported again when that file changes; an .onnx file there that meshfit
did not write is never replaced (the model then runs on Keras). Without onnxruntime, or when the
copy cannot be written, the model runs on Keras (same probabilities, slower start).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from meshfit.data import image_files
from meshfit.errors import MeshfitError, troubleshooting
from meshfit.parallel.engine import installed
from meshfit.run import models, rundir
from meshfit.run.rundir import ModelFiles
from meshfit.serve import export as export_lib
from meshfit.watch import figures

BACKENDS = ("auto", "onnx", "keras")
KERAS_BATCH = 256  # images per Keras call in the fallback


# ----------------------------------------------------------------------------------- images

def load_image(path: str, input_shape: Sequence[int]) -> np.ndarray:
    """One image file as the model's input: uint8 (H, W, C), decoded, converted and resized exactly
    as image folders are for training (meshfit.data.image_files.load_image)."""
    height, width, channels = (int(d) for d in input_shape)
    if channels not in (1, 3):
        raise MeshfitError(f"cannot convert {path} to the model's {channels} channels; "
                           "meshfit predict reads images as RGB (3 channels) or grey (1)")
    if not os.path.isfile(path):
        raise MeshfitError(f"image {path} not found or not a file; pass PNG or JPEG files")
    return image_files.load_image(path, (height, width), channels)


def check_model(path: str | os.PathLike) -> None:
    """A one-line MeshfitError unless `path` names a model (run directory, .keras or .onnx) whose
    .keras file, if any, is a zip archive, and whose run's inputs are images; quick: nothing is
    loaded."""
    files = rundir.locate_model(path)
    if files.keras_path:
        models.check_keras_file(files.keras_path)
    if files.config.get("input_shape") is not None:
        check_takes_images(files.source, files.config["input_shape"])


def check_takes_images(model: str, input_shape: Sequence[int]) -> None:
    """A one-line MeshfitError unless `input_shape` is an image's (H, W, C): meshfit predict
    answers image files (a model of token ids or feature rows is predicted from Python)."""
    if len(input_shape) != 3:
        raise MeshfitError(f"{model} takes inputs of shape {tuple(input_shape)}, not images; "
                           "meshfit predict answers image files: predict from Python with "
                           "keras.saving.load_model(...).predict(x)")


def check_images(paths: Sequence[str]) -> None:
    """A one-line MeshfitError for the first path that is not an image file Pillow can decode
    (checked before any model is loaded or exported)."""
    for path in paths:
        load_image(path, (1, 1, 1))


def load_images(paths: Sequence[str], input_shape: Sequence[int]) -> np.ndarray:
    """Image files as one uint8 batch (N, H, W, C) for a model with `input_shape` (H, W, C)."""
    check_takes_images("the model", input_shape)  # a bare .keras or .onnx file: no config read
    return np.stack([load_image(p, input_shape) for p in paths])


# ----------------------------------------------------------------------------------- predictor

@dataclass
class Predictor:
    """A model ready for CPU inference.

    backend: 'onnxruntime' or 'keras'. input_shape: (height, width, channels) in pixels.
    model_file: the file that answers (the .onnx or the .keras). class_names: one per output of a
    classifier; () for a model that is no classifier (its outputs are values, not probabilities).
    """

    source: str
    backend: str
    class_names: tuple[str, ...]
    input_shape: tuple[int, int, int]
    run: Callable[[np.ndarray], np.ndarray] = field(repr=False)
    model_file: str | None = None
    outputs: str = "probabilities"  # what the model outputs (config.json's "outputs"): see probabilities

    def engine(self) -> str:
        """Who answers, for people: 'ONNX Runtime' or 'Keras on <backend>'."""
        if self.backend == "onnxruntime":
            return "ONNX Runtime"
        import keras

        return f"Keras on {keras.backend.backend()}"

    @property
    def classifier(self) -> bool:
        """Whether the outputs are class probabilities (else values, e.g. a regression's)."""
        return bool(self.class_names)

    def predict(self, images: np.ndarray) -> np.ndarray:
        """The outputs (N, outputs) float32, class probabilities for a classifier, for raw pixels
        (N, H, W, C) or one image (H, W, C)."""
        x = np.asarray(images, dtype=np.float32)
        if x.ndim == 3:
            x = x[None]
        if x.shape[1:] != self.input_shape:
            raise MeshfitError(f"images of shape {tuple(x.shape[1:])} given, but the model takes "
                               f"{self.input_shape} (height, width, channels)")
        raw = np.asarray(self.run(x), dtype=np.float32)
        return probabilities(raw, self.outputs) if self.classifier else raw

    def predict_files(self, paths: Sequence[str]) -> np.ndarray:
        """The outputs (N, outputs) for image files, read with `load_images`."""
        return self.predict(load_images(paths, self.input_shape))


def load_predictor(path: str | os.PathLike, backend: str = "auto", export: bool = True,
                   threads: int | None = None) -> Predictor:
    """A `Predictor` for a run directory, .keras or .onnx file, on the CPU.

    backend 'auto': ONNX Runtime on the cached ONNX copy (exported first when missing or stale and
    `export` is true and the folder is writable), else Keras. 'onnx' or 'keras' force one.
    threads: ONNX Runtime's threads per operation (default: one per physical core).
    """
    if backend not in BACKENDS:
        raise MeshfitError(f"unknown backend {backend!r}; use one of: {', '.join(BACKENDS)}")
    files = rundir.locate_model(path)
    if files.keras_path:
        models.check_keras_file(files.keras_path)
    if backend == "keras" or (backend == "auto" and not installed("onnxruntime")):
        return _keras_predictor(files)  # the result's "backend" says which ran
    session = _current_session(files, threads)
    if session is None and export and files.keras_path:
        why = _cannot_export(files)
        if why is None:  # once; a terminal shows a bar while it runs
            try:
                export_lib.export_onnx(files.source, files.onnx_path)
            except models.ModelUnreadable:
                raise  # Keras cannot load it either
            except MeshfitError as e:
                if backend == "onnx":
                    raise
                warnings.warn(f"predicting with Keras: {e} (use --backend keras to skip this "
                              "export)", stacklevel=2)
            session = _current_session(files, threads)
        elif backend == "onnx":
            raise MeshfitError(f"cannot export {files.keras_path} to ONNX: {why}")
        else:
            warnings.warn(f"predicting with Keras (slow start): cannot export to ONNX: {why}",
                          stacklevel=2)
    if session is not None:
        return _onnx_predictor(files, session)
    if backend == "onnx":
        raise MeshfitError(f"no up-to-date ONNX copy of {files.source}; "
                           f"run `meshfit export {files.source} --format onnx`")
    return _keras_predictor(files)


def _cannot_export(files: ModelFiles) -> str | None:
    """Why the ONNX copy cannot be written here, or None when it can."""
    missing = [m for m in ("tensorflow", "tf2onnx", "onnx") if not installed(m)]
    if missing:
        return (f"{', '.join(missing)} not installed (pip install 'meshfit[onnx]')"
                f"{troubleshooting('onnx-not-installed')}")
    if os.path.exists(files.onnx_path) and not export_lib.written_by_meshfit(files.onnx_path):
        return (f"{files.onnx_path} exists and was not written by meshfit, so it is left alone "
                "(export elsewhere with `meshfit export MODEL --out X.onnx` and predict with X.onnx)")
    folder = os.path.dirname(os.path.abspath(files.onnx_path))
    if not os.access(folder, os.W_OK):
        return (f"{folder} is not writable (export elsewhere with `meshfit export MODEL --out "
                "X.onnx` and predict with X.onnx)")
    return None


def _current_session(files: ModelFiles, threads: int | None = None):
    """An ONNX Runtime session on the ONNX copy when it exists and matches the .keras file."""
    if not os.path.isfile(files.onnx_path):
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    # Single images: all graph fusions, one operator at a time, its work spread over the cores
    # (measured on the CIFAR-10 CNN, 2 cores: 0.48 ms p50 vs 0.53 ms with ONNX Runtime's defaults).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(files.onnx_path, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for bad files
        if files.keras_path:
            return None  # not a usable copy: exported again if meshfit wrote it (_cannot_export)
        why = str(e).splitlines()[0]
        raise MeshfitError(f"cannot load ONNX model {files.onnx_path} ({why}); "
                           "export it again with `meshfit export`") from e
    if files.keras_path:
        if onnx_metadata(session).get("source_sha256") != rundir.file_sha256(files.keras_path):
            return None  # exported from an older model.keras
    return session


def onnx_metadata(session) -> dict:
    """meshfit's metadata written into an ONNX model at export ({} for other ONNX files)."""
    raw = session.get_modelmeta().custom_metadata_map.get(export_lib.METADATA_KEY)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def probabilities(outputs: np.ndarray, kind: str) -> np.ndarray:
    """A classifier's outputs (N, classes) as class probabilities: `kind` (config.json's
    "outputs", meshfit.run.keras_side.scores.outputs_of) "logits" get a softmax, "sigmoid" (one
    output, the second class's probability; "sigmoid-logits": its logit) become two columns;
    "probabilities" stay."""
    if kind == "logits":
        shifted = np.exp(outputs - outputs.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    if kind.startswith("sigmoid"):
        second = 1 / (1 + np.exp(-outputs[:, :1])) if kind == "sigmoid-logits" else outputs[:, :1]
        return np.concatenate([1 - second, second], axis=-1)
    return outputs


def _outputs(files: ModelFiles, stored: str | None = None) -> str:
    """What the model outputs: config.json's "outputs", else `stored` (an ONNX copy's), else
    probabilities (runs from before it was recorded)."""
    return files.config.get("outputs") or stored or "probabilities"


def _onnx_predictor(files: ModelFiles, session) -> Predictor:
    meta = onnx_metadata(session)
    shape = (files.config.get("input_shape") or meta.get("input_shape")
             or session.get_inputs()[0].shape[1:])
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise MeshfitError(f"{files.onnx_path} takes inputs of shape {shape}, not images "
                           "(height, width, channels)")
    classes = session.get_outputs()[0].shape[-1]
    outputs = _outputs(files, meta.get("outputs"))
    names = _class_names(files, meta.get("class_names"), classes, outputs)
    input_name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {input_name: x})[0]

    return Predictor(files.source, "onnxruntime", names, tuple(int(d) for d in shape), run,
                     files.onnx_path, outputs)


def _keras_predictor(files: ModelFiles) -> Predictor:
    if files.keras_path is None:
        raise MeshfitError(f"{files.source} has no .keras model for the Keras backend; "
                           "use --backend onnx")
    keras = models.import_keras()
    model = export_lib.load_float32(files)
    shape = files.config.get("input_shape") or model.input_shape[1:]
    classes = model.output_shape[-1] if hasattr(model, "output_shape") else None  # subclassed: none
    outputs = _outputs(files)
    names = _class_names(files, None, classes, outputs)

    def run(x: np.ndarray) -> np.ndarray:
        with models.on_cpu(keras):
            return np.concatenate([np.asarray(model.predict_on_batch(x[i:i + KERAS_BATCH]))
                                   for i in range(0, len(x), KERAS_BATCH)])

    return Predictor(files.source, "keras", names, tuple(int(d) for d in shape), run,
                     files.keras_path, outputs)


def _class_names(files: ModelFiles, stored: list | None, classes: Any,
                 outputs: str = "probabilities") -> tuple[str, ...]:
    """The class names of a model with `classes` outputs (None: unknown), from config.json, else
    `stored` (an ONNX copy's), else the indices; () for a model that is no classifier: recorded
    so ([]), or with one output and no sigmoid `outputs` (a regression's, also from runs that
    recorded their labels' classes for it)."""
    names = files.config.get("class_names")
    names = stored if names is None else names
    if classes == 1 and outputs.startswith("sigmoid") and names and len(names) == 2:
        return tuple(str(n) for n in names)  # a binary classifier: the second class's probability
    if classes == 1 or names == []:
        return ()
    if names is None:
        if not isinstance(classes, int):
            raise MeshfitError(f"cannot tell how many classes {files.source} has; "
                               "put class_names in config.json beside it")
        return tuple(str(i) for i in range(classes))
    if isinstance(classes, int) and len(names) != classes:
        raise MeshfitError(f"{files.source}: config.json lists {len(names)} class names but the "
                           f"model outputs {classes} probabilities; fix class_names")
    return tuple(str(n) for n in names)


# ----------------------------------------------------------------------------------- results

def top_k(probabilities: np.ndarray, class_names: Sequence[str], k: int) -> list[dict]:
    """The k most probable classes of one image: [{'label', 'index', 'probability'}], best first."""
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [{"label": class_names[i], "index": int(i), "probability": float(probabilities[i])}
            for i in order]


def results(paths: Sequence[str], probabilities: np.ndarray, class_names: Sequence[str],
            k: int) -> list[dict]:
    """One dict per image: its file, predicted label, probability, top-k and all probabilities;
    for a model that is no classifier (no class_names), its file and the model's "values"."""
    if not class_names:
        return [{"image": path, "values": [float(v) for v in np.ravel(p)]}
                for path, p in zip(paths, probabilities)]
    out = []
    for path, p in zip(paths, probabilities):
        best = top_k(p, class_names, k)
        out.append({"image": path, "label": best[0]["label"], "index": best[0]["index"],
                    "probability": best[0]["probability"], "top_k": best,
                    "probabilities": [float(v) for v in p]})
    return out


def format_results(rows: list[dict]) -> str:
    """Text for people: per image its predicted class, then the top-k classes and probabilities;
    or its values (a model that is no classifier)."""
    lines = []
    for row in rows:
        if "values" in row:
            lines.append(f"{row['image']}: {', '.join(f'{v:.6g}' for v in row['values'])}")
            continue
        lines.append(f"{row['image']}: {row['label']} ({row['probability']:.1%})")
        width = max(len(t["label"]) for t in row["top_k"])
        lines += [f"  {t['label']:<{width}}  {t['probability']:.4f}" for t in row["top_k"]]
    return "\n".join(lines)


def save_figure(path: str, images: np.ndarray, rows: list[dict]) -> None:
    """A PNG at `path` of `figure(images, rows)`."""
    try:
        figure(images, rows).savefig(path, dpi=100)
    except OSError as e:
        raise MeshfitError(f"cannot write {path} ({e}); choose a writable path for --show") from e


def figure(images: np.ndarray, rows: list[dict]):
    """A matplotlib Figure of each image (as the model saw it) beside bars of its top-k
    probabilities; `rows` as `results` returns them. A notebook cell ending with it shows it."""
    fig = figures.new(figsize=(7, 1.8 * len(rows) + 0.3), layout="constrained")
    axes = fig.subplots(len(rows), 2, squeeze=False, width_ratios=(1, 2))
    for (ax_img, ax_bar), image, row in zip(axes, images, rows):
        grey = image.shape[-1] == 1
        ax_img.imshow(image[..., 0] if grey else image, cmap="gray" if grey else None,
                      vmin=0, vmax=255)
        ax_img.axis("off")
        if "values" in row:  # no classifier: its values, written beside the image (no scale to draw)
            ax_img.set_title(os.path.basename(row["image"]), fontsize=9)
            ax_bar.axis("off")
            ax_bar.text(0, 0.5, ", ".join(f"{v:.6g}" for v in row["values"]), fontsize=12,
                        va="center", wrap=True)
            continue
        ax_img.set_title(f"{row['label']} ({row['probability']:.1%})", fontsize=10)
        best = row["top_k"][::-1]
        ax_bar.barh([t["label"] for t in best], [t["probability"] for t in best],
                    color=["tab:blue"] * (len(best) - 1) + ["tab:orange"])
        ax_bar.set_xlim(0, 1)
        ax_bar.set_title(os.path.basename(row["image"]), fontsize=9)
        ax_bar.tick_params(labelsize=8)
    return fig


# ----------------------------------------------------------------------------------- benchmark

def benchmark_latency(path: str | os.PathLike, n: int = 1000, batch: int = 1,
                      backend: str = "auto", warmup: int = 50, threads: int | None = None) -> dict:
    """Latency of `Predictor.predict` on random images in this (warm) process, in milliseconds.

    Returns {'p50_ms', 'p90_ms', 'mean_ms', 'n', 'batch', 'backend', 'threads'}; `warmup` calls
    are not timed.
    """
    if n < 1 or batch < 1:
        raise MeshfitError(f"benchmark needs n >= 1 and batch >= 1, got n={n}, batch={batch}")
    predictor = load_predictor(path, backend=backend, threads=threads)
    x = np.random.default_rng(0).integers(0, 256, (batch, *predictor.input_shape)).astype(np.uint8)
    for _ in range(warmup):
        predictor.predict(x)
    times = np.empty(n)
    for i in range(n):
        start = time.perf_counter()
        predictor.predict(x)
        times[i] = time.perf_counter() - start
    p50, p90 = np.percentile(times * 1e3, [50, 90])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "mean_ms": float(times.mean() * 1e3),
            "n": n, "batch": batch, "backend": predictor.backend, "threads": threads}
