"""When `meshfit launch --elastic` grows the mesh back: at a new committed checkpoint of the
smaller generation (not the run's last), where the launcher stops it with an agreed save.
"""

from __future__ import annotations

import os
from typing import Callable

from meshfit.errors import MeshfitError
from meshfit.launch import mesh_history
from meshfit.run import rundir


class NextCheckpoint:
    """run_job's boundary for growing the mesh again: true once a checkpoint newer than those
    there are now is committed in `run` (by the smaller generation), unless it is the run's last
    (the run is about to finish: a restart would only cost) or `room()` says there is no room for
    more processes yet (asked once a new checkpoint). `found`: its name."""

    def __init__(self, run: str, room: Callable[[], bool] = lambda: True):
        self.folder = os.path.join(run, rundir.CHECKPOINTS)
        self.run, self.before, self.found = run, set(rundir.list_checkpoints(self.folder)), None
        self.room = room

    def __call__(self) -> bool:
        for path in reversed(rundir.list_checkpoints(self.folder)):
            if path in self.before:  # there before, or asked about already
                continue
            self.before.add(path)
            if not _last_of_run(self.run, path) and self.room():
                self.found = os.path.basename(path)
                return True
        return False


def _last_of_run(run: str, checkpoint: str) -> bool:
    """Whether `checkpoint` holds the run's last step (config.json's epochs x its steps per epoch)."""
    try:
        state = rundir.read_json(os.path.join(checkpoint, rundir.CHECKPOINT_STATE))
        return state["global_step"] >= int(mesh_history.run_config(run)["epochs"]) * state["steps_per_epoch"]
    except (MeshfitError, KeyError, TypeError, ValueError):
        return False


