"""Every Ctrl-C ends a meshfit command with one line and exit code 130, whatever runs then.

Python raises a signal's KeyboardInterrupt in the Python code the main thread runs next; in a gc
callback (JAX's _xla_gc_callback) it was printed as "Exception ignored" and dropped, and the
command went on to exit 0. These tests send SIGINT from inside a gc callback, deterministically,
at chosen moments of a command (meshfit.cli._ctrl_c_stops).
"""

import os
import subprocess
import sys

import pytest
from helpers import cli_env, environment

# `python -c SIGINT_IN_GC FUNCTION N ARGS...`: `meshfit ARGS...` that sends itself SIGINT from
# inside the N-th garbage collection that starts while FUNCTION is on the stack ("-": any).
SIGINT_IN_GC = """
import gc, os, signal, sys
from meshfit import cli

where, left = sys.argv[1], int(sys.argv[2])

def inside(name):
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False

def sigint_in_gc(phase, info):
    global left
    if phase == "start" and left > 0 and (where == "-" or inside(where)):
        left -= 1
        if not left:
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, in this callback

gc.callbacks.append(sigint_in_gc)
code = cli.main(sys.argv[3:])
print("sent" if left == 0 else "not sent", file=sys.stderr)
sys.exit(code)
"""


def interrupted(where: str, nth: int, *args: str, env=None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", SIGINT_IN_GC, where, str(nth), *args],
                         capture_output=True, text=True, timeout=300, env=environment(env))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1:] == ["sent"], out.stderr  # the moment was reached
    assert out.returncode == 130, out.stderr
    assert lines[:-1] == ["meshfit: interrupted"], out.stderr  # no "Exception ignored", no traceback
    return out


@pytest.mark.parametrize("nth", [1, 60, 300])
def test_a_ctrl_c_in_a_gc_callback_stops_meshfit_info(nth, tmp_path):
    """In argument parsing (the first collection), while JAX is imported and while it starts."""
    interrupted("-", nth, "info", "--simulate-devices", "8", "--json", env=cli_env(tmp_path))


def test_a_ctrl_c_in_a_gc_callback_stops_meshfit_train_as_it_writes_its_results(data_dir, tmp_path):
    """After training, while the results are written: nothing is half-written, and the run is
    not finished (no metrics.json), so `--resume` finishes it."""
    run = str(tmp_path / "run")
    interrupted("score_and_write", 1, "train", "--data-dir", data_dir, "--out", run, "--epochs", "1",
                "--steps-per-epoch", "2", "--global-batch", "16", "--no-tensorboard",
                env=cli_env(tmp_path))
    assert not os.path.exists(os.path.join(run, "metrics.json"))
    assert not [name for name in os.listdir(run) if name.startswith(".tmp-")]
