"""Attention as modules: learned projections around :func:`lib.attention.attention` (chapters 6 and 10).

Two pairs of mirrored twins with the same parameter names and the same arithmetic::

    SelfAttention            NumPy, one head, forward only (no gradients, no dropout)  ch. 6
    TorchSelfAttention       its torch.nn.Module twin: trainable, dropout, any device
    MultiHeadAttention       NumPy, h heads (grouped-query if n_kv_heads < n_heads),
                             a KV cache                                                ch. 10
    TorchMultiHeadAttention  its twin, calling scaled_dot_product_attention on 4-D inputs

The NumPy twins live here, and this module imports without torch. The ``torch.nn`` twins live in :mod:`lib.nn`,
which imports torch at its top, and are imported from there alone: ``from lib.nn import TorchMultiHeadAttention``.

Shape vocabulary, as in :mod:`lib.attention`, plus the sizes of the projections and the heads::

    ...   batch dimensions     L    query length      S   key length (self-attention: L = S)
    D     d_model, the size of each input token     E     d_k, the query and key size
    Ev    d_v, the value size       Do   d_out, the output size (Ev without w_o)
    H     n_heads, query heads      Hkv  n_kv_heads, key/value heads (H but in GQA)
    d     d_head = D / H, the size of one head's queries, keys and values

    one head:  x (..., L, D)   w_q (D, E)   w_k (D, E)   w_v (D, Ev)   w_o (Ev, Do)
               output (..., L, Do)
    H heads:   x (..., L, D)   w_q (D, D)   w_k (D, Hkv·d)   w_v (D, Hkv·d)   w_o (D, D)
               q (..., H, L, d)   k, v (..., Hkv, S, d)   weights (..., H, L, S)
               output (..., L, D)

Weights are stored as the book writes them, (in, out), so a projection is ``x @ w_q``: the transpose of the
(out, in) layout of ``torch.nn.Linear`` and of ``nn.MultiheadAttention``'s ``in_proj_weight``.
Masks follow :mod:`lib.attention`: a boolean mask is True where a query MAY attend a key (the opposite of
``nn.MultiheadAttention``), a floating mask is added to the scores. The multi-head functions and modules take a
mask in one of two layouts: (..., L, S), shared by every head (``padding_mask(lengths, S, heads=False)``, (B, 1,
S), is one), or (..., 1 or H, L, S), one more dimension than that, per head: the 4-D (B, 1 or H, L, S) of
``scaled_dot_product_attention`` and Hugging Face (``padding_mask``'s default (B, 1, 1, S) is one), which also
carries per-head biases such as ALiBi's. Either way a padding mask is read per sequence.

``causal`` takes False (the default), True, ``"top-left"`` or ``"bottom-right"`` everywhere in the library. In
:func:`grouped_attention`, a function of q, k and v, True means ``"top-left"``, as ``is_causal=True`` in
``scaled_dot_product_attention``. The modules know where their queries sit, and True aligns them by position:
each token attends itself and the tokens before it. Without a cache the queries and keys both start at position 0,
which is top-left; with a :class:`lib.decoding.KVCache` that holds earlier tokens, the L new queries are the
last L of the S tokens, which is bottom-right. (A static cache holds a context, not earlier tokens: top-left.)
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from lib import attention as attn
from lib.backend import (
    _NUMPY,
    _backend,
    _causal_pattern,
    _check_causal,
    _check_mask,
    _compute_dtype,
    _is_tensor,
    _key_padding,
    _with_key_padding,
)

__all__ = [
    "MultiHeadAttention",
    "SelfAttention",
    "grouped_attention",
    "merge_heads",
    "split_heads",
    "xavier_bound",
]

PARAMETER_NAMES = ("w_q", "w_k", "w_v", "w_o")


def xavier_bound(fan_in, fan_out):
    """Half-width a of Xavier/Glorot's uniform initialisation U(-a, a), a = sqrt(6 / (fan_in + fan_out)).

    Its variance a²/3 = 2 / (fan_in + fan_out) keeps activations near unit variance going forwards (which wants
    1/fan_in) and gradients going backwards (which wants 1/fan_out) as well as one number can (chapter 6).
    """
    fan_in = _check_size(fan_in, "fan_in")
    fan_out = _check_size(fan_out, "fan_out")
    return math.sqrt(6.0 / (fan_in + fan_out))


def _check_size(n, name):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{name} must be at least 1, got {n}")
    return int(n)


def _check_dims(d_model, d_k, d_v, d_out):
    """The four sizes as ints, d_v defaulting to d_k; d_out stays None when there is no output projection."""
    d_model = _check_size(d_model, "d_model")
    d_k = _check_size(d_k, "d_k")
    d_v = d_k if d_v is None else _check_size(d_v, "d_v")
    d_out = None if d_out is None else _check_size(d_out, "d_out")
    return d_model, d_k, d_v, d_out


def _shapes(d_model, d_k, d_v, d_out):
    """Parameter name -> (in, out) shape, in PARAMETER_NAMES order."""
    shapes = {"w_q": (d_model, d_k), "w_k": (d_model, d_k), "w_v": (d_model, d_v)}
    if d_out is not None:
        shapes["w_o"] = (d_v, d_out)
    return shapes


def _numpy_input(x, module, twin, name="x"):
    """x as a floating NumPy array for a NumPy module; a torch tensor is refused with the twin's name."""
    if _is_tensor(x):
        raise TypeError(f"{name} is a torch.Tensor but {module} is the NumPy module: use lib.nn.{twin}, or pass "
                        f"{name}.numpy()")
    return _numeric(x, name, "fiu", "the module needs real floating-point or integer input")


