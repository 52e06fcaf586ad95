"""A decoder you can run: rotary attention, a pre-norm residual block, a tiny language model, and ``generate``.

Chapter 10 builds these from the library's parts: the heads of :class:`lib.nn.TorchMultiHeadAttention`, the
rotary positions of :mod:`lib.positions`, and one :class:`lib.decoding.KVCache` per layer. Everything is causal
(a decoder), so a new token's keys and values never change once computed and decoding with a cache gives the same
logits as running the whole sequence again; :func:`generate` does either, and the tests check that they agree.

Shapes: ``B`` sequences, ``L`` new tokens, ``S`` tokens the keys cover (S = L without a cache), ``D`` = d_model,
``H`` query heads, ``Hkv`` key/value heads, ``d`` = D / H, ``V`` the vocabulary size. torch only.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn
from torch.nn import functional as F

from lib import attention as attn
from lib.decoding import KVCache
from lib.modules import merge_heads, split_heads
from lib.nn import TorchMultiHeadAttention
from lib.positions import apply_rope

__all__ = ["MLP", "CausalSelfAttention", "DecoderBlock", "TinyLM", "generate"]


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class CausalSelfAttention(TorchMultiHeadAttention):
    """Causal multi-head self-attention with RoPE on queries and keys: x (B, L, D) -> (B, L, D) (chapter 10).

    :class:`lib.nn.TorchMultiHeadAttention` with ``causal=True`` and, with ``rope=True``, a ``rotate`` hook that
    turns queries and keys by their positions before the keys enter the cache (:func:`lib.positions.apply_rope`),
    so a cached key keeps the rotation of the position it was computed at; with a cache the new tokens' positions
    start at ``len(cache)``. The new queries are the last L of the S tokens, aligned bottom-right; the module's
    SDPA call passes no mask for one new token, ``is_causal`` when L = S and ``causal_lower_right(L, S)``
    otherwise (:func:`lib.nn.sdpa_arguments`).

    ``ablated`` is a set of head indices whose output is replaced by its mean over the batch and positions before
    W_O (mean ablation): what the model does without what that head computes for each token.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, rope=True, base=10000.0, device=None, dtype=None):
        super().__init__(d_model, n_heads, n_kv_heads, device=device, dtype=dtype)
        if self.d_head % 2 and rope:
            raise ValueError(f"RoPE rotates pairs of coordinates: d_head={self.d_head} must be even")
        self.rope, self.base = bool(rope), base
        self.ablated = set()

    def extra_repr(self):
        return super().extra_repr() + f", rope={self.rope}"

    def _rotate(self, t, start):
        return apply_rope(t, offset=start, base=self.base)  # start: the position of the first new token

    def forward(self, x, *, cache=None, return_weights=False):
        """Output (B, L, D), and the weights (B, H, L, S) too with ``return_weights=True``."""
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (B, L, {self.d_model}), got {shape}")
        rotate = self._rotate if self.rope else None
        if not self.ablated:
            return super().forward(x, causal=True, cache=cache, rotate=rotate, return_weights=return_weights)
        return self._ablated(x, cache, rotate, return_weights)

    def _ablated(self, x, cache, rotate, return_weights):
        """The same attention computed head by head, with the ablated heads' outputs replaced by their means."""
        q = split_heads(x @ self.w_q, self.n_heads)  # (B, H, L, d)
        k = split_heads(x @ self.w_k, self.n_kv_heads)  # (B, Hkv, L, d)
        v = split_heads(x @ self.w_v, self.n_kv_heads)  # (B, Hkv, L, d)
        if rotate is not None:  # before the cache, as the module's own path does
            start = 0 if cache is None else len(cache)
            q, k = rotate(q, start), rotate(k, start)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, d): every token so far
        L, S = q.shape[-2], k.shape[-2]
        group = self.n_heads // self.n_kv_heads
        k_all, v_all = (t.repeat_interleave(group, dim=-3) for t in (k, v))  # (B, H, S, d)
        scores = q @ k_all.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, L, S)
        allowed = attn.causal_mask(L, S, like=scores, align="bottom-right")  # (L, S)
        weights = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
        out = (weights @ v_all).clone()  # (B, H, L, d)
        for h in self.ablated:
            out[:, h] = out[:, h].mean(dim=(0, 1), keepdim=True)  # the head's average output, whatever the token
        out = merge_heads(out) @ self.w_o  # (B, L, D)
        return (out, weights) if return_weights else out


