"""What `meshfit launch` reads of its processes to tell why a job must stop: their status files
(meshfit.parallel.heartbeat: who never joined, who hangs and where, `Watch`) and the last lines of
a failed one (JAX's fatal messages: `diagnosis`, `silent_processes`).
"""

from __future__ import annotations

import os
from typing import Sequence

from meshfit import env
from meshfit.errors import troubleshooting
from meshfit.parallel import cluster, heartbeat, stall

GRACE_SECONDS = 10.0  # between SIGTERM and SIGKILL when stopping the other processes
INIT_TIMEOUT_SECONDS = 120  # local processes start together, so joining should be quick
HEARTBEAT_TIMEOUT_SECONDS = 60  # meshfit.parallel.cluster's default of MESHFIT_HEARTBEAT_TIMEOUT
# A process of this machine seen stopped by a signal (state T: SIGSTOP, SIGTSTP) this long is
# lost: it cannot train until continued, and its peers wait for it in a collective. Two polls
# (meshfit.launch.local.POLL_SECONDS, a quarter second), so one glimpse of a state does not
# decide; every second more was a second of each such fault's recovery. A process held by a
# tracer (t: a debugger, py-spy) is left to the heartbeat's timeout: it is looked at, not frozen.
FROZEN_SECONDS = 0.5
WHERE = {"device": "in a device computation", "input": "waiting for input", "checkpoint":
         "on a checkpoint", "compiling": "compiling", "thread": "waiting for another thread",
         "callback": "in a Keras callback", "python": "in Python",
         "meeting": "waiting for the others at a call every process makes"}  # heartbeat.where()'s kinds


def never_joined(missing: Sequence[int], processes: int, init_timeout: float) -> str:
    """'process 1 of 2 never joined the job (...)': the processes without a join marker."""
    who = (f"process {missing[0]} of {processes}" if len(missing) == 1 else
           f"processes {', '.join(map(str, missing))} of {processes}")
    they = "it" if len(missing) == 1 else "they"
    return (f"{who} never joined the job ({they} did not reach meshfit.connect within "
            f"{init_timeout:g} s; {env.INIT_TIMEOUT})")


class Watch:
    """The launcher's view of its processes' status files (meshfit.parallel.heartbeat).

    `poll()` says why the job must be stopped: processes that never joined (INIT_TIMEOUT plus
    GRACE_SECONDS after the first began joining, should their peers not give up by themselves),
    or a job without progress for `stall_timeout` seconds (0: never) since the first step.
    """

    def __init__(self, directory: str, processes: int, init_timeout: float, stall_timeout: float):
        self.directory, self.processes = directory, processes
        self.init_timeout, self.stall_timeout = init_timeout, stall_timeout
        self.first_joined: float | None = None  # when the first process began joining
        self.progress: dict[int, tuple[int, int]] = {}  # (steps started, reports) of each process
        self.last_progress: float | None = None  # when any process last progressed, once armed
        self.behind: list[int] = []  # once the job hung: the processes furthest behind
        self.timed_out = False  # the job ran past launch's --timeout
        self.stopped_since: dict[int, tuple[float, str]] = {}  # processes seen stopped: since when, state
        self.first_step: float | None = None  # when a process was first seen training (the poll's time)
        self.signal_stopped = False  # the job was stopped for processes stopped by a signal (SIGSTOP)

    def missing(self) -> list[int]:
        """The processes that never began joining while others did (else [])."""
        joined = heartbeat.joined(self.directory)
        return sorted(set(range(self.processes)) - joined) if joined else []

    def poll(self, now: float) -> str | None:
        """A reason to stop the job now, or None."""
        missing = self.missing()
        if missing and self.first_joined is None:
            self.first_joined = now
        if missing and now - self.first_joined > self.init_timeout + GRACE_SECONDS:
            return never_joined(missing, self.processes, self.init_timeout)
        found = heartbeat.progress(self.directory)
        progress = {i: counts[:2] for i, counts in found.items()}
        if self.first_step is None and any(c[0] > 0 for c in progress.values()):
            self.first_step = now
        armed = self.last_progress is not None or any(c[2] > 1 for c in found.values())
        # A process in a callback's own code waits for nothing of the job's (its own stall guard
        # does not count it either): the others may wait for it in a collective, not hung.
        busy = any(c[3] == "callback" for c in found.values())
        if armed and (progress != self.progress or busy):  # from a second dispatch: the first compiled
            self.last_progress = now
        self.progress = progress
        if self.stall_timeout and self.last_progress is not None and \
                now - self.last_progress > self.stall_timeout:
            return self.hung()
        return None

    def frozen(self, processes: Sequence, now: float) -> str | None:
        """A reason to stop the job: a process of this machine stopped by a signal (SIGSTOP:
        `state()` T) for FROZEN_SECONDS, or held by a tracer (t) for the
        MESHFIT_HEARTBEAT_TIMEOUT seconds after which JAX counts a silent process as dead. JAX's
        own check takes that timeout and needs a peer's coordination service (a job of one
        process has none, and a stopped process 0 is that service), the stall watchdog a first
        step: this one sees the states of the launcher's own processes and of the srun tasks on
        its node at once (a process on another host has no state here: the heartbeat's). None
        while none is."""
        heartbeat_limit = float(os.environ.get(env.HEARTBEAT_TIMEOUT) or HEARTBEAT_TIMEOUT_SECONDS)
        for p in processes:
            state = getattr(p, "state", lambda: None)()
            if state in ("T", "t"):
                since = self.stopped_since.setdefault(p.index, (now, state))
                if since[1] != state:
                    self.stopped_since[p.index] = (now, state)
            else:
                self.stopped_since.pop(p.index, None)
        limits = {"T": min(FROZEN_SECONDS, heartbeat_limit), "t": heartbeat_limit}
        frozen = sorted(i for i, (since, state) in self.stopped_since.items() if now - since >= limits[state])
        if not frozen:
            return None
        self.behind = frozen
        who = ", ".join(map(str, frozen))
        if all(self.stopped_since[i][1] == "T" for i in frozen):
            self.signal_stopped = True
            return (f"process(es) {who} of {self.processes} stopped (SIGSTOP) for "
                    f"{limits['T']:g} s (seen in /proc)")
        return (f"process(es) {who} of {self.processes} held by a tracer for {heartbeat_limit:g} s "
                f"({env.HEARTBEAT_TIMEOUT})")

    def step_seconds(self, now: float) -> float | None:
        """Seconds a training step takes in this job so far (the furthest process's steps since
        the first was seen, over the time since; 1 s resolution: the progress files'), None
        before a step was seen again."""
        steps = max((c[0] for c in self.progress.values()), default=0)
        if self.first_step is None or steps < 2 or now <= self.first_step:
            return None
        return (now - self.first_step) / (steps - 1)

    def positions(self) -> str:
        """Where each process is: 'process 0 at step 12 in a device computation, process 1 ...'."""
        found = heartbeat.progress(self.directory)
        where = []
        for i in range(self.processes):
            if i not in found:
                where.append(f"process {i} before its first step")
                continue
            steps, _, _, doing = found[i]
            where.append(f"process {i} at step {steps} {WHERE.get(doing, doing)}")
        return ", ".join(where)

    def hung(self) -> str:
        """Which process hung: the one furthest behind (fewest steps, then fewest reports)."""
        counts = {i: self.progress.get(i, (0, 0)) for i in range(self.processes)}
        lowest = min(counts.values())
        behind = self.behind = [i for i, c in counts.items() if c == lowest]
        still = (f"no process made progress for {self.stall_timeout:g} s ({env.STALL_TIMEOUT}; "
                 f"{self.positions()})")
        if self.processes == 1:
            return f"process 0 of 1 hung after starting {lowest[0]} training steps: {still}"
        if len(behind) > 1:
            return (f"the job hung: {still}, and processes {', '.join(map(str, behind))} stopped at "
                    f"the same point (after starting {lowest[0]} training steps), so which one hung "
                    "is not known")
        most = max(c[0] for i, c in counts.items() if i != behind[0])
        others = f"the others started {most}" if most > lowest[0] else "the others as many, but got further"
        if most > lowest[0] and heartbeat.progress(self.directory).get(behind[0], ("",) * 4)[3] == "meeting":
            # it finished its fit (evaluate, predict) and waits for the others: fewer batches
            return (f"process {behind[0]} of {self.processes} ran out of batches after starting "
                    f"{lowest[0]} training steps ({others}), and waits for them: "
                    f"{cluster.AS_MANY_BATCHES}: {still}")
        return (f"process {behind[0]} of {self.processes} hung after starting {lowest[0]} training "
                f"steps ({others}): {still}")


