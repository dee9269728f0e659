"""Every Ctrl-C ends a meshfit command with one line and exit code 130, whatever runs then.

Python raises a signal's KeyboardInterrupt in the Python code the main thread runs next; in a gc
callback (JAX's _xla_gc_callback) it was printed as "Exception ignored" and dropped, and the
command went on to exit 0. These tests send SIGINT from inside a gc callback, deterministically,
at chosen moments of a command (meshfit.commands.ctrl_c.stops).
"""

import json
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


# `python -c SIGINT_ON_IMPORT MODULE ARGS...`: `meshfit ARGS...` that sends itself SIGINT as
# MODULE's import starts (from a finder on sys.meta_path, where its handler runs).
SIGINT_ON_IMPORT = """
import os, signal, sys
from meshfit import cli

module = sys.argv[1]

class SigintOnImport:
    def find_spec(self, name, path=None, target=None):
        global module
        if name == module:
            module = None
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintOnImport())
code = cli.main(sys.argv[2:])
print("sent" if module is None else "not sent", file=sys.stderr)
sys.exit(code)
"""

# `python -c SIGINT_LOADING_JAXLIB N ARGS...`: `meshfit ARGS...` that sends itself SIGINT at the
# N-th Python call made while importlib loads jaxlib._jax (_load_unlocked: from its C
# initialisation until it is in sys.modules).
SIGINT_LOADING_JAXLIB = """
import os, signal, sys
from meshfit import cli

left = int(sys.argv[1])

def loading_jaxlib(frame):
    while frame is not None:
        code, local = frame.f_code, frame.f_locals
        if code.co_name == "_load_unlocked" and local["spec"].name == "jaxlib._jax":
            return True
        frame = frame.f_back
    return False

def profile(frame, event, arg):
    global left
    if event == "call" and loading_jaxlib(frame):
        left -= 1
        if not left:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(profile)
code = cli.main(sys.argv[2:])
sys.setprofile(None)
print("sent" if left == 0 else "not sent", file=sys.stderr)
sys.exit(code)
"""


# Run first in each child: Ctrl-C handled as in a terminal's foreground process (Python's own
# handler), also where this suite runs with SIGINT ignored (started in the background, `make test
# &`), which children inherit and rightly keep. Not a preexec_fn: forking a process that runs
# JAX's threads and then running Python in the child can deadlock.
TERMINAL_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def interrupted(script: str, moment: list[str], *args: str, env=None
                ) -> subprocess.CompletedProcess:
    """`meshfit ARGS...` run by `script` (one of the above), told the `moment` of its SIGINT."""
    out = subprocess.run([sys.executable, "-c", TERMINAL_SIGINT + script, *moment, *args],
                         capture_output=True, text=True, timeout=300, env=environment(env))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1:] == ["sent"], out.stderr  # the moment was reached
    assert out.returncode == 130, out.stderr
    assert lines[:-1] == ["meshfit: interrupted"], out.stderr  # no "Exception ignored", no traceback
    return out


@pytest.mark.parametrize("nth", [1, 60, 300])
def test_a_ctrl_c_in_a_gc_callback_stops_meshfit_info(nth, tmp_path):
    """In argument parsing (the first collection), while JAX is imported and while it starts."""
    interrupted(SIGINT_IN_GC, ["-", str(nth)], "info", "--simulate-devices", "8", "--json",
                env=cli_env(tmp_path))


def test_a_ctrl_c_in_a_gc_callback_stops_meshfit_train_as_it_writes_its_results(data_dir, tmp_path):
    """After training, while the results are written: nothing is half-written. The interrupt
    dropped in the gc callback is delivered again from another thread, so it lands at the main
    thread's next check: mostly before metrics.json (the run is not finished, `--resume` finishes
    it), sometimes just after its write on a loaded machine (the run is finished, whole)."""
    run = str(tmp_path / "run")
    interrupted(SIGINT_IN_GC, ["score_and_write", "1"], "train", "--data-dir", data_dir, "--out", run,
                "--epochs", "1", "--steps-per-epoch", "2", "--global-batch", "16", "--no-tensorboard",
                env=cli_env(tmp_path))
    assert not [name for name in os.listdir(run) if name.startswith(".tmp-")]
    metrics = os.path.join(run, "metrics.json")
    if os.path.exists(metrics):  # written whole (atomically), and the run's last file
        with open(metrics) as f:
            assert "test_accuracy" in json.load(f)


