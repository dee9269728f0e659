"""`meshfit launch --elastic`: a training job that outlives a lost process, by restarting it smaller.

    meshfit launch --processes 2 --devices-per-process 4 --elastic -- meshfit train fashion-mnist-cnn

runs the job as `meshfit launch` does (one generation). When a process of it dies (killed by a
signal: SIGKILL, an abort, a crash) or hangs (JAX's heartbeat check names it, or the launcher's
stall watchdog finds it furthest behind, meshfit.commands.launch), the launcher stops the other
processes within its grace period (10 s), and starts a new generation with the survivors' count,
which resumes the run from its newest committed checkpoint (`meshfit train --resume RUN`: exact,
resharded to the devices there are now, meshfit.run.keras_side.checkpoints), with one line naming the
change, and so on until the run finishes (exit 0), fewer than --min-processes would be left, or
--max-restarts restarts were made (then one error line names why and the checkpoint the run
continues from with --resume). A process that exits with an error code of its own (a bad
flag, a bug, a stop on SIGTERM after saving) ends the job as without --elastic: every process
would fail the same way again.

The mesh grows back (unless --no-grow): on one machine the launcher owns every process, so the
slot of a lost one is free again at once. Once the smaller generation committed a checkpoint (the
next boundary; not the run's last), the launcher sends it SIGTERM (its processes agree on a step
and save there, meshfit.run.keras_side.checkpoints, so no step runs again) and starts a generation with all
--processes from that save. Growing is no restart of --max-restarts: each loss counts once.

Why restart instead of shrinking in place: JAX fixes the job's processes and devices when
`jax.distributed.initialize` runs (its coordination service registers every task once, and the
compiled programs' collectives span every device), and offers no way to leave a process out of a
running world: `jax.distributed` can only be shut down and started again, by every process, and
XLA's backends cannot be started twice in one process. So a smaller mesh needs new processes,
and so does a larger one (a new process cannot join a running coordination service either).

What a mesh change costs: the steps since the newest checkpoint, or since the newest local copy
every process of the new generation has where that is newer (`--elastic` makes the run save
every ELASTIC_CHECKPOINT_EVERY and copy its state to each host's local disk every
ELASTIC_LOCAL_COPY_EVERY steps unless the command gives --checkpoint-every or --local-copy-every;
meshfit.run.local_copies: the new processes read the copies the lost generation left), plus the
restart (imports, joining, compiling). Both are in the run's goodput ("lost" seconds and steps,
meshfit.watch.goodput), and every generation (its processes, devices, global batch, first and last
step, why it ended) is in RUN/generations.json, and in metrics.json as "generations"
(meshfit.commands.mesh_history).

Where each generation runs is a runner's business: `Local` runs launch.run_job's processes of
this machine; under SLURM (`--via srun`, in a batch script submitted with --no-kill:
tools/slurm/elastic.sbatch) meshfit.commands.slurm_step.Srun runs each generation as an srun step
of the allocation, reads its tasks' exits from srun's lines, leaves a lost node out of the next
steps (`note_lost`) and grows back only to the tasks the allocation still has (`most`: a failed
node leaves a --no-kill allocation for good). The loop, its decisions and its lines are the same.
Open MPI's mpirun kills every rank when one dies (no survivors; docs/guides/schedulers.md).

The new generation keeps the run's global batch (the data order, hence exact resume, depends on
it). With --keep-batch global (the default) each of the fewer devices takes a larger share of
every batch, and needs that much more activation memory. With --keep-batch per-core each keeps
its per-core batch: the generation runs `meshfit train --micro-batches K` (K = the full mesh's
devices over its own, 8 -> 4: 2; in general the fewest equal slices no larger), which sums each
batch's gradient over K slices of every device's share and steps once
(meshfit.fit.jax_microbatch), so the run stays the same run; back on the full mesh, K is 1 (the
command's own --micro-batches) again. A model that cannot train in slices (batch normalization)
trains whole batches there, with one warning line. The generation's line says which, e.g. 'global
batch kept at 1000 (250 per device)' or 'per-core batch kept at 125 (global batch 1000 in 2
micro-batches)', and RUN/generations.json has each one's "micro_batches". It has as many of the
survivors as split that batch evenly (`meshfit train` refuses a batch that does not: 1000 over
3 x 2 devices): the other slots stay free until the mesh grows back. Processes SIGKILLed together (2
of 4) are all left out; a hung one that the stall watchdog names is named by the elastic line
alone (the launcher's own error line is printed only when the job stops).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Sequence

from meshfit.commands import launch, launch_watch, mesh_history, slurm_step
from meshfit.errors import MeshfitError
from meshfit.parallel import stall
from meshfit.run import rundir

# A lost process costs the steps since the last checkpoint: the run saves this often unless the
# command says otherwise. A save blocks training only while the arrays are copied off the devices
# and orbax starts the write (the files are written in a background thread,
# meshfit.run.keras_side.checkpoints): 0.2-0.3 s a save in a 2-process job of the Fashion-MNIST
# CNN on a loaded 2-core VM, 2-3% of the wall time at 5 s (BENCHMARKS.md section 6), so 10 s.
ELASTIC_CHECKPOINT_EVERY = "10s"
# ... and keeps a copy of the state on each host's local disk every this many steps (at most one a
# dispatch) unless the command gives --local-copy-every: a lost process then costs the steps
# since the newest copy (meshfit.run.local_copies). A copy of the Fashion-MNIST CNN's state (1.25
# MiB) blocks training 1.1-3.5 ms (median 1.4; the run's first 85 ms, starting its writing
# thread), its write in the background about 66 ms, against 1.0-2.0 s steps of the 2 x 4-device
# job on a loaded 2-core VM: 0.1-0.3% at every step, goodput `checkpoint` 2.1% of the wall time
# against 2.0% without copies (BENCHMARKS.md section 6). A larger state or shorter steps (an
# accelerator) cost more: give a larger N there.
ELASTIC_LOCAL_COPY_EVERY = "1"
MAX_RESTARTS = 3
KEEP_BATCH = ("global", "per-core")  # --keep-batch: what a generation on fewer devices keeps


def elastic_launch(command: Sequence[str], processes: int | None, devices_per_process: int | None = None,
                   *, min_processes: int = 1, max_restarts: int = MAX_RESTARTS, grow: bool = True,
                   show: str = "all", timeout: float | None = None,
                   grace: float = launch_watch.GRACE_SECONDS, keep_batch: str = "global",
                   via: str = "local") -> int:
    """Run `command` (a `meshfit train`) as a job of `processes` processes that restarts with the
    survivors after losing some, and grows back to `processes` at the smaller generation's next
    checkpoint unless not `grow` (see the module); return the launch's exit code. On fewer
    devices, keep_batch 'global' gives each a larger share of the batch, 'per-core' keeps each
    one's share with micro-batches. via: "local" (processes of this machine,
    `devices_per_process` simulated CPU devices each, default 1) or "srun" (steps of the SLURM
    allocation this runs in, meshfit.commands.slurm_step: processes default to its tasks;
    devices_per_process, each task's devices for the records and the batch split, defaults to
    the command's --simulate-devices, else 1)."""
    argv, run = train_command(launch.command_line(command))
    runner = runner_for(via, run)
    if via == "srun":
        processes = processes or runner.tasks
        if processes > runner.tasks:
            raise MeshfitError(f"--processes {processes} is more than the allocation's {runner.tasks} "
                               "tasks (SLURM_NTASKS); give at most that, or leave it out")
        devices_per_process = devices_per_process or int(_flag_value(argv, "--simulate-devices") or 1)
    devices_per_process = devices_per_process or 1
    launch.check_arguments(processes, devices_per_process, timeout, show)
    if keep_batch not in KEEP_BATCH:
        raise MeshfitError(f"--keep-batch must be one of {', '.join(KEEP_BATCH)}, got {keep_batch!r}")
    if not 1 <= min_processes <= processes:
        raise MeshfitError(f"--min-processes must be between 1 and --processes ({processes}), "
                           f"got {min_processes}")
    if max_restarts < 0:
        raise MeshfitError(f"--max-restarts must be at least 0, got {max_restarts}")
    full = processes * devices_per_process
    per_core = keep_batch == "per-core"
    deadline = None if timeout is None else time.monotonic() + timeout
    generations = mesh_history.earlier(run)  # a resumed run's history goes on
    count, restarts = processes, 0
    while True:
        resumed_before = len(mesh_history.run_config(run).get("resumed", []))
        resume = ["--resume", run] if os.path.isfile(os.path.join(run, rundir.CONFIG)) else []
        left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
        boundary = (NextCheckpoint(run, lambda: runner.most(processes) > count)
                    if grow and count < processes else None)
        slices = micro_batches_for(run, count * devices_per_process, full, argv) if per_core else None
        ended = runner(with_micro_batches(argv, slices) + resume, count, devices_per_process, show,
                       left, grace, boundary)
        record = mesh_history.record(len(generations) + 1, count, devices_per_process, run,
                                     resumed_before, ended)
        if per_core:  # the first generation's count is known once it wrote config.json
            record["micro_batches"] = slices or micro_batches_for(run, count * devices_per_process,
                                                                  full, argv)
        if generations:
            mesh_history.continued(generations[-1], record)
        generations.append(record)
        if ended.at_boundary:
            grown = fitting_processes(run, runner.most(processes), devices_per_process)
            record["ended"] = f"stopped after {boundary.found} to grow back to {grown} process(es)"
            mesh_history.write(run, generations)
            launch.finish(ended.started)
            print(f"meshfit launch: elastic: {boundary.found} committed on {count} process(es); "
                  f"generation {len(generations) + 1}: {grown} process(es) x "
                  f"{devices_per_process} device(s) again (was {count} x {devices_per_process}), "
                  f"{batch_line(run, grown * devices_per_process, full if per_core else None, argv)}, "
                  f"resuming {run} from its stop", file=sys.stderr, flush=True)
            count = grown
            continue
        restart, lost = lost_processes(ended, count)
        runner.note_lost(ended, lost)
        if ended.verdict is None and ended.failure is None:
            record["ended"] = "finished"
            mesh_history.write(run, generations, finished=True)
            if len(generations) > 1:
                print(f"meshfit launch: elastic run finished after {len(generations)} generations "
                      f"({' -> '.join(mesh_history.mesh_name(g) for g in generations)} devices), "
                      f"{sum(g.get('lost_steps', 0) for g in generations)} steps run again",
                      file=sys.stderr, flush=True)
            return 0
        why = what_ended(ended, lost)
        record["ended"], record["lost_processes"] = why, lost
        mesh_history.write(run, generations)
        survivors = fitting_processes(run, min(count - len(lost), runner.most(processes)),
                                      devices_per_process)
        stop = None
        if not restart:
            stop = "not a lost process"
        elif survivors < min_processes:
            stop = f"{survivors} process(es) left, fewer than --min-processes {min_processes}"
            if survivors < count - len(lost):
                stop += " (the global batch splits evenly over no more)"
        elif restarts >= max_restarts:
            stop = f"--max-restarts {max_restarts} reached"
        if stop is not None:
            if not restart:
                return ended.report(show) or 1
            return _stopped(ended, show, len(generations), why, stop, run)
        restarts += 1
        launch.finish(ended.started)
        idle = (f"; {count - len(lost) - survivors} survivor(s) idle: the global batch splits "
                "evenly over no more devices" if survivors < count - len(lost) else "")
        print(f"meshfit launch: elastic: {why}; generation {len(generations) + 1}: "
              f"{survivors} process(es) x {devices_per_process} device(s) (was {count} x "
              f"{devices_per_process}{idle}), "
              f"{batch_line(run, survivors * devices_per_process, full if per_core else None, argv)}, "
              f"resuming {run} from its newest checkpoint", file=sys.stderr, flush=True)
        count = survivors


def _stopped(ended: launch.Ended, show: str, generation: int, why: str, stop: str, run: str) -> int:
    """Print the one error line of a job that lost a process it may not restart without (the
    failed process's last lines first, as launch does); return the launch's exit code."""
    launch.finish(ended.started)
    if ended.verdict is not None:  # its line is not printed: this one names it (`why`)
        code = ended.verdict
    else:
        index, code = ended.failure
        if show == "first" and index != 0:
            for line in list(ended.started[index].tail)[-launch.TAIL_LINES:]:
                print(f"[{index}] {line}", file=sys.stderr)
        code = code if code > 0 else 128 - code
    newest = rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))
    since = os.path.basename(newest[-1]) if newest else "its start (no checkpoint yet)"
    print(f"meshfit: error: elastic launch stopped after generation {generation} ({why}): {stop}; "
          f"continue from {since} with --resume {run}", file=sys.stderr, flush=True)
    return code


