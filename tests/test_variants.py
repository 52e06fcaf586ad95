"""lib.variants (chapter 13) against independent references: SDPA with an explicit mask where one applies, loops
written out here where none does, and the counts of lib.cost against the masks and tensors they count."""

import math

import pytest
import torch
import torch.nn.functional as F

from lib import cost
from lib import variants as vr
from lib.model import TinyLM
from lib.positions import apply_rope


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- sinks


@pytest.mark.parametrize("sink", [0.0, 2.5, torch.tensor([-1.0, 0.0, 3.0])], ids=["off-by-one", "scalar", "per-head"])
def test_sink_attention_is_sdpa_scaled_by_the_weight_left_to_the_keys(sink):
    q, k, v = randn(2, 3, 5, 4, seed=1), randn(2, 3, 7, 4, seed=2), randn(2, 3, 7, 6, seed=3)
    out, weights, to_sink = vr.sink_attention(q, k, v, sink, causal="bottom-right", return_weights=True)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)  # bottom-right
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-2, -1) / 2).masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (2, 3, 5, 1)
    s = torch.as_tensor(sink).reshape(-1, 1, 1) if torch.is_tensor(sink) else torch.tensor(sink)
    kept = torch.sigmoid(lse - s)  # e^lse / (e^lse + e^sink)
    torch.testing.assert_close(out, plain * kept)
    torch.testing.assert_close(weights.sum(-1) + to_sink, torch.ones(2, 3, 5))
    assert bool((to_sink > 0).all())


