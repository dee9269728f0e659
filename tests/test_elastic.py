"""`meshfit launch --elastic`: a job that loses a process goes on, on the survivors.

The slow tests run a real 2-process x 2-device training job on small generated Fashion-MNIST
files, kill process 1 once the epoch-1 checkpoint is committed, and check that the launcher
finished the run (on 1 process, or back on 2 from the next checkpoint), recording the meshes.
The fast ones drive the launcher with a stand-in for `meshfit train` (tests/elastic_stand_in.py):
its limits, the one line they end with, resuming after them, and growing back.
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
from meshfit.commands import elastic, launch, mesh_history
from meshfit.errors import MeshfitError
from meshfit.run import rundir

# As in test_launch.py: the launcher's watchdog bounds a job by its progress, SAFETY_SECONDS only
# ends a test whose watchdog failed.
STALL_SECONDS = 180
SAFETY_SECONDS = 1800
PYTHON_MESHFIT = [sys.executable, "-m", "meshfit"]


def test_every_generation_trains_one_run_directory_and_saves_more_often():
    argv, run = elastic.train_command([*PYTHON_MESHFIT, "train", "fashion-mnist-cnn", "--out", "r"])
    assert run == "r" and argv[-4:] == ["--checkpoint-every", elastic.ELASTIC_CHECKPOINT_EVERY,
                                        "--local-copy-every", elastic.ELASTIC_LOCAL_COPY_EVERY]
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
    (["--min-processes", "2"], "--min-processes, --max-restarts, --no-grow, --keep-batch and --via "
                               "go with --elastic"),
    (["--keep-batch", "per-core"], "--keep-batch and --via go with --elastic"),
    (["--via", "srun"], "--keep-batch and --via go with --elastic"),
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


def test_processes_killed_together_are_all_lost_but_not_the_ones_the_launcher_stopped():
    job = ended((1, -signal.SIGKILL), count=4)
    job.codes = {1: -9, 2: -9, 0: -9, 3: 143}
    for i, process in enumerate(job.started):
        process.killed = i == 0  # by the launcher, after its grace period (3 stopped on SIGTERM)
    assert elastic.lost_processes(job, 4) == (True, [1, 2])
    assert elastic.what_ended(job, [1, 2]) == ("process 1 of 4 failed with SIGKILL (exit code -9), "
                                                "and so did process(es) 2")
    # a survivor's error (its collective's peer gone) reached the launcher before the kill did
    job = ended((0, 1), count=2)
    job.codes = {0: 1, 1: -9}
    job.started[0].killed = job.started[1].killed = False
    assert elastic.lost_processes(job, 2) == (True, [1])
    assert elastic.what_ended(job, [1]) == "process 0 of 2 failed with exit code 1, process(es) 1 SIGKILLed"


def test_the_next_mesh_keeps_the_global_batch_splitting_evenly(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 1000})
    assert elastic.fitting_processes(str(tmp_path), 3, 2) == 2  # 1000 over 6 devices: no
    assert elastic.fitting_processes(str(tmp_path), 3, 1) == 2
    assert elastic.fitting_processes(str(tmp_path), 2, 4) == 2
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 63})
    assert elastic.fitting_processes(str(tmp_path), 3, 2) == 3  # none fits: train's error says so


def test_generation_records_the_checkpoint_it_resumed_from(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "ckpt-00000004"}]})
    job = ended((0, -9))
    job.steps = {0: 3}
    record = mesh_history.record(2, 1, 2, str(tmp_path), 0, job)
    assert (record["processes"], record["devices"], record["global_batch"]) == (1, 2, 64)
    assert (record["first_step"], record["last_step"]) == (4, 7)
    assert elastic.batch_line(str(tmp_path), 2) == "global batch kept at 64 (32 per device)"
    # a generation lost before it restored (killed while joining): from the newest checkpoint
    path = tmp_path / rundir.CHECKPOINTS / "ckpt-00000009"
    path.mkdir(parents=True)
    rundir.write_json(str(path / rundir.CHECKPOINT_MANIFEST), {})
    job.steps = {}
    record = mesh_history.record(3, 2, 2, str(tmp_path), 1, job)
    assert (record["first_step"], record["last_step"]) == (9, 9)


STAND_IN = os.path.join(os.path.dirname(__file__), "elastic_stand_in.py")


def stand_in_launch(launch_flags: list[str], train_flags: list[str]) -> subprocess.CompletedProcess:
    """`meshfit launch --elastic LAUNCH FLAGS -- <stand-in trainer> TRAIN FLAGS` (tests/elastic_stand_in.py:
    processes that take milliseconds, so that no test of the launcher's decisions trains)."""
    command = [sys.executable, STAND_IN, "launch", "--elastic", "--show", "first", *launch_flags,
               "--", sys.executable, STAND_IN, "train", *train_flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=SAFETY_SECONDS,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def meshes(run: str) -> list[tuple]:
    with open(os.path.join(run, mesh_history.GENERATIONS)) as f:
        return [(g["processes"], g["first_step"], g["last_step"]) for g in json.load(f)]


@pytest.mark.parametrize("flags, kill, stop, checkpoint", [
    (["--processes", "3", "--max-restarts", "1", "--no-grow"], "last", "--max-restarts 1 reached",
     "ckpt-00000002"),  # 3 -> 2 processes, then a second loss: no restart left
    (["--processes", "2", "--min-processes", "2"], "1@2", "1 process(es) left, fewer than "
     "--min-processes 2", "ckpt-00000002"),
])
def test_a_limit_ends_the_job_in_one_line_and_the_run_resumes(tmp_path, flags, kill, stop, checkpoint):
    run = str(tmp_path / "run")
    job = stand_in_launch(flags, ["--out", run, "--kill", kill])
    errors = [line for line in job.stderr.splitlines() if "error" in line]
    assert job.returncode == 128 + signal.SIGKILL and len(errors) == 1, job.stderr
    assert errors[0].startswith("meshfit: error: elastic launch stopped after generation") and \
        f": {stop}; continue from {checkpoint} with --resume {run}" in errors[0], errors[0]
    newest = rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))[-1]
    assert os.path.basename(newest) == checkpoint  # committed, and nothing newer half-written
    before = meshes(run)
    again = stand_in_launch(["--processes", "1"], ["--resume", run])
    assert again.returncode == 0, again.stderr
    with open(os.path.join(run, rundir.CONFIG)) as f:
        assert json.load(f)["resumed"][-1]["checkpoint"] == checkpoint
    assert meshes(run) == before + [(1, 2, 6)]  # the run's history of meshes goes on


