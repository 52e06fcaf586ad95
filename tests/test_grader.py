"""The student editions (tools/make_student.py) and the grader (tools/grade.py), proven both ways.

First on a tiny book whose chapter has two graded exercises, one answered in words and one whose code is not
graded: each rule of the edition, and the grader against official, untouched, broken, tampered, gutted and
endless notebooks. Then on every chapter without running it: each solution is stubbed, each grading cell kept, no
solution text left, student/ and the instructors' table current. Last, the three-way proof on two real chapters,
run whole: a NumPy chapter, and chapter 12, whose kernel exercise runs in Triton's interpreter on a CPU.
"""

import ast
import json
import pathlib
import re
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grade
import make_student as ms

mc = ms.mc

# The chapters the three-way proof runs whole: a NumPy chapter, and the chapter with a Triton kernel exercise.
EXECUTED = ["chapters/04_worked_example.ipynb", "chapters/12_one_merge.ipynb"]


def text(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def md(cid, source):
    return {"cell_type": "markdown", "id": cid, "metadata": {}, "source": source}


def code(cid, source, tags=()):
    return {"cell_type": "code", "id": cid, "metadata": {"tags": list(tags)}, "source": source,
            "execution_count": None, "outputs": []}


SOLUTION, CHECK = ("solution", "hide-cell"), ("check", "hide-input")
CELLS = [
    md("cell-000", "# One\n\nText."),
    code("cell-001", "from lib.notebook import checks"),
    code("cell-002", "x = 3\nprint(x)"),
    md("cell-003", "## Exercises\n\n**1.** Write `double(n)`."),
    code("cell-004", "def double(n):\n    return 2 * n\n\n\nprint(double(4))", SOLUTION),
    code("cell-005", 'with checks("exercise 1") as check:\n    check.equal(double(5), 10)', CHECK),
    md("cell-006", "**2.** Call the sum of 1 to 10 `total`, and say why it is 55."),
    code("cell-007", "import math\n\ntotal = sum(range(1, 11))  # Gauss's pairs\nprint(total, math.pi)", SOLUTION),
    code("cell-008", 'with checks("exercise 2") as check:\n    check.equal(total, 55)', CHECK),
    md("cell-009", ":::{admonition} Solution\n:class: dropdown\nFive pairs that each sum to eleven.\n:::"),
    md("cell-010", "**3.** Why is the sky blue? Print the ratio of blue to red scattering."),
    code("cell-011", "ratio = (700 / 450) ** 4\nprint(ratio)", SOLUTION),
    md("cell-012", "Some words first.\n\n:::{admonition} Solution\n:class: dropdown\nRayleigh scattering.\n:::"),
]


def notebook(cells):
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture()
def book(tmp_path):
    root = tmp_path / "book"
    (root / "chapters").mkdir(parents=True)
    (root / "_config.yml").write_text(yaml.safe_dump({
        "title": "Tiny", "repository": {"url": "https://github.com/org/repo", "branch": "main"},
        "html": {"baseurl": "https://org.github.io/repo/"}}))
    (root / "_toc.yml").write_text(yaml.safe_dump({
        "format": "jb-book", "root": "intro",
        "parts": [{"caption": "Chapters", "numbered": True, "chapters": [{"file": "chapters/01_one"}]}]}))
    (root / "intro.md").write_text("# Intro\n")
    (root / "instructors.md").write_text(f"# For instructors\n\n{ms.TABLE_BEGIN}\nold\n{ms.TABLE_END}\n\nAfter.\n")
    (root / "chapters" / "01_one.ipynb").write_text(json.dumps(notebook(CELLS)))
    return mc.Book(root)


def edition_of(book):
    return ms.edition(book, book.root / "chapters" / "01_one.ipynb")


# ---------------------------------------------------------------------------------------------- the edition


def test_exercises_are_read_from_the_convention(book):
    _, exercises = edition_of(book)
    summary = [(e.number, e.graded, e.names, e.prose) for e in exercises]
    assert summary == [(1, True, ["double"], []), (2, True, ["total"], ["cell-009"]),
                       (3, False, [], ["cell-012"])]


def test_solutions_become_stubs_that_name_what_the_grading_cell_reads(book):
    nb, _ = edition_of(book)
    cells = {c["id"]: c for c in nb["cells"]}
    one, two, three = (text(cells[i]) for i in ("cell-004", "cell-007", "cell-011"))
    assert "uses these names:\n#   double\n" in one and "raise NotImplementedError" in one
    assert "def double(n):" in one and "return 2 * n" not in one and "print" not in one
    assert "import math" in two and "total = ...\n" in two and "sum(range" not in two and "Gauss" not in two
    assert three.startswith("# Exercise 3 is not graded") and "ratio" not in three
    for stub in (one, two, three):
        ast.parse(stub)
        assert max(map(len, stub.splitlines())) <= 88
        assert cells["cell-004"]["metadata"]["tags"] == ["solution", "stub"]
    namespace = {}
    exec(one + "\n" + two, namespace)  # noqa: S102 (an untouched stub runs; its names are placeholders)
    assert namespace["total"] is Ellipsis
    with pytest.raises(NotImplementedError, match="exercise 1: write double"):
        namespace["double"](2)


def test_grading_cells_stay_and_written_answers_go(book):
    nb, _ = edition_of(book)
    cells = {c["id"]: c for c in nb["cells"]}
    for cid, number in (("cell-005", 1), ("cell-008", 2)):
        first, rest = text(cells[cid]).split("\n", 1)
        assert first.startswith(f"# @title Grading cell for exercise {number}")
        assert rest == text(CELLS[int(cid[-3:])])
        assert cells[cid]["metadata"]["tags"] == ["check", "grading"]
    assert "cell-009" not in cells and "cell-012" not in cells
    everything = json.dumps(nb)
    assert "Five pairs" not in everything and "Rayleigh" not in everything
    assert text(cells["cell-009-answer"]).startswith("**Your answer to exercise 2, in words** (not graded)")
    assert text(cells["cell-012-answer"]).startswith("Some words first.\n\n**Your answer to exercise 3")
    assert "Graded exercises: 1, 2. Not graded: 3." in text(nb["cells"][0])
    assert nb["metadata"]["student_edition"] == {"chapter": "chapters/01_one", "graded": [1, 2], "ungraded": [3]}
    assert all(c.get("outputs", []) == [] for c in nb["cells"])


@pytest.mark.parametrize("cells, message", [
    ([md("a", "## Exercises"), code("b", "y = 1", SOLUTION)], "not under an exercise statement"),
    ([md("a", "## Exercises\n\n**1.** Go."), code("b", "y = 1", SOLUTION),
      code("c", 'with checks("exercise 1") as check:\n    check(x == 3)', CHECK)], "reads no name its solution"),
    ([md("a", "## Exercises\n\n**1.** Go."), code("b", "y = 1", SOLUTION), code("c", "assert y == 1", CHECK)],
     "does not use `with checks"),
    ([md("a", "## Exercises\n\n**1.** Go.\n\n**1.** Again.")], "used twice"),
])
def test_what_breaks_the_convention_is_an_error(cells, message):
    with pytest.raises(ms.StudentError, match=message):
        ms.find_exercises(notebook(cells), "chapters/01_one")


def test_the_table_of_exercises_is_written_between_its_markers(book):
    table = ms.exercise_table(book)
    assert table.splitlines()[2] == "| [1. One](chapters/01_one.ipynb) | 1: `double`; 2: `total` | none | 3 |"
    page = book.root / "instructors.md"
    assert ms.write_table(page, table) and not ms.write_table(page, table)
    assert page.read_text() == f"# For instructors\n\n{ms.TABLE_BEGIN}\n{table}\n{ms.TABLE_END}\n\nAfter.\n"


# ---------------------------------------------------------------------------------------------- the grader


def submit(folder, student, nb, name="01_one.ipynb"):
    (folder / student).mkdir(parents=True, exist_ok=True)
    (folder / student / name).write_text(json.dumps(nb))


def test_the_grader_scores_each_exercise_by_its_official_grading_cell(book, tmp_path, capsys):
    official = grade.Official(book.root)
    student, _ = edition_of(book)
    folder = tmp_path / "handed-in"
    submit(folder, "official", notebook(CELLS))
    submit(folder, "untouched", student)
    broken = json.loads(json.dumps(CELLS))
    broken[7]["source"] = "total = sum(range(10))"  # exercise 2 answered wrong: 45
    submit(folder, "broken", notebook(broken))
    tampered = json.loads(json.dumps(student))
    for cell in tampered["cells"]:
        if "grading" in cell["metadata"].get("tags", []):
            cell["source"] = "checks = None\nprint('✓ passed')"  # a grading cell that checks nothing
    submit(folder, "tampered", tampered)
    gutted = {**student, "cells": [c for c in student["cells"] if c["id"] != "cell-008"]}
    submit(folder, "gutted", notebook(CELLS[:8]), name="gutted_01_one.ipynb")  # no grading cell 2
    (folder / "flat_01_one.ipynb").write_text(json.dumps(gutted))
    no_ids = {**student, "nbformat_minor": 4, "cells": [{k: v for k, v in c.items() if k != "id"}
                                                        for c in student["cells"]]}
    for cell in no_ids["cells"]:
        if "NotImplementedError" in text(cell):
            cell["source"] = "def double(n):\n    return n + n"  # exercise 1 answered right, from an editor
    submit(folder, "no_ids", no_ids)
    results = {r.student: r for r in (grade.grade(p, folder, official, timeout=120, cell_timeout=60)
                                      for p in grade.submissions(folder))}
    assert {name: r.scores for name, r in results.items()} == {
        "official": {1: 1, 2: 1}, "untouched": {1: 0, 2: 0}, "broken": {1: 1, 2: 0},
        "tampered": {1: 0, 2: 0}, "gutted": {1: 1, 2: 0}, "flat": {1: 0, 2: 0}, "no_ids": {1: 1, 2: 0},
    }
    assert results["broken"].reasons == {2: "AssertionError: 45 != 55"}
    assert results["untouched"].reasons[1] == "NotImplementedError: exercise 1: write double"
    assert results["gutted"].reasons == {2: "grading cell missing"}
    assert results["official"].cpu_seconds > 0
    header, rows = grade.table(list(results.values()))
    assert header == ["student", "1.1", "1.2", "total"]
    assert ["official", "1", "1", "2/2"] in rows and ["broken", "1", "0", "1/2"] in rows


def test_a_notebook_that_runs_too_long_scores_what_it_reached(book, tmp_path):
    cells = json.loads(json.dumps(CELLS))
    cells[7]["source"] = "import time\n\nwhile True:\n    time.sleep(0.1)"
    folder = tmp_path / "handed-in"
    submit(folder, "slow", notebook(cells))
    result = grade.grade(folder / "slow" / "01_one.ipynb", folder, grade.Official(book.root), timeout=30,
                         cell_timeout=4)
    assert result.scores == {1: 1, 2: 0} and result.reasons == {2: "not run: time limit"}


def test_the_grader_command_grades_every_readable_notebook_once(book, tmp_path, capsys):
    folder = tmp_path / "handed-in"
    submit(folder, "ada", notebook(CELLS))
    submit(folder, "ada", notebook(CELLS), name="copy_01_one.ipynb")  # ada's second copy of chapter 1
    (folder / "grace").mkdir()
    (folder / "grace" / "01_one.ipynb").write_text("{not json")
    csv_path = tmp_path / "scores.csv"
    assert grade.main([str(folder), "--course", str(book.root), "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("student  1.1  1.2  total\n------------------------\nada        1    1    2/2\n")
    assert "Not graded" in out and "a second notebook of chapters/01_one from ada" in out
    assert "grace/01_one.ipynb" in out
    assert csv_path.read_text().splitlines() == ["student,1.1,1.2,total", "ada,1,1,2/2"]


def test_the_grader_command_prints_the_table_and_refuses_bad_input(tmp_path, capsys):
    assert grade.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert grade.main([str(tmp_path / "empty")]) == 2
    assert "no notebook" in capsys.readouterr().err
    header, rows = ["student", "11.1", "total"], [["ada", "1", "1/1"], ["grace", "0", "0/1"]]
    assert grade.render(header, rows).splitlines() == [
        "student  11.1  total", "--------------------", "ada         1    1/1", "grace       0    0/1"]


# ---------------------------------------------------------------------------------------------- every chapter

BOOK = mc.Book(ROOT)
CHAPTERS = BOOK.chapters


def solution_lines(source):
    """The lines of an answer that a stub must not keep: all but blank lines, comments, imports and signatures."""
    keep = re.compile(r"^\s*(#|import |from \S+ import |@|def |class |$)")
    return {line.strip() for line in source.splitlines() if not keep.match(line)}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_edition_is_stubbed_graded_and_leak_free(path):
    nb, exercises = ms.edition(BOOK, path)
    original = mc.read_notebook(path)
    cells = {c["id"]: c for c in nb["cells"]}
    originals = {c["id"]: c for c in original["cells"]}
    answers = {cid for e in exercises for cid in [*e.solutions, *e.prose]}
    tagged = {c["id"] for c in original["cells"] if "solution" in c["metadata"].get("tags", [])}
    assert tagged <= answers, "a solution cell outside any exercise"
    elsewhere = "\n".join(text(c) for c in original["cells"] if c["id"] not in answers)
    edition_text = "\n".join(text(c) for c in nb["cells"])
    for exercise in exercises:
        for cid in exercise.solutions:
            assert cells[cid]["metadata"]["tags"] == ["solution", "stub"]
            leaked = {line for line in solution_lines(text(originals[cid])) if line in edition_text}
            assert leaked <= {line for line in leaked if line in elsewhere}, f"exercise {exercise.number} leaks"
            ast.parse(text(cells[cid]))
            assert max(map(len, text(cells[cid]).splitlines())) <= 88, "a stub wider than 88 columns"
        for cid in exercise.prose:
            block = "".join(m.group(0) for m in ms.SOLUTION_BLOCK.finditer(text(originals[cid])))
            body = [line for line in block.splitlines()[1:-1] if line.strip() and not line.startswith(":")]
            assert body and not [line for line in body if line in edition_text and line not in elsewhere]
        if exercise.graded:
            kept = text(cells[exercise.check]).split("\n", 1)[1]
            assert kept == text(originals[exercise.check]), f"exercise {exercise.number}'s grading cell changed"
            for name in exercise.names:
                assert name in text(cells[exercise.solutions[-1]]) or any(
                    name in text(cells[s]) for s in exercise.solutions)
    assert nb["metadata"]["student_edition"]["graded"] == [e.number for e in exercises if e.graded]


def test_the_committed_student_editions_are_current():
    for path in CHAPTERS:
        nb, _ = ms.edition(BOOK, path)
        committed = ROOT / "student" / "chapters" / path.name
        assert committed.exists(), f"no student edition of {path.name}: run `make student`"
        assert committed.read_text() == mc.dumps(nb), f"student/chapters/{path.name} is stale: run `make student`"
    names = sorted(p.name for p in (ROOT / "student" / "chapters").glob("*.ipynb"))
    assert names == [p.name for p in CHAPTERS], "student/chapters has an edition of a chapter that is gone"


def test_the_instructors_page_lists_the_graded_exercises_as_the_chapters_have_them():
    page = (ROOT / "instructors.md").read_text()
    between = page.split(ms.TABLE_BEGIN, 1)[1].split(ms.TABLE_END, 1)[0].strip()
    assert between == ms.exercise_table(BOOK), "instructors.md's exercise table is stale: run `make student`"
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    reference = next(part for part in toc["parts"] if part["caption"] == "Reference")
    assert {"file": "instructors"} in reference["chapters"]


def test_the_instructors_page_times_every_chapter_and_says_which_ask_for_a_gpu():
    page = (ROOT / "instructors.md").read_text()
    rows = re.findall(r"^\| \[\d+\. [^]]*\]\((chapters/\w+\.ipynb)\) \| (CPU|GPU optional) \| \d+ \| \d+ \|$", page,
                      re.MULTILINE)
    assert [path for path, _ in rows] == [p.relative_to(ROOT).as_posix() for p in CHAPTERS]
    for path, runtime in rows:
        asks = mc.read_notebook(ROOT / path).get("metadata", {}).get("accelerator") == "GPU"
        assert (runtime == "GPU optional") == asks, f"{path}: the page says {runtime}"


# ---------------------------------------------------------------------------------------------- run whole


@pytest.mark.parametrize("chapter", EXECUTED)
def test_three_ways_full_marks_none_and_exactly_the_broken_one(chapter, tmp_path):
    """The official chapter scores every graded exercise, its untouched student edition none, and the official
    chapter with one answer replaced by its stub loses exactly that exercise."""
    path = ROOT / chapter
    nb, exercises = ms.edition(BOOK, path)
    graded = [e for e in exercises if e.graded]
    assert graded, f"{chapter} has no graded exercise"
    victim = graded[-1]
    broken = mc.read_notebook(path)
    for cell in broken["cells"]:
        if cell["id"] in victim.solutions:
            cell["source"] = ms.stub(chapter, victim, text(cell))
    folder = tmp_path / "handed-in"
    submit(folder, "official", mc.read_notebook(path), name=path.name)
    submit(folder, "untouched", nb, name=path.name)
    submit(folder, "broken", broken, name=path.name)
    official = grade.Official(ROOT)
    scores = {r.student: r.scores for r in (grade.grade(p, folder, official, timeout=600, cell_timeout=300)
                                            for p in grade.submissions(folder))}
    every = [e.number for e in graded]
    assert scores == {
        "official": dict.fromkeys(every, 1),
        "untouched": dict.fromkeys(every, 0),
        "broken": {n: int(n != victim.number) for n in every},
    }
