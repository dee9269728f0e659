"""Spares of `meshfit launch --elastic` (meshfit.launch.spares): processes started ahead, their
imports done, that take a new generation's places: handed their command and environment, they
run it as a process started cold would; JAX imported ahead has not started its backends, so the
place's devices and job are its own."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from meshfit.launch import spares

STAND_IN = os.path.join(os.path.dirname(__file__), "elastic_stand_in.py")
PYTHON_MESHFIT = [sys.executable, "-m", "meshfit"]


def test_a_spare_runs_the_command_it_is_handed_with_its_environment(tmp_path):
    script = tmp_path / "place.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        json.dump({"argv": sys.argv, "x": os.environ.get("PLACE"), "stdin": sys.stdin.read(),
                   "preload": os.environ.get("MESHFIT_SPARE_PRELOAD")}, open(sys.argv[1], "w"))
        sys.exit(7)
    """))
    pool = spares.Spares(2, [sys.executable, str(script)], 1)
    assert pool.preload == []  # not meshfit train: nothing to import ahead
    pool.fill()
    assert len(pool.waiting) == 2
    out = str(tmp_path / "out.json")
    spare = pool.take([sys.executable, str(script), out], {**os.environ, "PLACE": "1"})
    assert spare is not None and len(pool.waiting) == 1
    assert spare.wait(timeout=120) == 7  # its exit code is the command's
    with open(out) as f:
        assert json.load(f) == {"argv": [str(script), out], "x": "1", "stdin": "", "preload": None}
    assert pool.take(["/bin/echo", "hi"], {}) is None  # not this Python: started cold
    assert pool.take([sys.executable, "-c", "pass"], {}) is None
    left = pool.waiting[0]
    pool.close()
    assert left.returncode == -signal.SIGKILL and pool.waiting == []


def test_a_spare_that_ends_while_waiting_turns_spares_off_in_one_line(tmp_path, capsys, monkeypatch):
    pool = spares.Spares(1, [sys.executable, "x.py"], 1)
    pool.preload = ["no_such_module_for_a_spare"]
    pool.fill()
    pool.waiting[0].wait(timeout=120)
    assert pool.take([sys.executable, "x.py"], dict(os.environ)) is None
    err = capsys.readouterr().err
    assert err.startswith("meshfit launch: spares off: a spare ended while waiting (exit code 1: "
                          "ModuleNotFoundError: No module named 'no_such_module_for_a_spare'); "
                          "processes start cold"), err
    pool.fill()
    assert pool.waiting == []  # off for the job


def test_what_a_spare_imports_ahead():
    train = [*PYTHON_MESHFIT, "train", "fashion-mnist-cnn"]
    assert spares.preload_for(train, 8) == [*spares.TRAIN_MODULES, *spares.KERAS_MODULES]
    assert spares.preload_for(train, 1) == list(spares.TRAIN_MODULES)  # TensorFlow may run it
    assert spares.preload_for([*train, "--engine", "tensorflow"], 8) == list(spares.TRAIN_MODULES)
    assert spares.preload_for([*PYTHON_MESHFIT, "info"], 8) == []


def test_keras_imported_ahead_leaves_jax_to_the_place(tmp_path):
    """A spare imports JAX and Keras (and meshfit's training modules) without starting JAX's
    backends: handed a place that simulates 3 devices, connect() gets 3 CPU devices."""
    script = tmp_path / "place.py"
    script.write_text(textwrap.dedent("""
        import sys
        import meshfit
        assert "keras" in sys.modules and "meshfit.run.keras_side.fitting" in sys.modules
        info = meshfit.connect(simulate_devices=3)
        import jax
        print("devices", jax.device_count(), jax.devices()[0].platform)
    """))
    pool = spares.Spares(1, [*PYTHON_MESHFIT, "train"], 8)
    pool.fill()
    spare = pool.take([sys.executable, str(script)], dict(os.environ))
    out, err = spare.communicate(timeout=600)
    assert spare.returncode == 0, err.decode()[-3000:]
    assert out.decode().splitlines()[-1] == "devices 3 cpu", out.decode()


def test_an_elastic_job_s_next_generation_takes_its_spares(tmp_path):
    """A generation trains (0.6 s a step): the launcher starts 2 spares; process 1 is lost after
    step 4 and the next generation's 2 places are the spares', which finish the run."""
    run = str(tmp_path / "run")
    job = subprocess.run([sys.executable, STAND_IN, "launch", "--elastic", "--show", "first",
                          "--processes", "2", "--", sys.executable, STAND_IN, "train", "--out", run,
                          "--kill", "1@4", "--pause", "0.6"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert job.returncode == 0, job.stderr
    starts = [line for line in job.stderr.splitlines() if line.startswith("meshfit launch: 2 process(es)")]
    assert len(starts) == 2 and not starts[0].endswith("spares)") and starts[1].endswith("(2 of them spares)"), starts
    with open(os.path.join(run, "generations.json")) as f:
        assert [(g["processes"], g["first_step"], g["last_step"]) for g in json.load(f)] == [(2, 0, 4), (2, 4, 6)]


def test_spares_go_with_this_machine_s_processes_only():
    from meshfit.errors import MeshfitError
    from meshfit.launch import elastic

    with pytest.raises(MeshfitError, match="--spares goes with --via local"):
        elastic.elastic_launch(["meshfit", "train", "--out", "r"], 2, spares=1, via="srun")
