"""The hidden tests of chapters/03_why_sqrt_dk.ipynb (see tools/grading_specs.py for what a spec holds).

Three exercises sample: the student's function draws from a generator the harness seeds, returns its samples (or
its estimate), and the grader checks what any correct sampler gives within a statistical tolerance far wider than
the spread of 20,000 samples (at least five standard errors), plus what no sampler of the wrong distribution or no
typed-in formula can give: a bound the distribution imposes, and other samples for another generator."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, softmax_rows

SAMPLES = 20_000


def _seeded(rng, **inputs):
    return {**inputs, "seed_h": int(rng.integers(0, 2**31))}


def _samples(answers, names, who):
    """The answers `names`, each as a vector of SAMPLES finite numbers; or why not."""
    found = []
    for name in names:
        try:
            x = np.asarray(answers.get(name), dtype=np.float64)
        except (TypeError, ValueError):
            return None, f"`{who}` did not return numbers"
        if x.shape != (SAMPLES,) and x.size == SAMPLES:
            x = x.reshape(SAMPLES)
        if x.shape != (SAMPLES,) or not np.isfinite(x).all():
            return None, f"`{who}` did not return {SAMPLES} finite samples, one per pair"
        found.append(x)
    return found, None


def _fresh(a, b, who):
    """Samples or estimates that differ for two generators, as any sampler's do."""
    if np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)):
        return f"`{who}` gives the same answer for two different generators: draw from `rng`"
    return None


# ------------------------------------------------------------------ 1. not only for normal distributions


def _uniform_checks(answers, inputs):
    d = inputs["d_h"]
    found, why = _samples(answers, ("dots_1", "dots_h", "dots_h2"), "uniform_dots")
    if why:
        return why
    one, many, again = found
    if np.abs(one).max() > 3 + 1e-9 or np.abs(many).max() > 3 * d + 1e-9:
        return "`uniform_dots`: |q·k| exceeds 3 d_k, which uniform components on [-√3, √3] never reach"
    for x, dim in ((one, 1), (many, d)):
        if abs(x.var() / dim - 1) > 0.06 or abs(x.mean()) > 0.06 * math.sqrt(dim):
            return f"`uniform_dots`: at d_k = {dim}, the samples' mean or variance is not that of q·k"
    # at d_k = 1, q·k is a product of two uniform numbers, which piles up near 0: P(|qk| < 0.1) = (1 + ln 30) / 30,
    # about 0.147, against 0.080 for a normal number of the same variance (one standard error here: 0.0025)
    near_zero = float((np.abs(one) < 0.1).mean())
    if abs(near_zero - (1 + math.log(30)) / 30) > 0.015:
        return "`uniform_dots`: at d_k = 1, the samples are not spread as a product of two uniform components"
    return _fresh(many, again, "uniform_dots")


HARNESS_1 = f"""\
import numpy as _np
dots_1 = uniform_dots(1, {SAMPLES}, _np.random.default_rng(seed_h))
dots_h = uniform_dots(d_h, {SAMPLES}, _np.random.default_rng(seed_h + 1))
dots_h2 = uniform_dots(d_h, {SAMPLES}, _np.random.default_rng(seed_h + 2))
"""

# ------------------------------------------------------------------------ 2. components of the wrong size


def _ex2_make(rng, params):
    sigma = float(rng.uniform(0.3, 0.7) if rng.integers(0, 2) else rng.uniform(1.5, 3.0))
    return _seeded(rng, sigma_h=round(sigma, 2), d_h=int(rng.integers(8, 97)))


def _variance_checks(answers, inputs):
    true = inputs["d_h"] * inputs["sigma_h"] ** 4
    estimates = []
    for name in ("var_h", "var_h2"):
        value = answers.get(name)
        if not isinstance(value, (int, float, np.ndarray)) or np.size(value) != 1:
            return "`dot_variance` did not return one number"
        estimates.append(float(np.asarray(value).ravel()[0]))
    if any(abs(e / true - 1) > 0.07 for e in estimates):
        return "`dot_variance`: the estimate is not within 7% of Var(q·k) for these sigma and d_k"
    return _fresh(*estimates, "dot_variance")


