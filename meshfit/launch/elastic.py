"""`meshfit launch --elastic`: a training job that outlives a lost process, by restarting it smaller.

    meshfit launch --processes 2 --devices-per-process 4 --elastic -- meshfit train fashion-mnist-cnn

runs the job as `meshfit launch` does (one generation). When a process of it dies (killed by a
signal: SIGKILL, an abort, a crash) or hangs (JAX's heartbeat check names it, or the launcher's
stall watchdog finds it furthest behind, meshfit.launch.local), the launcher stops the other
processes within its grace period (10 s) (kills them at once where the lost one was killed by a
signal or frozen, seen in /proc, and every step is copied locally, the default below: there is
nothing newer to save), and starts a new generation with the survivors' count,
which resumes the run from its newest committed checkpoint (`meshfit train --resume RUN`: exact,
resharded to the devices there are now, meshfit.run.keras_side.checkpoints), with one line naming the
change, and so on until the run finishes (exit 0), fewer than --min-processes would be left, or
more than --max-restarts-without-progress restarts came in a row without progress (no newer
checkpoint or local copy to resume from than at the loss before; a process stopped by SIGSTOP from
outside is not counted, as it cannot repeat by itself: a job on machines that lose a
process every 30 s goes on as long as it saves between losses; then one error line names why
and the checkpoint the run continues from with --resume). A process that exits with an error code of its own (a bad
flag, a bug, a stop on SIGTERM after saving) ends the job as without --elastic: every process
would fail the same way again.

A lost process starts again at once in its slot (--on-loss restart, the default) where the
runner has that slot (Local: always; Srun: while its node is in the allocation): the next
generation has the same mesh, one change a fault instead of a shrink and a growth, and JAX's
persistent compilation cache has its programs. A slot lost again before a step of such a
restart is left out (the fault would likely strike again), as every lost one is with --on-loss
shrink, until the mesh grows back:

The mesh grows back (unless --no-grow): on one machine the launcher owns every process, so the
slot of a lost one is free again at once. Once the smaller generation committed a checkpoint (the
next boundary; not the run's last), the launcher sends it SIGTERM (its processes agree on a step
and save there, meshfit.run.keras_side.checkpoints, so no step runs again) and starts a generation with all
--processes from that save; its line names that save, the checkpoint the next generation
resumes from. It grows back only when that pays (growth.pays): when the steps left, at the full
mesh's seconds a step instead of the smaller one's, save more than a mesh change costs (the
median of the changes so far: stopping, then the new processes' start to their first step);
else one line says so, and each later checkpoint asks again. A generation that lost every
process starts as many again (their slots are free again at once). Growing is no restart: only losses count toward --max-restarts-without-progress.

Why restart instead of shrinking in place: JAX fixes the job's processes and devices when
`jax.distributed.initialize` runs (its coordination service registers every task once, and the
compiled programs' collectives span every device), and offers no way to leave a process out of a
running world: `jax.distributed` can only be shut down and started again, by every process, and
XLA's backends cannot be started twice in one process. So a smaller mesh needs new processes,
and so does a larger one (a new process cannot join a running coordination service either).

Why not JAX's own fault tolerance: JAX 0.10.2 has `jax_enable_recoverability` and
`jax.experimental.multihost_utils.live_devices` (documented "under active development and not
stable") to let survivors go on with the live devices. The survivors would then have to rebuild
Keras' distribution (its mesh and the variables' layouts are fixed when the model is built),
place the state on fewer devices and compile again, and the CPU backend's gloo collectives
would have to fail cleanly, not hang, when a peer dies; none of it is tried here, so meshfit
restarts processes on every platform, and makes the restart cheap instead (the state from the
local copies, JAX's persistent compilation cache shared by every generation,
meshfit.parallel.engine.use_compile_cache).

What a mesh change costs: the steps since the newest checkpoint, or since the newest local copy
every process of the new generation has where that is newer (`--elastic` makes the run save
every ELASTIC_CHECKPOINT_EVERY and copy its state to each host's local disk every
ELASTIC_LOCAL_COPY_EVERY steps unless the command gives --checkpoint-every or --local-copy-every;
meshfit.run.local_copies: the new processes read the copies the lost generation left), plus the
restart (imports, joining, compiling). Both are in the run's goodput ("lost" seconds and steps,
meshfit.watch.goodput), and every generation (its processes, devices, global batch, first and last
step, why it ended) is in RUN/generations.json, and in metrics.json as "generations"
(meshfit.launch.mesh_history).

Where each generation runs is a runner's business: `Local` runs local.run_job's processes of
this machine; under SLURM (`--via srun`, in a batch script submitted with --no-kill:
tools/slurm/elastic.sbatch) meshfit.launch.slurm_step.Srun runs each generation as an srun step
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

import dataclasses
import os
import sys
import time
from typing import Any, Callable

from meshfit.errors import MeshfitError
from meshfit.launch import growth, job_command, local, losses, mesh_history, slurm_step, train_argv, watchdog
from meshfit.launch.output import Output
from meshfit.launch.spares import Spares
from meshfit.run import checkpoint_format, local_copies, rundir

MAX_RESTARTS_WITHOUT_PROGRESS = 3
KEEP_BATCH = ("global", "per-core")  # --keep-batch: what a generation on fewer devices keeps
ON_LOSS = ("restart", "shrink")  # --on-loss: a lost process's slot started again at once, or left out


@dataclasses.dataclass
class Plan:
    """An elastic job's settings, the same for every generation (see elastic_launch)."""

    argv: list[str]  # the command every generation runs (meshfit.launch.train_argv)
    run: str  # its run directory
    runner: Any  # Local or slurm_step.Srun
    processes: int  # the full mesh's
    devices_per_process: int
    min_processes: int
    max_restarts_without_progress: int
    grow: bool
    show: str
    deadline: float | None  # time.monotonic() past which the job stops (--timeout)
    grace: float
    per_core: bool  # --keep-batch per-core
    restart_slots: bool = True  # --on-loss restart

    @property
    def full(self) -> int:
        """The full mesh's devices."""
        return self.processes * self.devices_per_process

    def batch_line(self, count: int) -> str:
        """The batch a generation of `count` processes keeps, in words."""
        return train_argv.batch_line(self.run, count * self.devices_per_process,
                                     self.full if self.per_core else None, self.argv)


