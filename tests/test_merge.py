"""lib.merge: attention states over parts of the keys, merged in any order and grouping, against SDPA over all keys."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lib import attention as attn
from lib.merge import attention_state, merge_states

EXACT = {"rtol": 1e-12, "atol": 1e-12}


def qkv(B, L, S, E, Ev, seed=0, dtype=torch.float64, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, E, generator=gen, dtype=dtype) * spread
    k = torch.randn(B, S, E, generator=gen, dtype=dtype)
    v = torch.randn(B, S, Ev, generator=gen, dtype=dtype)
    return q, k, v


def merge_in_tree(states, data):
    """Merge a list of states by a random binary tree whose leaves are in a random order."""
    states = data.draw(st.permutations(states))
    while len(states) > 1:
        i = data.draw(st.integers(0, len(states) - 2))
        merged = merge_states([states[i], states[i + 1]])
        states = states[:i] + [merged] + states[i + 2 :]
    return states[0]


@st.composite
def partitions(draw, S):
    """Cut points splitting range(S) into consecutive parts, empty parts allowed."""
    cuts = sorted(draw(st.lists(st.integers(0, S), min_size=0, max_size=6)))
    edges = [0, *cuts, S]
    return list(itertools.pairwise(edges))


@given(data=st.data(), S=st.integers(1, 24), L=st.integers(1, 5), causal=st.booleans(), seed=st.integers(0, 99))
def test_any_partition_and_any_merge_tree_equal_sdpa_over_all_keys(data, S, L, causal, seed):
    q, k, v = qkv(2, L, S, 4, 3, seed=seed)
    mask = torch.ones(L, S, dtype=torch.bool).tril() if causal else None  # top-left, as is_causal
    parts = data.draw(partitions(S))
    states = [
        attention_state(q, k[:, a:b], v[:, a:b], None if mask is None else mask[None, :, a:b]) for a, b in parts
    ]
    out, lse = merge_in_tree(states, data)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), **EXACT)
    scores = (q @ k.mT) / 2.0
    if causal:
        scores = scores.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **EXACT)


@given(data=st.data(), S=st.integers(1, 16), seed=st.integers(0, 99))
def test_rows_with_no_key_in_any_part_merge_to_zeros_and_minus_infinity(data, S, seed):
    L = 4
    q, k, v = qkv(1, L, S, 4, 3, seed=seed)
    allowed = torch.rand(L, S, generator=torch.Generator().manual_seed(seed)) < 0.4
    allowed[0] = False  # one row that may attend nothing at all
    states = [attention_state(q, k[:, a:b], v[:, a:b], allowed[:, a:b]) for a, b in data.draw(partitions(S))]
    out, lse = merge_in_tree(states, data)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, attn.attention(q, k, v, allowed), **EXACT)  # zeros where a row is empty
    empty = ~allowed.any(-1)
    assert torch.equal(lse[0, empty], torch.full((int(empty.sum()),), -math.inf, dtype=lse.dtype))
    assert torch.isfinite(lse[0, ~empty]).all()


@pytest.mark.parametrize("gap", [100.0, 300.0, 700.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logsumexp_gaps_in_the_hundreds_stay_finite(gap, dtype):
    out_a = torch.tensor([[1.0, 2.0]], dtype=dtype)
    out_b = torch.tensor([[-3.0, 5.0]], dtype=dtype)
    for lse_a, lse_b in ((0.0, gap), (gap, 0.0), (-gap, gap)):
        out, lse = merge_states([(out_a, torch.tensor([lse_a], dtype=dtype)), (out_b, torch.tensor([lse_b], dtype=dtype))])
        winner = out_a if lse_a > lse_b else out_b
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(out, winner)
        torch.testing.assert_close(lse, torch.tensor([max(lse_a, lse_b)], dtype=dtype))


def test_real_parts_hundreds_apart_match_sdpa():
    q, k, v = qkv(1, 3, 10, 4, 3, seed=7)
    k[:, :5] *= 200.0  # the first part's scores, and so its lse, sit hundreds above the second part's
    states = [attention_state(q, k[:, :5], v[:, :5]), attention_state(q, k[:, 5:], v[:, 5:])]
    gaps = (states[0][1] - states[1][1]).abs()
    assert gaps.max() > 100
    out, _ = merge_states(states)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **EXACT)
    out32, lse32 = merge_states([(o.float(), s.float()) for o, s in states])
    assert torch.isfinite(out32).all() and torch.isfinite(lse32).all()


def test_numpy_and_torch_agree_and_keep_their_kinds():
    q, k, v = qkv(2, 3, 7, 4, 5, seed=3)
    np_states = [attention_state(q.numpy(), k.numpy()[:, a:b], v.numpy()[:, a:b]) for a, b in ((0, 2), (2, 7))]
    t_states = [attention_state(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 2), (2, 7))]
    np_out, np_lse = merge_states(np_states)
    t_out, t_lse = merge_states(t_states)
    assert isinstance(np_out, np.ndarray) and isinstance(np_lse, np.ndarray)
    assert np_out.shape == (2, 3, 5) and np_lse.shape == (2, 3)
    np.testing.assert_allclose(np_out, t_out.numpy(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np_lse, t_lse.numpy(), rtol=1e-13, atol=1e-13)


def test_empty_key_set_gives_zeros_and_minus_infinity():
    q, k, v = qkv(1, 2, 0, 4, 3)
    for x in ((q, k, v), (q.numpy(), k.numpy(), v.numpy())):
        out, lse = attention_state(*x)
        assert out.shape == (1, 2, 3) and (out == 0).all()
        assert (lse == -math.inf).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_are_kept_and_half_lse_is_float32(dtype):
    q, k, v = qkv(1, 3, 8, 4, 4, dtype=dtype)
    out, lse = attention_state(q, k, v)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float32 if dtype != torch.float32 else dtype)
    merged, mlse = merge_states([attention_state(q, k[:, :3], v[:, :3]), attention_state(q, k[:, 3:], v[:, 3:])])
    assert merged.dtype == dtype and mlse.dtype == lse.dtype
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(merged.double(), ref, rtol=2e-2, atol=2e-2)


def test_gradients_through_the_merge_equal_autograd_through_sdpa():
    q, k, v = (x.requires_grad_() for x in qkv(2, 4, 9, 4, 3, seed=11))
    out, _ = merge_states([attention_state(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 4), (4, 4), (4, 9))])
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), dout)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **EXACT)


def test_bad_states_raise_clear_errors():
    out, lse = attention_state(*qkv(1, 2, 4, 4, 3))
    with pytest.raises(ValueError, match="at least one"):
        merge_states([])
    with pytest.raises(ValueError, match="same queries"):
        merge_states([(out, lse), (out[:, :1], lse[:, :1])])
    with pytest.raises(ValueError, match=r"expected \(\.\.\., L\)"):
        merge_states([(out, lse[..., None])])
    with pytest.raises(TypeError, match="pair"):
        merge_states([out])
    with pytest.raises(TypeError, match="out0 has dtype torch.int64; attention states are floating point"):
        merge_states([(out.long(), lse)])
    with pytest.raises(TypeError, match="lse1 has dtype int32"):
        merge_states([(out.numpy(), lse.numpy()), (out.numpy(), lse.numpy().astype(np.int32))])
    with pytest.raises(TypeError, match="NumPy arrays or all torch"):
        merge_states([(out, lse), (out.numpy(), lse.numpy())])
    with pytest.raises(ValueError, match="E=3 but q has E=4"):
        attention_state(torch.ones(2, 4), torch.ones(3, 3), torch.ones(3, 2))


@given(seed=st.integers(0, 99), causal=st.booleans())
def test_numpy_states_with_masks_merge_to_the_library_attention(seed, causal):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 5))
    mask = rng.random((3, 7)) < 0.6
    states = [attention_state(q, k[:, a:b], v[:, a:b], mask[:, a:b], causal=False) for a, b in ((0, 3), (3, 7))]
    out, lse = merge_states(states)
    np.testing.assert_allclose(out, attn.attention(q, k, v, mask), rtol=1e-12, atol=1e-12)
    whole_out, whole_lse = attention_state(q, k, v, mask, causal=causal)
    np.testing.assert_allclose(whole_out, attn.attention(q, k, v, mask, causal=causal), rtol=1e-12, atol=1e-12)
    assert not np.isnan(whole_lse).any() and not np.isnan(lse).any()
