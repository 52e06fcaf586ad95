"""Measure what a reader meets on each page of the BUILT book (_build/html), as a Markdown table.

Usage, from the project root after `make book`:
    .venv/bin/python tools/measure_book.py [--html _build/html] [pages ...]   (default: every page in _toc.yml)

Per page, read from the HTML as the book ships it (not from the notebooks; lib.notebook.reading_surface does that):
- prose words: the article's text outside code cells, code, math and folded dropdowns (what a first reading reads);
- visible code lines and the longest visible code block: non-blank lines of the code cells' source that no fold
  hides (a "Show the checks", "Show solution" or aside fold hides its code);
- folded code lines: the same inside folds;
- figures: numbered, captioned figures ("Figure 7.2") on the page;
- output boxes per cell: the most printed-output boxes one cell shows, and how many cells show more than one
  (a cell's printed output should be one box).
"""

from __future__ import annotations

import argparse
import pathlib
import re

import yaml
from bs4 import BeautifulSoup

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORD = re.compile(r"[A-Za-z0-9][\w'’.,-]*")
COLUMNS = ("prose words", "visible code lines", "longest visible cell", "folded code lines", "figures",
           "most output boxes in a cell", "cells with split output")


def pages_in_toc():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [entry["file"] for part in toc["parts"] for entry in part["chapters"]]


def folded(element):
    """True when a reader must open a fold to see element: a details block or a dropdown admonition above it."""
    for parent in element.parents:
        if parent.name == "details":
            return True
        if parent.name == "div" and {"dropdown", "admonition"} <= set(parent.get("class", [])):
            return True
    return False


def code_lines(pre):
    return sum(1 for line in pre.get_text().splitlines() if line.strip())


def measure(html):
    """The row of COLUMNS for one built page (its HTML text)."""
    article = BeautifulSoup(html, "html.parser").select_one("article") or BeautifulSoup(html, "html.parser")
    visible, longest, hidden = 0, 0, 0
    for pre in article.select("div.cell div.cell_input pre"):
        lines = code_lines(pre)
        if folded(pre):
            hidden += lines
        else:
            visible += lines
            longest = max(longest, lines)
    figures = sum(1 for fig in article.select("figure") if re.match(r"\s*Fig(ure)?\.? ?\d", fig.get_text(" ")))
    boxes = [len(out.find_all("div", class_="output", recursive=False))
             for out in article.select("div.cell_output")]
    texts = [sum(1 for box in out.find_all("div", class_="output", recursive=False)
                 if {"stream", "text_plain"} & set(box.get("class", [])))
             for out in article.select("div.cell_output")]
    prose = BeautifulSoup(str(article), "html.parser")
    for element in prose.select("div.cell, pre, code, .math, mjx-container, script, style, svg, details, a.headerlink, "
                                "div.dropdown.admonition"):
        element.decompose()
    return {
        "prose words": len(WORD.findall(prose.get_text(" "))),
        "visible code lines": visible,
        "longest visible cell": longest,
        "folded code lines": hidden,
        "figures": figures,
        "most output boxes in a cell": max(boxes, default=0),
        "cells with split output": sum(1 for n in texts if n > 1),
    }


def table(rows):
    lines = ["| page | " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
    for page, row in rows:
        lines.append(f"| {page} | " + " | ".join(f"{row[c]:,}" for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=pathlib.Path, default=ROOT / "_build" / "html")
    parser.add_argument("pages", nargs="*", help="pages as in _toc.yml, e.g. chapters/01_token_by_token")
    args = parser.parse_args(argv)
    if not (args.html / "index.html").is_file():
        parser.error(f"no built book in {args.html}: run make book first")
    rows = []
    for page in args.pages or pages_in_toc():
        path = args.html / f"{page}.html"
        if not path.is_file():
            parser.error(f"{page} is not in the built book ({path} is missing)")
        rows.append((page.split("/")[-1], measure(path.read_text())))
    print(table(rows))


if __name__ == "__main__":
    main()
