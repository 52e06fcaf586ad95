"""lib.traffic: the bytes a Triton kernel moves, counted in the interpreter, against chapter 8's IO count."""

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from lib import flash, traffic

pytestmark = pytest.mark.skipif(not flash.INTERPRETED, reason="counts bytes in Triton's interpreter")


def _qkv(Z, L, S, E, Ev, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(Z, L, E, generator=g).to(dtype), torch.randn(Z, S, E, generator=g).to(dtype),
            torch.randn(Z, S, Ev, generator=g).to(dtype))


def _forward_counted(Z, L, S, E, Ev, block_m, block_n, causal, dtype=torch.float16):
    q, k, v = _qkv(Z, L, S, E, Ev, dtype)
    tiles = flash.Tiles(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1)
    with traffic.count() as moved:
        flash._forward(q, k, v, causal, 1 / math.sqrt(E), tiles=tiles)
    return moved


def _per_argument(moved):
    return {name: moved.bytes(name, "both") for name in ("Q", "K", "V", "O", "LSE")}


@pytest.mark.parametrize("n,d,block_m,block_n", [(64, 16, 16, 16), (64, 32, 32, 16), (96, 64, 32, 32),
                                                 (128, 16, 64, 16)])
def test_forward_moves_exactly_chapter_8s_count(n, d, block_m, block_n):
    # chapter 8: Q read once, K and V once per query block, O written once, n logsumexps:
    # 2nd + 2nd·ceil(n / B_r) numbers, the logsumexps in float32
    moved = _forward_counted(1, n, n, d, d, block_m, block_n, causal=False)
    chapter_8 = 2 * (2 * n * d + 2 * n * d * math.ceil(n / block_m)) + 4 * n
    assert moved.bytes(kind="both") == chapter_8
    assert moved.kernels() == ["_flash_forward"]
    assert moved.launches[0].programs == math.ceil(n / block_m)


@settings(max_examples=12, deadline=None)
@given(Z=st.integers(1, 3), L=st.integers(1, 70), S=st.integers(1, 70), E=st.sampled_from([8, 16, 40]),
       Ev=st.sampled_from([16, 24]), block_m=st.sampled_from([16, 32]), block_n=st.sampled_from([16, 32]),
       causal=st.booleans(), dtype=st.sampled_from([torch.float16, torch.float32]))
def test_forward_moves_what_the_formula_says_for_ragged_shapes(Z, L, S, E, Ev, block_m, block_n, causal, dtype):
    if causal and L != S:
        S = L  # the kernel's causal rule is top-left; L = S keeps the shape every caller uses
    moved = _forward_counted(Z, L, S, E, Ev, block_m, block_n, causal, dtype)
    expected = traffic.flash_forward_bytes(L, S, E, Ev, block_m=block_m, block_n=block_n, causal=causal,
                                           batch_heads=Z, bytes_per_number=dtype.itemsize)
    assert _per_argument(moved) == expected
    assert moved.bytes(traffic.UNKNOWN, "both") == 0


def test_causal_skips_the_future_tiles():
    full = _forward_counted(1, 128, 128, 16, 16, 16, 16, causal=False)
    causal = _forward_counted(1, 128, 128, 16, 16, 16, 16, causal=True)
    # 8 query tiles of 16: tile t reads t + 1 key tiles, 36 of 64
    assert causal.bytes("K") * 64 == full.bytes("K") * 36
    assert causal.bytes("Q") == full.bytes("Q") and causal.bytes("O", "store") == full.bytes("O", "store")


def test_masked_lanes_move_nothing():
    # 17 queries in tiles of 16: the second tile has one live row of 16, and E = 8 is padded to 16 lanes
    moved = _forward_counted(1, 17, 17, 8, 8, 16, 16, causal=False)
    assert moved.bytes("Q") == 17 * 8 * 2
    assert moved.bytes("O", "store") == 17 * 8 * 2
    assert moved.bytes("K") == 2 * 17 * 8 * 2


@triton.jit
def _scores_to_memory(Q, K, SCORES, L, S, E: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e = tl.arange(0, E)
    q = tl.load(Q + rows[:, None] * E + e[None, :], mask=rows[:, None] < L, other=0.0)
    k = tl.load(K + cols[:, None] * E + e[None, :], mask=cols[:, None] < S, other=0.0)
    s = tl.dot(q, tl.trans(k))
    tl.store(SCORES + rows[:, None] * S + cols[None, :], s, mask=(rows[:, None] < L) & (cols[None, :] < S))


def _naive_scores(n, E=16, block=16):
    q, k, _ = _qkv(1, n, n, E, E, torch.float32)
    scores = torch.empty(n, n)
    with traffic.count() as moved:
        _scores_to_memory[(triton.cdiv(n, block), triton.cdiv(n, block))](q[0], k[0], scores, n, n, E=E,
                                                                          BLOCK=block)
    torch.testing.assert_close(scores, q[0] @ k[0].T, rtol=1e-5, atol=1e-5)
    return moved


def test_a_kernel_that_writes_the_scores_shows_the_quadratic_term():
    small, large = _naive_scores(32), _naive_scores(64)
    assert small.bytes("SCORES", "store") == 32 * 32 * 4
    assert large.bytes("SCORES", "store") == 4 * small.bytes("SCORES", "store")  # n² grows 4x when n doubles
    fused = _forward_counted(1, 64, 64, 16, 16, 64, 16, causal=False)  # one query tile: K, V read once
    assert fused.bytes(kind="both") < large.bytes("SCORES", "store")


def test_a_wrapper_that_calls_torch_launches_nothing():
    q, k, v = _qkv(1, 16, 16, 16, 16, torch.float32)
    with traffic.count() as moved:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert moved.launches == [] and moved.bytes(kind="both") == 0


def test_counting_ends_with_the_block():
    from triton.runtime import interpreter

    before = interpreter.InterpreterBuilder.create_masked_load
    with traffic.count():
        assert interpreter.InterpreterBuilder.create_masked_load is not before
    assert interpreter.InterpreterBuilder.create_masked_load is before
    after = _forward_counted(1, 16, 16, 16, 16, 16, 16, causal=False)  # a later block counts afresh
    assert after.bytes("Q") == 16 * 16 * 2


def test_refusals(monkeypatch):
    with traffic.count(), pytest.raises(ValueError, match="do not nest"), traffic.count():
        pass
    moved = _forward_counted(1, 16, 16, 16, 16, 16, 16, causal=False)
    with pytest.raises(ValueError, match="kind must be"):
        moved.bytes("Q", "read")
    with pytest.raises(ValueError, match="no launch of a kernel named"):
        moved.bytes("Q", kernel="_flash_backward_kv")
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        traffic.flash_forward_bytes(16, block_m=0, block_n=16)
    monkeypatch.setattr(flash, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"), traffic.count():
        pass


def test_backward_kernels_are_counted_too():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 32, 32, 16, 16, torch.float32))
    out = flash.flash_attention(q, k, v)
    with traffic.count() as moved:
        out.backward(torch.ones_like(out))
    assert len(moved.launches) >= 2
    # every key's gradient is written exactly once, whichever kernel writes it
    assert moved.bytes("DK", "store") == 32 * 16 * 4
    assert moved.bytes("DV", "store") == 32 * 16 * 4
    assert moved.bytes(traffic.UNKNOWN, "both") == 0


def test_the_table_sets_each_count_beside_the_formula(capsys):
    traffic.main(["--L", "40", "--S", "72", "--E", "24", "--block-m", "16", "--block-n", "32", "--causal",
                  "--dtype", "float32"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["Q", "K", "V", "O", "LSE", "total"]
    assert all(row[1] == row[2] for row in rows)
    formula = traffic.flash_forward_bytes(40, 72, 24, block_m=16, block_n=32, causal=True, bytes_per_number=4)
    assert rows[-1][1] == f"{sum(formula.values()):,}"
    with pytest.raises(ValueError, match="no bfloat16"):
        traffic.forward_table(16, 16, 16, block_m=16, block_n=16, dtype="bfloat16")
