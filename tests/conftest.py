import os
import pathlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Two pytest workers share CI's two cores: one thread each keeps them from fighting.
torch.set_num_threads(1)

# Without a GPU, Triton's interpreter runs lib.flash's kernels on CPU tensors. Triton decides when it defines a
# kernel, so this must be set before anything imports lib.flash.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "default", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a passing browser check, say how much of the built book it covered."""
    ran_browser = any(r.nodeid.startswith("tests/test_book_browser.py") for r in terminalreporter.stats.get("passed", []))
    if exitstatus == 0 and ran_browser:
        from test_book_browser import summary

        counts = ", ".join(f"{n} {what}" for what, n in summary().items())
        terminalreporter.write_line(f"browser check of the built book: {counts}")
