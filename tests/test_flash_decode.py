"""lib.flash_decode, split-KV decoding in Triton, against PyTorch's kernel; and the rule that picks the split count.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1), in float32
and float16, with 16-key tiles, so that slices of a few tiles, ragged lengths and empty slices all occur at small
sizes. With a GPU the tests marked ``gpu`` compare with SDPA at decoding sizes in half precision.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from lib import cost
from lib import flash_decode as fd
from lib.decoding import KVCache
from lib.paged import PagedKVCache, PagePool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cpu" if fd.INTERPRETED else "cuda"
needs_interpreter = pytest.mark.skipif(not fd.INTERPRETED, reason="checks the interpreter's fixed tiles")


def oracle(q, k, v, scale=None):
    """SDPA in float64 on the CPU, grouped heads, the L queries aligned bottom-right (the last L of S tokens)."""
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    mask = causal_lower_right(L, S)._materialize() if L > 1 else None  # (L, S), True = may attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


def qkv(B, H, Hkv, L, S, E, Ev, dtype=torch.float32):
    return randn(B, H, L, E, dtype=dtype), randn(B, Hkv, S, E, dtype=dtype, seed=1), \
        randn(B, Hkv, S, Ev, dtype=dtype, seed=2)


# B, H, Hkv, L, S, E, Ev: GQA ratios 1, 4 and 8; S on and off the 16-key tile; L from 1 to 16; head sizes padded.
CASES = {
    "mha-one-query": (2, 3, 3, 1, 64, 16, 16),
    "gqa4-ragged": (1, 8, 2, 1, 77, 32, 32),
    "gqa8-ragged": (1, 8, 1, 1, 50, 64, 64),
    "gqa4-L3": (2, 8, 2, 3, 45, 16, 24),
    "gqa8-L16": (1, 16, 2, 16, 71, 16, 16),
    "L=S": (1, 4, 1, 5, 5, 8, 8),
    "odd-heads": (1, 4, 2, 2, 33, 40, 24),
}


@pytest.mark.parametrize("splits", [1, 3, 5], ids=lambda p: f"splits{p}")
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_sdpa_float32(case, splits):
    B, H, _, L, S, _, Ev = case
    q, k, v = qkv(*case)
    out = fd.flash_decode(q, k, v, num_splits=min(splits, S))
    assert out.dtype == torch.float32 and out.shape == (B, H, L, Ev)
    torch.testing.assert_close(out.double().cpu(), oracle(q, k, v), rtol=1e-5, atol=2e-6)


@needs_interpreter
def test_empty_and_ragged_slices():
    # S = 40 keys in 16-key tiles: 4 slices round up to one tile each, so the last slice has no key at all; 3 slices
    # leave a ragged last one (keys 32 to 39). Both merge to the exact answer.
    q, k, v = qkv(1, 4, 1, 1, 40, 16, 16)
    outs, lses = fd.flash_decode_partials(q, k, v, num_splits=4)
    assert (outs[3] == 0).all() and (lses[3] == -math.inf).all()
    assert lses[:3].isfinite().all()
    for splits in (3, 4, 40):
        torch.testing.assert_close(fd.flash_decode(q, k, v, num_splits=splits).double(), oracle(q, k, v),
                                   rtol=1e-5, atol=2e-6)


@needs_interpreter
def test_partial_states_are_attention_over_each_slice():
    # Slice s holds keys [16 s, 16 s + 16) here (3 slices of 48 keys): its state is attention over those keys alone
    # and their logsumexp in the natural log, and the logsumexp-weighted mean of the states is the answer.
    B, H, Hkv, L, S, E = 1, 4, 2, 1, 48, 16
    q, k, v = qkv(B, H, Hkv, L, S, E, E)
    outs, lses = fd.flash_decode_partials(q, k, v, num_splits=3, scale=0.2)
    assert outs.shape == (3, B, H, L, E) and lses.shape == (3, B, H, L)
    kk, vv = (x.double().repeat_interleave(H // Hkv, 1) for x in (k, v))
    for s in range(3):
        part = slice(16 * s, 16 * s + 16)
        torch.testing.assert_close(outs[s].double(), oracle(q, kk[:, :, part], vv[:, :, part], scale=0.2),
                                   rtol=1e-5, atol=2e-6)
        scores = 0.2 * q.double() @ kk[:, :, part].transpose(-1, -2)  # (B, H, L, 16)
        torch.testing.assert_close(lses[s].double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    weights = torch.softmax(lses.double(), dim=0)[..., None]  # (3, B, H, L, 1)
    torch.testing.assert_close((weights * outs.double()).sum(0), oracle(q, k, v, scale=0.2), rtol=1e-5, atol=2e-6)


def test_queries_see_the_cache_bottom_right():
    # Four new tokens, the last four of 30: query i sees keys up to 26 + i. Top-left alignment (is_causal) would
    # let query 0 see only key 0, a different answer.
    q, k, v = qkv(1, 2, 1, 4, 30, 16, 16)
    out = fd.flash_decode(q, k, v, num_splits=2).double().cpu()
    torch.testing.assert_close(out, oracle(q, k, v), rtol=1e-5, atol=2e-6)
    top_left = F.scaled_dot_product_attention(*(x.double().cpu() for x in (q, k.expand(1, 2, 30, 16),
                                                                           v.expand(1, 2, 30, 16))), is_causal=True)
    assert (out - top_left).abs().max() > 0.1


def test_never_reads_past_the_cache_length():
    # A cache's storage beyond its length holds anything (here NaN): the kernel masks every key at or past S.
    storage_k, storage_v = randn(1, 2, 64, 16, seed=1), randn(1, 2, 64, 16, seed=2)
    storage_k[:, :, 37:] = float("nan")
    storage_v[:, :, 37:] = float("nan")
    q, k, v = randn(1, 8, 2, 16), storage_k[:, :, :37], storage_v[:, :, :37]  # views, as KVCache hands out
    for splits in (1, 3, 4):
        out = fd.flash_decode(q, k, v, num_splits=splits)
        torch.testing.assert_close(out.double().cpu(), oracle(q, k, v), rtol=1e-5, atol=2e-6)


def test_follows_strides_and_a_custom_scale():
    # Keys stored (B, S, Hkv, E), as many caches do, seen as (B, Hkv, S, E): no copy is needed.
    k = randn(2, 40, 2, 32, seed=1).transpose(1, 2)
    v = randn(2, 40, 2, 32, seed=2).transpose(1, 2)
    q = randn(2, 3, 8, 32).transpose(1, 2)  # (2, 8, 3, 32)
    assert not k.is_contiguous() and not q.is_contiguous()
    out = fd.flash_decode(q, k, v, num_splits=2, scale=0.3)
    torch.testing.assert_close(out.double().cpu(), oracle(q, k, v, scale=0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("splits", [1, 3])
def test_float16_is_as_close_as_sdpa_in_float16(splits):
    q, k, v = qkv(1, 8, 2, 2, 90, 64, 64, dtype=torch.float16)
    out = fd.flash_decode(q, k, v, num_splits=splits)
    assert out.dtype == torch.float16
    expected = oracle(q, k, v)
    mask = causal_lower_right(2, 90)._materialize()
    theirs = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=mask, enable_gqa=True)
    ours = (out.double().cpu() - expected).abs().max().item()
    reference = (theirs.double() - expected).abs().max().item()
    assert ours <= 2 * reference + 1e-3, (ours, reference)


@needs_interpreter
def test_the_default_split_count_comes_from_the_rule_and_is_exact():
    q, k, v = qkv(1, 8, 2, 1, 200, 16, 16)
    # 2 programs per slice against an H100's 132 SMs: as many slices as 200 keys allow at 64 keys (4 tiles) each.
    assert fd.split_count(1, 8, 1, 2, 200) == cost.choose_num_splits(2, 200, 132, min_keys=64) == 3
    torch.testing.assert_close(fd.flash_decode(q, k, v).double(), oracle(q, k, v), rtol=1e-5, atol=2e-6)


@needs_interpreter
def test_rows_beyond_the_largest_row_tile_take_more_row_blocks(monkeypatch):
    # A T4's table caps the row tile at 32 (a 64-row tile spills there): G · L = 5 · 8 = 40 packed rows then run as
    # row blocks of 32 and 8. Here the interpreter's tiles are capped at 16, so the same 40 rows take three blocks,
    # the last one partly empty, each reading its own copy of the cache; the answer is the same.
    q, k, v = qkv(2, 10, 2, 8, 53, 16, 16)
    calls = []
    split = fd._decode_split

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return split[grid]

    monkeypatch.setattr(fd, "_decode_split", Counting())
    for cap, blocks in ((16, 3), (fd.MAX_ROWS, 1)):
        monkeypatch.setattr(fd, "INTERPRETER_TILES", fd.DecodeTiles(block_n=16, num_warps=1, num_stages=1,
                                                                    max_rows=cap))
        for splits in (1, 3):
            out = fd.flash_decode(q, k, v, num_splits=splits)
            assert calls[-1] == (blocks, 2 * 2, splits)
            torch.testing.assert_close(out.double(), oracle(q, k, v), rtol=1e-5, atol=2e-6)
    assert fd.DECODE_TILES["sm_75"].max_rows == 32 and fd.DECODE_TILES["sm_90"].max_rows == fd.MAX_ROWS
    # The split count sees the same row blocks: 3 blocks · B · Hkv programs against 132 SMs.
    capped = fd.DecodeTiles(block_n=16, num_warps=1, num_stages=1, max_rows=16)
    assert fd.split_count(2, 10, 8, 2, 4096, tiles=capped) == cost.choose_num_splits(12, 4096, 132, min_keys=64)
    assert fd.split_count(2, 10, 8, 2, 4096, tiles=fd.INTERPRETER_TILES) == cost.choose_num_splits(
        4, 4096, 132, min_keys=64)


def test_nothing_to_compute_gives_empty_answers():
    assert fd.flash_decode(randn(2, 4, 0, 16), randn(2, 2, 5, 16), randn(2, 2, 5, 8)).shape == (2, 4, 0, 8)
    assert fd.flash_decode(randn(0, 4, 1, 16), randn(0, 2, 5, 16), randn(0, 2, 5, 8)).shape == (0, 4, 1, 8)


# ----------------------------------------------------------------------------------------------------------------
# Reading a paged cache through its block table
# ----------------------------------------------------------------------------------------------------------------


def paged_batch(lengths, page_size, Hkv=2, E=16, Ev=16, dtype=torch.float32, chunk=7):
    """Sequences of the given lengths in one pool, appended in turns of ``chunk`` tokens so that their pages
    interleave; with each sequence's keys and values as plain tensors (Hkv, S, E), (Hkv, S, Ev)."""
    pool = PagePool(sum(-(-n // page_size) for n in lengths), page_size)
    caches = [PagedKVCache(pool) for _ in lengths]
    keys = [randn(Hkv, n, E, dtype=dtype, seed=10 + b) for b, n in enumerate(lengths)]
    values = [randn(Hkv, n, Ev, dtype=dtype, seed=20 + b) for b, n in enumerate(lengths)]
    for start in range(0, max(lengths), chunk):
        for c, k, v in zip(caches, keys, values):
            if start < k.shape[1]:
                c.append(k[:, start : start + chunk], v[:, start : start + chunk])
    return caches, keys, values


@pytest.mark.parametrize("splits", [1, 3, None], ids=["splits1", "splits3", "default"])
@pytest.mark.parametrize("page_size", [5, 16, 40])
def test_paged_cache_is_read_through_its_block_table(page_size, splits):
    # Pages of 5 (a tile spans several pages), 16 (one each) and 40 (a page spans several tiles); three sequences
    # of different lengths whose pages interleave in the pool; 2 new queries each, 4 query heads per key head.
    lengths = [57, 9, 64]
    caches, keys, values = paged_batch(lengths, page_size)
    assert any(b - a != 1 for c in caches for a, b in zip(c.block_table, c.block_table[1:]))  # not contiguous
    q = randn(3, 8, 2, 16, seed=5)
    out = fd.flash_decode_paged(q, caches, num_splits=splits)
    assert out.shape == (3, 8, 2, 16)
    for b in range(3):
        expected = oracle(q[b : b + 1], keys[b][None], values[b][None])
        torch.testing.assert_close(out[b : b + 1].double().cpu(), expected, rtol=1e-5, atol=2e-6)


def test_paged_float16_and_a_single_cache():
    caches, keys, values = paged_batch([50], 8, Hkv=1, E=32, Ev=32, dtype=torch.float16)
    q = randn(1, 4, 1, 32, dtype=torch.float16)
    out = fd.flash_decode_paged(q, caches[0], num_splits=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, fd.flash_decode(q, keys[0][None], values[0][None], num_splits=2),
                               rtol=0, atol=1e-3)


def test_bad_paged_calls_are_named():
    caches, _, _ = paged_batch([20, 10], 4)
    q = randn(2, 4, 1, 16)
    other, _, _ = paged_batch([5], 4)
    with pytest.raises(ValueError, match="share one PagePool"):
        fd.flash_decode_paged(q, [caches[0], other[0]])
    with pytest.raises(ValueError, match="q has batch 2 but there are 1 caches"):
        fd.flash_decode_paged(q, caches[:1])
    with pytest.raises(TypeError, match="list of lib.paged.PagedKVCache"):
        fd.flash_decode_paged(q, [KVCache(4)])
    with pytest.raises(ValueError, match="L=12 new queries but the keys cover only S=10"):
        fd.flash_decode_paged(q.expand(2, 4, 12, 16), caches)
    with pytest.raises(ValueError, match="at least one token"):
        fd.flash_decode_paged(q, [caches[0], PagedKVCache(caches[0].pool)])


# ----------------------------------------------------------------------------------------------------------------
# The split-count rule (pure Python: no GPU, no Triton)
# ----------------------------------------------------------------------------------------------------------------


def test_the_rule_on_worked_examples():
    h100 = cost.gpu("H100").sms
    assert cost.choose_num_splits(8, 131072, h100) == 15  # 8 programs: 15 slices fill 120 of 132 SMs
    assert cost.choose_num_splits(8, 1024, h100) == 4  # short cache: no slice under 256 keys
    assert cost.choose_num_splits(132, 10**6, h100) == 1  # the SMs are full without splitting
    assert cost.choose_num_splits(48, 10**6, 108) == 2  # FlashAttention-2's own example: 2 slices at 0.89
    assert cost.wave_efficiency(133, 132) == pytest.approx(133 / 264)


@given(programs=st.integers(1, 600), keys=st.integers(0, 300_000), sms=st.integers(1, 200),
       min_keys=st.sampled_from([16, 64, 256]), max_splits=st.integers(1, 256))
def test_the_rule_fills_the_sms_without_short_slices(programs, keys, sms, min_keys, max_splits):
    p = cost.choose_num_splits(programs, keys, sms, min_keys=min_keys, max_splits=max_splits)
    assert 1 <= p <= max_splits
    if p > 1:
        assert keys // p >= min_keys  # no slice shorter than min_keys
    if programs >= sms:  # a full wave already: no slicing
        assert p == 1
        return
    allowed = range(1, max(1, min(max_splits, keys // min_keys)) + 1)
    best = max(cost.wave_efficiency(programs * n, sms) for n in allowed)
    assert cost.wave_efficiency(programs * p, sms) >= 0.85 * best
    assert all(cost.wave_efficiency(programs * n, sms) < 0.85 * best for n in allowed if n < p)  # the smallest such


def test_the_rule_imports_without_torch_or_triton():
    code = "import sys\nfrom lib.cost import choose_num_splits\nassert choose_num_splits(8, 4096, 132) > 1\n" \
           "assert 'torch' not in sys.modules and 'triton' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("bad", [{"programs": 0}, {"sms": 0}, {"keys": -1}, {"min_keys": 2.5},
                                 {"programs": True}])
def test_the_rule_names_bad_arguments(bad):
    args = {"programs": 8, "keys": 4096, "sms": 132, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        cost.choose_num_splits(args.pop("programs"), args.pop("keys"), args.pop("sms"), **args)


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

BAD_CALLS = [
    ("numpy", lambda q, k, v: fd.flash_decode(q.cpu().numpy(), k, v), TypeError, "torch tensors; q is a numpy"),
    ("dtypes", lambda q, k, v: fd.flash_decode(q, k.half(), v), TypeError, "share one dtype"),
    ("float64", lambda q, k, v: fd.flash_decode(q.double(), k.double(), v.double()), TypeError, "float16"),
    ("devices", lambda q, k, v: fd.flash_decode(q, k.to("meta"), v), ValueError, "on one device"),
    ("3-D", lambda q, k, v: fd.flash_decode(q[0], k, v), ValueError, r"4-D q \(B, H, L, E\)"),
    ("groups", lambda q, k, v: fd.flash_decode(q[:, :3], k, v), ValueError, "H=3 heads, not a multiple of"),
    ("E", lambda q, k, v: fd.flash_decode(q, k[..., :8], v), ValueError, "k has E=8 but q has E=16"),
    ("S", lambda q, k, v: fd.flash_decode(q, k, v[:, :, :5]), ValueError, "must agree on"),
    ("batch", lambda q, k, v: fd.flash_decode(q[:1], k, v), ValueError, "q has batch 1 but k and v have 2"),
    ("head", lambda q, k, v: fd.flash_decode(*(torch.zeros(1, 2, 1, 300, device=q.device) for _ in range(3))),
     ValueError, "E=300 is outside"),
    ("L>S", lambda q, k, v: fd.flash_decode(q.expand(2, 4, 9, 16), k, v), ValueError, "L=9 new queries"),
    ("splits0", lambda q, k, v: fd.flash_decode(q, k, v, num_splits=0), ValueError, "between 1 and S=8"),
    ("splits>S", lambda q, k, v: fd.flash_decode(q, k, v, num_splits=9), ValueError, "between 1 and S=8"),
    ("splits-float", lambda q, k, v: fd.flash_decode(q, k, v, num_splits=2.0), TypeError, "num_splits must be"),
    ("scale", lambda q, k, v: fd.flash_decode(q, k, v, scale="big"), TypeError, "scale must be a real"),
    ("grad", lambda q, k, v: fd.flash_decode(q.requires_grad_(), k, v), ValueError, "q requires grad"),
    ("partials", lambda q, k, v: fd.flash_decode_partials(q, k, v, num_splits=None), TypeError, "needs num_splits"),
]


@pytest.mark.parametrize("call, exc, words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_named(call, exc, words):
    q, k, v = randn(2, 4, 1, 16), randn(2, 2, 8, 16, seed=1), randn(2, 2, 8, 16, seed=2)
    with pytest.raises(exc, match=words):
        call(q, k, v)


def test_tensors_that_require_grad_are_taken_under_no_grad():
    q, k, v = qkv(1, 2, 1, 1, 20, 16, 16)
    q.requires_grad_()
    with torch.no_grad():
        out = fd.flash_decode(q, k, v, num_splits=2)
    torch.testing.assert_close(out.double().cpu(), oracle(q, k, v), rtol=1e-5, atol=2e-6)


def test_a_cpu_tensor_without_the_interpreter_says_how_to_run_it(monkeypatch):
    monkeypatch.setattr(fd, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fd.flash_decode(*(torch.zeros(1, 1, 1, 16) for _ in range(3)))


@needs_interpreter
def test_bfloat16_is_refused_in_the_interpreter():
    with pytest.raises(TypeError, match="bfloat16 is not supported in Triton's interpreter"):
        fd.flash_decode(*(torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16) for _ in range(3)))


def test_a_missing_triton_is_named():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "try:\n"
        "    from lib import flash_decode\n"
        "except ModuleNotFoundError as err:\n"
        "    assert 'pip install triton' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('no error without Triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: decoding sizes, half precision
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32, 8, 1, 4096, 128), (1, 32, 8, 1, 65536, 128), (4, 32, 8, 4, 8191, 128),
                                   (2, 16, 2, 16, 3000, 64), (1, 8, 1, 1, 131072, 128)])
@pytest.mark.parametrize("splits", [1, None])
def test_cuda_half_precision_is_as_close_as_sdpa(shape, dtype, splits):
    B, H, Hkv, L, S, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, L, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, S, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    mask = causal_lower_right(L, S)._materialize(device="cuda") if L > 1 else None
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ours = fd.flash_decode(q, k, v, num_splits=splits)
    a, b = ((x.float() - ref).abs().max().item() for x in (ours, theirs))
    assert a <= 2 * b + 1e-3, f"ours {a:.2e}, SDPA in {dtype} {b:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_cuda_paged_equals_contiguous_in_bfloat16(page_size):
    # Four sequences of different lengths in one pool, pages interleaved; each row of the paged answer equals the
    # contiguous kernel on that sequence's keys (the same tiles in the same order, so to within rounding of bf16).
    lengths = [5000, 1, 777, 20000]
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = PagePool(sum(-(-n // page_size) for n in lengths), page_size)
    caches = [PagedKVCache(pool) for _ in lengths]
    keys = [torch.randn(8, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in lengths]
    values = [torch.randn(8, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in lengths]
    for start in range(0, max(lengths), 1000):
        for c, k, v in zip(caches, keys, values):
            if start < k.shape[1]:
                c.append(k[:, start : start + 1000], v[:, start : start + 1000])
    q = torch.randn(len(lengths), 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = fd.flash_decode_paged(q, caches)
    for b, (k, v) in enumerate(zip(keys, values)):
        ref = F.scaled_dot_product_attention(q[b : b + 1].float(), k[None].float(), v[None].float(), enable_gqa=True)
        assert (out[b : b + 1].float() - ref).abs().max().item() < 2e-2


@needs_interpreter
def test_the_decoding_benchmark_runs_end_to_end_in_the_interpreter(tmp_path):
    # Its GPU timing cannot run here, but the rest can: every implementation against SDPA, the split count, the
    # profiler's backend name and the CSV file.
    table = tmp_path / "decode.csv"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_decode.py"), "--smoke", "--csv", str(table)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --smoke sets it itself
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert "sdpa ran _scaled_dot_product_flash_attention_for_cpu" in result.stdout
    rows = [line.split(",") for line in table.read_text().splitlines()]
    assert rows[0] == ["device", "torch", "triton", "cuda", "date", "dtype", "B", "H", "Hkv", "d", "L", "S", "impl",
                       "splits", "ms", "ms_with_host", "gb_per_s", "share_of_peak", "max_err"]
    assert len(rows) == 1 + 4
    by_impl = {(r[11], r[12]): r for r in rows[1:]}
    assert by_impl[("200", "auto")][13] == "3"  # 200 keys, 64 at least per slice: 3 slices on an H100's rule
    assert all(float(r[-1]) < 1e-5 for r in rows[1:])  # every implementation agrees with SDPA


COMPILE_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from lib import flash_decode as fd
from lib.decoding import KVCache
from lib.paged import PagedKVCache, PagePool

POINTERS = {"Q", "K", "V", "O"}
tiles = fd.GPU_TILES
results = {}
for fn, constexprs in (
    (fd._decode_split, {"E": 128, "EV": 128, "BLOCK_E": 128, "BLOCK_EV": 128, "PAGED": False, "PAGE": 1,
                        "DIRECT": False, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": tiles.block_n}),
    (fd._decode_split, {"E": 72, "EV": 72, "BLOCK_E": 128, "BLOCK_EV": 128, "PAGED": True, "PAGE": 16,
                        "DIRECT": True, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": tiles.block_n}),
    (fd._decode_merge, {"EV": 128, "BLOCK_EV": 128, "BLOCK_M": 16}),
):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*bf16"
        elif name in ("O_PART", "LSE_PART", "LSE"):
            signature[name] = "*fp32"
        elif name in ("TABLE", "LENS"):
            signature[name] = "*i32"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    results[f"{fn.__name__}-{len(results)}"] = {"shared": compiled.metadata.shared}
print(json.dumps(results))
"""


@needs_interpreter
def test_the_kernels_compile_for_an_h100():
    # The interpreter forgives what the compiler does not, so both kernels (contiguous and paged) are also compiled
    # for an H100 (sm_90) with the ptxas that ships with Triton, in bfloat16: compile errors and tiles too large for
    # on-chip memory show up on CI, where there is no GPU.
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], capture_output=True, text=True, env=env,
                            check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.splitlines()[-1])
    assert len(compiled) == 3
    for name, info in compiled.items():
        assert info["shared"] <= 227 * 1024, (name, info)  # one thread block's share of an H100 SM
