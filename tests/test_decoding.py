"""lib.decoding: the KV cache and the decode step, against full causal attention over the whole sequence."""

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from lib import attention as attn
from lib import decoding
from lib.cost import kv_cache_bytes
from lib.decoding import KVCache, decode_step
from lib.modules import MultiHeadAttention
from lib.nn import TorchMultiHeadAttention

TOL32 = {"rtol": 1e-5, "atol": 1e-6}


def heads(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def chunks(sizes):
    """(start, stop) of consecutive chunks of the given sizes."""
    edges = np.cumsum([0, *sizes])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


# ----------------------------------------------------------------------------------------------------------------
# The cache itself
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_cache_grows_and_hands_out_views(backend):
    k, v = heads(2, 3, 6, 4), heads(2, 3, 6, 5, seed=1)
    if backend == "torch":
        k, v = torch.from_numpy(k), torch.from_numpy(v)
    cache = KVCache(10)
    assert len(cache) == 0 and cache.keys is None and cache.values is None and cache.nbytes == 0
    for start, stop in chunks([1, 2, 3]):
        keys, values = cache.append(k[..., start:stop, :], v[..., start:stop, :])
        assert len(cache) == stop
        assert tuple(keys.shape) == (2, 3, stop, 4) and tuple(values.shape) == (2, 3, stop, 5)
        np.testing.assert_array_equal(np.asarray(keys), np.asarray(k[..., :stop, :]))
        np.testing.assert_array_equal(np.asarray(values), np.asarray(v[..., :stop, :]))
    assert cache.nbytes == 2 * 3 * 10 * (4 + 5) * 4  # every row of the capacity, float32
    if backend == "numpy":
        assert np.shares_memory(cache.keys, cache._k)
    else:
        assert cache.keys.data_ptr() == cache._k.data_ptr()
    assert repr(cache) == "KVCache(6 of 10 tokens, keys (2, 3, 6, 4), values (2, 3, 6, 5))"


def test_earlier_views_keep_their_rows_after_more_appends():
    cache = KVCache(4)
    first, _ = cache.append(heads(1, 2, 3), heads(1, 2, 3))
    before = first.copy()
    cache.append(heads(1, 2, 3, seed=5), heads(1, 2, 3, seed=6))
    np.testing.assert_array_equal(first, before)


# ----------------------------------------------------------------------------------------------------------------
# The decode step is full causal attention, row by row
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("sizes", [[1] * 8, [3, 1, 1, 2, 1], [8], [5, 3]])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_decoding_in_chunks_equals_full_causal_attention(backend, sizes, n_kv):
    q, k, v = heads(2, 4, 8, 3), heads(2, n_kv, 8, 3, seed=1), heads(2, n_kv, 8, 5, seed=2)
    g = 4 // n_kv
    full = attn.attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), causal=True)  # (2, 4, 8, 5)
    if backend == "torch":
        q, k, v = (torch.from_numpy(t) for t in (q, k, v))
    cache = KVCache(8)
    rows = [decode_step(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], cache) for a, b in chunks(sizes)]
    stacked = np.concatenate([np.asarray(r) for r in rows], axis=-2)
    np.testing.assert_allclose(stacked, full, **TOL32)
    assert len(cache) == 8


def test_decode_step_is_bottom_right_and_is_causal_is_not():
    q, k, v = (torch.from_numpy(heads(1, 2, n, 4, seed=s)) for n, s in [(3, 0), (8, 1), (8, 2)])
    cache = KVCache(8)
    cache.append(k[..., :5, :], v[..., :5, :])  # five tokens already seen
    out = decode_step(q, k[..., 5:, :], v[..., 5:, :], cache)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=causal_lower_right(3, 8)), **TOL32)
    torch.testing.assert_close(out, attn.attention(q, k, v, attn.causal_mask(3, 8, like=q, align="bottom-right")))
    wrong = sdpa(q, k, v, is_causal=True)  # top-left: the new tokens see only keys 0, 1 and 2
    assert bool(torch.isfinite(wrong).all()) and not torch.allclose(wrong, out, atol=1e-2)


