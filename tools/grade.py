"""Grade a folder of handed-in student editions and print a score table: one row per student, one column per
graded exercise.

Usage: python tools/grade.py SUBMISSIONS [--timeout 900] [--cell-timeout 600] [--csv scores.csv]
       (`make grade SUBMISSIONS=dir` runs it)

SUBMISSIONS holds one folder per student (`alice/12_one_merge.ipynb`, ...) or notebooks named
`<student>_NN_slug.ipynb` (or `<student>/<anything>.ipynb`: the chapter is read from the notebook's
`student_edition` metadata, which tools/make_student.py writes). Each notebook is graded thus:
- its grading cells are replaced by the official ones, generated afresh from chapters/ (tools/make_student.py), so an
  edited grading cell grades nothing; a deleted one scores 0 ("grading cell missing");
- it runs top to bottom in a fresh kernel (nbclient, the executor Jupyter Book uses), from an empty temporary
  folder, with the course library on its path, errors allowed, within a time limit per cell and per notebook;
- an exercise scores 1 if its grading cell ran and raised nothing, 0 otherwise, with the reason (the error's
  type, "not run: time limit", ...) listed under the table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_colab as mc
import make_student as ms


@dataclasses.dataclass
class Result:
    student: str
    chapter: str  # the chapter's document name, chapters/12_one_merge
    label: str  # the chapter's number, from its file name: "11"
    scores: dict[int, int]  # exercise number -> 1 or 0
    reasons: dict[int, str]  # exercise number -> why it scored 0
    seconds: float  # wall-clock seconds the notebook ran
    cpu_seconds: float | None  # processor seconds its kernel used, if it ran to the end


class Official:
    """The official grading cells of each chapter, generated from chapters/ once per chapter."""

    def __init__(self, root: pathlib.Path = ROOT):
        self.book = mc.Book(root)
        self.by_doc = {mc.docname(self.book, p): p for p in self.book.chapters}
        self._cache: dict[str, tuple[dict, list[ms.Exercise]]] = {}

    def chapter_of(self, nb: dict, path: pathlib.Path) -> str:
        doc = nb.get("metadata", {}).get("student_edition", {}).get("chapter")
        if doc in self.by_doc:
            return doc
        for candidate in self.by_doc:  # by file name: alice_12_one_merge.ipynb, 12_one_merge.ipynb
            if path.stem.endswith(candidate.rsplit("/", 1)[-1]):
                return candidate
        raise ValueError(f"{path}: cannot tell which chapter this is (no student_edition metadata, no chapter name)")

    def edition(self, doc: str) -> tuple[dict, list[ms.Exercise]]:
        if doc not in self._cache:
            self._cache[doc] = ms.edition(self.book, self.by_doc[doc])
        return self._cache[doc]

    def label(self, doc: str) -> str:
        """The chapter's number, from its file name (chapters/09_flash_kernel: "9")."""
        return doc.rsplit("/", 1)[-1].split("_")[0].lstrip("0") or "0"


def student_name(folder: pathlib.Path, path: pathlib.Path, chapter: str) -> str:
    relative = path.relative_to(folder)
    if len(relative.parts) > 1:
        return relative.parts[0]
    stem = path.stem
    slug = chapter.rsplit("/", 1)[-1]
    return (stem[: -len(slug)].rstrip("_-. ") or stem) if stem.endswith(slug) else stem


GRADER_IMPORT = "from lib.notebook import checks  # the grader's own\n"


def find_grading_cell(nb: nbformat.NotebookNode, exercise: ms.Exercise):
    """The submission's grading cell of an exercise: by its cell id, or, where an editor dropped the ids, by the
    edition's title line or the `checks("exercise N")` it opens with. None if the student deleted it."""
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    by_id = [cell for cell in code if cell.get("id") == exercise.check]
    if by_id:
        return by_id[0]
    marks = (f"Grading cell for exercise {exercise.number}:", f'checks("exercise {exercise.number}")')
    by_text = [cell for cell in code if any(mark in mc.source(cell) for mark in marks)]
    return by_text[0] if len(by_text) == 1 else None


def prepare(nb: nbformat.NotebookNode, official: dict, exercises: list[ms.Exercise]) -> tuple[dict, dict[int, str]]:
    """Put the official grading cells in place of the submission's. Return exercise -> the cell that grades it, and
    exercise -> 'grading cell missing' where the student deleted it."""
    cells = {c["id"]: c for c in official["cells"]}
    targets, missing = {}, {}
    for exercise in exercises:
        if not exercise.graded:
            continue
        cell = find_grading_cell(nb, exercise)
        if cell is None:
            missing[exercise.number] = "grading cell missing"
            continue
        # checks imported afresh: a student's own `checks` (a variable, say) cannot stand in for the course's
        cell.source = GRADER_IMPORT + mc.source(cells[exercise.check]).split("\n", 1)[1]
        targets[exercise.number] = cell
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return targets, missing


def error_of(cell) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return f"{output.get('ename', 'Error')}: {output.get('evalue', '')}".strip().rstrip(":")[:120]
    return None


# the processor seconds the kernel and its child processes used, asked of the kernel after the notebook's last cell
CPU_TIME = ("import resource as _r\nprint(sum(getattr(_r.getrusage(who), f) for who in (_r.RUSAGE_SELF, "
            "_r.RUSAGE_CHILDREN) for f in ('ru_utime', 'ru_stime')))")


