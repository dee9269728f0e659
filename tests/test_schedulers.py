"""`meshfit train`, unchanged, started by real schedulers: a one-node SLURM cluster and Open MPI.

tools/slurm/up.sh starts the cluster (munge, slurmctld, slurmd: needs root and Debian's slurm-wlm
and munge) for this module and tools/slurm/down.sh stops it. Each job is 2 tasks x 4 simulated
devices with fsdp, joined by JAX's own SLURM or Open MPI detection, and must end with the weights
of 1 process x 8 devices and a checkpoint holding both processes' shards. Where the cluster or
mpirun cannot start the tests are skipped with the reason; with MESHFIT_TESTS_REQUIRE_SCHEDULERS=1
(as .ci/run sets where it installs them) they fail instead.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import (assert_each_process_wrote_shards, assert_same_weights, environment, model_weights,
                     run_following_progress, run_meshfit, write_idx_dataset)

from meshfit.run import checkpoint_format, rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_TOOLS = os.path.join(ROOT, "tools", "slurm")
EPOCHS = 4  # of 4 steps: a stop after the epoch-1 checkpoint leaves steps to resume
TRAIN = ["fashion-mnist-cnn", "--batch-size", "64", "--seed", "0", "--epochs", str(EPOCHS),
         "--checkpoint-every", "epoch", "--no-tensorboard"]
TWO_TASKS = ["--simulate-devices", "4", "--sharding", "fsdp", "--fsdp-min-size", "10KB"]
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")  # SLURM's job states of a job that ended
# 2 processes sum gradients over gloo in another order than 1 process of 8 devices; Adam divides
# by their root mean square, so weights whose gradients are near 0 carry that rounding: after 16
# steps 1.86e-5 at most, the same for `meshfit launch` as for these jobs (measured 2026-11-25),
# against 3.1e-6 for fsdp against data-parallel in one process.
ROUNDING = 5e-5
STALL_SECONDS = 300  # a job whose log stops growing for this long has hung
# this Python's scripts (meshfit) first on the PATH, as an activated virtual environment has them
ON_PATH = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}


def assert_plain_epoch_lines(text, prefix=""):
    """A job's log as a file wants it: no gloo connection lines, no live bar (ANSI escapes,
    carriage returns), and process 0's epoch lines (`prefix`: srun --label's "0: "), 1 to EPOCHS."""
    assert "[Gloo]" not in text, text[-3000:]
    assert "\x1b" not in text and "\r" not in text, repr(text[-3000:])
    epochs = re.findall(rf"^{prefix}epoch (\d+)/{EPOCHS}  ", text, re.M)
    assert {int(e) for e in epochs} == set(range(1, EPOCHS + 1)), text[-3000:]
    assert len(re.findall(rf"^.*epoch \d+/{EPOCHS}  ", text, re.M)) == len(epochs), text[-3000:]


def unavailable(reason):
    """Skip the test for `reason`, or fail where the schedulers are required (CI)."""
    if os.environ.get("MESHFIT_TESTS_REQUIRE_SCHEDULERS") == "1":
        pytest.fail(f"{reason} (MESHFIT_TESTS_REQUIRE_SCHEDULERS=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """256 training images (4 steps of 64), 64 test images."""
    root = tmp_path_factory.mktemp("data")
    write_idx_dataset(root / "fashion-mnist", n_train=256, n_test=64)
    return str(root)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """model.keras of the run in 1 process x 8 devices."""
    run = str(tmp_path_factory.mktemp("reference") / "run")
    out = run_meshfit("train", *TRAIN, "--data-dir", data_dir, "--out", run, "--simulate-devices", "8",
                      timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return os.path.join(run, "model.keras")


# --------------------------------------------------------------------------------------- SLURM

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment changes that point SLURM's commands at a one-node cluster started for the
    module (stopped after it)."""
    if not shutil.which("bash"):
        unavailable("no bash to run tools/slurm/up.sh")
    up = subprocess.run(["bash", os.path.join(SLURM_TOOLS, "up.sh")], capture_output=True, text=True,
                        timeout=120)
    if up.returncode:
        unavailable((up.stderr.strip().splitlines() or ["tools/slurm/up.sh failed"])[-1])
    folder = up.stdout.strip()
    try:
        yield {"SLURM_CONF": os.path.join(folder, "slurm.conf"), **ON_PATH}
    finally:
        subprocess.run(["bash", os.path.join(SLURM_TOOLS, "down.sh"), folder], timeout=120)


def slurm_command(slurm, *command) -> str:
    out = subprocess.run(command, capture_output=True, text=True, env=environment(slurm), timeout=60)
    assert out.returncode == 0, f"{' '.join(command)}: {out.stderr.strip()}"
    return out.stdout.strip()


