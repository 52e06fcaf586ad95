"""Chapter 3's hidden tests, proven both ways on the real chapter: the official solutions and answers written apart
from them (float32, torch, a list, another loop) get full marks; typical mistakes, numbers typed in, a formula
returned where a sample was asked for, the wrong distribution and autograd instead of the formula score 0."""

import math
import sys

import numpy as np
import pytest
from grading_helpers import ROOT, proven_both_ways

sys.path.insert(0, str(ROOT / "tools"))
import grade
from hidden_tests import ch03

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH3 = "chapters/03_why_sqrt_dk.ipynb"

CORRECT = {
    1: '''def uniform_dots(d_k, samples, rng):
    pairs = rng.uniform(-(3**0.5), 3**0.5, size=(2, samples, d_k)).astype(np.float32)
    return np.einsum("nd,nd->n", pairs[0], pairs[1])


ratios = [np.var(uniform_dots(d, 20_000, np.random.default_rng(9))) / d for d in (16, 256)]''',
    2: '''def scale_for(sigma, d_k):
    return math.sqrt(d_k * sigma**4)


def dot_variance(sigma, d_k, samples, rng):
    q = sigma * torch.from_numpy(rng.standard_normal((samples, d_k)))
    k = sigma * torch.from_numpy(rng.standard_normal((samples, d_k)))
    return torch.var((q * k).sum(-1), unbiased=False)  # a 0-d tensor


sigma, d_k = 2, 64
var = float(dot_variance(sigma, d_k, 20_000, np.random.default_rng(5)))
c = scale_for(sigma, d_k)''',
    3: '''def saturation_table(scores, factors):
    s = torch.tensor(np.asarray(scores), dtype=torch.float64)
    norms, tops = [], []
    for f in factors:
        w = torch.softmax(f * s, dim=0)
        jac = torch.diag(w) - w[:, None] * w[None, :]
        norms.append(jac.pow(2).sum().sqrt().item())
        tops.append(w.max().item())
    return np.array(norms), np.array(tops)


def first_over_half(scores, factors):
    _, tops = saturation_table(scores, factors)
    for f, t in zip(factors, tops):
        if t > 0.5:
            return f


norms_c, tops_c = saturation_table(small, [1, 2, 5, 10, 20, 50])
first_c = first_over_half(small, [1, 2, 5, 10, 20, 50])''',
    4: '''def self_score_theory(d_k):
    return [float(d_k), 2.0 * d_k, d_k / math.sqrt(d_k)]


def self_scores(d_k, samples, rng):
    return np.square(rng.normal(size=(samples, d_k))).sum(-1).tolist()  # a list


self_stats = {}
for d in (16, 256):
    x = np.array(self_scores(d, 20_000, np.random.default_rng(d)))
    self_stats[d] = (x.mean(), x.var(), x.mean() / math.sqrt(d))''',
    5: '''def softmax_backward(p, g):
    p, g = np.asarray(p, dtype=float), np.asarray(g, dtype=float)
    flat_p, flat_g = p.reshape(-1, p.shape[-1]), g.reshape(-1, g.shape[-1])
    out = np.empty_like(flat_p)
    for r in range(flat_p.shape[0]):
        out[r] = flat_p[r] * (flat_g[r] - flat_p[r] @ flat_g[r])
    return out.reshape(p.shape)


rng5 = np.random.default_rng(50)
raw_rows = math.sqrt(512) * rng5.standard_normal((256, 16))
g = rng5.standard_normal((256, 16))
s_t = torch.tensor(raw_rows, requires_grad=True)
(torch.softmax(s_t, -1) * torch.from_numpy(g)).sum().backward()
mine = softmax_backward(attn.softmax(raw_rows), g)
median_unscaled = np.median(np.linalg.norm(mine, axis=-1))
median_scaled = np.median(np.linalg.norm(softmax_backward(attn.softmax(raw_rows / 512**0.5), g), axis=-1))''',
}
MISTAKES = {  # uniform on [-1, 1]; c with sigma for sigma^2; the Jacobian without its diagonal; Var(q.q) = d_k; the
    # Jacobian built row by row, which rows of 40,000 scores cannot hold
    1: ("official", "half_width = math.sqrt(3)", "half_width = 1.0"),
    2: ("official", "return sigma**2 * math.sqrt(d_k)", "return sigma * math.sqrt(d_k)"),
    3: ("official", "np.linalg.norm(np.diag(p) - np.outer(p, p))", "np.linalg.norm(np.outer(p, p))"),
    4: ("official", "return d_k, 2 * d_k, math.sqrt(d_k)", "return d_k, d_k, math.sqrt(d_k)"),
    5: ("official", "    return p * (g - (p * g).sum(axis=-1, keepdims=True))  # (..., n)",
        ("    rows = [(np.diag(r) - np.outer(r, r)) @ h for r, h in zip(p.reshape(-1, p.shape[-1]),\n"
         "                                                          g.reshape(-1, g.shape[-1]))]\n"
         "    return np.array(rows).reshape(p.shape)")),
}
CHEATS = {  # the chapter's normal components and its printed ratios; the formula where an estimate is asked for;
    # the printed table typed in; the printed numbers at d_k = 16 and Gaussian self-scores; autograd
    1: "def uniform_dots(d_k, samples, rng):\n"
       "    return (rng.standard_normal((samples, d_k)) * rng.standard_normal((samples, d_k))).sum(1)\n\n\n"
       "ratios = [16.1 / 16, 258.2 / 256]",
    2: ("official", "    return float((q * k).sum(axis=1).var())", "    return d_k * sigma**4"),
    3: "def saturation_table(scores, factors):\n"
       "    return ([4.38e-01, 4.32e-01, 2.98e-01, 9.06e-02, 4.93e-03, 6.12e-07],\n"
       "            [0.410, 0.545, 0.798, 0.952, 0.998, 1.0])\n\n\n"
       "def first_over_half(scores, factors):\n    return 2\n\n\n"
       "norms_c, tops_c = saturation_table(small, None)\nfirst_c = 2",
    4: "def self_score_theory(d_k):\n    return 16, 32, 4.0\n\n\n"
       "def self_scores(d_k, samples, rng):\n    return rng.normal(d_k, math.sqrt(2 * d_k), samples)\n\n\n"
       "self_stats = {16: (16.0, 32.3, 4.0), 256: (255.7, 505.2, 15.98)}",
    5: "official\n\n\ndef softmax_backward(p, g):\n"
       "    s = torch.log(torch.as_tensor(p).clamp_min(1e-300)).requires_grad_()\n"
       "    torch.softmax(s, -1).backward(torch.as_tensor(g))\n    return s.grad",
}


