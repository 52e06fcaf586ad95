"""A decoder you can run: rotary attention, a pre-norm residual block, a tiny language model, and ``generate``.

Chapter 11 builds these from the library's parts: the heads of :class:`lib.nn.TorchMultiHeadAttention`, the
rotary positions of :mod:`lib.positions`, and one :class:`lib.decoding.KVCache` per layer. The language model is
causal (a decoder), so a new token's keys and values never change once computed and decoding with a cache gives the
same logits as running the whole sequence again; :func:`generate` does either, and the tests check that they agree.

Ablation is a property of the model (:class:`HeadAblation`): ``fit_head_means`` stores each head's mean output over
reference inputs, and ``ablate`` replaces chosen heads' outputs by those means, or by their outputs on other inputs
(resample ablation), so that ablated decoding with a cache still equals decoding without one and a sequence's result
never depends on the rest of its batch. :func:`head_ablations` scores every head and layer so;
:class:`TwoCopies` is the chapter's non-causal positional model.

Shapes: ``B`` sequences, ``L`` new tokens, ``S`` tokens the keys cover (S = L without a cache), ``D`` = d_model,
``H`` query heads, ``Hkv`` key/value heads, ``d`` = D / H, ``V`` the vocabulary size. torch only.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lib import attention as attn
from lib.decoding import KVCache
from lib.modules import merge_heads, split_heads
from lib.nn import TorchMultiHeadAttention
from lib.positions import apply_rope

__all__ = [
    "MLP",
    "Ablations",
    "CausalSelfAttention",
    "DecoderBlock",
    "HeadAblation",
    "SelfAttention",
    "TinyLM",
    "TwoCopies",
    "generate",
    "head_ablations",
]


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_head_set(name, heads, n_heads):
    """``heads`` as a frozenset of head indices in 0..n_heads - 1, or a ValueError naming ``name``."""
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise ValueError(f"{name} must be a set of head indices, got {heads!r}")
    heads = list(heads)
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 0 <= h < n_heads:
            raise ValueError(f"{name} must hold head indices 0 to {n_heads - 1}, got {h!r}")
    return frozenset(int(h) for h in heads)


class SelfAttention(TorchMultiHeadAttention):
    """Multi-head self-attention whose heads can be switched off: x (B, L, D) -> (B, L, D) (chapter 10).

    :class:`lib.nn.TorchMultiHeadAttention` on one sequence of tokens, causal or not, with, when ``rope=True``,
    a ``rotate`` hook that turns queries and keys by their positions before the keys enter the cache
    (:func:`lib.positions.apply_rope`); with a cache the new tokens' positions start at ``len(cache)``.

    **Ablation.** ``ablated`` is a set of head indices whose output, before W_O, is replaced by a value that does
    not depend on the tokens of this call, so that a sequence's result never depends on the other sequences in
    the batch, and decoding with a cache gives the logits of decoding without one:

    - mean ablation (the default): the head's mean output over reference inputs, ``head_means`` (H, d), which
      the model's ``fit_head_means`` computes once and stores here; ablating before it is fitted is refused;
    - resample ablation (the model's ``ablate(..., source=...)``): the head's output on other inputs of the same
      shape, position by position; it cannot be combined with a cache.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, causal=True, rope=True, base=10000.0, device=None,
                 dtype=None):
        super().__init__(d_model, n_heads, n_kv_heads, device=device, dtype=dtype)
        if self.d_head % 2 and rope:
            raise ValueError(f"RoPE rotates pairs of coordinates: d_head={self.d_head} must be even")
        self.causal, self.rope, self.base = bool(causal), bool(rope), base
        self.register_buffer("head_means", None, persistent=False)  # (H, d) once fitted
        self._ablated = frozenset()
        self._source = None  # (B, H, L, d): each head's output on other inputs, for resample ablation
        self._recorded = None  # a list while the model records its heads' outputs

    @property
    def ablated(self):
        """The heads switched off, a frozenset of indices (assign any iterable of them)."""
        return self._ablated

    @ablated.setter
    def ablated(self, heads):
        self._ablated = _check_head_set("ablated", heads, self.n_heads)

    def extra_repr(self):
        return super().extra_repr() + ("" if self.causal else ", causal=False") + f", rope={self.rope}"

    def _rotate(self, t, start):
        return apply_rope(t, offset=start, base=self.base)  # start: the position of the first new token

    def forward(self, x, *, cache=None, return_weights=False, key_padding_mask=None, positions=None):
        """Output (B, L, D), and the weights (B, H, L, S) too with ``return_weights=True``.

        ``key_padding_mask`` (B, S), True on the real tokens among the S attended (the cache's and x's), keeps
        padding out of every query's keys; ``positions`` (B, L), each token's position in its own sequence, turns
        RoPE by those rather than by the index (a left-padded sequence starts at 0 after its padding)."""
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (B, L, {self.d_model}), got {shape}")
        if cache is not None and not self.causal:
            raise ValueError("cache: only causal attention can decode with a cache")
        rotate = None
        if self.rope:
            rotate = self._rotate if positions is None else (lambda t, start: apply_rope(t, positions, base=self.base))
        if not self._ablated and self._recorded is None:
            return super().forward(x, causal=self.causal, cache=cache, rotate=rotate, return_weights=return_weights,
                                   key_padding_mask=key_padding_mask)
        return self._ablated_forward(x, cache, rotate, return_weights, key_padding_mask)

    def _replacement(self, out):
        """What the ablated heads output instead: (1, H, 1, d) means or (B, H, L, d) resampled outputs."""
        if self._source is not None:
            if self._source.shape != out.shape:
                raise ValueError(f"x: resample ablation was prepared on inputs giving head outputs of shape "
                                 f"{tuple(self._source.shape)}, this call gives {tuple(out.shape)}")
            return self._source
        if self.head_means is None:
            raise ValueError("ablated: mean ablation needs each head's mean output over reference inputs; "
                             "call the model's fit_head_means(reference inputs) first")
        return self.head_means[None, :, None, :].to(out.dtype)

    def _ablated_forward(self, x, cache, rotate, return_weights, key_padding_mask=None):
        """The same attention computed head by head, the ablated heads' outputs replaced (see the class)."""
        if self._ablated and self._source is not None and cache is not None:
            raise ValueError("cache: resample ablation replaces a head's output position by position; "
                             "decode without a cache, or use mean ablation")
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
        if self.causal:
            allowed = attn.causal_mask(L, S, like=scores, align="bottom-right")  # (L, S)
            scores = scores.masked_fill(~allowed, -math.inf)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask.bool()[:, None, None, :], -math.inf)
        weights = attn.softmax(scores, -1)  # a padding query with no real key gets zeros, never NaN
        out = weights @ v_all  # (B, H, L, d)
        if self._recorded is not None:
            self._recorded.append(out.detach())
        if self._ablated:
            heads = sorted(self._ablated)
            out = out.clone()
            out[:, heads] = self._replacement(out)[:, heads]  # broadcast over B and L for means
        out = merge_heads(out) @ self.w_o  # (B, L, D)
        return (out, weights) if return_weights else out


