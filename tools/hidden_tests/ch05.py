"""The hidden tests of chapters/05_masking_and_cross_attention.ipynb (see tools/grading_specs.py for what a spec
holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, softmax_rows

MASK_LIBRARY = ("lib.attention.causal_mask", "torch.nn.attention.bias.causal_lower_right")


def _bottom_right(L, S, window=None):
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = j <= i + (S - L)  # (L, S)
    return allowed if window is None else allowed & (j > i + (S - L) - window)


def _attend(q, k, v, mask):
    s = np.where(mask, q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]), -np.inf)  # (..., L, S)
    empty = ~mask.any(-1, keepdims=True)
    w = np.where(empty, 0.0, softmax_rows(np.where(empty, 0.0, s)))
    return w @ v


# --------------------------------------------------------------------------------------- 1. a mask builder


def _ex1_make(rng, params):
    L, S = int(rng.integers(1, 10)), int(rng.integers(1, 15))
    L, S = min(L, S), max(L, S)  # a chunk's queries never outnumber the keys so far
    n = int(rng.integers(2, 13))
    return {"L_h": L, "S_h": S, "w_h": int(rng.integers(1, S + 1)), "n_h": n, "wn_h": int(rng.integers(1, n + 1))}


HARNESS_1 = """\
plain_h = causal_bottom_right(L_h, S_h)
windowed_h = causal_bottom_right(L_h, S_h, window=w_h)
square_h = causal_bottom_right(n_h, n_h, window=wn_h)
"""

# ------------------------------------------------------------------------------------ 2. a prompt in chunks


def _ex2_make(rng, params):
    n, E, Ev = int(rng.integers(5, 14)), int(rng.integers(2, 7)), int(rng.integers(2, 7))
    L = int(rng.integers(1, n))  # fewer queries than keys: the alignment matters
    return {"q_h": rng.standard_normal((n, E)), "k_h": rng.standard_normal((n, E)),
            "v_h": rng.standard_normal((n, Ev)), "L_h": L, "chunk_h": int(rng.integers(2, 5))}


def _ex2_expect(inputs, params):
    q, k, v, L = inputs["q_h"], inputs["k_h"], inputs["v_h"], inputs["L_h"]
    n = q.shape[0]
    return {"last_h": _attend(q[-L:], k, v, _bottom_right(L, n)), "prefill_h": _attend(q, k, v, _bottom_right(n, n))}


# Exercise 2 is graded on its own: while it runs, the answer's mask builder from exercise 1 is replaced by a correct
# one (returning the same kind of array as the answer's own, a torch tensor or a NumPy array), so a slip in exercise 1
# costs exercise 1 only.
HARNESS_2 = """\
import numpy as _np
import torch as _torch
_theirs = causal_bottom_right


def causal_bottom_right(L, S, window=None):
    _i, _j = _np.arange(L)[:, None], _np.arange(S)[None, :]
    _mask = _j <= _i + (S - L)
    if window is not None:
        _mask &= _j > _i + (S - L) - window
    try:
        _kind = _theirs(1, 1)
    except Exception:
        _kind = None
    return _torch.from_numpy(_mask) if isinstance(_kind, _torch.Tensor) else _mask


last_h = prefill_chunk(q_h[-L_h:], k_h, v_h)
prefill_h = _torch.cat([prefill_chunk(q_h[_s : _s + chunk_h], k_h[: _s + chunk_h], v_h[: _s + chunk_h])
                        for _s in range(0, q_h.shape[0], chunk_h)])
