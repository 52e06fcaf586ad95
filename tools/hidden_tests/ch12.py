"""The hidden tests of chapters/12_one_merge.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
