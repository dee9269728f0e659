"""The main job (`make train`: `meshfit train fashion-mnist-cnn`), timed from outside the process.

Runs the job --runs times, each in a fresh process in a scratch directory, and times it from the
command to the exit (what a user waits for at the prompt). Each run's metrics.json gives
meshfit's own ledger (meshfit.watch.goodput: startup, setup, compile, train, input wait, eval,
checkpoint, other); `exit` is the outside wall minus the ledger's wall (interpreter exit and what
runs after the ledger closes). Prints one markdown table: each part's median, accuracy, MFU,
goodput, and the wall, median of the runs.

Optional, in the same invocation so ratios come from one sitting:
  --keras      meshfit vs plain Keras/TF train step (`meshfit bench --engines tensorflow
               --rounds R`) on tutorial 1 (Fashion-MNIST CNN) and tutorial 2 (CIFAR-10, batch 256)
  --devices    the same CNN step on 1 CPU device vs 8 simulated (`meshfit bench --scaling 1,8`,
               JAX, one global batch)
  --bfloat16   also run the main job with --precision bfloat16 (runs alternate with float32)

Usage: python benchmarks/main_job.py [--runs 3] [--data-dir ../shared/data] [--keras]
       [--devices] [--bfloat16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("startup", "setup", "compile", "train", "input_wait", "eval", "checkpoint", "lost", "other")


def meshfit_command(*args: str) -> list[str]:
    """This checkout's meshfit, run by this interpreter (`python -m meshfit`)."""
    return [sys.executable, "-m", "meshfit", *args]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_main_job(data_dir: str, extra: list[str]) -> dict:
    """One `meshfit train fashion-mnist-cnn` in a scratch directory: its metrics.json plus the
    wall seconds measured here, from the process' start to its exit."""
    with tempfile.TemporaryDirectory(prefix="main-job-") as scratch:
        command = meshfit_command("train", "fashion-mnist-cnn", "--data-dir", data_dir, "--json", *extra)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=scratch, env=environment(), capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        metrics = json.loads(done.stdout.strip().splitlines()[-1])
    ledger = metrics["goodput"]
    seconds = {p: ledger["seconds"].get(p, 0.0) for p in PARTS}
    seconds["exit"] = wall - ledger["wall_seconds"]
    return {"wall": wall, "seconds": seconds, "goodput": ledger["fraction"],
            "accuracy": metrics["test_accuracy"], "mfu": metrics.get("mfu"),
            "train_seconds": metrics["train_seconds"]}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main_job_table(results: dict[str, list[dict]]) -> str:
    """One column per variant (float32, bfloat16): the median of its runs for each row."""
    names = list(results)
    lines = ["| part (median of runs, s) | " + " | ".join(names) + " |",
             "| --- |" + " --- |" * len(names)]
    for part in (*PARTS, "exit"):
        cells = [f"{median([r['seconds'][part] for r in results[n]]):.2f}" for n in names]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    rows = [
        ("**wall, command to prompt**", lambda rs: f"**{median([r['wall'] for r in rs]):.2f}**"),
        ("walls of the runs", lambda rs: ", ".join(f"{r['wall']:.2f}" for r in rs)),
        ("training time (epochs)", lambda rs: f"{median([r['train_seconds'] for r in rs]):.2f}"),
        ("test accuracy", lambda rs: ", ".join(f"{r['accuracy']:.2%}" for r in rs)),
        ("goodput", lambda rs: f"{median([r['goodput'] for r in rs]):.3f}"),
        ("MFU", lambda rs: f"{median([r['mfu'] for r in rs]):.3f}" if median([r['mfu'] for r in rs]) else "n/a"),
    ]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(results[n]) for n in names) + " |")
    return "\n".join(lines)


def bench_json(args: list[str]) -> dict:
    """`meshfit bench ... --json` in a scratch directory: its result."""
    with tempfile.TemporaryDirectory(prefix="main-job-bench-") as scratch:
        command = meshfit_command("bench", *args, "--json", "--out", os.path.join(scratch, "out"))
        done = subprocess.run(command, cwd=scratch, env=environment(), capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def keras_ratio_rows(rounds: int) -> list[str]:
    """meshfit vs plain Keras on TF, train step, tutorial 1 and tutorial 2 (batch 256)."""
    lines = []
    for label, args in (("tutorial 1, Fashion-MNIST CNN, batch 1000", ["fashion-mnist-cnn"]),
                        ("tutorial 2, CIFAR-10 CNN, batch 256", ["cifar10-cnn", "--global-batches", "256"])):
        result = bench_json([*args, "--engines", "tensorflow", "--rounds", str(rounds)])
        speed = {r["path"]: r["samples_per_s"] for r in result["rows"]}
        ratio = speed["meshfit"] / speed["plain"]
        lines.append(f"| meshfit vs plain Keras/TF, {label} | {speed['meshfit']:,.0f} vs "
                     f"{speed['plain']:,.0f} samples/s (median of {rounds} rounds) | **{ratio:.2f}x** |")
    return lines


def devices_row(global_batch: int) -> str:
    """The same CNN step on 1 CPU device vs 8 simulated devices (JAX, one global batch)."""
    result = bench_json(["fashion-mnist-cnn", "--scaling", "1,8", "--global-batches", str(global_batch)])
    speed = {r["devices"]: r["samples_per_s"] for r in result["rows"]}
    return (f"| 8 simulated CPU devices vs 1, Fashion-MNIST CNN step, JAX, global batch {global_batch} "
            f"| {speed[8]:,.0f} vs {speed[1]:,.0f} samples/s | **{speed[1] / speed[8]:.2f}x** the time |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the main job (default 3)")
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data"),
                        help="dataset folder (default ../shared/data beside the checkout)")
    parser.add_argument("--keras", action="store_true", help="also the ratio to plain Keras/TF")
    parser.add_argument("--rounds", type=int, default=3, help="bench rounds for --keras (default 3)")
    parser.add_argument("--devices", action="store_true", help="also 1 vs 8 simulated devices")
    parser.add_argument("--devices-batch", type=int, default=1000, help="global batch for --devices")
    parser.add_argument("--bfloat16", action="store_true", help="also the main job in bfloat16")
    parser.add_argument("--json", metavar="FILE", help="also write each run's figures to FILE "
                        "(benchmarks/gpu_table.py reads it)")
    args = parser.parse_args()

    variants = {"float32": []}
    if args.bfloat16:
        variants["bfloat16"] = ["--precision", "bfloat16"]
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for i in range(args.runs):  # variants alternate, so a change in the machine hits both
        for name, extra in variants.items():
            result = run_main_job(args.data_dir, extra)
            results[name].append(result)
            print(f"run {i + 1}/{args.runs} {name}: {result['wall']:.2f} s wall, accuracy "
                  f"{result['accuracy']:.2%}, goodput {result['goodput']:.3f}", file=sys.stderr)
    print(f"`meshfit train fashion-mnist-cnn --data-dir DATA`, {args.runs} runs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at the end: "
          f"{os.getloadavg()[0]:.1f}\n")
    if args.runs:
        print(main_job_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "meshfit train fashion-mnist-cnn --data-dir DATA --json",
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": results}, f)
    extra_rows = []
    if args.keras:
        extra_rows += keras_ratio_rows(args.rounds)
    if args.devices:
        extra_rows.append(devices_row(args.devices_batch))
    if extra_rows:
        print("\n| comparison | figures | ratio |\n| --- | --- | --- |")
        print("\n".join(extra_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
