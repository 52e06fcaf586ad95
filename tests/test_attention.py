"""lib.attention against PyTorch's kernel, and the properties no oracle states.

The oracle is torch.nn.functional.scaled_dot_product_attention in float64. Its attention weights come from the same
kernel: attention with V = the identity matrix returns the weight matrix itself.
"""

import math
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lib import attention as attn
from lib import speed, tiles
from lib.tiles import tiled_attention

TOL = {"rtol": 1e-9, "atol": 1e-9}
IMPLEMENTATIONS = {
    "attention": attn.attention,
    "attention_loop": attn.attention_loop,
    "tiled_attention": tiled_attention,
}


# ----------------------------------------------------------------------------------------------------------------
# Helpers: the oracle, and random cases
# ----------------------------------------------------------------------------------------------------------------


def causal_offset(causal, L, S):
    """Where the causal diagonal lies: key j is allowed for query i when j <= i + offset; None for no pattern."""
    if causal is False:
        return None
    return S - L if causal == "bottom-right" else 0  # True and "top-left" are SDPA's is_causal


def combined_mask(mask, causal, L, S):
    """The one attn_mask for SDPA that means `mask` and `causal` together (SDPA is inconsistent with both)."""
    offset = causal_offset(causal, L, S)
    if offset is None:
        return mask
    tril = torch.ones(L, S, dtype=torch.bool).tril(offset)
    if mask is None:
        return tril
    if mask.dtype == torch.bool:
        return mask & tril
    return mask.masked_fill(~tril, -math.inf)


def sdpa(q, k, v, mask=None, causal=False, scale=None):
    """The oracle on NumPy float64 inputs; batch dims broadcast by hand, as SDPA expects equal ones."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    tq, tk, tv = (torch.from_numpy(np.broadcast_to(x, batch + x.shape[-2:]).copy()) for x in (q, k, v))
    tm = None if mask is None else torch.from_numpy(np.asarray(mask))
    tm = combined_mask(tm, causal, q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, scale=scale).numpy()


def sdpa_weights(q, k, mask=None, causal=False, scale=None):
    S = k.shape[-2]
    return sdpa(q, k, np.eye(S), mask, causal, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))


@st.composite
def cases(draw, max_batch_dims=2, max_len=6):
    """Random q, k, v (float64) with broadcasting batch dims, L != S, E != Ev, and an optional mask of any kind."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=max_batch_dims)))
    L, S = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    E, Ev = draw(st.integers(1, 5)), draw(st.integers(1, 5))

    def batch_for(full):
        # each operand may drop leading batch dims or hold 1 where the others hold more
        dims = full[draw(st.integers(0, len(full))):]
        return tuple(1 if draw(st.booleans()) else d for d in dims)

    q = rng.standard_normal(batch_for(batch) + (L, E)) * draw(st.sampled_from([0.5, 1.0, 3.0]))
    k = rng.standard_normal(batch_for(batch) + (S, E))
    v = rng.standard_normal(batch_for(batch) + (S, Ev))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    kind = draw(st.sampled_from(["none", "bool", "float", "float-inf"]))
    mask = None
    if kind != "none":
        mshape = batch_for(batch) + tuple(1 if draw(st.booleans()) else n for n in (L, S))
        if kind == "bool":
            mask = rng.random(mshape) < draw(st.sampled_from([0.3, 0.7, 1.0]))
        else:
            mask = rng.standard_normal(mshape)
            if kind == "float-inf":
                mask[rng.random(mshape) < 0.4] = -np.inf
    causal = draw(st.sampled_from([False, True, "top-left", "bottom-right"]))
    if causal == "bottom-right" and L > S:
        causal = True  # bottom-right needs L <= S: every query keeps at least one key
    scale = draw(st.sampled_from([None, None, 0.1, 1.0, 2.5]))
    return q, k, v, mask, causal, scale


def full_batch(x, *others):
    """x broadcast over the batch dims of x and others."""
    batch = np.broadcast_shapes(*(a.shape[:-2] for a in (x, *others)))
    return np.broadcast_to(x, batch + x.shape[-2:])


def to_torch(*arrays, **kw):
    return [None if a is None else torch.from_numpy(np.asarray(a)).to(**kw) for a in arrays]


# ----------------------------------------------------------------------------------------------------------------
# The oracle: every path, both backends
# ----------------------------------------------------------------------------------------------------------------


@given(cases())
def test_every_path_matches_sdpa_numpy(case):
    q, k, v, mask, causal, scale = case
    expected = sdpa(q, k, v, mask, causal, scale)
    for name, fn in IMPLEMENTATIONS.items():
        got = fn(q, k, v, mask, causal=causal, scale=scale)
        assert isinstance(got, np.ndarray) and got.dtype == np.float64, name
        np.testing.assert_allclose(got, expected, **TOL, err_msg=name)


