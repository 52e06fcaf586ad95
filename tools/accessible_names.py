"""A Sphinx extension of the book: names a screen reader can tell apart, and markup its audit accepts.

`tests/test_book_browser.py` audits every page with axe-core (WCAG 2.0-2.2, A and AA). What it found, and what this
does about it, in the HTML the build writes (so it holds without scripts):

- A cell's fold (myst-nb's `<summary aria-label="Toggle hidden content">`) was named "Toggle hidden content" whatever
  it held, while it shows "Show solution" or "Show the checks": on a chapter a screen-reader user heard the same
  words thirty times. The fold now takes its name from the prompt it shows ("Show solution", "Hide solution"), and a
  check's fold adds the line it folds above, in text only a screen reader reads: "Show the checks: ✓ 3 checks
  against PyTorch". (A Going-deeper aside's toggle is a button that sphinx-togglebutton's script makes;
  `_static/book.js` names it after its title.)
- The theme's search field was named "Search" while it shows "Search Ctrl+K", and its colour-mode button "Color
  mode" while its icons carried the titles "Light", "Dark" and "System Settings" (the accessible name must contain
  the visible text): the search field now takes its name from its text, the icons lose their titles (the button
  keeps its tooltip and its name).
- The bibliography's list (`role="list"`) held entries with the role `doc-biblioentry`, which is not a list item:
  they are list items now.
"""

from __future__ import annotations

import re
from html import escape

from docutils import nodes

PROMPT = '<p class="{state} admonition-title">{prompt}{said}</p>\n'


def _check_line(fold):
    """The line a check cell prints ("✓ 3 checks against PyTorch"), which its fold sits above; None elsewhere."""
    cell = fold.parent
    if not isinstance(cell, nodes.container) or "tag_check" not in cell.get("classes", []):
        return None
    output = cell.children[-1] if cell.children else None
    if output is None or output.get("nb_element") != "cell_code_output":
        return None
    lines = [line.strip() for line in output.astext().splitlines() if line.strip()]
    return lines[0] if lines else None


def visit_fold(self, node):
    classes = " ".join(node["classes"])
    line = _check_line(node)
    said = f'<span class="visually-hidden">: {escape(line)}</span>' if line else ""
    self.body.append(f'<details class="admonition hide {classes}">\n<summary>\n')
    self.body.append(PROMPT.format(state="collapsed", prompt=escape(node["prompt_show"]), said=said))
    self.body.append(PROMPT.format(state="expanded", prompt=escape(node["prompt_hide"]), said=said))
    self.body.append("</summary>\n")


def depart_fold(self, node):
    self.body.append("</details>\n")


_SEARCH_FIELD = re.compile(r'(<button class="btn search-button-field[^"]*"[^>]*?) aria-label="[^"]*"')
_MODE_ICON = re.compile(r'(<i class="theme-switch [^"]*"[^>]*?) title="[^"]*"')


def fix_page(html):
    """The theme's and Sphinx's markup, as written, with the names and roles above."""
    html = _SEARCH_FIELD.sub(r"\1", html)
    html = _MODE_ICON.sub(r"\1", html)
    if 'class="citation-list"' in html:  # Sphinx puts every run of citations in one
        html = html.replace('<div class="citation" id=', '<div class="citation" role="listitem" id=')
        html = re.sub(r'(<div class="citation" role="listitem" id="[^"]*") role="doc-biblioentry"', r"\1", html)
    return html


def wrap_templates(app):
    templates = getattr(app.builder, "templates", None)
    if templates is None or getattr(templates, "_accessible_names", False):
        return
    render = templates.render

    def render_fixed(template, context):
        return fix_page(render(template, context))

    templates.render = render_fixed
    templates._accessible_names = True


def setup(app):
    from myst_nb.sphinx_ import HideCodeCellNode

    app.add_node(HideCodeCellNode, override=True, html=(visit_fold, depart_fold))
    app.connect("builder-inited", wrap_templates)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