class Local:
    """The runner of generations of processes of this machine (launch.run_job): every slot of a
    lost one is free again at once."""

    def most(self, processes: int) -> int:
        """The processes a generation can have now."""
        return processes

    def note_lost(self, ended: launch.Ended, lost: list[int]) -> None:
        """What the runner keeps of a generation's `lost` processes (here: nothing)."""

    def __call__(self, argv: list[str], count: int, devices_per_process: int, show: str,
                 timeout: float | None, grace: float, boundary) -> launch.Ended:
        """Run one generation of `count` processes; how it ended."""
        return launch.run_job(argv, count, devices_per_process, None, show, timeout, grace, boundary)


def runner_for(via: str, run: str):
    """The runner of each generation: `Local`, or meshfit.commands.slurm_step.Srun for "srun"."""
    if via == "local":
        return Local()
    if via == "srun":
        return slurm_step.Srun(run)
    raise MeshfitError(f"unknown --via {via!r}; use local or srun")


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


def train_command(argv: list[str]) -> tuple[list[str], str]:
    """(the command every generation runs, its run directory): `meshfit train` with --out (added
    when missing: a new runs/elastic-<time>), --checkpoint-every (ELASTIC_CHECKPOINT_EVERY when
    missing) and --local-copy-every (ELASTIC_LOCAL_COPY_EVERY when missing); a resumed run's own
    directory when the command has --resume."""
    if argv[1:3] != ["-m", "meshfit"] or len(argv) < 4 or argv[3] != "train":
        raise MeshfitError("--elastic restarts a `meshfit train` run from its checkpoints; give "
                           "one after --, e.g. meshfit launch --elastic --processes 2 -- meshfit "
                           "train fashion-mnist-cnn")
    argv = list(argv)
    run = _flag_value(argv, "--resume") or _flag_value(argv, "--out")
    if run is None:
        run = rundir.timestamped("elastic")
        argv += ["--out", run]
    if _flag_value(argv, "--resume"):
        argv = _without_flag(argv, "--resume")  # each generation adds it itself
    if _flag_value(argv, "--checkpoint-every") is None:
        argv += ["--checkpoint-every", ELASTIC_CHECKPOINT_EVERY]
    if _flag_value(argv, "--local-copy-every") is None:
        argv += ["--local-copy-every", ELASTIC_LOCAL_COPY_EVERY]
    return argv, run


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def lost_processes(ended: launch.Ended, count: int) -> tuple[bool, list[int]]:
    """(whether a restart can outlive this end, the processes lost) of a generation that did not
    finish: a process killed by a signal (or the ones JAX names as silent: stopped, frozen), a
    hung one (the launcher's watchdog or the process's own stall guard: the ones furthest
    behind), ones that never joined. Lost processes are left out of the next generation; where
    they cannot be told apart from the others (all equally behind), the next one has as many."""
    if ended.timed_out:  # --timeout: the user's limit, no fault
        return False, []
    if ended.verdict is not None:  # the launcher's watchdog: hung, or never joined
        lost = ended.missing or ended.behind
        return True, lost if len(lost) < count else []
    if ended.failure is None:
        return False, []
    index, code = ended.failure
    killed = _killed_too(ended, index)
    if code > 0 and code != stall.EXIT_CODE and killed:  # its error came first: a collective
        return True, killed  # failed because a peer was killed ("Connection reset by peer")
    if code >= 0 and code != stall.EXIT_CODE:  # an error of its own, or a stop after saving
        return False, []
    silent = [i for i in launch_watch.silent_processes(ended.started[index].tail) if i < count]
    if silent:
        return True, silent
    if code == stall.EXIT_CODE:  # its own guard: it waited for a peer that hung
        return True, ended.behind if 0 < len(ended.behind) < count else []
    return True, sorted({index, *_killed_too(ended, index)})


