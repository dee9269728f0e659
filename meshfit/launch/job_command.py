"""The command a job of `meshfit launch` runs in each process: COMMAND after `--` as run, and a
Python named there that cannot import meshfit refused before any process starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Sequence

from meshfit.errors import MeshfitError


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
    _check_python(command)
    return command


def _check_python(command: list[str]) -> None:
    """A one-line MeshfitError when the command's program is a Python (python, python3,
    python3.12, a path to one) other than this one that cannot import meshfit where the command
    runs: every process would end in a ModuleNotFoundError (`meshfit` run from a virtual
    environment that is not activated, and `python` on the PATH the system's)."""
    program = command[0]
    name = os.path.basename(program)
    if not (name == "python" or name.startswith("python3")) or name.endswith((".py", ".sh")):
        return
    found = shutil.which(program)
    # Paths, not their targets: a virtual environment's python links to the system's binary.
    if found is None or os.path.abspath(found) == os.path.abspath(sys.executable):
        return
    # Asked from where the program's own imports start: a script's folder, else here (-m, -c).
    script = command[1] if len(command) > 1 and not command[1].startswith("-") else None
    where = os.path.dirname(os.path.abspath(script)) if script else None
    try:
        importable = subprocess.run([found, "-c", "import meshfit"], capture_output=True, cwd=where,
                                    timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return  # not a Python this can ask: the launch says what happens
    if not importable:
        raise MeshfitError(f"{program} is {found}, which cannot import meshfit (this meshfit runs "
                           f"on {sys.executable}); launch that Python: -- {sys.executable} ..., or "
                           "activate its environment first")