def _check_tokens(name, tokens, vocab):
    """Refuse anything but an integer tensor (B, L) of ids 0 to vocab - 1, naming what is wrong."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch tensor of shape (B, L), got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.ndim != 2:
        raise ValueError(f"{name} must have shape (B, L), got {tuple(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise ValueError(f"{name} holds token {bad}, outside the vocabulary 0 to {vocab - 1}")


class CausalSelfAttention(SelfAttention):
    """Causal multi-head self-attention with RoPE on queries and keys: x (B, L, D) -> (B, L, D) (chapter 10).

    :class:`SelfAttention` with ``causal=True``. The new queries are the last L of the S tokens, aligned
    bottom-right; the module's SDPA call passes no mask for one new token, ``is_causal`` when L = S and
    ``causal_lower_right(L, S)`` otherwise (:func:`lib.nn.sdpa_arguments`). Heads can be ablated as
    :class:`SelfAttention` says.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, rope=True, base=10000.0, device=None, dtype=None):
        super().__init__(d_model, n_heads, n_kv_heads, causal=True, rope=rope, base=base, device=device,
                         dtype=dtype)


@dataclass(frozen=True)
class Ablations:
    """A score with every single head and every whole layer ablated in turn (chapter 11).

    ``intact`` is the score of the model as trained; ``heads[i][h]`` the score with head h of attention layer i
    ablated; ``layers[i]`` with every head of layer i ablated. ``kind`` is "mean" or "resample".
    """

    kind: str
    intact: object
    heads: tuple
    layers: tuple


