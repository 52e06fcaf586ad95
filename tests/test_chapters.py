"""Checks of the chapter notebooks as files: the shared setup cell, its Colab branch, figures' alt text, the TOC,
and the reading convention (README, "Chapter conventions: what a reader sees") that every chapter follows.

Strict nbval (make test-notebooks) proves each notebook's outputs; these prove what readers rely on around them.
The debugging field guide (guide/) is not a chapter, but it is read the same way: it shares the setup cell and the
reading convention, not the chapter anatomy (no exercises).
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from lib.notebook import (
    BUDGET,
    ROLES,
    checks,
    over_budget,
    prose_words,
    reading_minutes,
    reading_surface,
    resolve_constants,
    source_excerpt,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
GUIDES = sorted((ROOT / "guide").glob("*.ipynb"))
READ = CHAPTERS + GUIDES  # every notebook the book shows
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
    assert [f"guide/{p.stem}" for p in GUIDES] == [f for f in listed if f.startswith("guide/")]


def test_setup_cell_names_the_repository_of_the_config():
    assert f'REPO_URL = "{CONFIG["repository"]["url"]}"' in SETUP
    assert f'BRANCH = "{CONFIG["repository"]["branch"]}"' in SETUP


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_chapter_starts_with_the_shared_hidden_setup_cell(path):
    first = code_cells(path)[0]
    assert source(first).strip() == SETUP.strip(), "the setup cell differs from tools/setup_cell.py"
    assert "remove-cell" in first["metadata"].get("tags", [])
    assert "pip install" not in SETUP  # installing over Colab's torch or NumPy breaks its runtime


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_chapter_runs_without_the_book_tooling(path):
    text = "\n".join(source(c) for c in code_cells(path))
    assert not re.search(r"^\s*(from|import)\s+myst_nb", text, re.MULTILINE), "Colab has no myst-nb: use lib.notebook.glue"


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
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
    exercises = exercise_cells(path)
    code_solutions = [c for c in exercises if c["cell_type"] == "code" and "solution" in tags(c)]
    written = [c for c in exercises if c["cell_type"] == "markdown" and SOLUTION_DROPDOWN.search(source(c))]
    assert 2 <= len(code_solutions) + len(written) <= 12, (
        "2 to 6 exercises, each with its solution: a code cell tagged solution or a Solution dropdown"
    )
    previous = None
    for cell in exercises:
        if cell["cell_type"] == "code" and FOLDS & set(tags(cell)):
            assert {"solution", "check"} & set(tags(cell)), (
                f"a folded cell among the exercises is neither a solution nor its check: {first(cell)}"
            )
        if cell["cell_type"] == "code" and "check" in tags(cell):
            # the grading cell of an exercise: it follows the solution it grades and names the exercise
            assert previous is not None and "solution" in tags(previous), f"a check with no solution before it: {first(cell)}"
            assert re.search(r'checks\("exercise \d+', source(cell)), f"an exercise's check names no exercise: {first(cell)}"
        if cell["cell_type"] == "code":
            previous = cell
        if cell["cell_type"] == "code" and "solution" in tags(cell):
            answers = [ln for ln in source(cell).splitlines() if re.match(r"^\s*#\s*answer\b", ln, re.IGNORECASE)]
            assert not answers, f"a written answer as a code comment (write it in a Solution dropdown): {answers[0]}"


# ------------------------------------------------------------------------------------------ the reading convention

FOLDS = {"hide-input", "hide-cell", "hide-output"}
HIDDEN = ("hide-input", "hide-cell", "remove-input", "remove-cell")  # the reader does not see the code at first
NEVER_SHOWN = ("remove-input", "remove-cell")
WIDTH = 88  # chapters/ruff.toml: what fits the book's column at 1,400 px
PLUMBING = re.compile(r"^\s*(assert\b|np\.testing\.|torch\.testing\.|(\w+\s*=\s*)?glue\()")
SOLUTION_DROPDOWN = re.compile(r"^(?::{3,}|`{3,})\s*\{admonition\}\s*Solution.*\n(?:\s*:[\w-]+:.*\n)*?\s*:class:.*\bdropdown\b",
                               re.MULTILINE)


def tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def first(cell):
    return next((ln for ln in source(cell).splitlines() if ln.strip()), "")[:60]


def exercise_cells(path):
    """The cells after the chapter's "## Exercises" heading, up to the next "## " heading."""
    inside, found = False, []
    for cell in cells(path):
        if cell["cell_type"] == "markdown":
            for line in source(cell).splitlines():
                if line.startswith("## "):
                    inside = "exercise" in line.lower()
        if inside:
            found.append(cell)
    return found


