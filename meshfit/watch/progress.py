"""Live progress bars on terminals and in Jupyter notebooks (rich), and nothing at all elsewhere
(logs, pipes, CI).

  bars(stream)      whether `stream` (default stdout) is a terminal that can draw them;
  live()            either: whether stdout shows live bars;
  track(...)        wraps any long loop in a bar;
  task(...)         a bar advanced by hand (evaluation batches, export stages, downloaded bytes);
The bar of each epoch of fit is meshfit.watch.keras_side.progress_bar.ProgressBar (a Keras callback).

In a Jupyter kernel (meshfit.env.notebook) a bar is one output redrawn in place. This module
imports neither Keras nor rich at the top: data downloads use it before the engine is chosen.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

from meshfit import env
from meshfit.parallel import cluster

T = TypeVar("T")


def bars(stream=None) -> bool:
    """True when `stream` (default sys.stdout) is a TTY and $TERM is not "dumb", in a process that
    is not one of a multi-process job.

    A job's processes reach the user through their launcher (srun, mpirun, meshfit launch), most
    often into a log file, and mpirun gives each its own pseudo-terminal: isatty() cannot say where
    the output ends up, so a job prints lines (epoch lines), never bars.
    """
    if cluster.multi_process():
        return False
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


def live() -> bool:
    """True when stdout shows live bars: a terminal that can draw (bars()) or a notebook."""
    return bars() or env.notebook()


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


def unseen_console():
    """A rich Console that draws nowhere: a notebook's Progress is shown by a NotebookDisplay."""
    from rich.console import Console

    return Console(file=io.StringIO())


def can_draw(console) -> bool:
    return console.is_terminal and not console.is_dumb_terminal


def track(iterable: Iterable[T], total: int | None = None, description: str = "working",
          console=None) -> Iterable[T]:
    """`iterable`, with a transient bar while it is consumed when drawing to a terminal (in a
    notebook: a NotebookDisplay, see task).

    total: the number of items (default len(iterable) where it has one). console: a rich
    Console to draw on (default: stdout, if it is a terminal). Elsewhere a plain passthrough.
    """
    if console is None and not bars():
        if not env.notebook():
            return iterable
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        return _tracked(iterable, total, description)
    from rich.progress import track as rich_track

    if console is not None and not can_draw(console):
        return iterable
    return rich_track(iterable, description=description, total=total, console=console,
                      transient=True, refresh_per_second=4)


@contextlib.contextmanager
def task(description: str, total: float | None = None, data_bytes: bool = False,
         console=None) -> Iterator[Callable[[float], None]]:
    """Inside the block, `advance(n)` moves a transient bar on by n of `total` (None: unknown);
    with data_bytes the units are bytes (sizes and speed shown). Drawn only on a terminal
    (console, or stdout when bars() says so); elsewhere advance does nothing."""
    in_notebook = console is None and not bars() and env.notebook()
    if not in_notebook and ((console is None and not bars()) or
                            (console is not None and not can_draw(console))):
        yield lambda n=1: None
        return
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    counts = (DownloadColumn(), TransferSpeedColumn()) if data_bytes else (MofNCompleteColumn(),)
    columns = (BarColumn(), *counts, TimeRemainingColumn()) if total else (BarColumn(), TimeElapsedColumn())
    if in_notebook:
        progress = Progress(TextColumn(description), *columns, console=unseen_console(),
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