@given(cases())
def test_every_path_matches_sdpa_torch(case):
    q, k, v, mask, causal, scale = case
    expected = torch.from_numpy(sdpa(q, k, v, mask, causal, scale))
    tq, tk, tv, tm = to_torch(q, k, v, mask)
    for name, fn in IMPLEMENTATIONS.items():
        got = fn(tq, tk, tv, tm, causal=causal, scale=scale)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64, name
        torch.testing.assert_close(got, expected, **TOL, msg=name)


@given(cases(), st.integers(1, 4), st.integers(1, 4))
def test_tiled_matches_sdpa_for_any_block_shape(case, bq, bk):
    q, k, v, mask, causal, scale = case
    got = tiled_attention(q, k, v, mask, causal=causal, scale=scale, block_size=(bq, bk))
    np.testing.assert_allclose(got, sdpa(q, k, v, mask, causal, scale), **TOL)


@given(cases(), st.integers(1, 4), st.sampled_from([1, 2, 64]), st.sampled_from([0.0, 1.0, 2.0**32]))
def test_tiled_numpy_shift_policy_never_changes_the_result(case, bk, sample, limit):
    # The NumPy tiles start from the largest allowed score among the first `sample` keys and redo a tile the
    # textbook way once its row sums pass `limit`: a limit of 0 redoes every tile, 2**32 almost none.
    q, k, v, mask, causal, scale = case
    with mock.patch.multiple(tiles, SHIFT_SAMPLE=sample, LAZY_LIMIT=limit):
        got = tiled_attention(q, k, v, mask, causal=causal, scale=scale, block_size=(2, bk))
    np.testing.assert_allclose(got, sdpa(q, k, v, mask, causal, scale), **TOL)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_tiled_numpy_redoes_a_tile_whose_exponentials_would_overflow(dtype):
    rng = np.random.default_rng(8)
    q = rng.standard_normal((40, 16)) + 3 * np.eye(16)[0]
    k, v = rng.standard_normal((300, 16)), rng.standard_normal((300, 5))
    k[250] = 200 * np.eye(16)[0]  # one late key that most queries like far more than any of the first 64
    scores = q @ k.T / 4
    gap = scores.max(axis=1) - scores[:, : tiles.SHIFT_SAMPLE].max(axis=1)
    assert (gap > 100).sum() > 30  # exp(100) overflows float32 and sums far past LAZY_LIMIT in float64
    expected = sdpa(q, k, v)
    for block in (tiles.DEFAULT_BLOCK, (16, 64)):
        got = tiled_attention(*(x.astype(dtype) for x in (q, k, v)), block_size=block)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, **(TOL if dtype == np.float64 else {"rtol": 1e-4, "atol": 1e-5}))


@given(cases(), st.integers(1, 3))
def test_numpy_thread_pool_paths_match_sdpa(case, rows):
    # Large NumPy problems run in chunks of rows and blocks of queries on a thread pool; here at any size.
    q, k, v, mask, causal, scale = case
    q = full_batch(q, k, v)  # the mask may carry v's batch dims, which the weights alone do not have
    kw = {"causal": causal, "scale": scale}
    spy = mock.patch.object(speed, "full_attention_in_chunks", wraps=speed.full_attention_in_chunks)
    with mock.patch.multiple(speed, PARALLEL_MIN_SCORES=0, ROW_CHUNK=rows, workers=lambda: 2), spy as chunked:
        out, w = attn.attention(q, k, v, mask, return_weights=True, **kw)
        plain = attn.attention(q, k, v, mask, **kw)
        weights = attn.attention_weights(q, k, mask, **kw)
        tiled = tiled_attention(q, k, v, mask, block_size=(rows, 2), **kw)
    assert chunked.call_count == 3
    expected = sdpa(q, k, v, mask, causal, scale)
    for got in (out, plain, tiled):
        np.testing.assert_allclose(got, expected, **TOL)
    for got in (w, weights):
        np.testing.assert_allclose(got, sdpa_weights(q, k, mask, causal, scale), **TOL)


@given(cases())
def test_weights_match_sdpa(case):
    q, k, v, mask, causal, scale = case
    q = full_batch(q, k, v)  # the mask may carry v's batch dims, which the weights alone do not have
    expected = sdpa_weights(q, k, mask, causal, scale)
    np.testing.assert_allclose(attn.attention_weights(q, k, mask, causal=causal, scale=scale), expected, **TOL)
    out, w = attn.attention(q, k, v, mask, causal=causal, scale=scale, return_weights=True)
    np.testing.assert_allclose(w, expected, **TOL)
    np.testing.assert_allclose(out, w @ v, **TOL)


