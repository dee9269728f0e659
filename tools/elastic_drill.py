"""Kill one process of an elastic job after (or during) a checkpoint and report how the job ended.

    python tools/elastic_drill.py --data-dir ../shared/data [--kill 1] [--signal KILL]
        [--when after-checkpoint|during-checkpoint] [--] [TRAIN ARGS]

runs `meshfit launch --processes 2 --devices-per-process 4 --elastic -- meshfit train
fashion-mnist-cnn --data-dir DIR --out RUN [TRAIN ARGS]`, sends SIGNAL to process KILL once the
run's first checkpoint is committed (during-checkpoint: as soon as the folder of the save after
that one appears, before its manifest commits it), waits for the launch to end, and prints its
exit code, the wall seconds, the test accuracy, the generations metrics.json records and the
checkpoints each generation resumed from (BENCHMARKS.md section 6).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--kill", default="1",
                        help="the process(es) to kill, e.g. 1 or 1,3 (default: 1)")
    parser.add_argument("--signal", default="KILL", help="KILL or STOP (default: KILL)")
    parser.add_argument("--when", choices=("after-checkpoint", "during-checkpoint"),
                        default="after-checkpoint")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("train", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    run = os.path.join(tempfile.mkdtemp(prefix="elastic-drill-"), "run")
    extra = [a for a in args.train if a != "--"]
    command = [sys.executable, "-m", "meshfit", "launch", "--processes", str(args.processes),
               "--devices-per-process", str(args.devices_per_process), "--show", "first",
               "--elastic", "--", "meshfit", "train", "fashion-mnist-cnn", "--data-dir",
               args.data_dir, "--out", run, *extra]
    print("$", " ".join(command), flush=True)
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    committed: list[str] = []
    while job.poll() is None and not committed:
        committed = _folders(checkpoints, manifest=True)
        time.sleep(0.1)
    writing: list[str] = []
    while args.when == "during-checkpoint" and job.poll() is None and not writing:
        writing = [n for n in _folders(checkpoints, manifest=False) if n > committed[-1]]
        time.sleep(0.005)  # a save of this model's files takes a fraction of a second
    pids = re.search(r"pids ([\d ]+)", "".join(output))
    if job.poll() is None and pids:
        victims = [int(i) for i in args.kill.split(",")]
        chosen = [int(pids.group(1).split()[i]) for i in victims]
        for pid in chosen:
            os.kill(pid, getattr(signal, "SIG" + args.signal))
        when = f"while {writing[0]} was written" if writing else f"after {committed[0]}"
        print(f"DRILL: SIG{args.signal} to process(es) {args.kill} (pids {chosen}) {when}, "
              f"{time.monotonic() - began:.1f} s into the launch", flush=True)
    code = job.wait()
    reader.join(timeout=10)
    wall = time.monotonic() - began
    try:
        with open(os.path.join(run, "metrics.json")) as f:
            metrics = json.load(f)
    except OSError:
        metrics = {}
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


def _folders(checkpoints: str, manifest: bool) -> list[str]:
    """The checkpoint folders with (or without) a manifest, oldest first."""
    names = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
    return [n for n in names if n.startswith("ckpt-") and
            os.path.isfile(os.path.join(checkpoints, n, "manifest.json")) == manifest]


if __name__ == "__main__":
    sys.exit(main())
