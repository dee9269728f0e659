"""`meshfit launch`: run N processes of a multi-host job on this machine, for testing and CPU work.

    meshfit launch --processes 2 --devices-per-process 4 -- meshfit train fashion-mnist-cnn

starts N copies of COMMAND wired to a coordinator on 127.0.0.1 (MESHFIT_COORDINATOR,
MESHFIT_NUM_PROCESSES, MESHFIT_PROCESS_ID set per process, MESHFIT_SIMULATE_DEVICES=M), prefixes
each output line with "[i] " (or shows only process 0's output, and the others' when they fail),
and waits. When a process exits non-zero or is killed, the others get SIGTERM and, after
`GRACE_SECONDS`, SIGKILL; the launch then exits non-zero with one line naming that process. On a
real multi-host job run the same command on every host instead (see README).
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from meshfit import env
from meshfit.errors import MeshfitError

GRACE_SECONDS = 10.0  # between SIGTERM and SIGKILL when stopping the other processes
TAIL_LINES = 20  # lines of a failed process's output shown when only process 0 is shown
INIT_TIMEOUT_SECONDS = 120  # local processes start together, so joining should be quick


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(command: Sequence[str]) -> list[str]:
    """COMMAND as run: a leading `meshfit` becomes this Python's `-m meshfit`."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise MeshfitError("no command to launch; give one after --, e.g. "
                           "meshfit launch --processes 2 -- meshfit train")
    if command[0] == "meshfit":
        return [sys.executable, "-m", "meshfit", *command[1:]]
    return command


def process_environment(index: int, processes: int, port: int, devices_per_process: int,
                        base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of process `index`: the job's MESHFIT_* variables over `base`."""
    variables = dict(os.environ if base is None else base)
    variables.pop(env.LOCAL_DEVICE_IDS, None)
    variables.update({
        env.COORDINATOR: f"127.0.0.1:{port}",
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


class _Process:
    """One launched process: its Popen, its output pumps and its last lines."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str], show: bool, prefix: str,
                 lock: threading.Lock):
        self.index = index
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        self.pumps = [threading.Thread(target=self._pump, args=(stream, out, show, prefix, lock), daemon=True)
                      for stream, out in ((self.popen.stdout, sys.stdout), (self.popen.stderr, sys.stderr))]
        for pump in self.pumps:
            pump.start()

    def _pump(self, stream: IO[bytes], out: IO[str], show: bool, prefix: str, lock: threading.Lock):
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.tail.append(line)
            if show:
                with lock:
                    out.write(f"{prefix}{line}\n")
                    out.flush()

    def signal(self, signum: int) -> None:
        """Send `signum` to the process and everything it started."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(processes: list[_Process], grace: float) -> None:
    """SIGTERM every running process, SIGKILL those still running after `grace` seconds."""
    running = [p for p in processes if p.popen.poll() is None]
    for p in running:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)
    for p in running:
        p.signal(signal.SIGKILL)  # anything the process left behind in its group
        p.popen.wait()


def launch(command: Sequence[str], processes: int, devices_per_process: int = 1,
           port: int | None = None, show: str = "all", timeout: float | None = None,
           grace: float = GRACE_SECONDS) -> int:
    """Run `processes` copies of `command` as one job; return 0, or non-zero naming a failure.

    show: "all" prefixes every line with "[i] "; "first" shows process 0's lines as they are and
    the last lines of any other process that fails. timeout: stop everything after so many
    seconds (None: no limit). A process dying stops the others within `grace` seconds.
    """
    if processes < 1:
        raise MeshfitError(f"--processes must be at least 1, got {processes}")
    if devices_per_process < 1:
        raise MeshfitError(f"--devices-per-process must be at least 1, got {devices_per_process}")
    if timeout is not None and timeout <= 0:
        raise MeshfitError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    if show not in ("all", "first"):
        raise MeshfitError(f"unknown --show {show!r}; use all or first")
    argv = command_line(command)
    port = port or free_port()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # a stopped launch stops its processes too
    lock = threading.Lock()
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    started: list[_Process] = []
    try:
        for i in range(processes):
            env = process_environment(i, processes, port, devices_per_process)
            shown = show == "all" or i == 0
            prefix = f"[{i}] " if show == "all" else ""
            try:
                started.append(_Process(i, argv, env, shown, prefix, lock))
            except OSError as e:
                raise MeshfitError(f"cannot start {argv[0]!r} ({e.strerror}); check the command after --") from None
            p = started[-1]
            threading.Thread(target=lambda p=p: exits.put((p.index, p.popen.wait())), daemon=True).start()
        print(f"meshfit launch: {processes} process(es) x {devices_per_process} device(s), coordinator "
              f"127.0.0.1:{port}, pids {' '.join(str(p.popen.pid) for p in started)}",
              file=sys.stderr, flush=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        failure = None
        for _ in range(processes):
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                index, code = exits.get(timeout=wait)
            except queue.Empty:
                _stop(started, grace)
                _finish(started)
                print(f"meshfit: error: the job ran past --timeout {timeout:g} s; stopped all "
                      f"{processes} processes", file=sys.stderr, flush=True)
                return 124
            if code != 0 and failure is None:
                failure = (index, code)
                _stop(started, grace)
    finally:
        _stop(started, grace)  # on Ctrl-C or any error, leave nothing running
    _finish(started)
    if failure is None:
        return 0
    index, code = failure
    if show == "first" and index != 0:
        for line in started[index].tail:
            print(f"[{index}] {line}", file=sys.stderr)
    others = processes - 1
    print(f"meshfit: error: process {index} of {processes} failed with {describe_exit(code)}"
          + (f"; stopped the other {others} process(es)" if others else ""), file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _finish(processes: list[_Process]) -> None:
    """Wait (briefly) until every output line of the processes is printed."""
    for p in processes:
        for pump in p.pumps:
            pump.join(timeout=5)
