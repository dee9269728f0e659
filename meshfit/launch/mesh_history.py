"""A run's history of meshes under `meshfit launch --elastic`: RUN/generations.json, one record
per generation (its processes, devices, global batch, the first global step, from the checkpoint
it resumed, the steps it ran again there, and about the last it started, its seconds: in all, to
its first step, stopping, a step; why it ended, the steps the next one ran again, and the mesh
change that began it, its seconds in parts), and metrics.json's "generations" once the run finished."""

from __future__ import annotations

import json
import os
from typing import Any

from meshfit.launch import local
from meshfit.errors import MeshfitError
from meshfit.run import rundir

GENERATIONS = "generations.json"  # in the run directory


def record(number: int, processes: int, devices_per_process: int, run: str, resumed_before: int,
           ended: local.Ended) -> dict[str, Any]:
    """What RUN/generations.json keeps of one generation: its mesh, global batch, the global step
    it started from (its checkpoint's) and about the last it started (its progress reports are
    written once a second), and its wall seconds."""
    config = run_config(run)
    resumed = config.get("resumed", [])
    first_step, restore = 0, None
    ran_again = 0  # one that never restored ran nothing again: the next resume counts those steps
    if len(resumed) > resumed_before:  # this generation's resumption, config.json's record of it
        first_step = checkpoint_step(resumed[resumed_before].get("checkpoint", ""))
        restore = resumed[resumed_before].get("restore_seconds")
        ran_again = resumed[resumed_before].get("steps_run_again")  # None: written by an older meshfit
    elif number > 1 or resumed_before:  # it ended before restoring (killed while joining): it
        # started nothing new, from the checkpoint it would have resumed (not step 0, which
        # would count every step of the generation before as run again)
        newest = rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))
        first_step = checkpoint_step(os.path.basename(newest[-1])) if newest else 0
    started = max(ended.steps.values(), default=0)
    start = ended.start_seconds
    training = None if start is None else ended.seconds - start - ended.stop_seconds
    return {"generation": number, "processes": processes, "devices_per_process": devices_per_process,
            "devices": processes * devices_per_process, "global_batch": config.get("global_batch"),
            "first_step": first_step, "last_step": first_step + started, "ran_again": ran_again,
            "seconds": round(ended.seconds, 1), "ended": None,
            "start_seconds": None if start is None else round(start, 1), "restore_seconds": restore,
            "stop_seconds": round(ended.stop_seconds, 1),
            "step_seconds": round(training / started, 4) if training and started > 1 else None}


def continued(last: dict[str, Any], record: dict[str, Any]) -> None:
    """Generation `last` ran at least to the step the next one (`record`) resumed from: its
    progress reports lag (once a second), a local copy of the state may be newer. Its last step,
    and the steps the next one runs again: the count the next one's goodput ledger made as it
    resumed (`ran_again`, config.json's "resumed" record), so that the launcher's "N steps run
    again" and metrics.json's goodput "lost_steps" are one count; from the progress reports only
    where a run directory written by an older meshfit lacks it."""
    last["last_step"] = max(last["last_step"], record["first_step"])
    again = record.get("ran_again")
    last["lost_steps"] = last["last_step"] - record["first_step"] if again is None else again
    record["change"] = change(last, record)


def change(last: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The mesh change from generation `last` to `record`, its seconds in parts, named as
    ml-goodput-measurement names them: stop (from the launcher noticing the end to the last
    process's exit), restart (the new processes' start, or a spare's handing over, to their
    first training step), of which restore (process 0 loading the checkpoint or local copy it
    resumed from: config.json's "resumed" record) and reinitialisation (the rest: start-up,
    joining, data, model, the first step's compile), wasted (the steps run again, at `last`'s
    seconds a step). kind: scale down, scale up, or restart (as many processes again). A part
    not measured (a generation that never trained) is None."""
    before, after = last.get("processes", 0), record.get("processes", 0)
    kind = "scale down" if after < before else "scale up" if after > before else "restart"
    step, restart, restore = last.get("step_seconds"), record.get("start_seconds"), record.get("restore_seconds")
    return {"kind": kind, "stop": last.get("stop_seconds"), "restart": restart, "restore": restore,
            "reinitialisation": None if restart is None or restore is None else round(max(restart - restore, 0.0), 1),
            "wasted": None if step is None else round(last["lost_steps"] * step, 1)}


def checkpoint_step(name: str) -> int:
    """The global step in a checkpoint's name (ckpt-00000012, local:ckpt-00000012), 0 for none."""
    digits = name.rpartition("-")[2]
    return int(digits) if digits.isdigit() else 0  # "none": a run resumed before its first save


def run_config(run: str) -> dict[str, Any]:
    """The run's config.json, {} while there is none."""
    try:
        with open(os.path.join(run, rundir.CONFIG)) as f:
            config = json.load(f)
        return config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        return {}


def mesh_name(generation: dict[str, Any]) -> str:
    """'2x4': processes x devices per process."""
    return f"{generation['processes']}x{generation['devices_per_process']}"


def earlier(run: str) -> list[dict[str, Any]]:
    """RUN/generations.json of a run resumed with --resume (an earlier elastic launch), else []."""
    try:
        found = rundir.read_json(os.path.join(run, GENERATIONS))
    except MeshfitError:
        return []
    return found if isinstance(found, list) and os.path.isfile(os.path.join(run, rundir.CONFIG)) else []


def write(run: str, generations: list[dict[str, Any]], finished: bool = False) -> None:
    """RUN/generations.json; once the run finished, also metrics.json's "generations" (process 0
    of the last generation wrote metrics.json)."""
    if not os.path.isdir(run):
        return
    rundir.write_json(os.path.join(run, GENERATIONS), generations)
    metrics_path = os.path.join(run, rundir.METRICS)
    if finished and os.path.isfile(metrics_path):
        metrics = rundir.read_json(metrics_path)
        metrics["generations"] = generations
        rundir.write_json(metrics_path, metrics)