def test_larger_shapes_match_sdpa_with_multiple_tiles():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 3, 300, 16)), rng.standard_normal((2, 3, 700, 16)), rng.standard_normal((1, 3, 700, 24))
    mask = rng.random((2, 1, 300, 700)) < 0.8
    for causal in (False, True):
        expected = sdpa(q, k, v, mask, causal)
        np.testing.assert_allclose(attn.attention(q, k, v, mask, causal=causal), expected, **TOL)
        np.testing.assert_allclose(
            tiled_attention(q, k, v, mask, causal=causal, block_size=(64, 128)), expected, **TOL
        )


@given(cases(max_batch_dims=1, max_len=5))
def test_gradients_match_sdpa(case):
    q, k, v, mask, causal, scale = case
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]).copy() for x in (q, k, v))
    grad_out = np.random.default_rng(1).standard_normal(batch + (q.shape[-2], v.shape[-1]))

    def grads(fn, use_sdpa):
        tq, tk, tv = (t.requires_grad_() for t in to_torch(q, k, v))
        tm = None if mask is None else torch.from_numpy(np.asarray(mask))
        if use_sdpa:
            out = F.scaled_dot_product_attention(
                tq, tk, tv, attn_mask=combined_mask(tm, causal, q.shape[-2], k.shape[-2]), scale=scale
            )
        else:
            out = fn(tq, tk, tv, tm, causal=causal, scale=scale)
        out.backward(torch.from_numpy(grad_out))
        return [t.grad for t in (tq, tk, tv)]

    expected = grads(None, True)
    for name, fn in IMPLEMENTATIONS.items():
        for g, e in zip(grads(fn, False), expected):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, e, **TOL, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# Properties no oracle states
# ----------------------------------------------------------------------------------------------------------------


@given(cases())
def test_rows_sum_to_one_or_zero_when_nothing_is_allowed(case):
    q, k, v, mask, causal, scale = case
    q = full_batch(q, k, v)
    w = attn.attention_weights(q, k, mask, causal=causal, scale=scale)
    assert (w >= 0).all()
    sums = w.sum(-1)
    allowed = np.ones(w.shape, dtype=bool)
    if mask is not None:
        allowed &= (mask if mask.dtype == bool else mask > -np.inf)
    offset = causal_offset(causal, *w.shape[-2:])
    if offset is not None:
        allowed &= np.tril(np.ones(w.shape[-2:], dtype=bool), offset)
    anything = allowed.any(-1)
    np.testing.assert_allclose(sums[anything], 1.0, rtol=1e-12)
    assert (w[~anything] == 0).all()


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_future_tokens_cannot_change_earlier_outputs(name):
    fn = IMPLEMENTATIONS[name]
    rng = np.random.default_rng(3)
    n, d = 9, 4
    x = rng.standard_normal((3, n, d))
    before = fn(x[0], x[1], x[2], causal=True)
    for t in range(n - 1):
        changed = x.copy()
        changed[:, t + 1 :] = rng.standard_normal(changed[:, t + 1 :].shape) * 10
        after = fn(changed[0], changed[1], changed[2], causal=True)
        np.testing.assert_array_equal(after[: t + 1], before[: t + 1])
        assert not np.allclose(after[t + 1 :], before[t + 1 :])


@given(cases(max_batch_dims=0))
def test_permuting_keys_and_values_together_changes_nothing(case):
    q, k, v, mask, _, scale = case
    perm = np.random.default_rng(0).permutation(k.shape[-2])
    pmask = None if mask is None else np.broadcast_to(mask, mask.shape[:-1] + (k.shape[-2],))[..., perm]
    for name, fn in IMPLEMENTATIONS.items():
        np.testing.assert_allclose(
            fn(q, k[..., perm, :], v[..., perm, :], pmask, scale=scale), fn(q, k, v, mask, scale=scale), **TOL, err_msg=name
        )


