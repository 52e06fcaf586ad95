"""The student editions (tools/make_student.py) and the grader (tools/grade.py), proven both ways.

First on a tiny book whose chapter has two graded exercises, one answered in words and one whose code is not
graded: each rule of the edition, then the grader's hidden tests, its sandbox and its limits against official,
untouched, wrong, hard-coded, patched, endless, memory-hungry, self-killing, file-reading and networking notebooks,
and its reports (score CSV, feedback, gradebook). Then on every chapter without running it: each solution is
stubbed, each grading cell kept, no solution text left, student/ and the instructors' table current, every hidden
test matched to its exercise and every graded exercise to a hidden test. Last, the proof on three kinds of real
chapter, run whole in the sandbox: chapter 4 (NumPy), chapter 9 (a Triton kernel in the interpreter, an autograd
function) and chapters 10 and 11 (a Triton kernel, training a model): the official solutions and independently
written correct ones get full marks, typical mistakes and every cheat score 0 on what they touch and nothing else.
The other chapters' proofs are tests/test_grader_chNN.py.
"""

import ast
import inspect
import json
import pathlib
import re
import sys

import numpy as np
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grade
import grading_specs as gs
import lab_kernels
import make_student as ms
from grading_helpers import (
    BOOK,
    CHAPTERS,
    OFFICIAL,
    by_chapter,
    grade_chapter,
    located,
    official_answers,
    submission,
    submit,
    text,
)

mc = ms.mc



def md(cid, source):
    return {"cell_type": "markdown", "id": cid, "metadata": {}, "source": source}


def code(cid, source, tags=()):
    return {"cell_type": "code", "id": cid, "metadata": {"tags": list(tags)}, "source": source,
            "execution_count": None, "outputs": []}


