"""Chapter 13's hidden tests (tools/hidden_tests/ch13.py), proven both ways on the real chapter: the official
solutions and answers written apart from them score every graded exercise (1, 2, 3 and 5; 4 is answered in words),
typical mistakes and cheats score none."""

import sys

import pytest
from grading_helpers import (
    ROOT,
    proven_both_ways,
)

sys.path.insert(0, str(ROOT / "tools"))
import grade

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH13 = "chapters/13_variants.ipynb"

CORRECT = {  # from the statements: a zero logit appended to torch's softmax, another band, other containers, a
    # float64 while loop
    1: '''def softmax_one(scores):
    zero = torch.zeros_like(scores[..., :1])
    return torch.softmax(torch.cat([scores, zero], dim=-1), dim=-1)[..., :-1]''',
    2: '''def band(n, window):
    future = torch.ones(n, n, dtype=torch.bool).triu(1)  # j > i
    recent = torch.ones(n, n, dtype=torch.bool).triu(1 - window)  # j > i - window
    return recent & ~future


def band_count(n, window):
    return band(n, window).sum()


band_total = int(band_count(1000, 100))''',
    3: '''def mla_bytes_per_token(layers, latent, rope_dim, bytes_per_number):
    per_layer = latent + rope_dim  # shared by every head
    return float(per_layer * layers * bytes_per_number)


def mha_bytes_per_token(layers, heads, head_dim, bytes_per_number):
    keys = values = heads * head_dim
    return torch.tensor(layers * (keys + values) * bytes_per_number)


v2_mla = mla_bytes_per_token(60, 512, 64, 2)
v2_mha = mha_bytes_per_token(60, 128, 128, 2)
v2_ratio = v2_mha / v2_mla''',
    5: '''qd, kd, vd = q5.double(), k5.double(), v5.double()


def phi(x):
    return torch.where(x > 0, x + 1, torch.exp(x))


S_state = torch.zeros(kd.shape[-1], vd.shape[-1], dtype=torch.float64)
z_state = torch.zeros(kd.shape[-1], dtype=torch.float64)
state_outputs = []
t = 0
while t < qd.shape[0]:
    S_state = S_state + phi(kd[t])[:, None] * vd[t][None, :]
    z_state = z_state + phi(kd[t])
    state_outputs.append((phi(qd[t]) @ S_state) / phi(qd[t]).dot(z_state))
    t += 1''',
}
WRONG = {  # one submission, since each run of this chapter costs seconds: softmax_one shifted by the row's maximum
    # alone (NaN for a row whose keys are all masked); the library's mask and count; the printed bytes typed in;
    # the sizes of the chapter's tensors typed in
    1: ("official", "scores.amax(-1, keepdim=True).clamp(min=0)", "scores.amax(-1, keepdim=True)"),
    2: "def band(n, window):\n    return vr.sliding_window_mask(n, n, window)\n\n\n"
       "def band_count(n, window):\n    return cost.band_scores(n, window)\n\n\nband_total = 95050",
    3: "def mla_bytes_per_token(layers, latent, rope_dim, bytes_per_number):\n    return 69120\n\n\n"
       "def mha_bytes_per_token(layers, heads, head_dim, bytes_per_number):\n    return 3932160\n\n\n"
       "v2_mla, v2_mha = 69120, 3932160\nv2_ratio = v2_mha / v2_mla",
    5: ("official", "d, d_v = k5.shape[1], v5.shape[1]", "d, d_v = 4, 4"),
}


def test_chapter_13_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH13, CORRECT, {"wrong": WRONG}, {
        ("wrong", 1): "`weights_h`: expected softmax_one(scores)",
        ("wrong", 2): "your answer uses `band_scores`, `sliding_window_mask`",
        ("wrong", 3): "`mla_h`: not mla_bytes_per_token's bytes",
        ("wrong", 5): "RuntimeError: The size of tensor",
    }, grade.Limits(timeout=300, cell_timeout=120))
