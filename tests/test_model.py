"""lib.model: RoPE attention against SDPA, the pre-norm block, and generate with a cache equal to generate without."""

import math

import pytest
import torch
import torch.nn.functional as F

from lib.decoding import KVCache
from lib.model import (
    CausalSelfAttention,
    DecoderBlock,
    TinyLM,
    TwoCopies,
    generate,
    head_ablations,
)
from lib.modules import merge_heads, split_heads
from lib.positions import apply_rope

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rope", [True, False])
def test_attention_equals_sdpa_on_rotated_heads(n_kv_heads, rope):
    torch.manual_seed(0)
    layer = CausalSelfAttention(16, 4, n_kv_heads, rope=rope).eval()
    x = torch.randn(3, 7, 16)
    q = split_heads(x @ layer.w_q, 4)
    k = split_heads(x @ layer.w_k, n_kv_heads)
    v = split_heads(x @ layer.w_v, n_kv_heads)
    if rope:
        q, k = apply_rope(q), apply_rope(k)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv_heads != 4)
    with torch.no_grad():
        out, weights = layer(x, return_weights=True)
        torch.testing.assert_close(layer(x), merge_heads(ref) @ layer.w_o, **TOL)
    torch.testing.assert_close(out, merge_heads(ref) @ layer.w_o, **TOL)
    assert weights.shape == (3, 4, 7, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 7))
    assert bool((weights.triu(1) == 0).all())  # causal: nothing above the diagonal


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 1, 2], [7], [2, 5]])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_cached_chunks_equal_the_whole_sequence(chunks, n_kv_heads):
    torch.manual_seed(1)
    layer = CausalSelfAttention(16, 4, n_kv_heads).eval()
    x = torch.randn(2, 7, 16)
    cache, outs, start = KVCache(7), [], 0
    with torch.no_grad():
        for size in chunks:
            assert len(cache) == start  # the new tokens' first position
            outs.append(layer(x[:, start : start + size], cache=cache))
            start += size
        torch.testing.assert_close(torch.cat(outs, dim=1), layer(x), **TOL)


def test_cache_holds_keys_rotated_at_their_own_positions():
    torch.manual_seed(2)
    layer = CausalSelfAttention(8, 2).eval()
    x = torch.randn(1, 5, 8)
    cache = KVCache(5)
    with torch.no_grad():
        for t in range(5):
            layer(x[:, t : t + 1], cache=cache)
        expected = apply_rope(split_heads(x @ layer.w_k, 2))
    torch.testing.assert_close(cache.keys, expected, **TOL)


def test_without_rope_attention_cannot_tell_the_order_of_earlier_tokens():
    torch.manual_seed(3)
    layer_on, layer_off = CausalSelfAttention(8, 2).eval(), CausalSelfAttention(8, 2, rope=False).eval()
    layer_off.load_state_dict(layer_on.state_dict())
    x = torch.randn(1, 5, 8)
    swapped = x[:, [1, 0, 2, 3, 4]]  # swap two earlier tokens; the last token sees the same set either way
    with torch.no_grad():
        torch.testing.assert_close(layer_off(x)[:, -1], layer_off(swapped)[:, -1], **TOL)
        assert not torch.allclose(layer_on(x)[:, -1], layer_on(swapped)[:, -1], atol=1e-4)


def test_ablating_a_head_replaces_its_output_by_its_mean_over_reference_inputs():
    torch.manual_seed(4)
    lm = TinyLM(11, 8, 1, 2).eval()
    layer = lm.blocks[0].attention
    reference, tokens = torch.randint(0, 11, (6, 7)), torch.randint(0, 11, (3, 5))
    lm.fit_head_means(reference)
    x = lm.blocks[0].norm_attention(lm.embed(tokens))
    with torch.no_grad():
        ref_x = lm.blocks[0].norm_attention(lm.embed(reference))
        _, w_ref = layer(ref_x, return_weights=True)
        mean = (w_ref @ split_heads(ref_x @ layer.w_v, 2)).mean(dim=(0, 2))  # (2, 4): values are not rotated
        _, w = layer(x, return_weights=True)
        heads = w @ split_heads(x @ layer.w_v, 2)  # (3, 2, 5, 4)
        heads[:, 1] = mean[1]
        torch.testing.assert_close(layer.head_means, mean, **TOL)
        layer.ablated = {1}
        torch.testing.assert_close(layer(x), merge_heads(heads) @ layer.w_o, **TOL)
        torch.testing.assert_close(layer(x, return_weights=True)[0], merge_heads(heads) @ layer.w_o, **TOL)