HARNESS_2 = f"""\
import numpy as _np
c_h = scale_for(sigma_h, d_h)
var_h = dot_variance(sigma_h, d_h, {SAMPLES}, _np.random.default_rng(seed_h))
var_h2 = dot_variance(sigma_h, d_h, {SAMPLES}, _np.random.default_rng(seed_h + 1))
"""

# ------------------------------------------------------------------------ 3. how fast the Jacobian closes


def _ex3_make(rng, params):
    while True:
        scores = rng.normal(0.0, 0.6, int(rng.integers(3, 9))).round(2)
        factors = sorted({round(float(f), 1) for f in rng.uniform(0.5, 60.0, 6)})
        tops = [softmax_rows(f * scores).max() for f in factors]
        over = [t > 0.5 for t in tops]
        if len(factors) == 6 and any(over[1:]) and not over[0] and min(abs(t - 0.5) for t in tops) > 1e-3:
            return {"scores_h": scores, "factors_h": factors}


def _ex3_expect(inputs, params):
    norms, tops = [], []
    for f in inputs["factors_h"]:
        p = softmax_rows(f * inputs["scores_h"])
        norms.append(np.linalg.norm(np.diag(p) - np.outer(p, p)))
        tops.append(p.max())
    return {"norms_h": norms, "tops_h": tops, "first_h": next(f for f, t in zip(inputs["factors_h"], tops) if t > 0.5)}


HARNESS_3 = """\
norms_h, tops_h = saturation_table(scores_h, factors_h)
first_h = first_over_half(scores_h, factors_h)
"""

# ------------------------------------------------------------------------- 4. when the query is the key


def _self_checks(answers, inputs):
    d = inputs["d_h"]
    found, why = _samples(answers, ("self_h", "self_h2"), "self_scores")
    if why:
        return why
    scores, again = found
    if scores.min() < 0:
        return "`self_scores`: a negative q·q, which a sum of squares never is"
    if abs(scores.mean() / d - 1) > 0.04 or abs(scores.var() / (2 * d) - 1) > 0.08:
        return "`self_scores`: the samples' mean or variance is not that of q·q for this d_k"
    centred = scores - scores.mean()
    if (centred**3).mean() / centred.var() ** 1.5 < 0.5 * math.sqrt(8 / d):  # a chi-square's skewness: √(8/d)
        return "`self_scores`: the samples are not skewed to the right as a sum of d_k squares is"
    return _fresh(scores, again, "self_scores")


HARNESS_4 = f"""\
import numpy as _np
theory_h = self_score_theory(d_h)
self_h = self_scores(d_h, {SAMPLES}, _np.random.default_rng(seed_h))
self_h2 = self_scores(d_h, {SAMPLES}, _np.random.default_rng(seed_h + 1))
"""

# ------------------------------------------------------------------------------ 5. a softmax backward pass

LONG = 40_000  # scores per row: one row's Jacobian, float64, takes 12.8 GB


def _ex5_make(rng, params):
    shape = (int(rng.integers(2, 5)), int(rng.integers(2, 6)), int(rng.integers(3, 17)))
    spread = float(rng.choice([1.0, 4.0, math.sqrt(512)]))
    p = softmax_rows(rng.standard_normal(shape) * spread)
    long_p = softmax_rows(rng.standard_normal((2, LONG)) * 3)
    return {"p_h": p, "g_h": rng.standard_normal(shape), "p_long": long_p, "g_long": rng.standard_normal((2, LONG))}


def _backward(p, g):
    return p * (g - (p * g).sum(axis=-1, keepdims=True))


