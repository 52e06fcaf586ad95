"""Sliding-window attention in the tiled and Triton kernels (chapter 13): the ``window`` argument of
``lib.tiles.tiled_attention`` and ``lib.flash.flash_attention``, forward and backward, against SDPA with the band
mask as the oracle.

Skipped tiles are proven skipped, not merely masked: a tile the kernel visits reads its values, so values poisoned
with NaN in every key block outside all of a query block's windows leave the output finite only if no such tile is
ever loaded; in the backward pass, queries and output gradients poisoned in every query block that no window of a
key block reaches leave that key block's dK and dV finite only if the kernel never loads those blocks.
"""

import pytest
import torch
import torch.nn.functional as F

from lib import flash
from lib.tiles import tile_count, tiled_attention
from lib.variants import sliding_window_mask

DEVICE = "cpu" if flash.INTERPRETED else "cuda"
CASES = [(37, 37, 5, (8, 4)), (37, 37, 1, (8, 8)), (10, 50, 7, (4, 6)), (64, 64, 100, (16, 16)), (33, 33, 16, (16, 16))]


def qkv(L, S, seed=0, E=8, Ev=5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, L, E, generator=g).to(device), torch.randn(2, 3, S, E, generator=g).to(device),
            torch.randn(2, 3, S, Ev, generator=g).to(device))


def band_oracle(q, k, v, window):
    L, S = q.shape[-2], k.shape[-2]
    band = sliding_window_mask(L, S, window, align="bottom-right", device=q.device)  # as causal="bottom-right"
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band)


