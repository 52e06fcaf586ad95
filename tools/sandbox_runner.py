"""What runs inside a student's sandbox (tools/grade.py starts it with `python -I -c <this file's text>`).

It reads a plan from standard input: the notebook's code cells (the official chapter's own cells and, for each graded
exercise, the cells the student wrote), and for each exercise the hidden inputs, the names of its answers and the
library functions its answer may not call. It runs the cells in order in one namespace, each under a time limit, then,
right after an exercise's cells, runs them once more in a copy of the namespace whose inputs are the hidden ones, and
sends the answers found there back as plain data (JSON), never as objects: the grader compares them in another
process. Nothing in this process decides a score.

Before any cell runs, an audit hook refuses to open the paths named in the plan (the course checkout, the submissions),
to start processes (also those multiprocessing starts, which raise no audit event) and to open network sockets;
the grader adds the rlimits and, where the system allows, namespaces of its own (no network, its own process tree,
a read-only file system: tools/grade.py, ISOLATE).
"""

import json
import linecache
import os
import signal
import sys
import traceback

PLAN: dict = {}
CHANNEL = None


LARGEST = 64 * 2**20  # characters of one message: an answer larger than this is refused


def send(**message):
    text = json.dumps(message, allow_nan=True)
    if len(text) > LARGEST:
        text = json.dumps({k: v for k, v in message.items() if k != "answers"} | {
            "error": f"your answers are too large to send back ({len(text) / 2**20:.0f} MB)"})
    CHANNEL.write(text + "\n")


DENY: tuple = ()
ALLOW: tuple = ()
REFUSED = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "pty.spawn", "socket.connect", "socket.bind", "socket.getaddrinfo", "sys.addaudithook"}
started = False
TIMED_OUT = set()  # the cells that ran past their limit
TRUSTED = []  # (owner, name, value) of what the hidden tests rely on, from before the first student cell


def audit(event, args):
    if event in REFUSED and started:
        raise PermissionError(f"a graded notebook may not use {event}")
    if event in ("open", "os.listdir", "os.scandir", "os.chdir", "shutil.copyfile") and args and started:
        path = args[0]
        if isinstance(path, int) or path is None:
            return
        try:
            real = os.path.realpath(os.fsdecode(path)) + os.sep
        except (TypeError, ValueError):
            return
        if real.startswith(DENY) and not real.startswith(ALLOW):
            raise PermissionError(f"a graded notebook may not read {os.fsdecode(path)}")


class TimeLimit(BaseException):
    pass


def on_alarm(signum, frame):
    raise TimeLimit(f"time limit: the cell ran past {PLAN['cell_timeout']:.0f} s")


def first_error(exc, filename):
    """The exception, and the line of the student's own cell where it arose (the deepest frame in that cell)."""
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(("<exercise", "<chapter", "<the hidden")):  # not the runner's own frames
            where = f" ({frame.filename[1:-1]}, line {frame.lineno}: {(frame.line or '').strip()[:80]})"
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:300] + where


def run_cell(source, filename, namespace, limit):
    """Run one cell; return None or the first error, as text."""
    linecache.cache[f"<{filename}>"] = (len(source), None, source.splitlines(True), f"<{filename}>")
    try:
        code = compile(source, f"<{filename}>", "exec")
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg} ({filename}, line {exc.lineno})"
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        exec(code, namespace)  # noqa: S102 (the sandbox's one purpose)
        return None
    except BaseException as exc:  # noqa: BLE001 (a student's SystemExit or KeyboardInterrupt costs their cell only)
        return first_error(exc, filename)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def decode(value):
    if isinstance(value, dict) and "__array__" in value:
        import numpy as np

        array = np.array(value["__array__"], dtype=value["dtype"]).reshape(value["shape"])
        if value["kind"] == "torch":
            import torch

            return torch.from_numpy(array)
        return array
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def encode(value, depth=0):
    """An answer as plain data: arrays and tensors as nested lists with their dtype, numbers, strings, lists, dicts;
    anything else as its type's name."""
    if depth > 4:
        return {"__type__": type(value).__name__}
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "detach"):
        value = value.detach().cpu()
        return {"__array__": value.double().tolist() if value.is_floating_point() else value.tolist(),
                "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape), "kind": "torch"}
    if module == "numpy" and hasattr(value, "shape"):
        import numpy as np

        value = np.asarray(value)
        plain = value.astype(float).tolist() if value.dtype.kind in "fc" else value.tolist()
        return {"__array__": plain, "dtype": str(value.dtype), "shape": list(value.shape), "kind": "numpy"}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v, depth + 1) for k, v in value.items()}
    return {"__type__": type(value).__name__}