@pytest.mark.parametrize("flags", [["--no-grow"], ["--max-restarts", "0"]])
def test_a_hung_process_is_named_in_one_line(tmp_path, monkeypatch, flags):
    """The stall watchdog names hung process 1: a job that goes on prints only the elastic line,
    a stopped one exactly one error line (not the watchdog's line as well)."""
    monkeypatch.setenv("MESHFIT_STALL_TIMEOUT", "1")
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", *flags], ["--out", run, "--hang", "1@2"])
    errors = [line for line in job.stderr.splitlines() if "error" in line]
    hung = "process 1 of 2 hung after starting 2 training steps (the others as many, but got further)"
    if flags == ["--no-grow"]:
        assert job.returncode == 0 and errors == [], job.stderr
        assert f"meshfit launch: elastic: {hung}: no process made progress for 1 s" in job.stderr
        assert meshes(run) == [(2, 0, 2), (1, 2, 6)]
    else:
        assert job.returncode == 124 and len(errors) == 1, job.stderr
        assert errors[0].startswith(f"meshfit: error: elastic launch stopped after generation 1 "
                                    f"({hung}") and "--max-restarts 0 reached" in errors[0], errors[0]


def test_a_lost_process_comes_back_at_the_next_checkpoint(tmp_path):
    """2 processes, process 1 lost after step 2: step 3 runs on 1 process, whose checkpoint is the
    boundary where the launcher stops it (an agreed save) and the mesh grows back to 2."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2"], ["--out", run, "--kill", "1@2", "--hold-below", "2"])
    assert job.returncode == 0, job.stderr
    assert ("meshfit launch: elastic: ckpt-00000003 committed on 1 process(es); generation 3: 2 "
            "process(es) x 1 device(s) again (was 1 x 1)") in job.stderr, job.stderr
    with open(os.path.join(run, rundir.METRICS)) as f:
        generations = json.load(f)["generations"]
    assert meshes(run) == [(2, 0, 2), (1, 2, 3), (2, 3, 6)]  # which steps ran on which mesh
    assert [(g["generation"], g["ended"]) for g in generations] == [
        (1, "process 1 of 2 failed with SIGKILL (exit code -9)"),
        (2, "stopped after ckpt-00000003 to grow back to 2 process(es)"), (3, "finished")]
    assert generations[1]["lost_steps"] == 0  # the stop saved where it stopped


def test_per_core_batch_kept_with_micro_batches_until_the_mesh_grows_back(tmp_path):
    """--keep-batch per-core: 2 -> 1 process keeps each device's 4 rows of the global batch of 8
    by asking the smaller generation for 2 micro-batches, and the full mesh again for none."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--keep-batch", "per-core"],
                          ["--out", run, "--kill", "1@2", "--hold-below", "2"])
    assert job.returncode == 0, job.stderr
    assert ("generation 2: 1 process(es) x 1 device(s) (was 2 x 1), per-core batch kept at 4 "
            "(global batch 8 in 2 micro-batches), resuming") in job.stderr, job.stderr
    assert "again (was 1 x 1), per-core batch kept at 4 (global batch 8), resuming" in job.stderr
    with open(os.path.join(run, rundir.CONFIG)) as f:  # the commands the generations ran
        assert [r["micro_batches"] for r in json.load(f)["resumed"]] == [2, None]
    with open(os.path.join(run, mesh_history.GENERATIONS)) as f:
        assert [g["micro_batches"] for g in json.load(f)] == [1, 2, 1]


