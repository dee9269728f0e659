"""One measurement in a fresh process: its spec goes in as JSON, its rows come back as lines.

Keras fixes its backend once per process, so every engine and path is timed in its own
`python -m meshfit.commands.bench.<module> SPEC`. The worker prints marked lines on stdout (a
row, the machine, or a one-line error) and progress lines starting "bench: " on stderr, which the
parent relays as they come.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from typing import Any, Callable

from meshfit.errors import MeshfitError

ROW, MACHINE, ERROR = "meshfit-bench-row ", "meshfit-bench-machine ", "meshfit-bench-error "


def run(module: str, spec: dict[str, Any]) -> tuple[list[dict], dict | None, str | None]:
    """Run `python -m module SPEC` and relay its progress lines; returns (rows, machine, error):
    error is the worker's one-line MeshfitError (it could not measure), else None."""
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: collections.deque = collections.deque(maxlen=20)

    def relay():
        for line in proc.stderr:
            if line.startswith(("bench: ", "meshfit: warning")):
                print(line, end="", file=sys.stderr, flush=True)
            elif line.strip():
                tail.append(line.rstrip())

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    stdout = proc.stdout.read()
    proc.wait()
    relayer.join()
    rows, machine, error = [], None, None
    for line in stdout.splitlines():
        if line.startswith(ROW):
            rows.append(json.loads(line[len(ROW):]))
        elif line.startswith(MACHINE):
            machine = json.loads(line[len(MACHINE):])
        elif line.startswith(ERROR):
            error = line[len(ERROR):]
    if proc.returncode != 0 and error is None:
        last = tail[-1] if tail else "no output"
        raise MeshfitError(f"the {spec.get('engine', 'input')} {spec['path']} benchmark process failed "
                           f"(exit {proc.returncode}): {last}")
    return rows, machine, error


def emit_machine(machine: dict[str, Any]) -> None:
    """(In the worker) hand the parent the description of this machine."""
    print(MACHINE + json.dumps(machine), flush=True)


def emit_row(row: dict[str, Any]) -> None:
    """(In the worker) hand the parent one measured row."""
    print(ROW + json.dumps(row), flush=True)


def main(measure: Callable[[dict], None], argv: list[str]) -> int:
    """A worker's entry point: measure the JSON spec in argv[0]; a MeshfitError becomes the
    one-line error the parent reports (exit 2)."""
    try:
        measure(json.loads(argv[0]))
    except MeshfitError as err:
        print(ERROR + str(err), flush=True)
        return 2
    return 0


def command_line() -> str | None:
    """The `meshfit bench ...` command this process runs, for bench.json (None from Python)."""
    return "meshfit bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
