"""Checkpoints of the full training state, and exact resume.

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
On JAX a save blocks training only while the arrays are copied off the devices; the files are
written in a background thread, then process 0 writes arrays.npz and state.json (as they were
at the save), then the small manifest atomically (a file write and rename, never a folder rename,
which object-store mounts such as gcsfuse do not do atomically; orbax's own folder is marked
complete by a commit file for the same reason). The next save, a stop and the end of training
wait for it. A folder without a manifest is a save cut short (a kill mid-write): it is ignored
and removed by the next save. A checkpoint whose files do not match its manifest is damaged:
`--resume` falls back to the newest one that is intact, with a warning. The newest `keep` are kept.
TensorFlow (one CPU device, no shards, no JAX arrays for orbax to write) keeps format 2, written
at the save. Folders of format 2 and of meshfit 0.1 (state.npz + state.json, committed by
renaming the folder, no manifest) are still read.

`Checkpointer` (a Keras callback) saves every N steps or seconds and at every epoch end, and after
a SIGTERM/SIGINT (see `stop_on_signals`) saves at the next step boundary and stops training by
raising `TrainingInterrupted`. It acts in `on_train_batch_begin`, which Keras calls synchronously
without logs, so training pays no per-step host synchronization on JAX.

In a multi-process job a signal often reaches one process only (a preemption notice, a Ctrl-C on
one host), so the processes vote at every dispatch boundary (`hosts.Vote`, one step behind, so
still without a host sync) and all stop at the same step: every process writes its shards,
process 0 commits, all wait until it has, and all raise `TrainingInterrupted` with the same exit
code.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Iterator

import keras
import numpy as np

from meshfit.errors import MeshfitError
from meshfit.fit import hosts
from meshfit.parallel import cluster, heartbeat
from meshfit.run import rundir, sharded_arrays, spec
from meshfit.run.rundir import list_checkpoints
from meshfit.watch import report

# 1: meshfit 0.1, committed by renaming the folder; 2: arrays.npz, committed by manifest.json;
# 3: as 2, with the model's and optimizer's arrays in arrays/ (orbax, each process its shards).
FORMAT, NPZ_FORMAT = 3, 2
READABLE_FORMATS = (1, 2, 3)
STATE_ARRAYS, STATE_JSON = rundir.CHECKPOINT_ARRAYS, rundir.CHECKPOINT_STATE
MANIFEST, LEGACY_ARRAYS = rundir.CHECKPOINT_MANIFEST, "state.npz"
STATE_FIELDS = ("epoch", "step", "global_step", "steps_per_epoch", "variables")
GROUPS = ("model", "optimizer", "metrics")
EXTRA = "extra"  # arrays.npz keys "extra/KEY": Checkpointer's extra_arrays


class TrainingInterrupted(MeshfitError):
    """Training stopped on a signal after saving a checkpoint; `exit_code` is 128 + the signal."""

    def __init__(self, message: str, signum: int, checkpoint: str | None):
        super().__init__(message)
        self.signum = signum
        self.checkpoint = checkpoint
        self.exit_code = 128 + signum


class CheckpointDamaged(MeshfitError):
    """A checkpoint's files are unreadable, incomplete or do not match its manifest."""


# ------------------------------------------------------------------------------- reading/writing