def test_mean_ablation_is_refused_before_the_means_are_fitted():
    lm = TinyLM(11, 8, 2, 2).eval()
    lm.blocks[1].attention.ablated = {0}
    with pytest.raises(ValueError, match="fit_head_means"):
        lm(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="fit_head_means"), lm.ablate({0: [1]}):
        pass


@pytest.mark.parametrize("ablated", [{(1, 0)}, {(0, 1), (1, 0), (1, 1)}, {(1, 0), (1, 1)}])
def test_generation_under_ablation_with_a_cache_equals_without(ablated):
    torch.manual_seed(11)
    lm = TinyLM(17, 16, 2, 2).eval()
    lm.fit_head_means(torch.randint(0, 17, (8, 10)))
    heads = {}
    for layer, head in ablated:
        heads.setdefault(layer, []).append(head)
    prompt = torch.randint(0, 17, (1, 4))  # one sequence: the case a per-call mean got wrong
    with lm.ablate(heads):
        cached, cached_logits = generate(lm, prompt, 6)
        plain, plain_logits = generate(lm, prompt, 6, use_cache=False)
        with torch.no_grad():
            full = lm(cached)[:, 3:-1]
    intact = generate(lm, prompt, 6)[1]
    assert torch.equal(cached, plain)
    torch.testing.assert_close(torch.stack(cached_logits, 1), torch.stack(plain_logits, 1), **TOL)
    torch.testing.assert_close(torch.stack(cached_logits, 1), full, **TOL)
    assert not torch.allclose(torch.stack(intact, 1), torch.stack(cached_logits, 1), atol=1e-3)  # it did ablate
    assert all(not layer.ablated for layer in lm.attention_layers())  # restored on leaving


@pytest.mark.parametrize("source", [False, True])
def test_an_ablated_sequence_does_not_depend_on_the_rest_of_the_batch(source):
    torch.manual_seed(12)
    lm = TinyLM(13, 16, 2, 2).eval()
    lm.fit_head_means(torch.randint(0, 13, (8, 6)))
    alone, others = torch.randint(0, 13, (1, 6)), torch.randint(0, 13, (3, 6))
    batch = torch.cat([alone, others])
    swap = torch.randint(0, 13, (4, 6))  # resample: each sequence's own source
    with torch.no_grad():
        with lm.ablate({1: [0], 0: [1]}, source=swap[:1] if source else None):
            by_itself = lm(alone)
        with lm.ablate({1: [0], 0: [1]}, source=swap if source else None):
            in_batch = lm(batch)[:1]
        intact = lm(alone)
    torch.testing.assert_close(in_batch, by_itself, **TOL)
    assert not torch.allclose(intact, by_itself, atol=1e-3)


def test_resample_ablation_takes_each_heads_output_on_the_source():
    torch.manual_seed(13)
    lm = TinyLM(13, 16, 2, 2).eval()
    tokens, source = torch.randint(0, 13, (2, 6)), torch.randint(0, 13, (2, 6))
    with torch.no_grad():
        with lm.ablate({0: [0, 1]}, source=source):  # all of layer 0 from the source
            patched = lm(tokens)
        # by hand: layer 0 outputs exactly what it output on the source, layer 1 runs on the mixed stream
        x_src = lm.embed(source)
        mixed0 = lm.blocks[0].attention(lm.blocks[0].norm_attention(x_src))
        x = lm.embed(tokens) + mixed0
        x = x + lm.blocks[0].mlp(lm.blocks[0].norm_mlp(x))
        expected = lm.unembed(lm.norm(lm.blocks[1](x)))
    torch.testing.assert_close(patched, expected, **TOL)
    with pytest.raises(ValueError, match="cache"), lm.ablate({0: [0]}, source=source):
        lm(tokens, caches=lm.new_caches(6))
    with pytest.raises(ValueError, match="shape"), lm.ablate({0: [0]}, source=source):
        lm(tokens[:1])


