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
from meshfit.launch import elastic, growth, local, losses, mesh_history, train_argv
from meshfit.errors import MeshfitError
from meshfit.run import rundir

# As in test_launch.py: the launcher's watchdog bounds a job by its progress, SAFETY_SECONDS only
# ends a test whose watchdog failed.
STALL_SECONDS = 180
SAFETY_SECONDS = 1800
PYTHON_MESHFIT = [sys.executable, "-m", "meshfit"]


def test_every_generation_trains_one_run_directory_and_saves_more_often():
    argv, run = train_argv.train_command([*PYTHON_MESHFIT, "train", "fashion-mnist-cnn", "--out", "r"])
    assert run == "r" and argv[-4:] == ["--checkpoint-every", train_argv.ELASTIC_CHECKPOINT_EVERY,
                                        "--local-copy-every", train_argv.ELASTIC_LOCAL_COPY_EVERY]
    argv, run = train_argv.train_command([*PYTHON_MESHFIT, "train", "--resume=old", "--checkpoint-every", "5"])
    assert run == "old" and "--resume=old" not in argv and argv.count("--checkpoint-every") == 1
    argv, run = train_argv.train_command([*PYTHON_MESHFIT, "train", "fashion-mnist-cnn"])
    assert argv[argv.index("--out") + 1] == run and os.path.basename(run).startswith("fashion-mnist-cnn-")  # as train names it


def test_elastic_needs_meshfit_train_and_sane_limits():
    with pytest.raises(MeshfitError, match="restarts a `meshfit train` run"):
        elastic.elastic_launch(["meshfit", "info"], 2)
    with pytest.raises(MeshfitError, match="--min-processes must be between 1 and --processes"):
        elastic.elastic_launch(["meshfit", "train"], 2, min_processes=3)


@pytest.mark.parametrize("flags, message", [
    (["--min-processes", "2"], "--min-processes, --max-restarts-without-progress, --no-grow, "
                               "--on-loss, --spares, --keep-batch and --via go with --elastic"),
    (["--on-loss", "shrink"], "--on-loss, --spares, --keep-batch and --via go with --elastic"),
    (["--spares", "0"], "--spares, --keep-batch and --via go with --elastic"),
    (["--elastic", "--spares", "-1"], "--spares must be at least 0"),
    (["--keep-batch", "per-core"], "--keep-batch and --via go with --elastic"),
    (["--via", "srun"], "--keep-batch and --via go with --elastic"),
    (["--elastic", "--port", "1234"], "--port goes without --elastic"),
    (["--elastic", "--max-restarts-without-progress", "-1"],
     "--max-restarts-without-progress must be at least 0"),
])
def test_elastic_flags_are_checked_in_one_line(flags, message, capsys):
    from meshfit import cli

    assert cli.main(["launch", "--processes", "2", *flags, "--", "meshfit", "train"]) == 2
    assert message in capsys.readouterr().err


def ended(failure=None, verdict=None, tail=(), behind=(), missing=(), count=2, timed_out=False):
    started = [SimpleNamespace(tail=list(tail) if failure and i == failure[0] else []) for i in range(count)]
    return local.Ended(started, verdict, {}, failure, list(missing), "", 15, list(behind), {}, 1.0,
                        timed_out)


def test_which_ends_a_restart_outlives_and_who_is_left_out():
    assert losses.lost_processes(ended((1, -signal.SIGKILL)), 2) == (True, [1])
    # JAX's heartbeat check aborts process 0 and names the stopped one
    abort = ["... stopped sending heartbeats ...", "1", "Fatal Python error: Aborted"]
    assert losses.lost_processes(ended((0, -signal.SIGABRT), tail=abort), 2) == (True, [1])
    # process 0, the coordinator, frozen: a survivor's heartbeat to it times out and JAX aborts
    # the survivor without naming anyone (as seen with JAX 0.10.2); process 0 is the one lost
    unanswered = ["F1128 client.h:80] Terminating process because the JAX distributed service "
                  "detected fatal errors. ... absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded", "",
                  "RPC: /xla.coordination.CoordinationService/Heartbeat",
                  "*** Check failure stack trace: ***"]
    job = ended((1, -signal.SIGABRT), tail=unanswered)
    assert losses.lost_processes(job, 2) == (True, [0])
    assert losses.what_ended(job, [0]) == ("process 1 of 2 failed with SIGABRT (exit code -6) because "
                                            "process 0, the coordinator, stopped answering heartbeats")
    assert losses.lost_processes(ended(verdict=124, behind=[1]), 2) == (True, [1])
    assert losses.lost_processes(ended(verdict=124, behind=[0, 1]), 2) == (True, [])  # as many again
    assert losses.lost_processes(ended(verdict=124, missing=[1]), 2) == (True, [1])
    # its own error, a stop after saving, the user's --timeout: restarting would not help
    assert losses.lost_processes(ended((1, 2)), 2) == (False, [])
    assert losses.lost_processes(ended((1, 143)), 2) == (False, [])
    assert losses.lost_processes(ended(verdict=124, timed_out=True), 2) == (False, [])


