"""Chapter 5's hidden tests, proven both ways on the real chapter: the official solutions and answers written apart
from them (a loop of lists, a hand-written masked softmax in torch, SDPA on a filled copy) get full marks; an
off-by-one window, `is_causal=True` for a chunk, the mask's polarity flipped, the library's mask called instead of
written and variables the notebook holds score 0."""

import sys

import pytest
from grading_helpers import ROOT, proven_both_ways

sys.path.insert(0, str(ROOT / "tools"))
import grade

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH5 = "chapters/05_masking_and_cross_attention.ipynb"

OFFICIAL_MASK = '''def causal_bottom_right(L, S, window=None):
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    diagonal = i + (S - L)  # the key position of query i in the whole sequence
    mask = j <= diagonal  # (L, S)
    if window is not None:
        mask &= j > diagonal - window  # only the last `window` keys
    return mask'''
OFFICIAL_CHUNK = '''def prefill_chunk(q_c, k_seen, v_seen):
    mask = causal_bottom_right(q_c.shape[-2], k_seen.shape[-2])  # (L, S)
    return F.scaled_dot_product_attention(
        q_c, k_seen, v_seen, attn_mask=torch.from_numpy(mask)
    )'''

CORRECT = {
    1: ("official", OFFICIAL_MASK, '''def causal_bottom_right(L, S, window=None):
    offset = S - L
    rows = []
    for i in range(L):
        lo = 0 if window is None else max(0, i + offset - window + 1)
        rows.append([lo <= j <= i + offset for j in range(S)])
    return np.array(rows, dtype=bool).reshape(L, S)'''),
    2: ("official", OFFICIAL_CHUNK, '''def prefill_chunk(q_c, k_seen, v_seen):
    allowed = torch.as_tensor(causal_bottom_right(len(q_c), len(k_seen)))
    scores = q_c @ k_seen.T / math.sqrt(q_c.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_seen'''),
    3: '''def filled_outputs(Q, K, V, key_ok, filler):
    V = np.array(V, dtype=float, copy=True)
    for b in range(V.shape[0]):
        V[b, ~key_ok[b, 0]] = filler
    tensors = (torch.from_numpy(x) for x in (Q, K, V))
    return F.scaled_dot_product_attention(*tensors, attn_mask=torch.from_numpy(key_ok))


out_huge = filled_outputs(Qb, Kb, Vb, key_ok, 1e6).numpy()
out_nan = filled_outputs(Qb, Kb, Vb, key_ok, float("nan")).numpy()''',
}
MISTAKES = {  # a window one key too wide; a chunk aligned top-left; the mask's polarity flipped
    1: ("official", "mask &= j > diagonal - window", "mask &= j >= diagonal - window"),
    2: ("official", "q_c, k_seen, v_seen, attn_mask=torch.from_numpy(mask)", "q_c, k_seen, v_seen, is_causal=True"),
    3: ("official", "np.where(real, V, filler)", "np.where(real, filler, V)"),
}
CHEATS = {  # the library's mask called; the chapter's bottom-right outputs and its padded batch's outputs returned
    1: ("official", OFFICIAL_MASK, '''def causal_bottom_right(L, S, window=None):
    mask = attn.causal_mask(L, S, align="bottom-right")
    if window is not None:
        mask = np.triu(mask, k=S - L - window + 1)
    return mask'''),
    2: ("official", OFFICIAL_CHUNK, "def prefill_chunk(q_c, k_seen, v_seen):\n    return with_bias"),
    3: "def filled_outputs(Q, K, V, key_ok, filler):\n    return out_b\n\n\n"
       "out_huge = out_b\nout_nan = np.where(np.arange(3)[:, None, None] > 0, np.nan, out_b)",
}


def test_chapter_5_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH5, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, {
        ("cheats", 1): "your answer uses `causal_mask`",
        ("mistakes", 2): "`last_h`: expected prefill_chunk",
        ("cheats", 3): "`finite_h`: expected",
    }, grade.Limits(timeout=300, cell_timeout=120), partial={"partial": ({1: MISTAKES[1], 2: "official"}, {2: 1})})
