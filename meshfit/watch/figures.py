"""matplotlib Figures that a notebook shows inline: a cell ending with one displays the PNG, with
or without pyplot and its inline backend. matplotlib is imported on first use."""

from __future__ import annotations

import io
from typing import Any

_figure_class = None


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
