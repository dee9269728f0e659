"""The benchmarks' results shown and written: the plain-text tables, bench.csv, bench.json and
bench.png (see meshfit.commands.bench.step and .inputs for what the figures mean)."""

from __future__ import annotations

import csv
import json
import os
from typing import Any

COLUMNS = ("recipe", "engine", "path", "precision", "global_batch", "steps_per_dispatch", "micro_batches",
           "sharding", "replicas", "ms_per_step", "samples_per_s", "mfu", "compile_s", "vs_plain", "vs_fastest",
           "vs_meshfit",
           "flops_per_step", "auto_engine", "platform", "device_kind", "repeats", "steps_per_repeat",
           "rounds")  # bench.csv's, in order

_TABLE = (("engine", "engine"), ("path", "path"), ("precision", "precision"), ("global_batch", "batch"),
          ("steps_per_dispatch", "steps/dispatch"), ("micro_batches", "micro-batches"),
          ("sharding", "sharding"), ("ms_per_step", "ms/step"),
          ("samples_per_s", "samples/s"), ("mfu", "MFU"), ("compile_s", "compile s"),
          ("vs_plain", "vs plain"), ("vs_fastest", "vs fastest"), ("vs_meshfit", "vs meshfit"))


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if column == "mfu":
        return f"{value * 100:.1f}%" if value else "n/a"
    if value is None:
        return "-"
    if column in ("vs_plain", "vs_fastest", "vs_meshfit"):
        return f"{value:.3f}x" if column == "vs_meshfit" else f"{value:.2f}x"
    if column == "samples_per_s":
        return f"{value:,.0f}"
    if column in ("ms_per_step", "compile_s"):
        return f"{value:.1f}"
    if column == "engine" and row.get("auto_engine") == value:
        return f"{value}*"
    return str(value)


def format_table(result: dict) -> str:
    """The train-step results as a plain-text table with a title and the baseline stated under it."""
    header = [title for _, title in _TABLE]
    body = [[_cell(r, c) for c, _ in _TABLE] for r in result["rows"]]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = [_title(result), "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in body]
    return "\n".join(lines + _notes(result))


def _title(result: dict) -> str:
    m = result.get("machine") or {}
    return (f"meshfit bench {result['recipe']} on {m.get('device_kind', '?')} "
            f"({m.get('platform', '?')}, {m.get('devices', '?')} device(s)), {result['date']}")


def _notes(result: dict) -> list[str]:
    auto = (result.get("machine") or {}).get("auto_engine")
    notes = [f"* meshfit's engine for these devices ({auto})" if auto else "",
             result["baseline"] + "; vs_plain = samples/s / plain Keras on the same engine, "
             "precision, batch and steps per dispatch"]
    rounds = max((r.get("rounds") or 1 for r in result["rows"]), default=1)
    if rounds > 1:
        notes.append(f"each row: the median of {rounds} rounds, paths alternating")
    return [n for n in notes if n] + [f"skipped {s}" for s in result.get("skipped", [])]


def write_files(result: dict, out: str) -> None:
    """bench.csv (one row per measurement), bench.json (everything) and bench.png (bar chart)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    write_json(result, out)
    plot(result, os.path.join(out, "bench.png"))


def write_json(result: dict, out: str) -> None:
    """out/bench.json: the whole result."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)


def plot(result: dict, path: str) -> None:
    """Horizontal bars of samples/s, one per row, labelled with the `vs fastest` ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['engine']} {r['path']} {r['precision']} b{r['global_batch']} x{r['steps_per_dispatch']}"
              for r in rows]
    values = [r["samples_per_s"] for r in rows]
    colors = ["#9e9e9e" if r["path"] == "plain" else "#1f77b4" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.4 * len(rows)))
    bars = ax.barh(range(len(rows)), values, color=colors)
    for bar, r in zip(bars, rows):
        ratio = f" {r['vs_fastest']:.2f}x" if r.get("vs_fastest") else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, ratio, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("training samples/s (grey: plain Keras, blue: meshfit; label: vs fastest plain)")
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_input_table(result: dict) -> str:
    """The input benchmark as a plain-text table with the ratio under it."""
    m = result.get("machine") or {}
    height, width = result["image_size"]
    lines = [f"meshfit bench --input {result['input']}: {result['images']:,} images to "
             f"{height}x{width}x{result['channels']}, batch {result['global_batch']}, {result['steps']} timed "
             f"batches, on {m.get('cpu', '?')} ({m.get('cores', '?')} cores), {result['date']}",
             f"{'path':<8}  {'images/s':>9}  {'CPU-us/image':>12}  {'peak RSS MB':>11}  rounds (images/s)"]
    for r in result["rows"]:
        name = "meshfit" if r["path"] == "meshfit" else "keras"
        lines.append(f"{name:<8}  {r['images_per_s']:>9,.0f}  {r['cpu_us_per_image']:>12,.0f}  "
                     f"{r['peak_rss_mb']:>11,.0f}  "
                     + ", ".join(f"{v:,.0f}" for v in r["rounds_images_per_s"]))
    if result["vs_anchor"]:
        lines.append(f"meshfit vs keras.utils.image_dataset_from_directory: {result['vs_anchor']:.2f}x "
                     f"(medians of {len(result['rounds_vs_anchor'])} rounds, paths alternating)")
    return "\n".join(lines + [f"skipped {s}" for s in result["skipped"]])