def test_processes_killed_together_are_all_lost_but_not_the_ones_the_launcher_stopped():
    job = ended((1, -signal.SIGKILL), count=4)
    job.codes = {1: -9, 2: -9, 0: -9, 3: 143}
    for i, process in enumerate(job.started):
        process.killed = i == 0  # by the launcher, after its grace period (3 stopped on SIGTERM)
    assert losses.lost_processes(job, 4) == (True, [1, 2])
    assert losses.what_ended(job, [1, 2]) == ("process 1 of 4 failed with SIGKILL (exit code -9), "
                                                "and so did process(es) 2")
    # a survivor's error (its collective's peer gone) reached the launcher before the kill did
    job = ended((0, 1), count=2)
    job.codes = {0: 1, 1: -9}
    job.started[0].killed = job.started[1].killed = False
    assert losses.lost_processes(job, 2) == (True, [1])
    assert losses.what_ended(job, [1]) == "process 0 of 2 failed with exit code 1, process(es) 1 SIGKILLed"


def test_the_next_mesh_keeps_the_global_batch_splitting_evenly(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 1000})
    assert losses.fitting_processes(str(tmp_path), 3, 2) == 2  # 1000 over 6 devices: no
    assert losses.fitting_processes(str(tmp_path), 3, 1) == 2
    assert losses.fitting_processes(str(tmp_path), 2, 4) == 2
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 63})
    assert losses.fitting_processes(str(tmp_path), 3, 2) == 3  # none fits: train's error says so


def test_generation_records_the_checkpoint_it_resumed_from(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "ckpt-00000004"}]})
    job = ended((0, -9))
    job.steps = {0: 3}
    record = mesh_history.record(2, 1, 2, str(tmp_path), 0, job)
    assert (record["processes"], record["devices"], record["global_batch"]) == (1, 2, 64)
    assert (record["first_step"], record["last_step"]) == (4, 7)
    assert train_argv.batch_line(str(tmp_path), 2) == "global batch kept at 64 (32 per device)"
    # a generation lost before it restored (killed while joining): from the newest checkpoint
    path = tmp_path / rundir.CHECKPOINTS / "ckpt-00000009"
    path.mkdir(parents=True)
    rundir.write_json(str(path / rundir.CHECKPOINT_MANIFEST), {})
    job.steps = {}
    record = mesh_history.record(3, 2, 2, str(tmp_path), 1, job)
    assert (record["first_step"], record["last_step"]) == (9, 9)


def test_the_steps_run_again_are_the_resumed_ledgers_count(tmp_path):
    """One count of the steps run again: the one the next generation's goodput ledger made as it
    resumed (config.json's "resumed" record, metrics.json's goodput lost_steps), not the lost
    generation's progress reports (once a second, they lag or lead it); a generation lost before
    it restored ran nothing again (the next resume counts those steps); a run directory of an
    older meshfit, without the count, falls back to the reports."""
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "local:ckpt-00000006", "steps_run_again": 1}]})
    job = ended((0, -9))
    job.steps = {0: 3}
    last = {"processes": 2, "last_step": 9, "step_seconds": 0.5, "stop_seconds": 0.3}
    record = mesh_history.record(2, 2, 2, str(tmp_path), 0, job)
    mesh_history.continued(last, record)
    assert (last["lost_steps"], record["change"]["wasted"]) == (1, 0.5)
    job.steps = {}
    never_restored = mesh_history.record(3, 2, 2, str(tmp_path), 1, job)  # no record of its own
    mesh_history.continued(record, never_restored)
    assert record["lost_steps"] == 0
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "local:ckpt-00000006"}]})
    older = mesh_history.record(2, 2, 2, str(tmp_path), 0, job)
    mesh_history.continued(last, older)
    assert last["lost_steps"] == 3  # 9 reported, 6 resumed


