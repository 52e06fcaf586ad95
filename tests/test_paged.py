"""lib.paged, the paged key-value cache: read back through its block table, it equals the contiguous KVCache."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.decoding import KVCache, decode_step
from lib.paged import PagedKVCache, PagePool


def heads(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@given(sizes=st.lists(st.integers(0, 23), min_size=1, max_size=8), page_size=st.integers(1, 17),
       lead=st.sampled_from([(), (3,), (2, 2)]))
def test_paged_equals_contiguous_for_any_appends_and_page_size(sizes, page_size, lead):
    total = sum(sizes)
    pool = PagePool(max(1, -(-total // page_size)), page_size)  # exactly enough pages
    paged, contiguous = PagedKVCache(pool), KVCache(max(1, total))
    k, v = heads(*lead, total, 4), heads(*lead, total, 3, seed=1)
    start = 0
    for n in sizes:
        keys, values = paged.append(k[..., start : start + n, :], v[..., start : start + n, :])
        ref_keys, ref_values = contiguous.append(k[..., start : start + n, :], v[..., start : start + n, :])
        start += n
        np.testing.assert_array_equal(keys, ref_keys)
        np.testing.assert_array_equal(values, ref_values)
        assert len(paged) == start and paged.keys().shape == (*lead, start, 4)
        assert len(paged.block_table) == -(-start // page_size)  # a page is taken only when the last is full
    assert pool.free_pages == 0 or total == 0
    assert len(set(paged.block_table)) == len(paged.block_table)  # no page twice


@settings(max_examples=60)
@given(script=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=20),
       page_size=st.integers(1, 8))
def test_sequences_sharing_a_pool_never_see_each_other(script, page_size):
    # Three sequences append in any interleaving; each reads back exactly its own tokens, their pages are disjoint,
    # and the pool's free count is what they do not hold.
    pool = PagePool(200, page_size)  # room for 20 appends of 9 tokens even in pages of 1
    paged = [PagedKVCache(pool) for _ in range(3)]
    contiguous = [KVCache(200) for _ in range(3)]
    for step, (who, n) in enumerate(script):
        k, v = heads(2, n, 4, seed=step), heads(2, n, 5, seed=100 + step)
        paged[who].append(k, v)
        contiguous[who].append(k, v)
    held = [p for c in paged for p in c.block_table]
    assert len(held) == len(set(held)) and pool.free_pages == 200 - len(held)
    for p, c in zip(paged, contiguous):
        if len(c):
            np.testing.assert_array_equal(p.keys(), c.keys)
            np.testing.assert_array_equal(p.values(), c.values)
        else:
            assert p.keys().shape == (2, 0, 4) and p.block_table == ()


def test_released_pages_are_reused_and_others_keep_their_rows():
    pool = PagePool(4, 4)
    a, b = PagedKVCache(pool), PagedKVCache(pool)
    a.append(heads(2, 5, 3), heads(2, 5, 3, seed=1))  # pages 0, 1
    b.append(heads(2, 3, 3, seed=2), heads(2, 3, 3, seed=3))  # page 2
    assert a.block_table == (0, 1) and b.block_table == (2,) and pool.free_pages == 1
    a.release()
    assert len(a) == 0 and a.block_table == () and pool.free_pages == 3
    c = PagedKVCache(pool)
    c.append(heads(2, 9, 3, seed=4), heads(2, 9, 3, seed=5))  # the lowest free pages: 0, 1, 3
    assert c.block_table == (0, 1, 3)
    np.testing.assert_array_equal(b.keys(), heads(2, 3, 3, seed=2))
    np.testing.assert_array_equal(c.values(), heads(2, 9, 3, seed=5))


def test_a_full_pool_refuses_and_leaves_the_cache_as_it_was():
    pool = PagePool(2, 4)
    cache = PagedKVCache(pool)
    cache.append(heads(1, 6, 2), heads(1, 6, 2))
    with pytest.raises(ValueError, match="the pool has 0 free pages of 4 tokens, but 3 more tokens after 6 need 1"):
        cache.append(heads(1, 3, 2), heads(1, 3, 2))
    assert len(cache) == 6 and cache.block_table == (0, 1)
    cache.append(heads(1, 2, 2, seed=7), heads(1, 2, 2, seed=7))  # the last page still has room for 2
    np.testing.assert_array_equal(cache.keys()[:, 6:], heads(1, 2, 2, seed=7))


def test_waste_is_under_one_page_per_sequence():
    # The point of pages: a sequence of S tokens holds ⌈S / page_size⌉ pages, so fewer than page_size rows unused,
    # where a contiguous cache reserves its whole capacity.
    pool = PagePool(100, 16)
    lengths = [1, 16, 17, 100, 250]
    for n in lengths:
        PagedKVCache(pool).append(heads(2, n, 8), heads(2, n, 8))
    used_rows = (100 - pool.free_pages) * 16
    assert 0 <= used_rows - sum(lengths) < 16 * len(lengths)
    assert pool.nbytes == 2 * 100 * 2 * 16 * 8 * 4


def test_torch_pages_on_the_tensors_device_and_decode_step_takes_either_cache():
    # decode_step only appends and attends what append returns: a paged cache gives the same outputs.
    torch.manual_seed(0)
    pool = PagePool(8, 3)
    paged, contiguous = PagedKVCache(pool), KVCache(20)
    for n in (4, 1, 1, 3):
        q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 6)
        got = decode_step(q, k, v, paged)
        want = decode_step(q, k, v, contiguous)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert pool.key_pages.shape == (8, 1, 2, 3, 8) and pool.key_pages.dtype == torch.float32
    assert repr(paged) == "PagedKVCache(9 tokens in 3 pages of 3, block table [0, 1, 2])"
    assert repr(pool) == "PagePool(5 of 8 pages free, 3 tokens each, pages of keys (1, 2, 3, 8))"


BAD = [
    ("pages", lambda: PagePool(0, 4), ValueError, "num_pages must be at least 1"),
    ("page-size", lambda: PagePool(4, 2.0), TypeError, "page_size must be an integer"),
    ("pool", lambda: PagedKVCache(KVCache(4)), TypeError, "pool must be a PagePool"),
    ("1-D", lambda: PagedKVCache(PagePool(2, 2)).append(heads(4), heads(4)), ValueError, "at least 2-D"),
    ("k-v", lambda: PagedKVCache(PagePool(2, 2)).append(heads(2, 3, 4), heads(2, 2, 4)), ValueError,
     "one value per key"),
    ("grad", lambda: PagedKVCache(PagePool(2, 2)).append(torch.zeros(1, 2, requires_grad=True), torch.zeros(1, 2)),
     ValueError, "k requires grad"),
]


@pytest.mark.parametrize("call, exc, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("k, v, words", [
    (heads(3, 2, 4), heads(3, 2, 5), r"k has shape \(3, 2, 4\) but the pool stores \(2, 'l', 4\)"),
    (heads(2, 2, 4).astype(np.float64), heads(2, 2, 5), "k has dtype float64 but the pool stores float32"),
    (torch.zeros(2, 2, 4), torch.zeros(2, 2, 5), "k is a Tensor but the pool holds a ndarray"),
])
def test_appends_that_do_not_match_the_pool_are_named(k, v, words):
    pool = PagePool(4, 2)
    PagedKVCache(pool).append(heads(2, 1, 4), heads(2, 1, 5))
    other = PagedKVCache(pool)
    with pytest.raises((ValueError, TypeError), match=words):
        other.append(k, v)
    assert len(other) == 0 and pool.free_pages == 3  # a refused append takes no page
