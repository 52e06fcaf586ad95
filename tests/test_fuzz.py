"""The public API called as a careless user would call it: the right answer, or a clear error naming the argument.

Two parts. A table of every public function and method of lib (lib.model has its own tests) with one good call
each; every argument of it is then replaced, one at a time, by careless values: None, a name where an object is
expected, plain lists and scalars, wrong ranks, empty and size-1 axes, NaN, infinities, the other library's
arrays. Each call must either succeed or raise ValueError or TypeError whose message names the argument, and a
call must never change the arrays it was given (nor a cache or pool it refused). Then a hypothesis search over
the attention functions themselves, q, k, v and every mask form, causal spelling and scale, in NumPy and torch,
mixed dtypes included, checked against a float64 reference written here.
"""

import copy
import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lib import attention as attn
from lib import (
    cost,
    decoding,
    flash,
    flash_decode,
    merge,
    modules,
    nn,
    paged,
    positions,
    ring,
    tiles,
)

R = np.random.default_rng(0)


def arr(*shape):
    return R.standard_normal(shape)


def ten(*shape):
    return torch.from_numpy(arr(*shape)).float()


def filled_cache(n=3):
    cache = decoding.KVCache(8)
    cache.append(arr(2, n, 4), arr(2, n, 4))
    return cache


def paged_cache(pool=None, n=3):
    cache = paged.PagedKVCache(pool or paged.PagePool(8, 2))
    cache.append(ten(2, n, 16), ten(2, n, 16))
    return cache


H100, LLAMA = cost.gpu("H100"), cost.model("Llama-2-7B")
np_self, np_multi = modules.SelfAttention(8, 4, rng=0), modules.MultiHeadAttention(8, 2, rng=0)
t_self, t_multi = nn.TorchSelfAttention(8, 4), nn.TorchMultiHeadAttention(8, 2)
pool_for_paged = paged.PagePool(8, 2)

