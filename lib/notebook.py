"""Small helpers the chapter notebooks share: numbers for the prose, and one look for every figure.

Nothing here computes attention; that is :mod:`lib.attention`. These helpers work with or without the book's
tooling, so a chapter runs the same in the built book, in local Jupyter and on Colab (which has no myst-nb).
"""

from __future__ import annotations

import numbers

try:  # the book build and the tests have myst-nb; Colab does not
    from myst_nb import glue as _myst_glue
except ImportError:  # pragma: no cover - exercised on Colab
    _myst_glue = None


def plain(value, digits=None):
    """value as a plain Python number (NumPy and torch scalars unwrapped), rounded to ``digits`` if given."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"glue takes a real number or a string, got {type(value).__name__}")
    if digits is not None and isinstance(value, float):
        value = round(value, digits)
    return value


def glue(name, value, digits=None):
    """Store a computed number under ``name`` for the prose ({glue:text}`name`) and return it.

    The value is unwrapped to a plain Python number and rounded, so the stored text is stable under strict nbval.
    Outside the book build (Colab, plain Jupyter) nothing is stored and the value is simply returned.
    """
    value = plain(value, digits)
    if _myst_glue is not None:
        _myst_glue(name, value, display=False)
    return value


def use_book_style():
    """One look for every figure: white background (readable in dark mode), viridis, labelled, legible sizes."""
    import matplotlib as mpl

    mpl.rcParams.update(
        {
            "figure.figsize": (6.4, 4.0),
            "figure.dpi": 100,
            "figure.facecolor": "white",
            "savefig.facecolor": "white",
            "axes.facecolor": "white",
            "axes.grid": True,
            "grid.alpha": 0.3,
            "image.cmap": "viridis",
            "font.size": 11,
            "axes.titlesize": 12,
            "axes.prop_cycle": mpl.cycler(
                color=["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
            ),
        }
    )
