"""Status files that the processes of a `meshfit launch` job leave for their launcher.

`meshfit launch` gives every process a folder in MESHFIT_LAUNCH_STATUS; without that variable (a
real cluster, a plain run) everything here does nothing. In the folder, for process i:

  joining-<i>    created when process i starts joining the job (`meshfit.parallel.cluster.join`), so that
                 the launcher can name a process that never arrived;
  progress-<i>   "<steps> <beats> <dispatches>": the training steps process i has started, its
                 progress reports and its training dispatches so far. A background thread rewrites
                 it at most once a second, when it changed, so the launcher's stall watchdog sees
                 when each process last moved and which one is furthest behind; the watchdog
                 starts once a process began its second dispatch (the first, with its
                 compilation, is done by then).

Progress is reported with `advance()` just before each point where a process may wait for the
others (on CPUs a collective's dispatch blocks until every process has reached it): every training
dispatch (meshfit.fit.jax_loop, with its number of steps), every stop vote at a dispatch boundary or
epoch end (meshfit.run.checkpoints) and every multi-host predict batch. So a process that hangs between
two such points stays behind the others, which wait at the next one. `advance` adds two integers
on the calling thread; no file I/O there and no device sync.
"""

from __future__ import annotations

import os
import threading
import time

from meshfit import env

WRITE_INTERVAL_SECONDS = 1.0  # the progress file is rewritten at most this often


def _directory() -> str | None:
    return os.environ.get(env.LAUNCH_STATUS, "").strip() or None


def _index() -> str:
    return os.environ.get(env.PROCESS_ID, "0").strip() or "0"


def joining(process_id: int | None) -> None:
    """Leave the marker saying that process `process_id` has started joining the job."""
    directory = _directory()
    if directory is None or process_id is None:
        return
    try:
        with open(os.path.join(directory, f"joining-{process_id}"), "w"):
            pass
    except OSError:  # the launcher's folder is gone: nothing to tell it
        pass


class _Reporter:
    """This process's progress counts, written to its progress file by a daemon thread."""

    def __init__(self, path: str):
        self.path = path
        self.steps = 0
        self.beats = 0
        self.dispatches = 0
        threading.Thread(target=self._write_changes, name="meshfit-progress", daemon=True).start()

    def _write_changes(self) -> None:
        written = None
        while True:
            counts = (self.steps, self.beats, self.dispatches)
            if counts != written:
                try:
                    with open(self.path + ".tmp", "w") as f:
                        f.write(" ".join(map(str, counts)) + "\n")
                    os.replace(self.path + ".tmp", self.path)  # the launcher never reads half a line
                except OSError:
                    return  # the launcher's folder is gone
                written = counts
            time.sleep(WRITE_INTERVAL_SECONDS)


_reporter: _Reporter | None = None
_checked = False


def advance(steps: int = 0) -> None:
    """Report progress: `steps` more training steps about to start (0: progress of another kind)."""
    global _reporter, _checked
    if not _checked:
        _checked = True
        directory = _directory()
        if directory is not None:
            _reporter = _Reporter(os.path.join(directory, f"progress-{_index()}"))
    if _reporter is not None:
        _reporter.beats += 1
        if steps:
            _reporter.steps += steps
            _reporter.dispatches += 1


# ------------------------------------------------------------------------- the launcher's side

def joined(directory: str) -> set[int]:
    """The indices of the processes that have started joining."""
    return {int(name.split("-", 1)[1]) for name in _names(directory)
            if name.startswith("joining-") and name.split("-", 1)[1].isdigit()}


def progress(directory: str) -> dict[int, tuple[int, int, int]]:
    """{process index: (training steps started, progress reports, training dispatches)} of the
    processes that reported."""
    found = {}
    for name in _names(directory):
        index = name.split("-", 1)[1] if name.startswith("progress-") else ""
        if not index.isdigit():
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                steps, beats, dispatches = (int(n) for n in f.read().split())
        except (OSError, ValueError):
            continue
        found[int(index)] = (steps, beats, dispatches)
    return found


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []
