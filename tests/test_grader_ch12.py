"""Chapter 12's hidden tests, proven both ways on the real chapter (tools/hidden_tests/ch12.py): the official
solutions and answers written another way (other loops, NumPy, a list, float32, another kernel) get full marks;
typical mistakes, numbers typed in, a variable the notebook holds, the library called instead of the recomputation
written, and an empty kernel behind a PyTorch wrapper score 0."""

import pytest
from grading_helpers import grade, proven_both_ways

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader

CH12 = "chapters/12_one_merge.ipynb"

CORRECT = {
    # a count per owner rank by division, in plain integers, handed back as a NumPy array
    1: '''import numpy as np


def striped_counts(N, P, tile=64):
    tiles = N // P // tile  # tiles a rank, a side
    counts = []
    for r in range(P):
        total = 0
        for i in range(tiles):
            last = r + P * (i * tile + tile - 1)  # the query tile's last position
            for owner in range(P):
                # key tile j of `owner` starts at owner + P * j * tile: computed while that is <= last
                seen = (last - owner) // (P * tile) + 1 if last >= owner else 0
                total += min(tiles, seen)
        counts.append(total)
    return np.array(counts)''',
    # the wave efficiency by hand; the pair as a list holding a NumPy integer
    2: '''import numpy as np

a100, t4 = cost.gpu("A100"), cost.gpu("T4")


def wave_efficiencies(programs, sms, counts):
    table = {}
    for c in counts:
        waves = programs * c / sms
        table[c] = waves / math.ceil(waves)
    return table


def split_plan(batch, kv_heads, keys, sms):
    n = batch * kv_heads
    s = cost.choose_num_splits(n, keys, sms)
    return [np.int64(s), wave_efficiencies(n, sms, [s])[s]]


efficiencies = wave_efficiencies(48, a100.sms, [1, 2, 3])
a100_choice = split_plan(1, 48, 2**20, a100.sms)[0]
t4_splits, t4_busy = split_plan(4, 8, 8192, t4.sms)''',
    # the final lse from the library's attention state, the scores by einsum, float32 out
    3: '''def block_probabilities(q, k, start, stop):
    _, lse = attention_state(q, k, k)  # each row's lse over all the keys
    s = torch.einsum("le,se->ls", q, k[start:stop]) / q.shape[-1] ** 0.5
    return torch.exp(s - lse[..., None]).to(torch.float32)


g = torch.Generator().manual_seed(0)
q = torch.randn(3, 4, generator=g, dtype=torch.float64)
k = torch.randn(10, 4, generator=g, dtype=torch.float64)
v = torch.randn(10, 2, generator=g, dtype=torch.float64)
p_b = block_probabilities(q, k, 4, 10)''',
    # guards written as one `empty` flag; launched with keywords into zeroed buffers
    4: '''import triton
import triton.language as tl


@triton.jit
def merge_kernel(oa, la, ob, lb, o, lse, Ev: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    keep = d < Ev
    a = tl.load(la + i)
    b = tl.load(lb + i)
    hi = tl.maximum(a, b)
    empty = hi == float("-inf")
    hi = tl.where(empty, 0.0, hi)
    wa = tl.where(empty, 0.0, tl.exp(a - hi))
    wb = tl.where(empty, 0.0, tl.exp(b - hi))
    s = tl.where(empty, 1.0, wa + wb)
    xa = tl.load(oa + i * Ev + d, mask=keep, other=0.0)
    xb = tl.load(ob + i * Ev + d, mask=keep, other=0.0)
    tl.store(o + i * Ev + d, xa * (wa / s) + xb * (wb / s), mask=keep)
    tl.store(lse + i, tl.where(empty, float("-inf"), hi + tl.log(s)))


def merge_two(o_a, lse_a, o_b, lse_b):
    out, out_lse = torch.zeros_like(o_a), torch.zeros_like(lse_a)
    merge_kernel[(o_a.shape[0],)](o_a, lse_a, o_b, lse_b, out, out_lse, Ev=o_a.shape[1],
                                   BLOCK=triton.next_power_of_2(o_a.shape[1]))
    return out, out_lse''',
}
MISTAKES = {  # a tile skipped unless wholly visible; the SMs busy counted without the slices; the lse of the
    # block alone (a softmax over the block); the guard for a row with no keys forgotten
    1: ("official", "keys[j:j + tile].min() <= mine[i:i + tile].max()", "keys[j:j + tile].max() <= mine[i:i + tile].max()"),
    2: ("official", "return splits, cost.wave_efficiency(programs * splits, sms)",
        "return splits, cost.wave_efficiency(programs, sms)"),
    3: ("official", "lse = torch.logsumexp(scores, dim=-1)", "lse = torch.logsumexp(scores[:, start:stop], dim=-1)"),
    4: ("official", 'm = tl.where(m == float("-inf"), 0.0, m)', "m = m"),
}
CHEATS = {  # the chapter's counts typed in; the notebook's `chosen` (the H100's slices); the full attention matrix
    # from SDPA, sliced; an empty kernel behind a PyTorch wrapper
    1: "def striped_counts(N, P, tile=64):\n    return {2: [1056, 1056], 8: [288] * 8}.get(P, [64 * 65 // 2])",
    2: "official\n\n\ndef split_plan(batch, kv_heads, keys, sms):\n"
       "    return chosen, cost.wave_efficiency(batch * kv_heads * chosen, sms)",
    3: "official\n\n\ndef block_probabilities(q, k, start, stop):\n"
       "    eye = torch.eye(k.shape[0], dtype=q.dtype)\n"
       "    return F.scaled_dot_product_attention(q, k, eye)[:, start:stop]",
    4: '''import triton
import triton.language as tl


@triton.jit
def merge_kernel(oa, la, ob, lb, o, lse, Ev: tl.constexpr, BLOCK: tl.constexpr):
    pass


def merge_two(o_a, lse_a, o_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    safe = torch.where(total == 0, torch.ones_like(total), total)
    o = (wa[:, None] * o_a + wb[:, None] * o_b) / safe[:, None]
    return o, torch.where(total == 0, torch.full_like(total, -math.inf), m + torch.log(safe))''',
}


def test_chapter_12_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH12, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, {
        ("cheats", 1): "`counts_h`: expected striped_counts(N, P, tile)",
        ("cheats", 2): "`splits_h`: not the slices split_plan(batch, kv_heads, keys, sms) picks",
        ("cheats", 3): "write what torch.nn.functional.scaled_dot_product_attention does",
        ("cheats", 4): "`launched_o_h`: expected the outputs merge_kernel stores when launched directly",
        ("mistakes", 4): "`wrapped_o_h`: expected merge_two(...)[0]",
    }, grade.Limits(timeout=300, cell_timeout=120))