class HeadAblation:
    """What a model needs to have its heads ablated: the mixin of :class:`TinyLM` and :class:`TwoCopies`.

    The model lists its :class:`SelfAttention` layers in ``attention_layers()``; ablation is then a property of
    the model: ``fit_head_means`` stores each head's mean output over reference inputs, and ``ablate`` switches
    heads off for a ``with`` block.
    """

    def attention_layers(self):  # pragma: no cover - every model overrides it
        raise NotImplementedError

    @torch.no_grad()
    def head_outputs(self, *inputs):
        """Run the model on ``inputs`` with nothing ablated; each attention layer's heads' outputs (B, H, L, d)."""
        layers = self.attention_layers()
        saved = [(layer._ablated, layer._source) for layer in layers]
        try:
            for layer in layers:
                layer._ablated, layer._source, layer._recorded = frozenset(), None, []
            self(*inputs)
            return [layer._recorded[-1] for layer in layers]
        finally:
            for layer, (ablated, source) in zip(layers, saved):
                layer._ablated, layer._source, layer._recorded = ablated, source, None

    def fit_head_means(self, *inputs):
        """Store on every attention layer each head's mean output over ``inputs`` (batch and positions): (H, d).

        Mean ablation then replaces a head's output by this one vector, whatever the call's batch, positions or
        cache. Returns the model.
        """
        for layer, out in zip(self.attention_layers(), self.head_outputs(*inputs)):
            layer.head_means = out.mean(dim=(0, 2))  # (H, d)
        return self

    @contextmanager
    def ablate(self, heads, *, source=None):
        """Within the block, switch off ``heads``, a dict {attention layer index: head indices}.

        With ``source=None`` each is mean-ablated (``fit_head_means`` first); with ``source``, inputs of the shape
        the block will run, each head's output is its output on ``source`` (resample ablation). The layers' own
        ``ablated`` sets are restored on leaving.
        """
        layers = self.attention_layers()
        if not isinstance(heads, dict):
            raise TypeError(f"heads must be a dict {{layer index: head indices}}, got {type(heads).__name__}")
        chosen = {}
        for i, hs in heads.items():
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(layers):
                raise ValueError(f"heads: layer {i!r} is not an attention layer index 0 to {len(layers) - 1}")
            chosen[int(i)] = _check_head_set("heads", hs, layers[i].n_heads)
        if source is None and any(layers[i].head_means is None for i in chosen):
            raise ValueError("ablate: mean ablation needs fit_head_means(reference inputs) first, or pass source")
        sources = None if source is None else self.head_outputs(source)
        saved = [(layer._ablated, layer._source) for layer in layers]
        try:
            for i, hs in chosen.items():
                layers[i]._ablated = layers[i]._ablated | hs
                layers[i]._source = None if sources is None else sources[i]
            yield self
        finally:
            for layer, (ablated, src) in zip(layers, saved):
                layer._ablated, layer._source = ablated, src


def head_ablations(model, score, *, source=None):
    """:class:`Ablations`: ``score(model)`` intact, with each head, and with each whole layer ablated (chapter 11).

    ``score`` is any function of the model (an accuracy, a pair of them); ``source`` as in
    :meth:`HeadAblation.ablate` (None: mean ablation, which needs ``fit_head_means`` first).
    """
    if not isinstance(model, HeadAblation):
        raise TypeError(f"model must be a TinyLM or TwoCopies (a HeadAblation), got {type(model).__name__}")
    if not callable(score):
        raise TypeError(f"score must be a function of the model, got {type(score).__name__}")
    heads, layers = [], []
    for i, layer in enumerate(model.attention_layers()):
        row = []
        for h in range(layer.n_heads):
            with model.ablate({i: [h]}, source=source):
                row.append(score(model))
        heads.append(tuple(row))
        with model.ablate({i: range(layer.n_heads)}, source=source):
            layers.append(score(model))
    kind = "mean" if source is None else "resample"
    return Ablations(kind, score(model), tuple(heads), tuple(layers))


