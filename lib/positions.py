"""Word order inside the dot product: rotary position embeddings and ALiBi (chapter 10).

Attention alone cannot see word order (chapter 2): permuting the tokens permutes the outputs. A learned table of
position vectors added to the tokens is one fix. The two here put the position into the score itself, so that the
score of query i on key j depends on the offset i - j rather than on where the pair sits:

- :func:`apply_rope` rotates each pair of a query's (or key's) coordinates by an angle proportional to its position
  (RoPE, Su et al. 2021). A rotation by a·θ dotted with a rotation by b·θ is a rotation by (a - b)·θ, so
  q_a · k_b depends on the positions only through a - b. Queries and keys are rotated, values never are; keys are
  rotated before they enter a KV cache, and a new token's position is the number of tokens already cached.
- :func:`alibi_bias` adds -slope·(i - j) to the score of query i on key j, a different slope per head (ALiBi, Press
  et al. 2022): a floating mask, added to the scores like the masks of :mod:`lib.attention`, with -inf on the keys
  a causal model may not see.

Shapes as in :mod:`lib.attention`: x (..., L, E), E even; positions (L,), or (B, L) per sequence (read as
(B, 1, L) against split heads (B, H, L, E), never paired with the heads), or (..., L) with x's batch dimensions.
NumPy arrays or torch tensors, answered in kind, dtype kept.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from lib.backend import _is_tensor

__all__ = ["alibi_bias", "alibi_slopes", "apply_rope", "rope_frequencies"]


def _check_base(base):
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 1:
        raise ValueError(f"base must be a number above 1, got {base!r}")
    return float(base)


def rope_frequencies(size, base=10000.0):
    """The angle per position of each coordinate pair, θ_i = base^(-2i/size), i = 0 .. size/2 - 1 (chapter 10).

    Pair 0 turns by one radian per position, the last pair by nearly base^-1: fast pairs tell near positions
    apart, slow pairs far ones. Returned as a float64 NumPy array of size/2 angles.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 2 or size % 2:
        raise ValueError(f"RoPE rotates pairs of coordinates, so the size must be an even integer >= 2; got {size!r}")
    base = _check_base(base)
    return base ** (-np.arange(0, size, 2, dtype=np.float64) / size)  # (size/2,)


PAIRS = ("interleaved", "half")


def apply_rope(x, positions=None, *, offset=0, base=10000.0, pairs="interleaved"):
    """x (..., L, E) with coordinate pairs (2i, 2i+1) of row l rotated by positions[l]·θ_i (chapter 10).

    ``positions`` is (L,), or (B, L) with one row per sequence as Hugging Face's ``position_ids`` (against split
    heads x (B, H, L, E) row b turns every head of sequence b); it defaults to offset, offset + 1, ...,
    offset + L - 1; decoding with a cache passes
    ``offset=len(cache)``, the new tokens' place after those already cached. NumPy or torch, dtype kept (the
    angles are computed in float64 and rounded once).

    ``pairs`` names which coordinates turn together, and a checkpoint fixes it: ``"interleaved"`` (the default)
    pairs adjacent coordinates (2i, 2i+1), as the RoPE paper and Meta's reference Llama code; ``"half"`` pairs
    coordinate i with i + E/2, as Hugging Face's ``rotate_half`` in ``apply_rotary_pos_emb``, which every Llama,
    Mistral or Qwen checkpoint on the Hub expects (their W_Q and W_K rows were permuted for it). The two are the
    same rotation after a fixed permutation of W_Q's and W_K's columns, so a model trained with either is right
    with that one alone; the other gives wrong scores and no error.
    """
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be 'interleaved' (adjacent coordinates, the RoPE paper and Meta's code) or "
                         f"'half' (i with i + E/2, Hugging Face's rotate_half), got {pairs!r}")
    tensor = _is_tensor(x)
    if not tensor:
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"x must hold floating-point numbers, got dtype {x.dtype}")
    elif not x.is_floating_point():
        raise TypeError(f"x must hold floating-point numbers, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, E), at least 2-D; got shape {tuple(x.shape)}")
    L, E = x.shape[-2], x.shape[-1]
    if E < 2 or E % 2:
        raise ValueError(f"x has E={E} coordinates (shape {tuple(x.shape)}): RoPE rotates pairs, so E must be even")
    theta = rope_frequencies(E, base)  # (E/2,)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"offset must be a whole number of tokens >= 0, got {offset!r}")
    if positions is None:
        pos = np.arange(offset, offset + L, dtype=np.float64)  # (L,)
    else:
        if offset:
            raise ValueError("give positions or offset, not both")
        pos = positions.detach().cpu().numpy() if _is_tensor(positions) else np.asarray(positions)
        if not np.issubdtype(pos.dtype, np.integer):
            raise TypeError(f"positions must be integers, got dtype {pos.dtype}")
        if pos.ndim == 0 or pos.shape[-1] != L:
            raise ValueError(f"positions must have shape (L,) or (B, L) with L={L} (the rows of x); got {pos.shape}")
        pos = _per_sequence(pos, tuple(x.shape)).astype(np.float64)
    if tensor:
        import torch

        angles = pos[..., :, None] * theta  # (..., L, E/2), float64 on the CPU (MPS has no float64)
        cos = torch.from_numpy(np.cos(angles)).to(x.dtype).to(x.device)
        sin = torch.from_numpy(np.sin(angles)).to(x.dtype).to(x.device)
        if pairs == "half":
            first, second = x[..., : E // 2], x[..., E // 2 :]  # (..., L, E/2) each: coordinates i and i + E/2
            return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)  # (..., L, E)
        even, odd = x[..., 0::2], x[..., 1::2]  # (..., L, E/2) each: the two coordinates of every pair
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)  # (..., L, E)
    angles = pos[..., :, None] * theta  # (..., L, E/2)
    cos, sin = np.cos(angles), np.sin(angles)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    if pairs == "half":
        first, second = x[..., : E // 2], x[..., E // 2 :]
        return np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)  # (..., L, E)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = np.stack((even * cos - odd * sin, even * sin + odd * cos), axis=-1)  # (..., L, E/2, 2)
    return rotated.reshape(*rotated.shape[:-2], E)  # (..., L, E)