SOLUTION, CHECK = ("solution", "hide-cell"), ("check", "hide-input")
CELLS = [
    md("cell-000", "# One\n\nText."),
    code("cell-001", "from lib.notebook import checks"),
    code("cell-002", "x = 3\ntop = 10\nprint(x)"),
    md("cell-003", "## Exercises\n\n**1.** Write `double(n)`."),
    code("cell-004", "def double(n):\n    return 2 * n\n\n\nprint(double(4))", SOLUTION),
    code("cell-005", 'with checks("exercise 1") as check:\n    check.equal(double(5), 10)', CHECK),
    md("cell-006", "**2.** Call the sum of 1 to `top` `total`, and say why it is 55."),
    code("cell-007", "import math\n\ntotal = sum(range(1, top + 1))  # Gauss's pairs\nprint(total, math.pi)",
         SOLUTION),
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

# The tiny book's hidden tests: double(n) called on four hidden numbers; the sum of 1 to a hidden `top`.
TINY_SPECS = [
    gs.Spec(label="one/double", title="Write `double(n)`", rerun=False,
            make=lambda rng, p: {"ns_h": [int(v) for v in rng.integers(-50, 50, 4)]},
            expect=lambda i, p: {"doubled_h": [2 * n for n in i["ns_h"]]},
            harness="doubled_h = [double(n) for n in ns_h]\n",
            compare={"doubled_h": gs.Close(0, 0, "four doubled numbers")}),
    gs.Spec(label="one/total", title="Call the sum of 1 to", draws=2,
            make=lambda rng, p: {"top": int(rng.integers(20, 99))},
            expect=lambda i, p: {"total": i["top"] * (i["top"] + 1) // 2},
            compare={"total": gs.Whole("the sum of 1 to top")}),
]
FAST = grade.Limits(timeout=60, cell_timeout=3, memory_gb=2, grace=2)


def answered(nb, answers, drop=(), add=()):
    """A copy of a notebook with the given cells' sources replaced, cells dropped, and (after id, source) added."""
    nb = json.loads(json.dumps(nb))
    cells = []
    for cell in nb["cells"]:
        if cell.get("id") in drop:
            continue
        if cell.get("id") in answers:
            cell["source"] = answers[cell["id"]]
        cells.append(cell)
        cells += [code(f"{cell.get('id')}-{k}", extra) for k, (after, extra) in enumerate(add) if after == cell.get("id")]
    return {**nb, "cells": cells}


def grade_all(folder, official, limit=FAST, seed=7):
    return {r.student: r for r in (grade.grade(p, folder, official, seed, limit) for p in grade.submissions(folder))}


PATCH = ("import contextlib\nimport lib.notebook\n\n\n@contextlib.contextmanager\ndef lenient(what=''):\n"
         "    class Anything:\n        def __getattr__(self, name):\n            return lambda *a, **k: None\n"
         "    try:\n        yield Anything()\n    except Exception:\n        pass\n    print('✓ passed')\n\n\n"
         "lib.notebook.checks = lenient\nchecks = lenient")


def test_hidden_tests_score_what_was_solved_and_nothing_else(book, tmp_path):
    official = grade.Official(book.root, TINY_SPECS)
    student, _ = edition_of(book)
    folder = tmp_path / "handed-in"
    submit(folder, "official", notebook(CELLS))
    submit(folder, "untouched", student)
    submit(folder, "wrong", answered(notebook(CELLS), {"cell-007": "total = sum(range(top))"}))
    submit(folder, "typed", answered(notebook(CELLS), {"cell-007": "total = 55  # the number the chapter prints"}))
    submit(folder, "copied", answered(notebook(CELLS), {"cell-007": "total = 55 + 0 * x"}))
    patched = answered(student, {}, add=[("cell-001", PATCH)])
    for cell in patched["cells"]:
        if "grading" in cell["metadata"].get("tags", []):
            cell["source"] = "print('✓ 1 check for exercise')"  # and every grading cell says it passed
    submit(folder, "patched", patched)
    submit(folder, "patched_but_right", answered(notebook(CELLS), {}, add=[("cell-001", PATCH)]))
    submit(folder, "gutted", answered(notebook(CELLS), {}, drop={"cell-005", "cell-008"}))  # no grading cells
    no_ids = {**student, "nbformat_minor": 4, "cells": [{k: v for k, v in c.items() if k != "id"}
                                                        for c in student["cells"]]}
    for cell in no_ids["cells"]:
        if "NotImplementedError" in text(cell):
            cell["source"] = text(cell).replace("raise NotImplementedError('exercise 1: write double')", "return n + n")
    submit(folder, "no_ids", no_ids)
    results = grade_all(folder, official)
    assert {name: r.scores for name, r in results.items()} == {
        "official": {1: 1, 2: 1}, "untouched": {1: 0, 2: 0}, "wrong": {1: 1, 2: 0}, "typed": {1: 1, 2: 0},
        "copied": {1: 1, 2: 0}, "patched": {1: 0, 2: 0}, "patched_but_right": {1: 1, 2: 1},
        "gutted": {1: 1, 2: 1}, "no_ids": {1: 1, 2: 0},
    }
    assert results["untouched"].reasons[1].startswith("NotImplementedError: exercise 1: write double (exercise 1")
    assert results["untouched"].reasons[2] == "`total`: expected the sum of 1 to top, got `...` (not answered yet)"
    assert results["wrong"].reasons == {2: "`total`: not the sum of 1 to top for these inputs"}
    assert results["official"].cpu_seconds > 0 and results["official"].titles == {1: "one/double", 2: "one/total"}
    header, rows = grade.table(list(results.values()))
    assert header == ["student", "1.1", "1.2", "total"]
    assert ["official", "1", "1", "2/2"] in rows and ["wrong", "1", "0", "1/2"] in rows


STOPS = {
    "sleeps": ({"cell-004": "import time\n\ntime.sleep(10**6)\n\n\ndef double(n):\n    return 2 * n"}, 1),
    "stubborn": ({"cell-007": "import time\n\nwhile True:\n    try:\n        time.sleep(1)\n"
                              "    except BaseException:\n        pass"}, 2),
    "hungry": ({"cell-004": "blob = bytearray(64 * 2**30)\n\n\ndef double(n):\n    return 2 * n"}, 1),
    "killer": ({"cell-007": "import os\n\nos.kill(os.getpid(), 9)"}, 2),
    "exits": ({"cell-004": "import sys\n\nsys.exit(0)\n\n\ndef double(n):\n    return 2 * n"}, 1),
    "exits_hard": ({"cell-007": "import os\n\nos._exit(0)"}, 2),
    "recursion": ({"cell-004": "def double(n):\n    return double(n) * 2"}, 1),
}


def test_a_cell_that_will_not_stop_or_ends_the_process_costs_its_exercise_only(book, tmp_path):
    official = grade.Official(book.root, TINY_SPECS)
    folder = tmp_path / "handed-in"
    for name, (answers, _) in STOPS.items():
        submit(folder, name, answered(notebook(CELLS), answers))
    results = grade_all(folder, official)
    for name, (_, broken) in STOPS.items():
        assert results[name].scores == {n: int(n != broken) for n in (1, 2)}, (name, results[name].reasons)
    reasons = {name: results[name].reasons[broken] for name, (_, broken) in STOPS.items()}
    assert reasons["sleeps"].startswith("TimeLimit") and "exercise 1, your cell 1, line 3" in reasons["sleeps"]
    assert reasons["stubborn"].startswith("time limit in exercise 2, your cell 1")
    assert reasons["hungry"].startswith("MemoryError") and "line 1" in reasons["hungry"]
    assert reasons["killer"].startswith("killed") and "`os._exit`" in reasons["exits_hard"]
    assert reasons["exits"].startswith("SystemExit")
    assert reasons["recursion"].startswith("RecursionError")
    assert max(r.seconds for r in results.values()) < 40


def test_the_sandbox_keeps_the_course_the_submissions_and_the_network_out(book, tmp_path):
    official = grade.Official(book.root, TINY_SPECS)
    folder = tmp_path / "handed-in"
    solution = book.root / "chapters" / "01_one.ipynb"
    tries = {
        "reads": f"import shutil\n\nshutil.copyfile({str(solution)!r}, 'mine.ipynb')\ntotal = sum(range(1, top + 1))",
        "lists": f"import os\n\nos.listdir({str(folder)!r})\ntotal = sum(range(1, top + 1))",
        "opens": f"total = len(open({str(solution)!r}).read())",
        "calls": "import http.client\n\nhttp.client.HTTPConnection('192.0.2.1', 80, timeout=2).connect()\n"
                 "total = sum(range(1, top + 1))",
        "spawns": "import shutil\n\nshutil.which('ls')\nimport os\n\nos.posix_spawn('/bin/ls', ['ls'], {})\n"
                  "total = sum(range(1, top + 1))",
        "evals": "total = eval('sum(range(1, top + 1))')",
        # what multiprocessing calls to start a process (chapter 12's ring.launch), without an audit event
        "launches": "import _posixsubprocess\n\n_posixsubprocess.fork_exec()\ntotal = sum(range(1, top + 1))",
        "plans": "import __main__\n\ntotal = __main__.PLAN and sum(range(1, top + 1))",  # the runner's own plan
    }
    for name, answer in tries.items():
        submit(folder, name, answered(notebook(CELLS), {"cell-007": answer}))
    results = grade_all(folder, official)
    assert {name: r.scores for name, r in results.items()} == {name: {1: 1, 2: 0} for name in tries}
    why = {name: r.reasons[2] for name, r in results.items()}
    assert why["reads"].startswith("PermissionError: a graded notebook may not read") and "line 3" in why["reads"]
    assert why["lists"].startswith("PermissionError: a graded notebook may not read")
    assert why["opens"].startswith("your answer uses `open`") and why["evals"].startswith("your answer uses `eval`")
    assert why["calls"].startswith("PermissionError: a graded notebook may not use socket")
    assert why["spawns"].startswith("PermissionError: a graded notebook may not use os.posix_spawn")
    assert why["launches"].startswith("PermissionError: a graded notebook may not start processes")
    assert why["plans"] == "your answer uses `__main__`, which this exercise does not allow (it asks you to write " \
                           "that part yourself)"
    nb = answered(notebook(CELLS), {"cell-007": tries["plans"]})
    edition, exercises, specs = official.edition("chapters/01_one")
    plan = grade.build_plan(nb, edition, exercises, specs, {}, FAST)
    assert "raise PermissionError('not run: the cell uses __main__')" in [c["source"] for c in plan["cells"]]


def test_the_words_an_answer_may_not_use_are_found_in_code_not_in_comments():
    spec = gs.Spec(label="x", title="x", make=None, expect=None, compare={},
                   forbidden=("lib.attention.attention_weights",), banned=("@", "np.exp"))
    assert grade.banned_words(["w = attn.attention_weights(q, k)  # eval in a comment"], spec) == [
        "attention_weights"]
    assert grade.banned_words(["s = q @ k.T", "e = np.exp(s)", "f = getattr(np, 'exec')"], spec) == [
        "@", "exec", "getattr", "np.exp"]
    assert grade.banned_words(["import math\nw = [math.exp(s) for s in raw]  # not np.exp"], spec) == []


def test_answers_are_compared_by_value_in_any_container_or_precision():
    close, whole = gs.Close(1e-5, 1e-7, "weights"), gs.Whole("a count")
    want = np.array([0.2927, 0.3231, 0.3842])
    for good in (want.tolist(), want.astype(np.float32), want.reshape(1, 3), tuple(want)):
        assert grade.compare("w", close, grade.decode_answer(good) if isinstance(good, dict) else good, want, {},
                             {}) is None
    for count in (6728, 6728.0, np.int64(6728), np.array(6728)):
        assert grade.compare("n", whole, count, 6728, {}, {}) is None
    assert grade.compare("n", whole, 6727.43, 6728, {}, {}) == "`n`: expected a count, got an object of type float"
    message = grade.compare("w", close, want[::-1], want, {}, {})
    assert message == "`w`: expected weights, to rtol=1e-05, atol=1e-07; 2 of 3 differ on the hidden inputs"
    assert "0.29" not in message
    assert grade.compare("w", close, want[:2], want, {}, {}).endswith("shape (3,); yours has shape (2,)")


def test_the_grader_command_writes_scores_feedback_and_a_gradebook(book, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(grade.gs, "SPECS", TINY_SPECS)
    folder = tmp_path / "handed-in"
    submit(folder, "ada", notebook(CELLS))
    submit(folder, "ada", notebook(CELLS), name="copy_01_one.ipynb")  # ada's second copy of chapter 1
    submit(folder, "grace", answered(notebook(CELLS), {"cell-007": "total = 55"}))
    (folder / "linus").mkdir()
    (folder / "linus" / "01_one.ipynb").write_text("{not json")
    (tmp_path / "points.csv").write_text("exercise,points\n1.1,2\none/total,3\n")
    (tmp_path / "roster.csv").write_text("folder,name,id,sis_user_id,email\nada,Ada L,17,a17,ada@uni.edu\n")
    out = tmp_path / "out"
    assert grade.main([str(folder), "--course", str(book.root), "--seed", "5", "-j", "2", "--points",
                       str(tmp_path / "points.csv"), "--csv", str(out / "scores.csv"), "--feedback", str(out / "fb"),
                       "--lms", "canvas", "--gradebook", str(out / "canvas.csv"), "--roster",
                       str(tmp_path / "roster.csv"), "--timeout", "60", "--cell-timeout", "5"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("student  1.1  1.2  total\n------------------------\nada        2    3    5/5\n"
                                  "grace      2    0    2/5\n")
    assert "a second notebook of chapters/01_one from ada" in printed.out and "linus/01_one.ipynb" in printed.out
    assert "with seed 5" in printed.err
    assert (out / "scores.csv").read_text().splitlines() == ["student,1.1,1.2,total", "ada,2,3,5/5", "grace,2,0,2/5"]
    feedback = (out / "fb" / "grace.md").read_text()
    assert "## Chapter 1 (01_one): 2 of 5 points" in feedback
    assert "- Exercise 2 (one/total): 0/3. `total`: not the sum of 1 to top for these inputs" in feedback
    assert "- Exercise 1 (one/double): 2/2, passed on hidden inputs." in feedback
    assert (out / "canvas.csv").read_text().splitlines() == [
        "Student,ID,SIS User ID,SIS Login ID,Section,Chapter 1 exercises",
        "    Points Possible,,,,,5", "Ada L,17,a17,,,5", "grace,,grace,,,2"]


def test_a_variant_changes_the_statement_and_the_hidden_answers():
    path = ROOT / "chapters" / "04_worked_example.ipynb"
    plain, exercises = ms.edition(BOOK, path)
    variant, _ = ms.edition(BOOK, path, variant="two-thirds")
    statement = next(e.statement for e in exercises if e.number == 2)
    words = {nb_id: text(next(c for c in nb["cells"] if c["id"] == statement)) for nb_id, nb in
             (("plain", plain), ("variant", variant))}
    assert "more than half of its attention" in words["plain"] and "two thirds" not in words["plain"]
    assert "more than two thirds of its attention" in words["variant"]
    spec = next(s for s in gs.SPECS if s.label == "worked-example/longer-query")
    drawn = grade.draw(3, "ada", spec, None) + grade.draw(3, "ada", spec, "two-thirds")
    half, thirds = drawn[:spec.draws], drawn[spec.draws:]
    assert [i["Q"].tolist() for i, _ in half] == [i["Q"].tolist() for i, _ in thirds]  # the same inputs
    assert all(spec.expect(*a)["c"] < spec.expect(*b)["c"] for a, b in zip(half, thirds))  # other answers
    assert grade.draw(3, "ada", spec, None)[0][0]["Q"].tolist() != grade.draw(3, "bob", spec, None)[0][0]["Q"].tolist()


def test_the_book_without_solutions_keeps_statements_and_checks_and_drops_every_answer(book, tmp_path):
    written = ms.book_without_solutions(tmp_path / "term", book.root)
    assert written == [tmp_path / "term" / "chapters" / "01_one.ipynb"]
    assert (tmp_path / "term" / "_toc.yml").exists() and (tmp_path / "term" / "intro.md").exists()
    cells = {c["id"]: c for c in json.loads(written[0].read_text())["cells"]}
    everything = json.dumps(list(cells.values()))
    assert "return 2 * n" not in everything and "Five pairs" not in everything and "Rayleigh" not in everything
    assert "raise NotImplementedError" in text(cells["cell-004"]) and cells["cell-004"]["outputs"] == []
    assert text(cells["cell-005"]) == text(CELLS[5]) and "cell-009" not in cells
    assert text(cells["cell-012"]) == "Some words first.\n"
    with pytest.raises(ms.StudentError, match="outside the course checkout"):
        ms.book_without_solutions(book.root / "inside", book.root)


def test_the_grader_command_refuses_bad_input(tmp_path, capsys):
    assert grade.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert grade.main([str(tmp_path / "empty")]) == 2
    assert "no notebook" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path / "empty"), "--lms", "canvas"])
    header, rows = ["student", "11.1", "total"], [["ada", "1", "1/1"], ["grace", "0", "0/1"]]
    assert grade.render(header, rows).splitlines() == [
        "student  11.1  total", "--------------------", "ada         1    1/1", "grace       0    0/1"]


# ---------------------------------------------------------------------------------------------- every chapter

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




def test_every_graded_exercise_has_one_hidden_test_and_every_hidden_test_one_exercise():
    matched, untested = {}, []
    for path in CHAPTERS:
        doc = mc.docname(BOOK, path)
        _, exercises, specs = OFFICIAL.edition(doc)
        untested += [f"{OFFICIAL.label(doc)}.{e.number}" for e in exercises if e.graded and e.number not in specs]
        for number, spec in specs.items():
            assert spec.label not in matched, f"{spec.label} matches {matched.get(spec.label)} and {doc}"
            matched[spec.label] = f"{doc} exercise {number}"
            assert set(spec.answers) >= set(spec.compare)
    assert set(matched) == {s.label for s in gs.SPECS}, "a hidden test matches no exercise"
    assert untested == [], "graded exercises without a hidden test"
    assert {"worked-example/without-scaling", "worked-example/longer-query", "worked-example/keys-from-weights",
            "worked-example/row-by-hand"} <= set(matched)


# ---------------------------------------------------------------------------------------------- run whole

# Submissions to three kinds of chapter, as a class would hand them in: the student edition with answers in place of
# the stubs, by exercise number (today's numbers; the hidden tests find their exercise by its title). `None` keeps
# the stub; "official" puts back the chapter's own solution; (old, new) is the official solution with one slip.
CH4_CORRECT = {  # written from the statements, not from the solutions: torch float32, a while loop, lists
    1: "import torch\n\nscores_A = torch.tensor(Q[0], dtype=torch.float32) @ torch.tensor(K.T, "
                "dtype=torch.float32)\nunscaled_A = torch.softmax(scores_A, dim=0)",
    2: "c = np.int64(1)\nwhile True:\n    s = (c * Q[0]) @ K.T / np.sqrt(d_k)\n    w = np.exp(s - s.max())\n"
                "    w = w / w.sum()\n    if w[0] > 0.5:\n        break\n    c += 1",
    3: "def recover_east(s_AA, rounded, d_k):\n    return [s_AA + d_k**0.5 * math.log(r / rounded[0]) "
                "for r in rounded]\n\n\neast = recover_east(0.8, (0.37, 0.32, 0.31), d_k)\n"
                "shifted = attn.attention_weights(Q[:1], K + [0.3, 0])[0]",
    4: "qB = [float(v) for v in Q[1]]\nraw_B = []\nfor key in K.tolist():\n"
                "    raw_B.append(sum(a * b for a, b in zip(qB, key)))\nscale = 1 / math.sqrt(len(qB))\n"
                "exps = [math.exp(r * scale) for r in raw_B]\nweights_B = [e / sum(exps) for e in exps]\n"
                "out_B = [sum(wt * row[j] for wt, row in zip(weights_B, V.tolist())) for j in range(2)]",
}
CH4_MISTAKES = {  # softmax over the wrong axis, c without the scale, a sign slip, the scale forgotten
    1: "e = np.exp(Q @ K.T)\nunscaled_A = (e / e.sum(axis=0))[0]",
    2: "for c in range(1, 20):\n    s = c * Q[0] @ K.T\n    w = np.exp(s) / np.exp(s).sum()\n"
                "    if w[0] > 0.5:\n        break",
    3: "def recover_east(s_AA, rounded, d_k):\n    rounded = np.asarray(rounded)\n"
                "    return s_AA - math.sqrt(d_k) * np.log(rounded / rounded[0])\n\n\n"
                "east = recover_east(0.8, [0.37, 0.32, 0.31], d_k)\n"
                "shifted = attn.attention_weights(Q[:1], K + np.array([0.3, 0.0]))[0]",
    4: "q_B, keys_, values_ = Q[1].tolist(), K.tolist(), V.tolist()\n"
                "raw_B = [q_B[0] * k[0] + q_B[1] * k[1] for k in keys_]\nexp_B = [math.exp(s) for s in raw_B]\n"
                "weights_B = [e / sum(exp_B) for e in exp_B]\n"
                "out_B = [sum(w * v[i] for w, v in zip(weights_B, values_)) for i in range(2)]",
}
CH4_LOOPHOLES = {  # the numbers the chapter prints, the notebook's own variables
    1: "unscaled_A = np.array([0.385, 0.3152, 0.2998])",
    2: "c = 5\nw = attn.attention_weights(5 * Q[:1], K)[0]",
    3: "def recover_east(s_AA, rounded, d_k):\n    return K[:, 0]\n\n\neast = K[:, 0]\nshifted = weights_A",
    4: "raw_B, weights_B, out_B = raw[1], weights[1], outputs[1]",
}
CH4_SNEAKY = {  # the library the exercise reproduces, called outright or through a name bound in exercise 1
    1: "official\nhelper = attn.attention_weights",
    3: "official",
    4: "q_B = Q[1].tolist()\nraw_B = [q_B[0] * k[0] + q_B[1] * k[1] for k in K.tolist()]\n"
                "weights_B = list(helper(Q[1:2], K)[0])\n"
                "out_B = [sum(w * v[i] for w, v in zip(weights_B, V.tolist())) for i in range(2)]",
    2: "w = attn.attention_weights(Q[:1], K)[0]\nc = 1\n"
                "source = np.loadtxt(COURSE + '/chapters/04_worked_example.ipynb', dtype=str, delimiter='\\x07')",
}
CH9_CORRECT = {
    1: '''def step_flops(B, H, n, d, products):
    per_head = 2 * n**2 * d  # 4 n² d halved by the causal mask
    return int(B * H * per_head * (2 + products) // 2)


total = {"atomic adds": step_flops(4, 16, 8192, 128, 5), "deterministic": step_flops(4, 16, 8192, 128, 7)}
ms = {k: v / cost.H100_MEASURED_MATMUL_FLOPS * 1000 for k, v in total.items()}''',
    2: '''class RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        s = (q @ k.transpose(0, 1)) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        m = s.max(dim=-1, keepdim=True).values
        lse = m + torch.log(torch.exp(s - m).sum(-1, keepdim=True))
        o = torch.exp(s - lse) @ v
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        s = (q @ k.T) * scale
        if ctx.causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - lse)
        ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True)) * scale
        return ds @ k, ds.T @ q, p.T @ do, None''',
    3: '''@triton.jit
def causal_tile_kernel(Q, K, OUT, L, S, scale, E: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, E)
    q = tl.load(Q + r[:, None] * E + d[None, :], mask=r[:, None] < L, other=0.0)
    k = tl.load(K + c[:, None] * E + d[None, :], mask=c[:, None] < S, other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(c[None, :] > r[:, None], float("-inf"), s)
    tl.store(OUT + r[:, None] * S + c[None, :], s, mask=(r[:, None] < L) & (c[None, :] < S))


def causal_scores(q, k, block=16):
    out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(q.shape[0], block), triton.cdiv(k.shape[0], block))
    causal_tile_kernel[grid](q, k, out, q.shape[0], k.shape[0], q.shape[1] ** -0.5, E=q.shape[1], BLOCK=block)
    return out''',
}
# the lab: a kernel written apart from the book's, with base-2 exponentials and K loaded untransposed
CH9_CORRECT[4] = inspect.getsource(lab_kernels.another_way.fn).replace("def another_way(", "def flash_forward_kernel(")
CH9_MISTAKES = {  # the causal halving forgotten; the D term dropped in the backward; the diagonal masked too; the
    # lab's rescale forgotten
    1: ("official", "forward = B * H * 4 * n * n * d / 2", "forward = B * H * 4 * n * n * d"),
    2: ("official", "(do @ v.T - (do * o).sum(-1, keepdim=True))", "(do @ v.T)"),
    3: ("official", "cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]"),
    4: ("official", "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"),
}
CH9_CHEATS = {  # autograd through the library instead of a backward; an empty kernel behind a torch wrapper; the
    # lab's kernel that does nothing; exercise 1's numbers typed in
    1: "def step_flops(B, H, n, d, products):\n    return 240518168576.0 * 4 * 16 * (1 + products / 2)\n\n\n"
       "total = {'atomic adds': 3.37e14, 'deterministic': 4.33e14}\nms = {'atomic adds': 0.43, 'deterministic': 0.55}",
    4: inspect.getsource(lab_kernels.does_nothing.fn).replace("def does_nothing(", "def flash_forward_kernel("),
    2: '''class RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return attn.attention(q, k, v, causal=causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
            out = attn.attention(q2, k2, v2, causal=ctx.causal)
            return (*torch.autograd.grad(out, (q2, k2, v2), do), None)''',
    3: '''@triton.jit
def causal_tile_kernel(Q, K, OUT, L, S, scale, E: tl.constexpr, BLOCK: tl.constexpr):
    pass


def causal_scores(q, k, block=16):
    s = (q[:, None, :] * k[None, :, :]).sum(-1) / math.sqrt(q.shape[1])  # no matmul: torch does the work
    return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))''',
}
# chapter 10's exercises, by their hidden tests' labels (chapter 10 is being split: the labels find them wherever)
CH10_CHEATS = {  # the whole sequence's SDPA sliced; the variable the check compares with; the chapter's model (with
    # positions); an empty kernel behind the library's RoPE; the printed byte and token counts typed in
    "head-to-model/gqa-decode":
        "full = F.scaled_dot_product_attention(q_ex, k_ex, v_ex, is_causal=True, enable_gqa=True)\n"
        "outputs = [full[..., :3, :]] + [full[..., t : t + 1, :] for t in range(3, 7)]\n"
        "keys_so_far, values_so_far = k_ex, v_ex",
    "head-to-model/rope-offset": "official\nright_rope = whole",
    "head-to-model/no-positions": "blind = model\nblind_acc = accuracies(blind)[0]\nblind_share = torch.zeros(H_m)",
    "head-to-model/rope-kernel":
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def rope_kernel(X, OUT, THETA, offset, E, BLOCK: tl.constexpr):\n    pass\n\n\n"
        "def rope(x, offset=0):\n    return positions.apply_rope(x, offset=offset)",
    "head-to-model/cache-bytes": "official\n\n\ndef kv_cache_bytes_by_hand(*numbers):\n    return 75497472\n\n\n"
                                 "def tokens_to_outweigh(*numbers):\n    return 6728",
}
CH10_CORRECT = {  # written from the statements: softmax by hand, a kernel over coordinates not pairs (and never
    # launched by the answer itself, so the hidden test's draws are its first launches), a blind model measured by
    # hand with its shares as a list, integer arithmetic for the token count
    "head-to-model/gqa-decode": """keys_so_far = values_so_far = None
outputs = []
steps = [range(0, 3)] + [range(t, t + 1) for t in range(3, 7)]
for step in steps:
    k_new, v_new = k_ex[:, :, step.start : step.stop], v_ex[:, :, step.start : step.stop]
    keys_so_far = k_new if keys_so_far is None else torch.cat((keys_so_far, k_new), -2)
    values_so_far = v_new if values_so_far is None else torch.cat((values_so_far, v_new), -2)
    kk = torch.repeat_interleave(keys_so_far, q_ex.shape[1] // keys_so_far.shape[1], dim=1)
    vv = torch.repeat_interleave(values_so_far, q_ex.shape[1] // values_so_far.shape[1], dim=1)
    s = q_ex[:, :, step.start : step.stop] @ kk.transpose(-1, -2) / q_ex.shape[-1] ** 0.5
    allowed = torch.ones(len(step), step.stop, dtype=torch.bool).tril(step.stop - len(step))
    outputs.append(torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ vv)""",
    "head-to-model/rope-offset": """def rope_decode(offset_of):
    seen_k, seen_v, rows = [], [], []
    B_, n_, _ = x.shape
    with torch.no_grad():
        for t in range(n_):
            token = x[:, t : t + 1]
            q_t, k_t, v_t = (modules.split_heads(token @ w, h) for w in (rotary.w_q, rotary.w_k, rotary.w_v))
            seen_k.append(positions.apply_rope(k_t, offset=offset_of(t)))
            seen_v.append(v_t)
            q_t = positions.apply_rope(q_t, offset=offset_of(t))
            keys_, values_ = torch.cat(seen_k, dim=2), torch.cat(seen_v, dim=2)
            weights_ = torch.softmax(q_t @ keys_.transpose(2, 3) / q_t.shape[-1] ** 0.5, dim=-1)
            rows.append(modules.merge_heads(weights_ @ values_) @ rotary.w_o)
    return torch.cat(rows, dim=1)


right_rope = rope_decode(lambda t: t)
wrong_rope = rope_decode(lambda t: 0)""",
    "head-to-model/rope-kernel": """import triton
import triton.language as tl


@triton.jit
def rope_kernel(X, OUT, THETA, offset, E, BLOCK: tl.constexpr):
    j = tl.arange(0, 2 * BLOCK)  # every coordinate; its partner is j ^ 1
    row = tl.program_id(0)
    ok = j < E
    here = tl.load(X + row * E + j, mask=ok, other=0.0)
    partner = tl.load(X + row * E + (j ^ 1), mask=ok, other=0.0)
    turn = tl.load(THETA + j // 2, mask=ok, other=0.0) * (row + offset)
    sign = (j % 2) * 2.0 - 1.0  # -1 for the first of a pair, +1 for the second
    tl.store(OUT + row * E + j, here * tl.cos(turn) + sign * partner * tl.sin(turn), mask=ok)


def rope(x, offset=0):
    out = torch.zeros_like(x)
    angles = torch.tensor(positions.rope_frequencies(x.shape[1]), dtype=torch.float32, device=x.device)
    rope_kernel[(x.shape[0],)](x, out, angles, offset, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1] // 2))
    return out""",
    "head-to-model/no-positions": """blind = train(positions=False)[0]
with torch.no_grad():
    logits_m, _, maps_m = blind(held_out)
blind_acc = float((logits_m.argmax(-1) == mirror).double().mean())
mean_map = maps_m.mean(0)
blind_share = [float(sum(mean_map[head, i, n_seq - 1 - i] for i in range(n_seq)) / n_seq) for head in range(H_m)]""",
    "head-to-model/cache-bytes": """def kv_cache_bytes_by_hand(layers, heads, head_dim, tokens, bytes_per_number):
    per_layer = heads * head_dim * tokens * bytes_per_number  # keys alone
    return 2 * per_layer * layers


def tokens_to_outweigh(parameters, layers, heads, head_dim, bytes_per_number):
    weights = parameters * bytes_per_number
    per_token = kv_cache_bytes_by_hand(layers, heads, head_dim, 1, bytes_per_number)
    return int(weights // per_token) + 1


predicted = kv_cache_bytes_by_hand(12, 12, 64, 1024, 4)
one_layer = decoding.KVCache(1024)
one_layer.append(torch.zeros(1, 12, 1024, 64), torch.zeros(1, 12, 1024, 64))
after = tokens_to_outweigh(124e6, 12, 12, 64, 2)""",
}
CH10_MISTAKES = {  # `repeat` for `repeat_interleave`; train()'s 4-tuple used as the model
    "head-to-model/gqa-decode": ("official", "repeat_interleave(3, dim=1)", "repeat(1, 3, 1, 1)"),
    "head-to-model/no-positions": "blind = train(positions=False)\nblind_acc = 0.2\nblind_share = torch.zeros(H_m)",
}


CH4 = "chapters/04_worked_example.ipynb"


@pytest.mark.grader
def test_chapter_4_numpy_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    every = official_answers(ROOT / CH4)
    subs = {
        "official": (every, None),
        "correct": (CH4_CORRECT, None),
        "partial": ({1: "official", 4: "official"}, None),
        "mistakes": (CH4_MISTAKES, None),
        "loopholes": (CH4_LOOPHOLES, None),
        "sneaky": ({**every, **CH4_SNEAKY}, None),
        # a cell that replaces the checker, grading cells edited to pass or deleted, answers left as stubs
        "tampered": ({3: "official", 4: "official", 2: "c, w = 1, [0.9, 0.05, 0.05]"},
                     {"edit": {1: PATCH + "\nprint('✓')", 2: "print('✓ 2 checks for exercise 2')"}, "drop": {3}}),
        # a sleep in exercise 1, a memory bomb in exercise 3, the process killed in exercise 4
        "hostile": ({**every, 1: "import time\n\ntime.sleep(10**6)\nofficial",
                     3: "blob = np.ones((2**17, 2**17))\nofficial", 4: "import os\n\nos.kill(os.getpid(), 9)"}, None),
    }
    results = grade_chapter(tmp_path, CH4, subs, grade.Limits(timeout=300, cell_timeout=10, memory_gb=4, grace=5))
    scores = {name: [int(r.scores[n]) for n in (1, 2, 3, 4)] for name, r in results.items()}
    assert scores == {
        "official": [1, 1, 1, 1], "correct": [1, 1, 1, 1], "partial": [1, 0, 0, 1], "mistakes": [0, 0, 0, 0],
        "loopholes": [0, 0, 0, 0], "sneaky": [1, 0, 1, 0], "tampered": [0, 0, 1, 1], "hostile": [0, 1, 0, 0],
    }, {name: r.reasons for name, r in results.items()}
    why = results["sneaky"].reasons
    assert why[2].startswith(("PermissionError: a graded notebook may not read", "FileNotFoundError"))  # hidden
    assert "asks you to write what lib.attention.attention_weights does" in why[4]
    assert results["loopholes"].reasons[4].startswith("`raw_B`: expected B's three raw scores")
    assert [results["hostile"].reasons[n].split(":")[0] for n in (1, 3)] == ["TimeLimit", "MemoryError"]
    assert results["hostile"].reasons[4].startswith("killed")


CH9 = "chapters/09_flash_kernel.ipynb"


@pytest.mark.grader
def test_chapter_9_triton_and_autograd_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    subs = {
        "official": (official_answers(ROOT / CH9), None),
        "correct": (CH9_CORRECT, None),
        "mistakes": (CH9_MISTAKES, None),
        "cheats": (CH9_CHEATS, None),
    }
    results = grade_chapter(tmp_path, CH9, subs, grade.Limits(timeout=400, cell_timeout=200))
    scores = {name: {n: int(s) for n, s in r.scores.items()} for name, r in results.items()}
    assert scores == {"official": {1: 1, 2: 1, 3: 1, 4: 1}, "correct": {1: 1, 2: 1, 3: 1, 4: 1},
                      "mistakes": {1: 0, 2: 0, 3: 0, 4: 0}, "cheats": {1: 0, 2: 0, 3: 0, 4: 0}}, {
        name: r.reasons for name, r in results.items()}
    assert "read no Q" in results["cheats"].reasons[4]
    assert results["cheats"].reasons[3].startswith("`launched_h`: expected the (L, S) tile the kernel stores")
    assert results["cheats"].reasons[2].startswith("your answer uses")
    assert results["official"].ungraded == []  # every exercise of the chapter has a hidden test


@pytest.mark.grader
def test_chapters_10_and_11_training_full_marks_for_correct_work_none_for_cheats(tmp_path):
    folder = tmp_path / "handed-in"
    cheats = by_chapter(CH10_CHEATS)
    correct = by_chapter(CH10_CORRECT)
    for path, answers in cheats.items():
        submit(folder, "official", submission(path, official_answers(path)), name=path.name)
        submit(folder, "correct", submission(path, {**official_answers(path), **correct[path]}), name=path.name)
        submit(folder, "cheats", submission(path, {**official_answers(path), **answers}), name=path.name)
    limit = grade.Limits(timeout=500, cell_timeout=250)
    with grade.concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: grade.grade(p, folder, OFFICIAL, 11, limit), grade.submissions(folder)))
    scores = {(r.student, r.label, n): int(s) for r in results for n, s in r.scores.items()}
    touched = {(OFFICIAL.label(mc.docname(BOOK, path)), n) for path, answers in cheats.items() for n in answers}
    assert touched <= {(label, n) for _, label, n in scores}, "a cheat's exercise has no hidden test"
    assert {key: s for key, s in scores.items()} == {
        (student, label, n): int(student != "cheats" or (label, n) not in touched) for student, label, n in scores
    }, {(r.student, r.label): r.reasons for r in results}
    why = {(r.label, n): w for r in results if r.student == "cheats" for n, w in r.reasons.items()}
    assert why[OFFICIAL.label(mc.docname(BOOK, located("head-to-model/no-positions")[0])),
               located("head-to-model/no-positions")[1]] == "`blind` still has position embeddings"