def test_band_mask_is_the_causal_mask_cut_to_the_window():
    mask = sliding_window_mask(6, 6, 3)
    expected = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    assert torch.equal(mask, expected)
    assert mask.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]  # window keys, itself included, once the window is full
    assert torch.equal(sliding_window_mask(2, 6, 3, align="bottom-right"), mask[-2:])  # the last 2 of 6 tokens
    assert torch.equal(sliding_window_mask(2, 6, 3), mask[:2, :])  # top-left, as causal=True
    assert torch.equal(sliding_window_mask(5, 5, 99), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("L, S, window, block", CASES, ids=str)
def test_tiled_window_equals_sdpa_with_the_band_mask(L, S, window, block):
    q, k, v = qkv(L, S)
    causal = True if L == S else "bottom-right"
    expected = band_oracle(q, k, v, window)
    torch.testing.assert_close(tiled_attention(q, k, v, causal=causal, window=window, block_size=block), expected)
    out = tiled_attention(q.numpy(), k.numpy(), v.numpy(), causal=causal, window=window, block_size=block)
    torch.testing.assert_close(torch.from_numpy(out), expected)


@pytest.mark.parametrize("L, S, window, block", CASES, ids=str)
def test_tile_count_is_exactly_the_tiles_the_band_touches(L, S, window, block):
    bq, bk = block
    causal = True if L == S else "bottom-right"
    mask = sliding_window_mask(L, S, window, align="bottom-right")
    touched = sum(bool(mask[i:i + bq, j:j + bk].any()) for i in range(0, L, bq) for j in range(0, S, bk))
    assert tile_count(L, S, block, causal=causal, window=window) == touched
    assert tile_count(L, S, block, causal=causal, window=window) <= tile_count(L, S, block, causal=causal)


def poisoned_blocks(v, L, window, bq, bk):
    """For each block of bq query rows: its rows, and v with NaN in every key block its windows do not reach."""
    S = v.shape[-2]
    mask = sliding_window_mask(L, S, window, align="bottom-right")
    for i in range(0, L, bq):
        seen = mask[i:i + bq].nonzero()[:, 1]
        needed = torch.zeros(S, dtype=torch.bool)
        needed[int(seen.min()) // bk * bk: min(S, (int(seen.max()) // bk + 1) * bk)] = True
        poisoned = v.clone()
        poisoned[..., ~needed, :] = float("nan")
        yield slice(i, i + bq), poisoned, int((~needed).sum())


def test_tiled_window_never_reads_a_tile_outside_the_window():
    L, window, block = 64, 9, (8, 8)
    q, k, v = qkv(L, L, seed=1)
    expected = band_oracle(q, k, v, window)
    skipped = 0
    for rows, poisoned, n_poisoned in poisoned_blocks(v, L, window, *block):
        skipped += n_poisoned
        for backend in (torch.as_tensor, lambda t: t.numpy()):
            out = tiled_attention(backend(q), backend(k), backend(poisoned), causal=True, window=window,
                                  block_size=block)
            torch.testing.assert_close(torch.as_tensor(out)[..., rows, :], expected[..., rows, :])
    assert skipped > (L // block[0]) * L // 2  # most keys were poisoned for most blocks


@pytest.mark.parametrize("L, window", [(40, 3), (64, 16), (50, 17), (33, 100)])
def test_flash_window_equals_sdpa_and_skips_old_tiles(L, window):
    q, k, v = qkv(L, L, seed=2, E=16, Ev=16, device=DEVICE)
    expected = band_oracle(q, k, v, window).cpu()
    torch.testing.assert_close(flash.flash_attention(q, k, v, causal=True, window=window).cpu(), expected,
                               rtol=1e-4, atol=1e-4)
    if flash.INTERPRETED:  # the interpreter's tiles are fixed, so each query block's skipped keys are known
        tiles = flash.INTERPRETER_TILES
        for rows, poisoned, _ in poisoned_blocks(v.cpu(), L, window, tiles.block_m, tiles.block_n):
            out = flash.flash_attention(q, k, poisoned.to(DEVICE), causal=True, window=window)
            torch.testing.assert_close(out.cpu()[..., rows, :], expected[..., rows, :], rtol=1e-4, atol=1e-4)


def test_window_errors_name_the_argument():
    q, k, v = qkv(8, 8)
    with pytest.raises(ValueError, match="window must be at least 1"):
        tiled_attention(q, k, v, causal=True, window=0)
    with pytest.raises(TypeError, match="window must be an integer"):
        tiled_attention(q, k, v, causal=True, window=2.5)
    with pytest.raises(ValueError, match="window needs causal"):
        tiled_attention(q, k, v, window=3)
    with pytest.raises(ValueError, match="window must be at least 1"):
        sliding_window_mask(4, 4, 0)
    qd, kd, vd = (t.to(DEVICE) for t in (q, k, v))
    with pytest.raises(ValueError, match="window must be at least 1"):
        flash.flash_attention(qd, kd, vd, causal=True, window=-1)
    with pytest.raises(ValueError, match="window needs causal"):
        flash.flash_attention(qd, kd, vd, window=4)


def test_tiled_window_gradients_equal_sdpa_with_the_band_mask():
    q, k, v = (t.requires_grad_() for t in qkv(20, 20, seed=3))
    out = tiled_attention(q, k, v, causal=True, window=6, block_size=(4, 4))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(band_oracle(q, k, v, 6).square().sum(), (q, k, v))
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "two-kernels"])
@pytest.mark.parametrize("L, window", [(40, 3), (64, 16), (50, 17), (33, 100), (37, 1)])
def test_flash_window_gradients_equal_sdpa_with_the_band_mask(L, window, deterministic):
    q, k, v = (t.requires_grad_() for t in qkv(L, L, seed=4, E=16, Ev=8, device=DEVICE))
    do, dlse = torch.randn(2, 3, L, 8).to(DEVICE), torch.randn(2, 3, L).to(DEVICE)
    out, lse = flash.flash_attention(q, k, v, causal=True, window=window, deterministic=deterministic,
                                     return_lse=True)
    grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    mask = sliding_window_mask(L, L, window)
    want = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask)
    want_lse = torch.logsumexp((q64 @ k64.transpose(-1, -2) / 4).masked_fill(~mask, float("-inf")), -1)
    expected = torch.autograd.grad((want * do.double().cpu()).sum() + (want_lse * dlse.double().cpu()).sum(),
                                   (q64, k64, v64))
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), rtol=1e-4, atol=1e-4)
    for name, ours, theirs in zip("qkv", grads, expected):
        torch.testing.assert_close(ours.cpu().double(), theirs, rtol=1e-4, atol=1e-4, msg=f"d{name}")


