"""Checks of the chapter notebooks as files: the shared setup cell, its Colab branch, figures' alt text, the TOC.

Strict nbval (make test-notebooks) proves each notebook's outputs; these prove what readers rely on around them.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
SETUP = (ROOT / "tools" / "setup_cell.py").read_text()
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())


def cells(path):
    return json.loads(path.read_text())["cells"]


def code_cells(path):
    return [c for c in cells(path) if c["cell_type"] == "code"]


def source(cell):
    return "".join(cell["source"])


def test_every_chapter_is_in_the_toc_and_every_toc_entry_exists():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    listed = [entry["file"] for part in toc["parts"] for entry in part["chapters"]]
    assert [f for f in listed if f.startswith("chapters/")] == [f"chapters/{p.stem}" for p in CHAPTERS]
    for page in listed:
        assert (ROOT / f"{page}.md").is_file() or (ROOT / f"{page}.ipynb").is_file(), page
    assert len(CHAPTERS) == 10


def test_setup_cell_names_the_repository_of_the_config():
    assert f'REPO_URL = "{CONFIG["repository"]["url"]}"' in SETUP
    assert f'BRANCH = "{CONFIG["repository"]["branch"]}"' in SETUP


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_starts_with_the_shared_hidden_setup_cell(path):
    first = code_cells(path)[0]
    assert source(first).strip() == SETUP.strip(), "the setup cell differs from tools/setup_cell.py"
    assert "remove-cell" in first["metadata"].get("tags", [])
    assert "pip install" not in SETUP  # installing over Colab's torch or NumPy breaks its runtime


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_without_the_book_tooling(path):
    text = "\n".join(source(c) for c in code_cells(path))
    assert not re.search(r"^\s*(from|import)\s+myst_nb", text, re.MULTILINE), "Colab has no myst-nb: use lib.notebook.glue"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_has_alt_text(path):
    for i, cell in enumerate(code_cells(path)):
        has_image = any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))
        if has_image:
            alt = cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "")
            assert len(alt) > 20, f"code cell {i} draws a figure without alt text"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_anatomy(path):
    markdown = [source(c) for c in cells(path) if c["cell_type"] == "markdown"]
    assert markdown[0].startswith("# ")
    assert "You will learn" in markdown[0]
    headings = [line for text in markdown for line in text.splitlines() if line.startswith("## ")]
    assert any("Summary" in h for h in headings) and any("Exercises" in h for h in headings)
    hidden = [c for c in code_cells(path) if "hide-cell" in c["metadata"].get("tags", [])]
    assert 2 <= len(hidden) <= 6, "2 to 4 exercises, each with its solution in a hide-cell"


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def course_repository(tmp_path):
    """A git repository holding the course library on branch main, standing in for the public one."""
    repo = tmp_path / "origin"
    shutil.copytree(ROOT / "lib", repo / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    git("init", "--quiet", "--initial-branch", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("-c", "user.name=course", "-c", "user.email=course@example.org", "commit", "--quiet", "-m", "course", cwd=repo)
    return repo


def run_setup_cell(workdir, repo, extra=""):
    env = dict(os.environ, COURSE_REPO_URL=repo.as_uri())
    env.pop("PYTHONPATH", None)
    code = SETUP + "\n" + extra
    return subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )


def test_setup_cell_colab_branch_clones_once_and_imports(course_repository, tmp_path):
    content = tmp_path / "content"  # where Colab runs a notebook: no lib/ anywhere above it
    content.mkdir()
    check = (
        "import lib.attention, numpy as np\n"
        "print(pathlib.Path(lib.attention.__file__).resolve().parent.parent)\n"
        "print(lib.attention.attention(np.eye(2), np.eye(2), np.eye(2)).shape)\n"
    )
    first = run_setup_cell(content, course_repository, check)
    assert first.returncode == 0, first.stderr
    clone = content / "attention-course"
    assert first.stdout.splitlines() == [str(clone.resolve()), "(2, 2)"]
    marker = clone / "lib" / "marker"
    marker.write_text("the second run must not clone again")
    second = run_setup_cell(content, course_repository, check)
    assert second.returncode == 0, second.stderr
    assert marker.exists() and second.stdout.splitlines()[0] == str(clone.resolve())


def test_setup_cell_uses_the_checkout_locally(tmp_path):
    result = run_setup_cell(ROOT / "chapters", tmp_path / "nowhere", "print(ROOT)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(ROOT)
