"""Tensors shaped by another library, at sizes that coincide (B = L, S = H, L = H, S = Hkv): the right answer when
the layout or the mask is named, and a clear error, never a silent answer, when it is not."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lib import attention as attn
from lib import flash, flash_decode, merge, nn, tiles

B, H, L, S, E = 4, 2, 4, 8, 8  # B = L, S = E: the coincidences that hid the bugs


def qkv(b=B, h=H, lq=L, s=S, e=E, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, e, generator=gen, dtype=dtype) for n in (lq, s, s))


def hf_mask(lengths=(8, 5, 3, 6), s=S):
    """Hugging Face's attention_mask: (B, S), 1 on a real token."""
    return (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()


def sdpa(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


# --------------------------------------------------------------------------------------------------------------
# Padding masks by name and polarity
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_", ["long", "bool", "float"])
def test_hugging_face_attention_mask_as_key_padding_mask_gives_sdpa(as_):
    q, k, v = qkv()
    m = hf_mask()
    want = sdpa(q, k, v, m.bool()[:, None, None, :])
    given = {"long": m, "bool": m.bool(), "float": m.double()}[as_]
    for fn in (attn.attention, attn.attention_loop, lambda *a, **kw: merge.attention_state(*a, **kw)[0]):
        torch.testing.assert_close(fn(q, k, v, key_padding_mask=given), want)
    w = attn.attention_weights(q, k, key_padding_mask=given)
    assert (w[..., m.bool()[:, None, None, :].logical_not().expand_as(w)] == 0).all()


def test_multihead_attentions_polarity_is_passed_inverted():
    q, k, v = qkv()
    ignore = ~hf_mask().bool()  # nn.MultiheadAttention's key_padding_mask: True = ignore
    torch.testing.assert_close(attn.attention(q, k, v, key_padding_mask=~ignore),
                               sdpa(q, k, v, ~ignore[:, None, None, :]))


def test_key_padding_mask_and_mask_both_apply():
    q, k, v = qkv()
    m = hf_mask().bool()
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    want = sdpa(q, k, v, m[:, None, None, :] & causal)
    torch.testing.assert_close(attn.attention(q, k, v, causal[None], key_padding_mask=m), want)
    torch.testing.assert_close(attn.attention(q, k, v, key_padding_mask=m, causal=True), want)
    additive = torch.zeros(L, S, dtype=torch.float64).masked_fill(~causal, -math.inf)[None]
    torch.testing.assert_close(attn.attention(q, k, v, additive, key_padding_mask=m), want)


def test_a_bad_key_padding_mask_is_refused_with_its_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\) = \(4, 8\)"):
        attn.attention(q, k, v, key_padding_mask=hf_mask()[:, :5])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        attn.attention(q, k, v, key_padding_mask=hf_mask() * 2)
    with pytest.raises(ValueError, match="no batch axis"):
        attn.attention(q[0, 0], k[0, 0], v[0, 0], key_padding_mask=hf_mask()[:1])


def test_a_float_mask_of_zeros_and_ones_is_refused_naming_both_fixes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"did you mean `mask.bool\(\)`.*`key_padding_mask=`"):
        attn.attention(q, k, v, hf_mask().double()[:, None, None, :])
    with pytest.raises(ValueError, match="only 0 and 1"):
        tiles.tiled_attention(q.numpy(), k.numpy(), v.numpy(), np.ones((L, S)))
    zeros = torch.zeros(L, S, dtype=torch.float64)  # adding 0 is a valid (if idle) bias
    torch.testing.assert_close(attn.attention(q, k, v, zeros), sdpa(q, k, v, None))


