"""Build the package sets of requirements/ (Colab's GPU runtime, its CPU runtime, the course's floor) into virtual
environments, and run every Colab edition in each, as Colab's *Run all* would.

    python tools/package_sets.py build requirements/colab-gpu.txt      # the environment only
    python tools/package_sets.py run requirements/colab-cpu.txt         # build if needed, then run colab/
    python tools/package_sets.py run requirements/floor.txt colab/chapters/07_complexity_and_tiling.ipynb

A set is a pip requirements file with two comment lines the tool reads: `# python: 3.13` (the interpreter Colab
uses: found as python3.13 on PATH, in pyenv, or through uv; where none is, the machine's Python runs the set and
the tool says so) and `# without: triton` (packages pip brings in as dependencies that the runtime does not have,
removed after the install). Environments live in .venv-sets/NAME (or --into), rebuilt only when the set file
changes: installing is the only step that downloads. A run passes when every notebook reaches its end with no
error but its cells tagged `raises-exception`; each notebook runs alone (tools/run_chapters.py), in its own folder.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lib.runtime import TRITON_FOR_TORCH, version_tuple

DEFAULT_INTO = ROOT / ".venv-sets"


def read_set(path: pathlib.Path) -> dict:
    """The set's name, Python version, packages to remove after the install, and pinned requirement lines."""
    text = path.read_text()
    python = re.search(r"^# python: *(\d+\.\d+) *$", text, re.MULTILINE)
    if not python:
        raise ValueError(f"{path}: no '# python: X.Y' line")
    without = [name for line in re.findall(r"^# without: *(.+)$", text, re.MULTILINE) for name in line.split()]
    pins = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    loose = [pin for pin in pins if "==" not in pin]
    if loose:
        raise ValueError(f"{path}: every package is pinned with ==, not {loose}")
    return {"name": path.stem, "python": python.group(1), "without": without, "pins": pins,
            "digest": hashlib.sha256(text.encode()).hexdigest()}


