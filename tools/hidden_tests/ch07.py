"""The hidden tests of chapters/07_complexity_and_tiling.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, Whole, softmax_rows

# ------------------------------------------------------------------ exercise 1, scores and FLOPs of one layer


def _layer_make(rng, params):
    return {"heads_h": int(rng.integers(1, 65)), "n_h": int(rng.choice([300, 1000, 2048, 5000, 16384])),
            "d_h": int(rng.choice([32, 64, 96, 128, 256])), "bytes_h": int(rng.choice([1, 2, 4, 8]))}


def _layer_expect(i, p):
    heads, n = i["heads_h"], i["n_h"]
    return {"gib_h": heads * n * n * i["bytes_h"] / 2**30, "tflops_h": heads * 2 * n * n * i["d_h"] / 1e12}


# ------------------------------------------------------------------ exercise 2, rescales of the online softmax


def _row_make(rng, params):
    return {"row_h": rng.standard_normal(int(rng.integers(8, 25))) * 3, "block_h": int(rng.integers(2, 5))}


def _rescales(row, block):
    """How often a blockwise pass over `row` meets a new, larger maximum after its first block."""
    m, count = -math.inf, 0
    for start in range(0, len(row), block):
        top = float(np.max(row[start : start + block]))
        count += int(m != -math.inf and top > m)
        m = max(m, top)
    return count


def _row_expect(i, p):
    row, block = i["row_h"], i["block_h"]
    weights = softmax_rows(row[None, :])[0]
    return {"weights_h": weights, "rescales_h": _rescales(row, block), "reversed_h": weights[::-1],
            "rescales_reversed_h": _rescales(row[::-1], 1)}


HARNESS_ROW = """\
weights_h, rescales_h = online_softmax(row_h, block_h)
reversed_h, rescales_reversed_h = online_softmax(row_h[::-1].copy(), 1)
"""


# ------------------------------------------------------------------ exercise 3, how the peak grows


def _growth_make(rng, params):
    blocks = sorted(rng.choice([16, 32, 64, 96, 128, 256, 512], size=2, replace=False))
    return {"n_h": int(rng.integers(100, 9000)), "from_h": int(blocks[0]), "to_h": int(blocks[1]),
            "bytes_h": int(rng.choice([2, 4, 8]))}


# ------------------------------------------------------------------ exercise 4, skipping the future tiles


def _causal_make(rng, params):
    n, E = int(rng.integers(70, 240)), int(rng.choice([8, 16, 24]))
    blocks = [16, 24, 32, 48, 64]
    block_q, block_k = int(rng.choice(blocks)), int(rng.choice(blocks))
    if rng.integers(0, 2):  # the last query alone in its key block: the tile a `j >= last row` test skips
        n = n // block_k * block_k + 1
    return {"q_h": rng.standard_normal((n, E)).astype(np.float32),
            "k_h": rng.standard_normal((n, E)).astype(np.float32),
            "v_h": rng.standard_normal((n, E)).astype(np.float32),
            "block_q_h": block_q, "block_k_h": block_k,
            **{f"{x}_big": rng.standard_normal((BIG, 8)).astype(np.float32) for x in "qkv"}}


BIG = 1200  # a sequence whose (n, n) scores a loop over tiles never holds at once


def _small_peak(answers, inputs):
    peak = answers.get("big_peak_h")
    if not isinstance(peak, (int, float)) or peak <= 0:
        return "the memory your loop used could not be measured"
    if peak > BIG * BIG:  # a quarter of the float32 (n, n) scores
        return (f"on n = {BIG}, your loop held {peak / 2**20:.1f} MB at its peak: the scores of all the tiles at "
                "once, not one tile at a time")
    return None


def _causal_expect(i, p):
    from lib import tiles

    q, k, v = (i[name].astype(np.float64) for name in ("q_h", "k_h", "v_h"))
    n, bq, bk = q.shape[0], i["block_q_h"], i["block_k_h"]
    s = q @ k.T / math.sqrt(q.shape[1])
    s[np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    # a computed tile needs the mask when one of its keys lies after one of its queries
    masked = sum(min(j + bk, n) - 1 > i0 for i0 in range(0, n, bq) for j in range(0, min(i0 + bq, n), bk))
    qb, kb, vb = (i[f"{x}_big"].astype(np.float64) for x in "qkv")
    sb = qb @ kb.T / math.sqrt(8)
    sb[np.triu(np.ones((BIG, BIG), dtype=bool), 1)] = -np.inf
    return {"out_h": softmax_rows(s) @ v, "computed_h": tiles.tile_count(n, n, (bq, bk), causal=True),
            "masked_h": masked, "big_out_h": softmax_rows(sb) @ vb, "big_peak_h": None}


HARNESS_TILES = """\
import tracemalloc as _tracemalloc
out_h, computed_h, masked_h = tiled_loop_causal(q_h, k_h, v_h, block_q_h, block_k_h)
_tracemalloc.start()
big_out_h = tiled_loop_causal(q_big, k_big, v_big, 64, 64)[0]
big_peak_h = _tracemalloc.get_traced_memory()[1]
_tracemalloc.stop()
"""


SPECS = [
    Spec(
        label="complexity-and-tiling/scores-and-flops", title="Scores and FLOPs of one layer", draws=3,
        make=_layer_make, expect=_layer_expect, rerun=False,
        harness="gib_h = score_gib(heads_h, n_h, bytes_h)\ntflops_h = causal_tflops(heads_h, n_h, d_h)\n",
        compare={"gib_h": Close(1e-6, 0, "score_gib(heads, n, bytes_per_number), in GiB (2**30 bytes)"),
                 "tflops_h": Close(1e-6, 0, "causal_tflops(heads, n, d), in TFLOPs (10**12)")},
    ),
    Spec(
        label="complexity-and-tiling/online-rescales", title="Rescales of the online softmax", draws=3,
        make=_row_make, expect=_row_expect, harness=HARNESS_ROW, rerun=False,
        compare={"weights_h": Close(1e-6, 1e-9, "the weights of online_softmax(row, block)"),
                 "rescales_h": Whole("its number of rescales"),
                 "reversed_h": Close(1e-6, 1e-9, "the weights of online_softmax on the reversed row, block 1"),
                 "rescales_reversed_h": Whole("its number of rescales")},
        forbidden=("lib.attention.softmax", "torch.softmax", "torch.nn.functional.softmax",
                   "scipy.special.softmax"),
    ),
    Spec(
        label="complexity-and-tiling/peak-growth", title="How the peak grows with the key block", draws=3,
        make=_growth_make, rerun=False,
        expect=lambda i, p: {"growth_h": i["bytes_h"] * i["n_h"] * (i["to_h"] - i["from_h"])},
        harness="growth_h = peak_growth(n_h, from_h, to_h, bytes_h)\n",
        compare={"growth_h": Whole("peak_growth(n, block_from, block_to, bytes_per_number), in bytes")},
    ),
    Spec(
        label="complexity-and-tiling/causal-tiles", title="Skipping the future tiles", draws=3,
        make=_causal_make, expect=_causal_expect, rerun=False,
        harness=HARNESS_TILES,
        compare={"out_h": Close(1e-4, 1e-5, "the causal attention output, (n, Ev), from your own loop (not the "
                                           "chapter's tiled_loop)"),
                 "computed_h": Whole("the number of tiles computed"),
                 "masked_h": Whole("the number of computed tiles that cross the diagonal"),
                 "big_out_h": Close(1e-4, 1e-5, f"the output on n = {BIG} with blocks of 64"),
                 "big_peak_h": Holds(_small_peak, f"on n = {BIG}, at most a quarter of the (n, n) scores' memory "
                                                  "held at once (NumPy's allocations, counted)")},
        forbidden=("lib.attention.attention", "lib.attention.attention_weights", "lib.tiles.tiled_attention",
                   "lib.tiles.tile_count", "torch.nn.functional.scaled_dot_product_attention"),
        banned=("tiled_loop", "torch", "tracemalloc"),
    ),
]
