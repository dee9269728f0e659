"""Which of its processes' lines the launcher shows: a lost process is one line (the launcher's),
not the survivors' ends, and a generation after the first reports its devices in one line.

When a process of a job dies, its peers end too, and loudly: a collective with a lost peer
raises (gloo: "Connection reset by peer"), JAX's coordination service aborts every process once a
task is lost or silent (`F... client.h:80] Terminating process because the JAX distributed
service detected fatal errors`, `*** Check failure stack trace ***`, the C++ frames, GRPC's
errors, Python's "Fatal Python error: Aborted" dump: about 10 lines a survivor), and a process
that the launcher stops (SIGTERM) says "training stopped by SIGTERM ...; continue with: meshfit
train --resume RUN", though an elastic launcher resumes by itself. `Output.shown` keeps a line out
of sight (in the process's tail only: the launcher's diagnosis reads it there, and a job that
stops for good prints the failed process's held lines before its error line) when
- the launcher has begun stopping the job (`stopping`: a failure, its watchdog, a boundary),
  unless it is an epoch's line (the agreed stop may end an epoch the generation finished), or
- another process of the job has already ended with an error or a signal (`failed`): a survivor's
  line caused by a peer's death is written after that death, and the dead process is waitable
  from that moment (a zombie until reaped), so a check as each line comes closes the race with
  the launcher's own exit thread; it is sufficient for the processes of this machine, whose
  deaths are seen at once, and for srun's tasks as soon as srun reports the end, or
- it is part of a process's abort (from the first line of it, ABORT, to the process's end:
  a process that aborts first is the fault itself, e.g. JAX naming a silent peer, and the
  launcher's line names it with JAX's reason, meshfit.launch.watchdog.diagnosis).
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from typing import Callable

# The first line of an abort: glog's FATAL (F<mmdd> <time> <tid> <file>:<line>]), a failed CHECK,
# Python's fault handler on SIGABRT.
ABORT = re.compile(r"^F\d{4} \d\d:\d\d:\d\d\.\d+\s|^\*\*\* Check failure stack trace|"
                   r"^Fatal Python error: Aborted")
# glog ERROR lines of the coordination service and GRPC (a peer gone, the service's poll
# failing): the announcement of an abort, before its F line.
SERVICE_ERROR = re.compile(r"^E\d{4} \d\d:\d\d:\d\d\.\d+\s.*(coordination|grpc|heartbeat|"
                           r"preemption_notifier|client\.h|Terminating process)", re.IGNORECASE)
# An epoch's line (meshfit.watch.keras_side.report): shown also while a generation stops, since
# the agreed stop ends an epoch it finished (its record is in history.json; once, held, it was
# in no line).
EPOCH_LINE = re.compile(r"^epoch \d+/\d+  ")
REPORT_START = "meshfit connected"  # meshfit.watch.keras_side.report.discovery_text's first line
REPORT_ROW = re.compile(r"^  (\S.{16})(\S.*)$")  # its rows: "  " and a key padded to 17, a value
HELD_LINES = 20  # of each process, printed when the job stops for good with its failure
SUMMARY_ROWS = ("hosts", "devices per host", "replicas")  # always in a generation's one line


class Output:
    """The launcher's choice of lines for one job. stopping: set once the launcher stops the job
    (`stop`), at stopping_at.
    earlier_report: the rows of the device report an earlier generation printed ({} for the
    first: its report is shown in full; later ones print one line, the rows that changed)."""

    def __init__(self, earlier_report: dict[str, str] | None = None, hold_on_stop: bool = False):
        self.stopping = threading.Event()
        self.stopping_at: float | None = None  # time.monotonic() of the launcher's first stop
        self.hold_on_stop = hold_on_stop  # elastic: what a stopped generation says is not for the user
        self.earlier_report = earlier_report
        self.report: dict[str, str] = {}  # this job's device report's rows, as printed
        self.processes: list = []  # the job's processes, each with `failed()`: whether it ended so
        self.held_lines: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=HELD_LINES))
        self._aborting: set[int] = set()
        self._in_report = False
        self._flushed = False

    def stop(self) -> None:
        """The launcher begins stopping the job."""
        if self.stopping_at is None:
            self.stopping_at = time.monotonic()
        self.stopping.set()

    def shown(self, index: int, line: str) -> bool:
        """Whether process `index`'s `line` is shown now (see the module); its tail keeps it anyway,
        and `held_lines` the last HELD_LINES held."""
        if index not in self._aborting and (ABORT.match(line) or SERVICE_ERROR.match(line)):
            self._aborting.add(index)
        held_as_stopped = self.hold_on_stop and self.stopping.is_set() and not EPOCH_LINE.match(line)
        show = index not in self._aborting and not held_as_stopped \
            and not any(p.failed() for i, p in enumerate(self.processes) if i != index)
        if not show:
            self.held_lines[index].append(line)
        return show

    def condensed(self, line: str, emit: Callable[[str], None]) -> bool:
        """Process 0's device report: record it; under a later generation hold its rows and emit
        one line instead (at the report's first line after its rows). True when `line` is taken."""
        if line == REPORT_START:
            self._in_report = True
            return self.earlier_report is not None
        if self._in_report:
            row = REPORT_ROW.match(line)
            if row:
                self.report[row.group(1).strip()] = row.group(2)
                return self.earlier_report is not None
            self._in_report = False
            self.flush(emit)
        return False

    def flush(self, emit: Callable[[str], None]) -> None:
        """Emit a later generation's one line on its devices, once its report's rows came."""
        if self.earlier_report is None or not self.report or self._flushed:
            return
        self._flushed = True
        emit(summary(self.report, self.earlier_report))


def summary(report: dict[str, str], earlier: dict[str, str]) -> str:
    """A generation's device report in one line: the mesh's rows and any other that changed, e.g.
    'meshfit connected: hosts 1 (this is process 0), devices per host 4, replicas 4 (the rest as
    reported before)'."""
    rows = [f"{k} {v}" for k, v in report.items() if k in SUMMARY_ROWS or earlier.get(k) != v]
    return f"{REPORT_START}: {', '.join(rows)} (the rest as reported before)"


def ended_abnormally(pid: int, returncode: int | None) -> bool:
    """Whether process `pid` has ended with an error or a signal, without reaping it (waitid's
    WNOWAIT: the launcher's exit thread still collects its code). returncode: Popen's, once
    reaped."""
    if returncode is not None:
        return returncode != 0
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped between the two checks: returncode is being set
        return False
    if found is None:
        return False
    return found.si_code != os.CLD_EXITED or found.si_status != 0
