"""A Sphinx extension of the book: an aside's code inside the aside's box, and an exercise's answer in one fold.

A "Going deeper" aside (README, "Chapter conventions") is a Markdown dropdown, `:::{admonition} Going deeper: ...`
with `:class: dropdown`; its code cells, tagged `deeper`, follow it in the notebook, where Markdown cannot hold
them. On the page they would sit below the closed box as folds of their own, a second and third toggle for one
detour. This moves each code cell tagged `deeper` that directly follows such an aside into its box, with the check
cells that follow that code (they prove the aside), and shows the code open there: opening the aside opens all of
it, one fold. A `deeper` cell with no aside before it keeps its own fold.

An exercise's written answer is the same kind of dropdown, `:::{admonition} Solution`, and its code cells, tagged
`solution`, follow it: they move into its box the same way, with their checks, so that the reasoning, the code
and the checks of one answer open together. A `solution` cell with no written answer before it keeps its own fold.
"""

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

ROLE_OF_TITLE = {"Going deeper": "deeper", "Solution": "solution"}  # a dropdown's title -> the cells it takes in


def aside_role(node):
    """The role of the code cells a dropdown takes in ('deeper' or 'solution'), or None for any other node."""
    if not isinstance(node, nodes.admonition) or "dropdown" not in node.get("classes", []):
        return None
    title = node.next_node(nodes.title)
    text = "" if title is None else title.astext().strip()
    return next((role for start, role in ROLE_OF_TITLE.items() if text.startswith(start)), None)


def is_aside(node):
    return aside_role(node) is not None


def cell_role(node):
    """'deeper', 'solution' or 'check' for a code cell tagged so, else None."""
    if not isinstance(node, nodes.container) or node.get("nb_element") != "cell_code":
        return None
    classes = node.get("classes", [])
    return next((role for role in ("deeper", "solution", "check") if f"tag_{role}" in classes), None)


class CodeIntoAsides(SphinxPostTransform):
    default_priority = 150  # before myst-nb wraps hidden cells in their folds (HideInputCells, 199)
    formats = ("html",)

    def run(self, **kwargs):
        for aside in list(self.document.findall(is_aside)):
            parent, takes = aside.parent, aside_role(aside)
            moved, index = [], parent.index(aside) + 1
            while index < len(parent.children):
                role = cell_role(parent.children[index])
                if role == takes or (role == "check" and moved):
                    moved.append(parent.children[index])
                    index += 1
                else:
                    break
            for cell in moved:
                parent.remove(cell)
                if cell_role(cell) == takes:
                    cell.attributes.pop("hide_mode", None)  # the aside is the fold: its code shows when it opens
                    cell["classes"].append("in-aside")
                aside.append(cell)


def setup(app):
    app.add_post_transform(CodeIntoAsides)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