def test_a_mesh_change_splits_into_restore_reinitialisation_and_wasted_progress(tmp_path):
    """The parts goodput tools name apart: restore (from config.json's "resumed" record of the
    new generation), reinitialisation (the rest of its start to its first step), wasted progress
    (the steps run again at the generation before's seconds a step), and the stop."""
    rundir.write_json(str(tmp_path / "config.json"), {"global_batch": 64, "resumed": [
        {"checkpoint": "ckpt-00000004", "restore_seconds": 1.25}]})
    job = ended((0, -9))
    job.steps, job.start_seconds, job.seconds = {0: 3}, 9.0, 20.0
    record = mesh_history.record(2, 1, 2, str(tmp_path), 0, job)
    assert record["restore_seconds"] == 1.25 and record["start_seconds"] == 9.0
    last = {"processes": 2, "last_step": 5, "step_seconds": 0.5, "stop_seconds": 0.3}
    mesh_history.continued(last, record)
    assert record["change"] == {"kind": "scale down", "stop": 0.3, "restart": 9.0, "restore": 1.25,
                                "reinitialisation": 7.8, "wasted": 0.5}
    record.update(start_seconds=None)  # never trained: not measured
    assert mesh_history.change(last, record)["reinitialisation"] is None


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
    (["--processes", "3", "--max-restarts-without-progress", "1", "--no-grow"], "early",
     "2 losses in a row without progress (no newer checkpoint to resume from): "
     "--max-restarts-without-progress 1 reached", "its start (no checkpoint yet)"),
    (["--processes", "2", "--min-processes", "2", "--on-loss", "shrink"], "1@2", "1 process(es) left, fewer than "
     "--min-processes 2", "ckpt-00000002"),
])
def test_a_limit_ends_the_job_in_one_line_and_the_run_resumes(tmp_path, flags, kill, stop, checkpoint):
    run = str(tmp_path / "run")
    job = stand_in_launch(flags, ["--out", run, "--kill", kill])
    errors = [line for line in job.stderr.splitlines() if "error" in line]
    assert job.returncode == 128 + signal.SIGKILL and len(errors) == 1, job.stderr
    assert errors[0].startswith("meshfit: error: elastic launch stopped after generation") and \
        f": {stop}; continue from {checkpoint} with --resume {run}" in errors[0], errors[0]
    newest = rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))
    assert os.path.basename(newest[-1]) == checkpoint if newest else checkpoint.startswith("its start")
    before = meshes(run)
    again = stand_in_launch(["--processes", "1"], ["--resume", run])
    assert again.returncode == 0, again.stderr
    with open(os.path.join(run, rundir.CONFIG)) as f:
        assert json.load(f)["resumed"][-1]["checkpoint"] == (checkpoint if newest else "none")
    assert meshes(run) == before + [(1, 2 if newest else 0, 6)]  # the run's history of meshes goes on


def test_losses_between_saves_never_stop_the_job(tmp_path):
    """--kill last: every generation of more than one process loses its highest process after a
    committed step, 4 -> 2 -> 1 processes (the batch of 8 splits over no 3): each loss followed
    progress, so a limit of 0 restarts without progress lets the run finish."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "4", "--no-grow", "--max-restarts-without-progress", "0",
                           "--on-loss", "shrink"],
                          ["--out", run, "--kill", "last"])
    assert job.returncode == 0, job.stderr
    assert [m[0] for m in meshes(run)] == [4, 2, 1]


def test_processes_stopped_from_outside_are_no_restarts_without_progress(tmp_path):
    """--freeze early: each of the run's first 4 generations loses its highest process to SIGSTOP
    before a step, a burst of stops from outside with nothing committed in between. Such a loss
    cannot repeat by itself, so none counts toward --max-restarts-without-progress (3), which 4
    SIGKILLs before a step would pass (the limit's test above): the run finishes."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--no-grow"], ["--out", run, "--freeze", "early"])
    assert job.returncode == 0, job.stderr
    assert job.stderr.count("stopped (SIGSTOP) for 0.5 s (seen in /proc); generation") == 4, job.stderr
    assert meshes(run) == [(2, 0, 0), (2, 0, 0), (1, 0, 0), (1, 0, 0), (1, 0, 6)]


@pytest.mark.parametrize("flags", [["--no-grow"], ["--min-processes", "2"]])
def test_a_hung_process_is_named_in_one_line(tmp_path, monkeypatch, flags):
    """The stall watchdog names hung process 1: a job that goes on prints only the elastic line,
    a stopped one exactly one error line (not the watchdog's line as well)."""
    monkeypatch.setenv("MESHFIT_STALL_TIMEOUT", "1")
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--on-loss", "shrink", *flags], ["--out", run, "--hang", "1@2"])
    errors = [line for line in job.stderr.splitlines() if "error" in line]
    hung = "process 1 of 2 hung after starting 2 training steps (the others as many, but got further)"
    if flags == ["--no-grow"]:
        assert job.returncode == 0 and errors == [], job.stderr
        assert f"meshfit launch: elastic: {hung}: no process made progress for 1 s" in job.stderr
        assert meshes(run) == [(2, 0, 2), (1, 2, 6)]
    else:
        assert job.returncode == 124 and len(errors) == 1, job.stderr
        assert errors[0].startswith(f"meshfit: error: elastic launch stopped after generation 1 "
                                    f"({hung}") and "fewer than --min-processes 2" in errors[0], errors[0]


def test_a_lost_process_comes_back_at_the_next_checkpoint(tmp_path):
    """2 processes, process 1 lost after step 2: step 3 runs on 1 process, whose checkpoint is the
    boundary where the launcher stops it (an agreed save, at step 4: --stop-ahead) and the mesh
    grows back to 2 from that save, which the launcher's line names."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--on-loss", "shrink"], ["--out", run, "--kill", "1@2", "--hold-below", "2",
                                                 "--stop-ahead"])
    assert job.returncode == 0, job.stderr
    assert ("meshfit launch: elastic: ckpt-00000003 committed on 1 process(es); generation 3: 2 "
            f"process(es) x 1 device(s) again (was 1 x 1), global batch kept at 8 (4 per device), "
            f"resuming {run} from ckpt-00000004, saved as it stopped") in job.stderr, job.stderr
    with open(os.path.join(run, rundir.CONFIG)) as f:
        assert [r["checkpoint"] for r in json.load(f)["resumed"]] == ["ckpt-00000002", "ckpt-00000004"]
    assert f"resuming {run} from ckpt-00000002\n" in job.stderr  # the loss's line names it too
    with open(os.path.join(run, rundir.METRICS)) as f:
        generations = json.load(f)["generations"]
    assert meshes(run) == [(2, 0, 2), (1, 2, 4), (2, 4, 6)]  # which steps ran on which mesh
    assert [(g["generation"], g["ended"]) for g in generations] == [
        (1, "process 1 of 2 failed with SIGKILL (exit code -9)"),
        (2, "stopped after ckpt-00000003 to grow back to 2 process(es)"), (3, "finished")]
    assert generations[1]["lost_steps"] == 0  # the stop saved where it stopped
    assert "after 3 generations (2x1 -> 1x1 -> 2x1 devices), 0 steps run again" in job.stderr


def test_a_generation_that_finished_as_it_was_stopped_to_grow_ends_the_job(tmp_path):
    """The smaller generation finished the run before the launcher's stop at its checkpoint
    reached it (a short run's last steps are quick beside the launcher's poll): the job is over.
    It once started a third generation on the finished run, which trained nothing and wrote
    metrics.json and the goodput block again, and recorded the second as stopped to grow."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--on-loss", "shrink"],
                          ["--out", run, "--kill", "1@2", "--hold-below", "2", "--finish-on-stop"])
    assert job.returncode == 0, job.stderr
    assert meshes(run) == [(2, 0, 2), (1, 2, 6)]
    with open(os.path.join(run, rundir.METRICS)) as f:
        assert [g["ended"] for g in json.load(f)["generations"]][1:] == ["finished"]
    assert "again (was" not in job.stderr and "after 2 generations (2x1 -> 1x1 devices)" in job.stderr


