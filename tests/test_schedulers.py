"""`meshfit train`, unchanged, started by real schedulers: a one-node SLURM cluster and Open MPI.

tools/slurm/up.sh starts the cluster (munge, slurmctld, slurmd: needs root and Debian's slurm-wlm
and munge) for this module and tools/slurm/down.sh stops it. Each job is 2 tasks x 4 simulated
devices with fsdp, joined by JAX's own SLURM or Open MPI detection, and must end with the weights
of 1 process x 8 devices and a checkpoint holding both processes' shards. Where the cluster or
mpirun cannot start the tests are skipped with the reason; with MESHFIT_TESTS_REQUIRE_SCHEDULERS=1
(as .ci/run sets where it installs them) they fail instead.
"""

import os
import re
import shutil
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
