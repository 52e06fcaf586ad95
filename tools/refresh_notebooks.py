"""Re-run chapter notebooks top to bottom and store their outputs in a normalised form.

Usage: python tools/refresh_notebooks.py [chapters/NN_slug.ipynb ...]   (no argument: every chapter and guide/)

Each notebook runs in one fresh kernel with chapters/ as the working directory, as the book build and nbval run
it. Afterwards only stable metadata is kept (kernel, language name, the Colab settings), so that a refresh with no
change to the code leaves git with nothing to show, and each cell's role tag (``check``, ``plot``, ``solution``,
``deeper``: ``lib.notebook.ROLES``) is written out as the fold the book shows and the prompts on it.
"""

from __future__ import annotations

import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lib.notebook import ROLES

KEEP_NOTEBOOK_METADATA = ("kernelspec", "language_info", "colab", "accelerator")
KEEP_CELL_METADATA = ("tags", "mystnb")


def normalise(nb):
    nb.metadata = {key: nb.metadata[key] for key in KEEP_NOTEBOOK_METADATA if key in nb.metadata}
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for index, cell in enumerate(nb.cells):
        cell.id = f"cell-{index:03d}"  # stable ids: a regenerated notebook diffs only where its content changed
        cell.metadata = {key: cell.metadata[key] for key in KEEP_CELL_METADATA if key in cell.metadata}
        apply_role(cell)
        if cell.cell_type == "code":
            cell.outputs = merge_streams(cell.get("outputs", []))
            for output in cell.outputs:
                output.get("metadata", {}).pop("execution", None)
    return nb


def apply_role(cell):
    """Give a cell tagged with a role (lib.notebook.ROLES) its fold tag and the prompts the book shows on the fold."""
    tags = cell.metadata.get("tags", [])
    roles = [tag for tag in tags if tag in ROLES]
    if len(roles) > 1:
        raise ValueError(f"cell {cell.id} has two roles: {roles}")
    if not roles:
        return
    fold, show, hide = ROLES[roles[0]]
    others = [tag for tag in tags if not tag.startswith("hide-")]
    cell.metadata["tags"] = [*others, fold]
    prompts = cell.metadata.setdefault("mystnb", {})
    prompts["code_prompt_show"] = show
    prompts["code_prompt_hide"] = hide


def merge_streams(outputs):
    """Consecutive stream outputs of one name as one output: how a cell's prints split depends on timing."""
    merged = []
    for output in outputs:
        last = merged[-1] if merged else None
        same = last is not None and last.output_type == "stream" and last.get("name") == output.get("name")
        if output.output_type == "stream" and same:
            last.text += output.text
        else:
            merged.append(output)
    return merged


def refresh(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    )
    start = time.perf_counter()
    client.execute()
    nbformat.write(normalise(nb), path)
    return time.perf_counter() - start


def main(args):
    default = [*sorted((ROOT / "chapters").glob("*.ipynb")), *sorted((ROOT / "guide").glob("*.ipynb"))]
    paths = [pathlib.Path(a).resolve() for a in args] or default
    for path in paths:
        seconds = refresh(path)
        print(f"refreshed {path.relative_to(ROOT)} in {seconds:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