@given(cases(max_batch_dims=0))
def test_permuting_queries_permutes_outputs(case):
    q, k, v, mask, _, scale = case
    perm = np.random.default_rng(0).permutation(q.shape[-2])
    pmask = None if mask is None else np.broadcast_to(mask, (q.shape[-2], mask.shape[-1]))[perm]
    np.testing.assert_allclose(
        attn.attention(q[perm], k, v, pmask, scale=scale), attn.attention(q, k, v, mask, scale=scale)[perm], **TOL
    )


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_huge_logits_stay_finite_and_exact(name, backend):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((4, 8)) * 100, rng.standard_normal((6, 8)) * 100, rng.standard_normal((6, 3))
    scores = q @ k.T / math.sqrt(8)
    assert np.abs(scores).max() > 1e4  # naive exp overflows far below this
    expected = sdpa(q, k, v)
    args = (q, k, v) if backend == "numpy" else to_torch(q, k, v)
    got = np.asarray(IMPLEMENTATIONS[name](*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, **TOL)
    got32 = np.asarray(IMPLEMENTATIONS[name](*(a.astype(np.float32) if backend == "numpy" else a.float() for a in args)))
    assert np.isfinite(got32).all()


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_float32_stays_float32(name):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))
    mask = rng.random((5, 5)) < 0.5
    fmask = np.where(mask, 0.0, -np.inf)  # float64 mask: must not promote the result
    for m in (None, mask, fmask):
        out = IMPLEMENTATIONS[name](q, k, v, m, causal=True)
        assert out.dtype == np.float32
        t = IMPLEMENTATIONS[name](*to_torch(q, k, v), None if m is None else torch.from_numpy(m), causal=True)
        assert t.dtype == torch.float32
        np.testing.assert_allclose(out, sdpa(*(x.astype(np.float64) for x in (q, k, v)), m, True), rtol=1e-5, atol=1e-6)
    assert attn.attention_weights(q, k).dtype == np.float32
    assert attn.softmax(q).dtype == np.float32


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_returns_its_own_dtype_close_to_float32(name, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 8, generator=g) * 4 for _ in range(3))
    got = IMPLEMENTATIONS[name](q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert got.dtype == dtype
    ref = attn.attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), causal=True)
    # the only difference allowed is the final rounding to the half type (8 bits of mantissa for bfloat16)
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-3)


def test_numpy_float16_returns_float16():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((5, 4)).astype(np.float16) for _ in range(3))
    for fn in IMPLEMENTATIONS.values():
        out = fn(q, k, v)
        assert out.dtype == np.float16
        np.testing.assert_allclose(out, attn.attention(*(x.astype(np.float32) for x in (q, k, v))), atol=2e-3)


