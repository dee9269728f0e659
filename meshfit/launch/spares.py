"""Spares: processes of an elastic job started ahead, their imports done, waiting for the
launcher to hand them their place in a generation (`meshfit launch --elastic --spares N`).

Every mesh change of `meshfit launch --elastic` starts every process of the next generation
anew (meshfit.launch.elastic says why), and a new process spends seconds on Python's, NumPy's,
JAX's and Keras' imports before it joins the job. A spare has spent them already, while the
generation before trained: `python -m meshfit.launch.spares` imports the modules the launcher
names (MESHFIT_SPARE_PRELOAD: for `meshfit train` on several devices, JAX, Keras and meshfit's
training modules), then waits for one line on its stdin: the command and environment of its
place (argv, env: rank, coordinator address, status folder, as local.process_environment gives
a process started cold). It takes that environment as its own and runs the command in itself
(`python -m MODULE` or `python SCRIPT`), as Python would have. The data set is not read ahead:
the place's command (recipe, --data-dir) names it, and meshfit.data.datasets reads it then
(through its cache of unpacked arrays).

What a spare must not do before it is handed its place: start JAX's backends. JAX reads
XLA_FLAGS (the simulated device count, XLA's thread pool) when it starts a backend, and
jax.distributed.initialize (meshfit.parallel.cluster.join) must come before any backend: so the
spare only imports, and ends with an error line instead of waiting if an import started one.
What JAX reads at its import is set before it: its compilation cache (engine.use_compile_cache,
the same folder as the job's processes), and the platform that a JAX imported early read is
set again when meshfit.connect simulates devices (meshfit.parallel.devices). Its run's
goodput counts from the handing over (goodput.count_from_now): the wait is no part of the run.

`Spares` is the launcher's side: `fill` starts spares up to the count (the elastic runner calls
it once a generation trains, so that spares do not compete with a generation's own start for
the CPU), `take` hands one its place (None when none is ready: that process starts cold), `close`
ends those left. A spare that ended by itself while waiting (an import failed) turns spares off
for the job, with one line naming why; the job goes on, its processes started cold.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys

from meshfit import env
from meshfit.parallel import cluster, engine
from meshfit.launch import process
from meshfit.watch import goodput

PRELOAD = "MESHFIT_SPARE_PRELOAD"  # the modules a spare imports ahead, comma-separated
LAUNCHER = "MESHFIT_SPARE_LAUNCHER"  # the launcher's pid: a spare dies with it
# What `meshfit train` imports before its first step, in the order it does: the command line and
# the data modules, then (on JAX: several devices) Keras and meshfit's Keras side.
TRAIN_MODULES = ("numpy", "meshfit.cli", "meshfit.run.train")
KERAS_MODULES = ("jax", "keras", "meshfit.run.keras_side.fitting")


def preload_for(argv: list[str], devices: int) -> list[str]:
    """The modules a spare of a job running `argv` on `devices` devices in all imports ahead:
    for `meshfit train` (python -m meshfit train) its modules, and Keras with JAX where the job
    trains on JAX whatever the environment says (several devices: meshfit.parallel.engine) and
    nothing asks for another backend; nothing for another command (it is run as it is)."""
    if argv[1:4] != ["-m", "meshfit", "train"]:
        return []
    other = {os.environ.get("KERAS_BACKEND"), os.environ.get(env.ENGINE)} - {None, "", "jax", "auto"}
    asked = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--engine"]
    if devices < 2 or other or any(a not in ("jax", "auto") for a in asked):
        return list(TRAIN_MODULES)
    return list(TRAIN_MODULES + KERAS_MODULES)


class Spares:
    """The launcher's spares for a job running `argv` on `devices` devices in all (see the
    module): up to `count` waiting at a time."""

    def __init__(self, count: int, argv: list[str], devices: int):
        self.count = count
        self.preload = preload_for(argv, devices)
        self.waiting: list[subprocess.Popen] = []
        self.off: str | None = None  # why spares were turned off, once they were

    def fill(self) -> None:
        """Start spares until `count` wait (none once they were turned off)."""
        self.check()
        variables = {**os.environ, PRELOAD: ",".join(self.preload), LAUNCHER: str(os.getpid()),
                     "PYTHONUNBUFFERED": "1"}
        if any(m == "keras" for m in self.preload):
            variables["KERAS_BACKEND"] = "jax"  # Keras fixes its backend at its import
        while self.off is None and len(self.waiting) < self.count:
            # no preexec_fn (the launcher has threads now): the spare sets its death signal itself
            self.waiting.append(subprocess.Popen(
                [sys.executable, "-m", __name__], env=variables, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))

    def check(self) -> None:
        """Turn spares off, with one line, when a waiting one ended by itself."""
        for spare in self.waiting:
            if spare.poll() is not None and self.off is None:
                last = spare.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if spare.stderr else []
                self.off = f"exit code {spare.returncode}" + (f": {last[0]}" if last else "")
                print(f"meshfit launch: spares off: a spare ended while waiting ({self.off}); "
                      "processes start cold", file=sys.stderr, flush=True)
        self.waiting = [s for s in self.waiting if s.poll() is None]

    def take(self, argv: list[str], variables: dict[str, str]) -> subprocess.Popen | None:
        """A waiting spare, handed `argv` to run with the environment `variables` (its place);
        None when none is ready or `argv` is not `python -m MODULE ...` or `python SCRIPT ...` of
        this Python (a spare is this Python)."""
        python = shutil.which(argv[0]) or argv[0]
        if os.path.abspath(python) != os.path.abspath(sys.executable) or len(argv) < 2 or \
                (argv[1] != "-m" and argv[1].startswith("-")) or (argv[1] == "-m" and len(argv) < 3):
            return None
        self.check()
        while self.waiting:
            spare = self.waiting.pop(0)
            try:
                spare.stdin.write((json.dumps({"argv": argv, "env": variables}) + "\n").encode())
                spare.stdin.close()
                spare.stdin = None  # as a process started cold, with no input (communicate() reads it)
                return spare
            except (BrokenPipeError, OSError):  # it ended in between: the next one
                continue
        return None

    def close(self) -> None:
        """End the spares left waiting."""
        for spare in self.waiting:
            try:
                os.killpg(spare.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            spare.wait()
        self.waiting = []


def main() -> int:
    """A spare: import ahead, wait for its place, then run its command in this process."""
    process.dies_with(int(os.environ.get(LAUNCHER) or os.getppid()))
    engine.use_compile_cache()  # JAX reads it at its import: the job's processes' own folder
    for name in filter(None, os.environ.get(PRELOAD, "").split(",")):
        importlib.import_module(name)
    if cluster.jax_started():
        print(f"meshfit: error: a spare's imports ({os.environ[PRELOAD]}) started JAX's backends; "
              "it cannot take a place in a job", file=sys.stderr, flush=True)
        return 1
    line = sys.stdin.buffer.readline()
    if not line:  # the launcher ended without handing this one a place
        return 0
    handed = json.loads(line)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # as a process started cold: no input
    os.environ.clear()
    os.environ.update(handed["env"])
    goodput.count_from_now()  # its run counts from now, not from this spare's start
    argv = handed["argv"]
    if argv[1:2] == ["-m"]:
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