def owner_of(dotted):
    """Where a dotted name lives: "torch.Tensor.matmul" is the class torch.Tensor's "matmul"; (None, None) if
    nowhere."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part, None)
        return (owner, parts[-1]) if owner is not None and hasattr(owner, parts[-1]) else (None, None)
    return None, None


def snapshot(dotted_names):
    """What the hidden tests rely on, as it is before any student cell runs, to be put back before each test."""
    return [(owner, attr, getattr(owner, attr)) for owner, attr in map(owner_of, dotted_names) if owner is not None]


def poison(namespace, dotted_names):
    """Replace each library function an exercise may not call, in its module and wherever the namespace holds it."""
    undo = []
    for dotted in dotted_names:
        module, attr = owner_of(dotted)
        if module is None:
            continue
        original = getattr(module, attr)

        def refused(*args, _name=dotted, **kwargs):
            raise PermissionError(f"this exercise asks you to write what {_name} does, not to call it")

        undo.append((module, attr, original))
        setattr(module, attr, refused)
        for key, value in list(namespace.items()):  # the notebook's names, and what they hold one level down
            if value is original:
                undo.append((namespace, key, original))
                namespace[key] = refused
            elif isinstance(value, (list, dict)):
                for k in list(range(len(value)) if isinstance(value, list) else value):
                    if value[k] is original:
                        undo.append((value, k, original))
                        value[k] = refused
            elif callable(value) and hasattr(value, "__defaults__"):  # a function's defaults and closure
                for kind in ("__defaults__", "__kwdefaults__"):
                    held = getattr(value, kind, None) or ()
                    if any(v is original for v in (held.values() if isinstance(held, dict) else held)):
                        swapped = ({k: refused if v is original else v for k, v in held.items()}
                                   if isinstance(held, dict) else tuple(refused if v is original else v for v in held))
                        undo.append((value, kind, held))
                        setattr(value, kind, swapped)
                for cell in getattr(value, "__closure__", None) or ():
                    try:
                        if cell.cell_contents is original:
                            undo.append((cell, "cell_contents", original))
                            cell.cell_contents = refused
                    except ValueError:  # an empty cell
                        pass
    return undo


def restore(undo):
    for owner, key, original in reversed(undo):
        if isinstance(owner, (list, dict)):
            owner[key] = original
        else:
            setattr(owner, key, original)


def hidden(number, exercise, namespace):
    """Run an exercise's cells again on each draw of hidden inputs, then its harness; send back the answers as data.
    The notebook's namespace is put back as it was after each draw (the chapter's functions read their globals
    from it)."""
    sent = []
    if TIMED_OUT.intersection(exercise["cells"]):
        send(hidden=number, error="not run: your cell ran past its time limit")
        return
    for inputs in exercise["inputs"]:
        for owner, attr, value in TRUSTED:  # whatever the student's cells did to them
            setattr(owner, attr, value)
        before = dict(namespace)
        for name, value in inputs.items():
            namespace[name] = decode(value)
        undo = poison(namespace, exercise["forbidden"])
        try:
            sources = [(PLAN["cells"][i]["source"], PLAN["cells"][i]["name"]) for i in exercise["cells"]
                       if exercise["rerun"]]
            if exercise["harness"]:
                sources.append((exercise["harness"], "the hidden test"))
            for source, name in sources:
                error = run_cell(source, name, namespace, exercise["timeout"])
                if error:
                    send(hidden=number, error=error)
                    return
            missing = [n for n in exercise["answers"] if n not in namespace]
            if missing:
                send(hidden=number, error=f"NameError: {', '.join(missing)} not defined by your answer")
                return
            sent.append({n: encode(namespace[n]) for n in exercise["answers"]})
        finally:
            restore(undo)
            added = {name: value for name, value in namespace.items() if name not in before}
            namespace.clear()
            namespace.update(before)
            # Triton's interpreter copies its own globals into a kernel's globals (this namespace) the first time it
            # runs the kernel, and the kernel it caches reads them there on every later launch: they stay
            interpreter = sys.modules.get("triton.runtime.interpreter")
            namespace.update({name: value for name, value in added.items()
                              if interpreter is not None and getattr(interpreter, name, None) is value})
    send(hidden=number, answers=sent)


def main():
    global PLAN, CHANNEL, DENY, ALLOW, started
    PLAN = json.loads(sys.stdin.read())
    CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open("notebook.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.path.insert(0, os.getcwd())
    os.environ["MPLBACKEND"] = "Agg"
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (PLAN["cpu_seconds"], PLAN["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_AS, (PLAN["memory_bytes"], PLAN["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**20, 256 * 2**20))
    DENY = tuple(os.path.realpath(p) + os.sep for p in PLAN["deny"])
    ALLOW = tuple(os.path.realpath(p) + os.sep for p in PLAN["allow"])
    sys.addaudithook(audit)
    import _posixsubprocess  # multiprocessing starts its processes through this, and raises no audit event

    def no_processes(*args, **kwargs):
        raise PermissionError("a graded notebook may not start processes")

    _posixsubprocess.fork_exec = no_processes
    signal.signal(signal.SIGALRM, on_alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exercises = {int(k): v for k, v in PLAN["exercises"].items()}
    last_cell = {v["cells"][-1]: k for k, v in exercises.items() if v["cells"]}
    first_cell = {v["cells"][0]: k for k, v in exercises.items() if v["cells"]}
    started = True
    refusing = []  # while an exercise's own cells run, the library functions it asks the student to write raise
    for index, cell in enumerate(PLAN["cells"]):
        if index in PLAN["skip"]:
            continue
        if index in first_cell and not TRUSTED:
            TRUSTED[:] = snapshot(PLAN.get("trusted", []))
        if index in first_cell:
            refusing = poison(namespace, exercises[first_cell[index]].get("refused", []))
        send(start=index)
        error = run_cell(cell["source"], cell["name"], namespace, PLAN["cell_timeout"])
        if index in last_cell:
            restore(refusing)
            refusing = []
        if error and error.startswith("TimeLimit"):
            TIMED_OUT.add(index)
        send(done=index, error=error)
        if index in last_cell:
            number = last_cell[index]
            send(start=index, hidden=number)
            hidden(number, exercises[number], namespace)
    send(finished=True)


if __name__ == "__main__":
    main()