def visible_code(path):
    """The code cells whose code a reader sees without opening a fold."""
    return [c for c in code_cells(path) if not any(tag in tags(c) for tag in HIDDEN)]


def code_lines(cell):
    return [ln for ln in source(cell).splitlines() if ln.strip()]


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_no_glue_in_a_cell_the_reader_must_read(path):
    for cell in visible_code(path):
        assert "glue(" not in source(cell), f"glue in a visible cell (move it to a check cell): {first(cell)}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)  # the guide's visible tests are its lesson
def test_checks_are_at_most_five_percent_of_the_visible_code(path):
    lines = [ln for cell in visible_code(path) for ln in code_lines(cell)]
    plumbing = [ln for ln in lines if PLUMBING.match(ln)]
    assert len(plumbing) <= 0.05 * len(lines), (
        f"{len(plumbing)} of {len(lines)} visible code lines are asserts, testing calls or glue "
        f"(at most 5%; fold them into a check cell): {plumbing[:3]}"
    )


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_code_fits_the_column(path):
    for cell in code_cells(path):
        if any(tag in tags(cell) for tag in NEVER_SHOWN):
            continue
        wide = [ln for ln in source(cell).splitlines() if len(ln) > WIDTH]
        assert not wide, f"{len(wide)} lines over {WIDTH} columns scroll sideways in the book, first: {wide[0][:100]}"


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_outputs_print_whole(path):
    for cell in code_cells(path):
        outputs = cell.get("outputs", [])
        stdout = [o for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout"]
        assert len(stdout) <= 1, f"the printed output is split into {len(stdout)} boxes: {first(cell)}"
        lines = code_lines(cell)
        stray = lines and re.match(r"^\s*glue\(", lines[-1])
        results = [o for o in outputs if o.get("output_type") == "execute_result"]
        assert not (stray and results), f"a glue(...) on the last line prints its value: {first(cell)}"


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_every_figure_is_numbered_and_captioned(path):
    for cell in code_cells(path):
        images = [o for o in cell.get("outputs", []) if {"image/png", "image/svg+xml"} & set(o.get("data", {}))]
        if not images or any(tag in tags(cell) for tag in ("remove-output", "remove-cell")):
            continue
        meta = cell["metadata"].get("mystnb", {})
        figure = meta.get("figure", {})
        assert str(figure.get("name", "")).startswith("fig-"), f"a figure without mystnb.figure.name fig-...: {first(cell)}"
        assert len(str(figure.get("caption", "")).strip()) > 10, f"figure {figure['name']} has no caption"
        assert len(meta.get("image", {}).get("alt", "").strip()) > 20, f"figure {figure['name']} has no alt text"


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_an_exercises_written_answer_opens_its_one_fold(path):
    """One fold per answer: a Solution dropdown comes before the exercise's solution cells and their checks, which
    tools/asides.py then draws inside it. Placed after them, the page would show the code and the reasoning as two
    folds, three boxes apart."""
    notebook = cells(path)
    for i, cell in enumerate(notebook):
        if cell["cell_type"] != "markdown" or not source(cell).lstrip().startswith(":::{admonition} Solution"):
            continue
        j = i - 1
        while j >= 0 and notebook[j]["cell_type"] == "code" and "check" in tags(notebook[j]):
            j -= 1
        before = notebook[j] if j >= 0 else {}
        assert "solution" not in tags(before), (
            f"cell {i}: the written answer follows its code ({first(before)!r}); put it before the solution cells"
        )


@pytest.mark.parametrize("path", READ, ids=lambda p: p.stem)
def test_every_fold_has_its_role_and_prompts(path):
    """tools/refresh_notebooks.py writes a role's fold and prompts; a fold without a role says "Show code cell"."""
    for cell in code_cells(path):
        roles = [tag for tag in tags(cell) if tag in ROLES]
        assert len(roles) <= 1, f"a cell with two roles {roles}: {first(cell)}"
        meta = cell["metadata"].get("mystnb", {})
        if not roles:
            assert not FOLDS & set(tags(cell)) or meta.get("code_prompt_show"), (
                f"a fold that would say 'Show code cell' (tag it check, plot, solution or deeper): {first(cell)}"
            )
            continue
        fold, show, hide = ROLES[roles[0]]
        assert fold in tags(cell), f"{roles[0]} cell without its {fold} (refresh the notebook): {first(cell)}"
        assert (meta.get("code_prompt_show"), meta.get("code_prompt_hide")) == (show, hide), (
            f"{roles[0]} cell without its prompts (refresh the notebook): {first(cell)}"
        )


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


# ------------------------------------------------------------------------------------------- the learner's budget


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_fits_a_learners_budget(path):
    """One sitting (issue 22): at most 4,500 words of prose and 260 visible code lines, no visible cell over 25
    lines, at least three numbered, captioned figures. Folded asides, checks, plots and solutions do not count."""
    surface = reading_surface(json.loads(path.read_text()))
    broken = over_budget(surface)
    assert not broken, f"{path.stem} asks too much of a reader in one sitting: " + "; ".join(broken)


def notebook(*cells):
    return {"cells": list(cells)}


def markdown(text):
    return {"cell_type": "markdown", "source": text}


def code(text, tags=(), outputs=(), **mystnb):
    return {"cell_type": "code", "source": text, "metadata": {"tags": list(tags), "mystnb": mystnb},
            "outputs": list(outputs)}


def test_a_check_line_says_what_it_checked(capsys):
    for what, line in (("exercise 3", "✓ 2 checks for exercise 3"), ("on the shapes", "✓ 2 checks on the shapes"),
                       ("", "✓ 2 checks"), ("exercise 3b", "✓ 2 checks exercise 3b")):
        with checks(what) as check:
            check(True)
            check.equal(1, 1)
        assert capsys.readouterr().out == line + "\n"
    with pytest.raises(AssertionError, match="no check"), checks("exercise 1"):
        pass


KERNEL = """\
def loop(x):
    if TMA:  # tensor descriptors
        a = 1
    else:
        # pointers
        a = 2
    if MASKED:
        b = a
        if CAUSAL:
            b = -a
    # the extra multiply
    if not FOLD:
        b = b * 2

    if WINDOWED:
        b = 0
    elif a:
        b = 1
    if a > 1:
        b = 3
    return b
"""


def test_resolve_constants_keeps_the_branch_the_compiler_keeps():
    lines = KERNEL.splitlines()
    assert resolve_constants(lines, {}) == lines
    out = resolve_constants(lines, {"TMA": False, "FOLD": True, "CAUSAL": False})
    assert out == ["def loop(x):", "    # pointers", "    a = 2", "    if MASKED:", "        b = a", "",
                   "    if WINDOWED:", "        b = 0", "    elif a:", "        b = 1", "    if a > 1:", "        b = 3",
                   "    return b"]
    flat = resolve_constants(lines, {"TMA": True, "FOLD": False, "MASKED": True, "CAUSAL": True, "WINDOWED": True})
    assert flat[:7] == ["def loop(x):", "    a = 1", "    b = a", "    b = -a", "    # the extra multiply",
                        "    b = b * 2", ""]
    assert "    if WINDOWED:" in flat  # an elif chain is left as written
    # every kept line is a line of the source, at its own place or dedented by whole levels, in order
    rest = iter(lines)
    for line in flat:
        assert any(line.strip() == other.strip() and (len(other) - len(line)) % 4 == 0 for other in rest), line
    for constants in ({"TMA": 0}, {"MASKED": 1, "CAUSAL": 0}, {"FOLD": 0}):
        code = "\n".join(resolve_constants(lines, constants))
        compile(code, "<resolved>", "exec")  # still Python


def test_source_excerpt_prints_the_default_forward_loop_of_lib_flash():
    import inspect

    from lib import flash

    source = inspect.getsource(flash)
    full = source_excerpt(source, "    for start_n in range(lo, hi, BLOCK_N):", "    return acc, l_i, m_i")
    default = source_excerpt(source, "    for start_n in range(lo, hi, BLOCK_N):", "    return acc, l_i, m_i",
                             TMA=False, FOLD=True, WINDOWED=False, MASKED=False)
    assert "if TMA:" in full and "make_tensor_descriptor" not in default
    assert not re.search(r"if (not )?(TMA|FOLD|WINDOWED|MASKED):", default)
    assert default.count("tl.dot(") == 2 and "exp2(s * qk_scale - m_new" in default
    assert len(default.splitlines()) < len(full.splitlines()) / 2
    with pytest.raises(ValueError, match="no lines"):
        source_excerpt(source, "no such line", "return")


def test_prose_words_leave_out_math_code_and_folded_asides():
    assert prose_words("Attention mixes the values, weighted.") == 5
    assert prose_words("The scores $q \\cdot k$ and\n$$\nS = QK^T\n$$\nthen `softmax(s)` run.") == 5
    assert prose_words("It is {glue:text}`ch1_max` here; see {numref}`fig-x`, and {math}`n^2`.") == 7
    aside = ":::{admonition} Going deeper: a detour\n:class: dropdown\nfour words inside it\n:::\nTwo after."
    assert prose_words(aside) == 2
    shown = ":::{admonition} Note\nthree words shown\n:::\n"
    assert prose_words(shown) == 4  # a box that is not folded is read: its title and its text
    assert prose_words("```python\nx = 1  # not prose\n```\nOne.") == 1


def test_reading_surface_counts_what_a_reader_sees_without_opening_a_fold():
    figure = {"output_type": "display_data", "data": {"image/png": "..."}}
    nb = notebook(
        markdown("# Title\nThen six words of prose here."),
        code("import lib\n\nx = 1\n", ["remove-cell"]),
        code("a = 1\n\nb = 2\nc = 3"),
        code("\n".join(["check(1)"] * 30), ["check", "hide-input"]),
        code("plot()", ["plot", "hide-input"], [figure], figure={"name": "fig-a", "caption": "A caption"}),
        code("plot()", [], [figure], figure={"name": "fig-b", "caption": "Another caption"}),
        code("plot()", [], [figure]),  # an image without a number and a caption is not a figure of the book
        code("chart()", [], [{"output_type": "display_data", "data": {"application/vnd.vegalite.v5+json": {}}}],
             figure={"name": "fig-d", "caption": "An interactive chart"}),
        code("x = 1", [], [], figure={"name": "fig-e", "caption": "A name on a cell that shows nothing"}),
        code("plot()", ["remove-output"], [figure], figure={"name": "fig-c", "caption": "Not shown at all"}),
    )
    surface = reading_surface(nb)
    assert surface == {"prose_words": 7, "visible_code_lines": 8, "longest_visible_cell": 3, "figures": 3}
    assert over_budget(surface) == []
    long = reading_surface(notebook(code("\n".join(["x = 1"] * 26)), markdown("word " * 4501)))
    assert over_budget(long) == [
        "4,501 words of prose (at most 4,500)",
        "26 lines in its longest visible code cell (at most 25)",
        "0 numbered, captioned figures (at least 3)",
    ]
    with pytest.raises(TypeError, match="notebook"):
        reading_surface([])


def test_reading_minutes_follow_the_words_and_the_code():
    assert reading_minutes({"prose_words": 0, "visible_code_lines": 0}) == 5
    assert reading_minutes({"prose_words": 4000, "visible_code_lines": 100}) == 30  # 20 + 10
    assert reading_minutes({"prose_words": 4500, "visible_code_lines": 260}) == 50  # 22.5 + 26, the budget's most
    assert BUDGET == {"prose_words": 4500, "visible_code_lines": 260, "longest_visible_cell": 25, "figures": 3}


# ----------------------------------------------------------------------------- the landing page's chapter map


def chapter_map():
    """tools/chapter_map.py, the Sphinx extension that draws the map (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter_map", ROOT / "tools" / "chapter_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chapter_map_has_every_chapter_and_reads_its_minutes_from_the_notebook():
    extension = chapter_map()
    boxes = {box["number"]: box for box in extension.entries()}
    on_disk = {int(path.stem[:2]): path for path in CHAPTERS}
    assert set(on_disk) <= set(boxes), f"chapters missing from the map in tools/chapter_map.py: {set(on_disk) - set(boxes)}"
    for number, path in on_disk.items():
        expected = extension.reading_minutes(json.loads(path.read_text()))
        assert boxes[number]["minutes"] == expected, f"chapter {number}: the map says {boxes[number]['minutes']} min"
        assert boxes[number]["docname"] == f"chapters/{path.stem}"
    for number, box in boxes.items():
        if number not in on_disk and number is not None:
            assert box["minutes"] is None and box["docname"] is None, f"chapter {number} has no notebook yet"
        for before in box["builds_on"]:
            assert before < (number or 99), f"chapter {number} builds on a later chapter, {before}"
    guide = boxes[None]
    assert guide["minutes"] == extension.reading_minutes(json.loads((ROOT / "guide/debugging.ipynb").read_text()))


def test_the_maps_minutes_count_prose_code_results_figures_and_formulas_at_a_careful_pace():
    """tools/chapter_map.py's PACE: 140 words, 10 code lines and 20 printed lines a minute; a minute a figure, three
    an interactive figure, half a minute a display formula; nothing folded counts."""
    extension = chapter_map()
    assert extension.PACE == {"words": 140, "code_lines": 10, "output_lines": 20, "figure": 1.0, "interactive": 3.0,
                              "formula": 0.5}
    assert extension.reading_minutes(notebook()) == 5
    printed = {"output_type": "stream", "name": "stdout", "text": "a\nb\n\nc\n"}
    chart = {"output_type": "display_data", "data": {"text/html": '<div class="sdpa-interactive"></div>'}}
    image = {"output_type": "display_data", "data": {"image/png": ""}}
    figure = {"name": "fig-x", "caption": "A figure."}
    book = notebook(
        markdown("word " * 1400 + "\n$$x$$\n\n$$y$$\n"),
        code("\n".join(["x = 1"] * 20), outputs=[printed] * 20),  # 20 code lines, 60 printed lines
        code("x", tags=["hide-input", "check"], outputs=[printed] * 40),  # a check's line: not read
        code("plot()", tags=["hide-input", "plot"], outputs=[image], figure=figure),
        code("chart()", tags=["hide-input", "plot"], outputs=[chart], figure=figure),
    )
    load = extension.reading_load(book)
    assert load == {"prose_words": 1400, "visible_code_lines": 20, "output_lines": 60, "figures": 1,
                    "interactive": 1, "formulas": 2}
    # 10 + 2 + 3 + 1 + 3 + 1 = 20 minutes
    assert extension.reading_minutes(book) == 20


def test_the_map_marks_a_short_path_for_two_evenings():
    extension = chapter_map()
    boxes = extension.entries()
    short = [box for box in boxes if extension.on_short_path(box)]
    assert [box["number"] for box in short] == [1, 2, 3, 5, 7, None]
    hours = sum(box["minutes"] for box in short) / 60
    assert 3 <= hours <= 5.5, f"the short path takes {hours:.1f} hours: more than two evenings"
    for narrow in (False, True):
        svg = extension.svg(boxes, href=lambda docname: f"{docname}.html", narrow=narrow)
        assert svg.count("short path</text>") + svg.count("short path · after") == len(short)
    assert "short path" in extension.caption(boxes) and f"about {hours:.1f} hours" in extension.caption(boxes)


def test_each_chapter_has_one_title_in_the_sidebar_the_map_and_the_landing_page_list():
    """The sidebar shows a notebook's '# ' title; the map's box and intro.md's list must show the same words."""
    extension = chapter_map()
    boxes = {box["number"]: box for box in extension.entries() if box["number"]}
    listed = dict(re.findall(r"^(\d+)\. \*\*(.+?)\.\*\*", (ROOT / "intro.md").read_text(), re.MULTILINE))
    for path in CHAPTERS:
        number = int(path.stem[:2])
        title = extension.title_of(json.loads(path.read_text()))
        assert boxes[number]["title"] == title, f"chapter {number}: the map says {boxes[number]['title']!r}"
        assert listed.get(str(number)) == title, f"chapter {number}: intro.md's list says {listed.get(str(number))!r}"
        assert len(textwrap.wrap(f"{number}  {title}", extension.TITLE_CHARS)) <= 2, f"chapter {number}'s title is too long for its box"


def test_landing_page_counts_the_guides_bugs_from_the_guide():
    """intro.md takes the number of the guide's bugs from {guide-bugs}, which counts its numbered headings."""
    extension = chapter_map()
    guide = json.loads((ROOT / "guide/debugging.ipynb").read_text())
    text = "\n".join("".join(cell["source"]) for cell in guide["cells"] if cell["cell_type"] == "markdown")
    numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", text, re.MULTILINE)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 5
    assert extension.guide_bugs() == len(numbers)
    intro = (ROOT / "intro.md").read_text()
    assert "{guide-bugs}`count` bugs" in intro and not re.search(r"\b(ten|eleven|twelve|thirteen|\d+) bugs", intro)


def test_chapter_map_draws_a_linked_box_with_the_minutes_for_each_written_chapter():
    extension = chapter_map()
    boxes = extension.entries()
    svg = extension.svg(boxes, href=lambda docname: f"{docname}.html")
    for box in boxes:
        key = box["number"] or "guide"
        if box["docname"]:
            assert f'href="{box["docname"]}.html"' in svg
            assert f'data-chapter="{key}" data-minutes="{box["minutes"]}"' in svg
            assert f">{box['minutes']} min" in svg
        else:
            assert f'<g data-chapter="{key}" data-minutes="">' in svg
    narrow = extension.svg(boxes, href=lambda docname: f"{docname}.html", narrow=True)
    for box in boxes:
        if box["docname"]:
            assert f">{box['minutes']} min" in narrow
    assert 'class="arrow"' not in narrow and "after 6 and 7" in narrow  # a phone's map says what it follows
    arrows = svg.count('class="arrow"')
    assert arrows == sum(len(box["builds_on"]) for box in boxes) > 10
    assert "<title" in svg and "<desc" in svg  # what the picture says, in words
    total = sum(box["minutes"] for box in boxes if box["number"] and box["minutes"])
    assert f"about {total / 60:.0f} hours" in extension.caption(boxes)
