"""Every time figure of a run agrees (issue 50): the epoch lines, history.json, metrics.json's
`train_seconds` and `compile_seconds`, and the goodput block, with each other and with a
stopwatch outside the process; on both engines (JAX on the 8 simulated devices, TensorFlow on one
CPU), for a fresh run and for one stopped and resumed in the middle of an epoch; and those of an
elastic run (`meshfit launch --elastic`) across a mesh change.

The tolerances hold on a loaded machine: every figure is read from one clock (the goodput ledger,
see meshfit.watch.keras_side.epoch_clock), so figures that count the same seconds are compared to
the precision they are printed or stored with, and the wall time measured outside only bounds
the parts from above (a process cannot spend more time than it lived). No measured time is
compared with another measured time of a different clock.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import N_TRAIN, ONE_CPU, SIGNAL_AT, cli_env, environment

pytestmark = pytest.mark.slow

BATCH = 16
STEPS = N_TRAIN // BATCH  # 8 steps per epoch
# The epoch line: its time, ms/step, and the figures it shows apart (see report.format_epoch_line).
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+  .*\|  (\d+\.\d\d) s  (\d+\.\d) ms/step .*?"
                        r"(?:  \(\+(\d+\.\d\d) s compile\))?(?:  \(\+(\d+\.\d\d) s input wait\))?"
                        r"(?:  \(resumed: (\d+) of its (\d+) steps in this sitting, (\d+\.\d\d) s\))?$",
                        re.M)
BLOCK = re.compile(r"^goodput [\d.]+%: training steps took (\d+\.\d) s of (\d+\.\d) s wall time", re.M)
ROUNDING = 2e-4  # the goodput block in metrics.json keeps 4 decimals per part


def _environment(tmp_path, engine: str) -> dict:
    changes = cli_env(tmp_path / "home", engine)
    return {**changes, **ONE_CPU} if engine == "tensorflow" else changes


def _timed(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command`; return it and its wall time measured here, outside the process."""
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment(env))
    return out, time.monotonic() - started


def _two_places(value: float | None) -> str | None:
    """How the epoch line prints a figure shown apart: two decimals, or not at all below 0.005."""
    return f"{value:.2f}" if value is not None and value >= 0.005 else None


def check_lines_match_history(stdout: str, history: list[dict]) -> list[tuple]:
    """Each epoch line printed is its history record, to print precision; returns the lines."""
    lines = EPOCH_LINE.findall(stdout)
    assert lines, stdout[-3000:]
    for epoch, seconds, ms, compiled, waited, sitting_steps, steps, sitting_seconds in lines:
        record = history[int(epoch) - 1]
        assert seconds == f"{record['train_seconds']:.2f}", (epoch, seconds, record)
        in_epoch = record["samples"] // BATCH
        assert ms == f"{1000 * record['train_seconds'] / in_epoch:.1f}", (epoch, ms, record)
        assert (compiled or None) == _two_places(record["compile_seconds"]), (epoch, compiled, record)
        assert (waited or None) == _two_places(record["input_wait_seconds"]), (epoch, waited, record)
        if sitting_steps:
            assert int(steps) == in_epoch == STEPS
            assert int(sitting_steps) == record["sitting"]["steps"] < STEPS
            assert sitting_seconds == f"{record['sitting']['train_seconds']:.2f}"
        else:
            assert "sitting" not in record
    return lines