def test_a_sink_of_minus_infinity_is_plain_attention():
    q, k, v = randn(1, 2, 6, 4, seed=4), randn(1, 2, 6, 4, seed=5), randn(1, 2, 6, 4, seed=6)
    torch.testing.assert_close(vr.sink_attention(q, k, v, -math.inf),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_sink_on_the_wrong_axis_is_refused():
    q = randn(1, 3, 4, 2)
    with pytest.raises(ValueError, match="one logit per head"):
        vr.sink_attention(q, q, q, torch.zeros(4))  # one per query: the wrong axis
    with pytest.raises(ValueError, match="one logit per head"):
        vr.sink_attention(q, q, q, torch.zeros(3, 1))
    with pytest.raises(TypeError, match="sink must be a torch tensor"):
        vr.sink_attention(q, q, q, [0.0, 0.0, 0.0])


def test_streaming_mask_keeps_the_first_tokens_and_the_window():
    mask = vr.streaming_mask(10, 3, n_sink=2)
    assert mask[9].nonzero()[:, 0].tolist() == vr.streaming_keep(10, 3, n_sink=2) == [0, 1, 7, 8, 9]
    assert torch.equal(vr.streaming_mask(10, 3), vr.sliding_window_mask(10, 10, 3))
    assert not bool(mask.triu(1).any())  # never the future
    with pytest.raises(ValueError, match="n_sink"):
        vr.streaming_mask(4, 2, n_sink=-1)


def test_masked_forward_is_the_model_and_takes_sinks_and_other_attention():
    torch.manual_seed(0)
    model = TinyLM(11, 16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=8).eval()
    tokens = torch.randint(0, 11, (3, 9))
    with torch.no_grad():
        logits, maps = model(tokens, return_weights=True)
        ours, our_maps = vr.masked_forward(model, tokens, return_weights=True)
        torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(our_maps, maps):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        sunk = vr.masked_forward(model, tokens, sinks=torch.zeros(2, 4))
        assert not torch.allclose(sunk, logits, atol=1e-3)  # the sink takes weight away from the values
        mask = vr.streaming_mask(9, 4, n_sink=1)
        evicted = vr.masked_forward(model, tokens, mask)
        torch.testing.assert_close(evicted[:, :4], logits[:, :4], rtol=1e-5, atol=1e-5)  # nothing evicted yet

        def sdpa(q, k, v, allowed):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

        torch.testing.assert_close(vr.masked_forward(model, tokens, mask, attend=sdpa), evicted,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask must be boolean"):
        vr.masked_forward(model, tokens, torch.ones(9, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="sinks must be"):
        vr.masked_forward(model, tokens, sinks=torch.zeros(4))


# ---------------------------------------------------------------------------------------------------- windows


def test_a_rolling_cache_decodes_as_the_band_mask_and_stops_growing():
    window, n = 4, 11
    q, k, v = randn(2, 3, n, 8, seed=7), randn(2, 3, n, 8, seed=8), randn(2, 3, n, 5, seed=9)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=vr.sliding_window_mask(n, n, window))
    cache, outs, sizes = vr.RollingKVCache(window), [], []
    keys, values = cache.append(k[..., :3, :], v[..., :3, :])  # a prompt of 3
    outs.append(F.scaled_dot_product_attention(q[..., :3, :], keys, values, is_causal=True))
    for t in range(3, n):
        keys, values = cache.append(k[..., t:t + 1, :], v[..., t:t + 1, :])
        outs.append(F.scaled_dot_product_attention(q[..., t:t + 1, :], keys, values))  # every slot: in the window
        sizes.append(cache.nbytes)
    torch.testing.assert_close(torch.cat(outs, dim=-2), expected)
    assert len(cache) == n and keys.shape[-2] == window
    assert set(sizes) == {2 * 3 * window * (8 + 5) * 4}  # bytes: fixed from the first append


def test_rolling_cache_errors():
    with pytest.raises(ValueError, match="window must be at least 1"):
        vr.RollingKVCache(0)
    with pytest.raises(TypeError, match="window must be an integer"):
        vr.RollingKVCache(2.0)
    with pytest.raises(ValueError, match="same"):
        vr.RollingKVCache(2).append(torch.zeros(3, 4), torch.zeros(2, 4))


# ---------------------------------------------------------------------------------------------------- latent


def latent_reference(layer, x):
    """MLA written out head by head from its definition, with an explicit causal softmax."""
    B, L, _ = x.shape
    c = x @ layer.w_dkv
    k_rope = apply_rope(x @ layer.w_kr)
    q = (x @ layer.w_q).reshape(B, L, layer.H, -1)
    heads = []
    for h in range(layer.H):
        k_h = torch.cat([c @ layer.w_uk[:, h * layer.d_nope:(h + 1) * layer.d_nope], k_rope], dim=-1)
        v_h = c @ layer.w_uv[:, h * layer.d_v:(h + 1) * layer.d_v]
        q_h = torch.cat([q[..., h, :layer.d_nope], apply_rope(q[..., h, layer.d_nope:])], dim=-1)
        scores = q_h @ k_h.transpose(-2, -1) / math.sqrt(layer.d_nope + layer.d_rope)
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
        heads.append(scores.softmax(-1) @ v_h)
    return torch.cat(heads, dim=-1) @ layer.w_o


def test_latent_attention_naive_and_absorbed_agree_with_the_definition():
    torch.manual_seed(0)
    layer = vr.LatentAttention(d_model=24, n_heads=3, d_latent=10, d_nope=6, d_rope=4, d_v=5)
    x = randn(2, 9, 24, seed=10)
    with torch.no_grad():
        naive = layer(x)
        torch.testing.assert_close(naive, latent_reference(layer, x), rtol=1e-5, atol=1e-5)
        out, cache = layer.decode(x[:, :4])  # a prompt of 4, then one token at a time
        outs = [out]
        for t in range(4, 9):
            out, cache = layer.decode(x[:, t:t + 1], cache)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), naive, rtol=1e-5, atol=1e-5)
    assert cache[0].shape == (2, 9, 10) and cache[1].shape == (2, 9, 4)  # latent and rotary key: no k, no v


def test_latent_attention_errors():
    with pytest.raises(ValueError, match="d_rope=3 must be even"):
        vr.LatentAttention(16, 2, 8, 4, 3, 4)
    with pytest.raises(ValueError, match="d_latent must be at least 1"):
        vr.LatentAttention(16, 2, 0, 4, 4, 4)
    layer = vr.LatentAttention(16, 2, 8, 4, 4, 4)
    with pytest.raises(ValueError, match="d_latent=8"):
        layer.decode(randn(1, 1, 16), (torch.zeros(1, 3, 6), torch.zeros(1, 3, 4)))


# ---------------------------------------------------------------------------------------------------- linear