def variable_groups(model) -> dict[str, list]:
    """The model's variables, its optimizer's and its metrics', in a fixed order."""
    optimizer = getattr(model, "optimizer", None)
    return {"model": list(model.variables),
            "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "metrics": list(model.metrics_variables)}


def _sync(model) -> None:
    """On JAX, copy the state that fit keeps outside the model back into its variables."""
    if hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def _host_value(variable) -> np.ndarray:
    """A variable's value as numpy; of a replicated multi-host array, this process's copy."""
    value = variable.value
    if getattr(value, "is_fully_replicated", False) and not value.is_fully_addressable:
        value = value.addressable_data(0)
    return np.asarray(keras.ops.convert_to_numpy(value))


def gather_for_saving(model) -> None:
    """Make every variable sharded across processes whole in host memory on each process, so
    that process 0 alone can write model.keras; every process of the job calls it at the same
    point, after training (the variables then hold numpy arrays: save, do not train further)."""
    if keras.backend.backend() != "jax" or not cluster.multi_process():
        return
    from jax.experimental import multihost_utils

    for v in [*model.variables, *variable_groups(model)["optimizer"]]:
        value = v.value
        if getattr(value, "is_fully_addressable", True) or value.is_fully_replicated:
            continue
        # Not v.assign: that would lay the value out over the devices again.
        v._value = np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _fsync_dir(path: str) -> None:
    """Make a folder's entries durable (where the file system can: not every FUSE mount can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_file(path: str, write) -> None:
    """Create `path`, let `write(file)` fill it, and flush it to disk."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_name(global_step: int) -> str:
    """The folder name of the checkpoint taken after `global_step` training steps."""
    return f"ckpt-{global_step:08d}"


def latest(directory: str | os.PathLike) -> str | None:
    """The newest committed checkpoint in `directory`, or None (it may still be damaged: see
    `verify`)."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _describe(path: str) -> dict[str, Any]:
    return {"bytes": os.path.getsize(path), "sha256": rundir.file_sha256(path)}


def sharded_by_default() -> bool:
    """True where checkpoints are written by orbax (format 3): on the JAX engine."""
    return keras.backend.backend() == "jax"


class PendingSave:
    """A checkpoint being written: `result()` waits until it is committed and returns its folder
    (None on processes that do not commit), raising the write's error if it failed."""

    def __init__(self, path: str, finish=None):
        self.path = path
        self._error: BaseException | None = None
        self._thread = None
        if finish is not None:
            self._thread = threading.Thread(target=self._run, args=(finish,), daemon=True,
                                            name="meshfit-checkpoint")
            self._thread.start()

    def _run(self, finish) -> None:
        try:
            finish()
        except BaseException as e:  # handed to the thread that waits
            self._error = e

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> str:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


def save(directory: str | os.PathLike, model, *, epoch: int, step: int, steps_per_epoch: int,
         extra: dict[str, Any] | None = None, extra_arrays: dict[str, np.ndarray] | None = None,
         keep: int = spec.DEFAULT_KEEP_CHECKPOINTS, sharded: bool | None = None) -> str:
    """Write the full training state after `step` steps of epoch `epoch` (0-based); return its
    folder once committed (see `begin_save` for the arguments)."""
    return begin_save(directory, model, epoch=epoch, step=step, steps_per_epoch=steps_per_epoch,
                      extra=extra, extra_arrays=extra_arrays, keep=keep, sharded=sharded,
                      background=False).result()


def begin_save(directory: str | os.PathLike, model, *, epoch: int, step: int, steps_per_epoch: int,
               extra: dict[str, Any] | None = None, extra_arrays: dict[str, np.ndarray] | None = None,
               keep: int = spec.DEFAULT_KEEP_CHECKPOINTS, sharded: bool | None = None,
               background: bool | None = None,
               commit: bool = True) -> PendingSave:
    """Start writing the full training state after `step` steps of epoch `epoch` (0-based).

    extra: JSON-serializable data stored with it (e.g. seed, history, run settings).
    extra_arrays: numpy arrays stored with the variables (restore returns them as "extra_arrays").
    sharded: write the model's and optimizer's arrays with orbax, each process its own shards
    (format 3; default on JAX), else all in arrays.npz (format 2). With `background` (default:
    when sharded), returns once the arrays are copied off the devices; the files, the manifest
    and the pruning to the newest `keep` follow in a thread (one save at a time: wait for the
    previous one first).
    commit: False on processes other than 0 of a job, which write their shards only (format 3)
    or nothing (format 2). Every process of a job calls this at the same step.
    An intact checkpoint of the same global step that already exists is kept as it is; a damaged
    one is written again.
    """
    directory = os.fspath(directory)
    sharded = sharded_by_default() if sharded is None else sharded
    background = sharded if background is None else background
    global_step = epoch * steps_per_epoch + step
    final = os.path.join(directory, checkpoint_name(global_step))
    if _intact(final) or (not commit and not sharded):
        return PendingSave(final)
    _sync(model)
    host_arrays, variables, device_arrays = _arrays_of(model, sharded, extra_arrays)
    state = {"format": FORMAT if sharded else NPZ_FORMAT, "epoch": epoch, "step": step,
             "global_step": global_step, "steps_per_epoch": steps_per_epoch,
             "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra or {}), "variables": variables}
    state_text = json.dumps(state).encode()  # now: `extra` may change while the files are written
    writing = _start_writing(final, directory, device_arrays, sharded, background, commit)

    def finish() -> None:
        try:
            if writing is not None:
                writing.wait()
            if commit:
                _commit(final, host_arrays, state_text, global_step, sharded)
        except BaseException as e:
            _failed(final, directory, e, commit)
        if commit:
            _prune(directory, final, keep)

    if not background:
        finish()
        return PendingSave(final)
    try:
        return PendingSave(final, finish)
    except BaseException:  # e.g. Ctrl-C before the thread started: let orbax's threads end
        with contextlib.suppress(BaseException):
            writing.wait()
        raise


def _intact(final: str) -> bool:
    """True when the checkpoint folder `final` is committed and intact (a save of the same step
    keeps it); a damaged one is written again."""
    if not rundir.checkpoint_complete(final):
        return False
    try:
        verify(final)
        return True
    except CheckpointDamaged:
        return False


def _arrays_of(model, sharded: bool, extra_arrays: dict[str, np.ndarray] | None):
    """(host arrays for arrays.npz, each group's [name, shape, dtype] list, device arrays for orbax):
    with `sharded`, the model's and optimizer's variables stay on the devices (orbax writes each
    process's shards); the metrics' running totals and the extra arrays always go to the host."""
    host_arrays, variables, device_arrays = {}, {}, {}
    for group, values in variable_groups(model).items():
        variables[group], device_arrays[group] = [], {}
        for i, v in enumerate(values):
            if sharded and group != "metrics":
                value = v.value
                device_arrays[group][f"{i:05d}"] = value
                shape, dtype = tuple(value.shape), str(np.dtype(value.dtype))
            else:
                value = _host_value(v)
                host_arrays[f"{group}/{i:05d}"] = value
                shape, dtype = value.shape, str(value.dtype)
            variables[group].append([v.path, list(shape), dtype])
    host_arrays.update({f"{EXTRA}/{key}": np.asarray(value)
                        for key, value in (extra_arrays or {}).items()})
    return host_arrays, variables, device_arrays


def _start_writing(final: str, directory: str, device_arrays: dict, sharded: bool,
                   background: bool, commit: bool):
    """A fresh folder `final` (process 0) and, when sharded, orbax writing every process's shards
    into it (returned, to wait for); None when there is nothing for orbax to write."""
    writing = None
    try:
        if commit and os.path.exists(final):  # a save of this step cut short, or a damaged one
            shutil.rmtree(final)
        if commit:
            os.makedirs(final)
        if sharded:
            cluster.barrier(f"meshfit: writing {os.path.basename(final)}")  # after the removal
            writing = sharded_arrays.write(os.path.join(final, sharded_arrays.FOLDER),
                                           {g: a for g, a in device_arrays.items() if a},
                                           background=background)
    except BaseException as e:  # orbax's threads may still write there: leave it to the next save
        _failed(final, directory, e, commit and not sharded)
    return writing


def _failed(final: str, directory: str, error: BaseException, remove: bool):
    """Remove what a failed save left (with `remove`) and raise its error, one line for an
    OSError."""
    if remove and not rundir.checkpoint_complete(final):
        shutil.rmtree(final, ignore_errors=True)
    if isinstance(error, OSError):
        raise MeshfitError(f"cannot write checkpoint {final} ({error.strerror or error}); the "
                           "previous checkpoints are intact: free space or fix the directory, "
                           "then --resume") from None
    raise error


def _commit(final: str, host_arrays: dict[str, np.ndarray], state_text: bytes, global_step: int,
            sharded: bool) -> None:
    """Write arrays.npz and state.json, then the manifest listing every file (the commit)."""
    files = {}
    for name, write in ((STATE_ARRAYS, lambda f: np.savez(f, **host_arrays)),
                        (STATE_JSON, lambda f: f.write(state_text))):
        _write_file(os.path.join(final, name), write)
        files[name] = _describe(os.path.join(final, name))
    if sharded:
        folder = os.path.join(final, sharded_arrays.FOLDER)
        for name in sharded_arrays.files(folder):
            files[f"{sharded_arrays.FOLDER}/{name}"] = _describe(os.path.join(folder, name))
    manifest = {"format": FORMAT if sharded else NPZ_FORMAT, "global_step": global_step,
                "files": files}
    tmp = os.path.join(final, f".{MANIFEST}.tmp")
    _write_file(tmp, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    os.replace(tmp, os.path.join(final, MANIFEST))  # the commit
    _fsync_dir(final)
    _fsync_dir(os.path.dirname(final))


def _prune(directory: str, final: str, keep: int) -> None:
    """Keep the newest `keep` checkpoints (always `final`); remove what saves cut short left."""
    older = [path for path in list_checkpoints(directory) if path != final]
    for old in older[:max(len(older) - (keep - 1), 0)] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for name in os.listdir(directory):  # what earlier saves cut short left behind
        path = os.path.join(directory, name)
        cut_short = rundir.CHECKPOINT_NAME.match(name) and not rundir.checkpoint_complete(path)
        if name.startswith(".tmp-") or cut_short:
            shutil.rmtree(path, ignore_errors=True)


def _damaged(path: str, why: str) -> CheckpointDamaged:
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
        raise _damaged(path, f"unreadable {MANIFEST}: {type(e).__name__}") from None
    for name, (size, sha256) in expected.items():
        file = os.path.join(path, *name.split("/"))
        try:
            actual = _describe(file)
        except OSError as e:
            raise _damaged(path, f"{name}: {e.strerror or e}") from None
        if actual["bytes"] != size:
            raise _damaged(path, f"{name} has {actual['bytes']} bytes, its manifest says {size}")
        if actual["sha256"] != sha256:
            raise _damaged(path, f"{name} does not match the SHA-256 in its manifest")


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's state.json as a dict, with its fields checked."""
    path = os.fspath(path)
    try:
        with open(os.path.join(path, STATE_JSON), "rb") as f:
            state = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise _damaged(path, f"cannot read {STATE_JSON}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise _damaged(path, f"{STATE_JSON} is not a JSON object")
    if state.get("format") not in READABLE_FORMATS:
        raise MeshfitError(f"checkpoint {path} has format {state.get('format')}, this meshfit reads "
                           f"formats {READABLE_FORMATS}; resume it with the meshfit version that "
                           "wrote it")
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        raise _damaged(path, f"{STATE_JSON} lacks {', '.join(missing)}")
    counts = [state[k] for k in STATE_FIELDS[:4]]
    variables = state["variables"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or \
            not isinstance(variables, dict) or \
            not all(isinstance(variables.get(g), list) for g in GROUPS):
        raise _damaged(path, f"{STATE_JSON} has fields of the wrong type")
    return state


def _read_npz(path: str) -> dict[str, np.ndarray]:
    name = STATE_ARRAYS if os.path.exists(os.path.join(path, STATE_ARRAYS)) else LEGACY_ARRAYS
    try:
        with np.load(os.path.join(path, name), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # zipfile, numpy and OS errors of many kinds
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _damaged(path, f"cannot read {name}: {why}") from None


def _read_sharded(path: str, state: dict[str, Any], targets: dict[str, list]) -> dict[str, Any]:
    """The orbax-written arrays of a format-3 checkpoint, keyed 'model/00000'..., laid out as
    `targets` ({group: [sharded_arrays.target_of(...) per variable]})."""
    tree = {group: {f"{i:05d}": t for i, t in enumerate(items)} for group, items in targets.items()
            if items}  # as written: without empty groups
    try:
        read = sharded_arrays.read(os.path.join(path, sharded_arrays.FOLDER), tree)
    except Exception as e:  # orbax, tensorstore and OS errors of many kinds
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise _damaged(path, f"cannot read {sharded_arrays.FOLDER}/: {why}") from None
    return {f"{group}/{key}": value for group, values in read.items() for key, value in values.items()}


def _saved_targets(state: dict[str, Any]) -> dict[str, list]:
    """numpy targets of the saved shapes and dtypes of a format-3 checkpoint's device arrays."""
    return {group: [sharded_arrays.target_of(shape, dtype) for _, shape, dtype in state["variables"][group]]
            for group in ("model", "optimizer")}


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A checkpoint's arrays as numpy (gathered), keyed 'model/00000', 'optimizer/00000',
    'metrics/00000'..."""
    path = os.fspath(path)
    arrays = _read_npz(path)
    if os.path.exists(os.path.join(path, MANIFEST)):
        state = read_state(path)
        if state["format"] == FORMAT:
            arrays.update(_read_sharded(path, state, _saved_targets(state)))
    return arrays


def _check_fits(path: str, group: str, saved: list, variables: list) -> None:
    """A one-line MeshfitError unless the saved variables have the shapes of `variables`."""
    hint = "resume with the recipe and settings that wrote it, or start a new run"
    if len(saved) != len(variables):
        raise MeshfitError(f"checkpoint {path} does not fit this model: it has {len(saved)} {group} "
                           f"variables, the model has {len(variables)}; {hint}")
    for (name, shape, _), v in zip(saved, variables):
        if tuple(shape) != tuple(v.shape):
            raise MeshfitError(f"checkpoint {path} does not fit this model: {group} variable {name} "
                               f"has shape {tuple(shape)} there but {v.path} has {tuple(v.shape)} "
                               f"here; {hint}")


def _check_arrays(path: str, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """A CheckpointDamaged unless the arrays are the ones state.json lists, of its shapes."""
    for group in GROUPS:
        for i, entry in enumerate(state["variables"][group]):
            key = f"{group}/{i:05d}"
            if key not in arrays:
                raise _damaged(path, f"array {key} is missing")
            try:
                shape = tuple(int(d) for d in entry[1])
            except (TypeError, ValueError, IndexError):
                raise _damaged(path, f"{STATE_JSON} lists {group} variable {i} wrongly") from None
            if arrays[key].shape != shape:
                raise _damaged(path, f"array {key} has shape {arrays[key].shape}, {STATE_JSON} "
                                     f"says {shape}")


def _assign(values: list, arrays: dict[str, np.ndarray], group: str) -> None:
    for i, v in enumerate(values):
        v.assign(arrays[f"{group}/{i:05d}"])


def restore(model, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint's model and optimizer variables into a compiled `model`.

    Every file is checked (manifest, fields, arrays) before any variable changes: a damaged
    checkpoint raises CheckpointDamaged and leaves the model as it was.
    Returns the checkpoint's state (state.json) with the metrics' arrays under "metrics_values":
    metrics variables exist only once fit has started, so `Checkpointer(resume_state=...)` puts
    them back at the start of the resumed epoch; and the extra arrays under "extra_arrays".
    """
    path = os.fspath(path)
    verify(path)
    state, arrays = read_state(path), _read_npz(path)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:  # its variables exist only once built
        optimizer.build(model.trainable_variables)
    groups = variable_groups(model)
    sharded = state["format"] == FORMAT
    if sharded:  # every saved variable is listed: check the model first, then read for its layout
        for group in ("model", "optimizer"):
            _check_fits(path, group, state["variables"][group], groups[group])
        arrays.update(_read_sharded(path, state, {group: [_target(v) for v in groups[group]]
                                                  for group in ("model", "optimizer")}))
    _check_arrays(path, state, arrays)
    for group in ("model", "optimizer"):
        _check_fits(path, group, state["variables"][group], groups[group])
    # Every check came first: a checkpoint that fails one leaves the model as it was.
    for group in ("model", "optimizer"):
        _assign(groups[group], arrays, group)
    count = len(state["variables"]["metrics"])
    state["metrics_values"] = [arrays[f"metrics/{i:05d}"] for i in range(count)]
    state["extra_arrays"] = {k[len(EXTRA) + 1:]: v for k, v in arrays.items() if k.startswith(EXTRA + "/")}
    return state


def _target(variable) -> Any:
    """How to read a saved array into `variable`: with its sharding on JAX (laid out for the
    devices there are now), else as numpy."""
    if keras.backend.backend() == "jax":
        value = variable.value
        return sharded_arrays.target_of(tuple(value.shape), str(np.dtype(value.dtype)), value.sharding)
    return sharded_arrays.target_of(tuple(variable.shape), str(np.dtype(variable.dtype)))


# ------------------------------------------------------------------------------------ callback

class Checkpointer(keras.callbacks.Callback):
    """Saves the training state into `directory` during fit; stops cleanly on SIGTERM/SIGINT.

    steps_per_epoch: the run's steps per epoch (checkpoints are numbered by global step).
    every_steps / every_seconds: save when the global step reaches a multiple of every_steps (the
    first dispatch boundary at or past it, with several steps per dispatch), or when
    every_seconds have passed since the last save (either, both or neither); always at epoch end
    unless epoch_end=False. keep: how many checkpoints to keep. extra(): JSON data saved with each
    checkpoint (seed, history, settings); extra_arrays(): numpy arrays saved with it (a recipe
    callback's best weights). resume_state: what `restore` returned, when resuming mid-epoch.
    write: False on processes other than 0 (they write their shards only, or nothing with
    sharded=False). sharded: see `begin_save` (default: on JAX). background: save while training
    goes on (the next save, a stop and the end of training wait for it; default: when sharded);
    False: each save is committed before training goes on, as on TensorFlow.
    In a job of several processes a stop requested on any of them stops all at the same step.
    """

    def __init__(self, directory: str | os.PathLike, steps_per_epoch: int, *,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 epoch_end: bool = True, keep: int = spec.DEFAULT_KEEP_CHECKPOINTS, extra=None,
                 extra_arrays=None, resume_state: dict[str, Any] | None = None, write: bool = True,
                 sharded: bool | None = None, background: bool | None = None):
        super().__init__()
        self.directory = os.fspath(directory)
        self.steps_per_epoch = steps_per_epoch
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.epoch_end, self.keep = epoch_end, keep
        self.extra = extra or (lambda: {})
        self.extra_arrays = extra_arrays or (lambda: {})
        self.write = write
        self.sharded, self.background = sharded, background
        self.saving = self.interrupted = False  # see stop_on_signals
        self._pending: PendingSave | None = None
        self.last_saved: str | None = None
        self.stop_signal: int | None = None
        self._resume = resume_state
        self._epoch, self._offset, self._global_step = 0, 0, 0
        self._last_time = time.monotonic()
        self._vote: hosts.Vote | None = None

    def request_stop(self, signum: int) -> None:
        """Ask training to save and stop at the next step boundary (called by signal handlers)."""
        self.stop_signal = signum

    def save(self, epoch: int, step: int, wait: bool = False) -> str | None:
        """Save now, as the state after `step` steps of epoch `epoch`; with `wait`, return once
        committed. Returns the checkpoint's folder (None on processes other than 0)."""
        self.wait_for_device()  # first: the previous save's write overlaps these steps
        self.wait()
        _sync(self.model)
        self._last_time = time.monotonic()
        self.saving = True  # a Ctrl-C now waits until the write is handed to its threads
        try:
            self._pending = begin_save(self.directory, self.model, epoch=epoch, step=step,
                                       steps_per_epoch=self.steps_per_epoch, extra=self.extra(),
                                       extra_arrays=self.extra_arrays(), keep=self.keep,
                                       sharded=self.sharded, background=self.background,
                                       commit=self.write)
        finally:
            self.saving = False
        if self.interrupted:  # the second signal, held during begin_save
            self.interrupted = False
            raise KeyboardInterrupt
        if wait:
            return self.wait()
        return self._pending.path if self.write else None

    def wait_for_device(self) -> None:
        """Wait for the training steps already dispatched, whose results a save copies. A method
        of its own so that the goodput ledger charges this wait to training, not to the save
        (meshfit.run.fitting.charged_to_checkpoint): dispatch is asynchronous, so on JAX the
        first save of a run could otherwise hold many steps' device time."""
        report.wait_for_device(self.model)

    def wait(self) -> str | None:
        """Block until the save in progress (if any) is committed, raising its error; return the
        newest checkpoint saved (None on processes other than 0)."""
        pending = self._pending
        if pending is not None:
            try:
                path = pending.result()
            except KeyboardInterrupt:  # still being written: a later wait waits again
                raise
            except BaseException:
                self._pending = None
                raise
            self._pending = None
            if self.write:
                self.last_saved = path
        return self.last_saved

    def agreed_stop(self, settle: bool = False) -> int | None:
        """The signal to stop on now, the same on every process of a job; None: go on.

        One process alone: its own stop_signal. Several: the largest signal any process had at
        the previous call (or, with settle, at any call until now); every process calls this at
        the same points of training.
        """
        heartbeat.advance()  # progress for meshfit launch's watchdog, before the vote may wait
        if self._vote is None:
            return self.stop_signal
        signum = self._vote.cast(self.stop_signal or 0)
        if settle:
            signum = max(signum, self._vote.settle())
        if signum:
            self.stop_signal = signum
        return signum or None

    def on_train_begin(self, logs=None):
        self._last_time = time.monotonic()
        if self._vote is None and cluster.multi_process():
            self._vote = hosts.Vote()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._offset = epoch, 0
        if self._resume is not None and epoch == self._resume["epoch"]:
            self._offset = self._resume["step"]
            values = self._resume["metrics_values"]
            if self._offset and values:  # the interrupted epoch's running totals
                metrics = self.model.metrics_variables
                _check_fits(self.directory, "metrics", self._resume["variables"]["metrics"], metrics)
                for v, value in zip(metrics, values):
                    v.assign(value)
            self._resume = None

    def on_train_batch_begin(self, batch, logs=None):
        step = self._offset + batch
        if self.agreed_stop() is not None:
            self._stop(self.save(self._epoch, step, wait=True),
                       self._epoch * self.steps_per_epoch + step)
        global_step = self._epoch * self.steps_per_epoch + step
        previous, self._global_step = self._global_step, global_step
        if not batch:
            return
        # With k steps per dispatch the step advances by k: save when it passes a multiple.
        if (self.every_steps and global_step // self.every_steps > previous // self.every_steps) or \
                (self.every_seconds and time.monotonic() - self._last_time >= self.every_seconds):
            self.save(self._epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        stop = self.agreed_stop(settle=True) is not None
        if self.epoch_end or stop:
            self.save(epoch + 1, 0)
        if stop:
            self._stop(self.wait(), (epoch + 1) * self.steps_per_epoch)

    def on_train_end(self, logs=None):
        self.wait()

    def _stop(self, path: str | None, global_step: int):
        cluster.barrier("meshfit: stop saved")  # no process exits before process 0 has saved
        name = signal.Signals(self.stop_signal).name
        run = os.path.dirname(os.path.abspath(self.directory))
        where = f"saved to {path}" if path else "state saved by process 0"
        raise TrainingInterrupted(
            f"training stopped by {name} after step {global_step}, {where}; continue with: "
            f"meshfit train --resume {run}", self.stop_signal, path)


@contextlib.contextmanager
def stop_on_signals(checkpointer: Checkpointer,
                    signums=(signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """While inside, SIGTERM/SIGINT make `checkpointer` save and stop at the next step boundary.

    A second signal while stopping raises KeyboardInterrupt at once (after finishing the write
    of a checkpoint already begun, which a third signal abandons). Outside the main thread
    (where Python cannot install handlers) this does nothing.
    """
    def handler(signum, frame):
        if checkpointer.stop_signal is not None:
            if checkpointer.saving:  # not inside orbax's own calls: once they have returned
                checkpointer.interrupted = True
                return
            raise KeyboardInterrupt
        checkpointer.request_stop(signum)

    previous = {}
    try:
        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
        checkpointer.wait()
    except KeyboardInterrupt:  # a save being written is finished first (a third signal cuts
        with contextlib.suppress(BaseException):  # it short: the folder stays uncommitted)
            checkpointer.wait()
        if "orbax" in sys.modules:
            sharded_arrays.quiet_after_interrupt()
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            checkpointer.wait()  # commit what was saved before the error
        raise
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
