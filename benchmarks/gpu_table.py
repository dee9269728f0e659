"""Issue 52's targets against what a GPU lease measured: one markdown table.

Reads what `benchmarks/gpu_rows.sh` left in each call's $OUT folder (fetched here after the lease):
  cifar10-fast-metrics.jsonl  (stage `data`) cifar10-fast runs: mean test accuracy over the
                              seeds and median training time, per number of epochs;
  bench-resnet50*.json        (stages `profile`, `nodata`) meshfit against plain Keras at the same
                              batch, precision and steps per dispatch (the run of more rounds
                              where two measured it), and meshfit's best img/s;
  mainjob.json                (stage `mainjob`) the main job's wall, command to prompt.
A target whose files are absent reads "not measured".

Usage: python benchmarks/gpu_table.py FOLDER [FOLDER...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

FAST_ACCURACY, FAST_SECONDS = 0.940, 2.0   # cifar10-fast: mean of 5 seeds, training seconds
RESNET_RATIO, RESNET_IMAGES = 1.15, 6000   # ResNet-50: x plain Keras, img/s
MAIN_JOB_SECONDS = 4.0                     # the main job's wall, command to prompt


def _files(folders: list[str], pattern: str) -> list[str]:
    return sorted(f for folder in folders for f in glob.glob(os.path.join(folder, pattern)))


def _objects(text: str) -> list[dict]:
    """The JSON objects written one after another in text (a line each, or indented)."""
    decoder, objects, text, at = json.JSONDecoder(), [], text.strip(), 0
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        objects.append(value)
        at = len(text) - len(text[at:].lstrip())  # past the whitespace between two objects
    return objects


def fast_rows(folders: list[str]) -> list[tuple[str, str, str]]:
    runs = [run for path in _files(folders, "cifar10-fast-metrics.jsonl") for run in _objects(open(path).read())]
    if not runs:
        return [("cifar10-fast: >= 94.0% mean of 5 seeds in <= 2.0 s", "not measured", "-")]
    rows = []
    for epochs in sorted({r["epochs"] for r in runs}, reverse=True):
        group = [r for r in runs if r["epochs"] == epochs]
        accuracy = statistics.mean(r["test_accuracy"] for r in group)
        seconds = statistics.median(r["train_seconds"] for r in group)
        met = accuracy >= FAST_ACCURACY and seconds <= FAST_SECONDS and len(group) >= 5
        rows.append((f"cifar10-fast, {epochs} epochs: >= 94.0% mean of 5 seeds in <= 2.0 s",
                     f"{100 * accuracy:.2f}% mean of {len(group)} seeds; {seconds:.2f} s median "
                     f"training ({group[0].get('device_kind', '?')})", "met" if met else "not met"))
    return rows


def resnet_rows(folders: list[str]) -> list[tuple[str, str, str]]:
    rows_seen = [row for path in _files(folders, "bench-resnet50*.json")
                 for row in json.load(open(path)).get("rows", [])]
    pairs = {}
    for row in rows_seen:  # of two rows of one path, the one of more rounds (alternating paths)
        key = (row["global_batch"], row["precision"], row["steps_per_dispatch"])
        kept = pairs.setdefault(key, {}).get(row["path"])
        if kept is None or row.get("rounds", 1) > kept.get("rounds", 1):
            pairs[key][row["path"]] = row
    measured = [(key, p["meshfit"], p["plain"]) for key, p in sorted(pairs.items())
                if "meshfit" in p and "plain" in p]
    if not measured:
        return [("ResNet-50: >= 1.15x plain Keras; >= 6,000 img/s", "not measured", "-")]
    rows = []
    for (batch, precision, steps), mine, plain in measured:
        ratio = mine["samples_per_s"] / plain["samples_per_s"]
        rows.append((f"ResNet-50, batch {batch}, {precision}, {steps} step(s) per dispatch: "
                     f">= 1.15x plain Keras", f"{mine['samples_per_s']:,.0f} vs {plain['samples_per_s']:,.0f} "
                     f"img/s: {ratio:.2f}x ({mine.get('device_kind', '?')})",
                     "met" if ratio >= RESNET_RATIO else "not met"))
    best = max(mine["samples_per_s"] for _, mine, _ in measured)
    rows.append(("ResNet-50: >= 6,000 img/s", f"{best:,.0f} img/s (meshfit's best row)",
                 "met" if best >= RESNET_IMAGES else "not met"))
    return rows


def main_job_rows(folders: list[str]) -> list[tuple[str, str, str]]:
    walls = [run["wall"] for path in _files(folders, "mainjob.json")
             for runs in json.load(open(path))["runs"].values() for run in runs]
    if not walls:
        return [("the main job: <= 4 s wall", "not measured", "-")]
    wall = statistics.median(walls)
    return [("the main job: <= 4 s wall", f"{wall:.2f} s median of {len(walls)} runs "
             f"({', '.join(f'{w:.2f}' for w in walls)})", "met" if wall <= MAIN_JOB_SECONDS else "not met")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    print("| target | measured | |\n| --- | --- | --- |")
    for target, measured, verdict in (fast_rows(args.folders) + resnet_rows(args.folders)
                                      + main_job_rows(args.folders)):
        print(f"| {target} | {measured} | {verdict} |")


if __name__ == "__main__":
    main()
