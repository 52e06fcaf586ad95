"""A Sphinx extension of the book: the chapter map on the landing page, with each chapter's reading time.

`intro.md` holds the directive

    ```{chapter-map}
    ```

which draws the chapters and the field guide as boxes, an arrow from each chapter to the chapters that build on it,
and in each box the minutes its main path takes to read, the chapters of the short path (two evenings) marked. The
minutes are computed at build time from the notebooks (`reading_minutes` below, from what
`lib.notebook.reading_surface` counts and what a reader meets besides: printed results, figures, interactive figures
and display formulas; nothing folded), never typed by hand; the landing page is rebuilt whenever a notebook changes.
`tests/test_chapters.py` checks the map against the notebooks, `tests/test_book_browser.py` the built page against
them.

The picture is inline SVG: its boxes are links, its text follows the theme's colours in light and dark mode, and its
<title> and <desc> say in words what it draws.
"""

from __future__ import annotations

import html
import pathlib
import re
import sys
import textwrap

from docutils import nodes
from docutils.parsers.rst import Directive

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the build imports lib from the checkout, as the chapters do
    sys.path.insert(0, str(ROOT))
from lib.notebook import _DROPDOWN, reading_surface

# The reading pace behind the minutes: a first reading that follows the argument and checks its numbers, not a skim.
# 200 words and 10 code lines a minute, the pace the map first used, gave 7 hours for the book; a learner who read
# every chapter for understanding took about 1.3 times that for chapters 1 to 6 and 1.6 to 1.8 times for the GPU
# chapters, about 10 hours in all, and the difference is prose read more slowly and time spent on what is not
# prose. So: prose at 140 words a minute, code at 10 lines a minute, a printed result at 20 lines a minute, a
# minute for each figure, three for each interactive figure (its control tried through its range), and half a minute
# for each display formula.
PACE = {"words": 140, "code_lines": 10, "output_lines": 20, "figure": 1.0, "interactive": 3.0, "formula": 0.5}
# The short path, for a reader with two evenings: what attention computes (1, 2), why it is scaled (3), masks (5),
# what it costs and how it is tiled (7), and the field guide's bugs. The chapters left out are worked examples (4),
# the module (6) and the two tracks that follow chapter 7.
SHORT_PATH = (1, 2, 3, 5, 7, "guide")
INTERACTIVE_MARK = "sdpa-interactive"  # the class of an interactive figure's output (lib/interactive.py)
_DISPLAY_MATH = re.compile(r"\$\$[\s\S]*?\$\$|^```\{math\}", re.MULTILINE)
_NOT_READ = ("remove-output", "remove-cell", "hide-output", "hide-cell", "check", "solution", "deeper")


def reading_load(notebook):
    """What a reader meets on a notebook's main path, counted: ``prose_words`` and ``visible_code_lines`` (as
    ``lib.notebook.reading_surface`` counts them), ``output_lines`` (lines printed by the visible cells, checks,
    solutions and asides apart), ``figures`` (numbered figures that do not move), ``interactive`` (interactive
    figures) and ``formulas`` (display formulas outside folded dropdowns)."""
    surface = reading_surface(notebook)
    interactive = output_lines = 0
    for cell in notebook["cells"]:
        if cell.get("cell_type") != "code":
            continue
        outputs = cell.get("outputs", [])
        interactive += any(INTERACTIVE_MARK in "".join(out.get("data", {}).get("text/html", "")) for out in outputs)
        if any(tag in _NOT_READ for tag in cell.get("metadata", {}).get("tags", [])):
            continue
        for out in outputs:
            data = out.get("data", {})
            if out.get("output_type") == "stream":
                text = "".join(out.get("text", ""))
            elif "text/plain" in data and not any(kind.startswith("image/") or kind == "text/html" for kind in data):
                text = "".join(data["text/plain"])
            else:
                continue
            output_lines += sum(1 for line in text.splitlines() if line.strip())
    markdown = "\n".join("".join(cell.get("source", "")) for cell in notebook["cells"] if cell.get("cell_type") == "markdown")
    return {
        "prose_words": surface["prose_words"],
        "visible_code_lines": surface["visible_code_lines"],
        "output_lines": output_lines,
        "figures": surface["figures"] - min(interactive, surface["figures"]),
        "interactive": interactive,
        "formulas": len(_DISPLAY_MATH.findall(_DROPDOWN.sub(" ", markdown))),
    }


