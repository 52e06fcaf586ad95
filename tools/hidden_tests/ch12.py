"""The hidden tests of chapters/12_one_merge.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, Whole, softmax_rows

# -------------------------------------------------------------------------------- 1. striped tiles


def _striped_make(rng, params):
    P, tile = int(rng.integers(2, 6)), int(rng.choice([4, 8, 16]))
    return {"N_h": P * tile * int(rng.integers(1, 6)), "P_h": P, "tile_h": tile}


def striped_tiles(N, P, tile):
    """Each rank's causal tiles over all ring steps when rank r holds tokens r, r + P, ...: query tile i of any rank
    and key tile j of any rank (tiles of `tile` tokens in their order on the rank) are computed when the tile's
    first key is at or before its last query."""
    ranks = np.arange(P)
    first = ranks[:, None] + P * tile * np.arange(N // P // tile)[None, :]  # (rank, tile) -> first position
    last = first + P * (tile - 1)
    return [int((first.reshape(-1)[None, :] <= last[r].reshape(-1, 1)).sum()) for r in range(P)]


# -------------------------------------------------------------------------------- 2. split counts


def _split_make(rng, params):
    sms = int(rng.choice([40, 80, 108, 132]))
    return {"batch_h": int(rng.integers(1, 9)), "kv_heads_h": int(rng.choice([1, 2, 4, 8, 16])),
            "keys_h": int(rng.choice([300, 1000, 2048, 5000, 32_768, 2**20])), "sms_h": sms,
            "programs_h": int(rng.integers(5, 100)), "counts_h": sorted(int(c) for c in rng.choice(9, 3, False) + 1)}


def _split_expect(i, p):
    from lib import cost

    programs = i["batch_h"] * i["kv_heads_h"]
    splits = cost.choose_num_splits(programs, i["keys_h"], i["sms_h"])
    return {"splits_h": splits, "busy_h": cost.wave_efficiency(programs * splits, i["sms_h"]),
            "table_h": [cost.wave_efficiency(i["programs_h"] * c, i["sms_h"]) for c in i["counts_h"]]}


HARNESS_SPLIT = """\
splits_h, busy_h = split_plan(batch_h, kv_heads_h, keys_h, sms_h)
_table = wave_efficiencies(programs_h, sms_h, counts_h)
table_h = [_table[_c] for _c in counts_h]
"""

# -------------------------------------------------------------------------------- 3. recomputed probabilities


def _block_make(rng, params):
    L, S, E = int(rng.integers(2, 7)), int(rng.integers(5, 13)), int(rng.choice([3, 4, 8]))
    start = int(rng.integers(0, S - 1))
    return {"q_h": 1.5 * rng.standard_normal((L, E)), "k_h": 1.5 * rng.standard_normal((S, E)), "start_h": start,
            "stop_h": int(rng.integers(start + 1, S + 1))}


def _block_expect(i, p):
    weights = softmax_rows(i["q_h"] @ i["k_h"].T / math.sqrt(i["q_h"].shape[1]))
    return {"p_h": weights[:, i["start_h"] : i["stop_h"]]}


# -------------------------------------------------------------------------------- 4. the merge in Triton

_ROWS = {  # lse_a, lse_b of the rows every draw holds: the cases the two guards are for
    "e^200 overflows float32": (200.0, 100.0), "both underflow": (-150.0, -150.0), "A empty": (-math.inf, 2.0),
    "B empty": (1.0, -math.inf), "both empty": (-math.inf, -math.inf), "a gap of 100": (-60.0, 40.0),
}


def _merge_make(rng, params):
    ordinary = int(rng.integers(1, 5))
    lse = np.array([*_ROWS.values(), *rng.normal(0, 3, (ordinary, 2))])[rng.permutation(len(_ROWS) + ordinary)]
    Ev = int(rng.integers(2, 41))
    o = rng.standard_normal((2, len(lse), Ev))
    o[lse.T == -math.inf] = 0.0  # a part with no keys has output zeros
    f32 = np.float32
    return {"oa_h": o[0].astype(f32), "la_h": lse[:, 0].astype(f32), "ob_h": o[1].astype(f32),
            "lb_h": lse[:, 1].astype(f32)}


def _merge_expect(i, p):
    la, lb = i["la_h"].astype(np.float64), i["lb_h"].astype(np.float64)
    m = np.maximum(la, lb)
    m[m == -np.inf] = 0.0
    wa, wb = np.exp(la - m), np.exp(lb - m)
    total = wa + wb
    safe = np.where(total == 0, 1.0, total)
    o = (wa[:, None] * i["oa_h"] + wb[:, None] * i["ob_h"]) / safe[:, None]
    lse = np.where(total == 0, -np.inf, m + np.log(safe))
    return {"wrapped_o_h": o, "wrapped_lse_h": lse, "launched_o_h": o, "launched_lse_h": lse, "untouched_h": None}


HARNESS_MERGE = """\
import torch as _torch
import triton as _triton
_rows, _Ev = oa_h.shape
wrapped_o_h, wrapped_lse_h = merge_two(oa_h, la_h, ob_h, lb_h)
_o, _lse = _torch.full(((_rows + 1) * _Ev,), 7.0), _torch.full((_rows + 1,), 7.0)
merge_kernel[(_rows,)](oa_h, la_h, ob_h, lb_h, _o, _lse, _Ev, _triton.next_power_of_2(_Ev))
launched_o_h, launched_lse_h = _o[: _rows * _Ev].reshape(_rows, _Ev), _lse[:_rows]
untouched_h = bool((_o[_rows * _Ev :] == 7.0).all() and (_lse[_rows:] == 7.0).all())
"""


SPECS = [
    Spec(
        label="one-merge/striped-counts", title="Striped attention gives rank", draws=3,
        make=_striped_make, expect=lambda i, p: {"counts_h": striped_tiles(i["N_h"], i["P_h"], i["tile_h"])},
        harness="counts_h = striped_counts(N_h, P_h, tile_h)\n", rerun=False,
        compare={"counts_h": Close(0, 0, "striped_counts(N, P, tile): the P ranks' tile counts, in rank order "
                                         "(N a multiple of P * tile)")},
    ),
    Spec(
        label="one-merge/split-plan", title="FlashAttention-2's source gives an example of its split rule", draws=3,
        make=_split_make, expect=_split_expect, harness=HARNESS_SPLIT, rerun=False,
        compare={"splits_h": Whole("the slices split_plan(batch, kv_heads, keys, sms) picks, a whole number"),
                 "busy_h": Close(1e-9, 1e-12, "the share of the SMs busy, split_plan's second answer"),
                 "table_h": Close(1e-9, 1e-12, "wave_efficiencies(programs, sms, counts): each count's share of the SMs")},
    ),
    Spec(
        label="one-merge/recomputed-probabilities", title="The backward pass of the ring never stores", draws=3,
        make=_block_make, expect=_block_expect, torch_inputs=("q_h", "k_h"), rerun=False,
        harness="p_h = block_probabilities(q_h, k_h, start_h, stop_h)\n",
        compare={"p_h": Close(1e-6, 1e-9, "block_probabilities(q, k, start, stop): the (L, stop - start) "
                                         "probabilities")},
        forbidden=("lib.attention.attention_weights", "lib.attention.softmax"),
        banned=("softmax", "Softmax", "log_softmax"),
        poison=("torch.nn.functional.scaled_dot_product_attention", "lib.attention.attention"),
    ),
    Spec(
        label="one-merge/merge-kernel", title="Write the merge of two states as a Triton kernel", draws=2,
        make=_merge_make, expect=_merge_expect, harness=HARNESS_MERGE, rerun=False,
        torch_inputs=("oa_h", "la_h", "ob_h", "lb_h"),
        compare={"wrapped_o_h": Close(1e-5, 1e-6, "merge_two(...)[0]: the merged (rows, Ev) outputs"),
                 "wrapped_lse_h": Close(1e-5, 1e-5, "merge_two(...)[1]: the merged logsumexps"),
                 "launched_o_h": Close(1e-5, 1e-6, "the outputs merge_kernel stores when launched directly"),
                 "launched_lse_h": Close(1e-5, 1e-5, "the logsumexps merge_kernel stores when launched directly"),
                 "untouched_h": Holds(lambda a, i: None if a.get("untouched_h") is True
                                      else "merge_kernel stores past the last row", "nothing stored outside")},
        forbidden=("lib.merge.merge_states", "lib.merge.attention_state"),
    ),
]