def linear_reference(q, k, v):
    """out_i = Σ_{j<=i} φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j), one row at a time."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    rows = []
    for i in range(q.shape[-2]):
        w = (fq[..., i:i + 1, :] * fk[..., :i + 1, :]).sum(-1)  # (..., i + 1)
        rows.append((w[..., None] * v[..., :i + 1, :]).sum(-2) / w.sum(-1, keepdim=True))
    return torch.stack(rows, dim=-2)


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
def test_linear_attention_three_ways_equal_the_definition(chunk):
    q, k, v = randn(2, 3, 13, 4, seed=11), randn(2, 3, 13, 4, seed=12), randn(2, 3, 13, 6, seed=13)
    expected = linear_reference(q, k, v)
    torch.testing.assert_close(vr.linear_attention(q, k, v), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vr.linear_attention_recurrent(q, k, v), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vr.linear_attention_chunked(q, k, v, chunk), expected, rtol=1e-5, atol=1e-5)


def test_linear_attention_errors():
    q = randn(1, 5, 4)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        vr.linear_attention_chunked(q, q, q, 0)
    with pytest.raises(ValueError, match="k has E=3"):
        vr.linear_attention(q, randn(1, 5, 3), q)
    with pytest.raises(ValueError, match="L = S"):
        vr.linear_attention_recurrent(q, randn(1, 6, 4), randn(1, 6, 4))
    with pytest.raises(ValueError, match="kind must be"):
        vr.RecallNet(8, 4, 8, kind="cosine")


def test_recall_batch_asks_for_keys_that_were_given():
    keys, values, asked, answers = vr.recall_batch(torch.Generator().manual_seed(0), 50, 6, 20, 5, 4)
    assert all(len(set(row.tolist())) == 6 for row in keys)  # distinct keys
    for b in range(50):
        for a, ans in zip(asked[b].tolist(), answers[b].tolist()):
            assert values[b, keys[b].tolist().index(a)].item() == ans
    with pytest.raises(ValueError, match="n_keys >= n_pairs"):
        vr.recall_batch(torch.Generator(), 1, 9, 8, 2, 1)


def test_recall_net_linear_state_is_fixed_and_softmax_attends():
    torch.manual_seed(0)
    keys, values, asked, _ = vr.recall_batch(torch.Generator().manual_seed(1), 4, 6, 20, 5, 3)
    for kind in ("softmax", "linear"):
        assert vr.RecallNet(20, 5, 8, kind)(keys, values, asked).shape == (4, 3, 5)


# ---------------------------------------------------------------------------------------------------- costs


@pytest.mark.parametrize("n, window", [(10, 3), (10, 10), (3, 10), (0, 4), (17, None)])
def test_band_scores_count_the_band_mask(n, window):
    expected = n * (n + 1) // 2 if window is None or n == 0 else int(vr.sliding_window_mask(n, n, window).sum())
    assert cost.band_scores(n, window) == expected


def test_cache_bytes_count_what_the_caches_hold():
    layer = vr.LatentAttention(16, 2, 8, 4, 4, 4)
    _, (c, k_rope) = layer.decode(randn(1, 5, 16))
    assert cost.mla_cache_bytes(3, 8, 4, 5, 4) == 3 * (c.nbytes + k_rope.nbytes)
    ring = vr.RollingKVCache(4)
    ring.append(torch.zeros(2, 7, 16), torch.zeros(2, 7, 16))  # 2 heads, 7 tokens into 4 slots
    assert cost.windowed_cache_bytes([4, None], 2, 16, 7, 4) == ring.nbytes + 2 * 2 * 7 * 16 * 4
    per_token = {name: cost.cache_bytes_per_token(c) for name, c in cost.CACHE_CONFIGS.items()}
    assert per_token["DeepSeek-V3 (MLA)"] == 61 * 576 * 2
    assert per_token["Llama 2 7B (MHA)"] == 2 * 32 * 32 * 128 * 2
    assert cost.linear_state_bytes(2, 3, 4, 5, 2) == 2 * 3 * (4 * 5 + 4) * 2
    with pytest.raises(ValueError, match="one entry per layer"):
        cost.windowed_cache_bytes([], 2, 16, 7, 4)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        cost.band_scores(5, 0)


def test_lookup_batch_answers_with_the_token_after_the_last_occurrence():
    tokens, targets = vr.lookup_batch(torch.Generator().manual_seed(3), 40, n_tokens=16, n_symbols=20, max_gap=5)
    bos, none = 20, 21
    assert bool((tokens[:, 0] == bos).all())
    for row, target in zip(tokens.tolist(), targets.tolist()):
        for p in range(16):
            earlier = [j for j in range(1, p) if row[j] == row[p]]
            assert target[p] == (row[earlier[-1] + 1] if earlier and p > 0 else none)
            if earlier:
                assert p - earlier[-1] < 5  # the answer lies within the last max_gap tokens
    assert 0 < int((targets != none).sum()) < targets.numel()
    with pytest.raises(ValueError, match="distinct symbols"):
        vr.lookup_batch(torch.Generator(), 1, n_tokens=30, n_symbols=20)