# (name, function, args, kwargs): one good call of every public function and method
CALLS = [
    ("softmax", attn.softmax, (arr(2, 3),), {"axis": -1}),
    ("attention_weights", attn.attention_weights, (arr(2, 3, 4), arr(2, 5, 4)), {"mask": None, "causal": False,
                                                                                  "scale": None}),
    ("attention", attn.attention, (arr(2, 3, 4), arr(2, 5, 4), arr(2, 5, 3)),
     {"mask": None, "causal": False, "scale": None, "return_weights": False, "key_padding_mask": None,
      "axes": "bhsd"}),
    ("attention_loop", attn.attention_loop, (arr(1, 2, 4), arr(1, 3, 4), arr(1, 3, 2)),
     {"mask": None, "causal": False, "scale": None}),
    ("tiled_attention", tiles.tiled_attention, (arr(2, 3, 4), arr(2, 5, 4), arr(2, 5, 3)),
     {"mask": None, "causal": False, "scale": None, "block_size": 2}),
    ("causal_mask", attn.causal_mask, (3, 4), {"like": None, "align": "top-left"}),
    ("padding_mask", attn.padding_mask, ([1, 3], 4), {"heads": True}),
    ("attention_state", merge.attention_state, (arr(2, 3, 4), arr(2, 5, 4), arr(2, 5, 3)),
     {"mask": None, "causal": False, "scale": None}),
    ("merge_states", merge.merge_states, ([(arr(2, 3), arr(2)), (arr(2, 3), arr(2))],), {"axes": "bhsd"}),
    ("rope_frequencies", positions.rope_frequencies, (8,), {"base": 10000.0}),
    ("apply_rope", positions.apply_rope, (arr(2, 3, 8),), {"positions": None, "offset": 0, "base": 10000.0}),
    ("alibi_slopes", positions.alibi_slopes, (4,), {}),
    ("alibi_bias", positions.alibi_bias, (4, 3, 5), {"like": None}),
    ("split_heads", modules.split_heads, (arr(2, 3, 8), 2), {}),
    ("merge_heads", modules.merge_heads, (arr(2, 2, 3, 4),), {}),
    ("grouped_attention", modules.grouped_attention, (arr(2, 4, 3, 4), arr(2, 2, 5, 4), arr(2, 2, 5, 4)),
     {"mask": None, "causal": False, "return_weights": False}),
    ("xavier_bound", modules.xavier_bound, (4, 8), {}),
    ("SelfAttention", modules.SelfAttention, (8, 4), {"d_v": None, "d_out": None, "rng": 0}),
    ("MultiHeadAttention", modules.MultiHeadAttention, (8, 2), {"n_kv_heads": None, "rng": 0}),
    ("SelfAttention()", np_self, (arr(2, 3, 8),), {"mask": None, "causal": False, "return_weights": False}),
    ("MultiHeadAttention()", np_multi, (arr(2, 3, 8),), {"mask": None, "context": None, "causal": False,
                                                         "cache": None, "rotate": None, "return_weights": False}),
    ("TorchSelfAttention", nn.TorchSelfAttention, (8, 4), {"dropout": 0.0}),
    ("TorchMultiHeadAttention", nn.TorchMultiHeadAttention, (8, 2), {"n_kv_heads": None, "dropout": 0.0}),
    ("TorchSelfAttention()", t_self, (ten(2, 3, 8),), {"mask": None, "causal": False, "return_weights": False}),
    ("TorchMultiHeadAttention()", t_multi, (ten(2, 3, 8),), {"mask": None, "context": None, "causal": False,
                                                             "cache": None, "rotate": None,
                                                             "return_weights": False}),
    ("to_multihead_attention", nn.to_multihead_attention, (np_multi,), {}),
    ("from_multihead_attention", nn.from_multihead_attention, (torch.nn.MultiheadAttention(8, 2, bias=False,
                                                                                            batch_first=True),), {}),
    ("KVCache", decoding.KVCache, (8,), {"static": False}),
    ("KVCache.append", lambda k, v: filled_cache().append(k, v), (arr(2, 1, 4), arr(2, 1, 4)), {}),
    ("decode_step", lambda q, k, v, cache="fresh": decoding.decode_step(q, k, v, filled_cache() if isinstance(
        cache, str) and cache == "fresh" else cache), (arr(2, 1, 4), arr(2, 1, 4), arr(2, 1, 4)), {"cache": "fresh"}),
    ("PagePool", paged.PagePool, (8, 2), {}),
    ("PagedKVCache", paged.PagedKVCache, (pool_for_paged,), {}),
    ("PagedKVCache.append", lambda k, v: paged.PagedKVCache(paged.PagePool(8, 2)).append(k, v),
     (ten(2, 3, 16), ten(2, 3, 16)), {}),
    ("flash_attention", flash.flash_attention, (ten(2, 5, 16), ten(2, 7, 16), ten(2, 7, 8)),
     {"mask": None, "causal": False, "scale": None, "deterministic": False, "variant": None,
      "return_lse": False}),
    ("flash_decode", flash_decode.flash_decode, (ten(2, 2, 1, 16), ten(2, 2, 9, 16), ten(2, 2, 9, 16)),
     {"cache_seqlens": None, "num_splits": None, "scale": None}),
    ("flash_decode_partials", flash_decode.flash_decode_partials, (ten(1, 2, 1, 16), ten(1, 2, 9, 16),
                                                                   ten(1, 2, 9, 16)), {"num_splits": 2,
                                                                                       "scale": None}),
    ("flash_decode_paged", lambda q, caches="fresh", **kw: flash_decode.flash_decode_paged(
        q, [paged_cache()] if isinstance(caches, str) and caches == "fresh" else caches, **kw),
     (ten(1, 2, 1, 16),), {"caches": "fresh", "num_splits": None, "scale": None}),
    ("split_count", flash_decode.split_count, (1, 8, 1, 2, 4096), {"sms": None}),
    ("ring.positions", ring.positions, (8, 1, 2), {"layout": "contiguous"}),
    ("ring.shard", ring.shard, (ten(2, 8, 4), 1, 2), {"layout": "zigzag"}),
    ("ring.unshard", ring.unshard, ([ten(2, 4, 4), ten(2, 4, 4)],), {"layout": "contiguous"}),
    ("cost.gpu", cost.gpu, ("H100",), {}),  # (an id with "gpu" alone would be skipped as a GPU test)
    ("cost.model", cost.model, ("Llama-2-7B",), {}),
    ("wave_efficiency", cost.wave_efficiency, (8, 132), {}),
    ("choose_num_splits", cost.choose_num_splits, (8, 4096, 132), {"min_keys": 256, "max_splits": 128}),
    ("decode_bytes", cost.decode_bytes, (1, 8, 4096, 128, 128, 2), {}),
    ("fp32_per_score", cost.fp32_per_score, (128,), {"block_n": 64, "folded": True}),
    ("score_ledger", cost.score_ledger, (H100, 128), {"n": 4096, "products": 2, "tiles": (128, 64)}),
    ("smem_bytes_per_score", cost.smem_bytes_per_score, (64, 128, 64), {"elt": 2, "rows_per_mma": 64,
                                                                         "q_in_smem": True, "p_in_smem": False}),
    ("l2_bytes_per_score", cost.l2_bytes_per_score, (64, 128), {"Ev": None, "elt": 2}),
    ("GPU.at_clock", H100.at_clock, (1.83e9,), {}),
    ("ledger_ceilings", cost.ledger_ceilings, (H100, 128), {"n": 4096}),
    ("attended_pairs", cost.attended_pairs, (4, 8), {"causal": False}),
    ("attention_flops", cost.attention_flops, (4, 8, 64), {"heads": 1, "batch": 1, "causal": False}),
    ("attention_bytes", cost.attention_bytes, (4, 8, 64), {"heads": 2, "kv_heads": 1, "batch": 1,
                                                           "bytes_per_number": 2}),
    ("intensity", cost.intensity, (100.0, 10.0), {}),
    ("roofline_seconds", cost.roofline_seconds, (1e12, 1e9, H100), {}),
    ("attainable_flops", cost.attainable_flops, (10.0, H100), {}),
    ("layer_step_flops", cost.layer_step_flops, (1, 100, 512), {"kv_size": None}),
    ("forward_flops", cost.forward_flops, (LLAMA, 100), {}),
    ("attention_share", cost.attention_share, (LLAMA, 100), {}),
    ("attention_crossover", cost.attention_crossover, (LLAMA,), {}),
    ("decode_step (cost)", cost.decode_step, (LLAMA, 100), {"batch": 1, "bytes_per_number": 2}),
    ("decode_attention_intensity", cost.decode_attention_intensity, (32, 8), {}),
    ("decode_memory_bytes", cost.decode_memory_bytes, (LLAMA, 100), {"batch": 1}),
    ("decode_fits", cost.decode_fits, (LLAMA, H100, 100), {"batch": 1}),
    ("max_decode_batch", cost.max_decode_batch, (LLAMA, H100, 100), {}),
    ("decode_tokens_per_s", cost.decode_tokens_per_s, (LLAMA, H100, 100), {"batch": 1}),
    ("cache_outweighs_weights", cost.cache_outweighs_weights, (LLAMA,), {"batch": 1}),
    ("kv_cache_bytes", cost.kv_cache_bytes, (32, 8, 128, 100, 2), {"batch": 1}),
]