def _numeric(x, name, kinds, needed):
    """x as a NumPy array whose dtype kind is one of ``kinds``, or a TypeError naming it and saying what is needed."""
    try:
        x = np.asarray(x)
    except (ValueError, TypeError) as err:
        raise TypeError(f"{name} could not be read as a numeric array: {err}") from None
    if x.dtype.kind not in kinds:
        raise TypeError(f"{name} has dtype {x.dtype}; {needed}")
    return x


def _generator(rng):
    """numpy.random.default_rng(rng), with an error naming rng for anything it cannot seed from."""
    if rng is not None and not isinstance(rng, (np.random.Generator, numbers.Integral)) or isinstance(rng, bool):
        raise TypeError(f"rng must be None, a non-negative integer seed or a numpy.random.Generator, got "
                        f"{type(rng).__name__}")
    if isinstance(rng, numbers.Integral) and rng < 0:
        raise ValueError(f"rng must be a non-negative integer seed, got {rng}")
    return np.random.default_rng(rng)


def _check_input(x, d_model, name="x", length="L"):
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., {length}, d_model), at least 2-D; got shape {tuple(x.shape)}")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} has d_model={x.shape[-1]} (its last dimension) but the module was built for d_model={d_model} "
            f"({name} shape {tuple(x.shape)})"
        )


def _sizes(module):
    d_out = "" if module.d_out is None else f", d_out={module.d_out}"
    return f"d_model={module.d_model}, d_k={module.d_k}, d_v={module.d_v}{d_out}"


def _check_heads(d_model, n_heads, n_kv_heads):
    """d_model, n_heads and n_kv_heads as ints, n_kv_heads defaulting to n_heads, with the divisibility checked."""
    d_model = _check_size(d_model, "d_model")
    n_heads = _check_size(n_heads, "n_heads")
    n_kv_heads = n_heads if n_kv_heads is None else _check_size(n_kv_heads, "n_kv_heads")
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}: each head takes d_model / n_heads of the "
            "projected columns"
        )
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}: each key/value head serves "
            "n_heads / n_kv_heads query heads"
        )
    return d_model, n_heads, n_kv_heads