def test_a_generation_stopped_to_grow_shows_the_epoch_lines_it_finished_but_not_its_stop():
    """The agreed stop may end an epoch the stopped generation finished: its line is the only
    one of that epoch (history.json has its record), so it is shown; the stop's own line is not.
    All of it was held once, and a grown-back run printed no line for that epoch."""
    from meshfit.launch.output import Output

    output = Output({}, hold_on_stop=True)
    output.stop()
    assert output.shown(0, "epoch 5/6  accuracy 0.80 loss 0.90  |  0.21 s  53.7 ms/step")
    assert not output.shown(0, "training stopped by SIGTERM after step 20, saved to r/ckpt-00000020; "
                               "continue with: meshfit train --resume r")
    assert list(output.held_lines[0]) == ["training stopped by SIGTERM after step 20, saved to "
                                          "r/ckpt-00000020; continue with: meshfit train --resume r"]


def test_a_loss_and_a_growth_are_one_line_each_and_the_devices_are_reported_once(tmp_path):
    """What the user sees of an elastic job: the survivors' aborts (JAX's coordination service
    lines) and the stopped generation's "training stopped by SIGTERM ... continue with" are held
    back, the device report is printed in full once and then as one line a generation."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--show", "all", "--on-loss", "shrink"],
                          ["--out", run, "--kill", "1@2", "--hold-below", "2"])
    assert job.returncode == 0, job.stderr
    shown = job.stdout + job.stderr
    for noise in ("client.h:80] Terminating process", "Check failure stack trace", "coordination service",
                  "training stopped by SIGTERM", "continue with: meshfit train"):
        assert noise not in shown, shown
    launcher = [line for line in job.stderr.splitlines() if line.startswith("meshfit launch: elastic")]
    assert len(launcher) == 3 and "process 1 of 2 failed with SIGKILL" in launcher[0], job.stderr
    assert job.stdout.count("meshfit connected\n") == 1 and job.stdout.count("devices per host 1\n") == 1
    assert job.stdout.count("[0] meshfit connected: hosts 1 (this is process 0), devices per host 1, "
                            "replicas 1 (the rest as reported before)") == 1, job.stdout
    assert job.stdout.count("[0] meshfit connected: hosts 2 (this is process 0)") == 1, job.stdout


def test_per_core_batch_kept_with_micro_batches_until_the_mesh_grows_back(tmp_path):
    """--keep-batch per-core: 2 -> 1 process keeps each device's 4 rows of the global batch of 8
    by asking the smaller generation for 2 micro-batches, and the full mesh again for none."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--keep-batch", "per-core", "--on-loss", "shrink"],
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
    assert train_argv.micro_batches_for(run, 8, 8) == 1
    assert train_argv.micro_batches_for(run, 4, 8) == 2
    assert train_argv.micro_batches_for(run, 4, 8, ["--micro-batches", "5"]) == 10  # the command's own, kept
    assert train_argv.batch_line(run, 4, 8) == "per-core batch kept at 125 (global batch 1000 in 2 micro-batches)"
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"global_batch": 1200})
    assert train_argv.micro_batches_for(run, 4, 6) == 2  # 150 rows per device at a time, not 200 at once
    assert train_argv.batch_line(run, 4, 6) == ("per-core batch 150, below the 200 kept (global batch 1200 "
                                             "in 2 micro-batches)")
    assert train_argv.micro_batches_for(run, 7, 8) is None  # does not split: train says so
    argv = ["train", "--micro-batches", "5"]
    assert train_argv.with_micro_batches(argv, 5) == argv and train_argv.with_micro_batches(argv, None) == argv
    assert train_argv.with_micro_batches(argv, 10) == ["train", "--micro-batches", "10"]
    assert train_argv.with_micro_batches(["train"], 1) == ["train"]


