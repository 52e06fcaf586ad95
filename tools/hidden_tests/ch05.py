"""The hidden tests of chapters/05_masking_and_cross_attention.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
