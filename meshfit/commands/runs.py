"""`meshfit runs [DIR ...]`: a table of run directories, their progress, accuracy and speed.

A directory holding config.json is a run; any other directory given is searched one level down
(default: runs/). One row per run: recipe, hardware and settings, epochs done of those planned,
test accuracy ("-" for a model that is no classifier: --json has every run's test_loss and
test_mae; the last epoch's validation accuracy, marked "val", for a run without a test set or
not scored yet), training seconds, samples/s, MFU, goodput (training-step time / wall time, from
metrics.json or, while unfinished, the run's goodput.json) and status:
  finished         metrics.json exists;
  unfinished       killed or still training: progress from history.json or, as training writes
                   that only at the end, the newest checkpoint's state.json;
  diverged at step N  stopped because its weights became NaN or inf (its diverged.json);
  unreadable: ...  a damaged or missing JSON file (the reason follows).
`--json` prints the rows as JSON; `--plot OUT.png` draws test accuracy and loss of every run
against training time and against epochs; `--goodput-plot OUT.png` draws each run's wall time as
a stacked bar of its goodput parts. Reads JSON only: no Keras, no devices.
"""

from __future__ import annotations

import json
import os
from typing import Any

from meshfit.errors import MeshfitError
from meshfit.run.rundir import (CHECKPOINT_STATE, CHECKPOINTS, CONFIG, DIVERGED, HISTORY, METRICS,
                                list_checkpoints)
from meshfit.watch import figures, goodput

_SETTINGS = ("recipe", "device_kind", "platform", "replicas", "precision", "engine")
COLUMNS = (("run", "run"), ("recipe", "recipe"), ("device_kind", "device"), ("replicas", "x"),
           ("precision", "precision"), ("engine", "engine"), ("epochs", "epochs"),
           ("test_accuracy", "test acc"), ("train_seconds", "train s"),
           ("samples_per_second", "samples/s"), ("mfu", "MFU"), ("goodput", "goodput"),
           ("status", "status"))


