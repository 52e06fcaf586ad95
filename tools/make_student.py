"""Write the student edition of every chapter: student/chapters/NN_slug.ipynb, generated from chapters/, never edited.

Usage: python tools/make_student.py            (rewrites student/ from chapters/; `make student` runs it)

A student edition is the chapter's Colab edition (tools/make_colab.py: plain Markdown, no outputs, the setup cell
that finds or clones the course library) with its exercises opened up:
- each exercise keeps its statement (a Markdown line starting `**N.**` under an "Exercises" heading);
- each code cell tagged `solution` becomes a stub: a comment saying what to write and which names the grading cell
  uses, each of those names bound to `...`, each function kept as its signature with a body that raises
  NotImplementedError. Import lines stay; nothing else of the solution does;
- the `check` cell after an exercise's last solution cell stays, as the grading cell: it prints
  "✓ 4 checks for exercise 2" when the answer passes and raises when it does not;
- a written answer (a `Solution` dropdown) is removed and replaced by a cell for the student's own words, marked
  as not graded; an exercise without a check cell is not graded, and its stub says so.
Whatever does not follow this convention stops the generator with an error naming the chapter and the cell.
The grader (tools/grade.py) takes its grading cells from the same function, `edition`, run on chapters/.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grading_specs as gs
import make_colab as mc

OUT = ROOT / "student"
GRADING_TAG = "grading"

SOLUTION_BLOCK = re.compile(
    r"^ {0,3}(?P<fence>:{3,}|`{3,})\s*\{(?:admonition|dropdown)\}\s*Solution\b.*?$.*?^ {0,3}(?P=fence)\s*$\n?",
    re.MULTILINE | re.DOTALL,
)
STATEMENT = re.compile(r"^\*\*(\d+)[.)]")


class StudentError(ValueError):
    """A chapter whose exercises do not follow the convention the student edition relies on."""


@dataclass
class Exercise:
    number: int
    statement: str  # id of the Markdown cell holding the statement
    solutions: list[str] = field(default_factory=list)  # ids of the code cells tagged `solution`
    check: str | None = None  # id of the grading cell, if the exercise is graded
    prose: list[str] = field(default_factory=list)  # ids of Markdown cells holding a written `Solution`
    names: list[str] = field(default_factory=list)  # names the grading cell uses that the solution defines

    @property
    def graded(self) -> bool:
        return self.check is not None


# ---------------------------------------------------------------------------------------------------- reading


def tags_of(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def find_exercises(nb: dict, doc: str) -> list[Exercise]:
    """The exercises of a chapter, read from its cells as the exercise convention lays them out."""
    found: list[Exercise] = []
    in_exercises, current, previous_solution = False, None, False
    for cell in nb["cells"]:
        text, cid = mc.source(cell), cell.get("id")
        if cell["cell_type"] == "markdown":
            for line in text.splitlines():
                if re.match(r"^#{1,2} ", line):
                    in_exercises = line.lstrip("# ").strip().lower().startswith("exercise")
                    current = None
                numbered = STATEMENT.match(line)
                if numbered and in_exercises:
                    current = Exercise(int(numbered.group(1)), cid)
                    found.append(current)
            if in_exercises and SOLUTION_BLOCK.search(text):
                if current is None:
                    raise StudentError(f"{doc}: cell {cid} holds a Solution before any exercise statement")
                current.prose.append(cid)
            previous_solution = False
            continue
        if cell["cell_type"] != "code":
            continue
        tags = tags_of(cell)
        if "solution" in tags:
            if current is None:
                raise StudentError(f"{doc}: solution cell {cid} is not under an exercise statement (**N.**)")
            if current.check is not None:
                raise StudentError(f"{doc}: solution cell {cid} comes after exercise {current.number}'s grading cell")
            current.solutions.append(cid)
            previous_solution = True
            continue
        if "check" in tags and previous_solution:
            if "checks(" not in text:
                raise StudentError(f"{doc}: grading cell {cid} does not use `with checks(...) as check:`")
            current.check = cid
        previous_solution = False
    numbers = [e.number for e in found]
    if len(set(numbers)) != len(numbers):
        raise StudentError(f"{doc}: an exercise number is used twice: {numbers}")
    cells = {c.get("id"): c for c in nb["cells"]}
    for exercise in found:
        if exercise.graded:
            exercise.names = expected_names(doc, exercise, [mc.source(cells[i]) for i in exercise.solutions],
                                            mc.source(cells[exercise.check]))
    return found


def parse(doc: str, code: str, what: str) -> ast.Module:
    try:
        return ast.parse(code)
    except SyntaxError as exc:
        raise StudentError(f"{doc}: {what} is not valid Python: {exc}") from None


def bound_names(tree: ast.Module) -> list[str]:
    """Names a cell binds at its top level, in order (imports excluded: a stub keeps its imports)."""
    names: list[str] = []
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            candidates = [statement.name]
        else:
            candidates = [n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        for name in candidates:
            if name not in names:
                names.append(name)
    return names


def expected_names(doc: str, exercise: Exercise, solutions: list[str], check: str) -> list[str]:
    """The names the grading cell reads that the exercise's solution defines: what a student must define."""
    check_tree = parse(doc, check, f"exercise {exercise.number}'s grading cell")
    loaded = {n.id for n in ast.walk(check_tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stored = {n.id for n in ast.walk(check_tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names: list[str] = []
    for code in solutions:
        names += [n for n in bound_names(parse(doc, code, f"exercise {exercise.number}'s solution"))
                  if n in loaded - stored and n not in names]
    if not names:
        raise StudentError(
            f"{doc}: exercise {exercise.number}'s grading cell reads no name its solution defines, "
            "so an untouched stub could pass it"
        )
    return names


# ---------------------------------------------------------------------------------------------------- writing


def defined_names(tree: ast.Module) -> set[str]:
    return {s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def wrap(line: str, width: int = 88) -> list[str]:
    """A comment line broken at commas to fit the chapters' 88 columns."""
    out = []
    while len(line) > width:
        cut = line.rfind(", ", 0, width - 1) + 1
        out.append(line[:cut])
        line = "#   " + line[cut:].lstrip()
    return out + [line]


def hidden_test_lines(spec: gs.Spec, names: list[str]) -> list[str]:
    """What a stub says of the exercise's hidden test: what each answer must be, within which tolerance, and what
    the answer may not call or use."""
    parts = [f"{name}: {check.describe()}" if name in names else check.describe()
             for name, check in spec.compare.items()]
    text = "The grader runs your answer again on inputs you have not seen and checks " + "; ".join(parts) + "."
    avoid = [*(f.rsplit(".", 1)[-1] for f in spec.forbidden), *spec.banned]
    if avoid:
        text += " Write it yourself: it may not use " + ", ".join(dict.fromkeys(avoid)) + "."
    return textwrap.wrap(text, 86, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def fit_signature(text: str, width: int = 88) -> str:
    """A function's stub with its `def` line cut at its commas when it is wider than the column: one indented run of
    parameters under the name, as a formatter writes it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("def ") and len(line) > width:
            head, _, rest = line.partition("(")
            params, _, tail = rest.rpartition(")")
            body = textwrap.wrap(params.strip() + ",", width - 4, break_long_words=False, break_on_hyphens=False)
            lines[i:i + 1] = [head + "(", *("    " + b for b in body), ")" + tail]
            break
    return "\n".join(lines)


def stub(doc: str, exercise: Exercise, code: str, spec: gs.Spec | None = None) -> str:
    """What replaces one solution cell: what to write, the names the grading cell uses, and nothing of the answer."""
    tree = parse(doc, code, f"exercise {exercise.number}'s solution")
    if exercise.graded:
        functions = {s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        replace = " and ".join(w for w, used in (
            ("the `...`", any(n not in functions for n in exercise.names)),
            ("the NotImplementedError", any(n in functions for n in exercise.names)),
        ) if used)
        lines = [f"# Exercise {exercise.number}: your answer goes here, in place of {replace}.",
                 "# The grading cell after your answer uses these names:"]
        lines += wrap("#   " + ", ".join(exercise.names))
        if spec is not None:
            lines += hidden_test_lines(spec, exercise.names)
    else:
        lines = [f"# Exercise {exercise.number} is not graded: write your code here."]
    imports, definitions, values = [], [], []
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(statement))
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name in exercise.names:
            message = f"exercise {exercise.number}: write {statement.name}"
            signature = ast.FunctionDef(
                name=statement.name, args=statement.args, decorator_list=statement.decorator_list,
                returns=statement.returns, type_params=[],
                body=[ast.parse(f"raise NotImplementedError({message!r})").body[0]],
            )
            definitions.append(fit_signature(ast.unparse(ast.fix_missing_locations(signature))))
        elif isinstance(statement, ast.ClassDef) and statement.name in exercise.names:
            shell = ast.ClassDef(name=statement.name, bases=statement.bases, keywords=statement.keywords,
                                 decorator_list=statement.decorator_list, type_params=[],
                                 body=[ast.Expr(ast.Constant(Ellipsis))])
            definitions.append(ast.unparse(ast.fix_missing_locations(shell)) + f"  # exercise {exercise.number}")
    defined = defined_names(tree)
    values = [f"{name} = ..." for name in bound_names(tree) if name in exercise.names and name not in defined]
    text = "\n".join(lines)
    if imports:
        text += "\n\n" + "\n".join(imports)
    for definition in definitions:
        text += "\n\n\n" + definition
    if values:
        text += ("\n\n\n" if definitions else "\n\n") + "\n".join(values)
    return text + "\n"


def answer_cell(cid: str, exercise: Exercise, rest: str) -> list[dict]:
    """A cell for the student's written answer (after whatever else the Solution cell said, if anything)."""
    text = (rest.rstrip() + "\n\n" if rest.strip() else "") + (
        f"**Your answer to exercise {exercise.number}, in words** (not graded): "
        "*replace this line with your answer.*"
    )
    return [{"cell_type": "markdown", "id": f"{cid}-answer", "metadata": {}, "source": mc.as_lines(text)}]


def banner(book: mc.Book, doc: str, exercises: list[Exercise], nb: dict) -> str:
    title = book.doc_title(doc)
    graded = [str(e.number) for e in exercises if e.graded]
    ungraded = [str(e.number) for e in exercises if not e.graded]
    lines = [
        f"> **Student edition** of [{title}]({book.page_url(doc)}), a chapter of *{book.title}*.",
        "> Run the cells from the top: the first code cell finds the course library (in Colab it fetches it with",
        "> `git clone` and installs nothing). Each exercise's answer goes in the cell that says so, in place of",
        "> its `...`; the cell after it grades the answer and prints a ✓ line when it passes. Do not edit the",
        "> grading cells: the instructor's grader runs its own copy of them.",
        ">",
        f"> Graded exercises: {', '.join(graded) or 'none'}. Not graded: {', '.join(ungraded) or 'none'}.",
    ]
    if nb.get("metadata", {}).get("accelerator") == "GPU":
        lines += [">", "> Every cell runs on a CPU (the kernels in Triton's interpreter); a GPU runs them at full size."]
    return "\n".join(lines)


def edition(book: mc.Book, path: pathlib.Path, specs=None, variant: str | None = None) -> tuple[dict, list[Exercise]]:
    """The student edition of one chapter, and its exercises. Each graded exercise's stub says what its hidden test
    (tools/grading_specs.py, or `specs`) checks; with `variant`, the statements read as that variant's."""
    doc = mc.docname(book, path)
    original = mc.read_notebook(path)
    exercises = find_exercises(original, doc)
    matched = gs.specs_for(exercises, {c.get("id"): mc.source(c) for c in original["cells"]}, specs)
    statements = {e.statement: matched[e.number] for e in exercises if e.number in matched}
    by_cell = {}
    for exercise in exercises:
        for cid in [*exercise.solutions, *exercise.prose]:
            by_cell[cid] = exercise
    originals = {c.get("id"): c for c in original["cells"]}
    converted = mc.convert_notebook(book, path)
    cells = []
    for cell in converted["cells"]:
        cid = cell.get("id")
        if cid == "colab-banner":
            cell = {**cell, "id": "student-banner", "source": mc.as_lines(banner(book, doc, exercises, original))}
        elif cid in by_cell and cell["cell_type"] == "code":
            exercise = by_cell[cid]
            spec = matched.get(exercise.number) if cid == exercise.solutions[0] else None
            cell = {**cell, "metadata": {"tags": ["solution", "stub"]},
                    "source": mc.as_lines(stub(doc, exercise, mc.source(originals[cid]), spec))}
        elif cid in by_cell:  # a written Solution: removed, with a place for the student's own words
            rest = SOLUTION_BLOCK.sub("", mc.source(originals[cid]))
            cells += answer_cell(cid, by_cell[cid], mc.convert_blocks(book, doc, rest) if rest.strip() else "")
            continue
        elif cid in statements and variant:
            text = mc.source(cell)
            for old, new in statements[cid].variants.get(variant, ({}, []))[1]:
                if old not in text:
                    raise StudentError(f"{doc}: variant {variant!r} changes {old!r}, which the statement lacks")
                text = text.replace(old, new)
            cell = {**cell, "source": mc.as_lines(text)}
        elif any(cid == e.check for e in exercises):
            number = next(e.number for e in exercises if e.check == cid)
            title = f"# @title Grading cell for exercise {number}: run it after your answer (double-click for the checks)"
            lines = mc.source(cell).split("\n", 1)
            cell = {**cell, "metadata": {**cell["metadata"], "tags": ["check", GRADING_TAG]},
                    "source": mc.as_lines(title + "\n" + lines[1])}
        cells.append(cell)
    metadata = {**converted["metadata"], "student_edition": {
        "chapter": doc,
        "graded": [e.number for e in exercises if e.graded],
        "ungraded": [e.number for e in exercises if not e.graded],
    }}
    return {**converted, "cells": cells, "metadata": metadata}, exercises


TABLE_BEGIN = "% BEGIN the graded exercises: written by tools/make_student.py from the chapters, do not edit"
TABLE_END = "% END the graded exercises"


def exercise_table(book: mc.Book) -> str:
    """The Markdown table of every chapter's exercises, graded or not, for the instructors' page."""
    rows = ["| Chapter | Graded (the names each grading cell reads) | Of which Triton kernels | Not graded |",
            "| --- | --- | --- | --- |"]
    for path in book.chapters:
        doc = mc.docname(book, path)
        nb = mc.read_notebook(path)
        exercises = find_exercises(nb, doc)
        cells = {c.get("id"): mc.source(c) for c in nb["cells"]}
        graded = "; ".join(f"{e.number}: " + ", ".join(f"`{n}`" for n in e.names) for e in exercises if e.graded)
        kernels = [str(e.number) for e in exercises if e.graded
                   and any(re.search(r"@triton\.jit", cells[i]) for i in e.solutions)]
        words = [str(e.number) for e in exercises if not e.graded]
        number = path.stem.split("_")[0].lstrip("0")
        link = f"[{number}. {book.doc_title(doc)}]({doc}.ipynb)"
        rows.append(f"| {link} | {graded or 'none'} | {', '.join(kernels) or 'none'} | {', '.join(words) or 'none'} |")
    return "\n".join(rows)


def write_table(page: pathlib.Path, table: str) -> bool:
    """Put the table between the markers of the instructors' page; return whether the page changed."""
    text = page.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise StudentError(f"{page.name}: no '{TABLE_BEGIN}' ... '{TABLE_END}' markers for the exercise table")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}"
    if new != text:
        page.write_text(new)
    return new != text


def build(out: pathlib.Path = OUT, root: pathlib.Path = ROOT, variant: str | None = None) -> list[pathlib.Path]:
    """Write the student edition of every chapter under out/chapters; remove editions whose chapter is gone."""
    book = mc.Book(root)
    written = []
    for path in book.chapters:
        nb, _ = edition(book, path, variant=variant)
        copy = out / path.relative_to(book.root)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(mc.dumps(nb), encoding="utf-8")
        written.append(copy)
    for stale in sorted((out / "chapters").glob("*.ipynb")):
        if stale not in written:
            stale.unlink()
    if (root / "instructors.md").exists() and variant is None:
        write_table(root / "instructors.md", exercise_table(book))
    return written


# what a copy of the book for a term needs: its sources, never the generated editions, the build or the tests
# (whose submissions hold correct answers)
BOOK_SKIP = (".git", ".venv", "_build", "student", "colab", "tests", "node_modules", "__pycache__", ".pytest_cache")


def book_without_solutions(dest: pathlib.Path, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Copy the book's sources to dest with every exercise's solution left out: each solution cell becomes its stub
    (without outputs) and each written Solution is removed. `PYTHONPATH=dest jupyter-book build dest` then builds the
    book a class reads while its exercises are open; the grading cells stay, as self-checks."""
    if dest.resolve() == root.resolve() or root.resolve() in dest.resolve().parents:
        raise StudentError(f"{dest}: the copy must lie outside the course checkout")
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*BOOK_SKIP), dirs_exist_ok=True)
    book = mc.Book(root)
    written = []
    for path in book.chapters:
        doc = mc.docname(book, path)
        nb = mc.read_notebook(path)
        exercises = find_exercises(nb, doc)
        code_answers = {cid: e for e in exercises for cid in e.solutions}
        prose = {cid for e in exercises for cid in e.prose}
        cells = []
        for cell in nb["cells"]:
            cid = cell.get("id")
            if cid in code_answers:
                cell = {**cell, "source": mc.as_lines(stub(doc, code_answers[cid], mc.source(cell))), "outputs": [],
                        "execution_count": None}
            elif cid in prose:
                rest = SOLUTION_BLOCK.sub("", mc.source(cell))
                if not rest.strip():
                    continue
                cell = {**cell, "source": mc.as_lines(rest.rstrip() + "\n")}
            cells.append(cell)
        copy = dest / path.relative_to(root)
        copy.write_text(mc.dumps({**nb, "cells": cells}), encoding="utf-8")
        written.append(copy)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="folder to write into (default: student/)")
    parser.add_argument("--variant", help="write the editions of this graded variant (needs --out)")
    parser.add_argument("--book-without-solutions", type=pathlib.Path, metavar="DIR",
                        help="copy the book's sources to DIR with the solutions left out, for `jupyter-book build DIR`")
    args = parser.parse_args(argv)
    if args.variant and args.out == OUT:
        parser.error("--variant writes somewhere else than student/: give --out")
    try:
        if args.book_without_solutions:
            written = book_without_solutions(args.book_without_solutions)
            print(f"wrote {len(written)} chapters without solutions under {args.book_without_solutions}; "
                  f"build it with: PYTHONPATH={args.book_without_solutions} jupyter-book build {args.book_without_solutions}")
            return 0
        written = build(args.out, variant=args.variant)
    except (StudentError, mc.ConversionError) as exc:
        print(f"make_student: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} student editions under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