@pytest.mark.parametrize("sizes", [[1] * 6, [4, 1, 1], [2, 2, 2]])
@pytest.mark.parametrize("n_kv", [3, 1])
def test_module_with_a_cache_equals_the_module_on_the_whole_sequence(sizes, n_kv):
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(12, 3, n_kv).eval()
    np_mod = MultiHeadAttention(12, 3, n_kv)
    np_mod.load_state_dict(mod.state_dict())
    x = torch.randn(2, 6, 12)
    full = mod(x, causal=True)
    torch_cache, np_cache = KVCache(6), KVCache(6)
    with torch.no_grad():
        steps = [mod(x[:, a:b], causal=True, cache=torch_cache) for a, b in chunks(sizes)]
    np_steps = [np_mod(x[:, a:b].numpy(), causal=True, cache=np_cache) for a, b in chunks(sizes)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL32)
    np.testing.assert_allclose(np.concatenate(np_steps, axis=1), full.detach().numpy(), **TOL32)
    assert tuple(torch_cache.keys.shape) == (2, n_kv, 6, 4)


def test_cached_outputs_ignore_later_tokens():
    cache = KVCache(6)
    k = heads(1, 6, 4)
    first = decode_step(heads(1, 1, 4, seed=3), k[:, :1], k[:, :1], cache)
    np.testing.assert_allclose(first, k[:, :1], **TOL32)  # one key: all the weight on it


# ----------------------------------------------------------------------------------------------------------------
# The size of a cache
# ----------------------------------------------------------------------------------------------------------------


def test_kv_cache_bytes_of_published_configurations():
    # Llama 2 7B: 32 layers, 32 heads of 128, no grouped-query attention; fp16; its 4,096-token context
    assert kv_cache_bytes(32, 32, 128, 4096, 2) == 2 * 1024**3
    # Llama 3 8B: 32 layers, 8 key/value heads of 128; fp16; its 8,192-token context
    assert kv_cache_bytes(32, 8, 128, 8192, 2) == 1024**3
    assert kv_cache_bytes(32, 32, 128, 8192, 2) == 4 * kv_cache_bytes(32, 8, 128, 8192, 2)
    assert kv_cache_bytes(1, 1, 1, 0, 4) == 0


def test_kv_cache_bytes_is_what_a_cache_allocates():
    cache = KVCache(16)
    cache.append(torch.zeros(3, 2, 1, 8, dtype=torch.float16), torch.zeros(3, 2, 1, 8, dtype=torch.float16))
    assert cache.nbytes == kv_cache_bytes(1, 2, 8, 16, 2, batch=3)


# ----------------------------------------------------------------------------------------------------------------
# Bad input is named
# ----------------------------------------------------------------------------------------------------------------


def test_bad_capacity_is_named():
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        KVCache(0)
    with pytest.raises(TypeError, match="capacity must be an integer"):
        KVCache(4.0)


def test_a_full_cache_says_how_much_room_is_needed():
    cache = KVCache(3)
    cache.append(heads(2, 4), heads(2, 4))
    with pytest.raises(ValueError, match=r"holds 2 of 3 tokens: 2 more do not fit \(build it with capacity >= 4\)"):
        cache.append(heads(2, 4), heads(2, 4))
    assert len(cache) == 2  # the failed append changed nothing


def test_mismatched_appends_are_named():
    cache = KVCache(8)
    cache.append(heads(2, 1, 4), heads(2, 1, 5))
    with pytest.raises(ValueError, match=r"k has shape \(3, 1, 4\) but the cache stores \(2, 'l', 4\)"):
        cache.append(heads(3, 1, 4), heads(3, 1, 5))
    with pytest.raises(ValueError, match=r"v has shape \(2, 1, 6\) but the cache stores \(2, 'l', 5\)"):
        cache.append(heads(2, 1, 4), heads(2, 1, 6))
    with pytest.raises(ValueError, match="k has dtype float64 but the cache stores float32"):
        cache.append(heads(2, 1, 4).astype(np.float64), heads(2, 1, 5))
    with pytest.raises(TypeError, match="k is a Tensor but the cache holds a ndarray"):
        cache.append(torch.zeros(2, 1, 4), torch.zeros(2, 1, 5))
    with pytest.raises(ValueError, match="need the same leading dimensions and one value per key"):
        cache.append(heads(2, 1, 4), heads(2, 2, 5))
    with pytest.raises(ValueError, match="k must have shape .* at least 2-D"):
        cache.append(heads(4), heads(5))
    assert len(cache) == 1