def reading_minutes(notebook):
    """Minutes to read a notebook's main path at ``PACE``, rounded to 5 (at least 5)."""
    load = reading_load(notebook)
    minutes = (load["prose_words"] / PACE["words"] + load["visible_code_lines"] / PACE["code_lines"]
               + load["output_lines"] / PACE["output_lines"] + load["figures"] * PACE["figure"]
               + load["interactive"] * PACE["interactive"] + load["formulas"] * PACE["formula"])
    return max(5, 5 * round(minutes / 5))

# number -> (title while the chapter is being written, the chapters it builds on directly, (row, lane) on the map).
# A written chapter's box shows its notebook's own title, the one the sidebar and the landing page's list show,
# wrapped onto two lines where it is long. The dependencies are the "builds on" links of each chapter's opening, each drawn once
# (a chapter that builds on 5 through 6 gets no arrow from 5).
CHAPTERS = {
    1: ("Attention, one token at a time", (), (0, 0)),
    2: ("All tokens at once: the matrix form", (1,), (1, 0)),
    3: ("Why divide by √dₖ", (2,), (2, 0)),
    4: ("A worked example, by hand", (3,), (3, 0)),
    5: ("Masking, and attending to another sequence", (4,), (4, 0)),
    6: ("The complete attention module", (5,), (5, 0)),
    7: ("What attention costs, and the way out", (5,), (5, 1)),
    8: ("What a score costs on a GPU", (7,), (6, 1)),
    9: ("FlashAttention in Triton", (8,), (7, 1)),
    10: ("Heads, positions and the cache", (6, 7), (6, 0)),
    11: ("A model: decoding cost and what heads do", (8, 10), (7, 0)),
    12: ("One merge across programs, ranks and pages", (9, 11), (8, 1)),
    13: ("Variants of the formula", (11,), (8, 0)),
}
GUIDE = ("guide/debugging", "Field guide: silent bugs", (1, 1))
WIDTH, LANE, GAP, ROW, BOX = 560, 260, 20, 82, 66  # the drawing's units: px at its natural size
TITLE_CHARS = 28  # the characters of a title line that fit a box at the title's 15 px


def notebook_of(number, root=ROOT):
    """The chapter's notebook, chapters/NN_slug.ipynb, or None while it is being written."""
    found = sorted((root / "chapters").glob(f"{number:02d}_*.ipynb"))
    return found[0] if found else None


def title_of(notebook):
    """The notebook's title: the text of its first Markdown heading of level 1."""
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError("the notebook has no '# ' title")


def entries(root=ROOT):
    """One dict per box: number (None for the guide), title, docname or None, minutes or None, builds_on, place."""
    import json

    boxes = []
    for number, (title, builds_on, place) in CHAPTERS.items():
        path = notebook_of(number, root)
        notebook = json.loads(path.read_text()) if path else None
        minutes = reading_minutes(notebook) if path else None
        title = title_of(notebook) if path else title
        docname = f"chapters/{path.stem}" if path else None
        boxes.append({"number": number, "title": title, "docname": docname, "minutes": minutes,
                      "builds_on": builds_on, "place": place, "path": path})
    guide = root / f"{GUIDE[0]}.ipynb"
    minutes = reading_minutes(json.loads(guide.read_text())) if guide.exists() else None
    boxes.append({"number": None, "title": GUIDE[1], "docname": GUIDE[0] if guide.exists() else None,
                  "minutes": minutes, "builds_on": (), "place": GUIDE[2], "path": guide if guide.exists() else None})
    return boxes


def _box(place):
    row, lane = place
    x = 10 + lane * (LANE + GAP)
    y = 10 + row * ROW
    return x, y