def _killed_too(ended: launch.Ended, index: int) -> list[int]:
    """The processes other than `index` that were SIGKILLed, but not by the launcher (two of a
    job killed at once: both are lost; the launcher's SIGTERM may reach a process that is already
    being killed). Only SIGKILL: the survivors of a lost peer may end by themselves too, with an
    abort (JAX's heartbeat check) or an error, and are no loss."""
    return [i for i, code in ended.codes.items() if i != index and code == -signal.SIGKILL
            and not getattr(ended.started[i], "killed", True)]


def what_ended(ended: launch.Ended, lost: list[int]) -> str:
    """One phrase on why a generation ended, e.g. 'process 1 of 2 failed with SIGKILL (exit code -9)'."""
    count = len(ended.started)
    if ended.verdict is not None:  # the watchdog's own words, the only line naming it
        if ended.verdict_text:
            return ended.verdict_text
        how = "never joined" if ended.missing else "hung"
        who = ", ".join(map(str, lost)) or "?"
        return f"process(es) {who} of {count} {how}"
    index, code = ended.failure
    text = f"process {index} of {count} failed with {launch.describe_exit(code)}"
    also = ", ".join(map(str, _killed_too(ended, index)))
    if also:
        text += (f", and so did process(es) {also}" if code == -signal.SIGKILL else
                 f", process(es) {also} SIGKILLed")
    silent = launch_watch.silent_processes(ended.started[index].tail)
    if silent:
        text += f" because process(es) {', '.join(map(str, silent))} stopped sending heartbeats"
    return text