class MLP(nn.Module):
    """The feed-forward half of a block: Linear(D, d_ff), GELU, Linear(d_ff, D), applied to each token (chapter 10)."""

    def __init__(self, d_model, d_ff, *, device=None, dtype=None):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))  # (B, L, D), via (B, L, d_ff)


class DecoderBlock(nn.Module):
    """A pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)) (chapter 10).

    Pre-norm (the norm inside the branch, as GPT-2 and Llama place it) leaves the residual stream a plain sum of
    what every branch wrote, which is what lets one layer's head read another's output. ``d_ff=0`` drops the MLP,
    giving an attention-only block.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, d_ff=None, rope=True, device=None, dtype=None):
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else _check_int("d_ff", d_ff, 0)
        self.norm_attention = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.attention = CausalSelfAttention(d_model, n_heads, n_kv_heads, rope=rope, device=device, dtype=dtype)
        self.norm_mlp = nn.LayerNorm(d_model, device=device, dtype=dtype) if d_ff else None
        self.mlp = MLP(d_model, d_ff, device=device, dtype=dtype) if d_ff else None

    def forward(self, x, *, cache=None, return_weights=False):
        """x (B, L, D) -> (B, L, D), and the attention weights (B, H, L, S) with ``return_weights=True``."""
        mixed = self.attention(self.norm_attention(x), cache=cache, return_weights=return_weights)
        mixed, weights = mixed if return_weights else (mixed, None)
        x = x + mixed  # (B, L, D): the residual stream
        if self.mlp is not None:
            x = x + self.mlp(self.norm_mlp(x))
        return (x, weights) if return_weights else x


class TinyLM(nn.Module):
    """A decoder-only language model: tokens (B, L) -> next-token logits (B, L, V) (chapter 10).

    Token embedding, ``n_layers`` :class:`DecoderBlock`, a final LayerNorm and a linear read-out to the
    vocabulary. Positions enter only through RoPE in every attention layer. With ``caches`` (one
    :class:`KVCache` per layer) only the new tokens are run, at positions after those cached.
    """

    def __init__(self, vocab, d_model, n_layers, n_heads, n_kv_heads=None, *, d_ff=None, rope=True,
                 device=None, dtype=None):
        super().__init__()
        self.vocab = _check_int("vocab", vocab, 1)
        self.d_model = _check_int("d_model", d_model, 1)
        _check_int("n_layers", n_layers, 1)
        self.embed = nn.Embedding(vocab, d_model, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, n_heads, n_kv_heads, d_ff=d_ff, rope=rope, device=device, dtype=dtype)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.unembed = nn.Linear(d_model, vocab, bias=False, device=device, dtype=dtype)

    def new_caches(self, capacity):
        """One empty :class:`KVCache` per layer, room for ``capacity`` tokens (the first append sizes it)."""
        return [KVCache(capacity) for _ in self.blocks]

    def forward(self, tokens, *, caches=None, return_weights=False):
        """Logits (B, L, V); with ``return_weights=True`` also a list of each layer's weights (B, H, L, S)."""
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.is_floating_point():
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer tensor of shape (B, L), got {shape}")
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"the model has {len(self.blocks)} layers but {len(caches)} caches were given: one each")
        x = self.embed(tokens)  # (B, L, D)
        maps = []
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = block(x, cache=cache, return_weights=return_weights)
            if return_weights:
                x, weights = x
                maps.append(weights)
        logits = self.unembed(self.norm(x))  # (B, L, V)
        return (logits, maps) if return_weights else logits


@torch.no_grad()
def generate(model, prompt, n_new, *, use_cache=True, temperature=0.0, generator=None):
    """Extend ``prompt`` (B, P) by ``n_new`` tokens; return the tokens (B, P + n_new) and each step's logits.

    The logits are a list of ``n_new`` tensors (B, V), step t's prediction of token P + t. With ``use_cache`` the
    prompt is run once into one :class:`KVCache` per layer and each later step runs the newest token alone;
    without, every step runs the whole sequence again. Both give the same logits. ``temperature=0`` picks the
    most likely token (greedy); above 0 it samples from softmax(logits / temperature) with ``generator``.
    """
    if not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError("prompt must be an integer tensor of shape (B, P) with P >= 1")
    _check_int("n_new", n_new, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    tokens, steps = prompt, []
    caches = model.new_caches(prompt.shape[1] + n_new) if use_cache else None
    new = prompt
    for _ in range(n_new):
        logits = model(new if use_cache else tokens, caches=caches)[:, -1]  # (B, V): the prediction of the next
        steps.append(logits)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            probs = (logits / temperature).softmax(dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        new = nxt
    return tokens, steps
