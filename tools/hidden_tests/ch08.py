"""The hidden tests of chapters/08_gpu_cost.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, softmax_rows

# ------------------------------------------------------------------------------------ exercise 1, HBM traffic


def _traffic_make(rng, params):
    return {"n_h": int(rng.integers(100, 20000)), "d_h": int(rng.choice([32, 64, 80, 128, 256])),
            "block_h": int(rng.choice([16, 32, 64, 128, 256])), "elt_h": int(rng.choice([1, 2, 4]))}


def _traffic_expect(i, p):
    n, d, elt = i["n_h"], i["d_h"], i["elt_h"]
    tiled = (2 * n * d + 2 * n * d * math.ceil(n / i["block_h"])) * elt + 4 * n  # the logsumexps in float32
    return {"standard_h": (4 * n * d + 4 * n * n) * elt / 1e6, "tiled_h": tiled / 1e6}


# ------------------------------------------------------------------------------------ exercise 2, the block sweep


def _sweep_make(rng, params):
    n, d = int(rng.integers(30, 130)), int(rng.choice([4, 8, 12, 16]))
    blocks = sorted(int(b) for b in rng.choice([8, 16, 24, 32, 64], size=3, replace=False))
    return {"q_h": rng.standard_normal((n, d)), "k_h": rng.standard_normal((n, d)), "v_h": rng.standard_normal((n, d)),
            "blocks_h": blocks}


def _sweep_expect(i, p):
    (n, d), blocks = i["q_h"].shape, i["blocks_h"]
    out = softmax_rows(i["q_h"] @ i["k_h"].T / math.sqrt(d)) @ i["v_h"]
    # Q once, K and V once per query block, O and the logsumexps stored
    return {"counts_h": [2 * n * d + 2 * n * d * math.ceil(n / b) + n for b in blocks],
            "outputs_h": np.stack([out] * len(blocks))}


# ------------------------------------------------------------------------------------ exercise 3, the tile ledger


def _tiles_make(rng, params):
    sizes = [(m, n) for m in (32, 64, 128, 256) for n in (32, 64, 128)]
    picked = rng.choice(len(sizes), size=int(rng.integers(4, 7)), replace=False)
    return {"gpu_h": str(rng.choice(["H100", "H200", "A100"])), "clock_h": float(rng.uniform(1.2e9, 2.0e9)),
            "d_h": int(rng.choice([64, 96, 128, 256])), "n_h": int(rng.integers(1024, 16385)),
            "tiles_h": [list(sizes[j]) for j in sorted(picked)], "tflops_h": float(rng.uniform(100, 900))}


def _ledgers(i):
    from lib import cost

    rates = cost.gpu(i["gpu_h"]).at_clock(i["clock_h"])
    return [cost.score_ledger(rates, i["d_h"], n=i["n_h"], tiles=tuple(t)) for t in i["tiles_h"]]


def _tiles_expect(i, p):
    rows = _ledgers(i)
    return {"smem_h": [r.seconds["shared memory"] * 1e12 for r in rows],
            "l2_h": [r.l2_bytes_per_s(i["tflops_h"]) / 1e12 for r in rows]}


def _picked(answers, inputs):
    """`not_above` and `best` against the ledger: a tile within 1e-9 of a tie may fall either way."""
    rows, tiles = _ledgers(inputs), [tuple(t) for t in inputs["tiles_h"]]
    smem = [r.seconds["shared memory"] for r in rows]
    tensor = [r.seconds["tensor cores"] for r in rows]
    try:
        listed = {tuple(int(x) for x in t) for t in answers.get("not_above_h")}
        best = tuple(int(x) for x in answers.get("best_h"))
    except (TypeError, ValueError):
        return "`not_above` is not a list of (B_r, B_c) tiles, or `best` is not one tile"
    for tile, s, t in zip(tiles, smem, tensor):
        if s < t * (1 - 1e-9) and tile not in listed:
            return f"`not_above` leaves out a tile whose shared-memory bar is shorter than the tensor cores': {tile}"
        if s > t * (1 + 1e-9) and tile in listed:
            return f"`not_above` holds a tile whose shared-memory bar is longer than the tensor cores': {tile}"
    if not listed <= set(tiles):
        return "`not_above` holds a tile that is not one of `tiles`"
    shortest = [tile for tile, s in zip(tiles, smem) if s <= min(smem) * (1 + 1e-9)]
    return None if best in shortest else "`best` is not the tile with the shortest shared-memory bar"


HARNESS_3 = """\
from lib import cost as _cost
_tiles = [tuple(int(x) for x in _t) for _t in tiles_h]
_smem, _l2, _not_above, _best = tile_ledger(_cost.gpu(gpu_h).at_clock(clock_h), d_h, n_h, _tiles, tflops_h)
smem_h = [_smem.get(_t) for _t in _tiles]  # None where a tile is missing
l2_h = [_l2.get(_t) for _t in _tiles]
not_above_h = [list(_t) for _t in _not_above]
best_h = list(_best)
"""

SPECS = [
    Spec(
        label="gpu-cost/hbm-traffic", title="HBM traffic in MB", draws=3,
        make=_traffic_make, expect=_traffic_expect, rerun=False,
        harness="standard_h, tiled_h = traffic_mb(n_h, d_h, block_h, elt_h)\n",
        compare={"standard_h": Close(1e-9, 0, "traffic_mb's standard MB"),
                 "tiled_h": Close(1e-9, 0, "traffic_mb's tiled MB (the last query block may be shorter)")},
    ),
    Spec(
        label="gpu-cost/block-sweep", title="Sweep the block size", draws=2,
        make=_sweep_make, expect=_sweep_expect, rerun=False,
        harness="counts_h, outputs_h = sweep(q_h, k_h, v_h, blocks_h)\n",
        compare={"counts_h": Close(0, 0, "the numbers each run of sweep moved, one per block size"),
                 "outputs_h": Close(1e-6, 1e-8, "the output each run returned, (n, d) each")},
        # the outputs come from the model's runs, not from the library
        poison=("lib.attention.attention", "lib.attention.attention_weights", "lib.attention.attention_loop",
                "lib.tiles.tiled_attention"),
    ),
    Spec(
        label="gpu-cost/tile-ledger", title="Choose a tile with the ledger", draws=2,
        make=_tiles_make, expect=_tiles_expect, rerun=False, harness=HARNESS_3, also=("best_h",),
        compare={"smem_h": Close(1e-6, 1e-12, "tile_ledger's smem_ps, picoseconds per tile"),
                 "l2_h": Close(1e-6, 1e-12, "tile_ledger's l2_tbs, TB/s per tile"),
                 "not_above_h": Holds(_picked, "tile_ledger's not_above and best, read from the ledgers (a "
                                               "tile whose two bars tie may fall either way)")},
    ),
]
