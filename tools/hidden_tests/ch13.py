"""The hidden tests of chapters/13_variants.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import numpy as np
from grading_specs import Close, Holds, Spec, Whole

# ------------------------------------------------------------------------------- exercise 1, the off-by-one softmax


def _scores_make(rng, params):
    """Rows of every kind the statement names: ordinary, in the thousands, far below 0, partly and wholly masked."""
    rows, S = int(rng.integers(6, 10)), int(rng.integers(3, 9))
    scores = rng.standard_normal((2, rows, S)) * 3
    scores[:, 1] += rng.uniform(500, 1500)  # exp would overflow
    scores[:, 2] -= rng.uniform(30, 80)  # the extra logit takes almost all
    scores[:, 3, rng.integers(0, S)] = -np.inf  # one key masked
    scores[:, 4] = -np.inf  # every key masked
    scores[0, 5] += rng.uniform(0.5, 5)  # maximum above 0, near it
    return {"scores_h": scores.astype(np.float32)}


def _softmax_one(scores):
    s = scores.astype(np.float64)
    m = np.maximum(s.max(axis=-1, keepdims=True), 0.0)  # the extra logit 0 takes part
    e = np.exp(s - m)
    return e / (np.exp(-m) + e.sum(axis=-1, keepdims=True))


# ------------------------------------------------------------------------------------------ exercise 2, the band


def _band_make(rng, params):
    cases = [[1, 1], [int(rng.integers(4, 12)), 1]]  # one token; a window of one: the diagonal
    n = int(rng.integers(5, 30))
    cases += [[n, n + int(rng.integers(0, 4))]]  # the window at least n: the causal mask
    cases += [[int(m), int(rng.integers(2, m))] for m in rng.integers(5, 40, size=3)]
    return {"cases_h": cases}


def _band(n, window):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) & (j > i - window)


def _band_holds(answers, inputs):
    masks = answers.get("band_h")
    if not isinstance(masks, list) or len(masks) != len(inputs["cases_h"]):
        return "`band` did not return one mask for each (n, window)"
    for (n, window), mask in zip(inputs["cases_h"], masks):
        if not isinstance(mask, np.ndarray) or mask.shape != (n, n):
            return f"band({n}, {window}) is not an (n, n) array or tensor"
        if mask.dtype != np.bool_:
            return f"band({n}, {window}) is not boolean (dtype {mask.dtype})"
        if not np.array_equal(mask, _band(n, window)):
            return f"band({n}, {window}) is not the sliding-window mask"
    return None


def _band_expect(i, p):
    return {"count_h": [int(_band(n, w).sum()) for n, w in i["cases_h"]]}


HARNESS_2 = """\
band_h = [band(_n, _w) for _n, _w in cases_h]
count_h = [band_count(_n, _w) for _n, _w in cases_h]
"""

# ------------------------------------------------------------------------------------ exercise 3, the cache bytes


def _cache_make(rng, params):
    return {"layers_h": int(rng.integers(1, 100)), "latent_h": int(rng.choice([128, 256, 512, 1024])),
            "rope_h": int(rng.choice([16, 32, 64])), "heads_h": int(rng.integers(1, 129)),
            "head_dim_h": int(rng.choice([32, 64, 96, 128, 192])), "bytes_h": int(rng.choice([1, 2, 4]))}


def _cache_expect(i, p):
    return {"mla_h": i["layers_h"] * (i["latent_h"] + i["rope_h"]) * i["bytes_h"],
            "mha_h": 2 * i["layers_h"] * i["heads_h"] * i["head_dim_h"] * i["bytes_h"]}


HARNESS_3 = """\
mla_h = mla_bytes_per_token(layers_h, latent_h, rope_h, bytes_h)
mha_h = mha_bytes_per_token(layers_h, heads_h, head_dim_h, bytes_h)
"""

# ---------------------------------------------------------------------------------- exercise 5, the state by hand


def _state_make(rng, params):
    n, d, d_v = int(rng.integers(5, 16)), int(rng.integers(2, 7)), int(rng.integers(2, 7))
    return {"q5": rng.standard_normal((n, d)).astype(np.float32), "k5": rng.standard_normal((n, d)).astype(np.float32),
            "v5": rng.standard_normal((n, d_v)).astype(np.float32)}


def _phi(x):
    x = x.astype(np.float64)
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))  # elu(x) + 1


def _state_expect(i, p):
    fq, fk, v = _phi(i["q5"]), _phi(i["k5"]), i["v5"].astype(np.float64)
    S, z = np.cumsum(fk[:, :, None] * v[:, None, :], axis=0), np.cumsum(fk, axis=0)  # (n, d, d_v), (n, d)
    outputs = np.einsum("td,tde->te", fq, S) / np.einsum("td,td->t", fq, z)[:, None]
    return {"state_outputs": outputs, "S_state": S[-1], "z_state": z[-1]}


SPECS = [
    Spec(
        label="variants/softmax-one", title="The off-by-one softmax, safely", draws=2,
        make=_scores_make, expect=lambda i, p: {"weights_h": _softmax_one(i["scores_h"])},
        torch_inputs=("scores_h",), harness="weights_h = softmax_one(scores_h)\n", rerun=False,
        compare={"weights_h": Close(1e-5, 1e-7, "softmax_one(scores): the weights, scores' shape (finite, and 0 "
                                                "for a row whose keys are all masked)")},
        forbidden=("lib.variants.sink_attention",),
    ),
    Spec(
        label="variants/band", title="The band by hand", make=_band_make, expect=_band_expect, rerun=False,
        harness=HARNESS_2,
        compare={"band_h": Holds(_band_holds, "band(n, window): the boolean (n, n) mask for each (n, window), "
                                              "windows of 1 and of n or more among them"),
                 "count_h": Close(0, 0, "band_count(n, window) for each (n, window)")},
        forbidden=("lib.variants.sliding_window_mask", "lib.variants.streaming_mask", "lib.cost.band_scores"),
    ),
    Spec(
        label="variants/deepseek-v2-cache", title="DeepSeek-V2's cache", draws=3,
        make=_cache_make, expect=_cache_expect, rerun=False, harness=HARNESS_3,
        compare={"mla_h": Whole("mla_bytes_per_token's bytes, a whole number"),
                 "mha_h": Whole("mha_bytes_per_token's bytes, a whole number")},
        forbidden=("lib.cost.mla_cache_bytes", "lib.cost.kv_cache_bytes", "lib.cost.cache_bytes_per_token",
                   "lib.cost.windowed_cache_bytes"),
    ),
    Spec(
        label="variants/state-by-hand", title="The state, by hand", draws=2,
        make=_state_make, expect=_state_expect, torch_inputs=("q5", "k5", "v5"),
        compare={"state_outputs": Close(1e-5, 1e-6, "one output per token, (d_v,) each, on q5, k5, v5 of other "
                                                    "lengths and sizes"),
                 "S_state": Close(1e-5, 1e-6, "the final state, (d, d_v)"),
                 "z_state": Close(1e-5, 1e-6, "the final normaliser, (d,)")},
        forbidden=("lib.variants.linear_attention", "lib.variants.linear_attention_recurrent",
                   "lib.variants.linear_attention_chunked", "lib.variants.elu_feature"),
        banned=("vr", "variants"),
    ),
]
