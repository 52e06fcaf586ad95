"""The formula as models changed it (chapter 13): sinks, sliding windows, latent attention, linear attention.

Each variant changes one term of softmax(q kᵀ · scale) v:

========================  ==================================================================================
sinks                     the softmax's denominator gains a logit with no value (:func:`sink_attention`)
sliding windows           the mask becomes a band of ``window`` keys (:func:`sliding_window_mask`,
                          :class:`RollingKVCache`; the tiled and Triton kernels take ``window=``)
latent attention          k and v are rebuilt from a shared low-rank latent (:class:`LatentAttention`)
linear attention          exp(q·k) becomes φ(q)·φ(k), so the sum over keys folds into a d × d state
                          (:func:`linear_attention`, :func:`linear_attention_recurrent`,
                          :func:`linear_attention_chunked`)
========================  ==================================================================================

:func:`masked_forward` runs chapter 11's :class:`lib.model.TinyLM` with any mask (an evicted cache is one) and
optional per-head sink logits; :class:`RecallNet` is the one-layer associative-recall model that compares
softmax with linear attention at one size. Shapes as in :mod:`lib.attention`: ``...`` batch dims, ``H`` heads,
``L`` queries, ``S`` keys, ``E`` query/key size, ``Ev`` value size. torch only. A boolean mask is True where a
query may attend, as in ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn
from torch.nn import functional as F

from lib.backend import _check_causal
from lib.positions import apply_rope

__all__ = [
    "LatentAttention",
    "RecallNet",
    "RollingKVCache",
    "elu_feature",
    "linear_attention",
    "linear_attention_chunked",
    "linear_attention_recurrent",
    "lookup_batch",
    "masked_forward",
    "recall_batch",
    "sink_attention",
    "sliding_window_mask",
    "streaming_keep",
    "streaming_mask",
]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _tensor(name, x, ndim=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


# --------------------------------------------------------------------------------------------------------------
# Sinks: a softmax that may attend nothing
# --------------------------------------------------------------------------------------------------------------


def _sink_column(sink, scores):
    """The sink logit of each head as a column (..., H, L, 1) that broadcasts against scores (..., H, L, S)."""
    if isinstance(sink, numbers.Real) and not isinstance(sink, bool):
        return scores.new_full(scores.shape[:-1] + (1,), float(sink))
    _tensor("sink", sink)
    H = scores.shape[-3] if scores.ndim >= 3 else None
    if sink.ndim != 1 or sink.shape[0] != H:
        raise ValueError(
            f"sink holds one logit per head: shape ({H},) for scores {tuple(scores.shape)} (..., H, L, S), "
            f"got {tuple(sink.shape)}; a sink is an extra key, so it lives on the head axis, not on L or S"
        )
    return sink.to(scores.dtype)[:, None, None].expand(scores.shape[:-1] + (1,))


def sink_attention(q, k, v, sink=0.0, *, causal=True, mask=None, return_weights=False):
    """Attention whose softmax has one more logit, ``sink``, that carries no value (chapter 13).

    q (..., H, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> (..., H, L, Ev). The weights are
    exp(s_j) / (exp(sink) + Σ exp(s_j)), so a row sums to less than 1 and a head can put weight on "nothing".
    ``sink=0.0`` is the off-by-one softmax (an extra zero logit); a tensor of shape (H,) is one learned logit per
    head, as gpt-oss ships. Hkv may divide H (grouped-query heads, as gpt-oss): query head h reads key/value head
    h // (H / Hkv), as SDPA's ``enable_gqa``. ``causal`` follows the library's one rule: True (the default) or
    ``"top-left"``, query i attends keys j <= i; ``"bottom-right"``, the L queries are the last L of the S
    tokens (what new queries after a cache need); False, no causal pattern. ``mask`` is boolean (..., L, S), True
    where a query may attend. With ``return_weights`` also returns the weights (..., H, L, S) and the weight
    each row gave the sink (..., H, L).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x, 3)
    H, Hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != Hkv or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (..., Hkv, S)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of the {Hkv} key/value heads of k and v: each key/value "
                         "head must serve the same number of query heads")
    if Hkv != H:  # grouped-query heads: each key/value head serves H / Hkv query heads
        k, v = k.repeat_interleave(H // Hkv, dim=-3), v.repeat_interleave(H // Hkv, dim=-3)  # (..., H, S, ·)
    L, S = q.shape[-2], k.shape[-2]
    offset = _check_causal(causal, L, S)  # None, or the diagonal's offset: True is top-left
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., H, L, S)
    allowed = None
    if offset is not None:
        allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(offset)  # (L, S)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    column = _sink_column(sink, scores)  # (..., H, L, 1)
    weights = torch.cat([column, scores], dim=-1).softmax(dim=-1)  # (..., H, L, 1 + S)
    out = weights[..., 1:] @ v  # (..., H, L, Ev): the sink's value is zero
    return (out, weights[..., 1:], weights[..., 0]) if return_weights else out


