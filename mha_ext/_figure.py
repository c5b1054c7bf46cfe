"""plot_heads' figure: a matplotlib Figure that also shows itself in a
notebook whose kernel never set up matplotlib's inline display.

plot_heads builds its figure without pyplot, so IPython's printer for
figures (registered when pyplot's inline backend loads, e.g. by
``%matplotlib inline`` or ``import matplotlib.pyplot``) may not exist:
the figure as a cell's last expression then showed only its text repr,
"<Figure size 640x340 with 3 Axes>".  ``_repr_png_`` gives IPython the
picture either way (where the printer exists it is used instead).

Imported by plot_heads only: importing it imports matplotlib.
"""
from __future__ import annotations

import io

from matplotlib.figure import Figure

__all__ = ["HeadsFigure"]


class HeadsFigure(Figure):
    """A matplotlib Figure (plot_heads' result) with a PNG for notebooks."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
