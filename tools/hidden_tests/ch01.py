"""The hidden tests of chapters/01_token_by_token.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

SPECS: list = []
