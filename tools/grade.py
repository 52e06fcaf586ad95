"""Grade a folder of handed-in student editions with hidden tests, and write the scores, per-student feedback and a
gradebook an LMS imports.

Usage: python tools/grade.py SUBMISSIONS [--seed N] [-j N] [--variant NAME] [--points points.csv]
                             [--csv scores.csv] [--lms canvas|moodle --roster roster.csv --gradebook out.csv]
                             [--feedback folder] [--timeout 900] [--cell-timeout 300] [--memory-gb 6]
       (`make grade SUBMISSIONS=dir` runs it)

SUBMISSIONS holds one folder per student (`alice/12_one_merge.ipynb`, ...) or notebooks named
`<student>_NN_slug.ipynb`; the chapter is read from the notebook's `student_edition` metadata (tools/make_student.py
writes it) or its file name. Each notebook is graded thus (instructors.md, "Grading what students hand in"):
- what runs is the official chapter's own cells and, for each graded exercise, the cells the student wrote under
  it; anything else the student changed or added (a grading cell, a chapter cell, a cell that patches the library)
  is left out;
- it runs in its own process (tools/sandbox_runner.py), in a fresh folder that holds only that code and a copy of
  the library, under a CPU-time, memory and wall-clock limit, without network (a network namespace where the
  system allows one; an audit hook in any case), refused access to the course checkout and the submissions;
- right after an exercise's cells, the sandbox runs them again with the exercise's inputs replaced by hidden ones,
  drawn from the seed, the student and the exercise (tools/grading_specs.py), and sends the answers back as data;
  this process compares them with the library's answers on the same inputs, computed here, never in the sandbox;
- a cell that runs past its limit, exhausts memory or ends the process costs the exercise it belongs to: the
  sandbox starts again without that cell, and the other exercises are graded as usual.
An exercise scores its points (1 unless --points says otherwise) when every hidden answer matches, 0 otherwise,
with the reason: which name, what was expected in kind, and the first error in the student's own cells.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import csv
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]  # the library the hidden tests' answers come from: this checkout's
import grading_specs as gs
import make_colab as mc
import make_student as ms

RUNNER = (ROOT / "tools" / "sandbox_runner.py").read_text()


@dataclasses.dataclass
class Result:
    student: str
    chapter: str  # the chapter's document name, chapters/12_one_merge
    label: str  # the chapter's number, from its file name: "11"
    scores: dict[int, float]  # exercise number -> points scored
    reasons: dict[int, str]  # exercise number -> why it scored 0
    seconds: float  # wall-clock seconds grading took
    cpu_seconds: float | None  # processor seconds the sandbox used
    points: dict[int, float] = dataclasses.field(default_factory=dict)  # exercise number -> points possible
    titles: dict[int, str] = dataclasses.field(default_factory=dict)  # exercise number -> spec label
    ungraded: list[int] = dataclasses.field(default_factory=list)  # graded exercises with no hidden test yet


class Official:
    """The official chapters: each one's student edition, exercises and the hidden tests that grade them."""

    def __init__(self, root: pathlib.Path = ROOT, specs=None):
        self.root = root
        self.book = mc.Book(root)
        self.by_doc = {mc.docname(self.book, p): p for p in self.book.chapters}
        self.specs = gs.SPECS if specs is None else specs
        self._cache: dict[str, tuple[dict, list[ms.Exercise], dict]] = {}

    def chapter_of(self, nb: dict, path: pathlib.Path) -> str:
        doc = nb.get("metadata", {}).get("student_edition", {}).get("chapter")
        if doc in self.by_doc:
            return doc
        for candidate in self.by_doc:  # by file name: alice_12_one_merge.ipynb, 12_one_merge.ipynb
            if path.stem.endswith(candidate.rsplit("/", 1)[-1]):
                return candidate
        raise ValueError(f"{path}: cannot tell which chapter this is (no student_edition metadata, no chapter name)")

    def edition(self, doc: str) -> tuple[dict, list[ms.Exercise], dict]:
        """The student edition, its exercises, and exercise number -> the spec that grades it."""
        with PARSING:  # the edition parses the chapter's cells
            return self._edition(doc)

    def _edition(self, doc: str) -> tuple[dict, list[ms.Exercise], dict]:
        if doc not in self._cache:
            nb, exercises = ms.edition(self.book, self.by_doc[doc], self.specs)
            original = {c["id"]: mc.source(c) for c in mc.read_notebook(self.by_doc[doc])["cells"]}
            self._cache[doc] = nb, exercises, gs.specs_for(exercises, original, self.specs)
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