def fitting_processes(run: str, survivors: int, devices_per_process: int) -> int:
    """The most processes, at most `survivors`, whose devices split the run's global batch evenly
    (config.json): the batch is kept (exact resume depends on it) and `meshfit train` refuses a
    batch that does not split, e.g. 1000 over 3 x 2 devices (then 2 x 2). `survivors` when the
    batch is unknown or none fits (train's own error then says why)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not isinstance(batch, int) or batch < 1:
        return survivors
    fits = [n for n in range(survivors, 0, -1) if batch % (n * devices_per_process) == 0]
    return fits[0] if fits else survivors


def batch_line(run: str, devices: int, full_devices: int | None = None, argv: Sequence[str] = ()) -> str:
    """The batch of a generation on `devices`, e.g. 'global batch kept at 1000 (250 per device)';
    with `full_devices` (--keep-batch per-core), e.g. 'per-core batch kept at 125 (global batch
    1000 in 2 micro-batches)'. The run's global batch from config.json; argv: the command (its
    own --micro-batches)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not batch:
        return "global batch kept" if full_devices is None else "per-core batch kept"
    if full_devices is not None:
        slices = micro_batches_for(run, devices, full_devices, argv)
        if slices is not None:
            share, kept = batch // (devices * slices), per_core_batch(batch, full_devices, argv)
            text = (f"per-core batch kept at {share}" if share == kept else
                    f"per-core batch {share}, below the {kept} kept")
            return text + (f" (global batch {batch} in {slices} micro-batches)" if slices > 1
                           else f" (global batch {batch})")
    share = f"{batch // devices} per device" if batch % devices == 0 else f"{batch / devices:g} per device"
    return f"global batch kept at {batch} ({share})"


