"""The stall guard: a process whose training stops moving ends with one line, never a hang or SIGABRT.

While meshfit trains (`watching()`: Keras' fit, evaluate and predict under a meshfit strategy on
JAX, entered by meshfit.fit.hooks, and the whole of `meshfit train` after connecting), a daemon
thread looks once a second at the progress counts (every training, test and predict dispatch
reports, meshfit.parallel.heartbeat.advance) and at the main thread. Time counts as stalled only
while nothing moves and the main thread is blocked: it used no CPU that second (a slow step on a
busy machine still gets some), is not compiling or tracing (which can take minutes) and is not
in a Keras callback's own code (a user's callback may wait as long as it likes, as in plain Keras:
for an evaluation job, an upload, a pdb prompt), nor waiting while another process of a `meshfit
launch` job on this machine is (its progress file says so). After
MESHFIT_STALL_TIMEOUT seconds (default 600, 0: never) of stall the process prints one line naming
what the main thread waits for (heartbeat.where: a device computation, the next batch, a
checkpoint, another thread), e.g.

    meshfit: error: stalled for 600 s after 12 training steps: the main thread waits in a device
    computation (its collectives) or a transfer at meshfit/fit/jax_loop.py:141 and used 0.1 s of
    CPU meanwhile (...); its committed checkpoints are intact: continue with meshfit train --resume RUN

and exits with code 124. Next to no CPU used means a deadlock; much means work that never ended.
A checkpoint being written then is left uncommitted and ignored on resume, so the last committed
one is what `--resume` continues from (meshfit.run.keras_side.checkpoints).

XLA:CPU ends a process itself (SIGABRT, nothing saved) when a collective waits 40 s; with
simulated devices meshfit moves that limit behind the guard's (`xla_collective_timeouts`, set by
meshfit.parallel.devices before JAX starts), so the guard speaks first.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from typing import Iterator

from meshfit import env, errors
from meshfit.parallel import heartbeat

DEFAULT_SECONDS = 600
EXIT_CODE = 124  # as timeout(1) and meshfit launch's own stall verdict
XLA_ABORT_MARGIN_SECONDS = 120  # XLA's abort comes this long after the guard's line would
CHECK_SECONDS = 1.0
LAUNCHER_FIRST_SECONDS = 30  # under meshfit launch, whose watchdog names the process furthest behind
LINE = "meshfit: error: stalled for "  # how the guard's line begins (meshfit launch looks for it)
WORKING_CPU_SECONDS = 0.01  # a main thread using less CPU in a second is blocked

_FIXES = {
    "input": "make the input faster or check that its source still answers",
    "checkpoint": "check that the run folder's disk is writable and not full",
}


def timeout_seconds() -> int:
    """Seconds without progress before a process counts as stalled ($MESHFIT_STALL_TIMEOUT; 0: never)."""
    seconds = env.read_int(env.STALL_TIMEOUT, example=DEFAULT_SECONDS)
    return DEFAULT_SECONDS if seconds is None else seconds


def xla_collective_timeouts() -> dict[str, int]:
    """XLA:CPU flags that keep its own stuck-collective warning and abort behind the guard's
    timeout ({} when the guard is off: XLA's defaults then stand)."""
    seconds = timeout_seconds()
    if not seconds:
        return {}
    return {"--xla_cpu_collective_call_warn_stuck_timeout_seconds": seconds,
            "--xla_cpu_collective_call_terminate_timeout_seconds": seconds + XLA_ABORT_MARGIN_SECONDS}


_lock = threading.Lock()
_depth = 0  # how many watching() blocks are open (fit may call evaluate inside)
_guard: threading.Thread | None = None
_resume_hint = ""


def set_resume_hint(hint: str) -> None:
    """What the stall line tells the user to do next, e.g. 'continue with meshfit train --resume RUN'."""
    global _resume_hint
    _resume_hint = hint


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Guard the block: a stall inside it ends the process with one line (see the module)."""
    global _depth, _guard
    seconds = timeout_seconds()
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    if os.environ.get(env.LAUNCH_STATUS):  # meshfit launch sees every process: it speaks first
        seconds += LAUNCHER_FIRST_SECONDS
    with _lock:
        _depth += 1
        if _guard is None:
            _guard = threading.Thread(target=_guard_loop, args=(seconds,), name="meshfit-stall-guard",
                                      daemon=True)
            _guard.start()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _guard_loop(seconds: float) -> None:
    """Once a second: is the main thread blocked without progress? Ends the process after `seconds`
    of that."""
    main = threading.main_thread().ident
    last, since, cpu, main_cpu = None, time.monotonic(), _cpu_seconds(), None
    while True:
        time.sleep(CHECK_SECONDS)
        now = time.monotonic()
        kind, at = heartbeat.where()
        moved, was = heartbeat.counts(), main_cpu
        main_cpu = heartbeat.thread_cpu_seconds(main)
        # Working, not stalled: the main thread used CPU this second (a slow step on a busy
        # machine still gets some), or, where threads' CPU time is unknown, runs Python.
        working = (kind == "python" if main_cpu is None or was is None
                   else main_cpu - was >= WORKING_CPU_SECONDS)
        if (_depth == 0 or moved != last or kind in ("compiling", "callback") or working
                or heartbeat.a_peer_runs_a_callback()):
            last, since, cpu = moved, now, _cpu_seconds()
        elif now - since >= seconds:
            _stop(now - since, kind, at, _cpu_seconds() - cpu, moved[0])


def _stop(stalled: float, kind: str, at: str, cpu: float, steps: int) -> None:
    """Print the stall line and end the process (code EXIT_CODE)."""
    fix = _FIXES.get(kind, "a collective whose peers never came, or a device that stopped answering")
    doing = "is blocked in a call that never returns" if kind == "python" else heartbeat.DOING[kind]
    line = (f"{LINE}{stalled:.0f} s after {steps} training steps: the main "
            f"thread {doing} at {at} and used {cpu:.1f} s of CPU meanwhile ({fix}; "
            f"{env.STALL_TIMEOUT}={timeout_seconds()})")
    if _resume_hint:
        line += f"; {_resume_hint}"
    line += errors.troubleshooting("a-job-hangs")
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)