def test_the_mesh_grows_at_a_new_checkpoint_but_not_the_run_s_last(tmp_path):
    run = str(tmp_path)
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"epochs": 2})

    def commit(step: int) -> None:
        path = os.path.join(run, rundir.CHECKPOINTS, f"ckpt-{step:08d}")
        os.makedirs(path)
        rundir.write_json(os.path.join(path, "state.json"), {"global_step": step, "steps_per_epoch": 4})
        rundir.write_json(os.path.join(path, rundir.CHECKPOINT_MANIFEST), {})

    commit(4)
    boundary = growth.NextCheckpoint(run)
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
    (epoch-end) checkpoint; SIGSTOP (with --no-grow): it freezes, and the launcher sees it stopped
    in /proc after half a second (before JAX's heartbeat check, 10 s here)."""
    from meshfit.run import local_copies

    data = tmp_path / "data"
    write_idx_dataset(data / "fashion-mnist", n_train=256, n_test=64)  # 4 steps of 64 an epoch
    run, epochs = str(tmp_path / "run"), 6
    first_checkpoint = os.path.join(run, "checkpoints", "ckpt-00000004")
    command = [*PYTHON_MESHFIT, "launch", "--processes", "2", "--devices-per-process", "2",
               "--elastic", "--on-loss", "shrink", *(["--no-grow"] if how == "SIGSTOP" else []), "--", "meshfit", "train", "fashion-mnist-cnn", "--global-batch", "64",
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
           "process(es) 1 of 2 stopped (SIGSTOP) for 0.5 s (seen in /proc)")  # the launcher's /proc check
    assert why in text, text[-4000:]
    assert "generation 2: 1 process(es) x 2 device(s) (was 2 x 2)" in text, text[-4000:]
    for noise in ("Terminating process", "Check failure stack trace", "continue with: meshfit train"):
        assert noise not in text, text[-4000:]  # the survivors' ends and the stops are held back
    assert text.count("  devices per host") == 1, text[-4000:]  # the report once, then one line
    with open(os.path.join(run, "metrics.json")) as f:
        metrics = json.load(f)
    meshes = [(g["processes"], g["devices"]) for g in metrics["generations"]]
    first, second = metrics["generations"][:2]
    assert first["ended"].startswith(why) and first["lost_processes"] == [1]
    assert second["first_step"] >= 4
    # the steps run again: the count the next generation's goodput ledger made as it resumed
    assert first["lost_steps"] == second["ran_again"] >= 0 and first["last_step"] >= second["first_step"]
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
        assert f"resuming {run} from {resumed[0]}\n" in text  # the launcher names both
        assert f"resuming {run} from {resumed[1]}, saved as it stopped" in text
        assert not os.path.exists(copies.folder)  # removed once the run finished
    with open(os.path.join(run, "history.json")) as f:
        assert [r["epoch"] for r in json.load(f)] == list(range(1, epochs + 1))  # every epoch trained
    # host 0 was in every generation; the job's figure is the slowest host's, whose own count
    # leaves out the generations it had no part in
    # (a job that ends on one process has no per-host rows: that host is host 0)
    hosts = metrics["goodput"].get("hosts", [metrics["goodput"]])
    assert hosts[0]["sessions"] == len(meshes) and metrics["goodput"]["seconds"]["lost"] > 0
    assert metrics["goodput"]["sessions"] == hosts[metrics["goodput"].get("host", 0)]["sessions"]


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


def test_the_chaos_drill_repeats_its_faults_and_times_each_recovery(tmp_path):
    """tools/chaos.py's bookkeeping: a seed gives the same faults again; each fault's recovery
    runs to the first step of a generation that started after it; the table's figures."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import random

    import chaos

    def draws(seed):
        faults = chaos.Faults(random.Random(seed), 30.0, 600.0, ["KILL", "STOP"])
        return [(round(faults.next_gap(), 6), faults.rng.randrange(4), faults.rng.choice(faults.signals))
                for _ in range(5)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    # faults at 10 s and 12 s (during the mesh change), 50 s; generations' first steps at 3, 19, 55 s
    assert chaos.recoveries([10.0, 12.0, 50.0, 70.0], [3.0, 19.0, 55.0]) == [9.0, 7.0, 5.0, None]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    faults = chaos.Faults(random.Random(3), 30.0, 600.0, ["KILL"])
    fault = faults.strike([sleeper.pid], 12.5)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    assert fault == {"at": 12.5, "process": 0, "pid": sleeper.pid, "signal": "SIGKILL"}
    assert faults.strike([sleeper.pid], 13.0) is None and len(faults.sent) == 1  # reaped: no fault
    metrics = {"test_accuracy": 0.9, "goodput": {"fraction": 0.8},
               "generations": [{"lost_steps": 1}, {"lost_steps": 2, "change": {
                   "kind": "scale down", "stop": 1.5, "restart": 20.0, "restore": 1.2,
                   "reinitialisation": 18.8, "wasted": 0.5}},
                   {"change": {"kind": "scale up", "stop": 3.0, "restart": None, "wasted": None}}]}
    baseline = {"exit": 0, "wall": 100.0, "metrics": {"test_accuracy": 0.91}}
    generations = [{"appeared": 0.5, "reporting": 2.0, "first_step": 3.0, "gone": 15.0},
                   {"appeared": 15.2, "reporting": 17.0, "first_step": 20.0, "gone": None}]
    assert chaos.change_parts(12.5, generations) == pytest.approx({"stop": 2.5, "start": 1.8,
                                                                   "first step": 3.0})
    assert chaos.change_parts(21.0, generations) is None  # no generation after it
    text = chaos.table(baseline, {"exit": 0, "wall": 125.0, "metrics": metrics, "faults": [fault],
                                  "first_steps": [3.0, 20.0], "generations": generations})
    assert "| of which stop (median s) | 2.5 |" in text
    assert ("| scale downs (launcher's record) | 1: stop 1.5 s, restart 20.0 s (restore time 1.2 s, "
            "reinitialisation 18.8 s), wasted progress 0.5 s |") in text
    assert ("| scale ups (launcher's record) | 1: stop 3.0 s, restart 0.0 s (restore time 0.0 s, "
            "reinitialisation 0.0 s), wasted progress 0.0 s |") in text
    seen, folder = {}, str(tmp_path / "meshfit-launch-1")
    os.makedirs(folder)
    chaos.watch_generations(seen, [folder], 1.0)
    (tmp_path / "meshfit-launch-1" / "progress-0").write_text("0 1 0 python")
    chaos.watch_generations(seen, [folder], 2.0)
    (tmp_path / "meshfit-launch-1" / "progress-0").write_text("1 3 1 compiling")  # dispatching
    chaos.watch_generations(seen, [folder], 3.0)
    (tmp_path / "meshfit-launch-1" / "progress-0").write_text("2 4 2 device")  # the first step done
    chaos.watch_generations(seen, [folder], 3.5)
    chaos.watch_generations(seen, [], 9.0)
    assert seen[folder] == {"appeared": 1.0, "reporting": 2.0, "first_step": 3.5, "gone": 9.0}
    assert "| faults | 1 (1 SIGKILL, 0 SIGSTOP; process 0 1 times) |" in text
    assert "| recovery, fault to next first step (s) | median 7.5, max 7.5 (1 measured) |" in text
    assert "| steps run again | 3 |" in text and "| throughput ratio to the baseline | 0.80 |" in text


def test_a_job_that_lost_every_process_starts_them_again(tmp_path):
    """One process, lost after step 2: its slot is free again at once, so the job goes on (a
    loss after a save is no loss without progress)."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "1"], ["--out", run, "--kill", "0@2"])
    assert job.returncode == 0, job.stderr
    assert meshes(run) == [(1, 0, 2), (1, 2, 6)]
    assert "process 0 of 1 failed with SIGKILL (exit code -9); generation 2: 1 process(es)" in job.stderr
    with open(os.path.join(run, mesh_history.GENERATIONS)) as f:
        change = json.load(f)[1]["change"]
    assert change["kind"] == "restart" and change["stop"] >= 0 and change["restore"] == 0.01
    assert set(change) == {"kind", "stop", "restart", "restore", "reinitialisation", "wasted"}
    assert change["reinitialisation"] is None or change["reinitialisation"] == round(change["restart"] - 0.01, 1)


def test_the_mesh_grows_back_only_when_the_steps_left_repay_the_change(tmp_path, capsys):
    assert growth.pays(100, 0.5, 0.3, 15.0)  # 100 x 0.2 s saved > 15 s
    assert not growth.pays(50, 0.5, 0.3, 15.0) and not growth.pays(100, 0.3, 0.3, 1.0)
    assert growth.pays(None, 0.5, 0.3, 15.0) and growth.pays(100, None, 0.3, 15.0)  # not known: grow
    run = str(tmp_path)
    rundir.write_json(os.path.join(run, rundir.CONFIG), {"epochs": 2, "global_batch": 8})
    plan = elastic.Plan([], run, elastic.Local(), 2, 4, 1, 3, True, "first", None, 1.0, False)
    loop = elastic.Generations(plan)
    loop.count = 1
    loop.generations = [{"processes": 2, "step_seconds": 0.3},
                        {"processes": 1, "change": {"stop": 4.0, "restart": 11.0}}]
    assert loop.growth_pays(0.5, 100) and not loop.growth_pays(0.5, 50) and not loop.growth_pays(0.4, 60)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["meshfit launch: elastic: staying on 1 process(es): growing back would save about "
                     "10 s over the 50 steps left (0.50 s a step now, 0.30 s on 2) and cost about 15 s "
                     "(a mesh change); asking again at each checkpoint"]  # once a generation
    loop.said_stay = False
    assert not loop.growth_pays(0.2, 100)  # the smaller mesh is the faster (a loaded machine)
    assert capsys.readouterr().err.splitlines() == [
        "meshfit launch: elastic: staying on 1 process(es): growing back would be no faster (0.20 s "
        "a step now, 0.30 s on 2); asking again at each checkpoint"]
    path = os.path.join(run, rundir.CHECKPOINTS, "ckpt-00000006")
    os.makedirs(path)
    rundir.write_json(os.path.join(path, "state.json"), {"global_step": 6, "steps_per_epoch": 4})
    assert growth.steps_left(run, path) == 2 and growth.steps_left(run, run) is None


def test_a_stopped_process_is_noticed_in_bounded_time_even_alone(tmp_path, monkeypatch):
    """A job of one process has no peer to notice it stopped (no coordination service): the
    launcher sees its state in /proc and counts it lost after FROZEN_SECONDS, not JAX's
    MESHFIT_HEARTBEAT_TIMEOUT (here 600 s: the test would time out waiting for it)."""
    monkeypatch.setenv("MESHFIT_HEARTBEAT_TIMEOUT", "600")
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "1"], ["--out", run, "--freeze", "0@2"])
    assert job.returncode == 0, job.stderr
    assert ("meshfit launch: elastic: process(es) 0 of 1 stopped (SIGSTOP) for 0.5 s (seen in /proc); "
            "generation 2: 1 process(es)") in job.stderr, job.stderr
    assert meshes(run) == [(1, 0, 2), (1, 2, 6)]