def elastic_launch(command: list[str], processes: int | None, devices_per_process: int | None = None,
                   *, min_processes: int = 1,
                   max_restarts_without_progress: int = MAX_RESTARTS_WITHOUT_PROGRESS,
                   grow: bool = True, show: str = "all", timeout: float | None = None,
                   grace: float = watchdog.GRACE_SECONDS, keep_batch: str = "global",
                   via: str = "local", on_loss: str = "restart", spares: int | None = None) -> int:
    """Run `command` (a `meshfit train`) as a job of `processes` processes that restarts with the
    survivors after losing some, and grows back to `processes` at the smaller generation's next
    checkpoint unless not `grow` (see the module); return the launch's exit code. On fewer
    devices, keep_batch 'global' gives each a larger share of the batch, 'per-core' keeps each
    one's share with micro-batches. on_loss 'restart' starts a lost process's slot again at once
    where the runner has it (the same mesh: one change a fault), 'shrink' goes on without it
    until the mesh grows back (two). spares: processes started ahead that take a new
    generation's places (meshfit.launch.spares; default: as many as `processes` on this machine,
    none with srun). via: "local" (processes of this machine,
    `devices_per_process` simulated CPU devices each, default 1) or "srun" (steps of the SLURM
    allocation this runs in, meshfit.launch.slurm_step: processes default to its tasks;
    devices_per_process, each task's devices for the records and the batch split, defaults to
    the command's --simulate-devices, else 1)."""
    argv, run = train_argv.train_command(job_command.command_line(command))
    if spares is not None and spares < 0:
        raise MeshfitError(f"--spares must be at least 0, got {spares}")
    if spares and via != "local":
        raise MeshfitError("--spares goes with --via local: srun starts each step's tasks itself")
    runner = runner_for(via, run)
    if via == "srun":
        processes = processes or runner.tasks
        if processes > runner.tasks:
            raise MeshfitError(f"--processes {processes} is more than the allocation's {runner.tasks} "
                               "tasks (SLURM_NTASKS); give at most that, or leave it out")
        devices_per_process = devices_per_process or int(
            train_argv.flag_value(argv, "--simulate-devices") or 1)
    devices_per_process = devices_per_process or 1
    local.check_arguments(processes, devices_per_process, timeout, show)
    if via == "local":
        runner.spares = Spares(processes if spares is None else spares, argv,
                               processes * devices_per_process)
    if keep_batch not in KEEP_BATCH:
        raise MeshfitError(f"--keep-batch must be one of {', '.join(KEEP_BATCH)}, got {keep_batch!r}")
    if on_loss not in ON_LOSS:
        raise MeshfitError(f"--on-loss must be one of {', '.join(ON_LOSS)}, got {on_loss!r}")
    if not 1 <= min_processes <= processes:
        raise MeshfitError(f"--min-processes must be between 1 and --processes ({processes}), "
                           f"got {min_processes}")
    if max_restarts_without_progress < 0:
        raise MeshfitError("--max-restarts-without-progress must be at least 0, got "
                           f"{max_restarts_without_progress}")
    deadline = None if timeout is None else time.monotonic() + timeout
    plan = Plan(argv, run, runner, processes, devices_per_process, min_processes,
                max_restarts_without_progress, grow, show, deadline, grace, keep_batch == "per-core",
                on_loss == "restart")
    return Generations(plan).run()