def _arrow(start, end):
    """The path of an arrow from the box at start to the box at end (both (row, lane))."""
    (x0, y0), (x1, y1) = _box(start), _box(end)
    if start[1] == end[1]:  # straight down the lane
        return f"M{x0 + LANE / 2},{y0 + BOX} L{x1 + LANE / 2},{y1}"
    if end[0] == start[0] + 1:  # to the next row, across the lanes: a short diagonal through the gap between rows
        xa = x0 + LANE - 30 if end[1] > start[1] else x0 + 30
        xb = x1 + 30 if end[1] > start[1] else x1 + LANE - 30
        return f"M{xa},{y0 + BOX} L{xb},{y1}"
    # further down and across: out of the side, down the gap between the lanes, into the other box's side
    side0 = x0 + LANE if end[1] > start[1] else x0
    side1 = x1 if end[1] > start[1] else x1 + LANE
    middle = 10 + LANE + GAP / 2
    return (f"M{side0},{y0 + BOX / 2} L{middle},{y0 + BOX / 2} L{middle},{y1 + BOX / 2} "
            f"L{side1},{y1 + BOX / 2}")


def describe(boxes):
    """The map in words: the SVG's <desc>, and what a screen reader says."""
    parts = []
    for box in boxes:
        name = f"Chapter {box['number']}, {box['title']}" if box["number"] else box["title"]
        time = f"about {box['minutes']} minutes" if box["minutes"] else "being written"
        after = f", after chapter {' and '.join(map(str, box['builds_on']))}" if box["builds_on"] else ""
        short = ", on the short path" if on_short_path(box) else ""
        parts.append(f"{name}: {time}{after}{short}.")
    return " ".join(parts)


def on_short_path(box):
    return (box["number"] or "guide") in SHORT_PATH


def svg(boxes, href, narrow=False):
    """The map as inline SVG; href(docname) gives a box's link from the page that shows it.

    The wide map draws the two lanes and the arrows. The narrow one, for a phone, puts the boxes in reading order in
    one column at a size its text can be read at, each saying which chapters it follows instead of an arrow.
    """
    variant = "narrow" if narrow else "wide"
    if narrow:
        order = [box for box in boxes if box["number"]] + [box for box in boxes if not box["number"]]
        places = {id(box): (row, 0) for row, box in enumerate(order)}
        width = LANE + 20
    else:
        places = {id(box): box["place"] for box in boxes}
        width = WIDTH
    rows = 1 + max(row for row, _ in places.values())
    height = 20 + (rows - 1) * ROW + BOX
    out = [
        (f'<svg class="chapter-map {variant}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
         f'role="group" aria-labelledby="chapter-map-title-{variant} chapter-map-desc-{variant}" '
         'xmlns="http://www.w3.org/2000/svg">'),
        (f'<title id="chapter-map-title-{variant}">The chapters, what each builds on, and the minutes each takes '
         "to read</title>"),
        f'<desc id="chapter-map-desc-{variant}">{html.escape(describe(boxes))}</desc>',
        (f'<defs><marker id="chapter-map-head-{variant}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
         'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="head"/></marker></defs>'),
    ]
    if not narrow:
        by_number = {box["number"]: box for box in boxes if box["number"]}
        for box in boxes:
            for before in box["builds_on"]:
                out.append(f'<path class="arrow" d="{_arrow(places[id(by_number[before])], places[id(box)])}" '
                           f'marker-end="url(#chapter-map-head-{variant})"/>')
    for box in boxes:
        x, y = _box(places[id(box)])
        label = f"{box['number']}  {box['title']}" if box["number"] else box["title"]
        if box["minutes"] is None:
            time = "being written"
        elif on_short_path(box):
            time = f"{box['minutes']} min · short path"
        elif box["number"] is None:
            time = f"{box['minutes']} min · beside every chapter"
        else:
            time = f"{box['minutes']} min"
        if narrow and box["builds_on"]:
            time += f" · after {' and '.join(map(str, box['builds_on']))}"
        kind = "chapter" if box["number"] else "guide"
        state = ("" if box["docname"] else " planned") + (" short" if on_short_path(box) else "")
        lines = textwrap.wrap(label, TITLE_CHARS)[:2]
        title = "".join(f'<tspan x="{x + 12}" dy="{0 if i == 0 else 18}">{html.escape(line)}</tspan>'
                        for i, line in enumerate(lines))
        shape = (f'<rect class="box {kind}{state}" x="{x}" y="{y}" width="{LANE}" height="{BOX}" rx="8"/>'
                 f'<text class="title" x="{x + 12}" y="{y + 21}">{title}</text>'
                 f'<text class="minutes" x="{x + 12}" y="{y + 18 * len(lines) + 26}">{html.escape(time)}</text>')
        data = f' data-chapter="{box["number"] or "guide"}" data-minutes="{box["minutes"] or ""}"'
        if box["docname"]:  # named by its text, which a screen reader reads as it is shown
            out.append(f'<a href="{html.escape(href(box["docname"]), quote=True)}"{data}>{shape}</a>')
        else:
            out.append(f"<g{data}>{shape}</g>")
    out.append("</svg>")
    return "".join(out)


