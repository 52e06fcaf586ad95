"""What the grader's tests on real chapters share: a chapter's student edition filled in as a student would hand it
in, and the grader run on a class of such submissions (tests/test_grader.py, tests/test_grader_chapters.py)."""

import concurrent.futures
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grade
import make_student as ms

mc = ms.mc
BOOK = mc.Book(ROOT)
CHAPTERS = BOOK.chapters
OFFICIAL = grade.Official(ROOT)


def text(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def submit(folder, student, nb, name="01_one.ipynb"):
    (folder / student).mkdir(parents=True, exist_ok=True)
    (folder / student / name).write_text(json.dumps(nb))


def submission(path, answers, grading=None, course=ROOT):
    """The student edition of a chapter with the given answers in place of its stubs, and its grading cells
    edited (`grading["edit"]`: exercise -> source) or deleted (`grading["drop"]`: exercises).

    An answer is keyed by exercise number: `None` keeps the stub; a string replaces it, with the word "official"
    standing for the chapter's own solution (and COURSE, if named, bound to the course checkout); (old, new) is the
    official solution with one slip."""
    edition, exercises = ms.edition(BOOK, path)
    original = {c["id"]: text(c) for c in mc.read_notebook(path)["cells"]}
    by_number = {e.number: e for e in exercises}
    nb = json.loads(json.dumps(edition))
    cells = {c["id"]: c for c in nb["cells"]}
    for number, answer in answers.items():
        cid = by_number[number].solutions[0]
        if isinstance(answer, tuple):  # the official solution with one slip
            assert answer[1] in original[cid], answer[1]
            cells[cid]["source"] = original[cid].replace(answer[1], answer[2])
        elif isinstance(answer, str):
            prefix = f"COURSE = {str(course)!r}\n" if "COURSE" in answer else ""
            cells[cid]["source"] = prefix + answer.replace("official", original[cid], 1)
    for number, source in (grading or {}).get("edit", {}).items():
        cells[by_number[number].check]["source"] = source
    dropped = {by_number[n].check for n in (grading or {}).get("drop", ())}
    nb["cells"] = [c for c in nb["cells"] if c["id"] not in dropped]
    return nb


def official_answers(path):
    _, exercises = ms.edition(BOOK, path)
    return {e.number: "official" for e in exercises if e.solutions}


def grade_chapter(tmp_path, chapter, subs, limit, seed=11):
    """Grade one chapter's submissions (student -> (answers, grading)), two at a time: student -> Result."""
    path = ROOT / chapter
    folder = tmp_path / "handed-in"
    for student, (answers, grading) in subs.items():
        submit(folder, student, submission(path, answers, grading), name=path.name)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: grade.grade(p, folder, OFFICIAL, seed, limit), grade.submissions(folder)))
    return {r.student: r for r in results}


def scores_of(results):
    """student -> {exercise number: points}, as whole numbers."""
    return {name: {n: int(s) for n, s in r.scores.items()} for name, r in results.items()}


def located(label):
    """The chapter and today's number of the exercise a hidden test grades."""
    for doc, path in OFFICIAL.by_doc.items():
        for number, spec in OFFICIAL.edition(doc)[2].items():
            if spec.label == label:
                return path, number
    raise LookupError(label)


def by_chapter(answers):
    """Answers keyed by hidden-test label, regrouped as chapter path -> {exercise number: answer}."""
    grouped = {}
    for label, answer in answers.items():
        path, number = located(label)
        grouped.setdefault(path, {})[number] = answer
    return grouped


def proven_both_ways(tmp_path, chapter, correct, wrong, reasons, limit, partial=None):
    """Grade a chapter's official solutions, answers written independently of them (`correct`), wrong answers
    (`wrong`: student -> answers) and partly right ones (`partial`: student -> (answers, {exercise: points}));
    assert full marks for the first two on every graded exercise, none for the wrong ones, the given points for the
    partial ones, a hidden test for every graded exercise, and that each reason in `reasons` ((student, exercise) ->
    words) holds its words. Return the results (student -> Result)."""
    partial = partial or {}
    subs = {"official": (official_answers(ROOT / chapter), None), "correct": (correct, None),
            **{student: (answers, None) for student, answers in wrong.items()},
            **{student: (answers, None) for student, (answers, _) in partial.items()}}
    results = grade_chapter(tmp_path, chapter, subs, limit)
    graded = sorted(results["official"].scores)
    want = {student: {n: int(student in ("official", "correct")) for n in graded} for student in subs}
    want.update({student: {n: points.get(n, 0) for n in graded} for student, (_, points) in partial.items()})
    assert scores_of(results) == want, {name: r.reasons for name, r in results.items()}
    assert graded and results["official"].ungraded == []  # every graded exercise has a hidden test
    for (student, number), words in reasons.items():
        assert words in results[student].reasons[number], results[student].reasons[number]
    return results
