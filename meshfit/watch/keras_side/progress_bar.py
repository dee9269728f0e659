"""The progress bar of each epoch of fit, a Keras callback: step/total, loss, samples/s and ETA.
The bar is transient: removed at epoch end, so the epoch line of EpochReport stays. Draws on a
terminal or in a Jupyter notebook, and nothing elsewhere (meshfit.watch.progress decides).

This module imports Keras at the top: import it after `meshfit.connect()` chose the engine.
"""

from __future__ import annotations

import threading
import time

import keras

from meshfit import env
from meshfit.watch.progress import NotebookDisplay, bars, can_draw, unseen_console


def _floats(logs) -> dict[str, float]:
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class ProgressBar(keras.callbacks.Callback):
    """A transient bar per epoch: step/total, loss, samples/s (since the bar's first update,
    so without compilation) and ETA. Draws only on a terminal.

    global_batch: samples per step (None: no samples/s). console: a rich Console (default:
    stdout when bars() says it is a terminal; in a Jupyter kernel, a NotebookDisplay). refresh_per_second: the most redraws and log
    conversions per second; batch ends in between return at once. Put it first among the
    callbacks, so its bar is gone before other epoch-end callbacks print.
    """

    def __init__(self, global_batch: int | None = None, console=None,
                 refresh_per_second: float = 4.0):
        super().__init__()
        self.global_batch = global_batch
        self.console = console
        self.interval = 1.0 / refresh_per_second
        self.async_safe = True  # batch ends may run on Keras' worker threads: never self.model there
        self._progress = None
        self._display = None
        self._lock = threading.Lock()

    def on_epoch_begin(self, epoch, logs=None):
        self.close()
        in_notebook = self.console is None and not bars() and env.notebook()
        if self.console is None and not bars() and not in_notebook:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)

        console = unseen_console() if in_notebook else self.console or Console()
        if not in_notebook and not can_draw(console):
            return
        epochs = self.params.get("epochs") or "?"
        self._progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{epochs}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[figures]}"), TimeRemainingColumn(),
            console=console, transient=True, auto_refresh=not in_notebook,
            refresh_per_second=max(1.0 / self.interval, 1.0))
        self._task = self._progress.add_task("train", total=self.params.get("steps"), figures="")
        self._first = None  # (step, time) of the first update: the rate excludes compilation
        self._last = 0.0
        self._display = NotebookDisplay() if in_notebook else None
        if self._display is None:
            self._progress.start()
        else:
            self._display.show(self._progress.get_renderable())

    def on_train_batch_end(self, batch, logs=None):
        if self._progress is None or time.perf_counter() - self._last < self.interval:
            return  # not redrawing: no conversion of the logs
        with self._lock:
            now = time.perf_counter()
            if self._progress is None or now - self._last < self.interval:
                return
            self._last = now
            self._update(batch + 1, logs, now)

    def on_epoch_end(self, epoch, logs=None):
        with self._lock:
            if self._progress is not None:
                self._update(self.params.get("steps") or 0, logs, time.perf_counter())
        self.close()

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        """Remove the bar (also after an interrupted fit, where Keras calls no end hooks)."""
        with self._lock:
            if self._progress is not None:
                if self._display is not None:
                    self._display.clear()  # the bar gives way to the epoch line
                else:
                    self._progress.stop()
                self._progress = None

    def _update(self, step: int, logs, now: float) -> None:
        if self._first is None:
            self._first = (step, now)
        figures = []
        loss = _floats(logs).get("loss")
        if loss is not None:
            figures.append(f"loss {loss:.4f}")
        done, seconds = step - self._first[0], now - self._first[1]
        if self.global_batch and done > 0 and seconds > 0:
            figures.append(f"{self.global_batch * done / seconds:,.0f} samples/s")
        task = self._progress.tasks[0]
        self._progress.update(self._task, completed=max(step, task.completed),
                              figures="  ".join(figures))
        if self._display is not None:
            self._display.show(self._progress.get_renderable())