def find_python(version: str) -> tuple[str, bool]:
    """An interpreter of this X.Y version, and whether it is one (else the machine's own Python)."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv")) / "versions"
    candidates += sorted(str(p / "bin" / "python") for p in pyenv.glob(f"{version}.*"))
    if shutil.which("uv"):
        found = subprocess.run(["uv", "python", "find", version], capture_output=True, text=True, check=False)
        candidates.append(found.stdout.strip() if found.returncode == 0 else None)
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate, True
    return sys.executable, False


def torch_pin(spec: dict) -> str:
    return next(pin for pin in spec["pins"] if pin.lower().startswith("torch=="))


def site_packages(env: pathlib.Path) -> pathlib.Path:
    (found,) = (env / "lib").glob("python3.*/site-packages")
    return found


def build(set_path: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """The set's environment, built (or rebuilt after the set changed); prints what it used and how long it took."""
    spec = read_set(set_path)
    env = into / spec["name"]
    stamp = env / ".set-sha256"
    if stamp.is_file() and stamp.read_text().strip() == spec["digest"]:
        return env
    python, exact = find_python(spec["python"])
    found = subprocess.run([python, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if not exact:
        print(f"{spec['name']}: no Python {spec['python']} on this machine; using {found} ({python})", flush=True)
    start = time.perf_counter()
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(env)], check=True)
    site = site_packages(env)
    sibling = next((other for other in sorted(into.glob("*/.set-pins")) if other.parent != env
                    and other.read_text().splitlines()[:2] == [found, torch_pin(spec)]), None)
    if sibling:  # a set with the same Python and torch: start from its files, hard-linked (GBs, no copy)
        shutil.rmtree(site)
        shutil.copytree(site_packages(sibling.parent), site, copy_function=os.link, symlinks=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *spec["pins"]], check=True)  # on a sibling's files: only what differs
    if spec["without"]:
        # What the setup cell installs when a notebook needs it (lib.runtime.TRITON_FOR_TORCH), fetched now.
        torch_version = torch_pin(spec).split("==")[1]
        wanted = [TRITON_FOR_TORCH[version_tuple(torch_version)] if name == "triton" else name
                  for name in spec["without"]]
        subprocess.run([*pip[:3], "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest",
                        str(env / "wheelhouse"), *wanted], check=True)
        subprocess.run([*pip[:3], "uninstall", "--quiet", "--yes", *spec["without"]], check=True)
    stamp.write_text(spec["digest"] + "\n")
    (env / ".set-pins").write_text("\n".join([found, torch_pin(spec), *spec["pins"]]) + "\n")
    size = sum(f.stat().st_size for f in env.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30
    shared = f", starting from {sibling.parent.name}'s files" if sibling else ""
    print(f"{spec['name']}: built with {found} in {time.perf_counter() - start:.0f} s, {size:.1f} GiB{shared}",
          flush=True)
    return env


def notebooks() -> list[str]:
    """Every Colab edition in the checkout now: the chapters, then the guide's pages."""
    found = [*sorted((ROOT / "colab" / "chapters").glob("*.ipynb")), *sorted((ROOT / "colab" / "guide").glob("*.ipynb"))]
    return [str(p) for p in found]


VERSIONS = """import sys, importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
names = ("torch", "triton", "numpy", "matplotlib", "altair")
print(f"Python {sys.version.split()[0]}", *(f"{n} {version(n)}" for n in names), sep=", ")
"""


def run(set_path: pathlib.Path, into: pathlib.Path, paths: list[str], timeout: int) -> int:
    """Run each notebook alone in the set's environment; 1 if any stopped on an error. A package the set is
    without is removed again after each notebook, so every notebook meets the runtime as Colab gives it."""
    spec = read_set(set_path)
    env = build(set_path, into)
    python = str(env / "bin" / "python")
    versions = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True, check=True).stdout.strip()
    print(f"{spec['name']}: {versions}", flush=True)
    # Nothing is downloaded while notebooks run: the setup cell finds lib/ above colab/ (a clone would go nowhere),
    # and pip, when the setup cell installs Triton, reads only the wheels fetched into the environment at build time.
    environ = dict(os.environ, COURSE_REPO_URL="file:///nonexistent", PYTHONPATH=str(ROOT), PIP_NO_INDEX="1",
                   PIP_FIND_LINKS=str(env / "wheelhouse"))
    failed, paths = 0, paths or notebooks()
    remove = [python, "-m", "pip", "uninstall", "--quiet", "--yes", *spec["without"]]
    if spec["without"]:  # left behind by a run that was stopped
        subprocess.run(remove, capture_output=True, check=False)
    for path in paths:
        command = [python, str(ROOT / "tools" / "run_chapters.py"), "--jobs", "1", "--timeout", str(timeout),
                   "--out", str(env / "executed"), path]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, env=environ, capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the runner and its kernel, whatever the load
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        failed += done.returncode != 0
        lines = done.stdout.splitlines()
        executed = env / "executed" / pathlib.Path(path).name
        said = executed.read_text() if executed.is_file() else ""
        installed = ", the setup cell installed Triton" if "This runtime has no Triton" in said else ""
        status = lines[0] if lines else done.stderr.strip()[-300:]
        print(f"{spec['name']}: {status} ({cpu:.0f} s of CPU{installed})", flush=True)
        if spec["without"]:
            subprocess.run(remove, capture_output=True, check=False)
    print(f"{spec['name']}: {len(paths) - failed} of {len(paths)} notebooks ran to the end", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("set", type=pathlib.Path, help="a package set, requirements/NAME.txt")
    parser.add_argument("notebooks", nargs="*", help="default: every notebook in colab/chapters and colab/guide")
    parser.add_argument("--into", type=pathlib.Path, default=DEFAULT_INTO, help="where environments live")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.set, args.into)
        return 0
    return run(args.set, args.into, args.notebooks, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
