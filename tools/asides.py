"""A Sphinx extension of the book: an aside's code inside the aside's box.

A "Going deeper" aside (README, "Chapter conventions") is a Markdown dropdown, `:::{admonition} Going deeper: ...`
with `:class: dropdown`; its code cells, tagged `deeper`, follow it in the notebook, where Markdown cannot hold
them. On the page they would sit below the closed box as folds of their own, a second and third toggle for one
detour. This moves each code cell tagged `deeper` that directly follows such an aside into its box, with the check
cells that follow that code (they prove the aside), and shows the code open there: opening the aside opens all of
it, one fold. A `deeper` cell with no aside before it keeps its own fold.
"""

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

TITLE = "Going deeper"


def is_aside(node):
    if not isinstance(node, nodes.admonition) or "dropdown" not in node.get("classes", []):
        return False
    title = node.next_node(nodes.title)
    return title is not None and title.astext().strip().startswith(TITLE)


def cell_role(node):
    """'deeper' or 'check' for a code cell tagged so, else None."""
    if not isinstance(node, nodes.container) or node.get("nb_element") != "cell_code":
        return None
    classes = node.get("classes", [])
    return next((role for role in ("deeper", "check") if f"tag_{role}" in classes), None)


class CodeIntoAsides(SphinxPostTransform):
    default_priority = 150  # before myst-nb wraps hidden cells in their folds (HideInputCells, 199)
    formats = ("html",)

    def run(self, **kwargs):
        for aside in list(self.document.findall(is_aside)):
            parent = aside.parent
            moved, index = [], parent.index(aside) + 1
            while index < len(parent.children):
                role = cell_role(parent.children[index])
                if role == "deeper" or (role == "check" and moved):
                    moved.append(parent.children[index])
                    index += 1
                else:
                    break
            for cell in moved:
                parent.remove(cell)
                if cell_role(cell) == "deeper":
                    cell.attributes.pop("hide_mode", None)  # the aside is the fold: its code shows when it opens
                    cell["classes"].append("in-aside")
                aside.append(cell)


def setup(app):
    app.add_post_transform(CodeIntoAsides)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
