"""Multi-host fault drill: `meshfit launch --processes 2` jobs hit by the faults of real clusters.

    python tools/faults_multihost.py [--cases sigterm-one,sigkill-one,...] [--work DIR] [--fsdp]

Each case starts a 2-process x 2-device Fashion-MNIST job on small generated data, injects its
fault once the first checkpoint exists (epoch 1), and measures how long the job takes to end.
Where the job was cut short, it is resumed with `--resume` and its final weights are compared
bit for bit with an uninterrupted 2-process run. Cases:

  sigterm-one       SIGTERM to process 1 only (a preemption notice): both stop at one step, saved
  sigkill-one       SIGKILL of process 1: the launcher stops process 0 and names process 1
  sigstop-one       SIGSTOP of process 1 (alive but silent): ends once the launcher sees it stopped (2 s)
  never-starts      process 1 never joins: ends after the join timeout, naming process 1
  hang-one          process 1 hangs alive in Python at its 12th training dispatch (JAX's heartbeats
                    go on): the launcher's stall watchdog ends the job and names process 1
  two-ctrl-c        two SIGINTs to the launcher 0.5 s apart: every process is killed at once
  sigkill-launcher  SIGKILL of the launcher: its processes die with it (Linux PR_SET_PDEATHSIG)

Prints a table (case, outcome, seconds to end, failing process named?, resumed exactly?) and a
summary line; exits 1 when a case does not behave as described. Needs no network.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HEARTBEAT_SECONDS, INIT_SECONDS = 10, 15  # MESHFIT_HEARTBEAT_TIMEOUT, MESHFIT_INIT_TIMEOUT
STALL_SECONDS = 20  # MESHFIT_STALL_TIMEOUT
HANG_AT_DISPATCH = 12  # hang-one: in epoch 2, after the epoch-1 checkpoint
EPOCHS, TRAIN_IMAGES, BATCH = 3, 512, 64  # 8 steps per epoch
CASES = ("sigterm-one", "sigkill-one", "sigstop-one", "never-starts", "hang-one", "two-ctrl-c",
         "sigkill-launcher")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs meshfit with the faults of process 1: FAULT_NEVER_START (alive, but never runs meshfit) and
# FAULT_HANG_AT_DISPATCH=N (stuck in a Python loop at its Nth training dispatch, JAX's heartbeat
# thread still running).
WRAPPER = """
import os, sys, time
if os.environ['MESHFIT_PROCESS_ID'] == '1' and os.environ.get('FAULT_NEVER_START'):
    time.sleep(3600)
if os.environ['MESHFIT_PROCESS_ID'] == '1' and os.environ.get('FAULT_HANG_AT_DISPATCH'):
    from meshfit.fit import jax_loop
    dispatch, calls = jax_loop._TrainFunction.__call__, []
    def hang_at_dispatch(self, state, iterator):
        calls.append(1)
        if len(calls) == int(os.environ['FAULT_HANG_AT_DISPATCH']):
            print('FAULT: process 1 hangs at training dispatch', len(calls), file=sys.stderr, flush=True)
            while True:
                time.sleep(0.1)
        return dispatch(self, state, iterator)
    jax_loop._TrainFunction.__call__ = hang_at_dispatch
    from meshfit.cli import main
    sys.exit(main(sys.argv[1:]))
