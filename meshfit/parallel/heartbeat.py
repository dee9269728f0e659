"""Status files that the processes of a `meshfit launch` job leave for their launcher.

`meshfit launch` gives every process a folder in MESHFIT_LAUNCH_STATUS; without that variable (a
real cluster, a plain run) everything here does nothing. Process i is MESHFIT_PROCESS_ID, or
SLURM_PROCID for the tasks of `meshfit launch --elastic --via srun` (meshfit.launch.slurm_step),
whose folder is on storage every node reads. In the folder, for process i:

  joining-<i>    created when process i starts joining the job (`meshfit.parallel.cluster.join`), so that
                 the launcher can name a process that never arrived; it holds the name of the
                 process's node (SLURMD_NODENAME, else the host name) and its pid, so that a
                 launcher of srun steps can tell which tasks a lost node took along and read
                 the state of the tasks on its own node (a SIGSTOPped one, as launch does);
  progress-<i>   "<steps> <beats> <dispatches> <doing>": the training steps process i has
                 started, its progress reports and its training dispatches so far, and what its
                 main thread is doing (`where()`: compiling, checkpoint, input, device, thread or
                 python).
                 A background thread rewrites it at most once a second, when it changed, and
                 at once as the first and second training dispatches begin, so the launcher's
                 stall watchdog sees when each process last moved, which one is
                 furthest behind and what each waits for; the watchdog starts once a process
                 began its second dispatch (the first, with its compilation, is done by then).

Progress is reported with `advance()` just before each point where a process may wait for the
others (on CPUs a collective's dispatch blocks until every process has reached it): every training
dispatch (meshfit.fit.jax_loop, with its number of steps), every stop vote at a dispatch boundary or
epoch end (meshfit.run.keras_side.checkpoints) and every multi-host predict batch. So a process
that hangs between two such points stays behind the others, which wait at the next one. `advance`
adds two integers on the calling thread; no file I/O there and no device sync. The counts are
kept in every process: meshfit.parallel.stall reads them to tell a stalled process from a slow
one.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from meshfit import env

WRITE_INTERVAL_SECONDS = 1.0  # the progress file is rewritten at most this often
_wake = threading.Event()  # set as the first two dispatches begin: their reports are written at once


def _directory() -> str | None:
    return os.environ.get(env.LAUNCH_STATUS, "").strip() or None


def a_peer_runs_a_callback() -> bool:
    """True where another process of this `meshfit launch` job reports that it runs a Keras
    callback's own code (its progress file, in the launcher's folder this process sees): this
    one may then wait for it in a collective, and is not stalled."""
    directory = _directory()
    return directory is not None and any(
        doing == "callback" for index, (*_, doing) in progress(directory).items() if str(index) != _index())


def _index() -> str:
    for name in (env.PROCESS_ID, "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return "0"


def this_node() -> str:
    """This machine's node name: SLURM's (SLURMD_NODENAME, in a task), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def joining(process_id: int | None) -> None:
    """Leave the marker saying that process `process_id` (None: a detected cluster's, `_index`)
    has started joining the job."""
    directory = _directory()
    if directory is None:
        return
    index = _index() if process_id is None else process_id
    try:
        with open(os.path.join(directory, f"joining-{index}"), "w") as f:
            f.write(f"{this_node()} {os.getpid()}")
    except OSError:  # the launcher's folder is gone: nothing to tell it
        pass


_steps = _beats = _dispatches = 0  # this process's progress, see counts()


def counts() -> tuple[int, int, int]:
    """(training steps started, progress reports, training dispatches) of this process so far."""
    return _steps, _beats, _dispatches


# What the main thread does, by the files its stack runs in. Compiling (or tracing, which can take
# as long) when any frame is in JAX's compiler or tracer; otherwise the innermost frame of a known
# kind decides: a checkpoint that waits for its arrays waits on the device, and so does a batch
# being placed on the devices, while one still being read or decoded is input. A jitted function
# called through JAX's C++ fast path leaves no JAX frame, so the places that call the train, test
# and predict steps and the processes' votes count as device too. Code a Keras callback runs
# (keras/src/callbacks/ calls it; the trainer's frame lies further out) is a callback's own, unless
# it waits on the devices, for input or on a checkpoint itself (innermost frames first): a user's
# callback may take as long as it likes, as in plain Keras (an evaluation job it waits for, a pdb
# prompt). A main thread that waits for another thread (Keras 3 runs batch-end callbacks, which
# read the step's logs, in a thread pool) is doing what the first waiting thread it may wait for does.
_COMPILING = ("/jax/_src/compiler.py", "/jax/_src/interpreters/partial_eval.py")
_KINDS = (
    ("device", ("/jax/_src/", "/jaxlib/", "/keras/src/backend/jax/trainer.py",
                "/meshfit/fit/jax_loop.py", "/meshfit/fit/hosts.py", "/meshfit/parallel/cluster.py")),
    ("checkpoint", ("/orbax/", "/meshfit/run/checkpoint_format.py", "/meshfit/run/sharded_arrays.py",
                    "/meshfit/run/keras_side/checkpoint")),  # checkpoints.py and checkpoint_*.py
    ("input", ("/keras/src/trainers/data_adapters/", "/keras/src/trainers/epoch_iterator.py",
               "/tensorflow/python/data/", "/grain/", "/meshfit/data/", "/meshfit/fit/sources.py")),
    ("callback", ("/keras/src/callbacks/",)),
)
_THREAD_WAITS = ("/threading.py", "/queue.py", "/concurrent/futures/")
# Waiting for the other processes at a call every process makes (before and after fit, evaluate,
# predict): the one that came (e.g. its data ran out a batch early) is no hung one.
_MEETING = ("/meshfit/fit/hosts.py", "meet_every_process")
DOING = {
    "compiling": "compiles a program",
    "checkpoint": "writes or reads a checkpoint",
    "input": "waits for the next batch",
    "device": "waits in a device computation (its collectives) or a transfer",
    "thread": "waits for another thread",
    "callback": "runs a Keras callback's own code",
    "meeting": "waits for the other processes to come to a call every process makes",
    "python": "runs Python code",
}


