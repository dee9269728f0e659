"""`meshfit launch`: run N processes of a multi-host job on this machine, for testing and CPU work.

    meshfit launch --processes 2 --devices-per-process 4 -- meshfit train fashion-mnist-cnn

starts N copies of COMMAND wired to a coordinator on 127.0.0.1 (MESHFIT_COORDINATOR,
MESHFIT_NUM_PROCESSES, MESHFIT_PROCESS_ID set per process, MESHFIT_SIMULATE_DEVICES=M), prefixes
each output line with "[i] " (or shows only process 0's output, and the others' when they fail),
and waits. When a process exits non-zero or is killed, the others get SIGTERM and, after
`GRACE_SECONDS`, SIGKILL; the launch then exits non-zero with one line naming that process. A
process that exits 130 or 143 (stopped on SIGINT/SIGTERM after an agreed save, see
meshfit.run.keras_side.checkpoints) first gets its peers `GRACE_SECONDS` to stop the same way.

Two faults leave every process alive, so the launcher watches the status files its processes
write into a folder of their own (MESHFIT_LAUNCH_STATUS, see meshfit.parallel.heartbeat):
- a process that never reaches `meshfit.connect` (its peers give up joining after
  MESHFIT_INIT_TIMEOUT): the line names it, as the one without a join marker; should no process
  give up, the launcher stops the job `GRACE_SECONDS` after that timeout itself;
- a process that hangs alive (deadlocked, stuck in Python: JAX's heartbeats go on, its peers wait
  in a collective for ever): once the first training step is reported, when no process makes
  progress for MESHFIT_STALL_TIMEOUT seconds (default 600, 0: never) the job is stopped (exit
  code 124) and the process furthest behind (fewest steps) is named as the one that hung.

Nothing outlives the launcher: SIGTERM, SIGHUP or Ctrl-C stop the processes as above, a second
Ctrl-C kills them at once, and on Linux each process gets SIGKILL when the launcher dies (even by
SIGKILL). The coordinator and gloo listen on 127.0.0.1 only. On a real multi-host job run the
same command on every host instead (see README).

`run_job` runs one such job and says how it ended (`Ended`); `launch --elastic`
(meshfit.launch.elastic) runs one after another, each on the processes that survived the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterator, NamedTuple, Sequence

from meshfit import env
from meshfit.parallel import heartbeat, stall
from meshfit.launch.job_command import command_line
from meshfit.launch.output import Output
from meshfit.launch.process import GLOO_CONNECTED, KEPT_LINES, Process
from meshfit.launch.watchdog import (FROZEN_SECONDS, GRACE_SECONDS, INIT_TIMEOUT_SECONDS, Watch, diagnosis,
                                    never_joined)
from meshfit.errors import MeshfitError, troubleshooting

TAIL_LINES = 20  # lines of a failed process's output shown when only process 0 is shown
STALL_TIMEOUT_SECONDS = 600  # no training progress in any process for this long: the job hung
# How often the launcher reads its processes' status files and /proc states: a quarter second,
# so that a frozen process is lost within a second (reading a few small files costs microseconds)
POLL_SECONDS = 0.25
STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a process that stopped after saving
STOP_PATIENCE_SECONDS = 60  # --timeout: how long the processes get to stop at an agreed step and save


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_environment(index: int, processes: int, port: int, devices_per_process: int,
                        base: dict[str, str] | None = None, status: str | None = None) -> dict[str, str]:
    """The environment of process `index`: the job's MESHFIT_* variables over `base`.

    status: the folder for the processes' status files (MESHFIT_LAUNCH_STATUS), if any.
    """
    variables = dict(os.environ if base is None else base)
    variables.pop(env.LAUNCH_STATUS, None)
    if status is not None:
        variables[env.LAUNCH_STATUS] = status
    variables.pop(env.LOCAL_DEVICE_IDS, None)
    variables.update({
        env.COORDINATOR: f"127.0.0.1:{port}",
        env.COORDINATOR_BIND: f"127.0.0.1:{port}",  # the coordinator answers this machine only
        env.NUM_PROCESSES: str(processes),
        env.PROCESS_ID: str(index),
        env.SIMULATE_DEVICES: str(devices_per_process),
        "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
    })
    variables.setdefault(env.INIT_TIMEOUT, str(INIT_TIMEOUT_SECONDS))
    return variables


def describe_exit(code: int) -> str:
    """'exit code 3' or 'signal SIGKILL (exit code -9)' for a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{name} (exit code {code})"
    return f"exit code {code}"


