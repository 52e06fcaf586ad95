"""What every chapter checks about its runtime before it starts: the course's version floors, and Triton.

The setup cell at the top of every chapter (``tools/setup_cell.py``) ends with :func:`check`. It reads versions from
the installed packages' metadata and imports none of them, so chapters 8 and 9 can still set ``TRITON_INTERPRET``
before Triton is first imported.

- **Floors** (:data:`FLOORS`): the oldest torch, Triton, NumPy, matplotlib and Altair every chapter is run on in CI
  (``requirements/floor.txt``, Colab's runtime of 2025-11). Below one, :func:`check` prints a line naming the package,
  the floor and the command that lifts it; the chapter still runs, and some cells may fail.
- **Triton**: Colab's CPU runtime has had no Triton since 2025-12 (torch's +cpu build does not require it), and the
  chapters' Triton kernels need it. Where it is missing, :func:`check` arms a finder: the first ``import
  triton`` (the chapter's, ``lib.flash``'s, or torch's own) installs the release this torch is built with
  (:data:`TRITON_FOR_TORCH`) with pip, prints one line saying so, and goes on. On a CPU the kernels then run in
  Triton's interpreter. Chapters that never import Triton install nothing. Where Triton cannot be installed (no
  Linux wheel for this platform, no network), the import fails with :func:`triton_hint`'s one-line advice.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import subprocess
import sys
import time

__all__ = ["FLOORS", "TRITON_FOR_TORCH", "check", "install_triton", "too_old", "triton_hint", "version_tuple"]

# package -> (oldest release the course is checked on, why that one). README.md says the same.
FLOORS = {
    "torch": ((2, 9), "an older torch pairs with a Triton that cannot run lib.flash"),
    "triton": ((3, 5), "Triton 3.1, torch 2.5's, cannot run lib.flash in its interpreter"),
    "numpy": ((2, 0), "the oldest release CI runs the chapters with (Colab's of 2025)"),
    "matplotlib": ((3, 10), "the oldest release CI runs the chapters with (Colab's of 2025)"),
    "altair": ((5, 5), "the oldest release CI runs the chapters with (Colab's of 2025)"),
}

# torch (major, minor) -> the Triton that PyPI's CUDA build of that torch requires (its wheel's metadata): the one
# to install beside a +cpu torch, which requires none.
TRITON_FOR_TORCH = {
    (2, 9): "triton==3.5.0",
    (2, 10): "triton==3.6.0",
    (2, 11): "triton==3.6.0",
    (2, 12): "triton~=3.7.0",
    (2, 13): "triton~=3.7.0",
    (2, 14): "triton~=3.8.0",
}


def version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu128' or '3.6.0rc1'."""
    if not isinstance(text, str):
        raise TypeError(f"a version is a string, got {type(text).__name__}")
    found = re.match(r"\s*(\d+)\.(\d+)", text)
    if not found:
        raise ValueError(f"not a version: {text!r}")
    return int(found.group(1)), int(found.group(2))


def installed(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _floor(package: str) -> str:
    return ".".join(map(str, FLOORS[package][0]))


def too_old(versions: dict[str, str | None] | None = None) -> list[str]:
    """One message per package below its floor (or absent; a missing Triton is :func:`check`'s other business).
    ``versions`` maps package names to version strings (None: absent); default, what is installed."""
    versions = {name: installed(name) for name in FLOORS} if versions is None else versions
    messages = []
    for name, ((major, minor), why) in FLOORS.items():
        found = versions.get(name)
        if found is None and name == "triton":
            continue
        if found is not None and version_tuple(found) >= (major, minor):
            continue
        state = "is not installed" if found is None else f"{found} is older than {major}.{minor}"
        messages.append(f"{name} {state}, the oldest this course runs on:\n{why}.\n"
                        f"Fix: pip install --upgrade '{name}>={major}.{minor}', then restart the kernel.")
    return messages


def triton_hint(platform: str | None = None) -> str:
    """One line: what a cell that needs Triton needs, and what to do where it is missing."""
    platform = sys.platform if platform is None else platform
    if platform != "linux":
        return ("this cell's kernels need Triton, which has no build for this system: run the chapter on Linux "
                "(Colab, WSL), where it runs even on a CPU")
    spec = TRITON_FOR_TORCH.get(version_tuple(installed("torch") or "0.0"), "triton")
    return (f"this cell's kernels need Triton: pip install {spec} (it runs on a CPU too), or choose a GPU "
            "runtime in Colab (Runtime > Change runtime type)")


def install_triton(run=subprocess.run, out=None) -> None:
    """Install the Triton this torch is built with, saying so in one line; ModuleNotFoundError with
    :func:`triton_hint` where that is impossible. ``run`` is :func:`subprocess.run` (a test passes its own)."""
    out = sys.stdout if out is None else out
    torch_version = installed("torch")
    spec = TRITON_FOR_TORCH.get(version_tuple(torch_version)) if torch_version else None
    if sys.platform != "linux" or spec is None:
        raise ModuleNotFoundError(triton_hint(), name="triton")
    print(f"This runtime has no Triton: installing {spec}, the release torch {torch_version} is built with "
          "(on a CPU, the kernels run in its interpreter)...", end=" ", file=out, flush=True)
    start = time.perf_counter()
    done = run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", spec],
               capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print("failed.", file=out, flush=True)
        raise ModuleNotFoundError(triton_hint(), name="triton")
    print(f"done in {time.perf_counter() - start:.0f} s.", file=out, flush=True)
    importlib.invalidate_caches()


class _TritonOnDemand(importlib.abc.MetaPathFinder):
    """Installs Triton the first time something imports it, then lets the ordinary path finder find it. An install
    that failed is not retried: every later import of Triton fails with the same one-line advice."""

    def __init__(self):
        self.failure = None

    def find_spec(self, name, path=None, target=None):
        if name != "triton":
            return None
        if self.failure is None:
            try:
                install_triton()
            except ModuleNotFoundError as err:
                self.failure = str(err)
                raise
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            return importlib.machinery.PathFinder.find_spec(name, path)
        raise ModuleNotFoundError(self.failure, name="triton")


def check(out=None) -> None:
    """The setup cell's check: a line for each package below its floor; Triton installed on first use if absent."""
    out = sys.stderr if out is None else out
    for message in too_old():
        print(message, file=out)
    if installed("triton") is None and not any(isinstance(f, _TritonOnDemand) for f in sys.meta_path):
        sys.meta_path.append(_TritonOnDemand())
