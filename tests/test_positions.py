"""lib.positions: RoPE makes a score depend on the offset alone; ALiBi is a causal floating mask with a slope per head."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lib import attention as attn
from lib.positions import alibi_bias, alibi_slopes, apply_rope, rope_frequencies


def rows(n, size, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal((n, size)).astype(dtype)


@given(
    a=st.integers(0, 5000),
    b=st.integers(0, 5000),
    shift=st.integers(0, 5000),
    half=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_rope_score_depends_only_on_the_offset(a, b, shift, half, seed):
    q, k = rows(2, 2 * half, seed)
    here = apply_rope(q[None], [a])[0] @ apply_rope(k[None], [b])[0]
    moved = apply_rope(q[None], [a + shift])[0] @ apply_rope(k[None], [b + shift])[0]
    np.testing.assert_allclose(moved, here, rtol=1e-9, atol=1e-9)


def test_rope_changes_the_score_when_the_offset_changes():
    q, k = rows(2, 8, seed=3)
    scores = [apply_rope(q[None], [p])[0] @ apply_rope(k[None], [0])[0] for p in range(6)]
    assert len({round(float(s), 6) for s in scores}) == 6


def test_rope_is_a_rotation_of_each_pair():
    x = rows(5, 6, seed=1)
    out = apply_rope(x)
    np.testing.assert_allclose(np.linalg.norm(out.reshape(5, 3, 2), axis=-1), np.linalg.norm(x.reshape(5, 3, 2), axis=-1))
    np.testing.assert_allclose(out[0], x[0])  # position 0: no rotation
    theta = rope_frequencies(6)
    c, s = np.cos(2 * theta[1]), np.sin(2 * theta[1])  # row 2, pair 1 (coordinates 2 and 3)
    np.testing.assert_allclose(out[2, 2:4], [c * x[2, 2] - s * x[2, 3], s * x[2, 2] + c * x[2, 3]])


def test_rope_offset_equals_the_tail_of_the_whole_sequence():
    x = rows(9, 8, seed=2)
    np.testing.assert_allclose(apply_rope(x[6:], offset=6), apply_rope(x)[6:], rtol=1e-12)
    np.testing.assert_allclose(apply_rope(x[6:], np.arange(6, 9)), apply_rope(x)[6:], rtol=1e-12)


def test_rope_numpy_and_torch_agree_and_keep_the_dtype():
    x = rows(14, 8, dtype=np.float32).reshape(2, 7, 8)
    out_np = apply_rope(x, offset=3)
    out_t = apply_rope(torch.from_numpy(x), offset=3)
    assert out_np.dtype == np.float32 and out_t.dtype == torch.float32
    np.testing.assert_allclose(out_t.numpy(), out_np, rtol=1e-6, atol=1e-6)
    half = apply_rope(torch.from_numpy(x).to(torch.bfloat16))
    assert half.dtype == torch.bfloat16


def test_rope_is_differentiable():
    x = torch.randn(3, 4, requires_grad=True)
    apply_rope(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rope_batched_positions():
    x = rows(6, 4).reshape(2, 3, 4)
    pos = np.array([[0, 1, 2], [5, 6, 7]])
    out = apply_rope(x, pos)
    np.testing.assert_allclose(out[1], apply_rope(x[1], offset=5))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: apply_rope(np.ones((3, 5))), "even"),
        (lambda: apply_rope(np.ones(4)), "at least 2-D"),
        (lambda: apply_rope(np.ones((3, 4), dtype=int)), "floating"),
        (lambda: apply_rope(np.ones((3, 4)), [0, 1]), "shape"),
        (lambda: apply_rope(np.ones((3, 4)), [0.0, 1.0, 2.0]), "integers"),
        (lambda: apply_rope(np.ones((3, 4)), [0, 1, 2], offset=2), "not both"),
        (lambda: apply_rope(np.ones((3, 4)), offset=-1), "offset"),
        (lambda: apply_rope(np.ones((3, 4)), base=1), "base"),
    ],
)
def test_rope_refuses_bad_input(call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call()


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(alibi_slopes(4), [2**-2, 2**-4, 2**-6, 2**-8])
    # 6 heads: the 4 slopes of n = 4, then the odd-numbered slopes of n = 8
    np.testing.assert_allclose(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(0)


def test_alibi_bias_is_a_causal_distance_penalty():
    bias = alibi_bias(2, 3, 5)  # (H, L, S), queries are tokens 2, 3, 4
    assert bias.shape == (2, 3, 5)
    allowed = np.isfinite(bias[0])
    np.testing.assert_array_equal(allowed, attn.causal_mask(3, 5, align="bottom-right"))
    assert bias[0, 0, 0] == -2 * alibi_slopes(2)[0] and bias[1, 2, 4] == 0
    with pytest.raises(ValueError, match="L <= S"):
        alibi_bias(2, 5, 3)


def test_alibi_in_attention_matches_sdpa_with_the_same_float_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    bias = alibi_bias(4, 6, like=q)  # (4, 6, 6), float32
    ours = attn.attention(q, k, v, bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # a decode step: the last 2 queries against all 6 keys give the last 2 rows
    step = attn.attention(q[..., 4:, :], k, v, alibi_bias(4, 2, 6, like=q))
    torch.testing.assert_close(step, ours[..., 4:, :], rtol=1e-5, atol=1e-6)


def test_alibi_score_depends_only_on_the_offset():
    bias = alibi_bias(3, 10)
    for h in range(3):
        for d in range(10):
            diag = np.diagonal(bias[h], offset=-d)
            assert np.all(diag == diag[0])


# ------------------------------------------------------------------------------------- the two pairings of RoPE


def hf_rotate_half(x):
    """Hugging Face's rotate_half, written out: (x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_cos_sin(position_ids, dim, base=10000.0, dtype=torch.float64):
    """LlamaRotaryEmbedding's cos and sin (B, L, dim): inv_freq = base^(-2i/dim), emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq  # (B, L, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, L, dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


def left_padded_position_ids():
    """Hugging Face's position ids of a left-padded batch: cumsum(attention_mask) - 1, padding set to 1."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1), mask