@pytest.mark.skipif(not flash.INTERPRETED, reason="the interpreter's tiles are fixed, so each key block's reach is known")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "two-kernels"])
@pytest.mark.parametrize("window", [9, 1, 17])  # 1 and 17: a key block's reach ends exactly on a query block's edge
def test_flash_window_backward_skips_the_query_blocks_no_window_reaches(deterministic, window):
    L = 64
    bm, bn = flash.INTERPRETER_TILES.block_m, flash.INTERPRETER_TILES.block_n
    q, k, v = qkv(L, L, seed=5, E=16, Ev=16, device=DEVICE)
    do = torch.randn(2, 3, L, 16)
    mask = sliding_window_mask(L, L, window)
    for first in range(0, L, bn):  # each key block: the query blocks its keys' windows reach
        reached = {i // bm for i in range(L) if mask[i, first:first + bn].any()}
        far = torch.tensor([i // bm not in reached for i in range(L)])
        assert far.any()  # a block no window reaches exists, or the test proves nothing
        poisoned_q, poisoned_do = q.clone(), do.clone()
        poisoned_q[..., far, :] = float("nan")
        poisoned_do[..., far, :] = float("nan")
        grads = []
        for x, g in ((q, do), (poisoned_q, poisoned_do)):
            x, kk, vv = (t.clone().requires_grad_() for t in (x, k, v))
            out = flash.flash_attention(x, kk, vv, causal=True, window=window, deterministic=deterministic)
            grads.append(torch.autograd.grad(out, (kk, vv), g)[0:2])
        for clean, poisoned in zip(*grads):
            keys = slice(first, first + bn)
            torch.testing.assert_close(poisoned[..., keys, :], clean[..., keys, :], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not flash.INTERPRETED, reason="the interpreter's tiles are fixed, so each query block's reach is known")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "two-kernels"])
@pytest.mark.parametrize("window", [9, 1, 17])
def test_flash_window_backward_never_reads_keys_older_than_a_query_blocks_windows(deterministic, window):
    # dQ of a query block, from the dQ kernel or from the dK/dV kernel's atomic adds, stays exact when every key
    # block wholly older than all of its rows' windows holds NaN keys and values: no kernel loads them for it.
    L = 64
    bm, bn = flash.INTERPRETER_TILES.block_m, flash.INTERPRETER_TILES.block_n
    q, k, v = qkv(L, L, seed=6, E=16, Ev=16, device=DEVICE)
    do = torch.randn(2, 3, L, 16)
    poisoned_any = False
    for first in range(0, L, bm):
        rows = slice(first, first + bm)
        old = torch.tensor([j // bn * bn + bn - 1 < first - window + 1 for j in range(L)])  # whole blocks only
        if not old.any():
            continue
        poisoned_any = True
        poisoned_k, poisoned_v = k.clone(), v.clone()
        poisoned_k[..., old, :] = float("nan")
        poisoned_v[..., old, :] = float("nan")
        dqs = []
        for kk, vv in ((k, v), (poisoned_k, poisoned_v)):
            x = q.clone().requires_grad_()
            out = flash.flash_attention(x, kk, vv, causal=True, window=window, deterministic=deterministic)
            dqs.append(torch.autograd.grad(out, x, do)[0])
        torch.testing.assert_close(dqs[1][..., rows, :], dqs[0][..., rows, :], rtol=1e-5, atol=1e-6)
    assert poisoned_any


def top_left_band(L, S, window):
    """Query i sees keys i - window < j <= i: flash_attention's window, top-left aligned, for any L and S."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return (j <= i) & (j > i - window)


@pytest.mark.skipif(not flash.INTERPRETED, reason="forces tiles in the interpreter")
@pytest.mark.parametrize("block", [(32, 16), (16, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("L, S, window", [(45, 70, 6), (70, 45, 17), (40, 40, 33), (1, 9, 2)])
def test_flash_window_with_unequal_tiles_and_lengths_equals_the_band_reference(L, S, window, block):
    # The GPU tables' tiles are rarely square, and the key block's reach (dK/dV) and the query block's (dQ) are
    # counted in different units: both are checked with query tiles taller and shorter than key tiles.
    tiles = flash.Tiles(*block, num_warps=4, num_stages=1)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(2, n, 16, generator=g) for n in (L, S, S, L))
    scale = 0.25
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    scores = (ref[0] @ ref[1].transpose(-1, -2) * scale).masked_fill(~top_left_band(L, S, window), float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no key (none here) would give zeros
    want = weights @ ref[2]
    expected = torch.autograd.grad(want, ref, do.double())
    o, lse = flash._forward(q, k, v, True, scale, tiles=tiles, window=window)
    torch.testing.assert_close(o.double(), want.detach(), rtol=1e-4, atol=1e-5)
    for variant in (flash.DEFAULT, flash.DETERMINISTIC):
        grads = flash._backward(q, k, v, o, lse, do, True, scale, tiles=tiles, variant=variant, q_tiles=tiles,
                                window=window)
        for name, ours, theirs in zip("qkv", grads, expected):
            torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5, msg=f"d{name}, {variant}")


def test_a_window_as_long_as_the_queries_is_plain_causal():
    # query i < L sees every key j <= i once window >= L: the call is plain causal, and stays exact for a window
    # near 2**31, where the kernels' int32 "key + window" would wrap
    q, k, v = (t.requires_grad_() for t in qkv(40, 40, seed=8, E=16, Ev=16, device=DEVICE))
    want = flash.flash_attention(q, k, v, causal=True)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for window in (40, 41, 2**31 - 1, 2**40):
        out = flash.flash_attention(q, k, v, causal=True, window=window)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for ours, theirs in zip(torch.autograd.grad(out.sum(), (q, k, v)), want_grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