def streaming_keep(n_tokens, window, n_sink=0):
    """Positions a StreamingLLM cache keeps after ``n_tokens``: the first ``n_sink`` and the last ``window``."""
    n_tokens, window = _positive_int("n_tokens", n_tokens), _positive_int("window", window)
    if isinstance(n_sink, bool) or not isinstance(n_sink, numbers.Integral) or n_sink < 0:
        raise ValueError(f"n_sink must be an integer >= 0, got {n_sink!r}")
    recent = range(max(0, n_tokens - window), n_tokens)
    return sorted(set(range(min(n_sink, n_tokens))) | set(recent))


def streaming_mask(n, window, n_sink=0, *, device=None):
    """Boolean (n, n): query i sees the keys its StreamingLLM cache still holds, the first ``n_sink`` tokens and
    the last ``window`` (i - window < j <= i). ``n_sink=0`` is a plain sliding window."""
    band = sliding_window_mask(n, n, _positive_int("window", window), device=device)
    if isinstance(n_sink, bool) or not isinstance(n_sink, numbers.Integral) or n_sink < 0:
        raise ValueError(f"n_sink must be an integer >= 0, got {n_sink!r}")
    band[:, :n_sink] = True
    return band.tril()  # (n, n): never the future


def lookup_batch(gen, size, n_tokens=24, n_symbols=64, max_gap=8, p_repeat=0.3):
    """The task chapter 13 trains on: at every position, the token that followed this token's last earlier
    occurrence, or ``none`` when it has none.

    Token 0 is a fixed BOS (``n_symbols``); the others are distinct symbols except that, with probability
    ``p_repeat``, a position repeats the token 2 to ``max_gap - 1`` places back, so that every answer lies within
    the last ``max_gap`` tokens. Returns tokens (size, n_tokens) and targets (size, n_tokens); the answer "none"
    is ``n_symbols + 1``. The vocabulary is ``n_symbols + 2``.
    """
    if n_tokens - 1 > n_symbols:
        raise ValueError(f"n_tokens={n_tokens} needs n_symbols >= n_tokens - 1 distinct symbols, got {n_symbols}")
    bos, none = n_symbols, n_symbols + 1
    tokens = torch.rand(size, n_symbols, generator=gen).argsort(-1)[:, :n_tokens].clone()  # distinct symbols
    tokens[:, 0] = bos
    repeat = torch.rand(size, n_tokens, generator=gen) < p_repeat
    gap = torch.randint(2, max_gap, (size, n_tokens), generator=gen)
    for p in range(3, n_tokens):
        src = (p - gap[:, p]).clamp(min=1)
        tokens[repeat[:, p], p] = tokens[repeat[:, p], src[repeat[:, p]]]
    same = (tokens[:, :, None] == tokens[:, None, :]).tril(-1)  # (size, n, n): an earlier equal token
    same[:, :, 0] = False  # BOS is no symbol
    last = torch.where(same, torch.arange(n_tokens), -1).amax(-1)  # (size, n): -1 where none
    after = tokens.gather(1, (last + 1).clamp(min=0))
    return tokens, torch.where(last >= 0, after, torch.full_like(after, none))


