"""Checkpoints of the full training state, and exact resume.

A checkpoint is a folder RUN/checkpoints/ckpt-<global step, 8 digits>/ holding
  arrays.npz     every variable as a numpy array: the model's (weights, batch-norm statistics and
                 the SeedGenerator states that drive Dropout, which Keras' own weights files leave
                 out), the optimizer's (step count, moments) and the metrics' running totals;
                 and any extra arrays of the run (a recipe callback's best weights), "extra/KEY";
  state.json     where training stands (epoch, step within it, global step, steps per epoch), the
                 seed (with the epoch and step it fixes the data order and augmentation), the
                 metrics history so far, the run's settings, and each variable's name, shape, dtype;
  manifest.json  the commit: the size and SHA-256 of the two files above.
The two files are written and fsynced first, then the small manifest atomically replaces any
earlier one (a file write and rename, never a folder rename, which object-store mounts such as
gcsfuse do not do atomically). A folder without a manifest is a save cut short: it is ignored and
removed by the next save. A checkpoint whose files do not match its manifest is damaged: `--resume`
falls back to the newest one that is intact, with a warning. The newest `keep` are kept.
Folders written by meshfit 0.1 (state.npz + state.json, committed by renaming the folder, no
manifest) are still read.

`Checkpointer` (a Keras callback) saves every N steps or seconds and at every epoch end, and after
a SIGTERM/SIGINT (see `stop_on_signals`) saves at the next step boundary and stops training by
raising `TrainingInterrupted`. It acts in `on_train_batch_begin`, which Keras calls synchronously
without logs, so training pays no per-step host synchronization on JAX.

In a multi-process job a signal often reaches one process only (a preemption notice, a Ctrl-C on
one host), so the processes vote at every dispatch boundary (`cluster.Vote`, one step behind, so
still without a host sync) and all stop at the same step: process 0 saves, all wait until it has,
and all raise `TrainingInterrupted` with the same exit code.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import time
from typing import Any, Iterator

import keras
import numpy as np

from meshfit.parallel import cluster, heartbeat
from meshfit.run import rundir
from meshfit.errors import MeshfitError
from meshfit.run.rundir import list_checkpoints

FORMAT = 2  # 1: meshfit 0.1, committed by renaming the folder; 2: committed by manifest.json
READABLE_FORMATS = (1, 2)
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


def save(directory: str | os.PathLike, model, *, epoch: int, step: int, steps_per_epoch: int,
         extra: dict[str, Any] | None = None, extra_arrays: dict[str, np.ndarray] | None = None,
         keep: int = 3) -> str:
    """Write the full training state after `step` steps of epoch `epoch` (0-based); return its folder.

    extra: JSON-serializable data stored with it (e.g. seed, history, run settings).
    extra_arrays: numpy arrays stored with the variables (restore returns them as "extra_arrays").
    An intact checkpoint of the same global step that already exists is kept as it is; a damaged
    one is written again.
    """
    directory = os.fspath(directory)
    global_step = epoch * steps_per_epoch + step
    final = os.path.join(directory, checkpoint_name(global_step))
    if rundir.checkpoint_complete(final):
        try:
            verify(final)
            return final
        except CheckpointDamaged:
            pass
    _sync(model)
    arrays, variables = {}, {}
    for group, values in variable_groups(model).items():
        variables[group] = []
        for i, v in enumerate(values):
            value = _host_value(v)
            arrays[f"{group}/{i:05d}"] = value
            variables[group].append([v.path, list(value.shape), str(value.dtype)])
    arrays.update({f"{EXTRA}/{key}": np.asarray(value) for key, value in (extra_arrays or {}).items()})
    state = {"format": FORMAT, "epoch": epoch, "step": step, "global_step": global_step,
             "steps_per_epoch": steps_per_epoch, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
             **(extra or {}), "variables": variables}
    try:
        if os.path.exists(final):  # a save of this step cut short, or a damaged checkpoint
            shutil.rmtree(final)
        os.makedirs(final)
        files = {}
        for name, write in ((STATE_ARRAYS, lambda f: np.savez(f, **arrays)),
                            (STATE_JSON, lambda f: f.write(json.dumps(state).encode()))):
            _write_file(os.path.join(final, name), write)
            files[name] = _describe(os.path.join(final, name))
        manifest = {"format": FORMAT, "global_step": global_step, "files": files}
        tmp = os.path.join(final, f".{MANIFEST}.tmp")
        _write_file(tmp, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        os.replace(tmp, os.path.join(final, MANIFEST))  # the commit
        _fsync_dir(final)
        _fsync_dir(directory)
    except BaseException as e:
        if not rundir.checkpoint_complete(final):
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(e, OSError):
            raise MeshfitError(f"cannot write checkpoint {final} ({e.strerror or e}); the previous "
                               "checkpoints are intact: free space or fix the directory, then "
                               "--resume") from None
        raise
    older = [path for path in list_checkpoints(directory) if path != final]
    for old in older[:max(len(older) - (keep - 1), 0)] if keep > 0 else []:  # never the one just written
        shutil.rmtree(old, ignore_errors=True)
    for name in os.listdir(directory):  # what earlier saves cut short left behind
        path = os.path.join(directory, name)
        cut_short = rundir.CHECKPOINT_NAME.match(name) and not rundir.checkpoint_complete(path)
        if name.startswith(".tmp-") or cut_short:
            shutil.rmtree(path, ignore_errors=True)
    return final


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
        expected = {name: (int(files[name]["bytes"]), str(files[name]["sha256"]))
                    for name in (STATE_ARRAYS, STATE_JSON)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(path, f"unreadable {MANIFEST}: {type(e).__name__}") from None
    for name, (size, sha256) in expected.items():
        file = os.path.join(path, name)
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


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A checkpoint's arrays, keyed 'model/00000', 'optimizer/00000', 'metrics/00000'..."""
    path = os.fspath(path)
    name = STATE_ARRAYS if os.path.exists(os.path.join(path, STATE_ARRAYS)) else LEGACY_ARRAYS
    try:
        with np.load(os.path.join(path, name), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # zipfile, numpy and OS errors of many kinds
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _damaged(path, f"cannot read {name}: {why}") from None


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
    state, arrays = read_state(path), read_arrays(path)
    _check_arrays(path, state, arrays)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    groups = variable_groups(model)
    for group in ("model", "optimizer"):
        _check_fits(path, group, state["variables"][group], groups[group])
    for group in ("model", "optimizer"):
        _assign(groups[group], arrays, group)
    count = len(state["variables"]["metrics"])
    state["metrics_values"] = [arrays[f"metrics/{i:05d}"] for i in range(count)]
    state["extra_arrays"] = {k[len(EXTRA) + 1:]: v for k, v in arrays.items() if k.startswith(EXTRA + "/")}
    return state


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
    write: False on processes other than 0 (they sync state but write nothing).
    In a job of several processes a stop requested on any of them stops all at the same step.
    """

    def __init__(self, directory: str | os.PathLike, steps_per_epoch: int, *,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 epoch_end: bool = True, keep: int = 3, extra=None, extra_arrays=None,
                 resume_state: dict[str, Any] | None = None, write: bool = True):
        super().__init__()
        self.directory = os.fspath(directory)
        self.steps_per_epoch = steps_per_epoch
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.epoch_end, self.keep = epoch_end, keep
        self.extra = extra or (lambda: {})
        self.extra_arrays = extra_arrays or (lambda: {})
        self.write = write
        self.last_saved: str | None = None
        self.stop_signal: int | None = None
        self._resume = resume_state
        self._epoch, self._offset, self._global_step = 0, 0, 0
        self._last_time = time.monotonic()
        self._vote: cluster.Vote | None = None

    def request_stop(self, signum: int) -> None:
        """Ask training to save and stop at the next step boundary (called by signal handlers)."""
        self.stop_signal = signum

    def save(self, epoch: int, step: int) -> str | None:
        """Save now, as the state after `step` steps of epoch `epoch`."""
        _sync(self.model)
        self._last_time = time.monotonic()
        if not self.write:
            return None
        self.last_saved = save(self.directory, self.model, epoch=epoch, step=step,
                               steps_per_epoch=self.steps_per_epoch, extra=self.extra(),
                               extra_arrays=self.extra_arrays(), keep=self.keep)
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
            self._vote = cluster.Vote()

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
            self._stop(self.save(self._epoch, step), self._epoch * self.steps_per_epoch + step)
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
            self._stop(self.last_saved, (epoch + 1) * self.steps_per_epoch)

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

    A second signal while stopping raises KeyboardInterrupt at once. Outside the main thread
    (where Python cannot install handlers) this does nothing.
    """
    def handler(signum, frame):
        if checkpointer.stop_signal is not None:
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
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