def test_a_frozen_process_is_lost_at_once_a_traced_one_after_the_heartbeat(monkeypatch, tmp_path):
    """Watch.frozen: state T (SIGSTOP) counts after FROZEN_SECONDS, t (a tracer: a debugger,
    py-spy) only after MESHFIT_HEARTBEAT_TIMEOUT; a process running again starts afresh."""
    from meshfit.launch import watchdog

    monkeypatch.setenv("MESHFIT_HEARTBEAT_TIMEOUT", "10")
    states = {0: "S", 1: "T", 2: "t"}
    processes = [SimpleNamespace(index=i, state=lambda i=i: states[i]) for i in range(3)]
    watch = watchdog.Watch(str(tmp_path), 3, 60, 0)
    assert watch.frozen(processes, 100.0) is None and watch.frozen(processes, 100.4) is None
    assert watch.frozen(processes, 100.5) == "process(es) 1 of 3 stopped (SIGSTOP) for 0.5 s (seen in /proc)"
    assert watch.behind == [1]
    states[1] = "R"
    assert watch.frozen(processes, 105.0) is None  # continued: no longer counted; the tracer's 5 s
    states[1] = "T"
    assert watch.frozen(processes, 106.0) is None  # stopped again: counted from now
    states[1] = "S"
    assert watch.frozen(processes, 110.0) == "process(es) 2 of 3 held by a tracer for 10 s (MESHFIT_HEARTBEAT_TIMEOUT)"
    fresh = watchdog.Watch(str(tmp_path), 1, 60, 0)
    assert fresh.frozen([SimpleNamespace(index=0)], 200.0) is None  # no state (an srun task): the heartbeat's
    assert fresh.frozen([SimpleNamespace(index=0)], 300.0) is None