def _wait_all(processes: list[Process], seconds: float) -> None:
    """Wait until every process has ended, or `seconds` have passed, or one of them has been
    stopped (SIGSTOP) for FROZEN_SECONDS: a stop at an agreed step needs every process (a fault
    during the stop, as a chaos drill makes, would otherwise cost the whole wait: 60 s at a
    boundary)."""
    deadline = time.monotonic() + seconds
    frozen: dict[int, float] = {}
    for p in processes:
        while True:
            now = time.monotonic()
            try:
                p.popen.wait(max(0.0, min(deadline - now, POLL_SECONDS / 5)))
                break
            except subprocess.TimeoutExpired:
                if now >= deadline:
                    return
            for q in processes:
                if getattr(q, "stopped", lambda: False)():
                    if now - frozen.setdefault(q.index, now) >= FROZEN_SECONDS:
                        return
                else:
                    frozen.pop(q.index, None)


def _stop_to_resume(processes: list[Process], grace: float) -> bool:
    """SIGTERM every process (meshfit train stops all of them at one agreed step and saves, see
    meshfit.run.keras_side.checkpoints), SIGKILL what is left after `grace` seconds; True when
    every process stopped that way (exit 143)."""
    _stop(processes, grace)
    return all(p.popen.returncode == 128 + signal.SIGTERM for p in processes)