# ---------------------------------------------------------------------------------------------- what runs


def student_cells(nb: dict, edition: dict, exercises: list[ms.Exercise]) -> dict[int, list[str]]:
    """Exercise number -> the sources of the code cells the student wrote under it: from the exercise's statement
    (or its first answer cell) to its grading cell, or to the next exercise. Found by cell id, or, where an editor
    dropped the ids, by the stub's first line ("# Exercise N: your answer goes here")."""
    official = {c.get("id"): c for c in edition["cells"]}
    opens = {}
    for exercise in exercises:
        opens[exercise.statement] = opens[exercise.solutions[0] if exercise.solutions else None] = exercise.number
    closes = {e.check for e in exercises if e.check}
    found: dict[int, list[str]] = {e.number: [] for e in exercises}
    current = None
    for cell in nb.get("cells", []):
        cid, text = cell.get("id"), mc.source(cell)
        stub_mark = re.match(r"# Exercise (\d+)[: ]", text)
        if cid in opens and cid is not None:
            current = opens[cid]
        elif cid not in official and stub_mark and int(stub_mark.group(1)) in found:
            current = int(stub_mark.group(1))
        if cid in closes or (cell.get("cell_type") == "code" and "Grading cell for exercise" in text):
            current = None
            continue
        if cid in official and cid not in opens and cell.get("cell_type") == "markdown" and current is not None:
            if any(cid == e.statement for e in exercises):
                current = None
            continue
        solution = any(cid in e.solutions for e in exercises)
        if current is not None and cell.get("cell_type") == "code" and (solution or cid not in official):
            found[current].append(text)  # the chapter's own cells run as the chapter has them
    return found


def banned_words(sources: list[str], spec: gs.Spec) -> list[str]:
    """The forbidden or banned words an answer's cells use (names, attributes and operators, not comments)."""
    return used_words(sources, [*gs.ALWAYS_BANNED, *spec.banned, *map(forbidden_word, spec.forbidden)])


def forbidden_word(dotted: str) -> str:
    """The word an answer may not use for a forbidden function: its name (`attention_weights`), or, for a short
    name that other code uses too (`grad`, `mm`), its last two parts (`autograd.grad`, `torch.mm`)."""
    parts = dotted.split(".")
    return parts[-1] if len(parts[-1]) >= 5 else ".".join(parts[-2:])


# CPython 3.11 builds an AST with a recursion counter that two threads parsing at once can corrupt ("AST constructor
# recursion depth mismatch"): the grader's threads (-j) parse one at a time
PARSING = threading.RLock()