def check_run_agrees(stdout: str, run: str, outside: float) -> dict:
    """history.json, metrics.json and the printed goodput block agree with each other and with
    the wall time measured outside; returns metrics.json."""
    history = json.load(open(os.path.join(run, "history.json")))
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    spent, seconds = metrics["goodput"], metrics["goodput"]["seconds"]
    check_lines_match_history(stdout, history)
    assert [r["samples"] for r in history] == [N_TRAIN] * len(history)
    assert metrics["train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in history), abs=1e-9)
    # One clock: the epochs' training seconds are the ledger's train part, over every session.
    assert metrics["train_seconds"] == pytest.approx(seconds["train"], abs=ROUNDING)
    # One compile figure: metrics.json's is the ledger's (every compilation of the run); the
    # epoch lines' compile is the part of it inside each epoch's training.
    assert metrics["compile_seconds"] == pytest.approx(seconds["compile"], abs=ROUNDING)
    assert sum(r["compile_seconds"] for r in history) <= seconds["compile"] + ROUNDING
    assert sum(r["input_wait_seconds"] for r in history) <= seconds["input_wait"] + ROUNDING
    # The parts add up to the wall time, which the stopwatch outside bounds (the process's own
    # start is read from /proc with 10 ms ticks, the stopwatch started before it).
    assert sum(seconds.values()) == pytest.approx(spent["wall_seconds"], rel=1e-3)
    inside = sum(r["train_seconds"] + r["compile_seconds"] + r["input_wait_seconds"]
                 + r["checkpoint_seconds"] for r in history if r.get("checkpoint_seconds") is not None)
    assert inside <= spent["wall_seconds"] + ROUNDING
    assert spent["wall_seconds"] <= outside + 0.05
    block = BLOCK.findall(stdout)
    assert block == [(f"{seconds['train']:.1f}", f"{spent['wall_seconds']:.1f}")], stdout[-2000:]
    return metrics


@pytest.mark.parametrize("engine", ["jax", "tensorflow"])
def test_a_fresh_runs_time_figures_agree(engine, data_dir, tmp_path):
    run = str(tmp_path / "run")
    out, outside = _timed([sys.executable, "-m", "meshfit", "train", "fashion-mnist-cnn",
                           "--data-dir", data_dir, "--epochs", "2", "--global-batch", str(BATCH),
                           "--out", run], _environment(tmp_path, engine))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = check_run_agrees(out.stdout, run, outside)
    assert metrics["engine"] == engine and metrics["goodput"]["sessions"] == 1
    first = EPOCH_LINE.findall(out.stdout)[0]
    if engine == "jax":  # JAX reports every compilation: the first epoch traces its train step
        assert first[3], out.stdout[-2000:]


@pytest.mark.parametrize("engine", ["jax", "tensorflow"])
def test_a_run_resumed_mid_epoch_has_time_figures_that_agree(engine, data_dir, tmp_path):
    """Stopped by SIGINT after step 6 of 8 and resumed: epoch 1's line and record count both
    sittings' steps and seconds, and the line says what this sitting trained (it showed this
    sitting's 2 steps' time alone, as if it were the epoch's, beside a record of all 8)."""
    run, env = str(tmp_path / "run"), _environment(tmp_path, engine)
    started = time.monotonic()
    stop = subprocess.run([sys.executable, "-c", SIGNAL_AT, data_dir, run, "0", "5", "SIGINT"],
                          capture_output=True, text=True, timeout=600, env=environment(env))
    assert "stopped by SIGINT after step 6" in stop.stderr, stop.stderr[-3000:]
    state = json.load(open(os.path.join(run, "checkpoints", "ckpt-00000006", "state.json")))
    carried = state["epoch_so_far"]
    assert carried["steps"] == 6
    out = subprocess.run([sys.executable, "-m", "meshfit", "train", "--resume", run],
                         capture_output=True, text=True, timeout=600, env=environment(env))
    outside = time.monotonic() - started
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = check_run_agrees(out.stdout, run, outside)
    assert metrics["engine"] == engine and metrics["goodput"]["sessions"] == 2
    assert metrics["goodput"]["lost_steps"] == 0  # saved at the stop: nothing to run again
    first = json.load(open(os.path.join(run, "history.json")))[0]
    assert first["sitting"]["steps"] == STEPS - 6
    assert first["train_seconds"] == pytest.approx(carried["train_seconds"]
                                                   + first["sitting"]["train_seconds"], abs=1e-9)
    lines = EPOCH_LINE.findall(out.stdout)
    assert [line[0] for line in lines] == ["1", "2"] and lines[0][5] == "2" and not lines[1][5]


# The per-host line of the goodput block on several hosts (goodput.format_block).
PER_HOST = re.compile(r"^  per host: (.*)$", re.M)
HOST_FIGURES = re.compile(r"(\d+): [\d.]+%, train (\d+\.\d\d) s, compile (\d+\.\d\d) s")


def test_an_elastic_runs_time_figures_agree_across_a_mesh_change(tmp_path):
    """`meshfit launch --elastic`, 2 processes x 2 devices, process 1 SIGKILLed once epoch 1's
    checkpoint is committed: the run goes on on 1 process (and grows back to 2 at a later
    checkpoint, where the launcher's stop reaches the run before it finishes). Every epoch line
    printed is its history record; metrics.json's train_seconds is the epochs' sum and host 0's
    goodput train, its compile_seconds host 0's compile (an elastic run once wrote 2.85 s here
    against the block's 38.95 s: the epochs' sum, then host 0's beside the slowest host's block,
    unnamed), the block's line names whose parts it shows and gives host 0's; every host's parts
    add up to its wall time, which the launch's wall measured here bounds, as it bounds the
    generations' seconds; the steps run again are one count (goodput's and the launcher's)."""
    from helpers import write_idx_dataset

    from meshfit import env
    from meshfit.run import rundir

    data = tmp_path / "data"
    write_idx_dataset(data / "fashion-mnist", n_train=256, n_test=64)  # 4 steps of 64 an epoch
    run, epochs = str(tmp_path / "run"), 6
    command = [sys.executable, "-m", "meshfit", "launch", "--processes", "2", "--devices-per-process",
               "2", "--elastic", "--on-loss", "shrink",  # a mesh change, not the slot restarted
               "--", "meshfit", "train", "fashion-mnist-cnn", "--global-batch", "64",
               "--seed", "0", "--epochs", str(epochs), "--data-dir", str(data), "--out", run,
               "--checkpoint-every", "epoch", "--local-copy-every", "0"]
    started = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=environment({**cli_env(tmp_path / "home"), env.STALL_TIMEOUT: "180"}))
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    try:
        first = os.path.join(run, "checkpoints", "ckpt-00000004")
        while not rundir.checkpoint_complete(first) and job.poll() is None \
                and time.monotonic() < started + 1200:
            time.sleep(0.01)
        pids = re.search(r"pids (\d+) (\d+)", "".join(output)).groups()
        os.kill(int(pids[1]), signal.SIGKILL)
        assert job.wait(timeout=1200) == 0, "".join(output)[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    outside = time.monotonic() - started
    reader.join(timeout=10)
    text = re.sub(r"^\[0\] ", "", "".join(output), flags=re.M)  # process 0's lines, as printed alone
    history = json.load(open(os.path.join(run, "history.json")))
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    generations, spent = metrics["generations"], metrics["goodput"]
    assert [(g["processes"], g["devices"]) for g in generations][:2] == [(2, 4), (1, 2)], generations
    assert generations[-1]["ended"] == "finished" and len(generations) in (2, 3)
    # the epoch lines: each epoch's last line printed is its record (an epoch cut by the loss
    # prints none; one run again prints again)
    lines = {int(line[0]): line for line in EPOCH_LINE.findall(text)}
    assert sorted(lines) == [r["epoch"] for r in history] == list(range(1, epochs + 1)), text[-4000:]
    for epoch, (_, seconds, _, compiled, *_) in lines.items():
        record = history[epoch - 1]
        assert seconds == f"{record['train_seconds']:.2f}" and record["samples"] == 256
        assert (compiled or None) == _two_places(record["compile_seconds"]), (epoch, compiled, record)
    # metrics.json's figures are host 0's ledger, which the epochs' windows are
    hosts = spent.get("hosts", [spent])
    assert len(hosts) == generations[-1]["processes"]
    mine = hosts[0]["seconds"]
    assert metrics["train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in history), abs=1e-9)
    assert metrics["train_seconds"] == pytest.approx(mine["train"], abs=ROUNDING)
    assert metrics["compile_seconds"] == pytest.approx(mine["compile"], abs=ROUNDING)
    assert sum(r["compile_seconds"] for r in history) <= mine["compile"] + ROUNDING
    assert hosts[0]["sessions"] == len(generations) and mine["lost"] > 0
    assert all(2 <= h["sessions"] <= len(generations) for h in hosts)  # each host's own
    # the block: whose parts (the slowest host's), and host 0's train and compile beside them
    block = BLOCK.findall(text)
    assert block == [(f"{spent['seconds']['train']:.1f}", f"{spent['wall_seconds']:.1f}")], text[-3000:]
    assert f", {spent['sessions']} sessions" in text  # the sessions of the host whose parts it shows
    if "hosts" in spent:
        assert spent == {**spent["hosts"][spent["host"]], "host": spent["host"], "hosts": spent["hosts"]}
        assert f"; host {spent['host']}, the slowest of {len(hosts)}" in text
        shown = HOST_FIGURES.findall(PER_HOST.search(text).group(1))
        assert shown == [(str(i), f"{h['seconds']['train']:.2f}", f"{h['seconds']['compile']:.2f}")
                         for i, h in enumerate(hosts)], text[-2000:]
    # every host's parts add up to its wall time, which the stopwatch here bounds
    for host in hosts:
        assert sum(host["seconds"].values()) == pytest.approx(host["wall_seconds"], rel=1e-3)
        assert host["wall_seconds"] <= outside + 0.05
        assert host["seconds"]["train"] <= host["wall_seconds"]
    assert sum(g["seconds"] for g in generations) <= outside + 0.05 * len(generations)
    for g in generations:
        assert g["start_seconds"] is None or g["start_seconds"] <= g["seconds"]
    # the steps run again: one count, goodput's (every host's row has it, the run's), the
    # generations' records and the launcher's closing line its sum
    again = sum(g.get("lost_steps", 0) for g in generations)
    assert again == spent["lost_steps"] and [h["lost_steps"] for h in hosts] == [again] * len(hosts)
    assert f"{again} step{'' if again == 1 else 's'} run again" in text, text[-2000:]