def _stop(processes: list[Process], grace: float, patience: float = 0.0) -> None:
    """Let the processes end by themselves for `patience` seconds, then SIGTERM those left and
    SIGKILL them after `grace` seconds. A Ctrl-C meanwhile skips to SIGKILL."""
    for p in processes:
        p.output.stop()
    try:
        _wait_all(processes, patience)
        for p in processes:
            if p.popen.poll() is None:
                p.signal(signal.SIGTERM)
                p.signal(signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
        _wait_all(processes, grace)
    except KeyboardInterrupt:  # a second Ctrl-C: kill now, but never leave anything running
        pass
    finally:
        _kill(processes)


def _kill(processes: list[Process]) -> None:
    """SIGKILL the processes (and anything each left behind in its group) and wait until they
    have ended."""
    for p in processes:
        p.output.stop()
    with _interrupts_ignored():
        for p in processes:
            p.signal(signal.SIGKILL)
            p.popen.wait()


def launch(command: Sequence[str], processes: int, devices_per_process: int = 1,
           port: int | None = None, show: str = "all", timeout: float | None = None,
           grace: float = GRACE_SECONDS) -> int:
    """Run `processes` copies of `command` as one job; return 0, or non-zero naming a failure.

    show: "all" prefixes every line with "[i] "; "first" shows process 0's lines as they are and
    the last lines of any other process that fails. timeout: stop everything after so many
    seconds (None: no limit). A process dying stops the others within `grace` seconds; so does a
    process that never joins or a job that stops progressing (MESHFIT_STALL_TIMEOUT).
    """
    check_arguments(processes, devices_per_process, timeout, show)
    job = run_job(command_line(command), processes, devices_per_process, port, show, timeout, grace)
    return job.report(show)


@dataclasses.dataclass
class Ended:
    """How one job of `run_job` ended.

    verdict: 124 when the launcher itself stopped it (past --timeout, `timed_out`, or its
    watchdog: a hung process, `behind` the ones furthest behind; processes that never joined,
    `missing`), its line printed; else None. codes: each process's exit code. failure: (index,
    code) of the first process that failed, or None. steps: the training steps each process
    started. seconds: from the first start to the last exit. at_boundary: run_job's `boundary`
    came and the processes were stopped there (after saving, see `_stop_to_resume`). verdict_text:
    the verdict's reason (e.g. "process 1 of 2 hung after ..."); verdict_line: its error line,
    printed by `report`, not by run_job (an elastic launch that goes on prints its own line
    instead, and one that stops prints one error line, not two).
    """

    started: list
    verdict: int | None
    codes: dict[int, int]
    failure: tuple[int, int] | None
    missing: list[int]
    positions: str
    init_timeout: float
    behind: list[int]
    steps: dict[int, int]
    seconds: float
    timed_out: bool = False
    at_boundary: bool = False
    verdict_text: str = ""
    verdict_line: str = ""
    start_seconds: float | None = None  # from the start to the first training step seen (1 s resolution)
    stop_seconds: float = 0.0  # from the launcher's first stop to the last process's end
    signal_stopped: bool = False  # the verdict: processes stopped by a signal from outside (SIGSTOP)

    def report(self, show: str) -> int:
        """Print the line naming what failed (if anything did); the launch's exit code."""
        finish(self.started)
        if self.verdict is not None:
            print(self.verdict_line, file=sys.stderr, flush=True)
            return self.verdict
        if self.failure is None:
            return 0
        return _report_failure(self.started, self.codes, self.failure, show, self.missing,
                               self.positions, self.init_timeout)


def run_job(argv: list[str], processes: int, devices_per_process: int, port: int | None,
            show: str, timeout: float | None, grace: float,
            boundary: Callable[[], bool] | None = None, start: Callable | None = None,
            status_in: str | None = None, output: Output | None = None, spares=None,
            training: Callable[[], None] | None = None, lost_at_once: bool = False) -> Ended:
    """Start `processes` copies of `argv` as one job and wait until every one has ended (see
    `launch`); nothing is left running when it returns or raises. boundary: asked once a
    POLL_SECONDS while all run; once it says True the job is stopped to resume (SIGTERM: an agreed
    save) and ends `at_boundary` (meshfit.launch.elastic grows the mesh there). start: starts
    the processes instead of this machine's `_start_processes`, called as start(started, argv,
    processes, status, show, exits, output) (meshfit.launch.slurm_step: the tasks of an srun
    step); status_in: the folder for the status files' folder (default: the temporary folder);
    output: which lines are shown (meshfit.launch.output; default: all but the survivors' ends);
    spares: meshfit.launch.spares.Spares, whose waiting processes take the job's places before
    any starts cold; training: called once, when the first training step is seen. lost_at_once:
    a process lost (killed by a signal, or seen frozen: SIGSTOP, which is then killed) has the
    others killed at once, instead of asked to stop (SIGTERM, then SIGKILL after `grace`) or to
    stop at an agreed step and save: an elastic job whose every step is copied locally has
    nothing newer to save, and a survivor waiting in a collective for the lost one handles no
    signal until it gives up (7.7 and 8.6 s of two faults' recovery, chaos drill, 2026-11-28)."""
    port = port or free_port()
    init_timeout, stall_timeout = _timeouts()
    _catch_stop_signals()
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    started: list[Process] = []
    status = tempfile.mkdtemp(prefix="meshfit-launch-", dir=status_in)
    watch = Watch(status, processes, init_timeout, stall_timeout)
    output = output or Output()
    output.processes = started
    began = time.monotonic()
    try:
        if start is None:
            _start_processes(started, argv, processes, devices_per_process, port, status, show,
                             exits, output, spares)
        else:
            start(started, argv, processes, status, show, exits, output)
        waited = _wait_for_exits(started, exits, watch, processes, timeout, grace, boundary, training,
                                 lost_at_once)
    finally:
        _stop(started, grace)  # on Ctrl-C or any error, leave nothing running
        missing, positions = watch.missing(), watch.positions()
        steps = {i: counts[0] for i, counts in heartbeat.progress(status).items()}
        shutil.rmtree(status, ignore_errors=True)
    ended = time.monotonic()
    return Ended(started, missing=missing, positions=positions, init_timeout=watch.init_timeout,
                 behind=watch.behind, steps=steps, seconds=ended - began,
                 timed_out=watch.timed_out, signal_stopped=watch.signal_stopped, **waited._asdict(),
                 start_seconds=None if watch.first_step is None else watch.first_step - began,
                 stop_seconds=ended - (output.stopping_at or ended))


def check_arguments(processes: int | None, devices_per_process: int, timeout: float | None,
                     show: str) -> None:
    """A one-line MeshfitError for a count missing or below 1, a timeout not above 0 or an unknown
    --show."""
    if processes is None:
        raise MeshfitError("--processes N is needed: the processes to start")
    if processes < 1:
        raise MeshfitError(f"--processes must be at least 1, got {processes}")
    if devices_per_process < 1:
        raise MeshfitError(f"--devices-per-process must be at least 1, got {devices_per_process}")
    if timeout is not None and timeout <= 0:
        raise MeshfitError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    if show not in ("all", "first"):
        raise MeshfitError(f"unknown --show {show!r}; use all or first")


def _timeouts() -> tuple[float, float]:
    """(init, stall) timeouts in seconds, as the launched processes get them."""
    stall_timeout = env.read_int(env.STALL_TIMEOUT, example=STALL_TIMEOUT_SECONDS)
    stall_timeout = STALL_TIMEOUT_SECONDS if stall_timeout is None else stall_timeout
    init_timeout = env.read_int(env.INIT_TIMEOUT) or INIT_TIMEOUT_SECONDS  # as the processes get it
    return init_timeout, stall_timeout


def _catch_stop_signals() -> None:
    """Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt in the launcher (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C must reach the launcher even when it started with SIGINT ignored or blocked (as
        # a background job of a non-interactive shell does): Python then installs no handler.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _interrupt)  # a stopped launch stops its processes too


def _start_processes(started: list[Process], argv: list[str], processes: int,
                     devices_per_process: int, port: int, status: str, show: str,
                     exits: queue.Queue, output: Output, spares=None) -> None:
    """Start the job's processes into `started` (the caller stops what started, should one
    fail), or hand their places to `spares` (meshfit.launch.spares) where some wait, then their
    output pumps, and say what runs."""
    lock = threading.Lock()
    handed = 0
    for i in range(processes):
        variables = process_environment(i, processes, port, devices_per_process, status=status)
        shown = show == "all" or i == 0
        prefix = f"[{i}] " if show == "all" else ""
        spare = spares.take(argv, variables) if spares is not None else None
        handed += spare is not None
        try:
            started.append(Process(i, argv, variables, shown, prefix, lock, output, popen=spare))
        except OSError as e:
            raise MeshfitError(f"cannot start {argv[0]!r} ({e.strerror}); check the command after --") from None
    for p in started:  # only now: Popen's preexec_fn must run while no pump thread exists
        p.start_pumps(exits)
    print(f"meshfit launch: {processes} process(es) x {devices_per_process} device(s), coordinator "
          f"127.0.0.1:{port}, pids {' '.join(str(p.popen.pid) for p in started)}"
          + (f" ({handed} of them spares)" if handed else ""), file=sys.stderr, flush=True)


class _Waited(NamedTuple):
    """How `_wait_for_exits` ended: Ended's fields of the same names."""

    verdict: int | None
    codes: dict[int, int]
    failure: tuple[int, int] | None
    at_boundary: bool = False
    verdict_text: str = ""
    verdict_line: str = ""