def test_head_ablations_scores_every_head_and_layer():
    torch.manual_seed(14)
    lm = TinyLM(13, 16, 2, 2).eval()
    tokens = torch.randint(0, 13, (4, 6))
    lm.fit_head_means(tokens)

    def score(model):
        with torch.no_grad():
            return round(model(tokens).sum().item(), 3)

    result = head_ablations(lm, score)
    assert result.kind == "mean" and len(result.heads) == 2 and len(result.heads[0]) == 2
    with lm.ablate({1: [1]}):
        assert result.heads[1][1] == score(lm)
    with lm.ablate({0: [0, 1]}):
        assert result.layers[0] == score(lm)
    assert result.intact == score(lm) and len({*result.heads[0], *result.heads[1], result.intact}) == 5
    assert head_ablations(lm, score, source=tokens.flip(0)).kind == "resample"


def test_two_copies_ablation_uses_its_one_layer():
    torch.manual_seed(15)
    model = TwoCopies().eval()
    digits = torch.randint(0, 10, (5, 8))
    mirror, previous = TwoCopies.answers(digits)
    assert mirror[0].tolist() == digits[0].flip(0).tolist() and previous[0, 0] == digits[0, -1]
    model.fit_head_means(digits)
    with torch.no_grad(), model.ablate({0: [1]}):
        one = model(digits[:1])[0]
        many = model(digits)[0][:1]
    torch.testing.assert_close(one, many, **TOL)
    assert model.attention.head_means.shape == (2, 16)


def test_block_is_pre_norm_residual():
    torch.manual_seed(5)
    block = DecoderBlock(8, 2, d_ff=16).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        h = x + block.attention(block.norm_attention(x))
        expected = h + block.mlp.down(F.gelu(block.mlp.up(block.norm_mlp(h))))
        torch.testing.assert_close(block(x), expected, **TOL)
    attention_only = DecoderBlock(8, 2, d_ff=0)
    assert attention_only.mlp is None and attention_only.norm_mlp is None


def test_model_is_causal_a_later_token_changes_no_earlier_logit():
    torch.manual_seed(6)
    lm = TinyLM(13, 16, 2, 4, 2).eval()
    tokens = torch.randint(0, 13, (2, 9))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 13
    with torch.no_grad():
        a, b = lm(tokens), lm(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], **TOL)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_with_a_cache_gives_the_logits_of_generating_without(n_kv_heads, temperature):
    torch.manual_seed(7)
    lm = TinyLM(17, 32, 2, 4, n_kv_heads).eval()
    prompt = torch.randint(0, 17, (3, 4))
    runs = [generate(lm, prompt, 8, use_cache=c, temperature=temperature, generator=torch.Generator().manual_seed(0))
            for c in (True, False)]
    (cached, cached_logits), (plain, plain_logits) = runs
    assert torch.equal(cached, plain) and cached.shape == (3, 12)
    assert torch.equal(cached[:, :4], prompt)
    for step, (a, b) in enumerate(zip(cached_logits, plain_logits)):
        torch.testing.assert_close(a, b, **TOL, msg=f"step {step}")
    with torch.no_grad():
        full = lm(cached)  # (3, 12, 17): one forward over the final sequence
    torch.testing.assert_close(torch.stack(cached_logits, dim=1), full[:, 3:-1], **TOL)
    if temperature == 0:
        assert torch.equal(cached[:, 4:], full[:, 3:-1].argmax(-1))