def test_integers_are_promoted_to_the_default_float():
    q = np.arange(6).reshape(2, 3)
    out = attn.attention(q, q, q)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, attn.attention(q.astype(float), q.astype(float), q.astype(float)))
    t = attn.attention(*(torch.from_numpy(q) for _ in range(3)))
    assert t.dtype == torch.get_default_dtype()
    assert attn.softmax(np.array([1, 2, 3])).dtype == np.float64


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_fully_masked_rows_give_zeros_and_finite_gradients(name):
    fn = IMPLEMENTATIONS[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    bool_mask = torch.ones(2, 4, 4, dtype=torch.bool)
    bool_mask[0, 1] = False
    bool_mask[1, :, :] = False
    float_mask = torch.zeros(4, 4, dtype=torch.float64)
    float_mask[2] = -math.inf
    for mask in (bool_mask, float_mask):
        out = fn(q, k, v, mask)
        dead = ~mask.expand(2, 4, 4).any(-1) if mask.dtype == torch.bool else (mask == -math.inf).all(-1).expand(2, 4)
        assert dead.any()
        assert (out[dead] == 0).all()
        assert torch.isfinite(out).all()
        (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
            t.grad = None
        # a row that can attend nothing sends no gradient to its query
        out = fn(q, k, v, bool_mask)
        out.sum().backward()
        assert (q.grad[1] == 0).all() and (q.grad[0, 1] == 0).all()
        for t in (q, k, v):
            t.grad = None


def test_a_finite_fill_is_not_a_mask_but_minus_inf_is():
    """The bugs -inf masking prevents: with -1e9 a fully masked row silently attends to everything."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    fill = np.zeros((3, 5))
    fill[1] = -1e9  # added to every score of row 1: the softmax cannot see a constant shift
    np.testing.assert_allclose(attn.attention(q, k, v, fill)[1], attn.attention(q, k, v)[1], rtol=1e-6)
    scores = q @ k.T / 2.0
    scores[1] = -1e9  # written over the scores (masked_fill): every key equally likely
    np.testing.assert_allclose(attn.softmax(scores)[1] @ v, v.mean(0), rtol=1e-12)
    fill[1] = -np.inf
    assert (attn.attention(q, k, v, fill)[1] == 0).all()


def test_empty_lengths():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((0, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    for fn in IMPLEMENTATIONS.values():
        assert fn(q, k, v).shape == (0, 2)
        assert (fn(rng.standard_normal((2, 4)), k[:0], v[:0]) == 0).all()
        assert fn(rng.standard_normal((2, 4)), k[:0], v[:0]).shape == (2, 2)


def test_inputs_are_never_modified():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 3))
    mask = rng.standard_normal((5, 6))
    mask[0] = -np.inf
    copies = [x.copy() for x in (q, k, v, mask)]
    for fn in IMPLEMENTATIONS.values():
        fn(q, k, v, mask, causal=True)
    attn.attention_weights(q, k, mask)
    attn.softmax(q)
    for x, c in zip((q, k, v, mask), copies):
        np.testing.assert_array_equal(x, c)


def test_torch_path_stays_differentiable_and_on_device():
    q = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for fn in IMPLEMENTATIONS.values():
        out = fn(q, q, q)
        assert out.requires_grad and out.device == q.device
    assert attn.softmax(q).requires_grad


# ----------------------------------------------------------------------------------------------------------------
# softmax, the masks and the device helper
# ----------------------------------------------------------------------------------------------------------------


@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=8), st.floats(-1e3, 1e3))
def test_softmax_matches_torch_and_ignores_shifts(xs, shift):
    x = np.array(xs)
    expected = torch.softmax(torch.from_numpy(x), -1).numpy()
    np.testing.assert_allclose(attn.softmax(x), expected, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(attn.softmax(x + shift), attn.softmax(x), rtol=1e-6, atol=1e-12)
    assert math.isclose(attn.softmax(x).sum(), 1.0, rel_tol=1e-12)


def test_softmax_axis_and_minus_inf_rows():
    x = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    out = attn.softmax(x)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_allclose(out[2], [0.5, 0.0, 0.5])
    np.testing.assert_allclose(attn.softmax(x[[0, 2]], axis=0), torch.softmax(torch.from_numpy(x[[0, 2]]), 0).numpy())
    t = attn.softmax(torch.from_numpy(x))
    np.testing.assert_array_equal(t.numpy(), out)
    assert np.isfinite(attn.softmax(np.array([1000.0, 0.0]))).all()


def test_causal_mask_is_top_left_tril():
    for L, S in [(4, 4), (3, 6), (6, 3), (0, 2), (1, 1)]:
        m = attn.causal_mask(L, S)
        assert m.dtype == bool and m.shape == (L, S)
        np.testing.assert_array_equal(m, np.tril(np.ones((L, S), dtype=bool)))
    np.testing.assert_array_equal(attn.causal_mask(5), np.tril(np.ones((5, 5), dtype=bool)))
    t = attn.causal_mask(3, 4, like=torch.zeros(1))
    assert t.dtype == torch.bool
    np.testing.assert_array_equal(t.numpy(), attn.causal_mask(3, 4))


@pytest.mark.filterwarnings("ignore:Lower right causal bias")  # L > S leaves early queries no key: our point
@pytest.mark.filterwarnings("ignore:a bottom-right causal mask with L")
def test_causal_mask_bottom_right_matches_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    for L, S in [(4, 4), (2, 6), (1, 5), (6, 3), (0, 2), (3, 0)]:
        m = attn.causal_mask(L, S, align="bottom-right")
        expected = causal_lower_right(L, S)._materialize(torch.device("cpu")).numpy()
        np.testing.assert_array_equal(m, expected)
        t = attn.causal_mask(L, S, like=torch.zeros(1), align="bottom-right")
        assert t.dtype == torch.bool
        np.testing.assert_array_equal(t.numpy(), expected)
    np.testing.assert_array_equal(attn.causal_mask(5, align="bottom-right"), attn.causal_mask(5))
    with pytest.raises(ValueError, match="align must be"):
        attn.causal_mask(2, 3, align="bottom-left")


def test_causal_mask_matches_is_causal():
    rng = np.random.default_rng(0)
    q, k, v = to_torch(rng.standard_normal((5, 3)), rng.standard_normal((7, 3)), rng.standard_normal((7, 2)))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn.attention(q, k, v, causal=True), expected, **TOL)
    torch.testing.assert_close(attn.attention(q, k, v, attn.causal_mask(5, 7, like=q)), expected, **TOL)


def test_padding_mask():
    m = attn.padding_mask([3, 1, 0], 4, heads=False)
    assert m.shape == (3, 1, 4) and m.dtype == bool
    np.testing.assert_array_equal(m[:, 0], [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert attn.padding_mask([3, 1, 0], 4).shape == (3, 1, 1, 4)  # the default: split heads (B, H, L, S)
    t = attn.padding_mask(torch.tensor([2, 4]), 4, heads=False)
    assert t.dtype == torch.bool and t.shape == (2, 1, 4)
    np.testing.assert_array_equal(t.numpy()[:, 0], [[1, 1, 0, 0], [1, 1, 1, 1]])


def test_padding_gives_the_unpadded_outputs():
    rng = np.random.default_rng(0)
    lengths, S, d = [5, 2, 4], 5, 3
    x = rng.standard_normal((3, S, d))
    out = attn.attention(x, x, x, attn.padding_mask(lengths, S, heads=False))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(out[b, :n], attn.attention(x[b, :n], x[b, :n], x[b, :n]), **TOL)


def test_best_device_is_a_usable_device():
    device = attn.best_device()
    assert isinstance(device, torch.device)
    expected = "cuda" if torch.cuda.is_available() else None
    if expected:
        assert device.type == expected
    assert torch.zeros(1, device=device).device.type == device.type


# ----------------------------------------------------------------------------------------------------------------
# Bad input: the right exception, and a message that names the problem
# ----------------------------------------------------------------------------------------------------------------

A = np.ones((2, 3, 4))

BAD_CALLS = [
    ("mixed numpy and torch", lambda f: f(A, torch.ones(2, 3, 4), A), TypeError, ["torch.Tensor", "numpy"]),
    ("mixed mask", lambda f: f(A, A, A, torch.ones(3, 3, dtype=torch.bool)), TypeError, ["mask", "torch.Tensor"]),
    ("E disagrees", lambda f: f(np.ones((3, 4)), np.ones((5, 3)), np.ones((5, 2))), ValueError, ["E=3", "E=4"]),
    ("S disagrees", lambda f: f(np.ones((3, 4)), np.ones((5, 4)), np.ones((6, 2))), ValueError, ["S=6", "S=5"]),
    ("batch", lambda f: f(np.ones((2, 3, 4)), np.ones((3, 3, 4)), np.ones((3, 3, 4))), ValueError, ["batch", "(2,)", "(3,)"]),
    ("1-D q", lambda f: f(np.ones(4), np.ones((3, 4)), np.ones((3, 4))), ValueError, ["q", "(4,)", "2-D"]),
    ("mask shape", lambda f: f(A, A, A, np.ones((4, 3), dtype=bool)), ValueError, ["mask", "(4, 3)", "(2, 3, 3)"]),
    ("mask adds batch", lambda f: f(A, A, A, np.ones((5, 3, 3), dtype=bool)), ValueError, ["mask", "(5, 3, 3)"]),
    ("int mask", lambda f: f(A, A, A, np.ones((3, 3), dtype=int)), TypeError, ["mask", "int64", "boolean"]),
    ("nan mask", lambda f: f(A, A, A, np.full((3, 3), np.nan)), ValueError, ["mask", "NaN"]),
    ("+inf mask", lambda f: f(A, A, A, np.full((3, 3), np.inf)), ValueError, ["mask", "+inf"]),
    ("complex", lambda f: f(A.astype(complex), A, A), TypeError, ["q", "complex"]),
    ("strings", lambda f: f(np.array([["a", "b"]]), A, A), TypeError, ["q", "<U1"]),
    ("objects", lambda f: f(A.astype(object), A, A), TypeError, ["q", "object"]),
    ("bool q", lambda f: f(A, A.astype(bool), A), TypeError, ["k", "bool"]),
    ("torch complex", lambda f: f(*(torch.ones(3, 4, dtype=torch.complex64) for _ in range(3))), TypeError, ["q", "complex"]),
    ("scale text", lambda f: f(A, A, A, scale="big"), TypeError, ["scale", "str"]),
    ("scale nan", lambda f: f(A, A, A, scale=float("nan")), ValueError, ["scale", "finite"]),
    ("scale bool", lambda f: f(A, A, A, scale=True), TypeError, ["scale", "bool"]),
    ("causal text", lambda f: f(A, A, A, causal="yes"), ValueError, ["causal", "'yes'", "bottom-right"]),
    ("causal number", lambda f: f(A, A, A, causal=1), TypeError, ["causal", "int"]),
    ("bottom-right L > S", lambda f: f(np.ones((5, 4)), A, A, causal="bottom-right"), ValueError,
     ["bottom-right", "L=5", "S=3", "first 2 queries"]),
    ("E=0", lambda f: f(np.ones((2, 0)), np.ones((2, 0)), np.ones((2, 3))), ValueError, ["E=0", "scale"]),
    ("None", lambda f: f(A, None, A), TypeError, ["k", "None"]),
    ("ragged", lambda f: f([[1.0, 2.0], [1.0]], A, A), TypeError, ["q"]),
    ("devices", lambda f: f(torch.ones(2, 3), torch.ones(2, 3, device="meta"), torch.ones(2, 3)), ValueError, ["device", "meta"]),
]


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("call, exc, words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_named(name, call, exc, words):
    with pytest.raises(exc) as info:
        call(IMPLEMENTATIONS[name])
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_attention_weights_checks_too():
    with pytest.raises(ValueError, match="E=3"):
        attn.attention_weights(np.ones((3, 4)), np.ones((5, 3)))
    with pytest.raises(ValueError, match=r"mask of shape \(4, 4\)"):
        attn.attention_weights(np.ones((3, 4)), np.ones((5, 4)), np.ones((4, 4), dtype=bool))
    with pytest.raises(TypeError, match="return_weights"):
        attn.attention(A, A, A, return_weights="yes")


@pytest.mark.parametrize(
    "block, exc, words",
    [(0, ValueError, ["at least 1", "0"]), (-3, ValueError, ["at least 1"]), (1.5, TypeError, ["float"]),
     (True, TypeError, ["bool"]), ((4, 0), ValueError, ["at least 1"]), ((1, 2, 3), ValueError, ["pair"])],
)
def test_bad_block_size(block, exc, words):
    with pytest.raises(exc) as info:
        tiled_attention(A, A, A, block_size=block)
    assert "block_size" in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: attn.padding_mask([2, -1], 4), ValueError, ["non-negative", "-1"]),
        (lambda: attn.padding_mask([2, 5], 4), ValueError, ["at most S=4", "5"]),
        (lambda: attn.padding_mask([1.5], 4), TypeError, ["integers", "float64"]),
        (lambda: attn.padding_mask([[1, 2]], 4), ValueError, ["1-D", "(1, 2)"]),
        (lambda: attn.padding_mask(torch.tensor([1.0]), 4), TypeError, ["integers", "float32"]),
        (lambda: attn.padding_mask([1], -2), ValueError, ["S", "non-negative"]),
        (lambda: attn.causal_mask(-1), ValueError, ["L", "non-negative", "-1"]),
        (lambda: attn.causal_mask(3, -2), ValueError, ["S", "-2"]),
        (lambda: attn.causal_mask(2.5), TypeError, ["L", "integer", "float"]),
        (lambda: attn.causal_mask(3, like=[1]), TypeError, ["like"]),
        (lambda: attn.softmax(np.ones(3), axis=1), ValueError, ["axis 1", "1 dimensions"]),
        (lambda: attn.softmax(np.ones(3), axis=0.5), TypeError, ["axis", "float"]),
        (lambda: attn.softmax(np.array(["a"])), TypeError, ["x", "<U1"]),
    ],
)
def test_bad_mask_and_softmax_arguments(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: the same checks on CUDA, in float32 and half precision
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_gpu_path_matches_sdpa(dtype, causal):
    # speed.half_attention_on_gpu is plain torch, so it runs here on CPU tensors exactly as it would on a GPU.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (9, 13, 13))
    out, w = speed.half_attention_on_gpu(q.to(dtype), k.to(dtype), v.to(dtype), 0 if causal else None, 0.25)
    assert out.dtype == w.dtype == dtype and out.shape == (2, 3, 9, 16) and w.shape == (2, 3, 9, 13)
    mask = combined_mask(None, causal, 9, 13)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=3e-2 if dtype == torch.bfloat16 else 4e-3)
    torch.testing.assert_close(w.double().sum(-1), torch.ones(2, 3, 9, dtype=torch.float64), rtol=0, atol=2e-2)
    if causal:
        assert (w.triu(1) == 0).all()


def test_only_unmasked_half_precision_on_a_gpu_takes_the_half_path(monkeypatch):
    half = [torch.randn(4, 8, dtype=torch.float16) for _ in range(3)]
    assert not speed.half_attention_on_gpu_applies(*half, None)  # CPU: the contract computes in float32
    assert not speed.half_attention_on_gpu_applies(*(t.float() for t in half), None)
    assert not speed.half_attention_on_gpu_applies(*(t.numpy() for t in half), None)
    calls, original = [], speed.half_attention_on_gpu

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(speed, "half_attention_on_gpu_applies", lambda q, k, v, mask: mask is None)
    monkeypatch.setattr(speed, "half_attention_on_gpu", spy)
    out = attn.attention(*half, causal=True)
    assert len(calls) == 1 and calls[0][0].dtype == torch.float16 and out.dtype == torch.float16  # not upcast
    attn.attention(*half, torch.ones(4, 4, dtype=torch.bool))
    assert len(calls) == 1  # a mask takes the general path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_half_path_matches_sdpa(dtype, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    assert speed.half_attention_on_gpu_applies(q, k, v, None)
    got = attn.attention(q, k, v, causal=causal)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=3e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_sdpa(name, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 40, 40, generator=g) < 0.7
    mask[0, 0, 5] = False
    q, k, v, mask = (t.cuda() for t in (q, k, v, mask))
    got = IMPLEMENTATIONS[name](q.to(dtype), k.to(dtype), v.to(dtype), mask, causal=True)
    assert got.device.type == "cuda" and got.dtype == dtype
    expected = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=combined_mask(mask.cpu(), True, 40, 40).cuda()
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    assert (got[0, :, 5] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_cuda_gradients_match_sdpa(name):
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 12, 8, generator=g, dtype=torch.float64).cuda() for _ in range(3)]
    mask = (torch.rand(12, 12, generator=g) < 0.6).cuda()
    mask[3] = False

    def grads(fn):
        ts = [t.clone().requires_grad_() for t in base]
        fn(*ts).sum().backward()
        return [t.grad for t in ts]

    ours = grads(lambda q, k, v: IMPLEMENTATIONS[name](q, k, v, mask))
    theirs = grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)


# ----------------------------------------------------------------------------------------------------------------
# Traps closed: padding masks on split heads, empty bottom-right rows, half-precision scores
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, H", [(3, 3), (2, 4)])
def test_padding_mask_for_split_heads_pairs_each_sequence_with_its_own_lengths(B, H):
    # B == H is the case where a (B, 1, S) mask silently pairs batch b with head b instead of sequence b.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([5, 2, 4, 1][:B])
    mask = attn.padding_mask(lengths, 5, heads=True)
    assert mask.shape == (B, 1, 1, 5)
    expected = torch.stack([
        F.scaled_dot_product_attention(q[b], k[b, :, : int(n)], v[b, :, : int(n)]) for b, n in enumerate(lengths)
    ])  # each sequence alone, its padding cut off
    for fn in IMPLEMENTATIONS.values():
        torch.testing.assert_close(fn(q, k, v, mask), expected, **TOL)
    torch.testing.assert_close(attn.attention(q, k, v, attn.padding_mask(lengths, 5)), expected, **TOL)  # default
    shared = attn.padding_mask(lengths, 5, heads=False)
    assert shared.shape == (B, 1, 5)
    if B != H:  # the shared layout against split heads: refused by broadcasting, never paired with the heads
        with pytest.raises(ValueError, match="mask"):
            attn.attention(q, k, v, shared)
    np.testing.assert_array_equal(attn.padding_mask([2, 0], 3, heads=True), [[[[1, 1, 0]]], [[[0, 0, 0]]]])
    with pytest.raises(TypeError, match="heads"):
        attn.padding_mask([1], 2, heads="yes")


def test_bottom_right_with_more_queries_than_keys_is_refused_or_warned():
    q, k = np.ones((5, 2)), np.ones((3, 2))
    for fn in IMPLEMENTATIONS.values():
        with pytest.raises(ValueError, match="first 2 queries"):
            fn(q, k, k, causal="bottom-right")
        assert fn(q, k, k, causal="top-left").shape == (5, 2)  # top-left: query 0 still sees key 0
    with pytest.raises(ValueError, match="first 2 queries"):
        attn.attention_weights(q, k, causal="bottom-right")
    with pytest.warns(UserWarning, match="first 2 queries with no key"):
        attn.causal_mask(5, 3, align="bottom-right")


def test_true_means_top_left_in_every_function_and_bottom_right_is_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, 8, generator=g, dtype=torch.float64) for n in (3, 7, 7))
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 7))
    assert not torch.allclose(top_left, bottom_right)
    for fn in IMPLEMENTATIONS.values():
        for spelling in (True, "top-left"):
            torch.testing.assert_close(fn(q, k, v, causal=spelling), top_left, **TOL)
        torch.testing.assert_close(fn(q, k, v, causal="bottom-right"), bottom_right, **TOL)


class _SoftmaxInputs(torch.overrides.TorchFunctionMode):
    """Records the dtype of every tensor that goes into a softmax."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.softmax, torch.Tensor.softmax, F.softmax):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_path_keeps_the_scores_in_float32_into_the_softmax(dtype):
    # The GPU path is plain torch, so on CPU tensors it shows what it computes. Scores near 300 are where half
    # precision hurts: float16's spacing there is 0.25, so a rounded score is off by up to 0.125 and its weight
    # by up to 13 %; bfloat16's spacing is 2.
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 16, 32, generator=g, dtype=torch.float64)
    q, k = q / q.norm(dim=-1, keepdim=True) * 100, k / k.norm(dim=-1, keepdim=True) * 100  # scores up to 10,000
    v = torch.randn(2, 16, 4, generator=g, dtype=torch.float64)
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    with _SoftmaxInputs() as seen:
        out, w = speed.half_attention_on_gpu(qh, kh, vh, None, 1 / 32)
    assert seen.dtypes == [torch.float32] and out.dtype == w.dtype == dtype
    # the reference: the same rounded inputs, everything after them exact
    expected = F.softmax(qh.double() @ kh.double().transpose(-1, -2) / 32, dim=-1)
    assert (qh.double() @ kh.double().transpose(-1, -2) / 32).abs().max() > 100
    torch.testing.assert_close(w.double(), expected, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    _, w_causal = speed.half_attention_on_gpu(qh, kh, vh, 8, 1 / 32)  # offset 8: bottom-right, S - L
    assert (w_causal.double().tril(8) == w_causal.double()).all() and not (w_causal.double().triu(1) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_path_is_accurate_for_large_scores(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(2, 4, 256, 64, device="cuda", generator=g) for _ in range(2))
    q, k = q / q.norm(dim=-1, keepdim=True) * 120, k / k.norm(dim=-1, keepdim=True) * 120  # scores up to 1,800
    v = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    got, w = attn.attention(qh, kh, vh, return_weights=True)
    expected_w = F.softmax(qh.double() @ kh.double().transpose(-1, -2) / 8, dim=-1)
    torch.testing.assert_close(w.double(), expected_w, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    torch.testing.assert_close(got.double(), expected_w @ vh.double(), rtol=0, atol=5e-2 if dtype == torch.bfloat16 else 1e-2)
