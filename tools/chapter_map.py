"""A Sphinx extension of the book: the chapter map on the landing page, with each chapter's reading time.

`intro.md` holds the directive

    ```{chapter-map}
    ```

which draws the chapters and the field guide as boxes, an arrow from each chapter to the chapters that build on it,
and in each box the minutes its main path takes to read. The minutes are computed at build time from the notebooks
(`lib.notebook.reading_surface` and `reading_minutes`: prose words and visible code lines, nothing folded), never
typed by hand; the landing page is rebuilt whenever a notebook changes. `tests/test_chapters.py` checks the map
against the notebooks, `tests/test_book_browser.py` the built page against them.

The picture is inline SVG: its boxes are links, its text follows the theme's colours in light and dark mode, and its
<title> and <desc> say in words what it draws.
"""

from __future__ import annotations

import html
import pathlib
import sys
import textwrap

from docutils import nodes
from docutils.parsers.rst import Directive

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the build imports lib from the checkout, as the chapters do
    sys.path.insert(0, str(ROOT))
from lib.notebook import (
    CODE_LINES_PER_MINUTE,
    WORDS_PER_MINUTE,
    reading_minutes,
    reading_surface,
)

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
    10: ("From one head to a model", (6, 7), (6, 0)),
    11: ("One merge across programs, ranks and pages", (9, 10), (8, 1)),
    12: ("Variants of the formula", (10,), (8, 0)),
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
        minutes = reading_minutes(reading_surface(notebook)) if path else None
        title = title_of(notebook) if path else title
        docname = f"chapters/{path.stem}" if path else None
        boxes.append({"number": number, "title": title, "docname": docname, "minutes": minutes,
                      "builds_on": builds_on, "place": place, "path": path})
    guide = root / f"{GUIDE[0]}.ipynb"
    minutes = reading_minutes(reading_surface(json.loads(guide.read_text()))) if guide.exists() else None
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
        parts.append(f"{name}: {time}{after}.")
    return " ".join(parts)


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
        elif box["number"] is None:
            time = f"{box['minutes']} min · beside every chapter"
        else:
            time = f"{box['minutes']} min"
        if narrow and box["builds_on"]:
            time += f" · after {' and '.join(map(str, box['builds_on']))}"
        kind = "chapter" if box["number"] else "guide"
        state = "" if box["docname"] else " planned"
        lines = textwrap.wrap(label, TITLE_CHARS)[:2]
        title = "".join(f'<tspan x="{x + 12}" dy="{0 if i == 0 else 18}">{html.escape(line)}</tspan>'
                        for i, line in enumerate(lines))
        shape = (f'<rect class="box {kind}{state}" x="{x}" y="{y}" width="{LANE}" height="{BOX}" rx="8"/>'
                 f'<text class="title" x="{x + 12}" y="{y + 21}">{title}</text>'
                 f'<text class="minutes" x="{x + 12}" y="{y + 18 * len(lines) + 26}">{html.escape(time)}</text>')
        data = f' data-chapter="{box["number"] or "guide"}" data-minutes="{box["minutes"] or ""}"'
        if box["docname"]:
            name = f"Chapter {box['number']}: {box['title']}" if box["number"] else box["title"]
            aria = html.escape(f"{name}, about {box['minutes']} minutes", quote=True)
            out.append(f'<a href="{html.escape(href(box["docname"]), quote=True)}" aria-label="{aria}"{data}>'
                       f"{shape}</a>")
        else:
            out.append(f"<g{data}>{shape}</g>")
    out.append("</svg>")
    return "".join(out)


def caption(boxes):
    """The map's caption, with the total reading time computed like the boxes'."""
    written = [box["minutes"] for box in boxes if box["number"] and box["minutes"]]
    total = f"about {sum(written) / 60:.0f} hours in all"
    if len(written) < len(CHAPTERS):
        total += f" for the {len(written)} chapters written so far"
    return (f"The {len(CHAPTERS)} chapters and the field guide. An arrow leads from a chapter to one that builds on "
            f"it (on a narrow screen each box names the chapters it follows). Each box gives the minutes its main path takes at {WORDS_PER_MINUTE} words and "
            f"{CODE_LINES_PER_MINUTE} lines of code a minute, folded checks, asides and solutions aside: {total}. "
            "After chapter 7 the book forks: chapters 8 and 9 go onto the GPU, chapters 10 and 12 into a model, "
            "and chapter 11 needs both.")


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