def test_chapter_3_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH3, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, {
        ("cheats", 1): "`uniform_dots`: |q·k| exceeds 3 d_k",
        ("cheats", 2): "`dot_variance` gives the same answer for two different generators",
        ("cheats", 3): "`norms_h`: expected saturation_table's norms",
        ("cheats", 5): "asks you to write what torch.autograd.backward does",
        ("mistakes", 5): "MemoryError",
    }, grade.Limits(timeout=300, cell_timeout=120, memory_gb=6))


def test_chapter_3_sampling_checks_pass_any_correct_sampler_and_no_other_distribution():
    n, master = ch03.SAMPLES, np.random.default_rng(3)

    def uniform(d, rng):
        return (rng.uniform(-math.sqrt(3), math.sqrt(3), (2, n, d)).prod(0)).sum(1)

    def normal(d, rng):  # the chapter's own components, not uniform ones
        return (rng.standard_normal((2, n, d)).prod(0)).sum(1)

    def squares(d, rng):
        return (rng.standard_normal((n, d)) ** 2).sum(1)

    def gaussian(d, rng):  # the right mean and variance, the wrong shape
        return rng.normal(d, math.sqrt(2 * d), n)

    for _ in range(4):
        inputs = ch03._seeded(master, d_h=int(master.integers(2, 65)))
        d, gens = inputs["d_h"], [np.random.default_rng(inputs["seed_h"] + i) for i in range(3)]
        dots = {f: {"dots_1": f(1, gens[0]), "dots_h": f(d, gens[1]), "dots_h2": f(d, gens[2])}
                for f in (uniform, normal)}
        assert ch03._uniform_checks(dots[uniform], inputs) is None
        assert "exceeds 3 d_k" in ch03._uniform_checks(dots[normal], inputs)
        assert ch03._self_checks({"self_h": squares(d, gens[0]), "self_h2": squares(d, gens[1])}, inputs) is None
        assert ch03._self_checks({"self_h": gaussian(d, gens[0]), "self_h2": gaussian(d, gens[1])}, inputs)
        same = {"self_h": squares(d, np.random.default_rng(0)), "self_h2": squares(d, np.random.default_rng(0))}
        assert "draw from `rng`" in ch03._self_checks(same, inputs)