def test_a_2d_boolean_mask_when_b_equals_l_is_refused_as_ambiguous():
    q, k, v = qkv()
    m = hf_mask().bool()
    for call in (lambda: attn.attention(q, k, v, m), lambda: merge.attention_state(q, k, v, m)):
        with pytest.raises(ValueError, match=r"ambiguous.*key_padding_mask=.*m\[:, None, None, :\].*m\[None\]"):
            call()
    x = torch.randn(B, L, 8, dtype=torch.float64)
    module = nn.TorchMultiHeadAttention(8, 2).double()
    with pytest.raises(ValueError, match="ambiguous"):
        module(x, m[:, :L])
    causal = torch.ones(L, S, dtype=torch.bool).tril()  # the (L, S) fix named in the error
    torch.testing.assert_close(attn.attention(q, k, v, causal[None]), sdpa(q, k, v, causal))


def test_a_b_by_s_mask_that_does_not_broadcast_names_the_fix():
    q, k, v = qkv(b=3)
    with pytest.raises(ValueError, match=r"\(B, S\) padding mask.*key_padding_mask="):
        attn.attention(q, k, v, hf_mask()[:3].bool())


def test_the_modules_take_a_key_padding_mask():
    torch.manual_seed(0)
    x = torch.randn(B, L, 8, dtype=torch.float64)
    m = hf_mask(lengths=(4, 2, 1, 3), s=L).bool()
    module = nn.TorchMultiHeadAttention(8, 2, 1).double()
    want = module(x, m[:, None, None, :])
    torch.testing.assert_close(module(x, key_padding_mask=m), want)
    torch.testing.assert_close(module(x, key_padding_mask=m, return_weights=True)[0], want)
    single = nn.TorchSelfAttention(8, 4).double()
    torch.testing.assert_close(single(x, key_padding_mask=m), single(x, m[:, None, :]))


# --------------------------------------------------------------------------------------------------------------
# dtypes as SDPA
# --------------------------------------------------------------------------------------------------------------


def test_mixed_dtypes_are_refused_as_sdpa_refuses_them():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k has dtype torch.float64 but q has torch.float32.*k.to\(q.dtype\)"):
        attn.attention(q.float(), k, v)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q.float(), k, v)
    with pytest.raises(TypeError, match="v has dtype float32 but q has float64"):
        attn.attention(q.numpy(), k.numpy(), v.numpy().astype(np.float32))
    with pytest.raises(TypeError, match="mask has dtype torch.float16 but q has torch.float64"):
        attn.attention(q, k, v, torch.zeros(L, S, dtype=torch.float16))
    ints = (q * 3).long()  # integers take the floating inputs' dtype
    assert attn.attention(ints, k.float(), v.float()).dtype == torch.float32
    bias = np.where(np.tri(L, S) > 0, 0.0, -np.inf)  # NumPy's float64 mask on float32 q: rounded, stated in api.md
    got = attn.attention(q.numpy().astype(np.float32), k.numpy().astype(np.float32), v.numpy().astype(np.float32),
                         bias)
    assert got.dtype == np.float32


# --------------------------------------------------------------------------------------------------------------
# Say the layout, never guess it
# --------------------------------------------------------------------------------------------------------------


def test_attention_and_attention_state_take_flash_attns_layout():
    q, k, v = qkv(lq=H)  # L = H
    want_out, want_lse = merge.attention_state(q, k, v, causal="bottom-right")
    t = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = merge.attention_state(*t, causal="bottom-right", axes="bshd")
    torch.testing.assert_close(out, want_out.transpose(1, 2))
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(attn.attention(*(x.transpose(1, 2) for x in (q, k, v)), axes="bshd"),
                               sdpa(q, k, v, None).transpose(1, 2))
    with pytest.raises(ValueError, match=r"axes='bshd' names q as \(B, S, H, D\)"):
        attn.attention(q[0], k[0], v[0], axes="bshd")
    with pytest.raises(ValueError, match="axes must be 'bhsd'"):
        attn.attention(q, k, v, axes="BSHD")