def _wait_for_exits(started: list[Process], exits: queue.Queue, watch: "Watch", processes: int,
                    timeout: float | None, grace: float,
                    boundary: Callable[[], bool] | None,
                    training: Callable[[], None] | None = None, lost_at_once: bool = False) -> _Waited:
    """Wait until every process has exited, stopping the others at the first failure. verdict:
    124 once the job was stopped for running past `timeout` or by the watchdog (its line not yet
    printed: see Ended), else None. failure: (index, code) or None. at_boundary: `boundary()` said
    True and the job was stopped to resume."""
    codes: dict[int, int] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    while len(codes) < processes:
        wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
        try:
            index, code = exits.get(timeout=max(0.0, wait))
        except queue.Empty:
            now = time.monotonic()
            verdict = None
            if deadline is not None and now >= deadline:
                verdict = f"the job ran past --timeout {timeout:g} s ({watch.positions()})"
                watch.timed_out = True
                stopped = _stop_to_resume(started, max(grace, STOP_PATIENCE_SECONDS))
            elif failure is None:
                verdict = watch.poll(now)
                frozen = watch.frozen(started, now) if verdict is None else None
                verdict = verdict or frozen
                if training is not None and watch.first_step is not None:
                    training()  # once: the job trains
                    training = None
                if frozen and lost_at_once:  # lost, as a killed process is
                    _kill(started)
                    stopped = False
                else:
                    stopped = verdict is not None and _stop_to_resume(started, grace)
                if verdict is None and boundary is not None and boundary(watch.step_seconds(now)):
                    # SIGTERM: the processes agree on a step and save there (exit 143), so the
                    # next job resumes without running any step again
                    _stop_to_resume(started, max(grace, STOP_PATIENCE_SECONDS))
                    if all(p.popen.returncode == 0 for p in started):
                        # the run finished before the stop reached it (its last steps are quick
                        # beside the launcher's poll): the job is over, no generation follows
                        return _Waited(None, {p.index: 0 for p in started}, None)
                    return _Waited(None, codes, None, at_boundary=True)
            if verdict is None:
                continue
            after = (f"all {processes} processes stopped together after saving; continue with "
                     "--resume" if stopped else f"stopped all {processes} processes")
            see = "" if deadline is not None and now >= deadline else troubleshooting("a-job-hangs")
            return _Waited(124, codes, failure, verdict_text=verdict,
                           verdict_line=f"meshfit: error: {verdict}; {after}{see}")
        codes[index] = code
        if code != 0 and failure is None:
            failure = (index, code)
            if lost_at_once and code < 0:
                _kill(started)
            else:
                _stop(started, grace, patience=grace if code in STOP_CODES else 0.0)
    return _Waited(None, codes, failure)