def per_core_batch(batch: int, full_devices: int, argv: Sequence[str] = ()) -> int:
    """Rows each device trains at a time on the full mesh: the global batch over its devices and
    the command's own --micro-batches."""
    asked = _flag_value(list(argv), "--micro-batches")
    return max(batch // (full_devices * (int(asked) if asked and asked.isdigit() else 1)), 1)


def micro_batches_for(run: str, devices: int, full_devices: int, argv: Sequence[str] = ()) -> int | None:
    """Micro-batches per batch that keep each of `devices` at most at the full mesh's per-core
    batch (per_core_batch): the fewest whose per-device slices of the run's global batch
    (config.json) are equal, e.g. 1000 on 8 -> 4 devices: 2 (125 rows per device at a time).
    None while the batch is unknown (before the first generation wrote config.json) or does not
    split over the devices (train's own error then says why)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not isinstance(batch, int) or batch < 1 or batch % devices:
        return None
    kept = per_core_batch(batch, full_devices, argv)
    return next(k for k in range(1, batch // devices + 1)
                if batch % (devices * k) == 0 and batch // (devices * k) <= kept)


def with_micro_batches(argv: list[str], slices: int | None) -> list[str]:
    """The command with --micro-batches `slices` (argv as it is for None, or when it asks for as
    many: a full mesh keeps the command's own)."""
    asked = _flag_value(argv, "--micro-batches")
    if slices is None or str(slices) == (asked or "1"):
        return argv
    return _without_flag(argv, "--micro-batches") + ["--micro-batches", str(slices)]


