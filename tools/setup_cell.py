# Course setup, the same in every chapter. In the repository it finds lib/ above this
# notebook. Elsewhere (Colab) it clones the course once beside the notebook. It installs
# nothing up front (Colab's own torch, NumPy and matplotlib stay) but checks them
# against the course's floors; where Triton is missing (Colab's CPU runtime), the first
# cell that needs it installs the release this torch is built with (lib/runtime.py).
import importlib
import os
import pathlib
import subprocess
import sys

REPO_URL = "https://github.com/attention-course/scaled-dot-product-attention"
BRANCH = "main"


def course_root():
    here = pathlib.Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "lib" / "attention.py").is_file():
            return folder
    clone = pathlib.Path(os.environ.get("COURSE_CLONE_DIR", here / "attention-course"))
    if not (clone / "lib" / "attention.py").is_file():
        url = os.environ.get("COURSE_REPO_URL", REPO_URL)
        cmd = ["git", "clone", "--quiet", "--depth", "1", "--branch", BRANCH, url]
        subprocess.run([*cmd, str(clone)], check=True)
    return clone


ROOT = str(course_root())
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
importlib.import_module("lib.runtime").check()
