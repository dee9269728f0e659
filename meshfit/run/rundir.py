"""The run directory: its file names, where a new one goes, atomic writes, and finding its model.

A run directory (default runs/<recipe>-<YYYYmmdd-HHMMSS>/) holds
  config.json   the run specification (meshfit.run.spec), written first so a killed run can resume
  recipe.py     the recipe file trained (recipe files and --data runs only; its SHA-256 is in
                config.json), so resume, eval and export work after the original moves
  checkpoints/  the full training state, one folder per checkpoint, see meshfit.run.checkpoint_format
  model.keras   the trained model (raw 0-255 pixels in, class probabilities out)
  model.onnx    its ONNX copy for fast CPU inference (written by predict or export)
  history.json  per-epoch train and test loss/accuracy, time, samples/s, MFU
  metrics.json  the final figures: the specification plus test scores and speed
  curves.png    loss and accuracy per epoch, train and test
  tensorboard/  TensorBoard event files and profiler traces
Every command (train, eval, predict, export, runs, bench) reads and writes it through here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from meshfit.errors import MeshfitError
from meshfit.files import atomic_path

CONFIG, HISTORY, METRICS = "config.json", "history.json", "metrics.json"
MODEL, ONNX, CURVES = "model.keras", "model.onnx", "curves.png"
CHECKPOINTS, TENSORBOARD, LOCK = "checkpoints", "tensorboard", ".lock"
RECIPE = "recipe.py"
DIVERGED = "diverged.json"  # a run stopped because its weights became NaN or inf: where and why
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")  # checkpoints/ckpt-<global step>
CHECKPOINT_STATE = "state.json"  # where training stands (see meshfit.run.checkpoint_format)
CHECKPOINT_ARRAYS = "arrays.npz"  # the variables (meshfit 0.1 called them state.npz)
CHECKPOINT_MANIFEST = "manifest.json"  # written last, atomically: its checkpoint is complete
HINT = "pass a run directory written by meshfit train"


def timestamped(name: str, parent: str = "runs") -> str:
    """A new directory path <parent>/<name>-<YYYYmmdd-HHMMSS>, with a suffix if that exists;
    `name` (a recipe's, the user's text) made one plain folder name: a Recipe(name="cnn/v2") or
    "../x" would have put the run in another folder, or outside runs/."""
    name = re.sub(r"[^\w.+-]+", "-", name).strip(".-") or "run"
    base = os.path.join(parent, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def new(out: str | None, name: str) -> str:
    """The directory for a new run: `out`, or runs/<name>-<time>. Refuses a run that is there
    already, a file, a non-empty directory of other files (nothing of the user's is overwritten)
    and a place that cannot be written; creates nothing."""
    if not out:
        out = timestamped(name)
    elif os.path.isfile(os.path.join(out, CONFIG)):
        raise MeshfitError(f"{out} already holds a run; continue it with --resume {out} or "
                           "choose another --out")
    elif os.path.exists(out) and not os.path.isdir(out):
        raise MeshfitError(f"--out {out} is a file, not a directory; choose a new directory")
    elif os.path.isdir(out) and set(os.listdir(out)) - {LOCK}:
        raise MeshfitError(f"--out {out} already holds files that are not a meshfit run; choose an "
                           "empty or new directory")
    check_writable(out)
    return out


def check_writable(path: str) -> None:
    """A MeshfitError unless `path` (a directory, existing or to be created) can be written:
    a temporary file is made and removed in it or its nearest existing parent."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        if not os.path.isdir(parent):
            raise NotADirectoryError(f"{parent} is not a directory")
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise MeshfitError(f"cannot write the run directory {path} ({e.strerror or e}); choose "
                           "another --out") from None


@contextlib.contextmanager
def lock(run: str) -> Iterator[None]:
    """Hold the run directory's lock (RUN/.lock) inside the block; a second process that tries
    (a scheduler starting the same --resume twice) gets a MeshfitError naming the holder."""
    import fcntl

    try:
        os.makedirs(run, exist_ok=True)
        handle = open(os.path.join(run, LOCK), "a+")
    except OSError as e:
        raise MeshfitError(f"cannot write the run directory {run} ({e.strerror or e}); choose "
                           "another --out") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise MeshfitError(f"{run} is in use by {holder}; wait for it to finish or stop it "
                               "before resuming") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_json(path: str, data: Any) -> None:
    """Write `data` as indented JSON to `path`, atomically."""
    with atomic_path(path, ".json") as tmp:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")


def read_json(path: str) -> Any:
    """A JSON file's contents; an unreadable file is a one-line MeshfitError."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise MeshfitError(f"cannot read {path} ({e}); {HINT}") from e


def read_config(run: str, required: bool = True) -> dict[str, Any]:
    """The run's config.json as a dict; {} when it has none and `required` is false."""
    path = os.path.join(run, CONFIG)
    if not os.path.isfile(path):
        if required:
            raise MeshfitError(f"{run} has no {CONFIG}; {HINT}")
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise MeshfitError(f"{path} is not a JSON object; {HINT}")
    return config


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 of a text's UTF-8 bytes, hex: file_sha256 of the file it is written to."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files are: the .keras source (if any), its ONNX copy and its run config."""

    source: str
    keras_path: str | None
    onnx_path: str
    config: dict = field(default_factory=dict)


def _unfinished(run: str) -> str | None:
    """For a run directory whose training has not finished (config.json, no model.keras yet):
    one line saying so and how to finish it; else None."""
    if not os.path.isfile(os.path.join(run, CONFIG)) or os.path.isfile(os.path.join(run, MODEL)):
        return None
    saved = list_checkpoints(os.path.join(run, CHECKPOINTS))
    newest = f"; its newest checkpoint: {os.path.basename(saved[-1])}" if saved else ""
    return (f"{run} has not finished training (no {MODEL} yet{newest}); finish it with: "
            f"meshfit train --resume {run}")


def locate_model(path: str | os.PathLike) -> ModelFiles:
    """Resolve a run directory, a .keras file or an .onnx file to its model files."""
    path = os.fspath(path)
    hint = "pass a run directory written by `meshfit train`, a .keras file or an .onnx file"
    if not os.path.exists(path):
        raise MeshfitError(f"model {path} not found; {hint}")
    if os.path.isdir(path):
        keras_path, onnx_path = os.path.join(path, MODEL), os.path.join(path, ONNX)
        if not os.path.isfile(keras_path) and not os.path.isfile(onnx_path):
            raise MeshfitError(_unfinished(path) or f"{path} has no {MODEL} (nor {ONNX}); {hint}")
        return ModelFiles(path, keras_path if os.path.isfile(keras_path) else None, onnx_path,
                          read_config(path, required=False))
    stem, ext = os.path.splitext(path)
    if ext.lower() == ".keras":
        in_run = os.path.basename(path) == MODEL
        config = read_config(os.path.dirname(path) or ".", required=False) if in_run else {}
        return ModelFiles(path, path, stem + ".onnx", config)
    if ext.lower() == ".onnx":
        return ModelFiles(path, None, path, {})
    raise MeshfitError(f"{path} is not a .keras or .onnx model file; {hint}")


def locate_run(run_or_model: str | os.PathLike) -> tuple[str, str]:
    """(run directory, model.keras path) for a run directory or the model.keras inside it."""
    path = os.fspath(run_or_model)
    if os.path.isdir(path):
        run, model_path = path, os.path.join(path, MODEL)
    else:
        run, model_path = os.path.dirname(path) or ".", path
    hint = f"{HINT} (or the {MODEL} inside it)"
    if not os.path.isfile(model_path):
        raise MeshfitError((os.path.basename(model_path) == MODEL and _unfinished(run))
                           or f"{model_path} not found; {hint}")
    if not os.path.isfile(os.path.join(run, CONFIG)):
        raise MeshfitError(f"{run} has no {CONFIG}, so its dataset is unknown; {hint}")
    return run, model_path


def checkpoint_complete(path: str) -> bool:
    """Whether the checkpoint folder `path` was committed: it holds a manifest, or it was written
    by meshfit 0.1 (state.json and no arrays.npz), which committed a folder by renaming it."""
    if os.path.isfile(os.path.join(path, CHECKPOINT_MANIFEST)):
        return True
    return os.path.isfile(os.path.join(path, CHECKPOINT_STATE)) and \
        not os.path.exists(os.path.join(path, CHECKPOINT_ARRAYS))


def list_checkpoints(directory: str | os.PathLike) -> list[str]:
    """Committed checkpoints in `directory`, oldest first (folders cut short are left out)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = CHECKPOINT_NAME.match(name)
        path = os.path.join(directory, name)
        if match and checkpoint_complete(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resume_target(path: str) -> tuple[str, str | None]:
    """(run directory, checkpoint folder or None) for `--resume PATH`: a run directory, or one of
    its checkpoints (RUN/checkpoints/ckpt-00000012, also written ckpt-12)."""
    path = os.path.normpath(os.fspath(path))
    parent, name = os.path.split(path)
    match = re.fullmatch(r"ckpt-(\d+)", name)
    if not match or os.path.basename(parent) != CHECKPOINTS:
        return path, None
    full = os.path.join(parent, f"ckpt-{int(match.group(1)):08d}")
    if not checkpoint_complete(full):
        have = ", ".join(os.path.basename(p) for p in list_checkpoints(parent)) or "none"
        raise MeshfitError(f"{path} is not a complete checkpoint (complete ones: {have}); name one "
                           "of those, or the run directory to resume from its newest")
    return os.path.dirname(parent) or ".", full