def test_a_process_in_a_callbacks_own_code_is_not_hung(tmp_path):
    """The launcher's stall watchdog: while a process runs a Keras callback's own code (a user's
    evaluation it waits for), the others wait for it in a collective and the job is not hung; once
    it waits elsewhere without progress for the stall timeout, it is."""
    from meshfit.launch import watchdog

    def report(doing):
        for index, what in enumerate((doing, "device")):
            (tmp_path / f"progress-{index}").write_text(f"3 3 3 {what}\n")

    watch = watchdog.Watch(str(tmp_path), 2, 60, 5)
    report("callback")
    assert watch.poll(100.0) is None and watch.poll(110.0) is None
    report("device")
    assert watch.poll(114.0) is None
    assert watch.poll(116.0).startswith("the job hung: no process made progress for 5 s")


def test_a_lost_process_starts_again_at_once_in_its_slot(tmp_path):
    """--on-loss restart (the default): process 1 lost after step 2 starts again at once, so the
    next generation has the same mesh (one change, kind restart) and no growth follows."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2"], ["--out", run, "--kill", "1@2", "--hold-below", "2"])
    assert job.returncode == 0, job.stderr
    assert ("meshfit launch: elastic: process 1 of 2 failed with SIGKILL (exit code -9); generation 2: "
            "2 process(es) x 1 device(s) again (process(es) 1 started again at once), global batch kept "
            f"at 8 (4 per device), resuming {run} from ckpt-00000002\n") in job.stderr, job.stderr
    assert meshes(run) == [(2, 0, 2), (2, 2, 6)]
    with open(os.path.join(run, mesh_history.GENERATIONS)) as f:
        assert json.load(f)[1]["change"]["kind"] == "restart"
    assert len([line for line in job.stderr.splitlines() if line.startswith("meshfit launch: elastic:")]) == 1


def test_a_slot_lost_again_before_a_step_is_left_out(tmp_path):
    """--kill early: the highest process of every job of 2 dies before a step. Its slot starts
    again once; lost again before a step of that restart, it is left out (1 process, which
    finishes; --no-grow keeps it there)."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "2", "--no-grow"], ["--out", run, "--kill", "early"])
    assert job.returncode == 0, job.stderr
    assert [m[0] for m in meshes(run)] == [2, 2, 1]
    assert "generation 2: 2 process(es) x 1 device(s) again (process(es) 1 started again at once)" in job.stderr
    assert ("generation 3: 1 process(es) x 1 device(s) (was 2 x 1; process(es) 1 left out: lost again "
            "before a step since a restart)") in job.stderr, job.stderr


