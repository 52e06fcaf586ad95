"""Small helpers the chapter notebooks share: numbers for the prose, folded checks, and one look for every figure.

Nothing here computes attention; that is :mod:`lib.attention`. These helpers work with or without the book's
tooling, so a chapter runs the same in the built book, in local Jupyter and on Colab (which has no myst-nb).

The reading convention (README, "Chapter conventions"): a cell the reader must read holds the lines of the idea and
prints their result; the checks that prove the prose sit in the next cell, tagged ``check``, inside
``with checks(...) as check:``, which prints one line such as "✓ 4 checks against PyTorch". ``ROLES`` maps each
role tag to the fold the book shows and the prompts on it; ``tools/refresh_notebooks.py`` writes them into the cells.
``reading_surface`` measures what a reader must read in a notebook against a learner's ``BUDGET``.
"""

from __future__ import annotations

import numbers
import re
from contextlib import contextmanager

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


# role tag -> (the book's fold tag, prompt to open the fold, prompt to close it)
ROLES = {
    "check": ("hide-input", "Show the checks", "Hide the checks"),
    "plot": ("hide-input", "Show the plotting code", "Hide the plotting code"),
    "solution": ("hide-cell", "Show solution", "Hide solution"),
    "deeper": ("hide-cell", "Going deeper: show the code", "Hide the code"),
}


class Checks:
    """Counts the checks of one folded check cell; each one raises ``AssertionError`` at once if it fails."""

    def __init__(self):
        self.count = 0

    def __call__(self, condition, message="check failed"):
        """Check that ``condition`` holds (a bool, or a NumPy/torch boolean scalar)."""
        self.count += 1
        if not bool(condition):
            raise AssertionError(message)

    def close(self, actual, expected, **tolerances):
        """Check two arrays or tensors agree, with ``np.testing.assert_allclose``'s or ``torch.testing``'s tolerances."""
        self.count += 1
        if type(actual).__module__.startswith("torch") or type(expected).__module__.startswith("torch"):
            import torch

            torch.testing.assert_close(actual, expected, **tolerances)
        else:
            import numpy as np

            np.testing.assert_allclose(actual, expected, **tolerances)

    def equal(self, actual, expected):
        """Check ``actual == expected`` exactly (shapes, counts, exact numbers), showing both if not."""
        self.count += 1
        if not actual == expected:
            raise AssertionError(f"{actual!r} != {expected!r}")


@contextmanager
def checks(what=""):
    """Run a cell's checks and print one line that says how many passed: ``✓ 4 checks against PyTorch``.

    >>> with checks("on the shapes") as check:
    ...     check.equal((2, 3), (2, 3))
    ✓ 1 check on the shapes

    A check cell that checks nothing is a mistake, so it raises.
    """
    counter = Checks()
    yield counter
    if counter.count == 0:
        raise AssertionError("a check cell ran no check")
    noun = "check" if counter.count == 1 else "checks"
    if re.fullmatch(r"exercise \d+", what):  # an exercise's grading cell: "✓ 3 checks for exercise 2"
        what = f"for {what}"
    print(f"✓ {counter.count} {noun} {what}".rstrip())


_CONSTANT_IF = re.compile(r"(?P<indent> *)if (?P<negated>not )?(?P<name>[A-Z][A-Z0-9_]*):\s*(#.*)?")


def _indent(line):
    return len(line) - len(line.lstrip(" "))