CARELESS = {
    "None": None,
    "a name": "bogus",
    "a list": [1.0, 2.0],
    "a nested list": [[1.0, 2.0], [3.0, 4.0]],
    "-1": -1,
    "0": 0,
    "1.5": 1.5,
    "True": True,
    "NaN": float("nan"),
    "inf": float("inf"),
    "an object": object(),
    "an empty array": np.zeros((0,)),
    "a 0-d array": np.array(1.0),
    "a 5-D array": np.zeros((1, 1, 1, 1, 1)),
    "an empty tensor": torch.zeros(0),
    "a size-1 tensor": torch.ones(1, 1, 1),
    "an int tensor": torch.ones(2, 3, dtype=torch.int64),
}

RAISED_FINE = (ValueError, TypeError)


def parameter_names(fn, args, kwargs):
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    names = list(inspect.signature(target).parameters)
    names = [n for n in names if n not in ("self",)]
    return names[: len(args)] + list(kwargs)


def snapshot(value):
    """A copy of every array or tensor inside value, to check that a call changed none of them."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, (decoding.KVCache, paged.PagedKVCache, paged.PagePool)):
        return repr(value)  # its length, capacity, shapes and pages
    return None


def same(a, b):
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b, equal_nan=True)
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, (list, tuple)):
        return all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, str):  # a cache or pool, by its repr
        return a == repr(b)
    return True




def call_with(fn, args, kwargs, i, value):
    args, kwargs = list(args), dict(kwargs)
    if i < len(args):
        args[i] = value
    else:
        kwargs[list(kwargs)[i - len(args)]] = value
    return args, kwargs


def test_every_good_call_succeeds():
    for name, fn, args, kwargs in CALLS:
        with torch.no_grad():
            fn(*copy.copy(args), **kwargs)


def careless_problems(name, fn, args, kwargs, i, param, what):
    """What is wrong with calling fn with argument ``param`` replaced by CARELESS[what]: a list of messages."""
    args, kwargs = call_with(fn, args, kwargs, i, CARELESS[what])
    before = [snapshot(a) for a in args] + [snapshot(v) for v in kwargs.values()]
    problems = []
    try:
        with torch.no_grad():
            fn(*args, **kwargs)
    except RAISED_FINE as err:
        if param not in str(err):
            problems.append(f"{name}({param}={what}) raised {type(err).__name__} without naming {param}: {err}")
    except Exception as err:  # noqa: BLE001 -- anything else is the finding
        problems.append(f"{name}({param}={what}) raised {type(err).__name__}: {err}")
    after = list(args) + list(kwargs.values())
    if not all(same(b, a) for b, a in zip(before, after)):
        problems.append(f"{name}({param}={what}) changed an input")
    return problems


# Where a careless value gives a result rather than an error, it is a value the function documents as accepted
# (a list read as an array, 0 as a count or a scale, True as an integer flag...): the test asks only that nothing
# else comes out of a careless call than a result or a ValueError/TypeError naming the argument.
@pytest.mark.parametrize(("name", "fn", "args", "kwargs"), CALLS, ids=[c[0] for c in CALLS])
def test_a_careless_argument_gives_a_result_or_an_error_that_names_it(name, fn, args, kwargs):
    problems = []
    for i, param in enumerate(parameter_names(fn, args, kwargs)):
        for what in CARELESS:
            problems += careless_problems(name, fn, args, kwargs, i, param, what)
    assert not problems, "\n".join(problems)


def test_a_refused_append_changes_neither_cache_nor_pool():
    cache = decoding.KVCache(4)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(arr(2, 5, 4), arr(2, 5, 4))  # too long for the capacity
    assert cache.keys is None and len(cache) == 0
    cache.append(arr(3, 2, 6), arr(3, 2, 6))  # a different shape is still welcome after the refusal
    assert cache.keys.shape == (3, 2, 6)
    with pytest.raises(ValueError, match="k has shape"):
        cache.append(arr(2, 1, 6), arr(2, 1, 6))
    assert len(cache) == 2
    pool = paged.PagePool(2, 2)
    seq = paged.PagedKVCache(pool)
    with pytest.raises(ValueError, match="free pages"):
        seq.append(ten(1, 5, 4), ten(1, 5, 4))
    assert pool.free_pages == 2 and pool.key_pages is None and len(seq) == 0
    cache.reset()
    assert len(cache) == 0
    cache.append(arr(3, 1, 6), arr(3, 1, 6))
    np.testing.assert_array_equal(cache.keys.shape, (3, 1, 6))


# --------------------------------------------------------------------------------------------------------------
# The attention functions against a float64 reference, every mask form, causal spelling and scale
# --------------------------------------------------------------------------------------------------------------


def reference(q, k, v, mask, causal, scale):
    """softmax(q kᵀ · scale + mask) v in float64 NumPy, causal as an offset or None; empty rows give zeros."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed = allowed & mask
        else:
            s = s + mask
    if causal is not None:
        allowed = allowed & (np.arange(S)[None, :] <= np.arange(L)[:, None] + causal)
    s = np.where(allowed & (s > -np.inf), s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    return (e / np.where(total == 0, 1.0, total)) @ v


FUNCTIONS = {
    "attention": attn.attention,
    "attention_loop": attn.attention_loop,
    "tiled_attention": lambda *a, **kw: tiles.tiled_attention(*a, block_size=(2, 3), **kw),
    "attention_state": lambda *a, **kw: merge.attention_state(*a, **kw)[0],
}
TAKE_AXES = {"attention", "attention_state"}  # the functions with axes=, fuzzed in both layouts

# Sizes that coincide, where a tensor read along the wrong axis passes every shape check: batch (B, H), L, S
COINCIDENT = ["B=L", "B=H", "S=H", "L=H", "B=L=S=H", None]


@st.composite
def sizes(draw):
    """batch, L, S: free, or two of B, H, L, S (the batch (B, H) of split heads) drawn equal."""
    coincide = draw(st.sampled_from(COINCIDENT))
    if coincide is None:
        batch = tuple(draw(st.lists(st.integers(0, 2), max_size=2)))
        return batch, draw(st.integers(0, 4)), draw(st.integers(0, 5))
    n = draw(st.integers(1, 4))
    B, H, L, S = (draw(st.integers(1, 4)) for _ in range(4))
    B, H, L, S = {"B=L": (n, H, n, S), "B=H": (n, n, L, S), "S=H": (B, n, L, n), "L=H": (B, n, n, S),
                  "B=L=S=H": (n, n, n, n)}[coincide]
    return (B, H), L, S


@st.composite
def problems(draw):
    batch, L, S = draw(sizes())
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    q, k, v = arr(*batch, L, E), arr(*batch, S, E), arr(*batch, S, Ev)
    form = draw(st.sampled_from(["none", "bool", "bool-keys", "bool-batch", "float", "list", "int", "wrong-shape",
                                 "heads-4d", "key-padding", "float-01"]))
    mask = {
        "none": None,
        "bool": R.random((L, S)) < 0.7,
        "bool-keys": R.random(S) < 0.7,  # (S,): one key mask for every query
        "bool-batch": R.random(batch + (L, S)) < 0.6,
        "float": np.where(R.random((L, S)) < 0.7, R.standard_normal((L, S)), -np.inf),
        "list": (R.random((L, S)) < 0.7).tolist(),
        "int": np.ones((L, S), dtype=np.int64),
        "wrong-shape": np.ones((L + 1, S + 2), dtype=bool),
        "heads-4d": np.ones((2, 1, 1, S), dtype=bool),
        "key-padding": (R.random(batch[:1] + (S,)) < 0.7).astype(np.int64),  # Hugging Face's (B, S), 1 = real
        "float-01": np.ones((L, S)),  # attention_mask.to(dtype): masks nothing if added, so refused
    }[form]
    causal = draw(st.sampled_from([False, True, "top-left", "bottom-right", "bogus", 1, None]))
    scale = draw(st.sampled_from([None, 0.0, -0.7, 1e-30, 5.0, float("nan"), "0.5", True]))
    backend = draw(st.sampled_from(["numpy", "torch", "mixed"]))
    dtype = draw(st.sampled_from(["float64", "float32", "float16", "int64"]))
    k_dtype = draw(st.sampled_from([dtype, "float32"]))  # mixed floating dtypes are refused, as SDPA refuses them
    return q, k, v, mask, form, causal, scale, backend, (dtype, k_dtype)


def expectation(q, mask, form, causal, scale, backend, L, S, E, dtypes=("float64", "float64")):
    """The argument names an error may give (every one that is wrong), or an empty set if the call is valid."""
    wrong = set()
    if backend == "mixed":
        wrong |= {"q", "k", "v"}
    if dtypes[0] != dtypes[1] and "int64" not in dtypes:
        wrong.add("k")
    batch = q.shape[:-2]
    if form in ("bool", "list") and batch and batch[0] == L > 1:  # (L, S) or a (B, S) padding mask? refused
        wrong.add("mask")
    if isinstance(causal, str):
        if causal not in ("top-left", "bottom-right") or causal == "bottom-right" and L > S:
            wrong.add("causal")
    elif not isinstance(causal, bool):
        wrong.add("causal")
    if isinstance(scale, (str, bool)) or (isinstance(scale, float) and math.isnan(scale)):
        wrong.add("scale")
    if form in ("int", "wrong-shape") or (form == "heads-4d" and (q.ndim < 4 or q.shape[0] != 2)):
        wrong.add("mask")
    if form == "float-01" and L * S:
        wrong.add("mask")
    if form == "key-padding" and not batch:
        wrong.add("key_padding_mask")
    if form == "list" and backend == "torch":
        wrong.add("mask")
    return wrong


@settings(max_examples=200)
@given(problem=problems(), which=st.sampled_from(sorted(FUNCTIONS)), bshd=st.booleans())
def test_the_attention_functions_give_the_reference_or_a_named_error(problem, which, bshd):
    q, k, v, mask, form, causal, scale, backend, (dtype, k_dtype) = problem
    bshd = bshd and which in TAKE_AXES and q.ndim == 4  # flash-attn's (B, L, H, E), passed with axes="bshd"
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    inputs = [x.astype(t) if t != "int64" else (x * 3).astype(np.int64)
              for x, t in zip((q, k, v), (dtype, k_dtype, dtype))]
    if backend in ("torch", "mixed"):
        inputs = [torch.from_numpy(x) for x in inputs]
        if backend == "mixed":
            inputs[1] = inputs[1].numpy()
        if isinstance(mask, np.ndarray):
            mask = torch.from_numpy(mask)
    before = [snapshot(x) for x in inputs] + [snapshot(mask)]
    want = expectation(q, mask, form, causal, scale, backend, L, S, E, (dtype, k_dtype))
    kw = {"axes": "bshd"} if bshd else {}
    args = [x.swapaxes(1, 2) for x in inputs] if bshd else inputs
    given_mask = mask
    if form == "key-padding":
        kw["key_padding_mask"], given_mask = mask, None
    try:
        got = FUNCTIONS[which](*args, given_mask, causal=causal, scale=scale, **kw)
    except RAISED_FINE as err:
        assert want, f"a valid call raised {type(err).__name__}: {err}"
        assert any(n in str(err) for n in want), f"the error does not name {want}: {err}"
    else:
        assert not want, f"an invalid call ({want}) gave a result"
        offset = {False: None, True: 0, "top-left": 0, "bottom-right": S - L}[causal]
        s = 1 / math.sqrt(E) if scale is None else scale
        ref_inputs = [np.asarray(x, dtype=np.float64) for x in inputs]
        ref_mask = None if mask is None else np.asarray(mask if not isinstance(mask, torch.Tensor) else mask.numpy())
        if form == "key-padding":  # one row per sequence: (B, 1, ..., 1, S)
            ref_mask = ref_mask.astype(bool).reshape(ref_mask.shape[:1] + (1,) * (q.ndim - 2) + ref_mask.shape[1:])
        expected = reference(*ref_inputs, ref_mask, offset, s)
        got = got.swapaxes(1, 2) if bshd else got
        got_np = got.numpy() if isinstance(got, torch.Tensor) else got
        assert not np.isnan(got_np).any()
        tol = max({"float16": 3e-3, "float32": 2e-5}.get(t, 1e-9) for t in (dtype, k_dtype))
        np.testing.assert_allclose(got_np.astype(np.float64), expected, rtol=tol * 10, atol=tol * 10)
    for b, a in zip(before, inputs + [mask]):
        assert same(b, a), "an input was changed"


def test_the_examples_the_fuzzing_first_found():
    """Each bad input the issue lists, now a right answer or a named error."""
    assert cost.attended_pairs(4, 8, causal="top-left") == 10
    with pytest.raises(ValueError, match="causal"):
        cost.attended_pairs(4, 8, causal="bogus")
    with pytest.raises(TypeError, match="like"):
        positions.alibi_bias(2, 3, like=torch.float16)
    half = positions.alibi_bias(2, 3, like=torch.empty(0, dtype=torch.float16))
    assert half.dtype == torch.float16
    q = arr(2, 3, 4)
    key_mask = np.array([True, False, True])
    np.testing.assert_allclose(tiles.tiled_attention(q, q, q, key_mask), attn.attention(q, q, q, key_mask), rtol=1e-12)
    x = ten(2, 3, 8)
    torch.testing.assert_close(t_multi(x, attn.padding_mask([3, 2], 3)),
                               t_multi(x, torch.from_numpy(attn.padding_mask([3, 2], 3))))
    out, lse = merge.merge_states([([[1.0, 2.0]], [0.0]), ([[3.0, 4.0]], [0.0])])
    np.testing.assert_allclose(out, [[2.0, 3.0]])
    np.testing.assert_allclose(lse, [math.log(2.0)])
    assert cost.decode_tokens_per_s("Llama-2-7B", "H100", 4096) == cost.decode_tokens_per_s(LLAMA, H100, 4096)
    assert cost.attention_share("Llama-2-7B", 100) == cost.attention_share(LLAMA, 100)
    with pytest.raises(ValueError, match="at most batch=30"):
        cost.decode_tokens_per_s("Llama-2-7B", "H100", 4096, batch=256)


@settings(max_examples=25)
@given(L=st.integers(1, 40), S=st.integers(0, 40), E=st.integers(1, 40), batch=st.lists(st.integers(1, 2), max_size=2),
       scale=st.sampled_from([None, -0.5, 0.0, 1e-30, 0.3, 2.0]),
       causal=st.sampled_from([False, True, "top-left", "bottom-right"]), lse=st.booleans(),
       coincide=st.sampled_from([None, "L=H", "S=H", "B=L"]), bshd=st.booleans())
def test_the_kernel_gives_the_reference_or_a_named_error(L, S, E, batch, scale, causal, lse, coincide, bshd):
    if coincide is not None:  # split heads (B, H) with two sizes equal, and maybe flash-attn's (B, L, H, E)
        L, S, B = min(L, 6), min(S, 6), batch[0] if batch else 2
        batch = {"L=H": [B, L], "S=H": [B, S], "B=L": [L, 2]}[coincide]
    q, k, v = ten(*batch, L, E), ten(*batch, S, E), ten(*batch, S, 3)
    bshd = bshd and len(batch) == 2
    try:
        if bshd:
            got = flash.flash_attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal, scale=scale,
                                        return_lse=lse, axes="bshd")
            got = (got[0].transpose(1, 2), got[1]) if lse else got.transpose(1, 2)
        else:
            got = flash.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=lse)
    except RAISED_FINE as err:
        assert causal == "bottom-right" and L != S and "causal" in str(err), err
        return
    out, got_lse = got if lse else (got, None)
    want_out, want_lse = merge.attention_state(*(x.double() for x in (q, k, v)), causal=causal, scale=scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    if lse:
        finite = want_lse > -math.inf
        assert (got_lse[~finite] == -math.inf).all()
        torch.testing.assert_close(got_lse.double()[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 3), S=st.integers(1, 10), E=st.integers(1, 20), G=st.integers(1, 3), Hkv=st.integers(1, 3),
       B=st.integers(1, 3), splits=st.sampled_from([None, 1, 2, 3]),
       coincide=st.sampled_from([None, "S=Hkv", "S=H", "L=H", "B=S", "B=Hkv"]), bshd=st.booleans())
def test_split_decoding_gives_the_reference_in_both_layouts(L, S, E, G, Hkv, B, splits, coincide, bshd):
    """flash_decode with grouped heads against SDPA in float64, with sizes that coincide (a cache read along the
    wrong axis passes every shape check then), in the library's (B, H, L, E) and flash-attn's (B, L, H, E)."""
    if coincide == "S=Hkv":
        S = Hkv = max(Hkv, L)
    if coincide == "S=H":
        G = max(G, -(-L // Hkv))  # enough query heads that S = H covers the L queries
    H = G * Hkv
    if coincide == "S=H":
        S = H
    elif coincide == "L=H":
        L = H
    elif coincide == "B=S":
        B = S
    elif coincide == "B=Hkv":
        B = Hkv
    S = max(S, L)  # the L new queries are the last L of the S tokens
    q, k, v = ten(B, H, L, E), ten(B, Hkv, S, E), ten(B, Hkv, S, 3)
    if splits is not None:
        splits = min(splits, S)
    if bshd:
        got = flash_decode.flash_decode(*(x.transpose(1, 2) for x in (q, k, v)), num_splits=splits, axes="bshd")
        got = got.transpose(1, 2)
    else:
        got = flash_decode.flash_decode(q, k, v, num_splits=splits)
    allowed = torch.ones(L, S, dtype=torch.bool).tril(S - L)  # bottom-right: query i is token S - L + i
    want = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), attn_mask=allowed,
                                                            enable_gqa=True)
    assert got.shape == (B, H, L, 3)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
