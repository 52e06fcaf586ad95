"""The hidden tests of chapters/03_why_sqrt_dk.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