def test_a_slot_lost_after_progress_starts_again_each_time(tmp_path):
    """--kill last: every generation of 4 loses process 3 after its first step; each restart
    made progress, so each starts it again (4 processes throughout, no shrink)."""
    run = str(tmp_path / "run")
    job = stand_in_launch(["--processes", "4", "--max-restarts-without-progress", "0"],
                          ["--out", run, "--kill", "last"])
    assert job.returncode == 0, job.stderr
    assert {m[0] for m in meshes(run)} == {4} and len(meshes(run)) > 2


def test_the_chaos_drill_under_srun_strikes_the_newest_steps_tasks(tmp_path, monkeypatch):
    """tools/chaos.py --via srun: the launcher runs in an allocation salloc holds (--no-kill, one
    task per process, each task's simulated devices on train's line), and a fault goes to a task
    of the allocation's newest srun step, numbered as SLURM numbers them."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import argparse

    import chaos

    args = argparse.Namespace(via="srun", processes=4, devices_per_process=2, launch="--no-grow",
                              data_dir="DATA")
    command = chaos.launch_command(args, "RUN", ["--epochs", "3"])
    assert command[:3] == ["salloc", "--no-kill", "--ntasks=4"]
    assert command[command.index("launch"):command.index("--")] == [
        "launch", "--show", "first", "--elastic", "--no-grow", "--via", "srun"]
    assert command[-5:] == ["RUN", "--epochs", "3", "--simulate-devices", "2"]
    # scontrol listpids of an allocation whose step 0 ended and step 1 runs (batch and extern
    # rows: "-" and step names, skipped)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\nprintf 'PID      JOBID    STEPID   LOCALID GLOBALID\\n"
        "101      7        0        0       0\\n102      7        0        1       1\\n"
        "203      7        1        1       1\\n202      7        1        0       0\\n"
        "300      7        extern   0       0\\n-1       7        batch    -       -\\n'\n")
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert chaos.task_pids("7") == [202, 203]
