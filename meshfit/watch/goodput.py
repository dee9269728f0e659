"""Where a run's wall time goes: the goodput ledger of this process.

Goodput = training-step time / wall time. The ledger splits the process's wall time, from the
moment the operating system started it, into parts:

  startup     imports, device discovery, joining hosts: until connect() has returned;
  setup       loading the data, building the model, planning: until the first training dispatch;
  compile     tracing, lowering and compiling XLA programs (JAX's own compile events);
  train       the training loop, minus what is counted apart below (the goodput);
  input_wait  time the devices had no step to run because the next batch was not ready;
  eval        evaluation (validation each epoch, the test set at the end);
  checkpoint  checkpoint writes and restores that blocked training;
  lost        time lost to interruptions: steps run again after a resume (their count is
              "lost_steps"), and the gap between the last sign of life of a stopped run and its
              restart (a `meshfit launch --elastic` mesh change is such a resume);
  other       everything else (callbacks' own work outside the loop, writing the results, the
              user's own code between fits).

Time is charged to one part at a time, the innermost `part()` open (else the base part that
`switch()` sets), so the parts add up to the wall time by construction; `move()` re-labels time
already charged (compile events, input waits) without creating or losing any. Summed over
sessions, a resumed run's parts add up to its wall time from its first start, interruptions
included. Light: no Keras or JAX here (meshfit.fit.hooks feeds it the loop's figures).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import threading
import time
from typing import Any, Iterator

from meshfit.errors import MeshfitError
from meshfit.files import atomic_path

PARTS = ("startup", "setup", "compile", "train", "input_wait", "eval", "checkpoint", "lost", "other")
LABELS = {"input_wait": "input wait"}
COLORS = {"train": "#2ca02c", "compile": "#ff7f0e", "input_wait": "#d62728", "eval": "#1f77b4",
          "checkpoint": "#9467bd", "startup": "#8c564b", "setup": "#e377c2", "lost": "#000000",
          "other": "#c7c7c7"}  # the parts' colours in meshfit's figures
INPUT_BOUND = 0.10  # input wait above this fraction of the step time prints the input-bound line
# A run's ledger file is rewritten at most this often while it trains: its steps done are what a
# resume counts as run again, so a lost process's count lags by at most this (a small file)
PERSIST_SECONDS = 0.5
FILE = "goodput.json"  # in the run directory (process i > 0: goodput-<i>.json)


def process_start_time() -> float:
    """When the operating system started this process (time.time() scale), from /proc on Linux
    (10 ms resolution); elsewhere, when this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5): start time after boot, in ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class Ledger:
    """The parts of this process's wall time (seconds), and the training steps it dispatched.

    start: the process's start (time.time() scale). A resumed run adds what its earlier sessions
    measured (`earlier`), with the lost time of the interruption in it.
    """

    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else start
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.earlier: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.earlier_wall = 0.0
        self.sessions = 1
        self.steps = 0  # training steps dispatched in this process
        self.earlier_steps = 0  # training steps of the earlier sessions (a resumed run's)
        self.first_step = 0  # the run's global step this process started from (a resume's)
        self.lost_steps = 0  # steps run again after the resumes of this run (earlier sessions')
        self.persist_to: str | None = None
        self.owner: str | None = None  # "run" while meshfit train's run owns the ledger
        self.finished = False  # the run wrote its results: a later --resume extends it
        self._base = "startup"
        self._stack: list[str] = []
        self._since = self.start
        self._written = 0.0
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- charging time to parts
    def _charge(self, now: float) -> None:
        current = self._stack[-1] if self._stack else self._base
        self.seconds[current] += now - self._since
        self._since = now

    def switch(self, part: str) -> dict[str, float]:
        """From now on, time outside any open `part()` goes to `part`. Returns the parts charged
        up to the switch (as `charged()` would at that instant): a window's edge read in the same
        step, so no time falls between the edge and the switch."""
        with self._lock:
            self._charge(time.time())
            self._base = part
            return dict(self.seconds)

    @property
    def base(self) -> str:
        return self._base

    @property
    def current(self) -> str:
        """The part time is charged to now."""
        with self._lock:
            return self._stack[-1] if self._stack else self._base

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to `name` (nested blocks: to the innermost)."""
        with self._lock:
            self._charge(time.time())
            self._stack.append(name)
        try:
            yield
        finally:
            with self._lock:
                self._charge(time.time())
                self._stack.pop()

    def move(self, seconds: float, to: str, source: str | None = None) -> None:
        """Re-label `seconds` just spent in the current part (or in `source`) as `to` (e.g. a
        compilation)."""
        if seconds <= 0:
            return
        with self._lock:
            current = source or (self._stack[-1] if self._stack else self._base)
            if current != to:
                self.seconds[to] += seconds
                self.seconds[current] -= seconds

    def charged(self) -> dict[str, float]:
        """This process's parts charged up to now (seconds; the earlier sessions' not added): the
        epoch report reads its figures as differences of these (meshfit.watch.keras_side.epoch_clock)."""
        with self._lock:
            self._charge(time.time())
            return dict(self.seconds)

    # ------------------------------------------------------------------------- reading it
    def totals(self, now: float | None = None) -> dict[str, Any]:
        """{"fraction", "seconds": {part: s}, "wall_seconds", "sessions"}: this process's parts
        up to `now` (default: now) plus the earlier sessions'."""
        with self._lock:
            now = time.time() if now is None else now
            self._charge(now)
            seconds = {p: self.seconds[p] + self.earlier[p] for p in PARTS}
            wall = (now - self.start) + self.earlier_wall
        return summary(seconds, wall, self.sessions, self.lost_steps)

    # -------------------------------------------------------------- a run's file, resumes
    def tick(self) -> None:
        """Called once per training dispatch: rewrite the run's ledger file when due."""
        if self.persist_to is not None and time.time() - self._written >= PERSIST_SECONDS:
            self.write()

    def write(self) -> None:
        """Write the ledger to `persist_to` (atomically), with the global step reached, so that
        a resumed run can count what the interruption lost."""
        if self.persist_to is None:
            return
        now = time.time()
        record = {**self.totals(now), "written_at": now, "steps_done": self.first_step + self.steps,
                  "train_steps": self.steps + self.earlier_steps, "finished": self.finished}
        # A read-only or vanished run directory: accounting never stops training, nor leaves a
        # file behind (atomic_path removes its temporary), nor makes the folder again: a run that
        # failed to start (its config.json unwritable) is started again with the same --out,
        # which refuses a folder of other files.
        with contextlib.suppress(MeshfitError, OSError), \
                atomic_path(self.persist_to, ".json", make_folder=False) as tmp, open(tmp, "w") as f:
            json.dump(record, f)
        self._written = now

    def resume(self, path: str, checkpoint_step: int,
               checkpoint_train: float | None = None) -> dict[str, float] | None:
        """Continue the ledger a stopped run left at `path`, from the global step
        `checkpoint_step` its checkpoint holds: its parts count as earlier sessions', and the
        lost time is added (the training after the checkpoint, and the gap from its last write
        to this process's start). Returns what was lost, or None where the run left no readable
        ledger (a run trained before meshfit counted goodput).

        checkpoint_train: the training seconds the checkpoint's history holds (its epochs' and
        the epoch in progress'); the earlier sessions' train part is then exactly that, as the
        epoch lines count it: what the ledger charged beyond it was trained again (lost), what
        it lacks was trained after the ledger's last write (taken from the gap; a process of a
        later elastic generation continues its own file, which may predate generations it had
        no part in). Without it, the steps dispatched after the checkpoint are lost at their
        mean step time."""
        try:
            with open(path) as f:
                saved = json.load(f)
            seconds = {p: float(saved["seconds"].get(p, 0.0)) for p in PARTS}
            wall, written = float(saved["wall_seconds"]), float(saved["written_at"])
            steps_done, train_steps = int(saved["steps_done"]), int(saved.get("train_steps", 0))
            lost_before = int(saved.get("lost_steps", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        # A finished run extended with --epochs lost nothing: the time between is no one's.
        finished = bool(saved.get("finished"))
        gap = 0.0 if finished else max(self.start - written, 0.0)
        redone = 0 if finished else max(steps_done - checkpoint_step, 0)
        behind = 0.0  # training in the gap, after the ledger's last write
        if checkpoint_train is not None and not finished:
            recomputed = max(seconds["train"] - checkpoint_train, 0.0)
            behind = min(max(checkpoint_train - seconds["train"], 0.0), gap)
        else:
            step_seconds = seconds["train"] / train_steps if train_steps else 0.0
            recomputed = min(redone * step_seconds, seconds["train"])
        seconds["train"] += behind - recomputed
        seconds["lost"] += recomputed + gap - behind
        with self._lock:
            self.earlier = seconds
            self.earlier_wall = wall + gap
            self.earlier_steps = max(train_steps - redone, 0)
            self.sessions = int(saved.get("sessions", 1)) + 1
            self.first_step = checkpoint_step
            self.lost_steps = lost_before + redone
        return {"gap_seconds": gap - behind, "recomputed_steps": redone, "recomputed_seconds": recomputed}


def summary(seconds: dict[str, float], wall: float, sessions: int = 1,
            lost_steps: int = 0) -> dict[str, Any]:
    """The goodput block of metrics.json from the parts' seconds and the wall time (lost_steps:
    the training steps run again after resumes, whose time is in the "lost" part)."""
    seconds = {p: float(seconds.get(p, 0.0)) for p in PARTS}  # plain floats: numpy's are not JSON
    wall = float(wall)
    return {"fraction": seconds["train"] / wall if wall > 0 else None,
            "seconds": {p: round(v, 4) for p, v in seconds.items()},
            "wall_seconds": round(wall, 4), "sessions": int(sessions), "lost_steps": int(lost_steps)}


_ledger: Ledger | None = None
# Whether this process's engine reports its compilations to the ledger (JAX's compile events, set
# by meshfit.fit.hooks); where not (TensorFlow), the epoch report estimates them from the first step.
compile_events = False


def ledger() -> Ledger:
    """This process's ledger (made on first use; it counts from the process's start)."""
    global _ledger
    if _ledger is None:
        _ledger = Ledger()
    return _ledger


def count_from_now() -> None:
    """This process's ledger counts from now, not from the process's start: a spare
    (meshfit.launch.spares) handed its run after waiting, its imports done (the wait is no part
    of the run's time)."""
    global _ledger
    _ledger = Ledger(start=time.time())


def begin_run() -> Ledger:
    """The ledger for a run starting now: this process's own when nothing has trained in it yet
    (it counts from the process's start, imports included), else a fresh one from now (a second
    train() in the same Python process)."""
    global _ledger
    if _ledger is not None and (_ledger.steps or _ledger.owner or _ledger.base != "startup"):
        _ledger = Ledger(start=time.time())
    return ledger()


def end_run() -> None:
    """The run that owned the ledger is over: later fits in this process report on their own."""
    current = ledger()
    current.owner, current.persist_to = None, None


def quick_exit() -> None:
    """Make this process's exit quick: once every later-registered atexit handler has run (they
    run last-in first-out, so call this early), collect the garbage there is, then freeze the heap.

    Why: after the atexit handlers, CPython's teardown clears every module and runs its cyclic
    garbage collector over the whole heap several times; with TensorFlow, JAX and Keras loaded
    that is about 0.5 million objects and took 1.3-2.9 s (perf: gc_collect_main and the
    deallocations it starts) on a loaded 2-core CPU, after metrics.json was written, where no
    ledger saw it. Frozen objects are skipped by the collector (gc.freeze): the collection here
    takes 0.25 s and the teardown 0.2 s. Nothing is skipped but those collections: every atexit handler (orbax's, JAX's
    distributed shutdown), the wait for non-daemon threads, the modules' clearing, the objects
    freed by reference counting (open files flushed and closed) and the libraries' destructors
    still run, and the collection made here first runs the finalizers of whatever garbage there
    is by then. Only garbage made during the teardown itself, in reference cycles, is left to the
    operating system to reclaim, as memory."""
    global _quick_exit_registered
    if not _quick_exit_registered:
        _quick_exit_registered = True
        atexit.register(_freeze_for_exit)


_quick_exit_registered = False


def _freeze_for_exit() -> None:
    gc.collect()
    gc.freeze()


def run_file(run: str, process_index: int = 0) -> str:
    """The path of process `process_index`'s ledger file in the run directory `run`."""
    return os.path.join(run, FILE if process_index == 0 else f"goodput-{process_index}.json")


def slowest(per_host: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's goodput from each host's: the host with the lowest fraction, with all hosts'
    blocks under "hosts" and its index under "host"."""
    worst = min(range(len(per_host)), key=lambda i: per_host[i]["fraction"] or 0.0)
    return {**per_host[worst], "host": worst, "hosts": per_host}


# -------------------------------------------------------------------------------- text

def input_fix(source: str | None, steps_per_dispatch: int = 1, platform: str = "cpu") -> str:
    """The change that helps an input-bound run, by its kind of source: 'folder' (images
    decoded from disk), 'generator' (a Python generator or iterator), 'pydataset', 'tf.data',
    'grain', 'preprocessor' (a keras-hub task's own pipeline of its preprocessor), 'arrays' (in
    memory)."""
    fixes = {
        "folder": "decode with more workers (the folder source's workers=N; by default one per "
                  "core this process may use) or store the images at the training size",
        "generator": "produce batches ahead of the step: a keras.utils.PyDataset with workers=N, "
                     "a tf.data pipeline with .prefetch(), or grain with worker processes",
        "pydataset": "raise the PyDataset's workers (and use_multiprocessing=True for Python-heavy "
                     "decoding)",
        "tf.data": "add .cache() and .prefetch(tf.data.AUTOTUNE) and map with "
                   "num_parallel_calls=tf.data.AUTOTUNE",
        "grain": "raise the grain pipeline's worker count (mp_prefetch) and read-ahead",
        "preprocessor": "run the model's preprocessor once before training (x, y, sample_weight "
                        "= model.preprocessor(data)) and fit a task built with preprocessor=None "
                        "on its output, or give fit a pipeline of your own with workers (grain, "
                        "tf.data)",
        "arrays": "keep the arrays on the devices (meshfit train does: data.arrays) or pass a "
                  "tf.data.Dataset with .prefetch()",
    }
    fix = fixes.get(source or "", "prefetch batches ahead of the step (more loader workers, a "
                                   "cached or on-device pipeline)")
    if steps_per_dispatch == 1 and platform != "cpu":
        fix += "; a larger --steps-per-dispatch (steps_per_execution) hides per-step overhead"
    return fix


def input_bound_line(wait: float, step_time: float, source: str | None,
                     steps_per_dispatch: int = 1, platform: str = "cpu") -> str | None:
    """One line when input wait exceeds INPUT_BOUND of the step time (wait + train), else None."""
    if step_time <= 0 or wait / step_time <= INPUT_BOUND:
        return None
    return (f"meshfit: input-bound: the devices waited for the next batch {wait / step_time:.0%} "
            f"of the step time; {input_fix(source, steps_per_dispatch, platform)}")


def format_block(goodput: dict[str, Any], mfu: float | None = None,
                 peak: dict[str, Any] | None = None) -> str:
    """The end-of-run block: goodput, each part's seconds and share of the wall time as a bar,
    and MFU with the peak it is measured against and where that peak comes from."""
    wall, seconds = goodput["wall_seconds"], goodput["seconds"]
    sessions = goodput.get("sessions", 1)
    over = f", {sessions} sessions" if sessions > 1 else ""
    if "hosts" in goodput:  # the job's figure is one host's: say which (the epoch lines are host 0's)
        over += f"; host {goodput['host']}, the slowest of {len(goodput['hosts'])}"
    fraction = goodput["fraction"] or 0.0
    lines = [f"goodput {fraction:.1%}: training steps took {seconds['train']:.1f} s of "
             f"{wall:.1f} s wall time{over}"]
    for part in PARTS:
        value = seconds[part]
        share = value / wall if wall > 0 else 0.0
        lines.append(f"  {LABELS.get(part, part):<11}{value:>9.2f} s {share:>6.1%}  "
                     f"{'#' * round(40 * max(share, 0.0))}")
    if "hosts" in goodput:  # each host's train and compile: host 0's are the epoch lines' and
        # metrics.json's train_seconds and compile_seconds, which the parts above need not be
        lines.append("  per host: " + "; ".join(
            f"{i}: {h['fraction'] or 0:.1%}, train {h['seconds']['train']:.2f} s, compile "
            f"{h['seconds']['compile']:.2f} s" + (" (the epoch lines')" if i == 0 else "")
            + (" (slowest)" if i == goodput["host"] else "") for i, h in enumerate(goodput["hosts"])))
    lines.append(mfu_line(mfu, peak))
    return "\n".join(lines)


def mfu_line(mfu: float | None, peak: dict[str, Any] | None) -> str:
    """'MFU 23.1% of 1.2 TFLOP/s (float32 peak, <source>)', or why it is n/a."""
    if not peak or not peak.get("flops"):
        return "  MFU n/a (no peak FLOP/s known for these devices)"
    shown = f"{mfu:.1%}" if mfu is not None else "n/a (no FLOP count for this model's step)"
    return (f"  MFU {shown} of {peak['flops'] / 1e12:.3g} TFLOP/s ({peak.get('precision', '')} "
            f"peak, {peak['source']})")