def _read(path: str) -> Any:
    """A JSON file's contents; ValueError naming the file when it is missing or damaged."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        reason = "missing" if isinstance(e, FileNotFoundError) else str(e).splitlines()[0]
        raise ValueError(f"{os.path.basename(path)}: {reason}") from e


def history(run: str) -> list[dict[str, Any]]:
    """The run's per-epoch records: history.json, else the newest checkpoint's (else [])."""
    if os.path.isfile(os.path.join(run, HISTORY)):
        return list(_read(os.path.join(run, HISTORY)))
    found = list_checkpoints(os.path.join(run, CHECKPOINTS))
    if not found:
        return []
    return list(_read(os.path.join(found[-1], CHECKPOINT_STATE)).get("history") or [])


def find_runs(paths: list[str]) -> list[str]:
    """Run directories: each path holding config.json, else its sub-directories that do."""
    found = []
    for path in paths or ["runs"]:
        if os.path.isfile(os.path.join(path, CONFIG)):
            found.append(path)
        elif os.path.isdir(path):
            found += [os.path.join(path, name) for name in sorted(os.listdir(path))
                      if os.path.isfile(os.path.join(path, name, CONFIG))]
        else:
            raise MeshfitError(f"{path} is not a directory; pass run directories or folders of "
                               "them (default: runs)")
    return found


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(run: str) -> dict[str, Any]:
    """One row for a run directory (see the module docstring); never raises for bad JSON."""
    row: dict[str, Any] = {"run": run, **{key: None for key, _ in COLUMNS[1:]}}
    try:
        _fill(row, run)
    except (ValueError, AttributeError, TypeError) as e:  # the latter two: JSON of the wrong shape
        row["status"] = f"unreadable: {e}"
    return row


def _fill(row: dict[str, Any], run: str) -> None:
    config = _read(os.path.join(run, CONFIG))
    row.update({key: config.get(key) for key in _SETTINGS})
    finished = os.path.isfile(os.path.join(run, METRICS))
    metrics = _read(os.path.join(run, METRICS)) if finished else {}
    records = history(run)
    source = {**config, **metrics}  # metrics.json: the settings of the last (resumed) session
    row.update({key: source.get(key) for key in _SETTINGS})
    seconds = sum(r.get("train_seconds") or 0.0 for r in records)
    samples = sum(r.get("samples") or 0 for r in records)
    last = records[-1] if records else {}
    spent = metrics.get("goodput") or _unfinished_goodput(run)
    row.update({
        "goodput": spent.get("fraction") if spent else None,
        "goodput_seconds": spent.get("seconds") if spent else None,
        "epochs_done": len(records), "epochs_planned": source.get("epochs"),
        "test_accuracy": metrics.get("test_accuracy", last.get("val_accuracy")),
        # where the scores come from: the test split, else (no test set, or not scored yet) the
        # last epoch's validation, marked "val" in the table
        "scored_on": ("test" if {"test_accuracy", "test_loss"} & set(metrics) else
                      "validation" if {"val_accuracy", "val_loss"} & set(last) else None),
        # a model that is no classifier has no accuracy ("-"): its loss and mean absolute error
        "test_loss": metrics.get("test_loss", last.get("val_loss")),
        "test_mae": metrics.get("test_mae", last.get("val_mae")),
        "train_seconds": metrics.get("train_seconds", seconds if records else None),
        "samples_per_second": metrics.get("samples_per_second",
                                          samples / seconds if seconds and samples else None),
        "mfu": metrics.get("mfu", _mean([r.get("mfu") for r in records])),
        "status": "finished" if finished else _stopped_for_good(run) or "unfinished",
    })
    row["epochs"] = f"{row['epochs_done']}/{row['epochs_planned'] or '?'}"


def _stopped_for_good(run: str) -> str | None:
    """'diverged at step N' for a run stopped because its weights became NaN or inf, else None."""
    path = os.path.join(run, DIVERGED)
    return f"diverged at step {_read(path).get('step')}" if os.path.isfile(path) else None


def _unfinished_goodput(run: str) -> dict[str, Any] | None:
    """The goodput so far of a run still training or stopped (its goodput.json), else None."""
    path = os.path.join(run, goodput.FILE)
    return _read(path) if os.path.isfile(path) else None


def collect(paths: list[str]) -> list[dict[str, Any]]:
    """One row per run found under `paths` (default ["runs"]), in path order."""
    return [summarize(run) for run in find_runs(paths)]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "test_accuracy":
        return f"{value:.2%}"
    if key in ("mfu", "goodput"):
        return f"{value:.1%}"
    if key == "train_seconds":
        return f"{value:,.1f}"
    if key == "samples_per_second":
        return f"{value:,.0f}"
    return str(value)


def _scored_on(key: str, row: dict[str, Any]) -> str:
    """" val" after a test accuracy that is the validation's (a run without a test set, or not
    scored yet), so that no validation figure passes for a test one."""
    scored = key == "test_accuracy" and row.get(key) is not None and row.get("scored_on") == "validation"
    return " val" if scored else ""


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as plain text columns, numbers right-aligned; "-" where unknown."""
    if not rows:
        return "no runs found"
    cells = [[title for _, title in COLUMNS]] + [[_cell(k, row.get(k)) + _scored_on(k, row)
                                                  for k, _ in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    right = {"replicas", "epochs", "test_accuracy", "train_seconds", "samples_per_second", "mfu",
             "goodput"}
    lines = ["  ".join(text.rjust(w) if key in right else text.ljust(w)
                       for (key, _), text, w in zip(COLUMNS, line, widths)).rstrip()
             for line in cells]
    return "\n".join(lines)


def to_json(rows: list[dict[str, Any]]) -> str:
    """The rows as a JSON list."""
    return json.dumps(rows, indent=2)


def label(row: dict[str, Any]) -> str:
    """A run's legend label: "<recipe> <device> x<replicas> <engine>" (device: cpu or its kind)."""
    device = "cpu" if row.get("platform") == "cpu" else (row.get("device_kind") or row.get("platform"))
    return f"{row.get('recipe')} {device} x{row.get('replicas')} {row.get('engine')}"


def plot(rows: list[dict[str, Any]], histories: list[list[dict[str, Any]]], path: str | None = None):
    """The matplotlib Figure of test accuracy and loss (solid; train dashed) of each run, against
    cumulative training seconds and against epochs, also saved as a PNG at `path` when given.
    `histories` pairs with `rows`. A notebook cell ending with it shows the figure."""
    from matplotlib.ticker import MaxNLocator

    labels = [label(row) if records else None for row, records in zip(rows, histories)]
    labels = [f"{text} ({os.path.basename(os.path.normpath(row['run']))})" if labels.count(text) > 1
              else text for text, row in zip(labels, rows)]  # runs alike: told apart by folder
    figure = figures.new(figsize=(12, 8), dpi=100, layout="constrained")
    axes = figure.subplots(2, 2)
    for index, (records, text) in enumerate(zip(histories, labels)):
        if not records:
            continue
        color = f"C{index % 10}"
        epochs = [r.get("epoch", i + 1) for i, r in enumerate(records)]
        seconds, total = [], 0.0
        for r in records:
            total += r.get("train_seconds") or 0.0
            seconds.append(total)
        for row_axes, metric in zip(axes, ("accuracy", "loss")):
            for ax, x in zip(row_axes, (seconds, epochs)):
                for key, style, name in ((f"val_{metric}", "-", text), (metric, "--", None)):
                    values = [r.get(key) for r in records]
                    if any(v is not None for v in values):
                        ax.plot(x, [float("nan") if v is None else v for v in values], style,
                                color=color, marker="o", markersize=3, label=name)
    for row_axes, metric in zip(axes, ("accuracy", "loss")):
        for ax, xlabel in zip(row_axes, ("training time (s)", "epoch")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{metric} (solid: test, dashed: train)")
            ax.grid(alpha=0.3)
        row_axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if any(histories):
        axes[0][0].legend(fontsize="small")
    if path is not None:
        figure.savefig(path)
    return figure


def plot_goodput(rows: list[dict[str, Any]], path: str | None = None):
    """The matplotlib Figure of every run's wall time as one horizontal bar stacked by goodput
    part (seconds), labelled with its goodput; also saved as a PNG at `path` when given. Runs
    without a goodput record are left out."""
    shown = [row for row in rows if row.get("goodput_seconds")]
    figure = figures.new(figsize=(11, 1.6 + 0.45 * max(len(shown), 1)), dpi=100, layout="constrained")
    ax = figure.subplots()
    names = [f"{label(row)} ({os.path.basename(os.path.normpath(row['run']))})" for row in shown]
    for part in goodput.PARTS:
        left = [sum(max(row["goodput_seconds"].get(p, 0.0), 0.0)
                    for p in goodput.PARTS[:goodput.PARTS.index(part)]) for row in shown]
        widths = [max(row["goodput_seconds"].get(part, 0.0), 0.0) for row in shown]
        ax.barh(range(len(shown)), widths, left=left, color=goodput.COLORS[part],
                label=goodput.LABELS.get(part, part))
    for i, row in enumerate(shown):
        total = sum(max(v, 0.0) for v in row["goodput_seconds"].values())
        ax.text(total, i, f" {row['goodput']:.0%}" if row.get("goodput") is not None else "",
                va="center", fontsize=8)
    ax.set_yticks(range(len(shown)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s); label: goodput = training-step time / wall time")
    ax.legend(ncols=len(goodput.PARTS), fontsize="small", loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    if path is not None:
        figure.savefig(path)
    return figure


# ------------------------------------------------------------------------------------------ CLI