def test_half_pairs_equal_hugging_faces_rotate_half_under_left_padding():
    gen = torch.Generator().manual_seed(0)
    position_ids, _ = left_padded_position_ids()
    B, H, L, E = 3, 4, 6, 8  # B = H - 1, L = 6: (B, L) positions are read per sequence
    q, k = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64), torch.randn(B, 2, L, E, generator=gen,
                                                                                   dtype=torch.float64)
    cos, sin = hf_cos_sin(position_ids, E)
    want_q, want_k = hf_apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, position_ids, pairs="half"), want_q)
    torch.testing.assert_close(apply_rope(k, position_ids, pairs="half"), want_k)
    np.testing.assert_allclose(apply_rope(q.numpy(), position_ids.numpy(), pairs="half"), want_q.numpy())
    interleaved = apply_rope(q, position_ids)  # the other pairing: a different rotation, no error
    assert (interleaved - want_q).abs().max() > 0.5
    perm = torch.cat([torch.arange(0, E, 2), torch.arange(1, E, 2)])  # (0, 2, 4, 6, 1, 3, 5, 7)
    torch.testing.assert_close(apply_rope(q[..., perm], position_ids, pairs="half"), interleaved[..., perm])
    with pytest.raises(ValueError, match="pairs must be 'interleaved'.*'half'"):
        apply_rope(q, pairs="rotate_half")


def test_half_pairs_equal_transformers_own_apply_rotary_pos_emb():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama",
                                reason="transformers is a test requirement (requirements.txt); run make to install it")
    gen = torch.Generator().manual_seed(1)
    position_ids, _ = left_padded_position_ids()
    q, k = (torch.randn(3, 2, 6, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    cos, sin = hf_cos_sin(position_ids, 16)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(hf_apply_rotary_pos_emb(q, k, cos, sin)[0], want_q)  # the re-implementation is faithful
    torch.testing.assert_close(apply_rope(q, position_ids, pairs="half"), want_q)
    torch.testing.assert_close(apply_rope(k, position_ids, pairs="half"), want_k)
    config = llama.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32)
    hf_cos, hf_sin = llama.LlamaRotaryEmbedding(config)(q.float(), position_ids)
    torch.testing.assert_close(hf_cos.double(), cos, rtol=1e-6, atol=1e-6)  # their cos and sin are these
    torch.testing.assert_close(hf_sin.double(), sin, rtol=1e-6, atol=1e-6)