def job_fields(slurm, job) -> dict:
    """scontrol's fields of the job (JobState, Restarts, ExitCode, ...)."""
    text = slurm_command(slurm, "scontrol", "show", "job", "--oneliner", job)
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait_for(slurm, job, log, done, what):
    """Wait until `done()`, while the job's log grows (at most STALL_SECONDS without growing);
    fail naming `what` when the job ended or stalled first."""
    size, moved = -1, time.monotonic()
    while not done():
        state = job_fields(slurm, job)["JobState"]
        grown = os.path.getsize(log) if os.path.exists(log) else 0
        if grown != size:
            size, moved = grown, time.monotonic()
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        if state in ENDED and not done():
            pytest.fail(f"job {job} ended ({state}) before {what}:\n{text[-3000:]}")
        if time.monotonic() - moved > STALL_SECONDS:
            slurm_command(slurm, "scancel", "--signal=KILL", "--full", job)
            pytest.fail(f"job {job} made no progress for {STALL_SECONDS} s before {what}:\n{text[-3000:]}")
        time.sleep(0.2)


@pytest.mark.slow
def test_sbatch_job_joins_stops_on_sigterm_requeues_and_ends_as_one_process(slurm, data_dir, reference,
                                                                            tmp_path):
    """tools/slurm/train.sbatch, the docs' script: a SIGTERM to every task (the preemption
    notice SLURM's --signal sends) stops both at one step with a checkpoint, the job requeues
    itself and resumes, and the run ends with the weights of an uninterrupted 1 x 8 run."""
    run, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    job = slurm_command(slurm, "sbatch", "--parsable", "--ntasks=2", f"--output={log}",
                        os.path.join(SLURM_TOOLS, "train.sbatch"), run, *TRAIN, "--data-dir", data_dir, *TWO_TASKS)
    first = os.path.join(run, rundir.CHECKPOINTS, checkpoint_format.checkpoint_name(4))  # after epoch 1
    wait_for(slurm, job, log, lambda: rundir.checkpoint_complete(first), "its first checkpoint")
    slurm_command(slurm, "scancel", "--signal=TERM", job)
    wait_for(slurm, job, log, lambda: job_fields(slurm, job)["JobState"] == "COMPLETED", "it completed")

    text = open(log).read()
    assert re.search(r"^0:\s+hosts\s+2 \(this is process 0\)$", text, re.M), text[-3000:]  # joined
    stops = re.findall(r"^(\d): meshfit: training stopped by SIGTERM after step (\d+)", text, re.M)
    assert sorted(task for task, _ in stops) == ["0", "1"], text[-3000:]
    step = int(stops[0][1])
    assert stops[1][1] == str(step) and step < EPOCHS * 4, text[-3000:]  # one step, mid-run
    assert "every task stopped on SIGTERM (exit code 143); requeued to resume" in text
    assert_plain_epoch_lines(text, prefix="0: ")
    assert re.search(rf"^0: resuming {re.escape(run)} from {checkpoint_format.checkpoint_name(step)}:", text, re.M)
    fields = job_fields(slurm, job)
    assert fields["Restarts"] == "1" and fields["ExitCode"] == "0:0", fields

    final = checkpoint_format.latest(os.path.join(run, rundir.CHECKPOINTS))
    assert checkpoint_format.read_state(final)["global_step"] == EPOCHS * 4
    assert_each_process_wrote_shards(final)
    assert_same_weights(model_weights(os.path.join(run, "model.keras")), model_weights(reference), ROUNDING)


def elastic_job(slurm, log, *launch_args) -> str:
    """sbatch tools/slurm/elastic.sbatch with 2 tasks: `meshfit launch --elastic --via srun
    LAUNCH_ARGS`; the job id."""
    return slurm_command(slurm, "sbatch", "--parsable", "--ntasks=2", f"--output={log}",
                         os.path.join(SLURM_TOOLS, "elastic.sbatch"), *launch_args)


def generations(run) -> list[tuple]:
    """(processes, devices per process, how it ended) of each generation in RUN/generations.json."""
    with open(os.path.join(run, "generations.json")) as f:
        return [(g["processes"], g["devices_per_process"], g["ended"]) for g in json.load(f)]