def masked_forward(model, tokens, mask=None, *, sinks=None, attend=None, return_weights=False):
    """Chapter 11's :class:`lib.model.TinyLM` run with its own weights under any boolean ``mask`` (L, L).

    The same computation as ``model(tokens)`` (a test checks it), written out so that the mask can be an evicted
    cache (:func:`streaming_mask`), ``sinks`` (n_layers, H) can add a learned sink logit per head, and ``attend``
    (q, k, v, allowed) -> out can replace softmax attention altogether. ``mask=None`` is causal. Keys keep the
    positions they had in the text (RoPE sees true distances). Returns logits (B, L, V), and with
    ``return_weights`` each layer's weights (B, H, L, L).
    """
    L = tokens.shape[-1]
    allowed = torch.ones(L, L, dtype=torch.bool).tril() if mask is None else mask  # (L, L)
    if allowed.shape != (L, L) or allowed.dtype != torch.bool:
        raise ValueError(f"mask must be boolean ({L}, {L}) for {L} tokens, got {allowed.dtype} "
                         f"{tuple(allowed.shape)}")
    if sinks is not None and (sinks.ndim != 2 or sinks.shape[0] != len(model.blocks)):
        raise ValueError(f"sinks must be (n_layers, H) = ({len(model.blocks)}, H), got {tuple(sinks.shape)}")
    x = model.embed(tokens)  # (B, L, D)
    maps = []
    for i, block in enumerate(model.blocks):
        a = block.attention
        h = block.norm_attention(x)
        q = (h @ a.w_q).unflatten(-1, (a.n_heads, -1)).transpose(1, 2)  # (B, H, L, d)
        k = (h @ a.w_k).unflatten(-1, (a.n_kv_heads, -1)).transpose(1, 2)  # (B, Hkv, L, d)
        v = (h @ a.w_v).unflatten(-1, (a.n_kv_heads, -1)).transpose(1, 2)  # (B, Hkv, L, d)
        if a.rope:
            q, k = apply_rope(q, base=a.base), apply_rope(k, base=a.base)
        group = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, L, d)
        if attend is not None:
            heads = attend(q, k, v, allowed)
        else:
            sink = -math.inf if sinks is None else sinks[i]
            heads, weights, _ = sink_attention(q, k, v, sink, causal=False, mask=allowed, return_weights=True)
            maps.append(weights)
        x = x + heads.transpose(1, 2).flatten(-2) @ a.w_o  # (B, L, D)
        if block.mlp is not None:
            x = x + block.mlp(block.norm_mlp(x))
    logits = model.unembed(model.norm(x))  # (B, L, V)
    return (logits, maps) if return_weights else logits


# --------------------------------------------------------------------------------------------------------------
# Sliding windows: a band of keys, and a cache that stops growing
# --------------------------------------------------------------------------------------------------------------


def sliding_window_mask(L, S=None, window=None, *, align="top-left", device=None):
    """Boolean (L, S), True where query i may attend key j: the last ``window`` keys up to its own position.

    Aligned as :func:`lib.attention.causal_mask` and the window kernels (``tiled_attention(..., window=)``,
    ``flash_attention(..., window=)``) with ``causal=True``: ``align="top-left"`` (the default) puts query i at
    position p = i; ``align="bottom-right"`` makes the L queries the last L of the S tokens, p = i + S - L (what
    new queries after a cache need, as :class:`RollingKVCache` returns its keys; it needs L <= S). Query i sees
    keys p - window < j <= p: ``window`` keys, itself included. The two agree when L == S. Conventions differ by
    one: Mistral's paper writes its window W as the positions from p - W to p, which read literally is W + 1 keys.
    ``window >= S`` is the plain causal mask.
    """
    S = L if S is None else S
    L, S = _positive_int("L", L), _positive_int("S", S)
    window = _positive_int("window", window)
    if align not in ("top-left", "bottom-right"):
        raise ValueError(f"align must be 'top-left' or 'bottom-right', got {align!r}")
    if align == "bottom-right" and L > S:
        raise ValueError(f"align='bottom-right' makes the L={L} queries the last of S={S} tokens, so L must be <= S")
    first = S - L if align == "bottom-right" else 0
    p = torch.arange(first, first + L, device=device)[:, None]  # (L, 1): each query's position
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    return (j <= p) & (j > p - window)  # (L, S)


