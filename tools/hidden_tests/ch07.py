"""The hidden tests of chapters/07_complexity_and_tiling.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
