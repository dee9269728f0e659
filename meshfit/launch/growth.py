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
    (the run is about to finish: a restart would only cost), `room()` says there is no room for
    more processes yet, or `pays(seconds a step now, steps left)` says the growth would not repay
    its cost (asked once a new checkpoint). `found`: its name."""

    def __init__(self, run: str, room: Callable[[], bool] = lambda: True,
                 pays: Callable[[float | None, int | None], bool] = lambda step, left: True):
        self.folder = os.path.join(run, rundir.CHECKPOINTS)
        self.run, self.before, self.found = run, set(rundir.list_checkpoints(self.folder)), None
        self.room, self.pays = room, pays

    def __call__(self, step_seconds: float | None = None) -> bool:
        for path in reversed(rundir.list_checkpoints(self.folder)):
            if path in self.before:  # there before, or asked about already
                continue
            self.before.add(path)
            left = steps_left(self.run, path)
            if left != 0 and self.room() and self.pays(step_seconds, left):
                self.found = os.path.basename(path)
                return True
        return False


def steps_left(run: str, checkpoint: str) -> int | None:
    """The steps of the run after `checkpoint` (config.json's epochs x its steps per epoch, less
    its global step); None when not known."""
    try:
        state = rundir.read_json(os.path.join(checkpoint, rundir.CHECKPOINT_STATE))
        total = int(mesh_history.run_config(run)["epochs"]) * state["steps_per_epoch"]
        return max(total - state["global_step"], 0)
    except (MeshfitError, KeyError, TypeError, ValueError):
        return None


def pays(left: int | None, step_now: float | None, step_full: float | None, cost: float | None) -> bool:
    """Whether growing back repays its cost: the `left` steps at the full mesh's seconds a step
    instead of the smaller one's (`step_now`) save more than a mesh change costs (`cost`
    seconds: the changes measured so far). True while a figure is not known yet (the full mesh
    is the run's own: grow)."""
    if left is None or step_now is None or step_full is None or cost is None:
        return True
    return left * (step_now - step_full) > cost