def test_per_core_micro_batches_are_the_fewest_equal_slices_no_larger(tmp_path):
    run = str(tmp_path)
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"global_batch": 1000})
    assert elastic.micro_batches_for(run, 8, 8) == 1
    assert elastic.micro_batches_for(run, 4, 8) == 2
    assert elastic.micro_batches_for(run, 4, 8, ["--micro-batches", "5"]) == 10  # the command's own, kept
    assert elastic.batch_line(run, 4, 8) == "per-core batch kept at 125 (global batch 1000 in 2 micro-batches)"
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"global_batch": 1200})
    assert elastic.micro_batches_for(run, 4, 6) == 2  # 150 rows per device at a time, not 200 at once
    assert elastic.batch_line(run, 4, 6) == ("per-core batch 150, below the 200 kept (global batch 1200 "
                                             "in 2 micro-batches)")
    assert elastic.micro_batches_for(run, 7, 8) is None  # does not split: train says so
    argv = ["train", "--micro-batches", "5"]
    assert elastic.with_micro_batches(argv, 5) == argv and elastic.with_micro_batches(argv, None) == argv
    assert elastic.with_micro_batches(argv, 10) == ["train", "--micro-batches", "10"]
    assert elastic.with_micro_batches(["train"], 1) == ["train"]