def _per_sequence(pos, shape):
    """positions (L,), (B, L) or (..., L) laid out against x of ``shape`` (..., L, E).

    (B, L) holds one row of positions per sequence, as Hugging Face's ``position_ids``: against split heads x
    (B, H, L, E) it is read as (B, 1, L), sequence b's positions on every head of sequence b, never right-aligned
    into the heads axis. Positions with every batch dimension of x, (..., L), are taken as they are; any other
    rank is ambiguous and refused."""
    batch = shape[:-2]
    if pos.ndim == 2 and len(batch) >= 2:  # (B, L) against (B, H, ..., L, E): one row per sequence
        pos = pos.reshape((pos.shape[0],) + (1,) * (len(batch) - 1) + (pos.shape[1],))
    elif 2 < pos.ndim < len(batch) + 1:
        raise ValueError(f"positions of shape {pos.shape} against x of shape {shape} are ambiguous: give (L,), "
                         f"(B, L) with one row per sequence, or (..., L) with every batch dimension of x {batch}")
    try:
        np.broadcast_shapes(pos.shape, shape[:-1])
    except ValueError:
        raise ValueError(f"positions of shape {pos.shape} do not fit x of shape {shape}: give (L,), (B, L) with B "
                         f"= {shape[0]} sequences, or (..., L) with the batch dimensions of x") from None
    return pos


def alibi_slopes(n_heads):
    """ALiBi's slope per head: 2^(-8/n), 2^(-16/n), ..., 2^(-8) for n heads, a power of two (chapter 10).

    For other head counts the paper takes the slopes of the power of two below and fills in every other slope of
    the power of two above; so does this function. Float64 NumPy array of n_heads slopes.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, numbers.Integral) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")

    def powers_of_two(n):
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    below = 2 ** int(math.log2(n_heads))
    if below == n_heads:
        return powers_of_two(n_heads)
    extra = powers_of_two(2 * below)[0::2][: n_heads - below]
    return np.concatenate([powers_of_two(below), extra])


def alibi_bias(n_heads, L, S=None, *, like=None):
    """The ALiBi scores' bias (H, L, S): -slope_h·(i - j) where key j may be seen, -inf where not (chapter 10).

    Query i is token S - L + i (aligned bottom-right, as a decode step with a cache needs), and may see keys
    j <= S - L + i. Add it to the scores as a floating mask: ``attn.attention(q, k, v, alibi_bias(H, L, S))``
    with q (..., H, L, E). ``like`` gives a torch tensor's dtype and device; NumPy float64 otherwise.
    """
    S = L if S is None else S
    for name, n in (("L", L), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    if L > S:
        raise ValueError(f"L={L} queries after S={S} keys: bottom-right alignment needs L <= S")
    i = np.arange(S - L, S)[:, None]  # (L, 1): each query's position in the sequence
    j = np.arange(S)[None, :]  # (1, S)
    distance = (i - j).astype(np.float64)  # (L, S)
    bias = -alibi_slopes(n_heads)[:, None, None] * distance  # (H, L, S)
    bias = np.where(j <= i, bias, -np.inf)
    if like is None:
        return bias
    if isinstance(like, np.ndarray):
        if like.dtype.kind != "f":
            raise TypeError(f"like must hold floating-point numbers (the bias is -inf where a key is hidden), "
                            f"got dtype {like.dtype}")
        return bias.astype(like.dtype)
    if not _is_tensor(like):
        raise TypeError(f"like must be a NumPy array or a torch tensor whose dtype and device the bias takes, got "
                        f"{type(like).__module__}.{type(like).__qualname__} (for a dtype d, pass "
                        "like=torch.empty(0, dtype=d))")
    if not like.is_floating_point():
        raise TypeError(f"like must hold floating-point numbers (the bias is -inf where a key is hidden), got dtype "
                        f"{like.dtype}")
    import torch

    return torch.as_tensor(bias, device=like.device).to(like.dtype)