def test_generate_fills_one_cache_per_layer():
    torch.manual_seed(8)
    lm = TinyLM(11, 16, 3, 2).eval()
    caches = lm.new_caches(10)
    with torch.no_grad():
        lm(torch.randint(0, 11, (1, 6)), caches=caches)
    assert [len(c) for c in caches] == [6, 6, 6]
    assert caches[0].keys.shape == (1, 2, 6, 8)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda lm: lm(torch.zeros(3, dtype=torch.long)), "shape"),
        (lambda lm: lm(torch.tensor([[0, 5]])), "token 5, outside the vocabulary"),
        (lambda lm: generate(lm, torch.tensor([[1, 7]]), 2), "token 7, outside the vocabulary"),
        (lambda lm: generate(lm, torch.tensor([[-1, 2]]), 2), "token -1"),
        (lambda lm: setattr(lm.blocks[0].attention, "ablated", {7}), "ablated"),
        (lambda lm: setattr(lm.blocks[0].attention, "ablated", {-1}), "ablated"),
        (lambda lm: setattr(lm.blocks[0].attention, "ablated", "0"), "ablated"),
        (lambda lm: lm.ablate({2: [0]}).__enter__(), "layer 2"),
        (lambda lm: lm.ablate({0: [2]}).__enter__(), "heads"),
        (lambda lm: lm(torch.zeros(1, 3, dtype=torch.long), caches=[KVCache(4)]), "one each"),
        (lambda lm: generate(lm, torch.zeros(1, 0, dtype=torch.long), 2), "prompt"),
        (lambda lm: generate(lm, torch.zeros(1, 2, dtype=torch.long), -1), "n_new"),
        (lambda lm: generate(lm, torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1), "temperature"),
        (lambda lm: generate(lm, torch.zeros(1, 2, dtype=torch.long), 2, temperature=math.inf), "temperature"),
        (lambda lm: generate(lm, torch.zeros(1, 2, dtype=torch.long), 2, temperature=math.nan), "temperature"),
        (lambda lm: lm.blocks[0].attention(torch.zeros(2, 3, 5)), "shape"),
        (lambda lm: CausalSelfAttention(6, 2), "even"),
    ],
)
def test_model_refuses_bad_input(call, error):
    lm = TinyLM(5, 8, 2, 2)
    with pytest.raises(ValueError, match=error):
        call(lm)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda lm: lm(torch.zeros(2, 3)), "integer token ids"),
        (lambda lm: lm([[0, 1]]), "integer torch tensor"),
        (lambda lm: generate(lm, torch.zeros(1, 2), 2), "integer token ids"),
        (lambda lm: lm.ablate([0]).__enter__(), "dict"),
        (lambda lm: generate(lm, torch.zeros(1, 2, dtype=torch.long), 2, temperature="hot"), "temperature"),
    ],
)
def test_model_refuses_the_wrong_type(call, error):
    lm = TinyLM(5, 8, 2, 2)
    with pytest.raises(TypeError, match=error):
        call(lm)


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    torch.manual_seed(16)
    lm = TinyLM(9, 16, 1, 2).eval()
    prompt = torch.randint(0, 9, (3, 4))
    greedy, _ = generate(lm, prompt, 5)
    tiny, _ = generate(lm, prompt, 5, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny, greedy)


def test_model_trains_deterministically():
    def run():
        torch.manual_seed(9)
        lm = TinyLM(7, 16, 2, 2, d_ff=0)
        opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randint(0, 7, (4, 6), generator=data)
            loss = F.cross_entropy(lm(x)[:, :-1].reshape(-1, 7), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item(), [p.detach().clone() for p in lm.parameters()]

    (a, pa), (b, pb) = run(), run()
    assert a == b and all(torch.equal(x, y) for x, y in zip(pa, pb))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_head_by_head_path_equals_the_module_path(n_kv_heads):
    torch.manual_seed(10)
    layer = CausalSelfAttention(16, 4, n_kv_heads).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        for chunks in ([6], [4, 1, 1], [1] * 6):
            fused_cache, plain_cache, start = KVCache(6), KVCache(6), 0
            for size in chunks:
                part = x[:, start : start + size]
                fused = layer(part, cache=fused_cache)  # lib.nn's SDPA call with the rotate hook
                plain, _ = layer._ablated_forward(part, plain_cache, layer._rotate, True)  # nothing ablated
                torch.testing.assert_close(plain, fused, **TOL)
                start += size
            torch.testing.assert_close(plain_cache.keys, fused_cache.keys)


def test_a_refused_ablation_leaves_the_model_as_it_was():
    torch.manual_seed(17)
    lm = TinyLM(11, 8, 2, 2).eval()
    lm.fit_head_means(torch.randint(0, 11, (4, 5)))
    lm.blocks[0].attention.ablated = {1}
    tokens = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        before = lm(tokens)
    for bad in ({0: [0], 3: [0]}, {1: [0, 2]}, {1: ["0"]}, {True: [0]}):
        with pytest.raises(ValueError), lm.ablate(bad):
            pass
    with pytest.raises(ValueError):
        lm.blocks[1].attention.ablated = {0, 5}
    assert [layer.ablated for layer in lm.attention_layers()] == [{1}, set()]
    with torch.no_grad():
        torch.testing.assert_close(lm(tokens), before, rtol=0, atol=0)