def used_words(sources: list[str], words: list[str]) -> list[str]:
    """Which of `words` the cells use: a name or attribute, a dotted name, a string that is a name or a dotted name
    (`getattr(x, "open")`; prose in a string or a docstring names nothing), the `@` operator, or a call (`name(`).
    A bare name the cells define themselves (`def softmax(xs)`) is the student's own, not the library's. Identifiers
    are read as Python reads them (NFKC: `ｓｏｆｔｍａｘ` is `softmax`)."""
    import ast
    import io
    import tokenize
    import unicodedata

    used = set()
    for text in sources:
        text = unicodedata.normalize("NFKC", text)
        try:
            tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                      if t.type in (tokenize.NAME, tokenize.OP)]
            with PARSING:
                tree = ast.parse(text)
        except (tokenize.TokenError, SyntaxError, IndentationError):
            continue  # a cell that does not parse fails in the sandbox, with its own message
        nodes = list(ast.walk(tree))
        dotted = {ast.unparse(n) for n in nodes if isinstance(n, (ast.Attribute, ast.Name))} | {
            f"{n.module}.{alias.name}" for n in nodes if isinstance(n, ast.ImportFrom) and n.module
            for alias in n.names}  # `from os import write as w` names os.write
        names = {t.string for t in tokens}
        attributes = {n.attr for n in nodes if isinstance(n, ast.Attribute)}
        imported = {part for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                    for alias in n.names for part in (*alias.name.split("."), alias.asname or "")}
        own = ({n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
               | {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
               | {n.arg for n in nodes if isinstance(n, ast.arg)}) - attributes - imported
        strings = [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and re.fullmatch(r"[A-Za-z_][\w.]*", n.value)]
        bare = {n.id for n in nodes if isinstance(n, ast.Name)}
        for word in words:
            if word in gs.BUILTINS:  # `eval(...)` is refused, `model.eval()` is not
                found = word in bare and word not in own
            else:
                found = (word in names and word not in own) or any(d.endswith("." + word) for d in dotted
                                                                   if "." in word) or word in dotted - own
            named = word.isidentifier() or "." in word
            in_strings = named and any(s == word or s.endswith("." + word) or word in s.split(".") for s in strings)
            if found or in_strings:
                used.add(word)
        if "@" in words and any(isinstance(n, ast.MatMult) for n in nodes):
            used.add("@")
        calls = {ast.unparse(n.func) for n in nodes if isinstance(n, ast.Call)}
        used.update(w for w in words if w.endswith("(") and w[:-1] in calls)  # "rotary(": that name called
    return sorted(used)


def encode_inputs(inputs: dict, spec: gs.Spec) -> dict:
    out = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            kind = "torch" if name in spec.torch_inputs else "numpy"
            out[name] = {"__array__": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape),
                         "kind": kind}
        else:
            out[name] = value
    return out


def decode_answer(value):
    """An answer sent by the sandbox, as NumPy arrays, numbers and lists; never a torch tensor or an object."""
    if isinstance(value, dict) and "__array__" in value:
        array = np.array(value["__array__"], dtype=np.float64 if value["dtype"].startswith(("float", "bfloat"))
                         else None)
        return array.reshape(value["shape"]) if array.size == int(np.prod(value["shape"])) else array
    if isinstance(value, dict) and "__type__" in value:
        return value
    if isinstance(value, dict):
        return {k: decode_answer(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_answer(v) for v in value]
    return value


def draw(seed: int, student: str, spec: gs.Spec, variant: str | None) -> list[tuple[dict, dict]]:
    """The hidden inputs of one exercise for one student (spec.draws sets of them), each with the exercise's
    parameters: from the seed, never stored."""
    digest = hashlib.sha256(f"{seed}\0{student}\0{spec.label}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    params = dict(spec.params)
    if variant and variant in spec.variants:
        params.update(spec.variants[variant][0])
    return [(spec.make(rng, params), params) for _ in range(spec.draws)]


# ---------------------------------------------------------------------------------------------- comparing


def describe_kind(value) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {tuple(value.shape)}"
    if isinstance(value, dict) and "__type__" in value:
        return "`...` (not answered yet)" if value["__type__"] == "ellipsis" else f"an object of type {value['__type__']}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"an object of type {type(value).__name__}"


def compare(name: str, check, got, expected, answers: dict, inputs: dict) -> str | None:
    """None if the answer passes; otherwise what was expected in kind, never the expected value."""
    if isinstance(check, gs.Holds):
        return check.test(answers, inputs)
    if isinstance(check, gs.Whole):
        value = np.asarray(got).item() if isinstance(got, (np.ndarray, np.generic)) and np.size(got) == 1 else got
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            return f"`{name}`: expected {check.describe()}, got {describe_kind(got)}"
        return None if int(value) == int(expected) else f"`{name}`: not {check.describe()} for these inputs"
    want = np.asarray(expected, dtype=np.float64)
    try:
        have = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return f"`{name}`: expected {check.kind} ({want.size} numbers), got {describe_kind(got)}"
    if have.shape != want.shape and have.size == want.size and have.squeeze().shape == want.squeeze().shape:
        have = have.reshape(want.shape)  # (1, 3) for (3,): the same numbers
    if have.shape != want.shape:
        return f"`{name}`: expected {check.kind}, shape {want.shape}; yours has shape {have.shape}"
    if np.allclose(have, want, rtol=check.rtol, atol=check.atol, equal_nan=False):
        return None
    wrong = int((~np.isclose(have, want, rtol=check.rtol, atol=check.atol)).sum())
    return f"`{name}`: expected {check.describe()}; {wrong} of {want.size} differ on the hidden inputs"


# ---------------------------------------------------------------------------------------------- the sandbox


# What the sandbox's process sees of the machine, where the system allows user namespaces (`unshare`): no network
# interface; its own process tree, so it cannot see or signal the grader or any other process (and whatever it starts
# ends with it); a file system read-only everywhere but its own folder, with the paths `covered` lists (the course
# checkout and the home folder but the Python environment, every submission) and this run's other sandboxes covered
# by empty ones. Run by `sh` as process 1 of the new tree, with the paths to cover as arguments, then the runner's
# command after `--`.
ISOLATE = r"""
set -e
own=$1; work=$2; shift 2
cd "$own"
while [ "$1" != "--" ]; do
    if [ -d "$1" ]; then mount -t tmpfs -o size=16k,mode=000 none "$1" || true
    elif [ -e "$1" ]; then mount --bind /dev/null "$1" || true; fi
    shift
done
shift
mount -t tmpfs -o size=16k none "$work"
mkdir -p "$own"
mount --no-canonicalize --bind . "$own"
cd "$own"
for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do
    case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/pts|/dev/pts/*|"$own") continue;; esac
    mount -o remount,bind,ro "$m" 2>/dev/null || true
done
"$@"
"""


def isolation_prefix() -> tuple[list[str], bool]:
    """The command that isolates a sandbox as ISOLATE says, and True; else `unshare -rn` (no network only) or
    nothing, and False: the sandbox's audit hook refuses sockets, processes and the course's paths either way."""
    unshare = shutil.which("unshare")
    if not unshare:
        return [], False
    full = [unshare, "-rn", "--pid", "--fork", "--mount-proc", "sh", "-c", ISOLATE, "sh"]
    with tempfile.TemporaryDirectory(prefix="grade-probe-") as probe:
        own = pathlib.Path(probe) / "own"
        own.mkdir()
        (own / "seen").touch()
        check = (f'[ -e "{own}/seen" ] && touch "{own}/w" && ! touch "{probe}/x" 2>/dev/null && '
                 '[ "$(cat /proc/1/comm)" = sh ]')
        if subprocess.run([*full, str(own), probe, "--", "sh", "-c", check], check=False,
                          capture_output=True).returncode == 0:
            return full, True
    if subprocess.run([unshare, "-rn", "true"], check=False, capture_output=True).returncode == 0:
        return [unshare, "-rn"], False
    return [], False


ISOLATION: tuple[list[str], bool] | None = None
WORK_ROOT: pathlib.Path | None = None


def work_root() -> pathlib.Path:
    """The folder that holds every sandbox of this grading run (covered, in each sandbox, by an empty one)."""
    global WORK_ROOT
    if WORK_ROOT is None:
        WORK_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="grade-"))
        atexit.register(shutil.rmtree, WORK_ROOT, True)
    return WORK_ROOT


SECRETS: list[pathlib.Path] = [pathlib.Path.home()]  # further paths no sandbox may see: the instructor's files


def covered(deny: list[pathlib.Path]) -> list[pathlib.Path]:
    """The paths to cover with empty ones: each denied path, or, where Python itself lives inside it (a virtual
    environment in the checkout), each of its entries but the ones that hold Python."""
    keep = {pathlib.Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}

    def expand(path: pathlib.Path) -> list[pathlib.Path]:
        if not path.exists():
            return []
        inside = [k for k in keep if k == path or path in k.parents]
        if not inside:
            return [path]
        if any(k == path for k in inside) or not path.is_dir():
            return []
        return [q for child in sorted(path.iterdir()) for q in expand(child)]

    found = []
    for path in {p.resolve() for p in [*deny, *SECRETS]}:
        found += [q for q in expand(path) if q not in found]
    return found


@dataclasses.dataclass
class Limits:
    timeout: float = 900  # wall-clock seconds for a whole notebook, every restart included
    cell_timeout: float = 300  # seconds one cell may run
    memory_gb: float = 6  # address space of the sandbox
    grace: float = 15  # seconds past a cell's limit before a sandbox that ignores it is ended


def sandbox(plan: dict, work: pathlib.Path, deny: list[pathlib.Path], limit: Limits, deadline: float):
    """Run a plan once in a fresh sandbox folder. Yield the runner's messages; stop when it ends or is killed.
    Return (via the last message) how it ended."""
    global ISOLATION
    if ISOLATION is None:
        ISOLATION = isolation_prefix()
    prefix, isolated = ISOLATION
    folder = pathlib.Path(tempfile.mkdtemp(prefix="student-", dir=work))
    shutil.copytree(ROOT / "lib", folder / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    allow = [folder, *{pathlib.Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}]
    cpu = max(10.0, deadline - time.monotonic())
    plan = {**plan, "deny": [str(p) for p in deny] + [str(work)], "allow": [str(p) for p in allow],
            "cpu_seconds": int(cpu) + 1, "memory_bytes": int(limit.memory_gb * 2**30)}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "MPLBACKEND": "Agg",
           "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "TRITON_CACHE_DIR": str(folder / ".triton"), "MPLCONFIGDIR": str(folder / ".mpl"), "LANG": "C.UTF-8"}
    python = [sys.executable, "-I", "-c", RUNNER]
    if isolated:
        command = [*prefix, str(folder), str(work_root()), *map(str, covered(deny)), "--", *python]
    else:
        command = [*prefix, *python]
    process = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        process.stdin.write(json.dumps(plan).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    buffer = bytearray()
    cell_started = time.monotonic()
    ended = "ended"
    try:
        while True:
            now = time.monotonic()
            if now > deadline:
                ended = "time limit (the notebook's)"
                break
            if now - cell_started > limit.cell_timeout + limit.grace:
                ended = "time limit"
                break
            ready, _, _ = select.select([process.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(process.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                buffer += chunk
                if len(buffer) > 80 * 2**20:  # the runner sends at most 64 MB at once
                    ended = "a message too large"
                    break
                start = len(buffer) - len(chunk)  # what came before held no line's end
                while (end := buffer.find(b"\n", start)) >= 0:
                    line, start = bytes(buffer[:end]), 0
                    del buffer[: end + 1]
                    try:
                        message = json.loads(line)
                    except ValueError:
                        continue
                    if "start" in message:
                        cell_started = time.monotonic()
                    yield message
    finally:
        try:  # the runner has said all it will: end it, and anything it left behind
            os.killpg(process.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        shutil.rmtree(folder, ignore_errors=True)
    code = process.returncode
    if ended == "ended" and code not in (0, None):
        code = -(code - 128) if isolated and code > 128 else code  # `sh` reports a signal N as 128 + N
        ended = {-9: "killed (CPU time or memory limit)", -24: "CPU time limit"}.get(code, f"exit status {code}")
    yield {"ended": ended, "cpu": usage.ru_utime + usage.ru_stime}


def build_plan(nb: dict, edition: dict, exercises: list[ms.Exercise], specs: dict[int, gs.Spec],
               hidden: dict[int, tuple[dict, dict]], limit: Limits) -> dict:
    """The cells the sandbox runs (the official chapter's, with the student's own under each exercise; no grading
    cell), and for each graded exercise its hidden inputs, answers and forbidden functions."""
    mine = student_cells(nb, edition, exercises)
    by_solution = {e.solutions[0]: e for e in exercises if e.solutions}
    skip = {cid for e in exercises for cid in [*e.solutions[1:], e.check] if cid}
    cells, plan_exercises = [], {}
    for cell in edition["cells"]:
        cid = cell.get("id")
        if cell["cell_type"] != "code" or cid in skip:
            continue
        if cid in by_solution:
            exercise = by_solution[cid]
            start = len(cells)
            for k, text in enumerate(mine[exercise.number], 1):
                refused = used_words([text], list(gs.ALWAYS_BANNED))
                if refused:  # never run: such a cell could reach the grader's machinery
                    text = f"raise PermissionError({f'not run: the cell uses {refused[0]}'!r})"
                cells.append({"source": text, "name": f"exercise {exercise.number}, your cell {k}"})
            if exercise.number in specs and exercise.number in hidden:
                spec = specs[exercise.number]
                plan_exercises[exercise.number] = {
                    "cells": list(range(start, len(cells))),
                    "inputs": [encode_inputs(inputs, spec) for inputs, _ in hidden[exercise.number]],
                    "answers": spec.answers, "forbidden": [*spec.forbidden, *spec.poison], "harness": spec.harness,
                    "refused": list(spec.forbidden),
                    "rerun": spec.rerun, "timeout": min(spec.timeout, limit.cell_timeout)}
            continue
        cells.append({"source": mc.source(cell), "name": f"chapter cell {cid}"})
    trusted = sorted({name for n in plan_exercises for name in specs[n].trusted})
    return {"cells": cells, "exercises": plan_exercises, "skip": [], "cell_timeout": limit.cell_timeout,
            "trusted": trusted}


def grade(path: pathlib.Path, folder: pathlib.Path, official: Official, seed: int = 0, limit: Limits | None = None,
          variant: str | None = None, points: dict | None = None) -> Result:
    limit = limit or Limits()
    start = time.monotonic()
    nb = json.loads(path.read_text(encoding="utf-8"))
    doc = official.chapter_of(nb, path)
    edition, exercises, specs = official.edition(doc)
    student = student_name(folder, path, doc)
    label = official.label(doc)
    graded = [e for e in exercises if e.graded and e.number in specs]
    reasons: dict[int, str] = {}
    hidden = {}
    mine = student_cells(nb, edition, exercises)
    for exercise in graded:
        spec = specs[exercise.number]
        if not any(text.strip() for text in mine[exercise.number]):
            reasons[exercise.number] = "no answer cell found"
            continue
        used = banned_words(mine[exercise.number], spec)
        if used:
            reasons[exercise.number] = (f"your answer uses {', '.join(f'`{w}`' for w in used)}, which this exercise "
                                        "does not allow (it asks you to write that part yourself)")
            continue
        hidden[exercise.number] = draw(seed, student, spec, variant)
    plan = build_plan(nb, edition, exercises, specs, hidden, limit)
    answers: dict[int, dict] = {}
    errors: dict[int, str] = {}  # exercise -> first error in the student's own cells
    owner = {i: n for n, e in plan["exercises"].items() for i in e["cells"]}
    for n, text in enumerate(plan["cells"]):
        match = re.match(r"exercise (\d+), your cell", text["name"])
        if match:
            owner[n] = int(match.group(1))
    deadline = start + limit.timeout
    cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="notebook-", dir=work_root()) as work:
        for _attempt in range(len(graded) + 2 if plan["exercises"] else 0):  # nothing to run without a hidden test
            running, hidden_running = None, None
            finished = False
            for message in sandbox(plan, pathlib.Path(work), official_deny(official, folder), limit, deadline):
                if "start" in message:
                    running, hidden_running = message["start"], message.get("hidden")
                elif "done" in message:
                    n = owner.get(message["done"])
                    if message["error"] and n is not None:
                        errors.setdefault(n, message["error"])
                    elif message["error"] and n is None:
                        errors.setdefault(0, f"{message['error']} (in the chapter's own cell)")
                    running = None
                elif "hidden" in message:
                    if "answers" in message:
                        answers[message["hidden"]] = message["answers"]
                    else:
                        errors.setdefault(message["hidden"], message["error"])
                        answers[message["hidden"]] = None
                    running, hidden_running = None, None
                elif "finished" in message:
                    finished = True
                elif "ended" in message:
                    cpu += message["cpu"]
                    ended = message["ended"]
            if finished or running is None or time.monotonic() > deadline:
                break
            # the process died or ran past its limit in cell `running`: that exercise scores 0, the rest go on
            n = hidden_running if hidden_running is not None else owner.get(running)
            if n is None:
                break
            errors[n] = f"{ended} in {'the hidden test' if hidden_running else plan['cells'][running]['name']}"
            answers[n] = None
            plan = {**plan, "skip": sorted({*plan["skip"], *plan["exercises"].get(n, {}).get("cells", [running])}),
                    "exercises": {k: v for k, v in plan["exercises"].items() if k not in answers}}
    scores, possible = {}, {}
    for exercise in graded:
        n = exercise.number
        possible[n] = float((points or {}).get(f"{label}.{n}", (points or {}).get(
            specs[n].label if n in specs else "", 1)))
        if n not in reasons:
            reasons[n] = judge(n, specs[n], hidden[n], answers.get(n), errors.get(n), time.monotonic() > deadline)
        if reasons[n] is None:
            del reasons[n]
        scores[n] = possible[n] if n not in reasons else 0.0
    titles = {n: s.label for n, s in specs.items()}
    ungraded = [e.number for e in exercises if e.graded and e.number not in specs]
    return Result(student, doc, label, scores, reasons, time.monotonic() - start, cpu, possible, titles, ungraded)


def official_deny(official: Official, folder: pathlib.Path) -> list[pathlib.Path]:
    """What the sandbox may not read: the course checkout (its solutions) and every submission."""
    return [official.root.resolve(), ROOT, folder.resolve()]


def judge(number: int, spec: gs.Spec, drawn: list[tuple[dict, dict]], sent, error: str | None,
          late: bool) -> str | None:
    """None if every hidden answer of an exercise passes on every draw, else why not."""
    if sent is None or len(sent) != len(drawn):
        return error or ("not run: the notebook's time limit" if late else "the hidden test did not run")
    for (inputs, params), answers in zip(drawn, sent):
        expected = spec.expect(inputs, params)
        answers = {name: decode_answer(value) for name, value in answers.items()}
        for name, check in spec.compare.items():
            why = compare(name, check, answers.get(name), expected.get(name), answers, inputs)
            if why:
                return why + (f" (the first error in your cells: {error})" if error else "")
    return None


# ---------------------------------------------------------------------------------------------- reports


def submissions(folder: pathlib.Path) -> list[pathlib.Path]:
    if not folder.is_dir():
        raise ValueError(f"SUBMISSIONS: {folder} is not a folder")
    found = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if not found:
        raise ValueError(f"SUBMISSIONS: no notebook under {folder}")
    return found


def number(value: float) -> str:
    return f"{value:g}"


def columns_of(results: list[Result]) -> list[tuple[int, str, int]]:
    return sorted({(int(r.label) if r.label.isdigit() else 0, r.label, n) for r in results for n in r.scores})


def table(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the score table: one row per student, one column per graded exercise, and the total."""
    columns = columns_of(results)
    names = [f"{label}.{n}" for _, label, n in columns]
    possible = {(r.label, n): p for r in results for n, p in r.points.items()}
    students = sorted({r.student for r in results})
    rows = []
    for student in students:
        mine = {(r.label, n): s for r in results if r.student == student for n, s in r.scores.items()}
        cells = [number(mine[(label, n)]) if (label, n) in mine else "-" for _, label, n in columns]
        total = sum(possible.get((label, n), 1) for _, label, n in columns)
        rows.append([student, *cells, f"{number(sum(mine.values()))}/{number(total)}"])
    return ["student", *names, "total"], rows


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def feedback(student: str, results: list[Result]) -> str:
    """One student's feedback: per chapter and exercise, the points, and why a test failed (never the answer)."""
    lines = [f"# Feedback for {student}", ""]
    for r in sorted(results, key=lambda r: (int(r.label) if r.label.isdigit() else 0)):
        got, possible = number(sum(r.scores.values())), number(sum(r.points.values()))
        lines += [f"## Chapter {r.label} ({r.chapter.rsplit('/', 1)[-1]}): {got} of {possible} points", ""]
        for n in sorted(r.scores):
            title = r.titles.get(n, "")
            head = f"- Exercise {n}{f' ({title})' if title else ''}: {number(r.scores[n])}/{number(r.points[n])}"
            lines.append(head + (f". {r.reasons[n]}" if n in r.reasons else ", passed on hidden inputs."))
        lines.append("")
    return "\n".join(lines)


def read_points(path: pathlib.Path) -> dict[str, float]:
    """The points file: rows `exercise,points`, the exercise as `4.2` or a spec label."""
    points = {}
    with path.open(newline="") as handle:
        for row in csv.reader(handle):
            if not row or row[0].startswith("#") or row[0] == "exercise":
                continue
            try:
                points[row[0].strip()] = float(row[1])
            except (IndexError, ValueError):
                raise ValueError(f"{path}: '{','.join(row)}' is not `exercise,points`") from None
    return points


def read_roster(path: pathlib.Path | None) -> dict[str, dict]:
    """The roster: a CSV with a `folder` column (the student's folder or file prefix) and the LMS's own columns
    (Canvas: name, id, sis_user_id, sis_login_id, section; Moodle: email)."""
    if path is None:
        return {}
    with path.open(newline="") as handle:
        return {row["folder"]: row for row in csv.DictReader(handle)}


def gradebook(results: list[Result], lms: str, roster: dict[str, dict]) -> list[list[str]]:
    """Rows for the LMS's gradebook import: one assignment column per chapter, points as numbers."""
    chapters = sorted({(int(r.label) if r.label.isdigit() else 0, r.label) for r in results})
    possible = {label: sum(r.points.values()) for r in results for _, label in [(0, r.label)]}
    titles = [f"Chapter {label} exercises" for _, label in chapters]
    students = sorted({r.student for r in results})
    got = {(r.student, r.label): sum(r.scores.values()) for r in results}
    if lms == "canvas":
        rows = [["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *titles],
                ["    Points Possible", "", "", "", "", *(number(possible[label]) for _, label in chapters)]]
        for s in students:
            who = roster.get(s, {})
            rows.append([who.get("name", s), who.get("id", ""), who.get("sis_user_id", s),
                         who.get("sis_login_id", ""), who.get("section", ""),
                         *(number(got[(s, label)]) if (s, label) in got else "" for _, label in chapters)])
        return rows
    rows = [["Email address", *titles]]
    for s in students:
        rows.append([roster.get(s, {}).get("email", s),
                     *(number(got[(s, label)]) if (s, label) in got else "" for _, label in chapters)])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", type=pathlib.Path, help="folder of handed-in student editions")
    parser.add_argument("--seed", type=int, help="the hidden tests' seed; keep it private (default: a new one)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="notebooks graded at once (1)")
    parser.add_argument("--variant", help="grade the exercises' variant of this name (tools/grading_specs.py)")
    parser.add_argument("--points", type=pathlib.Path, help="CSV of `exercise,points` (default: 1 each)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a whole notebook may run (900)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds one cell may run (300)")
    parser.add_argument("--memory-gb", type=float, default=6, help="address space of a sandbox, GiB (6)")
    parser.add_argument("--csv", type=pathlib.Path, help="also write the score table as CSV")
    parser.add_argument("--feedback", type=pathlib.Path, help="write one feedback file per student here")
    parser.add_argument("--lms", choices=("canvas", "moodle"), help="the gradebook's format")
    parser.add_argument("--gradebook", type=pathlib.Path, help="write the LMS gradebook CSV here (with --lms)")
    parser.add_argument("--roster", type=pathlib.Path, help="CSV mapping each `folder` to the LMS's columns")
    parser.add_argument("--course", type=pathlib.Path, default=ROOT,
                        help="the course whose chapters the grader uses (default: this checkout)")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.cell_timeout <= 0 or args.jobs < 1 or args.memory_gb <= 0:
        parser.error("--timeout, --cell-timeout, --memory-gb and -j must be positive")
    if bool(args.lms) != bool(args.gradebook):
        parser.error("--lms and --gradebook go together")
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    try:
        paths = submissions(args.submissions)
        official = Official(args.course)
        points = read_points(args.points) if args.points else {}
        roster = read_roster(args.roster)
    except (ValueError, OSError, KeyError, ms.StudentError, mc.ConversionError) as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    print(f"grading {len(paths)} notebooks with seed {seed}" + (f", variant {args.variant}" if args.variant else ""),
          file=sys.stderr)
    global ISOLATION
    ISOLATION = isolation_prefix()
    if not ISOLATION[1]:
        print("grade: this system does not allow user namespaces (`unshare`): the sandboxes share this machine's "
              "file system and processes, kept apart by an audit hook only; see instructors.md", file=sys.stderr)
    limit = Limits(args.timeout, args.cell_timeout, args.memory_gb)
    results, unreadable, seen, jobs = [], [], {}, []
    for path in paths:
        name = path.relative_to(args.submissions)
        try:
            nb = json.loads(path.read_text(encoding="utf-8"))
            doc = official.chapter_of(nb, path)
            official.edition(doc)
            student = student_name(args.submissions, path, doc)
            if (student, doc) in seen:
                raise ValueError(f"a second notebook of {doc} from {student} (the first: {seen[student, doc]})")
            seen[student, doc] = name
            jobs.append((name, path))
        except (ValueError, OSError, AttributeError, TypeError) as exc:  # one bad file stops nobody else's grading
            unreadable.append(f"  {name}: {' '.join(str(exc).split())[:200]}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(grade, path, args.submissions, official, seed, limit, args.variant, points): name
                   for name, path in jobs}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                result = future.result()
            except (ValueError, OSError) as exc:
                unreadable.append(f"  {name}: {' '.join(str(exc).split())[:200]}")
                continue
            print(f"graded {name} ({result.student}, chapter {result.label}) in {result.seconds:.0f} s "
                  f"({result.cpu_seconds:.0f} s of processor time)", file=sys.stderr)
            results.append(result)
    header, rows = table(results)
    print(render(header, rows))
    failures = [(r.student, f"{r.label}.{n}", why) for r in results for n, why in sorted(r.reasons.items())]
    if failures:
        print("\nWhy an exercise scored 0:")
        for student, exercise, why in sorted(failures):
            print(f"  {student}  {exercise}  {' '.join(why.split())[:300]}")
    ungraded = sorted({f"{r.label}.{n}" for r in results for n in r.ungraded})
    if ungraded:
        print(f"\nNo hidden test yet, so not in the scores (grade them by hand): {', '.join(ungraded)}")
    if unreadable:
        print("\nNot graded (fix or rename the file, then grade again):")
        print("\n".join(sorted(unreadable)))
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as handle:
            csv.writer(handle).writerows([header, *rows])
    if args.feedback:
        args.feedback.mkdir(parents=True, exist_ok=True)
        for student in sorted({r.student for r in results}):
            mine = [r for r in results if r.student == student]
            (args.feedback / f"{student}.md").write_text(feedback(student, mine), encoding="utf-8")
    if args.gradebook:
        args.gradebook.parent.mkdir(parents=True, exist_ok=True)
        with args.gradebook.open("w", newline="") as handle:
            csv.writer(handle).writerows(gradebook(results, args.lms, roster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
