"""Live progress bars on terminals and in Jupyter notebooks (rich), and nothing at all elsewhere
(logs, pipes, CI).

  bars(stream)      whether `stream` (default stdout) is a terminal that can draw them;
  notebook()        whether this is a Jupyter kernel, where a bar is one output redrawn in place;
  live()            either: whether stdout shows live bars;
  track(...)        wraps any long loop in a bar;
  task(...)         a bar advanced by hand (evaluation batches, export stages, downloaded bytes);
  ProgressBar(...)  a Keras callback: step/total, loss, samples/s and ETA within each epoch. The bar
                    is transient: removed at epoch end, so the epoch line of EpochReport stays.

This module imports neither Keras nor rich at the top; `ProgressBar` is made on first use.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


def bars(stream=None) -> bool:
    """True when `stream` (default sys.stdout) is a TTY and $TERM is not "dumb"."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


def notebook() -> bool:
    """True inside a Jupyter kernel: ipykernel is imported and runs an IPython kernel."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def live() -> bool:
    """True when stdout shows live bars: a terminal that can draw (bars()) or a notebook."""
    return bars() or notebook()


class NotebookDisplay:
    """A rich renderable shown as one notebook output and redrawn in place (an IPython display
    handle: no widgets needed, works in Jupyter, Colab, Kaggle and VS Code); `clear()` empties it."""

    def __init__(self, width: int = 100):
        from rich.console import Console

        self._console = Console(file=io.StringIO(), record=True, width=width, force_terminal=True,
                                force_jupyter=False, color_system="truecolor")
        self._handle = None

    def show(self, renderable) -> None:
        """Draw `renderable` (text/plain and text/html) in this display's output."""
        from IPython.display import display

        self._console.print(renderable)
        text = self._console.export_text(clear=False).rstrip()
        html = self._console.export_html(inline_styles=True, code_format=_HTML_FORMAT)
        data = {"text/plain": text, "text/html": html}
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)

    def clear(self) -> None:
        """Empty the output (the bar gives way to what is printed next)."""
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
            self._handle = None


_HTML_FORMAT = '<pre style="font-family:monospace;line-height:1.3;margin:0">{code}</pre>'


def _unseen_console():
    """A rich Console that draws nowhere: a notebook's Progress is shown by a NotebookDisplay."""
    from rich.console import Console

    return Console(file=io.StringIO())


def _can_draw(console) -> bool:
    return console.is_terminal and not console.is_dumb_terminal


def track(iterable: Iterable[T], total: int | None = None, description: str = "working",
          console=None) -> Iterable[T]:
    """`iterable`, with a transient bar while it is consumed when drawing to a terminal (in a
    notebook: a NotebookDisplay, see task).

    total: the number of items (default len(iterable) where it has one). console: a rich
    Console to draw on (default: stdout, if it is a terminal). Elsewhere a plain passthrough.
    """
    if console is None and not bars():
        if not notebook():
            return iterable
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        return _tracked(iterable, total, description)
    from rich.progress import track as rich_track

    if console is not None and not _can_draw(console):
        return iterable
    return rich_track(iterable, description=description, total=total, console=console,
                      transient=True, refresh_per_second=4)


@contextlib.contextmanager
def task(description: str, total: float | None = None, data_bytes: bool = False,
         console=None) -> Iterator[Callable[[float], None]]:
    """Inside the block, `advance(n)` moves a transient bar on by n of `total` (None: unknown);
    with data_bytes the units are bytes (sizes and speed shown). Drawn only on a terminal
    (console, or stdout when bars() says so); elsewhere advance does nothing."""
    in_notebook = console is None and not bars() and notebook()
    if not in_notebook and ((console is None and not bars()) or
                            (console is not None and not _can_draw(console))):
        yield lambda n=1: None
        return
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    counts = (DownloadColumn(), TransferSpeedColumn()) if data_bytes else (MofNCompleteColumn(),)
    columns = (BarColumn(), *counts, TimeRemainingColumn()) if total else (BarColumn(), TimeElapsedColumn())
    if in_notebook:
        progress = Progress(TextColumn(description), *columns, console=_unseen_console(),
                            auto_refresh=False)
        bar = progress.add_task(description, total=total)
        shown, last = NotebookDisplay(), [0.0]

        def advance(n: float = 1) -> None:
            progress.advance(bar, n)
            if time.perf_counter() - last[0] >= 0.25:  # at most 4 redraws a second
                last[0] = time.perf_counter()
                shown.show(progress.get_renderable())

        shown.show(progress.get_renderable())
        try:
            yield advance
        finally:
            shown.clear()
        return
    progress = Progress(TextColumn(description), *columns, console=console, transient=True,
                        refresh_per_second=4)
    bar = progress.add_task(description, total=total)
    with progress:
        yield lambda n=1: progress.advance(bar, n)


def _tracked(iterable: Iterable[T], total: int | None, description: str) -> Iterator[T]:
    with task(description, total) as advance:
        yield from counted(iterable, advance)


def counted(items: Iterable[T], advance: Callable[[float], None]) -> Iterator[T]:
    """`items`, calling advance(1) as each is taken."""
    for item in items:
        advance(1)
        yield item


def _floats(logs) -> dict[str, float]:
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _progress_bar_class():
    import keras

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
            in_notebook = self.console is None and not bars() and notebook()
            if self.console is None and not bars() and not in_notebook:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            console = _unseen_console() if in_notebook else self.console or Console()
            if not in_notebook and not _can_draw(console):
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

    return ProgressBar


def __getattr__(name: str):
    # ProgressBar subclasses keras.callbacks.Callback, so it is made on first use: importing this
    # module (for bars or track) must not import Keras before the engine is chosen.
    if name == "ProgressBar":
        globals()["ProgressBar"] = _progress_bar_class()
        return globals()["ProgressBar"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
