"""Local copies: the training state kept on each host's local disk every N global steps, so that
a job that loses a process (`meshfit launch --elastic`) resumes from the newest copy rather than
from the newest committed checkpoint, and runs again only the steps since that copy.

A copy is an unsharded checkpoint (format 2: arrays.npz, state.json, manifest.json committed by
an atomic rename; meshfit.run.checkpoint_format) written by the Checkpointer
(meshfit.run.keras_side.checkpoints) in a background thread into a host-local folder, never the
run directory (which may be shared storage):

    $MESHFIT_LOCAL_COPIES (default $TMPDIR/meshfit-local-copies)/<run name>-<hash of its path>/ckpt-<step>

Every process takes the copy at the same global steps by its own count (no vote, no exchange);
only one process of each host writes it (the one holding the folder's lock: all processes of a
`meshfit launch` share this machine's disk), from its own devices' shards alone, so it never
waits on another process. That needs the state whole on every process (data-parallel: every
variable replicated, meshfit's layout for small models); where a variable is sharded across
processes, no copy is taken and the committed checkpoints remain.

`--resume` takes the newest copy that every process of the new job can read and that is newer
than the run's newest committed checkpoint (`agreed_step`: each process reports the copies its
host has, all take the newest all have); config.json's "resumed" record names it
"local:ckpt-<step>". The copies are removed when the run finishes. This module is light: no
Keras, no JAX.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from meshfit import env
from meshfit.run import checkpoint_format, rundir

KEEP = 2  # copies kept per host: the newest may be cut short by a kill, the one before is whole
PREFIX = "local:"  # config.json names a resumption from a copy "local:ckpt-<step>"
LOCK = ".writer"


def folder_of(run: str) -> str:
    """The host-local folder of `run`'s copies, keyed by its absolute path."""
    base = os.environ.get(env.LOCAL_COPIES) or os.path.join(tempfile.gettempdir(),
                                                             "meshfit-local-copies")
    path = os.path.realpath(run)
    key = hashlib.sha256(path.encode()).hexdigest()[:12]
    return os.path.join(base, f"{os.path.basename(path)}-{key}")


def step_of(path: str) -> int:
    """The global step of a checkpoint folder (ckpt-<step>)."""
    return int(os.path.basename(path).rpartition("-")[2])


class Host:
    """This host's copies of a run. writer: whether this process writes them (it holds the
    folder's lock, taken with `take`: one process per host)."""

    def __init__(self, run: str):
        self.folder = folder_of(run)
        self.writer = False
        self._lock = None

    def take(self) -> bool:
        """Become this host's writer unless another process here already is; return writer."""
        import fcntl

        try:
            os.makedirs(self.folder, exist_ok=True)
            handle = open(os.path.join(self.folder, LOCK), "a")
        except OSError:  # no local disk to write: no copies, the committed checkpoints remain
            return False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._lock, self.writer = handle, True
        return True

    def steps(self) -> list[int]:
        """The global steps of the intact copies here, oldest first."""
        found = []
        for path in rundir.list_checkpoints(self.folder):
            try:
                checkpoint_format.verify(path)
            except checkpoint_format.CheckpointDamaged:
                continue
            found.append(step_of(path))
        return found

    def path(self, step: int) -> str:
        return os.path.join(self.folder, checkpoint_format.checkpoint_name(step))

    def drop_newer(self, step: int) -> None:
        """Remove the copies after `step` (the run resumed from it: they are of steps it will run
        again, and a copy of the same step is kept as it is by the next save). Writer only."""
        if self.writer:
            for path in rundir.list_checkpoints(self.folder):
                if step_of(path) > step:
                    shutil.rmtree(path, ignore_errors=True)

    def remove(self) -> None:
        """Remove the run's copies (it finished). Writer only."""
        if self.writer:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock, self.writer = None, False


def agreed_step(reports: list[list[int]], committed: int) -> int | None:
    """The step to resume from a local copy: the newest one that every process reported (each
    report: the steps of its host's intact copies) and newer than the newest committed
    checkpoint (its global step, -1 without one); None: resume from the committed checkpoint."""
    if not reports:
        return None
    common = set(reports[0]).intersection(*map(set, reports[1:]))
    newer = [step for step in common if step >= 0 and step > committed]
    return max(newer) if newer else None