class RollingKVCache:
    """A key-value cache of ``window`` slots, written round-robin: memory stops growing at ``window`` tokens.

    Token t goes to slot t mod window, overwriting token t - window, which the band mask no longer lets anyone
    see. ``append(k, v)`` takes T new tokens, (..., T, E) and (..., T, Ev), any T (one decode step, a chunk of a
    chunked prefill, a whole prompt longer than the window), and returns the keys and values the T new queries
    may attend, in order of position: the last ``window - 1`` tokens before them (fewer at the start) and the T
    new ones. Their positions are :attr:`positions` (``append(..., return_positions=True)`` returns them too), so
    ``sliding_window_mask(T, n, window, align="bottom-right")`` over the n keys returned gives exactly the band
    mask's answer. For T = 1 that is at most ``window`` keys, all in the window, and no mask is needed. Only
    the last ``window`` tokens are kept between calls; ``nbytes`` counts the buffers.
    """

    def __init__(self, window):
        self.window = _positive_int("window", window)
        self.k = self.v = None
        self.length = 0  # tokens seen so far
        self.positions = torch.arange(0)  # the positions of the keys the last append returned

    def __len__(self):
        return self.length

    @property
    def nbytes(self):
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def _held(self, n):
        """The last n tokens held, in order of position: (..., n, E), (..., n, Ev)."""
        slots = torch.arange(self.length - n, self.length, device=self.k.device) % self.window
        return self.k.index_select(-2, slots), self.v.index_select(-2, slots)

    def append(self, k, v, *, return_positions=False):
        _tensor("k", k, 2), _tensor("v", v, 2)
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same (..., T)")
        if self.k is not None and (k.shape[:-2] != self.k.shape[:-2] or k.shape[-1] != self.k.shape[-1]
                                   or v.shape[-1] != self.v.shape[-1]):
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match the cache's (..., T, E) = "
                             f"{tuple(self.k.shape[:-2])} + (T, {self.k.shape[-1]}) and Ev={self.v.shape[-1]}")
        T = k.shape[-2]
        if self.k is None:
            self.k = k.new_zeros(k.shape[:-2] + (self.window, k.shape[-1]))  # (..., W, E)
            self.v = v.new_zeros(v.shape[:-2] + (self.window, v.shape[-1]))  # (..., W, Ev)
        older = min(self.length, self.window - 1)  # the first new query's window reaches this far back
        old_k, old_v = self._held(older)
        keys, values = torch.cat([old_k, k], dim=-2), torch.cat([old_v, v], dim=-2)  # (..., older + T, ·)
        start = self.length - older
        self.positions = torch.arange(start, self.length + T, device=k.device)
        kept = min(T, self.window)  # of the new tokens, only the last window survive this call
        slots = torch.arange(self.length + T - kept, self.length + T, device=k.device) % self.window
        self.k[..., slots, :] = k[..., T - kept:, :]
        self.v[..., slots, :] = v[..., T - kept:, :]
        self.length += T
        return (keys, values, self.positions) if return_positions else (keys, values)


# --------------------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2): keys and values from one shared latent
# --------------------------------------------------------------------------------------------------------------


