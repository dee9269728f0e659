"""One process of a job `meshfit launch` starts on this machine: its Popen (it dies with the
launcher, Linux's PR_SET_PDEATHSIG), its output pumped to the launcher's as meshfit.launch.output
allows, its last lines kept to tell why it failed, signals to its whole process group.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from typing import IO

from meshfit.launch.output import Output, ended_abnormally

KEPT_LINES = 200  # lines of each process's output kept to find why it failed
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# gloo prints such a line as devices first run a collective: noise, kept out of the output of
# commands that join a job without meshfit (meshfit's join() turns C++'s std::cout off)
GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def death_signal():
    """A function for Popen's preexec_fn that makes the child get SIGKILL when this process dies
    (Linux prctl PR_SET_PDEATHSIG); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    launcher = os.getpid()

    def die_with_launcher() -> None:  # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(1)

    return die_with_launcher


def dies_with(launcher: int) -> None:
    """In a process started without death_signal (a spare, meshfit.launch.spares, started while
    the launcher has threads: no preexec_fn then): get SIGKILL when `launcher`, its parent, dies;
    exit at once if it has already (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:
        os._exit(1)


def proc_state(pid: int) -> str | None:
    """Process `pid`'s state letter in /proc (R, S, T, t, Z...), None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Process:
    """One launched process: its Popen, its output pumps and its last lines.

    Start every process before calling `start_pumps` (Popen's preexec_fn must run while this
    program has no other threads). popen: a process started already (a spare handed this place,
    meshfit.launch.spares), instead of starting `argv`.
    """

    def __init__(self, index: int, argv: list[str], env: dict[str, str], show: bool, prefix: str,
                 lock: threading.Lock, output: Output, popen: subprocess.Popen | None = None):
        self.index = index
        self.killed = False  # the launcher SIGKILLed it while it ran (after the grace period)
        self.tail: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
        self.output = output
        self.popen = popen or subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=death_signal())
        self.pumps = [threading.Thread(target=self._pump, args=(stream, out, show, prefix, lock), daemon=True)
                      for stream, out in ((self.popen.stdout, sys.stdout), (self.popen.stderr, sys.stderr))]

    def start_pumps(self, exits: queue.Queue) -> None:
        """Copy the output as it comes; put (index, exit code) on `exits` when the process ends."""
        for pump in self.pumps:
            pump.start()
        threading.Thread(target=lambda: exits.put((self.index, self.popen.wait())), daemon=True).start()

    def _pump(self, stream: IO[bytes], out: IO[str], show: bool, prefix: str, lock: threading.Lock):
        def emit(text: str) -> None:
            with lock:
                out.write(f"{prefix}{text}\n")
                out.flush()

        reports = self.index == 0 and out is sys.stdout  # where process 0 prints its device report
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            self.tail.append(line)
            if reports and self.output.condensed(line, emit):
                continue
            if show and not GLOO_CONNECTED.match(line) and self.output.shown(self.index, line):
                emit(line)
        if reports:
            self.output.flush(emit)

    def stopped(self) -> bool:
        """Whether the process is stopped now (SIGSTOP, SIGTSTP: its state T in /proc; or held by
        a tracer, t; False where there is no /proc)."""
        return self.state() in ("T", "t")

    def state(self) -> str | None:
        """The process's state letter in /proc (R, S, T, t, Z...), None where there is none."""
        return proc_state(self.popen.pid)

    def failed(self) -> bool:
        """Whether the process has ended with an error or a signal (meshfit.launch.output)."""
        return ended_abnormally(self.popen.pid, self.popen.returncode)

    def signal(self, signum: int) -> None:
        """Send `signum` to the process and everything it started."""
        # returncode, not poll(): poll() says None while the exit thread waits for the process
        if signum == signal.SIGKILL and self.popen.returncode is None:
            self.killed = True
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