def _head_shapes(d_model, n_heads, n_kv_heads):
    """Parameter name -> (in, out) shape of a multi-head module, in PARAMETER_NAMES order."""
    kv_width = n_kv_heads * (d_model // n_heads)  # Hkv·d: grouped-query attention projects fewer keys and values
    return {"w_q": (d_model, d_model), "w_k": (d_model, kv_width), "w_v": (d_model, kv_width), "w_o": (d_model, d_model)}


def _head_sizes(module):
    kv = "" if module.n_kv_heads == module.n_heads else f", n_kv_heads={module.n_kv_heads}"
    return f"d_model={module.d_model}, n_heads={module.n_heads}{kv}, d_head={module.d_head}"


def _check_context(context, x, d_model):
    """Keys and values come from ``context`` (cross-attention): it needs x's batch dimensions and d_model."""
    _check_input(context, d_model, "context", "S")
    if tuple(context.shape[:-2]) != tuple(x.shape[:-2]):
        raise ValueError(
            f"context has batch dimensions {tuple(context.shape[:-2])} but x has {tuple(x.shape[:-2])}: "
            "each sequence of queries needs its own sequence of keys"
        )
    return context


def _load_numpy_state(module, state, expected):
    """Copy weights into a NumPy module from a dict such as another module's ``state_dict()``."""
    if set(state) != set(expected):
        raise ValueError(f"state has parameters {sorted(state)} but {module!r} has {sorted(expected)}")
    for name, shape in expected.items():
        value = state[name]
        if hasattr(value, "detach"):  # a torch tensor, possibly on a GPU
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        if value.shape != shape:
            raise ValueError(f"{name} has shape {value.shape} but {module!r} needs {shape}")
        setattr(module, name, value.astype(getattr(module, name).dtype, copy=True))


# --------------------------------------------------------------------------------------------------------------
# Heads: split, attend (grouped when key/value heads are shared), merge. NumPy arrays or torch tensors alike.
# --------------------------------------------------------------------------------------------------------------


def _array(x, name="x"):
    """A torch tensor as it is; anything else as a NumPy array, refused by name if it is not numeric."""
    if _is_tensor(x):
        return x
    return _numeric(x, name, "fiub", "a numeric array or a torch tensor is needed")


def split_heads(x, n_heads):
    """(..., L, H·d) -> (..., H, L, d): head i gets columns i·d to (i+1)·d - 1 of the last axis (chapter 10).

    The reshape cuts each token's row into H pieces of d; the transpose then moves the head axis in front of the
    token axis, so that every head's (L, d) block is one matrix of a batch. NumPy arrays or torch tensors.
    """
    n_heads = _check_size(n_heads, "n_heads")
    x = _array(x)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, H·d), at least 2-D; got shape {tuple(x.shape)}")
    *batch, L, width = x.shape
    if width % n_heads:
        raise ValueError(f"x has {width} columns, not divisible by n_heads={n_heads} (x shape {tuple(x.shape)})")
    return x.reshape(*batch, L, n_heads, width // n_heads).swapaxes(-3, -2)  # (..., H, L, d)


def merge_heads(x):
    """(..., H, L, d) -> (..., L, H·d), the inverse of :func:`split_heads`: each token's heads side by side (chapter 10)."""
    x = _array(x)
    if x.ndim < 3:
        raise ValueError(f"x must have shape (..., H, L, d), at least 3-D; got shape {tuple(x.shape)}")
    *batch, H, L, d = x.shape
    return x.swapaxes(-3, -2).reshape(*batch, L, H * d)  # (..., L, H·d)


def _check_heads_input(q, k, v):
    """(H, L, Hkv, S) of split heads q (..., H, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), checked."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim < 3:
            raise ValueError(f"{name} must have shape (..., heads, length, size), at least 3-D; got shape {tuple(t.shape)}")
    H, L = q.shape[-3], q.shape[-2]
    Hkv, S = k.shape[-3], k.shape[-2]
    if v.shape[-3] != Hkv:
        raise ValueError(f"v has {v.shape[-3]} heads but k has {Hkv}: every key head needs a value head")
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q has {H} heads, not a multiple of the {Hkv} key/value heads: each key/value head must serve the same "
            "number of query heads"
        )
    return H, L, Hkv, S


def _heads_mask(ops, mask, causal, batch, H, L, S, like, key_padding_mask=None):
    """The mask the heads apply, (..., 1 or H, L, S), or None: the caller's, checked, and the causal pattern.

    ``mask`` is shared by every head when it has at most len(batch) + 2 dimensions, (..., L, S), and per head
    when it has one more, (..., 1 or H, L, S). ``causal`` is None or the offset of the causal diagonal
    (:func:`lib.backend._check_causal`): key j is allowed for query i when j <= i + causal."""
    if mask is not None:
        mask = _check_heads_mask(ops, mask, tuple(batch), H, L, S, like)
    if key_padding_mask is not None:  # (B, S), True or 1 on a real token: (B, 1, ..., 1, S) against the heads
        if ops is _NUMPY:
            key_padding_mask = np.asarray(key_padding_mask)
        elif not _is_tensor(key_padding_mask):
            raise TypeError(f"key_padding_mask must be a torch.Tensor like x, got {type(key_padding_mask).__name__}")
        else:
            key_padding_mask = key_padding_mask.to(like.device)
        mask = _with_key_padding(ops, mask, _key_padding(ops, key_padding_mask, tuple(batch) + (H,), S))
    if causal is None:
        return mask
    allowed = _causal_pattern(ops, range(L), range(S), like, causal)[None]  # (1, L, S)
    if mask is None:
        return allowed
    if _is_bool_mask(ops, mask):  # both boolean: a key must pass both
        return mask & allowed
    return mask + ops.where(allowed, 0.0, -math.inf)  # a floating mask, with -inf where the future is


def _is_bool_mask(ops, mask):
    return mask.dtype == (np.bool_ if ops is _NUMPY else ops.torch.bool)


def _check_heads_mask(ops, mask, batch, H, L, S, like):
    """A shared (..., L, S) or per-head (..., 1 or H, L, S) mask, checked, returned with a head axis."""
    if ops is _NUMPY:
        mask = np.asarray(mask)
    shared, per_head = batch + (L, S), batch + (H, L, S)
    per_head_layout = mask.ndim == len(batch) + 3
    target = per_head if per_head_layout else shared
    try:
        fits = mask.ndim <= len(target) and np.broadcast_shapes(tuple(mask.shape), target) == target
    except ValueError:
        fits = False
    if per_head_layout and mask.shape[-3] not in (1, H):
        fits = False
    if not fits:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} fits neither layout the heads take: shared by every head, it must "
            f"broadcast to (..., L, S) = {shared}; per head, as scaled_dot_product_attention's 4-D masks, to "
            f"(..., 1 or H, L, S) = {per_head}"
        )
    mask = _check_mask(ops, mask, target, _compute_dtype(ops, like.dtype))  # dtype, NaN and +inf checks
    if per_head_layout:
        return mask
    mask = mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))  # at least (L, S)
    return mask[..., None, :, :]  # (..., 1, L, S): the same for every head


def _grouped(q, k, v, mask, return_weights, dropout=None):
    """grouped_attention's arithmetic on checked inputs; ``mask`` (..., 1 or H, L, S) from :func:`_heads_mask`;
    ``dropout``, if given, acts on the weights."""
    *batch, H, L, E = q.shape
    Hkv, S, Ev = k.shape[-3], k.shape[-2], v.shape[-1]
    q = q.reshape(*batch, Hkv, H // Hkv, L, E)  # (..., Hkv, g, L, E): the g query heads that share a key head
    k, v = k[..., None, :, :], v[..., None, :, :]  # (..., Hkv, 1, S, E): broadcast over the group, not copied
    if mask is not None:
        *mb, h, ml, ms = mask.shape
        groups = (Hkv, H // Hkv) if h == H else (1, 1)
        mask = mask.reshape(*mb, *groups, ml, ms)  # (..., Hkv or 1, g or 1, L, S)
    if dropout is None:
        out = attn.attention(q, k, v, mask, return_weights=return_weights)  # (..., Hkv, g, L, Ev)
        out, weights = out if return_weights else (out, None)
    else:
        weights = dropout(attn.attention_weights(q, k, mask))  # (..., Hkv, g, L, S)
        out = weights @ v  # (..., Hkv, g, L, Ev)
    out = out.reshape(*out.shape[:-4], H, L, Ev)  # (..., H, L, Ev)
    if not return_weights:
        return out
    return out, weights.reshape(*weights.shape[:-4], H, L, S)  # (..., H, L, S)


def grouped_attention(q, k, v, mask=None, *, causal=False, return_weights=False, key_padding_mask=None):
    """Attention of H query heads on Hkv key/value heads, Hkv dividing H: output (..., H, L, Ev) (chapter 10).

    q (..., H, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), NumPy or torch. Query head i reads key/value head
    i // (H / Hkv), as ``scaled_dot_product_attention(..., enable_gqa=True)`` does and as ``repeat_interleave`` of
    the key/value heads would; the shared heads are broadcast, never copied. Hkv = H is plain multi-head
    attention, Hkv = 1 multi-query attention. ``mask``: boolean, True where a query may attend a key (the opposite
    of ``nn.MultiheadAttention``), or floating, added to the scores; (..., L, S) is shared by every head,
    (..., 1 or H, L, S) is per head. ``causal``: False (the default); True or ``"top-left"``, query i may attend
    keys j <= i, as ``is_causal=True``; or ``"bottom-right"``, the L queries are the last L of the S tokens and
    query i may attend keys j <= S - L + i, what new queries need when the first keys come from a cache (it needs
    L <= S). ``key_padding_mask`` (B, S), True or 1 on real tokens (Hugging Face's ``attention_mask``; pass
    ``~m`` for ``nn.MultiheadAttention``'s), is read per sequence. With ``return_weights=True`` returns (output,
    weights (..., H, L, S)).
    """
    ops = _backend({"q": q, "k": k, "v": v, "mask": mask})
    if ops is _NUMPY:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    H, L, _, S = _check_heads_input(q, k, v)
    try:
        batch = np.broadcast_shapes(tuple(q.shape[:-3]), tuple(k.shape[:-3]), tuple(v.shape[:-3]))
    except ValueError:
        raise ValueError(
            f"the batch dimensions do not broadcast: q {tuple(q.shape[:-3])}, k {tuple(k.shape[:-3])}, "
            f"v {tuple(v.shape[:-3])}"
        ) from None
    mask = _heads_mask(ops, mask, _check_causal(causal, L, S), batch, H, L, S, q, key_padding_mask)
    return _grouped(q, k, v, mask, return_weights)


def _project_kv(module, source):
    """k and v (..., Hkv, S, d) from source: x itself in self-attention, the context in cross-attention."""
    k = split_heads(source @ module.w_k, module.n_kv_heads)  # (..., Hkv, S, d)
    v = split_heads(source @ module.w_v, module.n_kv_heads)  # (..., Hkv, S, d)
    return k, v


def _heads_to_attend(module, x, context, cache, check_context, rotate):
    """q (..., H, L, d), the k and v (..., Hkv, S, d) a multi-head call attends, and whether q follows cached tokens.

    Self-attention projects x; with a growing :class:`lib.decoding.KVCache` the keys and values are appended to it
    and all its tokens are attended, so the queries are the last L of them. ``rotate(t, start)``, if given, turns
    the queries and the new keys before the keys enter the cache, ``start`` being the position of x's first token
    (the cache's length before this call, else 0). Cross-attention projects ``context``; a cache with it must be
    static (``KVCache(static=True)``): the first call stores the context's keys and values, and later calls read
    them without projecting the context again. ``check_context`` validates a context."""
    q = split_heads(x @ module.w_q, module.n_heads)  # (..., H, L, d)
    if cache is not None and not all(hasattr(cache, a) for a in ("append", "static", "__len__")):  # a KVCache
        raise TypeError(f"cache must be a lib.decoding.KVCache or None, got {type(cache).__name__}")
    if cache is not None and getattr(cache, "axes", "bhsd") != "bhsd":
        raise ValueError(f"the modules store split heads (..., Hkv, S, d): pass KVCache(capacity), not a cache with "
                         f"axes={cache.axes!r}")
    if rotate is not None and not callable(rotate):
        raise TypeError(f"rotate must be a function rotate(t, start) or None, got {type(rotate).__name__}")
    static = cache is not None and cache.static
    if context is None:
        if static:
            raise ValueError(
                "this KVCache is static: it holds a context's keys and values for cross-attention; pass context= "
                "too, or use KVCache(capacity) to cache self-attention"
            )
        k, v = _project_kv(module, x)  # (..., Hkv, L, d)
        if rotate is not None:
            start = 0 if cache is None else len(cache)  # the position of x's first token
            q, k = rotate(q, start), rotate(k, start)
        if cache is None:
            return q, k, v, False
        k, v = cache.append(k, v)  # (..., Hkv, S, d): every token so far
        return q, k, v, True
    if rotate is not None:
        raise ValueError(
            "rotate turns queries and keys by their positions in one sequence: it applies to self-attention, "
            "not to cross-attention with context"
        )
    context = check_context(context)
    if cache is None:
        return (q, *_project_kv(module, context), False)
    if not static:
        raise ValueError(
            "a KVCache that grows cannot be passed with context: it would store the context's keys and values "
            "again at every call. For cross-attention pass KVCache(static=True), which stores them once"
        )
    if len(cache) == 0:
        return (q, *cache.append(*_project_kv(module, context)), False)  # (..., Hkv, S, d), projected once
    held = tuple(cache.keys.shape)
    if held[:-3] != tuple(context.shape[:-2]) or held[-2] != context.shape[-2]:
        raise ValueError(
            f"context has shape {tuple(context.shape)} but the static cache holds the keys of a context with batch "
            f"dimensions {held[:-3]} and {held[-2]} tokens: one static cache serves one context"
        )
    return q, cache.keys, cache.values, False


# --------------------------------------------------------------------------------------------------------------
# NumPy
# --------------------------------------------------------------------------------------------------------------


class SelfAttention:
    """Single-head self-attention in NumPy: x (..., L, D) -> output (..., L, Do) (chapter 6).

    ``d_v`` defaults to ``d_k``. With ``d_out`` an output projection w_o (Ev, Do) follows the attention; without
    it the output is the attention's own (..., L, Ev). Every weight is drawn from Xavier's U(-a, a) with
    ``rng`` (a seed or a ``numpy.random.Generator``) in ``dtype``.
    """

    def __init__(self, d_model, d_k, d_v=None, d_out=None, *, rng=None, dtype=np.float32):
        self.d_model, self.d_k, self.d_v, self.d_out = _check_dims(d_model, d_k, d_v, d_out)
        rng = _generator(rng)
        for name, (fan_in, fan_out) in _shapes(self.d_model, self.d_k, self.d_v, self.d_out).items():
            a = xavier_bound(fan_in, fan_out)
            setattr(self, name, rng.uniform(-a, a, size=(fan_in, fan_out)).astype(dtype))
        if self.d_out is None:
            self.w_o = None

    def __repr__(self):
        return f"SelfAttention({_sizes(self)})"

    def state_dict(self):
        """Parameter name -> a copy of the weight, (in, out); the same names as :class:`TorchSelfAttention`."""
        return {n: getattr(self, n).copy() for n in PARAMETER_NAMES if getattr(self, n) is not None}

    def load_state_dict(self, state):
        """Copy weights in from a dict such as another module's ``state_dict()`` (torch tensors are accepted)."""
        _load_numpy_state(self, state, _shapes(self.d_model, self.d_k, self.d_v, self.d_out))

    def num_parameters(self):
        """How many numbers the module learns."""
        return sum(w.size for w in self.state_dict().values())

    def __call__(self, x, mask=None, *, causal=False, return_weights=False, key_padding_mask=None):
        """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

        ``mask``, ``key_padding_mask`` and ``causal`` are passed to :func:`lib.attention.attention` (boolean True =
        may attend; ``causal`` False, True or ``"top-left"``, or ``"bottom-right"``, which agree here since L = S).
        """
        x = _numpy_input(x, "SelfAttention", "TorchSelfAttention")
        _check_input(x, self.d_model)
        q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
        # without weights the library takes its cheaper path, so the output is exactly attn.attention's
        out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights,
                             key_padding_mask=key_padding_mask)  # (..., L, Ev)
        out, weights = out if return_weights else (out, None)
        if self.w_o is not None:
            out = out @ self.w_o  # (..., L, Do)
        return (out, weights) if return_weights else out


class MultiHeadAttention:
    """Multi-head attention in NumPy: x (..., L, D) -> output (..., L, D) (chapter 10).

    ``n_heads`` heads of size d = D / H attend side by side, each on its own d columns of the projections; their
    outputs, concatenated back to D columns, go through w_o. ``n_kv_heads`` (default ``n_heads``) below
    ``n_heads`` gives grouped-query attention: fewer key and value heads, each shared by H / Hkv query heads.
    Weights w_q (D, D), w_k and w_v (D, Hkv·d), w_o (D, D), no biases, each drawn from Xavier's U(-a, a) with
    ``rng`` (a seed or a ``numpy.random.Generator``) in ``dtype``.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, rng=None, dtype=np.float32):
        self.d_model, self.n_heads, self.n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads)
        self.d_head = self.d_model // self.n_heads
        rng = _generator(rng)
        for name, (fan_in, fan_out) in _head_shapes(self.d_model, self.n_heads, self.n_kv_heads).items():
            a = xavier_bound(fan_in, fan_out)
            setattr(self, name, rng.uniform(-a, a, size=(fan_in, fan_out)).astype(dtype))

    def __repr__(self):
        return f"MultiHeadAttention({_head_sizes(self)})"

    def state_dict(self):
        """Parameter name -> a copy of the weight, (in, out); the same names as :class:`TorchMultiHeadAttention`."""
        return {n: getattr(self, n).copy() for n in PARAMETER_NAMES}

    def load_state_dict(self, state):
        """Copy weights in from a dict such as another module's ``state_dict()`` (torch tensors are accepted)."""
        _load_numpy_state(self, state, _head_shapes(self.d_model, self.n_heads, self.n_kv_heads))

    def num_parameters(self):
        """How many numbers the module learns."""
        return sum(w.size for w in self.state_dict().values())

    def __call__(self, x, mask=None, *, context=None, causal=False, cache=None, rotate=None, return_weights=False,
                 key_padding_mask=None):
        """Attend: output (..., L, D), and the weights (..., H, L, S) too with ``return_weights=True``.

        Self-attention by default; ``context`` (..., S, D), with x's batch dimensions, supplies the keys and values
        for cross-attention. ``mask`` (boolean True = may attend, or floating, added) is (..., L, S), shared by
        every head, or (..., 1 or H, L, S), per head. ``causal``: False (the default), ``"top-left"``,
        ``"bottom-right"``, or True, which aligns by position: top-left without a cache (query i attends keys
        j <= i), bottom-right with a cache of earlier tokens (the L new queries are the last L of the S tokens).
        With ``cache``, a :class:`lib.decoding.KVCache`, this call's keys and values are appended to it and the
        queries attend every key it holds: x is then the next tokens of a sequence whose earlier tokens went
        through the cache. With
        ``context``, ``cache`` must be static (``KVCache(static=True)``): it stores the context's keys and values on
        the first call and serves them to every later one. ``rotate(t, start)``, for self-attention, turns the
        queries (..., H, L, d) and the new keys (..., Hkv, L, d), whose first token is at position ``start`` (the
        cache's length, else 0), before the keys are cached: where rotary position embeddings plug in.
        ``key_padding_mask`` (B, S), True or 1 on a real key (Hugging Face's ``attention_mask``), is read per
        sequence; ``nn.MultiheadAttention``'s (True = ignore) is passed as ``~m``.
        """
        x = _numpy_input(x, "MultiHeadAttention", "TorchMultiHeadAttention")
        _check_input(x, self.d_model)
        check = lambda c: _check_context(np.asarray(c), x, self.d_model)
        q, k, v, follows_cache = _heads_to_attend(self, x, context, cache, check, rotate)  # q (..., H, L, d)
        L, S = q.shape[-2], k.shape[-2]
        causal = _check_causal(causal, L, S, true="bottom-right" if follows_cache else "top-left")
        mask = _heads_mask(_NUMPY, mask, causal, x.shape[:-2], self.n_heads, L, S, q, key_padding_mask)
        out = _grouped(q, k, v, mask, return_weights)  # (..., H, L, d)
        out, weights = out if return_weights else (out, None)
        out = merge_heads(out) @ self.w_o  # (..., L, D)
        return (out, weights) if return_weights else out