def test_the_mesh_grows_at_a_new_checkpoint_but_not_the_run_s_last(tmp_path):
    run = str(tmp_path)
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"epochs": 2})

    def commit(step: int) -> None:
        path = os.path.join(run, rundir.CHECKPOINTS, f"ckpt-{step:08d}")
        os.makedirs(path)
        rundir.write_json(os.path.join(path, "state.json"), {"global_step": step, "steps_per_epoch": 4})
        rundir.write_json(os.path.join(path, rundir.CHECKPOINT_MANIFEST), {})

    commit(4)
    boundary = elastic.NextCheckpoint(run)
    assert not boundary()  # the checkpoint the generation resumed from
    os.makedirs(os.path.join(run, rundir.CHECKPOINTS, "ckpt-00000006"))  # being written
    assert not boundary()
    commit(8)
    assert not boundary()  # the run's last step: it is about to finish
    commit(7)
    assert boundary() and boundary.found == "ckpt-00000007"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_process_is_left_out_and_the_run_finishes_on_the_survivor(tmp_path, how):
    """SIGKILL: process 1 dies once a local copy (every step) is newer than the newest committed
    checkpoint, the survivor resumes from that copy, and process 1 comes back at the next
    (epoch-end) checkpoint; SIGSTOP (with --no-grow): it freezes, and JAX's heartbeat check (10 s
    here) names it when it ends process 0."""
    from meshfit.run import local_copies

    data = tmp_path / "data"
    write_idx_dataset(data / "fashion-mnist", n_train=256, n_test=64)  # 4 steps of 64 an epoch
    run, epochs = str(tmp_path / "run"), 6
    first_checkpoint = os.path.join(run, "checkpoints", "ckpt-00000004")
    command = [*PYTHON_MESHFIT, "launch", "--processes", "2", "--devices-per-process", "2",
               "--elastic", *(["--no-grow"] if how == "SIGSTOP" else []), "--", "meshfit", "train", "fashion-mnist-cnn", "--global-batch", "64",
               "--seed", "0", "--epochs", str(epochs), "--data-dir", str(data), "--out", run,
               "--checkpoint-every", "epoch", "--local-copy-every", "1" if how == "SIGKILL" else "0"]
    copies = local_copies.Host(run)
    copies.folder = os.path.join(tmp_path, "local", os.path.basename(copies.folder))
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, env.STALL_TIMEOUT: str(STALL_SECONDS),
                                env.HEARTBEAT_TIMEOUT: "10", env.LOCAL_COPIES: str(tmp_path / "local")})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SAFETY_SECONDS
        newer = 4  # SIGKILL: a local copy newer than the newest committed checkpoint, once seen
        while not (rundir.checkpoint_complete(first_checkpoint) and
                   (how == "SIGSTOP" or (copies.steps() or [0])[-1] > newer)) and \
                job.poll() is None and time.monotonic() < deadline:
            committed = rundir.list_checkpoints(os.path.join(run, "checkpoints"))
            newer = max([4, *(int(p[-8:]) for p in committed)])
            time.sleep(0.01)
        pids = re.search(r"pids (\d+) (\d+)", "".join(output)).groups()
        os.kill(int(pids[1]), getattr(signal, how))  # process 1 is lost mid-run
        copied = copies.steps()
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
    first, second = metrics["generations"][:2]
    assert first["ended"].startswith(why) and first["lost_processes"] == [1]
    assert second["first_step"] >= 4
    assert first["lost_steps"] == first["last_step"] - second["first_step"] >= 0
    if how == "SIGSTOP":
        assert meshes == [(2, 4), (1, 2)] and second["ended"] == "finished"
    else:  # the agreed stop after the next (epoch-end) checkpoint saved where it stopped
        third = metrics["generations"][2]
        assert meshes == [(2, 4), (1, 2), (2, 4)], metrics["generations"]
        assert re.fullmatch(r"stopped after ckpt-\d+ to grow back to 2 process\(es\)", second["ended"])
        assert third["ended"] == "finished" and third["first_step"] >= 8
        assert second["lost_steps"] == max(second["last_step"] - third["first_step"], 0)
        # the survivor resumed from the newest local copy (at least the one seen before the kill,
        # newer than every committed checkpoint then): only the steps since it ran again
        with open(os.path.join(run, "config.json")) as f:
            resumed = [r["checkpoint"] for r in json.load(f)["resumed"]]
        assert resumed[0] == f"local:ckpt-{second['first_step']:08d}", resumed
        assert second["first_step"] >= copied[-1] > newer and "the local copy ckpt-" in text
        assert resumed[1] == f"ckpt-{third['first_step']:08d}"  # the agreed stop's save
        assert not os.path.exists(copies.folder)  # removed once the run finished
    with open(os.path.join(run, "history.json")) as f:
        assert [r["epoch"] for r in json.load(f)] == list(range(1, epochs + 1))  # every epoch trained
    assert metrics["goodput"]["sessions"] == len(meshes) and metrics["goodput"]["seconds"]["lost"] > 0


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
