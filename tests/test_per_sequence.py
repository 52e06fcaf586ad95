"""A per-sequence argument is read per sequence, never right-aligned into the heads axis.

Every public function that takes lengths, a padding mask, positions or cache lengths is run on a batch of split
heads (B, H, ...) and compared with the same function run on each sequence alone. B == H is among the shapes:
it is the case where pairing sequence b with head b would raise no error and give a wrong answer.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lib import attention as attn
from lib import flash_decode as fd
from lib.modules import MultiHeadAttention, grouped_attention
from lib.nn import TorchMultiHeadAttention
from lib.paged import PagedKVCache, PagePool
from lib.positions import apply_rope

TOL = {"rtol": 1e-9, "atol": 1e-10}


@st.composite
def batches(draw, most=4):
    """(B, H) with B == H about half the time."""
    B = draw(st.integers(1, most))
    H = B if draw(st.booleans()) else draw(st.integers(1, most))
    return B, H


@given(bh=batches(), L=st.integers(1, 5), S=st.integers(1, 6), data=st.data())
def test_padding_mask_on_split_heads_is_each_sequence_alone(bh, L, S, data):
    B, H = bh
    lengths = data.draw(st.lists(st.integers(1, S), min_size=B, max_size=B))
    rng = np.random.default_rng(B * 100 + H * 10 + L)
    q, k, v = rng.standard_normal((B, H, L, 3)), rng.standard_normal((B, H, S, 3)), rng.standard_normal((B, H, S, 2))
    for fn in (attn.attention, attn.attention_loop):
        got = fn(q, k, v, attn.padding_mask(lengths, S))
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(got[b], attn.attention(q[b], k[b, :, :n], v[b, :, :n]), **TOL)
    weights = attn.attention_weights(q, k, attn.padding_mask(lengths, S))
    for b, n in enumerate(lengths):
        assert (weights[b, ..., n:] == 0).all()


@given(bh=batches(), L=st.integers(1, 5), data=st.data())
def test_per_sequence_positions_turn_each_sequence_by_its_own(bh, L, data):
    B, H = bh
    positions = np.array(data.draw(st.lists(st.lists(st.integers(0, 50), min_size=L, max_size=L), min_size=B,
                                            max_size=B)))  # (B, L), as Hugging Face's position_ids
    x = np.random.default_rng(L).standard_normal((B, H, L, 8))
    got = apply_rope(x, positions)
    want = np.stack([apply_rope(x[b], positions[b]) for b in range(B)])
    np.testing.assert_allclose(got, want, **TOL)
    got_t = apply_rope(torch.from_numpy(x), torch.from_numpy(positions))
    np.testing.assert_allclose(got_t.numpy(), want, **TOL)
    # 3-D x (B, L, E): the same rows per sequence
    np.testing.assert_allclose(apply_rope(x[:, 0], positions), want[:, 0], **TOL)


def test_ambiguous_positions_are_refused_with_the_fix():
    x = np.zeros((2, 2, 2, 3, 8))  # (B, H, G, L, E)
    with pytest.raises(ValueError, match="positions .* ambiguous.*one row per sequence"):
        apply_rope(x, np.zeros((2, 2, 3), dtype=int))
    with pytest.raises(ValueError, match="positions .* do not fit"):
        apply_rope(np.zeros((2, 4, 3, 8)), np.zeros((3, 3), dtype=int))


@settings(max_examples=30)
@given(bh=batches(3), L=st.integers(1, 4), data=st.data())
def test_modules_read_the_default_padding_mask_per_sequence(bh, L, data):
    B, H = bh
    lengths = data.draw(st.lists(st.integers(1, L), min_size=B, max_size=B))
    mod = MultiHeadAttention(4 * H, H, rng=0, dtype=np.float64)
    x = np.random.default_rng(L).standard_normal((B, L, 4 * H))
    mask = attn.padding_mask(lengths, L)
    got = mod(x, mask)
    tmod = TorchMultiHeadAttention(4 * H, H, dtype=torch.float64)
    tmod.load_state_dict({name: torch.from_numpy(w) for name, w in mod.state_dict().items()})
    with torch.no_grad():
        got_t = tmod(torch.from_numpy(x), mask).numpy()
    for b, n in enumerate(lengths):
        alone = mod(x[b : b + 1, :n])[0]  # the sequence without its padding
        np.testing.assert_allclose(got[b, :n], alone, **TOL)
        np.testing.assert_allclose(got_t[b, :n], alone, **TOL)
    q = np.random.default_rng(1).standard_normal((B, H, L, 4))
    kv = np.random.default_rng(2).standard_normal((B, 1, L, 4))
    grouped = grouped_attention(q, kv, kv, mask)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(grouped[b], grouped_attention(q[b], kv[b, :, :n], kv[b, :, :n]), **TOL)


@settings(max_examples=12)
@given(bh=batches(3), L=st.integers(1, 3), data=st.data())
def test_flash_decode_cache_seqlens_are_per_sequence(bh, L, data):
    B, H = bh
    S = 24
    lengths = data.draw(st.lists(st.integers(L, S), min_size=B, max_size=B))
    splits = data.draw(st.sampled_from([1, 3]))
    g = torch.Generator().manual_seed(B * 10 + H)
    q, k, v = (torch.randn(B, H, n, 16, generator=g) for n in (L, S, S))
    as_tensor = data.draw(st.booleans())
    got = fd.flash_decode(q, k, v, cache_seqlens=torch.tensor(lengths) if as_tensor else lengths, num_splits=splits)
    for b, n in enumerate(lengths):
        want = attn.attention(q[b].double(), k[b, :, :n].double(), v[b, :, :n].double(), causal="bottom-right")
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-5)


def test_flash_decode_cache_seqlens_refuses_what_it_cannot_read():
    q, k = torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 8, 16)
    for bad, exc, words in (([3], ValueError, "one length each"), ([1, 4], ValueError, r"cache_seqlens\[0\] = 1"),
                            ([4, 9], ValueError, r"outside \[L, S\]"), ([2.0, 3], TypeError, "integers"),
                            (torch.tensor([[2, 3]]), ValueError, "shape"), (torch.tensor([2.0, 3.0]), TypeError,
                                                                          "integers"), ("23", TypeError, "integers")):
        with pytest.raises(exc, match=words):
            fd.flash_decode(q, k, k, cache_seqlens=bad)
    torch.testing.assert_close(fd.flash_decode(q, k, k, cache_seqlens=8), fd.flash_decode(q, k, k))


def test_paged_decoding_reads_each_sequence_at_its_own_length_with_b_equal_h():
    B = H = 3
    pool = PagePool(16, 4)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 11, 2]
    caches, keys, values = [], [], []
    for n in lengths:
        cache = PagedKVCache(pool)
        k, v = torch.randn(H, n, 16, generator=g), torch.randn(H, n, 16, generator=g)
        cache.append(k, v)
        caches.append(cache)
        keys.append(k)
        values.append(v)
    q = torch.randn(B, H, 1, 16, generator=g)
    table = caches[1].device_block_table
    assert table.dtype == torch.int32 and table[: len(caches[1].block_table)].tolist() == list(caches[1].block_table)
    assert caches[1].device_length.tolist() == [11]
    got = fd.flash_decode_paged(q, caches, num_splits=2)
    for b in range(B):
        torch.testing.assert_close(got[b], attn.attention(q[b], keys[b], values[b]), rtol=1e-5, atol=1e-5)
    caches[2].append(torch.randn(H, 3, 16, generator=g), torch.randn(H, 3, 16, generator=g))  # a new page taken
    assert caches[2].device_length.tolist() == [5]
    assert table.data_ptr() == caches[1].device_block_table.data_ptr()  # updated in place, never rebuilt
    assert caches[2].device_block_table[:2].tolist() == list(caches[2].block_table)
