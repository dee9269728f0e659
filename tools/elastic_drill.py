"""Kill processes of an elastic job at a chosen moment and report how the job ended.

    python tools/elastic_drill.py --data-dir ../shared/data [--kill 1[,2...]] [--signal KILL]
        [--when after-checkpoint|during-checkpoint|during-eval|during-growth|random-step]
        [--seed S] [--processes 2] [--devices-per-process 4] [--] [TRAIN ARGS]

runs `meshfit launch --processes 2 --devices-per-process 4 --elastic -- meshfit train
fashion-mnist-cnn --data-dir DIR --out RUN [TRAIN ARGS]` and sends SIGNAL to the processes KILL:
- after-checkpoint: once the run's first checkpoint is committed;
- during-checkpoint: as soon as the folder of the save after that one appears, before its
  manifest commits it;
- during-eval: (after the first checkpoint) while the first of them evaluates at an epoch end,
  as its progress file shows (meshfit.parallel.heartbeat);
- during-growth: after the first checkpoint, and again (the first of KILL) as soon as it joins the
  third generation, the one that grows the mesh back (a loss during the mesh change; the launch
  gets --on-loss shrink, so that the loss shrinks the mesh and a growth follows);
- random-step: as the first of them starts a training step drawn at random (from --seed, printed)
  between the first and the last of the run (config.json's epochs x steps per epoch), wherever
  that falls: before the first checkpoint, between two, while one is written or evaluated.
It waits for the launch to end, and prints its exit code, the wall seconds, the test accuracy,
the generations metrics.json records and the checkpoints each generation resumed from
(BENCHMARKS.md section 6).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from meshfit.parallel import heartbeat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--kill", default="1",
                        help="the process(es) to kill, e.g. 1 or 1,3 (default: 1)")
    parser.add_argument("--signal", default="KILL", help="KILL or STOP (default: KILL)")
    parser.add_argument("--when", choices=("after-checkpoint", "during-checkpoint", "during-eval",
                                           "during-growth", "random-step"),
                        default="after-checkpoint")
    parser.add_argument("--seed", type=int, default=None,
                        help="random-step: the seed of the step drawn (default: from the clock)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("train", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run = os.path.join(tempfile.mkdtemp(prefix="elastic-drill-"), "run")
    extra = [a for a in args.train if a != "--"]
    command = [sys.executable, "-m", "meshfit", "launch", "--processes", str(args.processes),
               "--devices-per-process", str(args.devices_per_process), "--show", "first",
               "--elastic", *(["--on-loss", "shrink"] if args.when == "during-growth" else []),
               "--", "meshfit", "train", "fashion-mnist-cnn", "--data-dir",
               args.data_dir, "--out", run, *extra]
    print("$", " ".join(command), flush=True)
    began = time.monotonic()
    # the launcher makes each generation's status folder (MESHFIT_LAUNCH_STATUS) in TMPDIR: the
    # drill's own, so that it reads its job's progress files (meshfit.parallel.heartbeat)
    status = tempfile.mkdtemp(prefix="elastic-drill-tmp-")
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "TMPDIR": status})
    output: list[str] = []

    def read() -> None:
        for line in job.stdout:
            output.append(line)
            if line.startswith("meshfit"):  # the launcher's and train's own lines: when they came
                line = f"[{time.monotonic() - began:6.1f} s] {line}"
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    checkpoints = os.path.join(run, "checkpoints")
    victims = [int(i) for i in args.kill.split(",")]
    if args.when == "random-step":
        _kill(job, output, victims, args.signal, _random_step(job, status, run, victims[0], args.seed),
              began)
        return _report(job, reader, run, checkpoints, began)
    committed: list[str] = []
    while job.poll() is None and not committed:
        committed = _folders(checkpoints, manifest=True)
        time.sleep(0.1)
    writing: list[str] = []
    while args.when == "during-checkpoint" and job.poll() is None and not writing:
        writing = [n for n in _folders(checkpoints, manifest=False) if n > committed[-1]]
        time.sleep(0.005)  # a save of this model's files takes a fraction of a second
    when = f"while {writing[0]} was written" if writing else f"after {committed[0]}"
    if args.when == "during-eval":
        when = _eval_started(job, status, victims[0], checkpoints, committed)
    if args.when == "during-growth":  # first a loss, then the next generation of all processes
        _kill(job, output, victims, args.signal, when, began)
        while job.poll() is None and len(re.findall(r"pids ([\d ]+)", "".join(output))) < 3:
            time.sleep(0.05)
        while job.poll() is None and not any(
                os.path.isfile(os.path.join(folder, f"joining-{victims[0]}")) for folder in status_folders(status)):
            time.sleep(0.005)
        when = "while generation 3 joined (its joining marker written)"
    _kill(job, output, victims, args.signal, when, began)
    return _report(job, reader, run, checkpoints, began)


def _report(job, reader: threading.Thread, run: str, checkpoints: str, began: float) -> int:
    """Wait for the launch to end and print what it did; its exit code."""
    code = job.wait()
    reader.join(timeout=10)
    wall = time.monotonic() - began
    metrics = run_metrics(run)
    goodput = metrics.get("goodput", {})
    print(f"DRILL: exit {code}, wall {wall:.1f} s, test accuracy {metrics.get('test_accuracy')}, "
          f"goodput {goodput.get('fraction')}, lost {goodput.get('seconds', {}).get('lost')} s "
          f"and {goodput.get('lost_steps')} steps, sessions {goodput.get('sessions')}", flush=True)
    print("DRILL: generations " + json.dumps(metrics.get("generations")), flush=True)
    try:
        with open(os.path.join(run, "config.json")) as f:
            resumed = [r.get("checkpoint") for r in json.load(f).get("resumed", [])]
    except OSError:
        resumed = []
    print(f"DRILL: generations resumed from {resumed}; committed now "
          f"{_folders(checkpoints, manifest=True)}, uncommitted {_folders(checkpoints, manifest=False)}",
          flush=True)
    print(f"DRILL: run directory {run}", flush=True)
    return code


def run_metrics(run: str) -> dict:
    """The run's metrics.json ({} when it wrote none)."""
    try:
        with open(os.path.join(run, "metrics.json")) as f:
            return json.load(f)
    except OSError:
        return {}


