"""Writing a checkpoint: the training state copied off the devices, written (on JAX in a
background thread), committed by its manifest, the older ones pruned to the newest `keep`.

On JAX a save blocks training only while the arrays are copied off the devices; the files are
written in a background thread, then process 0 writes arrays.npz and state.json (as they were
at the save), then the small manifest atomically (a file write and rename, never a folder rename,
which object-store mounts such as gcsfuse do not do atomically; orbax's own folder is marked
complete by a commit file for the same reason). The next save, a stop and the end of training
wait for it. What a save cut short left (a folder without a manifest) is removed by the
next save; the newest `keep` are kept.
TensorFlow (one CPU device, no shards, no JAX arrays for orbax to write) keeps format 2, written
at the save. The files: meshfit.run.checkpoint_format.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
from typing import Any

import keras
import numpy as np

from meshfit.errors import MeshfitError
from meshfit.fit import saving
from meshfit.parallel import cluster
from meshfit.run import rundir, sharded_arrays, spec
from meshfit.run.checkpoint_format import (EXTRA, FORMAT, MANIFEST, NPZ_FORMAT, STATE_ARRAYS, STATE_JSON,
                                           CheckpointDamaged, checkpoint_name, describe, verify)
from meshfit.run.rundir import list_checkpoints


def variable_groups(model) -> dict[str, list]:
    """The model's variables, its optimizer's and its metrics', in a fixed order."""
    optimizer = getattr(model, "optimizer", None)
    return {"model": list(model.variables),
            "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "metrics": list(model.metrics_variables)}


def sync_variables(model) -> None:
    """On JAX, copy the state that fit keeps outside the model back into its variables."""
    if hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def _host_value(variable) -> np.ndarray:
    """A variable's value as numpy; of a multi-host array whole on this process (see
    `not_whole_here`), made of this process's shards alone: it never waits on another process."""
    value = variable.value
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(keras.ops.convert_to_numpy(value))
    if value.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    if _covered(value) < value.size:
        raise ValueError(f"{variable.path} is sharded across processes: no process holds it whole")
    whole = np.empty(value.shape, value.dtype)
    for shard in value.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
    return whole


def _covered(value) -> int:
    """How many of a JAX array's elements this process's shards hold (each counted once)."""
    slices = {tuple((s.start, s.stop) for s in _full(shard.index, value.shape))
              for shard in value.addressable_shards}
    return sum(int(np.prod([stop - start for start, stop in box])) for box in slices)


def _full(index: tuple, shape: tuple) -> list[slice]:
    return [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)]


def not_whole_here(model) -> str | None:
    """The path of a variable that no single process holds whole (sharded across processes:
    fsdp or model parallelism over several hosts), or None: every process could write the whole
    state from its own devices (data-parallel, replicated), as a local copy needs."""
    for values in variable_groups(model).values():
        for v in values:
            value = v.value
            if not getattr(value, "is_fully_addressable", True) and \
                    not value.is_fully_replicated and _covered(value) < value.size:
                return v.path
    return None


def gather_for_saving(model) -> None:
    """Make every variable sharded across processes whole in host memory on each process, so
    that process 0 alone can write model.keras; every process of the job calls it at the same
    point, after training (the variables then hold numpy arrays: save, do not train further)."""
    if keras.backend.backend() != "jax" or not cluster.multi_process():
        return
    for v in [*model.variables, *variable_groups(model)["optimizer"]]:
        value = saving.whole(v.value)
        if value is not None:
            v._value = value  # not v.assign: that would lay it out over the devices again


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


def sharded_by_default() -> bool:
    """True where checkpoints are written by orbax (format 3): on the JAX engine."""
    return keras.backend.backend() == "jax"


class PendingSave:
    """A checkpoint being written: `result()` waits until it is committed and returns its folder
    (None on processes that do not commit), raising the write's error if it failed. `finish`
    runs in a thread of its own, or in `writer` (a thread kept for the writes, see begin_save)."""

    def __init__(self, path: str, finish=None, writer=None):
        self.path = path
        self._error: BaseException | None = None
        self._thread = None
        if finish is not None and writer is not None:
            self._thread = writer.submit(self._run, finish)
        elif finish is not None:
            self._thread = threading.Thread(target=self._run, args=(finish,), daemon=True,
                                            name="meshfit-checkpoint")
            self._thread.start()

    def _run(self, finish) -> None:
        try:
            finish()
        except BaseException as e:  # handed to the thread that waits
            self._error = e

    def done(self) -> bool:
        if hasattr(self._thread, "done"):  # a writer's future
            return self._thread.done()
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> str:
        if self._thread is not None:
            if hasattr(self._thread, "result"):
                self._thread.result()
            else:
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
               background: bool | None = None, commit: bool = True, writer=None) -> PendingSave:
    """Start writing the full training state after `step` steps of epoch `epoch` (0-based).

    extra: JSON-serializable data stored with it (e.g. seed, history, run settings).
    extra_arrays: numpy arrays stored with the variables (restore returns them as "extra_arrays").
    sharded: write the model's and optimizer's arrays with orbax, each process its own shards
    (format 3; default on JAX), else all in arrays.npz (format 2). With `background` (default:
    when sharded), returns once the arrays are copied off the devices; the files, the manifest
    and the pruning to the newest `keep` follow in a thread (one save at a time: wait for the
    previous one first).
    commit: False on processes other than 0 of a job, which write their shards only (format 3)
    or nothing (format 2). Every process of a job calls this at the same step. writer: a
    concurrent.futures executor of one thread that writes in the background instead of a new
    thread (the local copies': starting a thread, which waits until it runs, blocked training
    50-70 ms a copy on a loaded 2-core VM, BENCHMARKS.md section 6).
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
    sync_variables(model)
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
        return PendingSave(final, finish, writer)
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
        files[name] = describe(os.path.join(final, name))
    if sharded:
        folder = os.path.join(final, sharded_arrays.FOLDER)
        for name in sharded_arrays.files(folder):
            files[f"{sharded_arrays.FOLDER}/{name}"] = describe(os.path.join(folder, name))
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