class LatentAttention(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2's MLA), x (B, L, D) -> (B, L, D) (chapter 13).

    Each token is compressed to one latent c = x W_dkv of ``d_latent`` numbers, shared by all heads; head h's
    keys and values are rebuilt from it, k_h = c W_uk[h] (``d_nope``) and v_h = c W_uv[h] (``d_v``). Rotary
    positions cannot pass through that product (a rotation between q and W_uk would depend on both positions),
    so a separate ``d_rope`` part of every key, k_r = RoPE(x W_kr), is shared by the heads, and each query has a
    matching rotated part. Score = q_nope·k_nope + q_rope·k_rope, scaled by 1/sqrt(d_nope + d_rope).

    :meth:`forward` is the naive form (builds every k and v). :meth:`decode` is the absorbed form: it caches only
    (c, k_r), d_latent + d_rope numbers a token for all heads, and folds W_uk into the query and W_uv into the
    output, so it never rebuilds k or v. (DeepSeek-V2 also compresses the queries; that saves no cache and is
    left out.)
    """

    def __init__(self, d_model, n_heads, d_latent, d_nope, d_rope, d_v):
        super().__init__()
        for name, n in (("d_model", d_model), ("n_heads", n_heads), ("d_latent", d_latent), ("d_nope", d_nope),
                        ("d_rope", d_rope), ("d_v", d_v)):
            _positive_int(name, n)
        if d_rope % 2:
            raise ValueError(f"RoPE rotates pairs of coordinates: d_rope={d_rope} must be even")
        self.H, self.d_latent, self.d_nope, self.d_rope, self.d_v = n_heads, d_latent, d_nope, d_rope, d_v

        def weight(*shape):
            return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[0]))

        self.w_q = weight(d_model, n_heads * (d_nope + d_rope))
        self.w_dkv = weight(d_model, d_latent)  # down: the latent every head shares
        self.w_uk = weight(d_latent, n_heads * d_nope)  # up: keys from the latent
        self.w_uv = weight(d_latent, n_heads * d_v)  # up: values from the latent
        self.w_kr = weight(d_model, d_rope)  # the decoupled rotary key, one for all heads
        self.w_o = weight(n_heads * d_v, d_model)

    def _queries(self, x, start):
        q = (x @ self.w_q).unflatten(-1, (self.H, -1)).transpose(1, 2)  # (B, H, L, d_nope + d_rope)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        return q_nope, apply_rope(q_rope, offset=start)

    def latent(self, x, start=0):
        """What the cache keeps for tokens x (B, L, D) at positions start, ...: c (B, L, d_latent), k_r (B, L, d_rope)."""
        return x @ self.w_dkv, apply_rope(x @ self.w_kr, offset=start)

    def forward(self, x):
        """The naive form: rebuild k (B, H, L, d_nope + d_rope) and v (B, H, L, d_v), then SDPA, causal."""
        c, k_rope = self.latent(x)
        q_nope, q_rope = self._queries(x, 0)
        k_nope = (c @ self.w_uk).unflatten(-1, (self.H, -1)).transpose(1, 2)  # (B, H, L, d_nope)
        v = (c @ self.w_uv).unflatten(-1, (self.H, -1)).transpose(1, 2)  # (B, H, L, d_v)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, self.H, -1, -1)], dim=-1)  # (B, H, L, d_nope + d_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, d_v)
        return out.transpose(1, 2).flatten(-2) @ self.w_o  # (B, L, D)

    def decode(self, x, cache=None):
        """The absorbed form for new tokens x (B, T, D) after ``cache`` = (c, k_r) or None; returns (out, cache).

        Scores: q_nope·(c W_uk[h]) = (q_nope W_uk[h]ᵀ)·c, so each head's query is moved into latent space once
        and dotted with the cached latents. Output: Σ_j w_j (c_j W_uv[h]) = (Σ_j w_j c_j) W_uv[h]. So every head
        reads the same cached vectors: the key [c, k_r] (d_latent + d_rope wide) and the value c (d_latent wide).
        This is multi-query attention with one wide key/value head, and it runs as SDPA with that one head.
        """
        if cache is not None and (cache[0].shape[-1] != self.d_latent or cache[1].shape[-1] != self.d_rope):
            raise ValueError(f"the cache holds latents of {cache[0].shape[-1]} and rotary keys of "
                             f"{cache[1].shape[-1]}; this layer has d_latent={self.d_latent}, d_rope={self.d_rope}")
        start = 0 if cache is None else cache[0].shape[-2]
        c_new, kr_new = self.latent(x, start)
        c, k_rope = (c_new, kr_new) if cache is None else (
            torch.cat([cache[0], c_new], dim=-2), torch.cat([cache[1], kr_new], dim=-2))  # (B, S, ·)
        q_nope, q_rope = self._queries(x, start)  # (B, H, T, ·)
        w_uk = self.w_uk.unflatten(-1, (self.H, self.d_nope)).permute(1, 2, 0)  # (H, d_nope, d_latent)
        q_shared = torch.cat([q_nope @ w_uk, q_rope], dim=-1)  # (B, H, T, d_latent + d_rope): W_uk absorbed
        k_shared = torch.cat([c, k_rope], dim=-1)[:, None]  # (B, 1, S, d_latent + d_rope): one head for all
        v_shared = c[:, None]  # (B, 1, S, d_latent): the latent is also the value
        T, S = x.shape[-2], c.shape[-2]
        allowed = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)  # bottom-right
        mixed = F.scaled_dot_product_attention(  # (B, H, T, d_latent): the weighted latent
            q_shared, k_shared.expand(-1, self.H, -1, -1), v_shared.expand(-1, self.H, -1, -1),
            attn_mask=allowed, scale=1 / math.sqrt(self.d_nope + self.d_rope))  # expand: views, no copies
        w_uv = self.w_uv.unflatten(-1, (self.H, self.d_v)).transpose(0, 1)  # (H, d_latent, d_v)
        out = mixed @ w_uv  # (B, H, T, d_v): W_uv applied after the sum
        return out.transpose(1, 2).flatten(-2) @ self.w_o, (c, k_rope)


# --------------------------------------------------------------------------------------------------------------
# Linear attention (Katharopoulos et al. 2020): a feature map instead of exp, a d × d state instead of a cache
# --------------------------------------------------------------------------------------------------------------


def elu_feature(x):
    """φ(x) = elu(x) + 1, positive everywhere: Katharopoulos et al.'s feature map."""
    return F.elu(x) + 1


def _linear_inputs(q, k, v, feature):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x, 2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k has E={k.shape[-1]} but q has E={q.shape[-1]}")
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"causal linear attention needs L = S: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    return feature(q), feature(k)


def linear_attention(q, k, v, feature=elu_feature, eps=1e-6):
    """Causal linear attention, quadratic form: out_i = Σ_{j<=i} (φq_i·φk_j) v_j / Σ_{j<=i} φq_i·φk_j.

    q, k (..., L, E), v (..., L, Ev) -> (..., L, Ev). The (L, L) matrix is built, as softmax attention's is.
    """
    fq, fk = _linear_inputs(q, k, v, feature)
    scores = (fq @ fk.transpose(-2, -1)).tril()  # (..., L, L), the future zeroed
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


def linear_attention_recurrent(q, k, v, feature=elu_feature, eps=1e-6):
    """The same, one token at a time through a state: S_t = S_{t-1} + φk_t v_tᵀ (E × Ev), z_t = z_{t-1} + φk_t.

    out_t = (φq_t S_t) / (φq_t · z_t). The state has the same size after 10 tokens or 10 million.
    """
    fq, fk = _linear_inputs(q, k, v, feature)
    state = fq.new_zeros(fq.shape[:-2] + (fq.shape[-1], v.shape[-1]))  # (..., E, Ev)
    z = fq.new_zeros(fq.shape[:-2] + (fq.shape[-1],))  # (..., E)
    outs = []
    for t in range(q.shape[-2]):
        state = state + fk[..., t, :, None] * v[..., t, None, :]  # (..., E, Ev)
        z = z + fk[..., t, :]
        num = (fq[..., t, None, :] @ state)[..., 0, :]  # (..., Ev)
        outs.append(num / ((fq[..., t, :] * z).sum(-1, keepdim=True) + eps))
    return torch.stack(outs, dim=-2)  # (..., L, Ev)


def linear_attention_chunked(q, k, v, chunk, feature=elu_feature, eps=1e-6):
    """The same in chunks of ``chunk`` tokens: quadratic inside a chunk, the state carried between chunks.

    What training kernels do: matrix products of (chunk, chunk) tiles, and one state update per chunk.
    """
    chunk = _positive_int("chunk", chunk)
    fq, fk = _linear_inputs(q, k, v, feature)
    state = fq.new_zeros(fq.shape[:-2] + (fq.shape[-1], v.shape[-1]))  # (..., E, Ev)
    z = fq.new_zeros(fq.shape[:-2] + (1, fq.shape[-1]))  # (..., 1, E)
    outs = []
    for c0 in range(0, q.shape[-2], chunk):
        cq, ck, cv = (t[..., c0:c0 + chunk, :] for t in (fq, fk, v))
        inner = (cq @ ck.transpose(-2, -1)).tril()  # (..., C, C): inside the chunk
        num = cq @ state + inner @ cv  # (..., C, Ev): earlier chunks through the state
        den = (cq * z).sum(-1, keepdim=True) + inner.sum(-1, keepdim=True)  # (..., C, 1)
        outs.append(num / (den + eps))
        state = state + ck.transpose(-2, -1) @ cv
        z = z + ck.sum(-2, keepdim=True)
    return torch.cat(outs, dim=-2)


def recall_batch(gen, size, n_pairs, n_keys, n_values, n_queries):
    """An associative-recall batch: n_pairs (key, value) pairs with distinct keys, then n_queries of those keys.

    Returns keys (size, n_pairs), values (size, n_pairs), query keys (size, n_queries) and their answers.
    """
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs={n_pairs} distinct keys need n_keys >= n_pairs, got {n_keys}")
    keys = torch.rand(size, n_keys, generator=gen).argsort(-1)[:, :n_pairs]  # distinct keys
    values = torch.randint(0, n_values, (size, n_pairs), generator=gen)
    which = torch.randint(0, n_pairs, (size, n_queries), generator=gen)
    return keys, values, keys.gather(1, which), values.gather(1, which)


class RecallNet(nn.Module):
    """One attention layer that must recall: context tokens are (key, value) pairs, queries are keys (chapter 13).

    A context token embeds as e_key + e_value; a query as its own embedding of the key. One head of size ``d``
    attends from each query to the whole context, with ``kind`` = "softmax" or "linear" (elu + 1 features);
    the read-out names the value. The same parameters either way: only the term exp(q·k) changes.
    """

    def __init__(self, n_keys, n_values, d, kind="softmax"):
        super().__init__()
        if kind not in ("softmax", "linear"):
            raise ValueError(f"kind must be 'softmax' or 'linear', got {kind!r}")
        self.kind = kind
        self.key = nn.Embedding(n_keys, d)
        self.value = nn.Embedding(n_values, d)
        self.query = nn.Embedding(n_keys, d)
        self.w_q, self.w_k, self.w_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.read = nn.Linear(d, n_values)

    def forward(self, keys, values, query_keys):
        context = self.key(keys) + self.value(values)  # (B, N, d)
        q = self.w_q(self.query(query_keys))  # (B, Q, d)
        k, v = self.w_k(context), self.w_v(context)  # (B, N, d)
        if self.kind == "softmax":
            out = F.scaled_dot_product_attention(q, k, v)  # (B, Q, d)
        else:
            fq, fk = elu_feature(q), elu_feature(k)
            state = fk.transpose(-2, -1) @ v  # (B, d, d): everything the context leaves behind
            out = (fq @ state) / (fq @ fk.sum(-2)[..., None] + 1e-6)
        return self.read(out)  # (B, Q, n_values)