CHAPTER_3 = [
    Spec(
        label="why-sqrt-dk/uniform-components", title="Not only for normal distributions",
        make=lambda rng, p: _seeded(rng, d_h=int(rng.integers(2, 65))), expect=lambda i, p: {"dots_1": None},
        harness=HARNESS_1, rerun=False, also=("dots_h", "dots_h2"),
        compare={"dots_1": Holds(_uniform_checks, f"uniform_dots(d_k, samples, rng): {SAMPLES:,} dot products "
                                                  "drawn from rng (at d_k = 1 and at a hidden d_k), every one within "
                                                  "3 d_k, their variance within 6% of d_k and their mean within "
                                                  "0.06 √d_k of 0, other samples for another generator")},
    ),
    Spec(
        label="why-sqrt-dk/wrong-size", title="Components of the wrong size",
        make=_ex2_make, expect=lambda i, p: {"c_h": i["sigma_h"] ** 2 * math.sqrt(i["d_h"])},
        harness=HARNESS_2, rerun=False, also=("var_h2",),
        compare={"c_h": Close(1e-6, 1e-9, "scale_for(sigma, d_k): the constant c"),
                 "var_h": Holds(_variance_checks, f"dot_variance(sigma, d_k, samples, rng): on {SAMPLES:,} pairs, "
                                                  "within 7% of the true Var(q·k), and another estimate for "
                                                  "another generator")},
    ),
    Spec(
        label="why-sqrt-dk/jacobian-closes", title="How fast the Jacobian closes", draws=2,
        make=_ex3_make, expect=_ex3_expect, harness=HARNESS_3, rerun=False,
        compare={"norms_h": Close(1e-5, 1e-7, "saturation_table's norms, one per factor"),
                 "tops_h": Close(1e-5, 1e-7, "saturation_table's largest weights, one per factor"),
                 "first_h": Close(1e-9, 0, "first_over_half: the first factor whose top weight exceeds 1/2")},
    ),
    Spec(
        label="why-sqrt-dk/query-is-key", title="When the query is the key",
        make=lambda rng, p: _seeded(rng, d_h=int(rng.integers(2, 65))),
        expect=lambda i, p: {"theory_h": [i["d_h"], 2 * i["d_h"], math.sqrt(i["d_h"])]},
        harness=HARNESS_4, rerun=False, also=("self_h2",),
        compare={"theory_h": Close(1e-6, 1e-9, "self_score_theory(d_k): the mean and variance of q·q and the "
                                               "mean of q·q / √d_k"),
                 "self_h": Holds(_self_checks, f"self_scores(d_k, samples, rng): {SAMPLES:,} samples, none "
                                               "negative, their mean within 4% of the true one and their variance "
                                               "within 8%, their skewness at least half the true √(8 / d_k), other "
                                               "samples for another generator")},
    ),
    Spec(
        label="why-sqrt-dk/softmax-backward", title="A softmax backward pass without the Jacobian", draws=2,
        make=_ex5_make, expect=lambda i, p: {"grad_h": _backward(i["p_h"], i["g_h"]),
                                             "grad_long": _backward(i["p_long"], i["g_long"])},
        harness="grad_h = softmax_backward(p_h, g_h)\ngrad_long = softmax_backward(p_long, g_long)\n", rerun=False,
        compare={"grad_h": Close(1e-5, 1e-9, "softmax_backward(p, g) on a (B, H, n) batch"),
                 "grad_long": Close(1e-5, 1e-9, f"softmax_backward(p, g) on rows of {LONG:,} scores (whose "
                                                "Jacobians would not fit in memory)")},
        poison=("torch.autograd.backward", "torch.autograd.grad", "torch.autograd.functional.jacobian",
                "torch.autograd.functional.vjp", "torch.func.vjp", "torch.func.jacrev", "torch.func.grad"),
        forbidden=("torch._softmax_backward_data",), banned=("softmax_jacobian",),
    ),
]

SPECS = CHAPTER_3