def _block(lines, start, indent):
    """The lines from ``start`` indented deeper than ``indent`` (blank lines inside included), and where they end."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():  # a blank line after the block belongs to what follows
        end -= 1
    return lines[start:end], end


def resolve_constants(lines, constants):
    """Python source ``lines`` as a compiler that knows ``constants`` sees them: each ``if NAME:`` or
    ``if not NAME:`` (with its ``else:``) on a name of ``constants`` is replaced by the branch that runs, dedented
    to the ``if``'s place. Comments just above a dropped first branch go with it. Any other ``if`` is kept, and
    so is one on such a name followed by ``elif``.

    >>> print("\n".join(resolve_constants(["if TMA:", "    a = 1", "else:", "    a = 2", "b = a"], {"TMA": False})))
    a = 2
    b = a
    """
    out, i = [], 0
    while i < len(lines):
        match = _CONSTANT_IF.fullmatch(lines[i])
        if match is None or match["name"] not in constants:
            out.append(lines[i])
            i += 1
            continue
        indent = len(match["indent"])
        first, end = _block(lines, i + 1, indent)
        second, after = [], end
        if end < len(lines) and _indent(lines[end]) == indent and lines[end].strip() == "else:":
            second, after = _block(lines, end + 1, indent)
        elif end < len(lines) and _indent(lines[end]) == indent and lines[end].lstrip().startswith("elif "):
            out.append(lines[i])  # an elif chain is left as written
            i += 1
            continue
        runs = bool(constants[match["name"]]) != bool(match["negated"])
        if not runs:
            while out and out[-1].strip().startswith("#") and _indent(out[-1]) == indent:
                out.pop()
        kept = resolve_constants(first if runs else second, constants)
        depth = min((_indent(line) for line in kept if line.strip()), default=indent) - indent
        out += [line[depth:] if line.strip() else line for line in kept]
        i = after
    return out


def source_excerpt(source, first, last, **constants):
    """The lines of ``source`` from the first that contains ``first`` to the next that contains ``last``, with the
    branches on the compile-time ``constants`` resolved (:func:`resolve_constants`): a kernel as Triton compiles
    it for one variant, e.g. ``source_excerpt(src, "for start_n", "return acc", TMA=False)``."""
    lines = source.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if first in line)
        stop = next(i for i in range(start, len(lines)) if last in lines[i])
    except StopIteration:
        raise ValueError(f"no lines from {first!r} to {last!r} in the source") from None
    return "\n".join(resolve_constants(lines[start:stop + 1], constants))


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


# ------------------------------------------------------------------------------------- what a reader has to read

#: A learner's budget per chapter (README, "Chapter conventions"; tests/test_chapters.py enforces it).
BUDGET = {"prose_words": 4500, "visible_code_lines": 260, "longest_visible_cell": 25, "figures": 3}
#: Tags under which a reader does not see a cell's code until a fold is opened (or never).
FOLDED_CODE = ("hide-input", "hide-cell", "remove-input", "remove-cell")
#: Reading pace behind the reading times of the landing page: prose words and visible code lines per minute.
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE = 200, 10

_DROPDOWN = re.compile(  # a MyST admonition folded as a dropdown, up to its own closing fence
    r"^(?P<fence>:{3,}|`{3,})\s*\{admonition\}[^\n]*\n(?:[ \t]*:[\w-]+:[^\n]*\n)*?[ \t]*:class:[^\n]*\bdropdown\b"
    r"[\s\S]*?^(?P=fence)[ \t]*$",
    re.MULTILINE,
)
_ROLE = re.compile(r"\{(?P<name>[\w:-]+)\}`[^`\n]*`")  # {glue:text}`name`, {numref}`fig-x`: shown as a word or two
_NOT_PROSE = re.compile(
    r"\$\$[\s\S]*?\$\$"  # display math
    r"|\$[^$\n]*\$"  # inline math
    r"|(?P<f>`{3,}|~{3,})[\s\S]*?(?P=f)"  # fenced code
    r"|`[^`\n]*`"  # inline code (and a role's content)
    r"|\{[\w:-]+\}"  # a role's or directive's name
)
_WORD = re.compile(r"[A-Za-z0-9][\w'’.,-]*")


def prose_words(markdown):
    """Words of a Markdown cell in the main reading path: no math, no code, nothing inside a folded dropdown."""
    text = _DROPDOWN.sub(" ", markdown)
    text = _ROLE.sub(lambda role: " " if role["name"] == "math" else " 1 ", text)  # a role counts as one word
    return len(_WORD.findall(_NOT_PROSE.sub(" ", text)))


def _text(value):
    return "".join(value) if isinstance(value, list) else value


def reading_surface(notebook):
    """What a reader of the book must read in one notebook (a dict as ``json.load`` gives it), as a dict:

    ``prose_words`` (Markdown outside folded dropdowns, math and code), ``visible_code_lines`` (non-blank lines of
    the code cells not folded or removed: ``FOLDED_CODE``), ``longest_visible_cell`` and ``figures`` (numbered,
    captioned figures: cells that display something, an image or an interactive chart, under a ``mystnb.figure``
    name ``fig-...`` and a caption).
    """
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        raise TypeError("notebook must be a notebook as json.load gives it: a dict with a list of cells")
    surface = dict.fromkeys(BUDGET, 0)
    for cell in notebook["cells"]:
        text = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            surface["prose_words"] += prose_words(text)
        if cell.get("cell_type") != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        if not any(tag in FOLDED_CODE for tag in tags):
            lines = sum(1 for line in text.splitlines() if line.strip())
            surface["visible_code_lines"] += lines
            surface["longest_visible_cell"] = max(surface["longest_visible_cell"], lines)
        shown = not any(tag in ("remove-output", "remove-cell") for tag in tags)
        image = any(out.get("output_type") in ("display_data", "execute_result") for out in cell.get("outputs", []))
        figure = cell.get("metadata", {}).get("mystnb", {}).get("figure", {})
        named = str(figure.get("name", "")).startswith("fig-") and str(figure.get("caption", "")).strip()
        surface["figures"] += bool(shown and image and named)
    return surface


def over_budget(surface):
    """The budget lines a notebook's ``reading_surface`` breaks, as readable sentences (empty when within it)."""
    limits = {"prose_words": "words of prose", "visible_code_lines": "visible code lines",
              "longest_visible_cell": "lines in its longest visible code cell"}
    broken = [f"{surface[key]:,} {what} (at most {BUDGET[key]:,})" for key, what in limits.items()
              if surface[key] > BUDGET[key]]
    if surface["figures"] < BUDGET["figures"]:
        broken.append(f"{surface['figures']} numbered, captioned figures (at least {BUDGET['figures']})")
    return broken


def reading_minutes(surface):
    """Minutes to read a notebook's main path at ``WORDS_PER_MINUTE`` and ``CODE_LINES_PER_MINUTE``, rounded to 5."""
    minutes = surface["prose_words"] / WORDS_PER_MINUTE + surface["visible_code_lines"] / CODE_LINES_PER_MINUTE
    return max(5, 5 * round(minutes / 5))