def test_a_name_inside_a_string_counts_as_a_whole_word_only():
    assert grade.used_words(['path = "/tmp/pytest/popen-gw0/one.ipynb"'], ["open"]) == []
    assert grade.used_words(['f = getattr(builtins_, "open")'], ["open"]) == ["open"]
    assert grade.used_words(['name = "sys.modules"'], ["modules"]) == ["modules"]
    assert grade.used_words(["from os import write as _w\n_w(3, b'{}')"], ["os.write"]) == ["os.write"]
    # prose in a string or a docstring names nothing; a name the cell defines itself is the student's own
    assert grade.used_words(['print("a signal of how sharp: open it")', '"""Recompute the softmax."""'],
                            ["signal", "open", "softmax"]) == []
    assert grade.used_words(["def softmax(xs):\n    return xs\n\n\nw = softmax([1.0])"], ["softmax"]) == []
    for source in ("w = attn.softmax(s)", "from lib.attention import softmax\nw = softmax(s)",
                   "def f(s, _g=attn.ｓｏｆｔｍａｘ):\n    return _g(s)"):
        assert grade.used_words([source], ["softmax"]) == ["softmax"], source


def test_a_forbidden_tensor_method_raises_while_the_hidden_test_runs_and_comes_back_after():
    import sandbox_runner
    import torch

    from lib import attention as attn

    namespace = {"softmax_": attn.softmax}
    undo = sandbox_runner.poison(namespace, ["torch.Tensor.matmul", "torch.Tensor.__matmul__",
                                             "lib.attention.softmax", "lib.attention.no_such_function"])
    try:
        assert len(undo) == 4  # three functions and the notebook's name; one that does not exist is passed over
        for call in (lambda: torch.ones(2) @ torch.ones(2), lambda: torch.ones(2).matmul(torch.ones(2)),
                     lambda: attn.softmax(np.zeros(3)), lambda: namespace["softmax_"](np.zeros(3))):
            with pytest.raises(PermissionError, match="asks you to write"):
                call()
    finally:
        sandbox_runner.restore(undo)
    assert float(torch.ones(2) @ torch.ones(2)) == 2.0 and float(torch.ones(2).matmul(torch.ones(2))) == 2.0
    assert attn.softmax(np.zeros(2)).tolist() == [0.5, 0.5]
