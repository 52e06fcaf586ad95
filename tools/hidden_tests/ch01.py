"""The hidden tests of chapters/01_token_by_token.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import numpy as np
from grading_specs import Close, Holds, Spec, softmax_rows


def _ex1_make(rng, params):
    """Three sets of sizes n, d_model, d_k, d_v, all four different, so that no size stands in for another."""
    return {"sizes_h": [[int(x) for x in rng.choice(np.arange(2, 65), 4, replace=False)] for _ in range(3)]}


def _ex1_expect(inputs, params):
    return {"shapes_h": [[[n, d_v], [n, n], [n, d_v]] for n, _d_model, _d_k, d_v in inputs["sizes_h"]]}


def _far_rows(rng, shape):
    """Scores around +-750 to +-1200, far beyond exp's range in float64; each row has its own level and, when
    there are several, some rows lie far above and some far below."""
    *lead, _ = shape
    signs = np.resize([1.0, -1.0], int(np.prod(lead, dtype=int)))
    rng.shuffle(signs)
    levels = signs.reshape(*lead, 1) * rng.uniform(750, 1200, (*lead, 1))
    return rng.normal(0, 2, shape) + levels


def _ex2_make(rng, params):
    m = int(rng.integers(3, 9))
    return {"row_h": _far_rows(rng, (1, m))[0] * rng.choice([1, -1]), "batch_h": _far_rows(rng, (2, 3, m))}


def _log_sum_exp(s):
    m = s.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


def _ex3_make(rng, params):
    factors = rng.choice([0.5, 1, 2, 3, 5, 8, 20, 50, 100], 5, replace=False)
    return {"s_h": np.clip(rng.normal(0, 1.5, int(rng.integers(3, 9))), -5, 5),
            "factors_h": [0.0, *(float(c) for c in rng.permutation(factors))]}


def _ex3_expect(inputs, params):
    return {"largest_h": [float(softmax_rows(c * inputs["s_h"]).max()) for c in inputs["factors_h"]]}


def _ex4_make(rng, params):
    """Which hidden implementations is_attention is handed, in order: 0 and 1 compute attention (as matrices, as a
    loop), 2 and 3 have the transposed scores (written two ways). Both kinds appear in every draw."""
    while True:
        kinds = [int(k) for k in rng.integers(0, 4, 6)]
        if {k < 2 for k in kinds} == {True, False}:
            return {"kinds_h": kinds}


def _ex4_verdicts(answers, inputs):
    verdicts = answers.get("verdicts_h")
    if not isinstance(verdicts, list) or len(verdicts) != len(inputs["kinds_h"]):
        return "`is_attention` did not return one True or False per function it was handed"
    wrong = sum(v is not (k < 2) for v, k in zip(verdicts, inputs["kinds_h"]))
    if wrong:
        return (f"`is_attention` judged {wrong} of {len(verdicts)} hidden functions wrongly (True for attention, "
                "False for the transposed scores)")
    return None


HARNESS_4 = """\
import math as _math

import numpy as _np


def _softmax(s):
    e = _np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _attend_as(kind):
    def attend(Q, K, V):
        like = Q
        Q, K, V = (_np.asarray(x, dtype=_np.float64) for x in (Q, K, V))
        scale = _math.sqrt(Q.shape[-1])
        if kind == 0:  # attention, as matrices
            out = _softmax(Q @ K.T / scale) @ V
        elif kind == 1:  # attention, one query at a time
            out = _np.stack([_softmax(K @ q / scale) @ V for q in Q])
        elif kind == 2:  # the colleague's bug
            out = _softmax(K @ Q.T / scale) @ V
        else:  # the same bug, written another way
            out = _softmax((Q @ K.T).T / scale) @ V
        if type(like).__module__.startswith("torch"):  # handed tensors, return one
            import torch as _torch

            return _torch.as_tensor(out, dtype=like.dtype)
        return out.astype(like.dtype) if isinstance(like, _np.ndarray) else out
    return attend


def _verdicts():
    global kinds_h
    kinds = kinds_h
    del kinds_h  # the answer sees the functions, never which is which
    return [bool(is_attention(_attend_as(kind))) for kind in kinds]


verdicts_h = _verdicts()
"""


SPECS = [
    Spec(
        label="token-by-token/values-of-another-size", title="Values of another size", draws=2,
        make=_ex1_make, expect=_ex1_expect, rerun=False,
        harness="shapes_h = [predict_shapes(*sizes) for sizes in sizes_h]\n",
        compare={"shapes_h": Close(0, 0, "the shapes of V, of A and of the outputs that predict_shapes returns "
                                         "for each set of sizes")},
    ),
    Spec(
        label="token-by-token/log-sum-exp", title="Log-sum-exp", draws=2,
        make=_ex2_make, rerun=False,
        expect=lambda i, p: {"lse_row_h": _log_sum_exp(i["row_h"]), "lse_batch_h": _log_sum_exp(i["batch_h"])},
        harness="lse_row_h = log_sum_exp(row_h)\nlse_batch_h = log_sum_exp(batch_h)\n",
        compare={"lse_row_h": Close(1e-6, 1e-6, "log_sum_exp(s) of one row of scores in the thousands (a number)"),
                 "lse_batch_h": Close(1e-6, 1e-6, "log_sum_exp(s) of a (2, 3, m) array (one number per row)")},
        forbidden=("torch.logsumexp", "numpy.logaddexp", "torch.special.logsumexp", "torch.Tensor.logsumexp"),
        banned=("scipy",),
    ),
    Spec(
        label="token-by-token/sharper-and-flatter", title="Sharper and flatter", draws=2,
        make=_ex3_make, expect=_ex3_expect, rerun=False,
        harness="largest_h = largest_weights(s_h, factors_h)\n",
        compare={"largest_h": Close(1e-5, 1e-9, "the largest weight largest_weights returns for each factor")},
    ),
    Spec(
        label="token-by-token/transposed-scores", title="A bug that raises no error", draws=2,
        make=_ex4_make, expect=lambda i, p: {}, rerun=False, harness=HARNESS_4,
        compare={"verdicts_h": Holds(_ex4_verdicts, "is_attention(attend) on hidden functions: True for each that "
                                                    "computes attention, False for each with the transposed scores")},
    ),
]