class MLP(nn.Module):
    """The feed-forward half of a block: Linear(D, d_ff), GELU, Linear(d_ff, D), applied to each token (chapter 11)."""

    def __init__(self, d_model, d_ff, *, device=None, dtype=None):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))  # (B, L, D), via (B, L, d_ff)


class DecoderBlock(nn.Module):
    """A pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)) (chapter 11).

    Pre-norm (the norm inside the branch, as GPT-2 and Llama place it) leaves the residual stream an exact sum of
    what every branch wrote, which makes it easy to read one layer's contribution to another's input (heads
    compose through the stream in post-norm stacks too) and eases training. ``d_ff=0`` drops the MLP, giving an
    attention-only block.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, d_ff=None, rope=True, device=None, dtype=None):
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else _check_int("d_ff", d_ff, 0)
        self.norm_attention = nn.LayerNorm(d_model, device=device, dtype=dtype)
        self.attention = CausalSelfAttention(d_model, n_heads, n_kv_heads, rope=rope, device=device, dtype=dtype)
        self.norm_mlp = nn.LayerNorm(d_model, device=device, dtype=dtype) if d_ff else None
        self.mlp = MLP(d_model, d_ff, device=device, dtype=dtype) if d_ff else None

    def forward(self, x, *, cache=None, return_weights=False, key_padding_mask=None, positions=None):
        """x (B, L, D) -> (B, L, D), and the attention weights (B, H, L, S) with ``return_weights=True``;
        ``key_padding_mask`` and ``positions`` as in :meth:`SelfAttention.forward`."""
        mixed = self.attention(self.norm_attention(x), cache=cache, return_weights=return_weights,
                               key_padding_mask=key_padding_mask, positions=positions)
        mixed, weights = mixed if return_weights else (mixed, None)
        x = x + mixed  # (B, L, D): the residual stream
        if self.mlp is not None:
            x = x + self.mlp(self.norm_mlp(x))
        return (x, weights) if return_weights else x


class TinyLM(HeadAblation, nn.Module):
    """A decoder-only language model: tokens (B, L) -> next-token logits (B, L, V) (chapter 11).

    Token embedding, ``n_layers`` :class:`DecoderBlock`, a final LayerNorm and a linear read-out to the
    vocabulary. Positions enter only through RoPE in every attention layer. With ``caches`` (one
    :class:`KVCache` per layer) only the new tokens are run, at positions after those cached.

    ``attention_mask`` (B, S), as Hugging Face's: 1 (or True) on a real token and 0 on padding, for every token
    so far (the cached ones and ``tokens``). Ragged prompts padded on the left then give each sequence the logits
    it gets alone: no query attends padding, and each token's RoPE position counts only the real tokens before
    it (Hugging Face's ``position_ids = attention_mask.cumsum(-1) - 1``). Padding positions' own logits are
    meaningless.
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

    def attention_layers(self):
        """Each block's :class:`CausalSelfAttention`, in order: the layers ``ablate`` indexes."""
        return [block.attention for block in self.blocks]

    def new_caches(self, capacity):
        """One empty :class:`KVCache` per layer, room for ``capacity`` tokens (the first append sizes it)."""
        return [KVCache(capacity) for _ in self.blocks]

    def forward(self, tokens, *, caches=None, return_weights=False, attention_mask=None):
        """Logits (B, L, V); with ``return_weights=True`` also a list of each layer's weights (B, H, L, S)."""
        _check_tokens("tokens", tokens, self.vocab)
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"the model has {len(self.blocks)} layers but {len(caches)} caches were given: one each")
        keys, positions = _padding(tokens, caches, attention_mask)
        x = self.embed(tokens)  # (B, L, D)
        maps = []
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = block(x, cache=cache, return_weights=return_weights, key_padding_mask=keys, positions=positions)
            if return_weights:
                x, weights = x
                maps.append(weights)
        logits = self.unembed(self.norm(x))  # (B, L, V)
        return (logits, maps) if return_weights else logits


