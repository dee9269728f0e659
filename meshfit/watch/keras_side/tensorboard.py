"""TensorBoard scalars of a training run, written with tensorboardX (no TensorFlow needed).

`TensorBoardLog` (a Keras callback) writes, all against the global train step (steps done since
the run began, so a resumed run continues the same curves):
  train/<metric>     the running epoch means Keras logs (loss, accuracy, ...), every `log_every`
                     steps;
  epoch/<metric>     every number of the epoch-end logs, val_* included, at the epoch's last step;
  epoch/learning_rate  the optimizer's learning rate at epoch end (a schedule evaluated at
                     optimizer.iterations);
  speed/ms_per_step, speed/samples_per_second, speed/mfu  from the EpochReport given as `report`;
  goodput/fraction, goodput/<part>_seconds  the run's goodput so far (meshfit.watch.goodput), from
                     the same report, accumulated across resumes.

No per-step device synchronization in the training loop: the callback is `async_safe`, so on JAX
Keras runs batch-end hooks on worker threads (keras/src/callbacks/callback_list.py), which convert
the step's logs to floats there while the loop dispatches the next step. The batch hook never
touches `self.model`: on JAX that property syncs the model's state, and from a worker thread it
races the next step, which donates those buffers (the process crashes). On TensorFlow Keras runs
batch hooks in the loop and converts the logs every step whatever the callbacks.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import keras
import numpy as np

from meshfit.parallel import engine

_files = itertools.count()  # tensorboardX names files by the second: keep two writers apart


def global_step(epoch: int, batch: int, fit_steps: int | None, steps_per_epoch: int | None) -> int:
    """Train steps done once step `batch` (0-based, within this fit's epoch) has run.

    fit_steps: the steps per epoch this fit runs (Keras' params["steps"]); steps_per_epoch: the
    run's whole epoch, when a resumed fit runs only the end of a cut epoch (None: the same).
    """
    full = steps_per_epoch or fit_steps or 0
    skipped = max(full - (fit_steps or full), 0)  # a cut epoch resumes `skipped` steps in
    return epoch * full + skipped + batch + 1


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch.

    tensorboardX's writer module imports torch whenever it is installed (a `try: import torch` at
    its top, only so that torch tensors count as values; `python -X importtime -c "import
    tensorboardX"` shows it): 3.2 s on a GPU machine with PyTorch (H200, 2026-11-28), inside the
    first epoch of every run, where meshfit writes only Python floats. engine.imports_skipped
    makes that import fail for the moment of tensorboardX's own import, and its except-branch
    falls back to NumPy; this is sufficient because that is tensorboardX's only import of torch
    at import time (the others sit in functions meshfit does not call). A torch imported already
    is left as it is, and torch imports normally afterwards.
    """
    with engine.imports_skipped(("torch",)):
        from tensorboardX import SummaryWriter

    return SummaryWriter


def _floats(logs: dict[str, Any] | None) -> dict[str, float]:
    """The logs' numbers as Python floats (converting device arrays here, only when called)."""
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
    return out


def learning_rate(optimizer) -> float | None:
    """The optimizer's current learning rate (a schedule at its step count), or None."""
    try:
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except Exception:  # an optimizer without a readable rate simply gets no curve
        return None


class TensorBoardLog(keras.callbacks.Callback):
    """Writes TensorBoard scalars to `logdir` (conventionally RUN/tensorboard).

    log_every: write train/* every so many global steps (a run's: see meshfit.run.options; with
      k steps per dispatch, at the dispatch that passes a multiple). report: the EpochReport of
      the fit (put it earlier in the callback list), for speed/*. global_batch: samples per step, for samples/s when the report
      has none. steps_per_epoch: the run's steps per epoch, needed only when a fit resumes the
      end of a cut epoch (meshfit's training does); otherwise Keras' params["steps"].
    """

    def __init__(self, logdir: str, log_every: int, report=None, global_batch: int | None = None,
                 steps_per_epoch: int | None = None):
        super().__init__()
        self.logdir = os.fspath(logdir)
        self.log_every = max(int(log_every), 1)
        self.report = report
        self.global_batch = global_batch
        self.steps_per_epoch = steps_per_epoch
        # Imported here, while the run sets up, not in the first epoch's time.
        self._writer_class = summary_writer_class()
        self.async_safe = True  # Keras may call on_train_batch_end from worker threads
        self._writer = None
        self._epoch, self._dispatch = 0, 1
        self._lock = threading.Lock()

    def _step(self, batch: int) -> int:
        return global_step(self._epoch, batch, self.params.get("steps"), self.steps_per_epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        # Read here, on the training thread: on JAX, `self.model` syncs the model's state, which
        # from a batch-end worker thread races the next step that donates those buffers (a crash).
        self._dispatch = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)
        if self._writer is None:
            first = self._step(-1)  # steps done before this fit
            # purge_step: a resumed run hides what the killed run wrote after its checkpoint.
            self._writer = self._writer_class(self.logdir, purge_step=first + 1 if first else None,
                                              flush_secs=30,
                                              filename_suffix=f".{os.getpid()}.{next(_files)}")

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is None:
            return
        step = self._step(batch)
        if step // self.log_every == (step - self._dispatch) // self.log_every:
            return  # no multiple of log_every in this dispatch: no conversion, no write
        with self._lock:
            for key, value in _floats(logs).items():
                self._writer.add_scalar(f"train/{key}", value, step)

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is None:
            return
        step = self._step((self.params.get("steps") or 1) - 1)
        scalars = {f"epoch/{k}": v for k, v in _floats(logs).items()}
        optimizer = getattr(self.model, "optimizer", None)
        rate = learning_rate(optimizer) if optimizer is not None else None
        if rate is not None:
            scalars["epoch/learning_rate"] = rate
        stats = self.report.epochs[-1] if self.report is not None and self.report.epochs else {}
        if stats.get("epoch", epoch + 1) == epoch + 1:  # this epoch's figures, not a stale one
            speed = {k: stats.get(k) for k in ("ms_per_step", "samples_per_second", "mfu")}
            if speed["samples_per_second"] is None and self.global_batch and speed["ms_per_step"]:
                speed["samples_per_second"] = self.global_batch * 1000 / speed["ms_per_step"]
            scalars.update({f"speed/{k}": float(v) for k, v in speed.items() if v is not None})
            spent = stats.get("goodput") or {}
            if spent.get("fraction") is not None:
                scalars["goodput/fraction"] = float(spent["fraction"])
                scalars.update({f"goodput/{k}_seconds": float(v) for k, v in spent["seconds"].items()})
        with self._lock:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        """Flush and close the event file (Keras calls no end hook when a callback raises; the
        writer's own atexit hook also closes it)."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