def test_merge_states_takes_flash_attns_out_and_softmax_lse_when_l_equals_h():
    q, k, v = qkv(lq=H, s=8)  # L = H = 2
    parts = [merge.attention_state(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 3), (3, 8))]
    want = merge.merge_states(parts)
    fa = [(out.transpose(1, 2), lse) for out, lse in parts]  # flash-attn: out (B, L, H, E), lse (B, H, L)
    out, lse = merge.merge_states(fa, axes="bshd")
    torch.testing.assert_close(out, want[0].transpose(1, 2))
    torch.testing.assert_close(lse, want[1])
    with pytest.raises(ValueError, match=r"out \(B, L, H, Ev\) and lse \(B, H, L\)"):
        merge.merge_states(parts[:1] + [(parts[1][0], parts[1][1][:, :1])], axes="bshd")


def test_flash_attention_and_flash_decode_take_flash_attns_layout():
    q, k, v = qkv(lq=4, s=4, h=4, e=16, dtype=torch.float32)  # S = H = Hkv
    want = flash.flash_attention(q, k, v, causal=True)
    got = flash.flash_attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, axes="bshd")
    torch.testing.assert_close(got, want.transpose(1, 2))
    q1 = q[:, :, -1:]
    with torch.no_grad():
        want = flash_decode.flash_decode(q1, k, v)
        got = flash_decode.flash_decode(q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), axes="bshd")
    torch.testing.assert_close(got, want.transpose(1, 2))
    torch.testing.assert_close(want, sdpa(q1, k, v, None))


# --------------------------------------------------------------------------------------------------------------
# One causal rule: True is top-left, bottom-right is spelled out
# --------------------------------------------------------------------------------------------------------------


def test_sink_attention_follows_the_one_causal_rule():
    from lib import variants as vr

    q, k, v = qkv(lq=3, s=6)  # L < S, where the alignments differ
    for causal, sdpa_mask in ((True, torch.ones(3, 6, dtype=torch.bool).tril()),
                              ("top-left", torch.ones(3, 6, dtype=torch.bool).tril()),
                              ("bottom-right", torch.ones(3, 6, dtype=torch.bool).tril(3))):
        torch.testing.assert_close(vr.sink_attention(q, k, v, -math.inf, causal=causal), sdpa(q, k, v, sdpa_mask))
    torch.testing.assert_close(vr.sink_attention(q, k, v, -math.inf), attn.attention(q, k, v, causal=True))
    with pytest.raises(ValueError, match="causal"):
        vr.sink_attention(q, k, v, causal="bottom_right")
    with pytest.raises(ValueError, match="bottom-right"):
        vr.sink_attention(k, q, q[..., :3, :], causal="bottom-right")  # L > S


@pytest.mark.parametrize(("L", "S"), [(3, 9), (9, 9), (9, 4)])
def test_sliding_window_mask_aligns_as_the_window_kernels(L, S):
    from lib import variants as vr

    q, k, v = qkv(lq=L, s=S)
    for align, causal in (("top-left", True), ("bottom-right", "bottom-right")):
        if align == "bottom-right" and L > S:
            with pytest.raises(ValueError, match="L must be <= S"):
                vr.sliding_window_mask(L, S, 3, align=align)
            continue
        band = vr.sliding_window_mask(L, S, 3, align=align)
        torch.testing.assert_close(tiles.tiled_attention(q, k, v, causal=causal, window=3, block_size=2),
                                   attn.attention(q, k, v, band))
    if L <= S:
        torch.testing.assert_close(flash.flash_attention(q.float(), k.float(), v.float(), causal=True, window=3),
                                   attn.attention(q, k, v, vr.sliding_window_mask(L, S, 3)).float(),
                                   rtol=1e-4, atol=1e-5)


def test_sink_attention_takes_grouped_query_heads():
    from lib import variants as vr

    q, (k, v) = qkv(h=4, lq=5, s=5)[0], qkv(h=2, lq=5, s=5)[1:]
    sink = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    want = vr.sink_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), sink)
    torch.testing.assert_close(vr.sink_attention(q, k, v, sink), want)
    torch.testing.assert_close(vr.sink_attention(q, k, v, -math.inf),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    with pytest.raises(ValueError, match="not a multiple of the 3 key/value heads"):
        vr.sink_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1))