def test_an_elastic_job_restarts_a_lost_task_s_step_smaller_and_grows_back(slurm, tmp_path):
    """The launcher's decisions with steps of a real allocation, in seconds: tests/elastic_stand_in.py
    stands in for `meshfit train`. Task 1 is SIGKILLed after step 2: srun's line names it, the
    next step has 1 task; at its first checkpoint the launcher stops it to resume (scancel
    --signal=TERM) and the next step has 2 tasks again, which finish."""
    run, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    stand_in = [sys.executable, os.path.join(ROOT, "tests", "elastic_stand_in.py")]
    job = slurm_command(slurm, "sbatch", "--parsable", "--no-kill", "--ntasks=2", f"--output={log}",
                        "--wrap", " ".join([*stand_in, "launch", "--elastic", "--via", "srun", "--on-loss", "shrink", "--",
                                            *stand_in, "train", "--out", run, "--kill", "1@2",
                                            "--hold-below", "2"]))
    wait_for(slurm, job, log, lambda: job_fields(slurm, job)["JobState"] == "COMPLETED", "it completed")
    text = open(log).read()
    assert "meshfit launch: elastic: process 1 of 2 failed with SIGKILL (exit code -9); generation 2: " \
           "1 process(es)" in text, text
    assert re.search(r"generation 3: 2 process\(es\) x 1 device\(s\) again \(was 1 x 1\)", text), text
    assert "elastic run finished after 3 generations (2x1 -> 1x1 -> 2x1 devices)" in text, text
    assert [g[:2] for g in generations(run)] == [(2, 1), (1, 1), (2, 1)]
    assert job_fields(slurm, job)["ExitCode"] == "0:0"


@pytest.mark.slow
def test_an_elastic_job_loses_a_task_and_finishes_on_the_survivor(slurm, data_dir, tmp_path):
    """tools/slurm/elastic.sbatch: `meshfit train` in 2 tasks x 4 simulated devices, 2 epochs;
    task 1 is SIGKILLed once the epoch-1 checkpoint is committed. Generation 2 is a step of 1 task that
    resumes from that checkpoint and finishes: exit 0, the generations in generations.json.
    (A lost node adds an --exclude of it to the next step: test_slurm_step.py; one node cannot
    be lost here.)"""
    run, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    job = elastic_job(slurm, log, "--no-grow", "--on-loss", "shrink", "--", "meshfit", "train", *TRAIN, "--epochs", "2",
                      "--data-dir", data_dir, *TWO_TASKS, "--out", run)
    first = os.path.join(run, rundir.CHECKPOINTS, checkpoint_format.checkpoint_name(4))  # after epoch 1
    wait_for(slurm, job, log, lambda: rundir.checkpoint_complete(first), "its first checkpoint")
    # the pid of task 1 of the job's step (scontrol listpids: PID JOBID STEPID LOCALID GLOBALID)
    rows = [line.split() for line in slurm_command(slurm, "scontrol", "listpids", job).splitlines()[1:]]
    pid = [int(r[0]) for r in rows if len(r) == 5 and r[2].isdigit() and r[4] == "1"][0]
    os.kill(pid, signal.SIGKILL)
    wait_for(slurm, job, log, lambda: job_fields(slurm, job)["JobState"] == "COMPLETED", "it completed")

    text = open(log).read()
    assert "meshfit launch: elastic: process 1 of 2 failed with SIGKILL (exit code -9); generation 2: " \
           "1 process(es) x 4 device(s) (was 2 x 4), global batch kept at 64 (16 per device)" in text, text[-3000:]
    assert "elastic run finished after 2 generations (2x4 -> 1x4 devices)" in text, text[-3000:]
    assert "meshfit: error" not in text, text[-3000:]
    found = generations(run)
    assert [g[:2] for g in found] == [(2, 4), (1, 4)] and found[1][2] == "finished", found
    assert job_fields(slurm, job)["ExitCode"] == "0:0"
    final = checkpoint_format.latest(os.path.join(run, rundir.CHECKPOINTS))
    assert checkpoint_format.read_state(final)["global_step"] == 2 * 4
    with open(os.path.join(run, rundir.METRICS)) as f:
        assert len(json.load(f)["generations"]) == 2


# ------------------------------------------------------------------------------------ Open MPI

@pytest.mark.slow
def test_mpirun_joins_two_processes_that_train_as_one(data_dir, reference, tmp_path):
    """`mpirun -np 2 meshfit train ...`: JAX's Open MPI detection joins the 2 ranks."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or "Open MPI" not in subprocess.run([mpirun, "--version"], capture_output=True,
                                                          text=True).stdout:
        unavailable("no Open MPI mpirun (Debian: apt-get install openmpi-bin)")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    run = str(tmp_path / "run")
    code, text = run_following_progress(
        [mpirun, "-np", "2", *as_root, "--oversubscribe", "meshfit", "train", *TRAIN, "--data-dir", data_dir,
         "--out", run, *TWO_TASKS], tmp_path / "mpirun.out", env=ON_PATH, stall_seconds=STALL_SECONDS)
    assert code == 0, text[-3000:]
    assert re.search(r"^\s+hosts\s+2 \(this is process 0\)$", text, re.M), text[-3000:]
    assert_plain_epoch_lines(text)  # each rank's stdout is a pty: the bar must not draw there
    final = checkpoint_format.latest(os.path.join(run, rundir.CHECKPOINTS))
    assert checkpoint_format.read_state(final)["global_step"] == EPOCHS * 4
    assert_each_process_wrote_shards(final)
    assert_same_weights(model_weights(os.path.join(run, "model.keras")), model_weights(reference), ROUNDING)