"""

# ----------------------------------------------------------------------------- 3. what may the filler be?


def _ex3_make(rng, params):
    B, n, d, dv = int(rng.integers(2, 5)), int(rng.integers(3, 8)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
    lengths = [n, *(int(m) for m in rng.integers(1, n, B - 1))]  # one full sequence, the others padded
    rng.shuffle(lengths)
    key_ok = (np.arange(n)[None, :] < np.array(lengths)[:, None])[:, None, :]  # (B, 1, n)
    return {"Q_h": rng.standard_normal((B, n, d)), "K_h": rng.standard_normal((B, n, d)),
            "V_h": rng.standard_normal((B, n, dv)), "key_ok_h": key_ok,
            "filler_h": float(rng.choice([-1, 1]) * 10.0 ** rng.integers(0, 8))}


def _filled(inputs, filler):
    V, key_ok = inputs["V_h"], inputs["key_ok_h"]
    mask = np.broadcast_to(key_ok, (V.shape[0], V.shape[1], V.shape[1]))  # (B, n, n)
    return _attend(inputs["Q_h"], inputs["K_h"], np.where(key_ok[:, 0, :, None], V, filler), mask)


def _nan_checks(answers, inputs):
    want = _filled(inputs, np.nan)
    try:
        got = np.asarray(answers.get("nan_h"), dtype=np.float64)
    except (TypeError, ValueError):
        return "`nan_h`: filled_outputs with a NaN filler did not return numbers"
    if got.shape != want.shape:
        return f"`nan_h`: expected the (B, n, d_v) outputs with a NaN filler, shape {want.shape}; yours {got.shape}"
    if not np.array_equal(np.isnan(got), np.isnan(want)) or not np.allclose(got, want, 1e-6, 1e-9, equal_nan=True):
        return "`nan_h`: with a NaN filler, not the outputs attention gives (which outputs are NaN, and the rest)"
    return None


HARNESS_3 = """\
finite_h = filled_outputs(Q_h, K_h, V_h, key_ok_h, filler_h)
nan_h = filled_outputs(Q_h, K_h, V_h, key_ok_h, float("nan"))
"""


CHAPTER_5 = [
    Spec(
        label="masking/mask-builder", title="A mask builder", draws=3,
        make=_ex1_make, harness=HARNESS_1, rerun=False,
        expect=lambda i, p: {"plain_h": _bottom_right(i["L_h"], i["S_h"]),
                             "windowed_h": _bottom_right(i["L_h"], i["S_h"], i["w_h"]),
                             "square_h": _bottom_right(i["n_h"], i["n_h"], i["wn_h"])},
        compare={"plain_h": Close(0, 0, "causal_bottom_right(L, S): the (L, S) mask, True where a query may attend"),
                 "windowed_h": Close(0, 0, "causal_bottom_right(L, S, window=w), L <= S"),
                 "square_h": Close(0, 0, "causal_bottom_right(n, n, window=w)")},
        forbidden=MASK_LIBRARY,
    ),
    Spec(
        label="masking/chunked-prefill", title="A prompt in chunks", draws=2,
        make=_ex2_make, expect=_ex2_expect, torch_inputs=("q_h", "k_h", "v_h"), harness=HARNESS_2, rerun=False,
        compare={"last_h": Close(1e-6, 1e-9, "prefill_chunk(q_c, k_seen, v_seen): the (L, Ev) outputs of the last "
                                             "L queries against every key, L < S"),
                 "prefill_h": Close(1e-6, 1e-9, "a whole prompt through prefill_chunk in chunks (the last one "
                                                "shorter): one causal pass's (n, Ev) outputs")},
        forbidden=MASK_LIBRARY,
    ),
    Spec(
        label="masking/padding-filler", title="What may the filler be?", draws=2,
        make=_ex3_make, harness=HARNESS_3, rerun=False,
        expect=lambda i, p: {"finite_h": _filled(i, i["filler_h"]), "nan_h": None},
        compare={"finite_h": Close(1e-6, 1e-9, "filled_outputs(Q, K, V, key_ok, filler): the (B, n, d_v) outputs "
                                               "with a finite filler"),
                 "nan_h": Holds(_nan_checks, "filled_outputs with a NaN filler: the NaN outputs where attention "
                                             "gives them, the others to rtol=1e-06, atol=1e-09")},
    ),
]

SPECS = CHAPTER_5
