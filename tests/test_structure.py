"""The library's rooms: which module imports which, and where each public name lives.

The import graph of lib/ is read from the source (every ``from lib import x``, ``from lib.x import ...`` and
``import lib.x``, at the top of a module or inside a function) and must have no cycle; the reference,
lib/attention.py, imports only the plumbing below it; and every public name is exported (listed in ``__all__``)
by exactly one module.
"""

import ast
import importlib
import pathlib

import pytest

LIB = pathlib.Path(__file__).resolve().parent.parent / "lib"
MODULES = sorted(p.stem for p in LIB.glob("*.py") if p.stem != "__init__")


def imports_of(name):
    """The lib modules that lib/<name>.py imports, anywhere in the file."""
    tree = ast.parse((LIB / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "lib":
                found |= {a.name for a in node.names if a.name in MODULES}
            elif node.module.startswith("lib."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("lib.")}
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycle(graph):
    """A list of modules forming a cycle, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_import_graph_of_lib_has_no_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_reference_imports_only_the_plumbing_below_it():
    assert GRAPH["attention"] <= {"backend", "speed"}
    assert GRAPH["backend"] == set()
    assert GRAPH["cost"] == set()  # counting imports nothing: lib.decoding and the kernels import it
    assert "nn" not in GRAPH["modules"]


@pytest.mark.parametrize("name", MODULES)
def test_each_module_lists_only_names_it_defines(name):
    module = importlib.import_module(f"lib.{name}")
    for public in getattr(module, "__all__", []):
        assert hasattr(module, public), f"lib.{name}.__all__ lists {public}, which it does not have"


def test_every_public_name_is_exported_from_one_module():
    owners = {}  # each public object: the modules whose __all__ lists it
    for name in MODULES:
        module = importlib.import_module(f"lib.{name}")
        for public in getattr(module, "__all__", []):
            owners.setdefault((public, id(getattr(module, public))), []).append(name)
    shared = {public: where for (public, _), where in owners.items() if len(where) > 1}
    assert not shared, shared
    assert importlib.import_module("lib.cost").choose_num_splits.__module__ == "lib.cost"


def test_no_module_hands_out_names_lazily():
    for name in MODULES:
        tree = ast.parse((LIB / f"{name}.py").read_text())
        top = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert "__getattr__" not in top, f"lib/{name}.py defines a module __getattr__"
