"""The hidden tests of chapters/02_matrix_form.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Spec, softmax_rows


def _attention(q, k, v):
    return softmax_rows(q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])) @ v


def _ex1_make(rng, params):
    L, S, E, Ev = int(rng.integers(2, 8)), int(rng.integers(3, 9)), int(rng.integers(2, 7)), int(rng.integers(2, 7))
    order = np.arange(S)
    while (order == np.arange(S)).any():  # every key moves
        order = rng.permutation(S)
    return {"q_h": rng.standard_normal((L, E)), "k_h": rng.standard_normal((S, E)),
            "v_h": rng.standard_normal((S, Ev)), "order_h": order}


def _ex1_expect(i, p):
    return {"same_h": _attention(i["q_h"], i["k_h"], i["v_h"]),
            "broken_h": _attention(i["q_h"], i["k_h"], i["v_h"][i["order_h"]])}


def _ex2_make(rng, params):
    """Budgets of whole GiB, budgets that hold n x n numbers exactly or miss by one byte, and any whole number."""
    sizes = [int(b) for b in rng.choice([1, 2, 4, 8], 4)]
    n = int(rng.integers(1_000, 300_000))
    budgets = [int(rng.integers(1, 193)) * 2**30, n * n * sizes[1], n * n * sizes[2] - 1,
               int(rng.integers(10**6, 10**12))]
    return {"budgets_h": budgets, "bytes_h": sizes}


def _ex3_make(rng, params):
    L, S, E = int(rng.integers(2, 7)), int(rng.integers(3, 8)), int(rng.choice([2, 3, 5, 6, 8]))
    return {"q_h": rng.standard_normal((L, E)), "k_h": rng.standard_normal((S, E)), "j_h": int(rng.integers(0, S)),
            "c_h": round(float(rng.uniform(1.5, 4)), 2)}


def _ex3_expect(i, p):
    k = i["k_h"].copy()
    k[i["j_h"]] *= i["c_h"]
    scores = i["q_h"] @ k.T / math.sqrt(k.shape[1])
    return {"S2_h": scores, "A2_h": softmax_rows(scores)}


def _ex4_make(rng, params):
    B = int(rng.integers(1, 4))
    L, S = (int(x) for x in rng.choice(np.arange(2, 8), 2, replace=False))
    E, Ev = (int(x) for x in rng.choice(np.arange(2, 7), 2, replace=False))
    return {"q_h": rng.standard_normal((B, L, E)), "k_h": rng.standard_normal((B, S, E)),
            "v_h": rng.standard_normal((B, S, Ev))}


SPECS = [
    Spec(
        label="matrix-form/keys-and-values-together", title="Keys and values travel together", draws=2,
        make=_ex1_make, expect=_ex1_expect, rerun=False,
        harness="same_h, broken_h = shuffled_outputs(q_h, k_h, v_h, order_h)\n",
        compare={"same_h": Close(1e-5, 1e-6, "the output with keys and values reordered together, a row per query"),
                 "broken_h": Close(1e-5, 1e-6, "the output with only the values reordered, a row per query")},
    ),
    Spec(
        label="matrix-form/one-gibibyte", title="One gibibyte", draws=2,
        make=_ex2_make, rerun=False,
        expect=lambda i, p: {"longest_h": [math.isqrt(b // s) for b, s in zip(i["budgets_h"], i["bytes_h"])]},
        harness="longest_h = [longest_sequence(b, s) for b, s in zip(budgets_h, bytes_h)]\n",
        compare={"longest_h": Close(0, 0, "the longest n that longest_sequence returns for each budget")},
    ),
    Spec(
        label="matrix-form/longer-keys-win", title="Longer keys win", draws=2,
        make=_ex3_make, expect=_ex3_expect, rerun=False,
        harness="S2_h, A2_h = stretch_key(q_h, k_h, j_h, c_h)\n",
        compare={"S2_h": Close(1e-5, 1e-6, "the scaled scores after the stretch, (L, S)"),
                 "A2_h": Close(1e-5, 1e-6, "the weights after the stretch, (L, S)")},
    ),
    Spec(
        label="matrix-form/einsum-attention", title="Attention with `einsum`", draws=2,
        make=_ex4_make, expect=lambda i, p: {"out_h": _attention(i["q_h"], i["k_h"], i["v_h"])}, rerun=False,
        harness="out_h = einsum_attention(q_h, k_h, v_h)\n",
        compare={"out_h": Close(1e-5, 1e-6, "the output of einsum_attention, (batch, L, d_v)")},
        poison=("lib.attention.attention", "lib.attention.attention_weights", "lib.attention.attention_loop",
                "torch.nn.functional.scaled_dot_product_attention"),
        banned=("@", "matmul", "dot", "tensordot", "bmm", "baddbmm"),
    ),
]