os.execv(sys.executable, [sys.executable, '-m', 'meshfit', *sys.argv[1:]])
"""


def write_data(folder: str) -> None:
    """A small Fashion-MNIST look-alike (class-dependent brightness) in the canonical IDX files."""
    from meshfit.data import datasets, file_formats

    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    arrays = []
    for n in (TRAIN_IMAGES, 64):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = np.clip(rng.normal(20 * labels[:, None, None], 40, (n, 28, 28)), 0, 255)
        arrays += [images.astype(np.uint8), labels]
    for name, array in zip(datasets.IDX_FILES, arrays):
        file_formats.write_idx(os.path.join(folder, name), array)


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    variables = dict(os.environ, KERAS_BACKEND="jax", MESHFIT_OFFLINE="1",
                     MESHFIT_HEARTBEAT_TIMEOUT=str(HEARTBEAT_SECONDS), MESHFIT_INIT_TIMEOUT=str(INIT_SECONDS),
                     MESHFIT_STALL_TIMEOUT=str(STALL_SECONDS),
                     PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    variables.pop("MESHFIT_SIMULATE_DEVICES", None)
    return {**variables, **(extra or {})}


def launch_command(*train_args: str) -> list[str]:
    return [sys.executable, "-m", "meshfit", "launch", "--processes", "2", "--devices-per-process", "2",
            "--timeout", "600", "--", sys.executable, "-c", WRAPPER, "train", *train_args]


SHARDING: list[str] = []  # --fsdp: ["--sharding", "fsdp", "--fsdp-min-bytes", "10KB"]


def train_args(data: str, run: str) -> list[str]:
    return ["fashion-mnist-cnn", "--global-batch", str(BATCH), "--seed", "0", "--epochs", str(EPOCHS),
            "--data-dir", data, "--out", run, "--checkpoint-every", "epoch", "--no-tensorboard",
            *SHARDING]


def weights(run: str) -> list[np.ndarray]:
    import keras

    return keras.saving.load_model(os.path.join(run, "model.keras"), compile=False).get_weights()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie or a vanished process is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_case(case: str, data: str, work: str, reference: list[np.ndarray] | None) -> dict:
    run = os.path.join(work, case)
    extra = {"never-starts": {"FAULT_NEVER_START": "1"},
             "hang-one": {"FAULT_HANG_AT_DISPATCH": str(HANG_AT_DISPATCH)}}.get(case, {})
    log = open(os.path.join(work, f"{case}.log"), "w+")
    job = subprocess.Popen(launch_command(*train_args(data, run)), env=environment(extra),
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    first = os.path.join(run, "checkpoints", f"ckpt-{TRAIN_IMAGES // BATCH:08d}")
    deadline = time.monotonic() + 300
    # committed (each process's shards written, then the manifest), not merely begun
    while case != "never-starts" and not os.path.isfile(os.path.join(first, "manifest.json")) \
            and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    while case == "hang-one" and "FAULT: process 1 hangs" not in open(log.name).read() \
            and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    while not (found := re.search(r"pids (\d+) (\d+)", open(log.name).read())) and job.poll() is None:
        time.sleep(0.1)
    pids = [int(p) for p in found.groups()]
    start = time.monotonic()
    if case == "sigterm-one":
        os.kill(pids[1], signal.SIGTERM)
    elif case == "sigkill-one":
        os.kill(pids[1], signal.SIGKILL)
    elif case == "sigstop-one":
        os.kill(pids[1], signal.SIGSTOP)
    elif case == "two-ctrl-c":
        job.send_signal(signal.SIGINT)
        time.sleep(0.5)
        job.send_signal(signal.SIGINT)
    elif case == "sigkill-launcher":
        job.kill()
    try:
        code = job.wait(timeout=600)
    except subprocess.TimeoutExpired:
        job.kill()
        code = job.wait()
    while any(alive(p) for p in pids) and time.monotonic() - start < 120:
        time.sleep(0.05)
    seconds = time.monotonic() - start
    orphans = [p for p in pids if alive(p)]
    for p in orphans:
        os.kill(p, signal.SIGKILL)
    log.seek(0)
    output = log.read()
    verdict = re.findall(r"^meshfit(?: launch)?: .*$", output, re.M)
    outcome = f"launcher exit {code}, " + ("processes left running" if orphans else "all processes ended")
    named = "-"
    if case in ("sigkill-one", "sigstop-one", "never-starts", "hang-one"):
        named = "yes" if re.search(r"process(?:\(es\))? 1\b.*(failed|stopped sending|stopped \(SIGSTOP\)|never joined|hung)",
                                   output) else "no"
    if case == "sigterm-one":
        steps = re.findall(r"^\[\d\] meshfit: training stopped by SIGTERM after step (\d+)", output, re.M)
        stopped = len(steps) == 2 and len(set(steps)) == 1 and code == 143
        outcome += f", both stopped after step {steps[0]}" if stopped else ", NOT an agreed stop"
    resumed = "-"
    if reference is not None and os.path.isdir(os.path.join(run, "checkpoints")):
        out = subprocess.run(launch_command("--resume", run), env=environment(), capture_output=True, text=True)
        resumed = "no (resume failed)" if out.returncode else (
            "yes" if all(np.array_equal(a, b) for a, b in zip(weights(run), reference)) else "no (weights differ)")
    ok = not orphans and (case != "sigterm-one" or "NOT" not in outcome) and resumed in ("yes", "-") \
        and named in ("yes", "-")
    return {"case": case, "outcome": outcome, "seconds": seconds, "named": named, "resumed": resumed,
            "ok": ok, "last": verdict[-1] if verdict else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--work", help="folder for data, runs and logs (default: a temporary one, removed)")
    parser.add_argument("--fsdp", action="store_true",
                        help="train with --sharding fsdp (kernels of 10 KB and more sharded over the "
                             "4 devices of the 2 processes, each process writing its own shards)")
    args = parser.parse_args()
    if args.fsdp:
        SHARDING[:] = ["--sharding", "fsdp", "--fsdp-min-bytes", "10KB"]
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}")
    work = args.work or tempfile.mkdtemp(prefix="meshfit-faults-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    sys.path.insert(0, ROOT)
    write_data(os.path.join(data, "fashion-mnist"))
    reference_run = os.path.join(work, "reference")
    shutil.rmtree(reference_run, ignore_errors=True)
    out = subprocess.run(launch_command(*train_args(data, reference_run)), env=environment(),
                         capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    reference = weights(reference_run)
    rows = []
    print(f"{'case':<17} {'outcome':<58} {'s to end':>8}  {'named?':<22} resumed exactly?", flush=True)
    for case in cases:
        row = run_case(case, data, work, reference)
        rows.append(row)
        print(f"{row['case']:<17} {row['outcome']:<58} {row['seconds']:8.1f}  {row['named']:<22} "
              f"{row['resumed']}", flush=True)
        print(f"{'':<17} {row['last'][:150]}", flush=True)
    good = sum(r["ok"] for r in rows)
    print(f"summary: {good}/{len(rows)} cases behaved as described; logs in {work}", flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