class Generations:
    """The loop of an elastic job: run a generation, then grow back, restart on the survivors,
    finish or stop, each with its one line."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.generations = mesh_history.earlier(plan.run)  # a resumed run's history goes on
        self.count = plan.processes
        self.report: dict[str, str] | None = None  # the device report's rows, once printed
        self.mark = progress_mark(plan.run, self.generations)  # where a restart would resume
        self.stalled = 0  # restarts in a row without progress
        self.said_stay = False  # this generation's line on not growing back is printed

    def run(self) -> int:
        """Generation after generation until the run finishes or stops; the exit code."""
        try:
            while True:
                ended, boundary = self.generation()
                if ended.at_boundary:
                    self.grow(ended, boundary)
                    continue
                code = self.after_loss(ended)
                if code is not None:
                    return code
        finally:
            self.plan.runner.close()

    def generation(self) -> tuple[local.Ended, Callable[[], bool] | None]:
        """Run one generation of `count` processes and record it (RUN/generations.json)."""
        plan, count = self.plan, self.count
        resumed_before = len(mesh_history.run_config(plan.run).get("resumed", []))
        resume = ["--resume", plan.run] if os.path.isfile(os.path.join(plan.run, rundir.CONFIG)) else []
        left = None if plan.deadline is None else max(plan.deadline - time.monotonic(), 1.0)
        boundary = (growth.NextCheckpoint(plan.run, lambda: self.room() > count, self.growth_pays)
                    if plan.grow and count < plan.processes else None)
        self.said_stay = False
        slices = (train_argv.micro_batches_for(plan.run, count * plan.devices_per_process, plan.full,
                                               plan.argv) if plan.per_core else None)
        output = Output(self.report, hold_on_stop=True)
        ended = plan.runner(train_argv.with_micro_batches(plan.argv, slices) + resume, count,
                            plan.devices_per_process, plan.show, left, plan.grace, boundary, output)
        if self.report is None and output.report:
            self.report = output.report
        record = mesh_history.record(len(self.generations) + 1, count, plan.devices_per_process,
                                     plan.run, resumed_before, ended)
        if plan.per_core:  # the first generation's count is known once it wrote config.json
            record["micro_batches"] = slices or train_argv.micro_batches_for(
                plan.run, count * plan.devices_per_process, plan.full, plan.argv)
        if self.generations:
            mesh_history.continued(self.generations[-1], record)
        self.generations.append(record)
        return ended, boundary

    def room(self) -> int:
        """The processes a generation can have now, as many as split the global batch evenly
        (growing to no more than there are would only cost a restart)."""
        plan = self.plan
        return losses.fitting_processes(plan.run, plan.runner.most(plan.processes),
                                        plan.devices_per_process)

    def growth_pays(self, step_now: float | None, left: int | None) -> bool:
        """Whether growing back now repays a mesh change (growth.pays: the full mesh's seconds a
        step from its newest generation, the cost the median of the changes so far: their stop
        and restart); says so in one line the first time it does not."""
        full = [g["step_seconds"] for g in self.generations if g["processes"] == self.plan.processes
                and g.get("step_seconds")]
        costs = sorted(c["stop"] + c["restart"] for g in self.generations
                       if (c := g.get("change")) and c.get("stop") is not None and c.get("restart") is not None)
        cost = costs[len(costs) // 2] if costs else None
        if growth.pays(left, step_now, full[-1] if full else None, cost):
            return True
        if not self.said_stay:
            self.said_stay = True
            steps = f"({step_now:.2f} s a step now, {full[-1]:.2f} s on {self.plan.processes})"
            saving = (f"save about {left * (step_now - full[-1]):.0f} s over the {left} steps left "
                      f"{steps} and cost about {cost:.0f} s (a mesh change)" if step_now > full[-1]
                      else f"be no faster {steps}")  # a loaded machine: more processes, slower steps
            print(f"meshfit launch: elastic: staying on {self.count} process(es): growing back would "
                  f"{saving}; asking again at each checkpoint", file=sys.stderr, flush=True)
        return False

    def grow(self, ended: local.Ended, boundary: growth.NextCheckpoint) -> None:
        """The smaller generation stopped at its save after `boundary.found`: the next has all
        the processes there is room for again, and resumes from that save."""
        plan, count = self.plan, self.count
        grown = self.room()
        self.generations[-1]["ended"] = f"stopped after {boundary.found} to grow back to {grown} process(es)"
        mesh_history.write(plan.run, self.generations)
        local.finish(ended.started)
        saved = newest_checkpoint(plan.run) or boundary.found  # the stop's own save: newer
        print(f"meshfit launch: elastic: {boundary.found} committed on {count} process(es); "
              f"generation {len(self.generations) + 1}: {grown} process(es) x "
              f"{plan.devices_per_process} device(s) again (was {count} x {plan.devices_per_process}), "
              f"{plan.batch_line(grown)}, resuming {plan.run} from {saved}, saved as it stopped",
              file=sys.stderr, flush=True)
        self.count = grown

    def after_loss(self, ended: local.Ended) -> int | None:
        """A generation ended other than at a boundary: finished (0), stopped for good (its exit
        code, one error line), or restarted on the survivors (None, one line)."""
        plan, count, record = self.plan, self.count, self.generations[-1]
        restart, lost = losses.lost_processes(ended, count)
        plan.runner.note_lost(ended, lost)
        if ended.verdict is None and ended.failure is None:
            record["ended"] = "finished"
            mesh_history.write(plan.run, self.generations, finished=True)
            if len(self.generations) > 1:
                again = sum(g.get("lost_steps", 0) for g in self.generations)
                print(f"meshfit launch: elastic run finished after {len(self.generations)} generations "
                      f"({' -> '.join(mesh_history.mesh_name(g) for g in self.generations)} devices), "
                      f"{again} step{'' if again == 1 else 's'} run again", file=sys.stderr, flush=True)
            return 0
        why = losses.what_ended(ended, lost)
        record["ended"], record["lost_processes"] = why, lost
        mesh_history.write(plan.run, self.generations)
        if not restart:
            return ended.report(plan.show) or 1
        alive = count - len(lost)
        if alive == 0:  # every process lost: their slots are free again (this machine's; with
            alive = count  # srun, those on nodes still up), so the next generation takes them
        in_place, said = self.restarts_in_place(count, lost)
        survivors = losses.fitting_processes(
            plan.run, count if in_place else min(alive, plan.runner.most(plan.processes)),
            plan.devices_per_process)
        stop = self.limit(survivors, alive, counted=not ended.signal_stopped)
        if stop is not None:
            return stopped(ended, plan.show, len(self.generations), why, stop, plan.run)
        local.finish(ended.started)
        idle = (f"; {alive - survivors} survivor(s) idle: the global batch splits "
                "evenly over no more devices" if survivors < alive else "")
        if os.path.isfile(os.path.join(plan.run, rundir.CONFIG)):
            resume = f"resuming {plan.run} from {plan.runner.resume_point(plan.run) or 'its newest checkpoint'}"
        else:  # lost before the run's first record: the next generation starts it afresh
            resume = f"starting {plan.run} again (lost before it began)"
        mesh = (f"{survivors} process(es) x {plan.devices_per_process} device(s) again ({said})"
                if in_place else f"{survivors} process(es) x {plan.devices_per_process} device(s) "
                f"(was {count} x {plan.devices_per_process}{idle}{said})")
        print(f"meshfit launch: elastic: {why}; generation {len(self.generations) + 1}: {mesh}, "
              f"{plan.batch_line(survivors)}, {resume}", file=sys.stderr, flush=True)
        self.count = survivors
        return None

    def restarts_in_place(self, count: int, lost: list[int]) -> tuple[bool, str]:
        """Whether the next generation starts the `lost` processes again at once in their slots
        (the same mesh: one change a fault instead of a shrink and a growth, and JAX's persistent
        compilation cache has the mesh's programs), with the phrase saying so, or why not where
        the slot would have been restarted: with --on-loss restart, when the runner has the
        slots (this machine's: always; srun: while their nodes are in the allocation), unless the
        generation that lost them was such a restart that lost a process before any step of its
        own (a slot that fails again at once is left out until the mesh grows back)."""
        plan, record = self.plan, self.generations[-1]
        if not plan.restart_slots or not lost or len(lost) == count or \
                plan.runner.most(plan.processes) < count:
            return False, ""
        who = ", ".join(map(str, lost))
        if (record.get("change") or {}).get("kind") == "restart" and record["last_step"] <= record["first_step"]:
            return False, f"; process(es) {who} left out: lost again before a step since a restart"
        return True, f"process(es) {who} started again at once"

    def limit(self, survivors: int, alive: int, counted: bool = True) -> str | None:
        """Why no generation of `survivors` may follow (`alive`: before the batch's split), or
        None; counts the restart otherwise. A restart is without progress when the run would
        resume from no newer step than at the loss before (no checkpoint committed, no newer
        local copy taken since). counted=False: a loss that cannot repeat by itself, a process
        stopped by a signal from outside (SIGSTOP; its stdin is /dev/null in a session of its
        own, so no terminal stops it): not counted, as a crash, a hang or a SIGKILL (an
        out-of-memory kill) may be a loop that no restart ends. A burst of faults from outside
        (chaos at 20 s on a loaded 2-core machine, 2026-11-29: 5 in 31 s, each before a step of
        the last restart) then leaves the job going, where the limit was the restart loop's."""
        plan = self.plan
        if survivors < plan.min_processes:
            stop = f"{survivors} process(es) left, fewer than --min-processes {plan.min_processes}"
            return stop + (" (the global batch splits evenly over no more)" if survivors < alive else "")
        mark = progress_mark(plan.run, self.generations)
        self.stalled = 0 if mark > self.mark else self.stalled + counted
        self.mark = max(mark, self.mark)
        if self.stalled > plan.max_restarts_without_progress:
            return (f"{self.stalled} losses in a row without progress (no newer checkpoint to resume "
                    f"from): --max-restarts-without-progress {plan.max_restarts_without_progress} reached")
        return None


def progress_mark(run: str, generations: list[dict[str, Any]]) -> int:
    """The newest step the run can resume from, as far as the launcher knows: its newest
    committed checkpoint, or a generation's first step (a local copy it resumed from); 0 before
    any."""
    newest = newest_checkpoint(run)
    steps = [mesh_history.checkpoint_step(newest)] if newest else []
    return max(steps + [g.get("first_step", 0) for g in generations] + [0])


def newest_checkpoint(run: str) -> str | None:
    """The name of the run's newest committed checkpoint, None before its first."""
    newest = rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))
    return os.path.basename(newest[-1]) if newest else None


def stopped(ended: local.Ended, show: str, generation: int, why: str, stop: str, run: str) -> int:
    """Print the one error line of a job that lost a process it may not restart without (the
    failed process's held lines first, as launch does); return the launch's exit code."""
    local.finish(ended.started)
    if ended.verdict is not None:  # its line is not printed: this one names it (`why`)
        code = ended.verdict
    else:
        index, code = ended.failure
        local.held_back(ended.started[index], show)
        code = code if code > 0 else 128 - code
    since = newest_checkpoint(run) or "its start (no checkpoint yet)"
    print(f"meshfit: error: elastic launch stopped after generation {generation} ({why}): {stop}; "
          f"continue from {since} with --resume {run}", file=sys.stderr, flush=True)
    return code


class Local:
    """The runner of generations of processes of this machine (local.run_job): every slot of a
    lost one is free again at once. spares: processes started ahead (meshfit.launch.spares),
    started again once each generation trains, that take the next one's places."""

    def __init__(self, spares: Spares | None = None):
        self.spares = spares

    def close(self) -> None:
        """End what the runner keeps between generations: its spares."""
        if self.spares is not None:
            self.spares.close()

    def most(self, processes: int) -> int:
        """The processes a generation can have now."""
        return processes

    def note_lost(self, ended: local.Ended, lost: list[int]) -> None:
        """What the runner keeps of a generation's `lost` processes (here: nothing)."""

    def resume_point(self, run: str) -> str | None:
        """The checkpoint the next generation resumes from: the newest local copy newer than the
        newest committed checkpoint (every process of this machine reads the same copies,
        meshfit.run.local_copies.agreed_step), else that checkpoint; None before either."""
        committed = newest_checkpoint(run)
        copy = local_copies.agreed_step([local_copies.Host(run).steps()],
                                        mesh_history.checkpoint_step(committed) if committed else -1)
        return committed if copy is None else local_copies.PREFIX + checkpoint_format.checkpoint_name(copy)

    def __call__(self, argv: list[str], count: int, devices_per_process: int, show: str,
                 timeout: float | None, grace: float, boundary, output: Output) -> local.Ended:
        """Run one generation of `count` processes; how it ended."""
        spares = self.spares if self.spares is not None and self.spares.count else None
        every_step_copied = train_argv.flag_value(argv, "--local-copy-every") == "1"
        return local.run_job(argv, count, devices_per_process, None, show, timeout, grace, boundary,
                             output=output, spares=spares, training=spares.fill if spares else None,
                             lost_at_once=every_step_copied)


def runner_for(via: str, run: str):
    """The runner of each generation: `Local`, or meshfit.launch.slurm_step.Srun for "srun"."""
    if via == "local":
        return Local()
    if via == "srun":
        return slurm_step.Srun(run)
    raise MeshfitError(f"unknown --via {via!r}; use local or srun")