def where() -> tuple[str, str]:
    """(kind, 'file:line') of what the main thread does now: a kind of DOING, and the innermost
    frame's place, e.g. ('device', 'jax/_src/array.py:642')."""
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident)
    if main is not None and any(part in main.f_code.co_filename.replace(os.sep, "/")
                                for part in _THREAD_WAITS):
        ours = {threading.main_thread().ident, threading.get_ident()} | {
            t.ident for t in threading.enumerate() if t.name.startswith("meshfit-")}
        for ident, frame in frames.items():
            other = _doing(frame) if ident not in ours else ("python", "")
            if other[0] in ("device", "input", "checkpoint", "callback"):
                return other
    return _doing(main)


def _doing(frame) -> tuple[str, str]:
    """(kind, place) of one thread's stack, from its innermost `frame` (see _KINDS)."""
    if frame is None:
        return "python", "?"
    innermost = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
    files, functions = [], []  # innermost first
    while frame is not None:
        files.append(frame.f_code.co_filename.replace(os.sep, "/"))
        functions.append(frame.f_code.co_name)
        frame = frame.f_back
    if any(part in name for name in files for part in _COMPILING):
        return "compiling", innermost
    if any(name.endswith(_MEETING[0]) and function == _MEETING[1]
           for name, function in zip(files, functions)):
        return "meeting", innermost
    for name in files:
        for kind, parts in _KINDS:
            if any(part in name for part in parts):
                return kind, innermost
    if any(part in files[0] for part in _THREAD_WAITS):
        return "thread", innermost
    return "python", innermost


def thread_cpu_seconds(ident: int) -> float | None:
    """CPU seconds the thread `ident` has used (None where the platform cannot tell): a thread
    blocked in a call that does not return uses none, however busy the machine."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return None


def _short(filename: str) -> str:
    """A frame's file from its package on, e.g. 'jax/_src/array.py'."""
    filename = filename.replace(os.sep, "/")
    for package in ("jax/", "jaxlib/", "keras/", "meshfit/", "orbax/", "tensorflow/", "grain/"):
        at = filename.rfind("/" + package)
        if at >= 0:
            return filename[at + 1:]
    return os.path.basename(filename)


class _Reporter:
    """Writes this process's progress counts and what it does to its progress file, from a daemon
    thread."""

    def __init__(self, path: str):
        self.path = path
        threading.Thread(target=self._write_changes, name="meshfit-progress", daemon=True).start()

    def _write_changes(self) -> None:
        written = None
        while True:
            line = " ".join(map(str, (*counts(), where()[0])))
            if line != written:
                try:
                    with open(self.path + ".tmp", "w") as f:
                        f.write(line + "\n")
                    os.replace(self.path + ".tmp", self.path)  # the launcher never reads half a line
                except OSError:
                    return  # the launcher's folder is gone
                written = line
            # The first two dispatches are written at once, not up to a second later: from the
            # first the launcher counts a generation as training (its spares start), and the
            # second begins once the first step is compiled and dispatched (a mesh change's
            # recovery ends there, tools/chaos.py)
            _wake.wait(WRITE_INTERVAL_SECONDS)
            _wake.clear()


_checked = False


def advance(steps: int = 0) -> None:
    """Report progress: `steps` more training steps about to start (0: progress of another kind)."""
    global _checked, _steps, _beats, _dispatches
    if not _checked:
        _checked = True
        directory = _directory()
        if directory is not None:
            _Reporter(os.path.join(directory, f"progress-{_index()}"))
    _beats += 1
    if steps:
        _steps += steps
        _dispatches += 1
        if _dispatches <= 2:
            _wake.set()


# ------------------------------------------------------------------------- the launcher's side

def joined(directory: str) -> set[int]:
    """The indices of the processes that have started joining."""
    return {int(name.split("-", 1)[1]) for name in _names(directory)
            if name.startswith("joining-") and name.split("-", 1)[1].isdigit()}


def nodes(directory: str) -> dict[int, str]:
    """{process index: the node it runs on} of the processes that have started joining."""
    markers = {index: joining_marker(directory, index) for index in joined(directory)}
    return {index: marker[0] for index, marker in markers.items() if marker is not None}


def joining_marker(directory: str, index: int) -> tuple[str, int | None] | None:
    """(node, pid or None) of process `index`'s joining marker; None before it has one."""
    try:
        with open(os.path.join(directory, f"joining-{index}")) as f:
            words = f.read().split()
    except OSError:
        return None
    if not words:  # empty while the process writes it
        return None
    return words[0], int(words[1]) if len(words) > 1 and words[1].isdigit() else None


def progress(directory: str) -> dict[int, tuple[int, int, int, str]]:
    """{process index: (training steps started, progress reports, training dispatches, what it
    does)} of the processes that reported."""
    found = {}
    for name in _names(directory):
        index = name.split("-", 1)[1] if name.startswith("progress-") else ""
        if not index.isdigit():
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                steps, beats, dispatches, doing = f.read().split()
            found[int(index)] = (int(steps), int(beats), int(dispatches), doing)
        except (OSError, ValueError):
            continue
    return found


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []
