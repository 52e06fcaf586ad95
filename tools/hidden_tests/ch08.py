"""The hidden tests of chapters/08_gpu_cost.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
