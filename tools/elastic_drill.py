"""Kill one process of an elastic job after its first checkpoint and report how the job ended.

    python tools/elastic_drill.py --data-dir ../shared/data [--kill 1] [--signal KILL] [--] [TRAIN ARGS]

runs `meshfit launch --processes 2 --devices-per-process 4 --elastic -- meshfit train
fashion-mnist-cnn --data-dir DIR --out RUN [TRAIN ARGS]`, sends SIGNAL to process KILL once the
run's first checkpoint is committed, waits for the launch to end, and prints its exit code, the
wall seconds, the test accuracy and the generations metrics.json records (BENCHMARKS.md section 6).
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
    parser.add_argument("--kill", type=int, default=1, help="the process to kill (default: 1)")
    parser.add_argument("--signal", default="KILL", help="KILL or STOP (default: KILL)")
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
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    checkpoints = os.path.join(run, "checkpoints")
    while job.poll() is None:
        done = [n for n in os.listdir(checkpoints)] if os.path.isdir(checkpoints) else []
        if any(os.path.isfile(os.path.join(checkpoints, n, "manifest.json")) for n in done):
            break
        time.sleep(0.1)
    pids = re.search(r"pids ([\d ]+)", "".join(output))
    if job.poll() is None and pids:
        pid = int(pids.group(1).split()[args.kill])
        first = sorted(done)[0]
        os.kill(pid, getattr(signal, "SIG" + args.signal))
        print(f"DRILL: SIG{args.signal} to process {args.kill} (pid {pid}) after {first}, "
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
    print(f"DRILL: run directory {run}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