def run(nb: nbformat.NotebookNode, timeout: float, cell_timeout: float,
        root: pathlib.Path = ROOT) -> tuple[str | None, float | None]:
    """Run a notebook in a fresh kernel from an empty temporary folder. Return why it stopped early (None if it ran
    to the end) and the processor seconds its kernel used (None if it stopped early)."""
    env = {**os.environ, "COURSE_CLONE_DIR": str(root), "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="grade-") as folder:
        client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": folder}}, record_timing=False)
        with client.setup_kernel(env=env, cwd=folder):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return "not run: time limit", None
                client.timeout = max(1, int(min(cell_timeout, left)))
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    return "not run: time limit", None
                except DeadKernelError:
                    return "not run: the kernel died", None
            probe = nbformat.v4.new_code_cell(CPU_TIME)
            nb.cells.append(probe)  # nbclient stores the cell it ran back in the notebook
            client.timeout = 60
            try:
                client.execute_cell(probe, len(nb.cells) - 1)
                return None, float(probe.outputs[0]["text"])
            except (CellTimeoutError, DeadKernelError, IndexError, KeyError, ValueError):
                return None, None
            finally:
                nb.cells.pop()


def grade(path: pathlib.Path, folder: pathlib.Path, official: Official, timeout: float = 900,
          cell_timeout: float = 600) -> Result:
    nb = nbformat.read(path, as_version=4)
    doc = official.chapter_of(nb, path)
    edition, exercises = official.edition(doc)
    targets, reasons = prepare(nb, edition, exercises)
    start = time.monotonic()
    stopped, cpu = run(nb, timeout, cell_timeout)
    seconds = time.monotonic() - start
    scores = {}
    for exercise in (e for e in exercises if e.graded):
        if exercise.number not in reasons:
            cell = targets[exercise.number]
            if cell.get("execution_count") is None:
                reasons[exercise.number] = stopped or "not run"
            elif error_of(cell):
                reasons[exercise.number] = error_of(cell)
        scores[exercise.number] = 0 if exercise.number in reasons else 1
    return Result(student_name(folder, path, doc), doc, official.label(doc), scores, reasons, seconds, cpu)


def submissions(folder: pathlib.Path) -> list[pathlib.Path]:
    if not folder.is_dir():
        raise ValueError(f"SUBMISSIONS: {folder} is not a folder")
    found = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if not found:
        raise ValueError(f"SUBMISSIONS: no notebook under {folder}")
    return found


def table(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the score table: one row per student, one column per graded exercise, and the total."""
    columns = sorted({(int(r.label) if r.label.isdigit() else 0, r.label, n) for r in results for n in r.scores})
    names = [f"{label}.{n}" for _, label, n in columns]
    students = sorted({r.student for r in results})
    rows = []
    for student in students:
        mine = {(r.label, n): s for r in results if r.student == student for n, s in r.scores.items()}
        cells = [str(mine[(label, n)]) if (label, n) in mine else "-" for _, label, n in columns]
        rows.append([student, *cells, f"{sum(mine.values())}/{len(columns)}"])
    return ["student", *names, "total"], rows


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", type=pathlib.Path, help="folder of handed-in student editions")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a whole notebook may run (900)")
    parser.add_argument("--cell-timeout", type=float, default=600, help="seconds one cell may run (600)")
    parser.add_argument("--csv", type=pathlib.Path, help="also write the table as CSV")
    parser.add_argument("--course", type=pathlib.Path, default=ROOT,
                        help="the course whose chapters hold the official grading cells (default: this checkout)")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.cell_timeout <= 0:
        parser.error("--timeout and --cell-timeout must be positive")
    try:
        paths = submissions(args.submissions)
        official = Official(args.course)
    except (ValueError, ms.StudentError, mc.ConversionError) as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    results, unreadable, seen = [], [], {}
    for path in paths:
        name = path.relative_to(args.submissions)
        try:
            nb = nbformat.read(path, as_version=4)
            doc = official.chapter_of(nb, path)
            student = student_name(args.submissions, path, doc)
            if (student, doc) in seen:
                raise ValueError(f"a second notebook of {doc} from {student} (the first: {seen[student, doc]})")
            seen[student, doc] = name
            result = grade(path, args.submissions, official, args.timeout, args.cell_timeout)
        except (ValueError, OSError, nbformat.ValidationError) as exc:  # one bad file stops nobody else's grading
            unreadable.append(f"  {name}: {' '.join(str(exc).split())[:200]}")
            continue
        print(f"graded {name} ({result.student}, chapter {result.label}) in {result.seconds:.0f} s"
              + (f" ({result.cpu_seconds:.0f} s of processor time)" if result.cpu_seconds is not None else ""),
              file=sys.stderr)
        results.append(result)
    header, rows = table(results)
    print(render(header, rows))
    failures = [(r.student, f"{r.label}.{n}", why) for r in results for n, why in sorted(r.reasons.items())]
    if failures:
        print("\nWhy an exercise scored 0:")
        for student, exercise, why in failures:
            print(f"  {student}  {exercise}  {' '.join(why.split())}")
    if unreadable:
        print("\nNot graded (fix or rename the file, then grade again):")
        print("\n".join(unreadable))
    if args.csv:
        with args.csv.open("w", newline="") as handle:
            csv.writer(handle).writerows([header, *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
