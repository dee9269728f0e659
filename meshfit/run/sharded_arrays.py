"""The device arrays of a checkpoint, written and read with orbax-checkpoint.

Each process writes only the shards it holds (one replica of a replicated array), into
CHECKPOINT/arrays/ (OCDBT: one `ocdbt.process_N/` folder per process). `write` returns once the
arrays are copied off the devices; the files are written in orbax's background threads. orbax
marks its folder complete with a commit file, never a folder rename (object-store mounts do not
rename folders atomically); meshfit's own commit is the checkpoint's manifest.json, written after
`PendingWrite.wait` (see meshfit.run.keras_side.checkpoint_save). `read` lays every array out as
its target says: the shardings of the variables of the model built on the devices there are
now, whatever device count wrote it; or numpy arrays (gathered).

orbax (and with it JAX) is imported on first use, not with this module.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

FOLDER = "arrays"  # inside the checkpoint folder

Tree = dict[str, dict[str, Any]]  # {"model": {"00000": array, ...}, "optimizer": {...}}


def _orbax():
    # orbax imports JAX: on first use, so that a TensorFlow run and meshfit's start-up skip it.
    import orbax.checkpoint as ocp
    from orbax.checkpoint.path import atomicity

    return ocp, atomicity


class PendingWrite:
    """A write started by `write`: `wait()` blocks until every process's shards are on disk."""

    def __init__(self, checkpointer):
        self._checkpointer = checkpointer

    def wait(self) -> None:
        """Block until the write is complete on every process; raise its error, if any."""
        try:
            if hasattr(self._checkpointer, "wait_until_finished"):  # an AsyncCheckpointer
                self._checkpointer.wait_until_finished()
        finally:
            self._checkpointer.close()


def write(path: str | os.PathLike, arrays: Tree, *, background: bool = True) -> PendingWrite:
    """Start writing `arrays` (jax.Arrays or numpy) into the new folder `path`; every process of
    a job calls it with its own arrays. Returns after the device-to-host copy when `background`,
    else once written."""
    ocp, atomicity = _orbax()
    kind = ocp.AsyncCheckpointer if background else ocp.Checkpointer
    # A commit file marks the folder complete, not a rename: gcsfuse-like mounts cannot rename
    # a folder atomically.
    checkpointer = kind(ocp.StandardCheckpointHandler(),
                        temporary_path_class=atomicity.CommitFileTemporaryPath)
    try:
        checkpointer.save(os.path.abspath(os.fspath(path)), args=ocp.args.StandardSave(arrays))
    except BaseException:  # e.g. Ctrl-C: let orbax's threads end before the interpreter does
        with contextlib.suppress(BaseException):
            PendingWrite(checkpointer).wait()
        raise
    return PendingWrite(checkpointer)


def quiet_after_interrupt() -> None:
    """From now on, drop orbax's log records: after a Ctrl-C its threads may fail on the
    interpreter's way out, which is expected (that checkpoint stays uncommitted, and ignored)."""
    import logging

    logging.getLogger("absl").addFilter(lambda record: "orbax" not in record.pathname)


def target_of(shape: tuple[int, ...], dtype: str, placement=None) -> Any:
    """What `read` should make of a saved array: a jax.Array of this shape, dtype and placement
    (the jax.sharding.Sharding of the variable it goes into), or without one a numpy array on
    this host."""
    if placement is not None:
        import jax

        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=placement)
    return np.zeros(tuple(shape), dtype)


def read(path: str | os.PathLike, targets: Tree) -> Tree:
    """The arrays saved in `path`, laid out as `targets` (see `target_of`; numpy zeros give
    numpy arrays gathered on this host). Raises what orbax raises on missing or damaged files."""
    ocp, _ = _orbax()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        return checkpointer.restore(os.path.abspath(os.fspath(path)),
                                    args=ocp.args.StandardRestore(targets))


def files(path: str | os.PathLike) -> list[str]:
    """Every file below `path`, relative to it ('/'-separated), sorted."""
    path = os.fspath(path)
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            found.append(os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/"))
    return sorted(found)