# --------------------------------------------------------------------------------------------------------------
# The rolling cache under chunked prefill
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[1] * 5 + [2, 1, 3], [3, 4, 2, 2], [11], [9, 2], [4, 4, 3]], ids=str)
def test_a_rolling_cache_under_chunked_prefill_gives_the_band_mask(chunks):
    from lib import variants as vr

    W, n = 4, sum(chunks)
    q, k, v = qkv(lq=n, s=n, seed=3)
    want = sdpa(q, k, v, vr.sliding_window_mask(n, n, W))
    cache, outs, start = vr.RollingKVCache(W), [], 0
    for T in chunks:
        keys, values, pos = cache.append(k[..., start:start + T, :], v[..., start:start + T, :],
                                         return_positions=True)
        assert pos.tolist() == list(range(max(0, start - W + 1), start + T))  # in order, with their positions
        torch.testing.assert_close(keys, k[..., pos, :])
        band = vr.sliding_window_mask(T, keys.shape[-2], W, align="bottom-right")
        outs.append(sdpa(q[..., start:start + T, :], keys, values, band))
        start += T
    torch.testing.assert_close(torch.cat(outs, dim=-2), want)
    assert cache.nbytes == 2 * B * H * W * E * 8  # never more than the window's slots


# --------------------------------------------------------------------------------------------------------------
# Left-padded ragged prompts through the model
# --------------------------------------------------------------------------------------------------------------


def test_tinylm_and_generate_take_an_attention_mask_for_left_padded_prompts():
    from lib.model import TinyLM, generate

    torch.manual_seed(0)
    model = TinyLM(11, 16, 2, 4, 2).eval()
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2]), torch.tensor([6, 5, 3])]
    P = max(len(p) for p in prompts)
    padded = torch.stack([torch.cat([torch.zeros(P - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(P) >= P - len(p) for p in prompts]).long()  # HF: 1 on real tokens
    logits = model(padded, attention_mask=mask)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b, P - len(p):], model(p[None])[0], rtol=1e-5, atol=1e-5)
    assert not logits.isnan().any()
    for use_cache in (True, False):
        tokens, steps = generate(model, padded, 4, attention_mask=mask, use_cache=use_cache)
        for b, p in enumerate(prompts):
            alone, alone_steps = generate(model, p[None], 4)
            assert tokens[b, P:].tolist() == alone[0, len(p):].tolist()
            for got, want in zip(steps, alone_steps):
                torch.testing.assert_close(got[b], want[0], rtol=1e-5, atol=1e-5)
    unmasked = model(padded)  # without the mask the padding leaks into the short prompts
    assert (unmasked[1, -1] - model(prompts[1][None])[0, -1]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, S\) = \(3, 5\)"):
        model(padded, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        model(padded, attention_mask=mask * 2)


def test_a_kv_cache_takes_flash_attns_layout():
    from lib.decoding import KVCache

    _, k, v = qkv(s=4, h=4)  # S = Hkv
    cache = KVCache(8, axes="bshd")
    cache.append(k[:, :, :3].transpose(1, 2), v[:, :, :3].transpose(1, 2))
    keys, values = cache.append(k[:, :, 3:].transpose(1, 2), v[:, :, 3:].transpose(1, 2))
    torch.testing.assert_close(keys, k.transpose(1, 2))
    torch.testing.assert_close(values, v.transpose(1, 2))
    assert cache.keys.shape == (B, 4, 4, E)
    with pytest.raises(ValueError, match=r"axes='bshd' names k as \(B, S, H, D\)"):
        cache.append(k[0], v[0])
    with pytest.raises(ValueError, match="not a cache with axes='bshd'"):
        nn.TorchMultiHeadAttention(8, 2).double()(torch.randn(1, 1, 8, dtype=torch.float64), cache=cache)