def test_bad_decode_steps_are_named():
    cache = KVCache(8)
    with pytest.raises(ValueError, match="q has 2 new queries but k brings 1 new keys"):
        decode_step(heads(1, 2, 4), heads(1, 1, 4), heads(1, 1, 4), cache)
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., H, l, E\), at least 3-D"):
        decode_step(heads(1, 4), heads(1, 4), heads(1, 4), cache)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of the 2 key/value heads"):
        decode_step(heads(3, 1, 4), heads(2, 1, 4), heads(2, 1, 4), cache)
    assert len(cache) == 0  # a refused step appends nothing


def test_bad_cache_size_arguments_are_named():
    with pytest.raises(ValueError, match="n_layers must be at least 1"):
        kv_cache_bytes(0, 8, 128, 10, 2)
    with pytest.raises(TypeError, match="n_tokens must be an integer"):
        kv_cache_bytes(1, 8, 128, 10.0, 2)
    with pytest.raises(ValueError, match="n_tokens must be at least 0"):
        kv_cache_bytes(1, 8, 128, -1, 2)


def test_public_names():
    assert decoding.__all__ == ["KVCache", "decode_step"]


# ----------------------------------------------------------------------------------------------------------------
# Traps closed: a cache under autograd, a static cache for cross-attention
# ----------------------------------------------------------------------------------------------------------------


def test_a_cache_refuses_tensors_that_require_grad_before_backward_could_fail():
    # Before, the cache stored them, and the error came only inside backward(), about an in-place operation.
    torch.manual_seed(0)
    layer = TorchMultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    cache = KVCache(3)
    with pytest.raises(ValueError, match=r"k requires grad, and a KVCache is for inference.*torch.no_grad\(\)"):
        layer(x[:, :1], causal=True, cache=cache)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="v requires grad"):
        cache.append(torch.zeros(1, 2), torch.zeros(1, 2, requires_grad=True))
    with torch.no_grad():
        steps = [layer(x[:, t : t + 1], causal=True, cache=cache) for t in range(3)]
        torch.testing.assert_close(torch.cat(steps, 1), layer(x, causal=True), **TOL32)
    with torch.inference_mode():
        cache2 = KVCache(3)
        layer(x, causal=True, cache=cache2)
    assert len(cache2) == 3


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_static_cache_stores_one_context_and_never_grows(backend):
    k, v = heads(2, 3, 5, 4), heads(2, 3, 5, 6, seed=1)
    if backend == "torch":
        k, v = torch.from_numpy(k), torch.from_numpy(v)
    cache = KVCache(static=True)
    assert cache.static and cache.capacity is None and "static" in repr(cache)
    keys, values = cache.append(k, v)
    assert len(cache) == 5 and cache.capacity == 5 and tuple(keys.shape) == (2, 3, 5, 4)
    assert tuple(values.shape) == (2, 3, 5, 6)
    with pytest.raises(ValueError, match="already holds the keys and values of a context of 5 tokens"):
        cache.append(k, v)
    with pytest.raises(ValueError, match="already holds"):
        decode_step(heads(2, 3, 1, 4) if backend == "numpy" else torch.zeros(2, 3, 1, 4), k[..., :1, :],
                    v[..., :1, :], cache)
    assert len(cache) == 5
    with pytest.raises(TypeError, match="capacity is required"):
        KVCache()
    with pytest.raises(TypeError, match="static must be True or False"):
        KVCache(4, static="yes")


def test_the_multi_head_module_never_appends_a_context_twice():
    # The review's case: cross-attention with a cache used to append the encoder's 3 keys at every step.
    layer = MultiHeadAttention(12, 3, rng=0)
    x, memory = heads(1, 2, 12), heads(1, 3, 12, seed=2)
    cache = KVCache(static=True)
    for t in range(2):
        layer(x[:, t : t + 1], context=memory, cache=cache)
    assert len(cache) == 3
    with pytest.raises(ValueError, match="cannot be passed with context"):
        layer(x, context=memory, cache=KVCache(6))
