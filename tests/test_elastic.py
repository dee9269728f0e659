"""`meshfit launch --elastic`: a job that loses a process goes on, on the survivors.

The slow test runs a real 2-process x 2-device training job on small generated Fashion-MNIST
files, kills process 1 once the epoch-1 checkpoint is committed, and checks that the launcher
finished the run on 1 process, recording both meshes.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import write_idx_dataset

from meshfit import env
from meshfit.commands import elastic, launch
from meshfit.errors import MeshfitError
from meshfit.run import rundir

# As in test_launch.py: the launcher's watchdog bounds a job by its progress, SAFETY_SECONDS only
# ends a test whose watchdog failed.
STALL_SECONDS = 180
SAFETY_SECONDS = 1800
PYTHON_MESHFIT = [sys.executable, "-m", "meshfit"]


def test_every_generation_trains_one_run_directory_and_saves_more_often():
    argv, run = elastic.train_command([*PYTHON_MESHFIT, "train", "fashion-mnist-cnn", "--out", "r"])
    assert run == "r" and argv[-2:] == ["--checkpoint-every", elastic.ELASTIC_CHECKPOINT_EVERY]
    argv, run = elastic.train_command([*PYTHON_MESHFIT, "train", "--resume=old", "--checkpoint-every", "5"])
    assert run == "old" and "--resume=old" not in argv and argv.count("--checkpoint-every") == 1
    argv, run = elastic.train_command([*PYTHON_MESHFIT, "train", "fashion-mnist-cnn"])
    assert argv[argv.index("--out") + 1] == run and os.path.basename(run).startswith("elastic-")


def test_elastic_needs_meshfit_train_and_sane_limits():
    with pytest.raises(MeshfitError, match="restarts a `meshfit train` run"):
        elastic.elastic_launch(["meshfit", "info"], 2)
    with pytest.raises(MeshfitError, match="--min-processes must be between 1 and --processes"):
        elastic.elastic_launch(["meshfit", "train"], 2, min_processes=3)


@pytest.mark.parametrize("flags, message", [
    (["--min-processes", "2"], "--min-processes, --max-restarts and --no-grow go with --elastic"),
    (["--elastic", "--port", "1234"], "--port goes without --elastic"),
    (["--elastic", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
])
def test_elastic_flags_are_checked_in_one_line(flags, message, capsys):
    from meshfit import cli

    assert cli.main(["launch", "--processes", "2", *flags, "--", "meshfit", "train"]) == 2
    assert message in capsys.readouterr().err


def ended(failure=None, verdict=None, tail=(), behind=(), missing=(), count=2, timed_out=False):
    started = [SimpleNamespace(tail=list(tail) if failure and i == failure[0] else []) for i in range(count)]
    return launch.Ended(started, verdict, {}, failure, list(missing), "", 15, list(behind), {}, 1.0,
                        timed_out)


def test_which_ends_a_restart_outlives_and_who_is_left_out():
    assert elastic.lost_processes(ended((1, -signal.SIGKILL)), 2) == (True, [1])
    # JAX's heartbeat check aborts process 0 and names the stopped one
    abort = ["... stopped sending heartbeats ...", "1", "Fatal Python error: Aborted"]
    assert elastic.lost_processes(ended((0, -signal.SIGABRT), tail=abort), 2) == (True, [1])
    assert elastic.lost_processes(ended(verdict=124, behind=[1]), 2) == (True, [1])
    assert elastic.lost_processes(ended(verdict=124, behind=[0, 1]), 2) == (True, [])  # as many again
    assert elastic.lost_processes(ended(verdict=124, missing=[1]), 2) == (True, [1])
    # its own error, a stop after saving, the user's --timeout: restarting would not help
    assert elastic.lost_processes(ended((1, 2)), 2) == (False, [])
    assert elastic.lost_processes(ended((1, 143)), 2) == (False, [])
    assert elastic.lost_processes(ended(verdict=124, timed_out=True), 2) == (False, [])


def test_generation_records_the_checkpoint_it_resumed_from(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "ckpt-00000004"}]})
    job = ended((0, -9))
    job.steps = {0: 3}
    record = elastic.generation_record(2, 1, 2, str(tmp_path), 0, job)
    assert (record["processes"], record["devices"], record["global_batch"]) == (1, 2, 64)
    assert (record["first_step"], record["last_step"]) == (4, 7)
    assert elastic.batch_line(str(tmp_path), 2) == "global batch kept at 64 (32 per device)"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_process_is_left_out_and_the_run_finishes_on_the_survivor(tmp_path, how):
    """SIGKILL: process 1 dies; SIGSTOP: it freezes, and JAX's heartbeat check (10 s here) names
    it when it ends process 0."""
    data = tmp_path / "data"
    write_idx_dataset(data / "fashion-mnist", n_train=256, n_test=64)  # 4 steps of 64 an epoch
    run, epochs = str(tmp_path / "run"), 6
    first_checkpoint = os.path.join(run, "checkpoints", "ckpt-00000004")
    command = [*PYTHON_MESHFIT, "launch", "--processes", "2", "--devices-per-process", "2",
               "--elastic", "--", "meshfit", "train", "fashion-mnist-cnn", "--global-batch", "64",
               "--seed", "0", "--epochs", str(epochs), "--data-dir", str(data), "--out", run,
               "--checkpoint-every", "epoch"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, env.STALL_TIMEOUT: str(STALL_SECONDS),
                                env.HEARTBEAT_TIMEOUT: "10"})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SAFETY_SECONDS
        while not rundir.checkpoint_complete(first_checkpoint) and job.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        pids = re.search(r"pids (\d+) (\d+)", "".join(output)).groups()
        os.kill(int(pids[1]), getattr(signal, how))  # process 1 is lost mid-run
        assert job.wait(timeout=SAFETY_SECONDS) == 0, "".join(output)[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    text = "".join(output)
    why = ("process 1 of 2 failed with SIGKILL" if how == "SIGKILL" else
           "process 0 of 2 failed with SIGABRT (exit code -6) because process(es) 1 stopped sending heartbeats")
    assert why in text, text[-4000:]
    assert "generation 2: 1 process(es) x 2 device(s) (was 2 x 2)" in text, text[-4000:]
    with open(os.path.join(run, "metrics.json")) as f:
        metrics = json.load(f)
    meshes = [(g["processes"], g["devices"]) for g in metrics["generations"]]
    assert meshes == [(2, 4), (1, 2)]
    first, second = metrics["generations"]
    assert first["ended"].startswith(why) and first["lost_processes"] == [1]
    assert second["ended"] == "finished" and second["first_step"] >= 4
    assert first["lost_steps"] == first["last_step"] - second["first_step"] >= 0
    with open(os.path.join(run, "history.json")) as f:
        assert [r["epoch"] for r in json.load(f)] == list(range(1, epochs + 1))  # every epoch trained
    assert metrics["goodput"]["sessions"] == 2 and metrics["goodput"]["seconds"]["lost"] > 0


def test_goodput_counts_the_steps_each_restart_ran_again(tmp_path):
    """Two generations lost: the lost_steps of both resumes add up in the run's goodput."""
    from meshfit.watch import goodput

    path = str(tmp_path / "goodput.json")
    first = goodput.Ledger(start=time.time() - 10.0)
    first.steps, first.persist_to = 30, path
    first.write()
    second = goodput.Ledger()
    second.resume(path, checkpoint_step=20)  # 10 steps after its newest checkpoint
    assert second.totals()["lost_steps"] == 10
    second.steps, second.persist_to = 15, path  # steps 20..35, its newest checkpoint at 32
    second.write()
    third = goodput.Ledger()
    third.resume(path, checkpoint_step=32)
    assert third.totals()["lost_steps"] == 13 and third.totals()["sessions"] == 3