def _padding(tokens, caches, attention_mask):
    """(key padding mask (B, S) bool, positions (B, L)) from Hugging Face's attention_mask, or (None, None)."""
    if attention_mask is None:
        return None, None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch tensor (B, S) of 0 and 1, got {type(attention_mask).__name__}")
    B, L = tokens.shape
    cached = 0 if caches is None else len(caches[0])
    S = cached + L
    if attention_mask.shape != (B, S):
        raise ValueError(f"attention_mask must have shape (B, S) = ({B}, {S}): one entry for each of the {cached} "
                         f"cached and {L} new tokens of every sequence, got {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex() or \
            bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a real token), as integers or booleans")
    keys = attention_mask.to(tokens.device).bool()
    positions = (keys.long().cumsum(-1) - 1).clamp(min=0)[:, cached:]  # (B, L): real tokens before each, HF's rule
    return keys, positions


class TwoCopies(HeadAblation, nn.Module):
    """The positional task's model: digits (B, n) -> logits (B, n, V) for two answers, and the weights (chapter 11).

    At every position i the model names the digit at the mirrored position n - 1 - i and the one at i - 1 (the
    last for i = 0). Token embeddings plus learned position embeddings (``positions=False`` leaves them out),
    one non-causal :class:`SelfAttention` without RoPE, and two linear read-outs, one per answer. No residual
    and no MLP: attention is the only way a digit reaches another position. Returns (mirror logits, previous
    logits, weights (B, H, n, n)).
    """

    def __init__(self, vocab=10, n=8, d_model=32, n_heads=2, *, positions=True):
        super().__init__()
        self.vocab, self.n = _check_int("vocab", vocab, 1), _check_int("n", n, 1)
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(n, d_model) if positions else None
        self.attention = SelfAttention(d_model, n_heads, causal=False, rope=False)
        self.read_mirror = nn.Linear(d_model, vocab)
        self.read_previous = nn.Linear(d_model, vocab)

    def attention_layers(self):
        """The one attention layer, index 0."""
        return [self.attention]

    @staticmethod
    def answers(digits):
        """The two targets of ``digits`` (..., n): the mirrored digits and the previous ones (wrapping round)."""
        return digits.flip(-1), digits.roll(1, dims=-1)

    def forward(self, digits):
        _check_tokens("digits", digits, self.vocab)
        if digits.shape[1] != self.n:
            raise ValueError(f"digits must have shape (B, {self.n}), got {tuple(digits.shape)}")
        hidden = self.token(digits)  # (B, n, D): what each token is
        if self.position is not None:
            hidden = hidden + self.position.weight  # ... and where it is
        mixed, weights = self.attention(hidden, return_weights=True)  # (B, n, D), (B, H, n, n)
        return self.read_mirror(mixed), self.read_previous(mixed), weights


@torch.no_grad()
def generate(model, prompt, n_new, *, use_cache=True, temperature=0.0, generator=None, attention_mask=None):
    """Extend ``prompt`` (B, P) by ``n_new`` tokens; return the tokens (B, P + n_new) and each step's logits.

    The logits are a list of ``n_new`` tensors (B, V), step t's prediction of token P + t. With ``use_cache`` the
    prompt is run once into one :class:`KVCache` per layer and each later step runs the newest token alone;
    without, every step runs the whole sequence again. Both give the same logits. ``temperature=0`` picks the
    most likely token (greedy); above 0 it samples from softmax(logits / temperature) with ``generator`` (a
    temperature too small to divide by gives the greedy choice). Heads the model has ablated stay ablated.
    ``attention_mask`` (B, P), 1 on the prompt's real tokens and 0 on its padding, as Hugging Face's, runs
    ragged prompts padded on the left: each sequence then gets the tokens and logits it gets alone.
    """
    _check_tokens("prompt", prompt, model.vocab)
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token, got shape (B, 0)")
    _check_int("n_new", n_new, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    tokens, steps = prompt, []
    caches = model.new_caches(prompt.shape[1] + n_new) if use_cache else None
    new = prompt
    mask = attention_mask
    for step in range(n_new):
        if mask is not None and step:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # each new token is real
        kw = {} if mask is None else {"attention_mask": mask}
        logits = model(new if use_cache else tokens, caches=caches, **kw)[:, -1]  # (B, V): the next's prediction
        steps.append(logits)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            # shifted by the maximum first, so a tiny temperature gives the greedy choice, never inf / inf
            shifted = (logits - logits.max(dim=-1, keepdim=True).values).double() / temperature
            probs = shifted.softmax(dim=-1)  # (B, V)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        new = nxt
    return tokens, steps
