"""matplotlib Figures that a notebook shows inline: a cell ending with one displays the PNG, with
or without pyplot and its inline backend. matplotlib is imported on first use."""

from __future__ import annotations

import io
import os
from typing import Any

from meshfit.errors import MeshfitError

FORMATS = (".png", ".jpg", ".jpeg", ".pdf", ".svg")  # what a picture flag (--plot, --show) writes
_figure_class = None


def check_path(flag: str, path: str | None) -> None:
    """A MeshfitError, before any work, where `path` (given to `flag`) names no picture format
    this module writes (matplotlib would fail only after the work, with a traceback)."""
    if path and os.path.splitext(path)[1].lower() not in FORMATS:
        raise MeshfitError(f"{flag} {path}: name a {', '.join(FORMATS)} file")


def new(**kwargs: Any):
    """A matplotlib Figure (Figure(**kwargs)) with `_repr_png_`, drawn without pyplot."""
    global _figure_class
    if _figure_class is None:
        from matplotlib.figure import Figure

        class NotebookFigure(Figure):
            """A Figure that IPython displays as a PNG."""

            def _repr_png_(self) -> bytes:
                buffer = io.BytesIO()
                self.savefig(buffer, format="png")
                return buffer.getvalue()

        _figure_class = NotebookFigure
    return _figure_class(**kwargs)
