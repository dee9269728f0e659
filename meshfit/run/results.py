"""A finished run's files: model.keras, history.json, metrics.json and the training curves."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from meshfit.files import atomic_path
from meshfit.run import models, rundir
from meshfit.run.evaluate import headline


def plot_curves(history: list[dict[str, Any]], path: str, title: str,
                evaluated_on: str = "test") -> None:
    """Save loss and accuracy per epoch (train, and the split behind val_*) as a two-panel PNG
    (a model that is no classifier: its mean absolute error for the accuracy)."""
    from matplotlib.figure import Figure

    epochs = [record["epoch"] for record in history]
    measured = "mae" if any("mae" in r or "val_mae" in r for r in history) else "accuracy"
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    for axes, metric in zip(figure.subplots(1, 2), ("loss", measured)):
        for key, label in ((metric, "train"), (f"val_{metric}", evaluated_on)):
            values = [record.get(key) for record in history]
            if any(v is not None for v in values):
                axes.plot(epochs, [np.nan if v is None else v for v in values], marker="o", label=label)
        axes.set_xlabel("epoch")
        axes.set_ylabel(metric)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.savefig(path)


def totals(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The last epoch's training loss and accuracy (a model that is no classifier: its mean
    absolute error instead), and the training steps' time and speed over all epochs (every
    session's: a resumed run's history holds them). Its compile_seconds is replaced by the
    whole run's where the run's goodput is known (fit_and_score.score_and_write)."""
    final = history[-1] if history else {}
    train_seconds = sum(r.get("train_seconds") or 0.0 for r in history)
    samples = sum(r.get("samples") or 0 for r in history)
    measured = {"train_mae": final["mae"]} if "mae" in final and "accuracy" not in final else \
        {"train_accuracy": final.get("accuracy")}
    return {**measured, "train_loss": final.get("loss"),
            "train_seconds": train_seconds,
            "compile_seconds": sum(r.get("compile_seconds") or 0.0 for r in history),
            "samples_per_second": samples / train_seconds if train_seconds else None}


def write_results(run: str, model, history: list, metrics: dict[str, Any]) -> None:
    """model.keras, history.json and curves.png in the run directory (metrics.json, which says
    the run finished, comes last: write_metrics)."""
    with atomic_path(os.path.join(run, rundir.MODEL), ".keras") as tmp:
        with models.without_distribution():  # saving alone under the multi-host mesh would wait for the others
            models.save(model, tmp)
    rundir.write_json(os.path.join(run, rundir.HISTORY), history)
    name, accuracy, _, _ = headline(metrics)
    title = f"{metrics['recipe']}: {name} accuracy {accuracy:.2%}" if accuracy is not None else metrics["recipe"]
    plot_curves(history, os.path.join(run, rundir.CURVES), title, metrics.get("evaluated_on", "test"))


def write_metrics(run: str, metrics: dict[str, Any]) -> None:
    """metrics.json: the run's specification and results, its goodput and MFU included."""
    rundir.write_json(os.path.join(run, rundir.METRICS), metrics)