def _report_failure(started: list[Process], codes: dict[int, int], failure: tuple[int, int],
                    show: str, missing: list[int], positions: str, init_timeout: float) -> int:
    """Print the one line naming the failed process and why; return the launch's exit code."""
    processes = len(started)
    index, code = failure
    if code in STOP_CODES and all(codes.get(p.index) == code for p in started):
        name = signal.Signals(code - 128).name
        print(f"meshfit launch: all {processes} processes stopped together on {name} after saving "
              f"(exit code {code}); continue with --resume", file=sys.stderr, flush=True)
        return code
    held_back(started[index], show)
    others = processes - 1
    if missing and index not in missing:  # it was waiting for processes that never came
        what = (never_joined(missing, processes, init_timeout)
                + f"; process {index} gave up waiting ({describe_exit(code)})")
    else:
        what = f"process {index} of {processes} failed with {describe_exit(code)}"
        what += diagnosis(started[index].tail)
        if code == stall.EXIT_CODE:
            what += f" ({positions})"
    print(f"meshfit: error: {what}" + (f"; stopped the other {others} process(es)" if others else "")
          + (troubleshooting("a-job-hangs") if code == stall.EXIT_CODE else ""), file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def held_back(process: Process, show: str) -> None:
    """Print the last lines of a failed process that were not shown (with --show first, any
    other than process 0's; else those meshfit.launch.output held), before the line naming it."""
    lines = process.output.held_lines.get(process.index, ())
    if show == "first" and process.index != 0:
        lines = process.tail
    for line in list(lines)[-TAIL_LINES:]:
        print(f"[{process.index}] {line}", file=sys.stderr)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """While inside, Ctrl-C, SIGTERM and SIGHUP cannot cut the launcher's last clean-up short."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def finish(processes: list[Process]) -> None:
    """Wait (briefly) until every output line of the processes is printed."""
    for p in processes:
        for pump in p.pumps:
            pump.join(timeout=5)
