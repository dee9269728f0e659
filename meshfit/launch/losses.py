"""What ended a generation of `meshfit launch --elastic`, and which of its processes are lost: a
process killed by a signal, one JAX names as silent, a hung one, ones that never joined; a
process's own error ends the job instead (every process would fail the same way again). And how
many survivors the next generation has: as many as split the run's global batch evenly.
"""

from __future__ import annotations

import signal

from meshfit.launch import local, mesh_history, watchdog
from meshfit.parallel import stall

def lost_processes(ended: local.Ended, count: int) -> tuple[bool, list[int]]:
    """(whether a restart can outlive this end, the processes lost) of a generation that did not
    finish: a process killed by a signal (or the ones JAX names as silent: stopped, frozen; or
    process 0 where a survivor's heartbeat to it timed out), a hung one (the launcher's watchdog
    or the process's own stall guard: the ones furthest behind), ones that never joined. Lost
    processes are left out of the next generation; where they cannot be told apart from the
    others (all equally behind), the next one has as many."""
    if ended.timed_out:  # --timeout: the user's limit, no fault
        return False, []
    if ended.verdict is not None:  # the launcher's watchdog: hung, or never joined
        lost = ended.missing or ended.behind
        return True, lost if len(lost) < count else []
    if ended.failure is None:
        return False, []
    index, code = ended.failure
    killed = _killed_too(ended, index)
    if code > 0 and code != stall.EXIT_CODE and killed:  # its error came first: a collective
        return True, killed  # failed because a peer was killed ("Connection reset by peer")
    if code >= 0 and code != stall.EXIT_CODE:  # an error of its own, or a stop after saving
        return False, []
    silent = [i for i in watchdog.silent_processes(ended.started[index].tail) if i < count]
    if silent:
        return True, silent
    if index != 0 and watchdog.coordinator_unanswering(ended.started[index].tail):
        return True, [0]  # this one aborted because process 0 went silent
    if code == stall.EXIT_CODE:  # its own guard: it waited for a peer that hung
        return True, ended.behind if 0 < len(ended.behind) < count else []
    return True, sorted({index, *_killed_too(ended, index)})


def _killed_too(ended: local.Ended, index: int) -> list[int]:
    """The processes other than `index` that were SIGKILLed, but not by the launcher (two of a
    job killed at once: both are lost; the launcher's SIGTERM may reach a process that is already
    being killed). Only SIGKILL: the survivors of a lost peer may end by themselves too, with an
    abort (JAX's heartbeat check) or an error, and are no loss."""
    return [i for i, code in ended.codes.items() if i != index and code == -signal.SIGKILL
            and not getattr(ended.started[i], "killed", True)]


def what_ended(ended: local.Ended, lost: list[int]) -> str:
    """One phrase on why a generation ended, e.g. 'process 1 of 2 failed with SIGKILL (exit code -9)'."""
    count = len(ended.started)
    if ended.verdict is not None:  # the watchdog's own words, the only line naming it
        if ended.verdict_text:
            return ended.verdict_text
        how = "never joined" if ended.missing else "hung"
        who = ", ".join(map(str, lost)) or "?"
        return f"process(es) {who} of {count} {how}"
    index, code = ended.failure
    text = f"process {index} of {count} failed with {local.describe_exit(code)}"
    also = ", ".join(map(str, _killed_too(ended, index)))
    if also:
        text += (f", and so did process(es) {also}" if code == -signal.SIGKILL else
                 f", process(es) {also} SIGKILLed")
    silent = watchdog.silent_processes(ended.started[index].tail)
    if silent:
        text += f" because process(es) {', '.join(map(str, silent))} stopped sending heartbeats"
    elif index != 0 and watchdog.coordinator_unanswering(ended.started[index].tail):
        text += " because process 0, the coordinator, stopped answering heartbeats"
    return text


def fitting_processes(run: str, survivors: int, devices_per_process: int) -> int:
    """The most processes, at most `survivors`, whose devices split the run's global batch evenly
    (config.json): the batch is kept (exact resume depends on it) and `meshfit train` refuses a
    batch that does not split, e.g. 1000 over 3 x 2 devices (then 2 x 2). `survivors` when the
    batch is unknown or none fits (train's own error then says why)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not isinstance(batch, int) or batch < 1:
        return survivors
    fits = [n for n in range(survivors, 0, -1) if batch % (n * devices_per_process) == 0]
    return fits[0] if fits else survivors