def diagnosis(lines: Sequence[str]) -> str:
    """What JAX's fatal messages in a process's last lines say went wrong ("" when none do).

    JAX ends every process with SIGABRT when its coordinator finds a silent process (heartbeats
    stopped) or when not all processes join in time; the silent ones are listed one a line.
    """
    lines = list(lines)
    for i, line in enumerate(lines):
        if line.startswith(stall.LINE):  # its own stall guard's line (meshfit.parallel.stall)
            return ": " + line[len(stall.LINE) - len("stalled for "):].removesuffix(troubleshooting("a-job-hangs"))
        if "stopped sending heartbeats" in line:
            silent = silent_processes(lines)
            who = f"process(es) {', '.join(map(str, silent))}" if silent else "a process"
            seconds = os.environ.get(env.HEARTBEAT_TIMEOUT, "60")
            return (f" because {who} sent no heartbeat for {seconds} s ({env.HEARTBEAT_TIMEOUT}; "
                    "stopped, hung or on a lost host)")
        if "CoordinationService/Heartbeat" in line and coordinator_unanswering(lines):
            return (" because process 0, the coordinator, stopped answering heartbeats (stopped, "
                    "hung or on a lost host)")
        if "RegisterTask" in line:
            seconds = os.environ.get(env.INIT_TIMEOUT, str(INIT_TIMEOUT_SECONDS))
            return f" because not every process joined within {seconds} s ({env.INIT_TIMEOUT})"
    return ""


def coordinator_unanswering(lines: Sequence[str]) -> bool:
    """Whether JAX's fatal message in `lines` says this process's heartbeat to the coordination
    service timed out (DEADLINE_EXCEEDED on RPC .../CoordinationService/Heartbeat): process 0,
    which hosts the service, stopped answering (stopped, hung or on a lost host). JAX names no
    process then: seen with process 0 SIGSTOPped, JAX 0.10.2, 2026-11-28."""
    text = "\n".join(lines)
    return "DEADLINE_EXCEEDED" in text and "CoordinationService/Heartbeat" in text


def silent_processes(lines: Sequence[str]) -> list[int]:
    """The processes JAX's fatal message in `lines` lists as having stopped sending heartbeats
    (one a line after it); [] when there is no such message."""
    lines = list(lines)
    for i, line in enumerate(lines):
        if "stopped sending heartbeats" in line:
            silent = []
            for after in lines[i + 1:]:
                if not after.strip().isdigit():
                    break
                silent.append(int(after.strip()))
            return silent
    return []