# `python -c SIGINT_AT_EXIT ARGS...`: `meshfit ARGS...` as `python -m meshfit` runs it (the process's
# own command line), sending itself SIGINT from the last of the atexit handlers (after JAX's).
SIGINT_AT_EXIT = """
import atexit, os, signal, sys
from meshfit import cli

atexit.register(lambda: (print("sent", file=sys.stderr, flush=True), os.kill(os.getpid(), signal.SIGINT)))
sys.argv = ["meshfit", *sys.argv[1:]]
sys.exit(cli.main())
"""


def test_a_ctrl_c_after_the_command_as_the_process_ends_is_one_line(tmp_path):
    """Python's own handler was back once the command returned: a Ctrl-C in an atexit handler
    (JAX's shutdown) printed a KeyboardInterrupt traceback and the process ended with exit 0."""
    out = subprocess.run([sys.executable, "-c", TERMINAL_SIGINT + SIGINT_AT_EXIT, "info", "--json"],
                         capture_output=True, text=True, timeout=300, env=environment(cli_env(tmp_path)))
    assert json.loads(out.stdout.strip().splitlines()[-1])  # the command's whole output came first
    assert out.stderr.split() == ["sent", "meshfit:", "interrupted"] and out.returncode == 130, out.stderr


def test_a_ctrl_c_while_jaxlib_initialises_stops_meshfit_once_it_is_imported(tmp_path):
    """jaxlib._jax imports jaxlib._hlo from its C initialisation: a KeyboardInterrupt there cut it
    half-way ("ImportError: Encountered an error while initializing the extension", at other
    moments a segmentation fault); it is raised once the module is imported."""
    interrupted(SIGINT_ON_IMPORT, ["jaxlib._hlo"], "info", "--simulate-devices", "8", "--json",
                env=cli_env(tmp_path))


@pytest.mark.parametrize("nth", [5, 12])
def test_a_ctrl_c_as_jaxlib_is_loaded_stops_meshfit_once_it_is_imported(nth, tmp_path):
    """Just after jaxlib._jax's C initialisation, before it is in sys.modules: a KeyboardInterrupt
    there dropped the module, and the garbage collection after it crashed (SIGSEGV)."""
    interrupted(SIGINT_LOADING_JAXLIB, [str(nth)], "info", "--simulate-devices", "8", "--json",
                env=cli_env(tmp_path))


def test_a_ctrl_c_while_the_meshfit_command_starts_ends_it_with_one_line(tmp_path):
    """Before main() runs, as the `meshfit` console script imports meshfit.cli: was a traceback
    and an exit by SIGINT (-2)."""
    script = """
import os, signal, sys
sys.argv[0] = os.path.join(os.path.dirname(sys.executable), "meshfit")  # the console script

class SigintOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "meshfit.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintOnImport())
from meshfit.cli import main
sys.exit(main(["info", "--json"]))
"""
    out = subprocess.run([sys.executable, "-c", TERMINAL_SIGINT + script], capture_output=True,
                         text=True, timeout=300, env=environment(cli_env(tmp_path)))
    assert (out.returncode, out.stderr) == (130, "meshfit: interrupted\n")


WRAPPED_INTERRUPT = """
import sys
from meshfit.commands import ctrl_c

def command():  # a Ctrl-C in a dataclass field's __set_name__, as Python 3.11 reports it
    ctrl_c._interrupted = True
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as error:
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'mem'") from error

sys.exit(ctrl_c.run(command, lambda code: None))
"""


def test_an_interrupt_python_wraps_in_another_error_is_still_one_line():
    """Python 3.11 turns a KeyboardInterrupt raised in a class's __set_name__ (Keras' import
    defines JAX's Pallas dataclasses) into a RuntimeError: a Ctrl-C at that moment of `meshfit
    info` printed a traceback (CI, the gc test's 300th collection)."""
    out = subprocess.run([sys.executable, "-c", WRAPPED_INTERRUPT], capture_output=True, text=True,
                         timeout=120, env=environment())
    assert out.returncode == 130 and out.stderr.strip() == "meshfit: interrupted", out.stderr
