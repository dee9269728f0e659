"""A checkpoint's folder and files (the on-disk format), and reading them back: its state
and arrays as numpy, with no Keras.

A checkpoint is a folder RUN/checkpoints/ckpt-<global step, 8 digits>/ holding
  arrays/        on the JAX engine (format 3), the model's and optimizer's variables (weights,
                 batch-norm statistics, the SeedGenerator states that drive Dropout, which Keras'
                 own weights files leave out; step count, moments), written by orbax-checkpoint:
                 each process writes only the shards it holds (see meshfit.run.sharded_arrays), and
                 `--resume` reads each array laid out for the devices there are then (another
                 device count, one process or several, fsdp or data-parallel);
  arrays.npz     the metrics' running totals and any extra arrays of the run (a recipe callback's
                 best weights), "extra/KEY"; on TensorFlow (format 2) every variable as well;
  state.json     where training stands (epoch, step within it, global step, steps per epoch), the
                 seed (with the epoch and step it fixes the data order and augmentation), the
                 metrics history so far, the callbacks' state, the run's settings, and each
                 variable's name, shape, dtype;
  manifest.json  the commit: the size and SHA-256 of every file above (arrays/ included).
A folder without a manifest is a save cut short (a kill mid-write): it is ignored and removed by
the next save. A checkpoint whose files do not match its manifest is damaged (`verify`):
`--resume` falls back to the newest one that is intact, with a warning. Folders of format 2 and
of meshfit 0.1 (state.npz + state.json, committed by renaming the folder, no manifest) are
still read. Writing one: meshfit.run.keras_side.checkpoint_save; loading one into a model:
meshfit.run.keras_side.checkpoint_restore.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from meshfit.errors import MeshfitError
from meshfit.run import rundir, sharded_arrays
from meshfit.run.rundir import list_checkpoints

# 1: meshfit 0.1, committed by renaming the folder; 2: arrays.npz, committed by manifest.json;
# 3: as 2, with the model's and optimizer's arrays in arrays/ (orbax, each process its shards).
FORMAT, NPZ_FORMAT = 3, 2
READABLE_FORMATS = (1, 2, 3)
STATE_ARRAYS, STATE_JSON = rundir.CHECKPOINT_ARRAYS, rundir.CHECKPOINT_STATE
MANIFEST, LEGACY_ARRAYS = rundir.CHECKPOINT_MANIFEST, "state.npz"
STATE_FIELDS = ("epoch", "step", "global_step", "steps_per_epoch", "variables")
GROUPS = ("model", "optimizer", "metrics")
EXTRA = "extra"  # arrays.npz keys "extra/KEY": Checkpointer's extra_arrays


class CheckpointDamaged(MeshfitError):
    """A checkpoint's files are unreadable, incomplete or do not match its manifest."""


def checkpoint_name(global_step: int) -> str:
    """The folder name of the checkpoint taken after `global_step` training steps."""
    return f"ckpt-{global_step:08d}"


def latest(directory: str | os.PathLike) -> str | None:
    """The newest committed checkpoint in `directory`, or None (it may still be damaged: see
    `verify`)."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def describe(path: str) -> dict[str, Any]:
    """The size and SHA-256 of a file, as a manifest lists them."""
    return {"bytes": os.path.getsize(path), "sha256": rundir.file_sha256(path)}


def damaged(path: str, why: str) -> CheckpointDamaged:
    """The one-line error for checkpoint `path`, damaged because of `why`."""
    return CheckpointDamaged(f"checkpoint {path} is damaged ({why}); resume from another "
                             "checkpoint or start a new run")


def verify(path: str | os.PathLike) -> None:
    """A CheckpointDamaged unless every file listed in the checkpoint's manifest has its size and
    SHA-256 (meshfit 0.1's checkpoints have no manifest: their files are checked when read)."""
    path = os.fspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path) and rundir.checkpoint_complete(path):
        return
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
        if not {STATE_ARRAYS, STATE_JSON} <= set(expected) or \
                any(name.startswith("/") or ".." in name.split("/") for name in expected):
            raise KeyError("files")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise damaged(path, f"unreadable {MANIFEST}: {type(e).__name__}") from None
    for name, (size, sha256) in expected.items():
        file = os.path.join(path, *name.split("/"))
        try:
            actual = describe(file)
        except OSError as e:
            raise damaged(path, f"{name}: {e.strerror or e}") from None
        if actual["bytes"] != size:
            raise damaged(path, f"{name} has {actual['bytes']} bytes, its manifest says {size}")
        if actual["sha256"] != sha256:
            raise damaged(path, f"{name} does not match the SHA-256 in its manifest")


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's state.json as a dict, with its fields checked."""
    path = os.fspath(path)
    try:
        with open(os.path.join(path, STATE_JSON), "rb") as f:
            state = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise damaged(path, f"cannot read {STATE_JSON}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise damaged(path, f"{STATE_JSON} is not a JSON object")
    if state.get("format") not in READABLE_FORMATS:
        raise MeshfitError(f"checkpoint {path} has format {state.get('format')}, this meshfit reads "
                           f"formats {READABLE_FORMATS}; resume it with the meshfit version that "
                           "wrote it")
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        raise damaged(path, f"{STATE_JSON} lacks {', '.join(missing)}")
    counts = [state[k] for k in STATE_FIELDS[:4]]
    variables = state["variables"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or \
            not isinstance(variables, dict) or \
            not all(isinstance(variables.get(g), list) for g in GROUPS):
        raise damaged(path, f"{STATE_JSON} has fields of the wrong type")
    return state


def read_npz(path: str) -> dict[str, np.ndarray]:
    """A checkpoint's arrays.npz (meshfit 0.1's state.npz) as numpy arrays by key."""
    name = STATE_ARRAYS if os.path.exists(os.path.join(path, STATE_ARRAYS)) else LEGACY_ARRAYS
    try:
        with np.load(os.path.join(path, name), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # zipfile, numpy and OS errors of many kinds
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise damaged(path, f"cannot read {name}: {why}") from None


def read_sharded(path: str, state: dict[str, Any], targets: dict[str, list]) -> dict[str, Any]:
    """The orbax-written arrays of a format-3 checkpoint, keyed 'model/00000'..., laid out as
    `targets` ({group: [sharded_arrays.target_of(...) per variable]})."""
    tree = {group: {f"{i:05d}": t for i, t in enumerate(items)} for group, items in targets.items()
            if items}  # as written: without empty groups
    try:
        read = sharded_arrays.read(os.path.join(path, sharded_arrays.FOLDER), tree)
    except Exception as e:  # orbax, tensorstore and OS errors of many kinds
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise damaged(path, f"cannot read {sharded_arrays.FOLDER}/: {why}") from None
    return {f"{group}/{key}": value for group, values in read.items() for key, value in values.items()}


def _saved_targets(state: dict[str, Any]) -> dict[str, list]:
    """numpy targets of the saved shapes and dtypes of a format-3 checkpoint's device arrays."""
    return {group: [sharded_arrays.target_of(shape, dtype) for _, shape, dtype in state["variables"][group]]
            for group in ("model", "optimizer")}


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A checkpoint's arrays as numpy (gathered), keyed 'model/00000', 'optimizer/00000',
    'metrics/00000'..."""
    path = os.fspath(path)
    arrays = read_npz(path)
    if os.path.exists(os.path.join(path, MANIFEST)):
        state = read_state(path)
        if state["format"] == FORMAT:
            arrays.update(read_sharded(path, state, _saved_targets(state)))
    return arrays