def _kill(job, output: list[str], victims: list[int], signame: str, when: str, began: float) -> None:
    """Send SIG<signame> to the processes `victims` of the newest generation (its pids line)."""
    pids = re.findall(r"pids ([\d ]+)", "".join(output))
    if job.poll() is not None or not pids:
        return
    chosen = [int(pids[-1].split()[i]) for i in victims]
    for pid in chosen:
        os.kill(pid, getattr(signal, "SIG" + signame))
    print(f"DRILL: SIG{signame} to process(es) {','.join(map(str, victims))} (pids {chosen}) "
          f"{when}, {time.monotonic() - began:.1f} s into the launch", flush=True)


def _random_step(job, tmp: str, run: str, victim: int, seed: int | None) -> str:
    """Wait until process `victim` of the first generation starts a global step drawn at random
    from 1 .. the run's last (config.json, written before training starts); the phrase saying so."""
    seed = int(time.time()) if seed is None else seed
    config = os.path.join(run, "config.json")
    while job.poll() is None and not os.path.isfile(config):
        time.sleep(0.05)
    try:
        with open(config) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return "never (the job ended first)"
    step = random.Random(seed).randint(1, settings["epochs"] * settings["steps_per_epoch"] - 1)
    print(f"DRILL: --seed {seed}: the kill comes as process {victim} starts step {step}", flush=True)
    while job.poll() is None:  # one generation's status folder at a time: the first's until it ends
        if any(heartbeat.progress(folder).get(victim, (0,))[0] >= step for folder in status_folders(tmp)):
            return f"as it started step {step} (drawn with --seed {seed})"
        time.sleep(0.005)
    return "never (the job ended first)"


def status_folders(tmp: str) -> list[str]:
    """The status folders of the job's generations (one at a time: the launcher removes each)."""
    names = os.listdir(tmp) if os.path.isdir(tmp) else []
    return [os.path.join(tmp, n) for n in names if n.startswith("meshfit-launch-")]


def _eval_started(job, tmp: str, victim: int, checkpoints: str, committed: list[str]) -> str:
    """Wait until process `victim` evaluates at an epoch end: its progress file (rewritten at most
    once a second) shows it at a multiple of the epoch's steps, in a device computation, with at
    least 2 more progress reports than when first seen there (each multi-host predict batch of
    the evaluation reports once, meshfit.fit.hosts; training reports 3 times a dispatch, the
    epoch end's stop vote once); return the phrase saying so."""
    with open(os.path.join(checkpoints, committed[0], "state.json")) as f:
        per_epoch = json.load(f)["steps_per_epoch"]
    first_seen: dict[int, int] = {}  # steps: beats when first seen at that many steps
    while job.poll() is None:
        for folder in status_folders(tmp):
            if victim not in (found := heartbeat.progress(folder)):
                continue
            steps, beats, _, doing = found[victim]
            if steps and steps % per_epoch == 0:
                seen = first_seen.setdefault(steps, beats)
                if beats >= seen + 2 and doing == "device":
                    return (f"during the evaluation after step {steps} (its progress: {beats} "
                            f"reports, {beats - seen} since first seen at step {steps}, {doing})")
        time.sleep(0.05)
    return "never (the job ended first)"


def _folders(checkpoints: str, manifest: bool) -> list[str]:
    """The checkpoint folders with (or without) a manifest, oldest first."""
    names = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
    return [n for n in names if n.startswith("ckpt-") and
            os.path.isfile(os.path.join(checkpoints, n, "manifest.json")) == manifest]


if __name__ == "__main__":
    sys.exit(main())