def _chapters(numbers):
    numbers = [str(n) for n in numbers]
    return ", ".join(numbers[:-1]) + " and " + numbers[-1] if len(numbers) > 1 else "".join(numbers)


def caption(boxes):
    """The map's caption: how the minutes are reckoned, the total, and the short path, computed like the boxes'."""
    written = [box["minutes"] for box in boxes if box["number"] and box["minutes"]]
    total = f"about {sum(written) / 60:.0f} hours in all"
    if len(written) < len(CHAPTERS):
        total += f" for the {len(written)} chapters written so far"
    short = [box for box in boxes if on_short_path(box) and box["minutes"]]
    short_hours = sum(box["minutes"] for box in short) / 60
    numbers = [box["number"] for box in short if box["number"]]
    return (f"The {len(CHAPTERS)} chapters and the field guide, which sits beside every chapter. An arrow leads from "
            "a chapter to one that builds on it (on a narrow screen each box names the chapters it follows). Each box "
            "gives the minutes a first, careful reading of its main path takes: prose at "
            f"{PACE['words']} words a minute, code at {PACE['code_lines']} lines and printed results at "
            f"{PACE['output_lines']} lines a minute, a minute for each figure, {PACE['interactive']:.0f} for each "
            f"interactive figure and half a minute for each display formula; folded checks, asides and solutions "
            f"are not counted: {total}. After chapter 7 the book forks: chapters 8 and 9 go onto the GPU, chapters "
            "10, 11 and 13 into a model, and chapter 12 needs both. With two evenings, take the short path (its boxes "
            f"say so): chapters {_chapters(numbers)} and the field guide, about {short_hours:.1f} hours, which "
            "covers what attention computes, why it is scaled, its masks and what it costs.")


class ChapterMap(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        boxes = entries()
        for box in boxes:  # rebuild the landing page when a notebook changes, or how the map is drawn or timed
            if box["path"]:
                env.note_dependency(str(box["path"]))
        env.note_dependency(__file__)
        env.note_dependency(str(ROOT / "lib" / "notebook.py"))
        docname = env.docname

        def href(target):
            return env.app.builder.get_relative_uri(docname, target)

        figure = (f'<figure class="chapter-map">{svg(boxes, href)}{svg(boxes, href, narrow=True)}'
                  f"<figcaption><p>{html.escape(caption(boxes))}</p></figcaption></figure>")
        return [nodes.raw("", figure, format="html")]


def guide_bugs(root=ROOT):
    """How many bugs the field guide describes: its Markdown headings of the form '## N. ...'."""
    import json
    import re

    notebook = json.loads((root / f"{GUIDE[0]}.ipynb").read_text())
    return sum(bool(re.match(r"## \d+\. ", line)) for cell in notebook["cells"] if cell["cell_type"] == "markdown"
               for line in "".join(cell["source"]).splitlines())


def guide_bugs_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """The role {guide-bugs}`count`: the number of bugs in the field guide, counted at build time."""
    inliner.document.settings.env.note_dependency(str(ROOT / f"{GUIDE[0]}.ipynb"))
    return [nodes.Text(str(guide_bugs()))], []


def setup(app):
    app.add_directive("chapter-map", ChapterMap)
    app.add_role("guide-bugs", guide_bugs_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
