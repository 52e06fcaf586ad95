"""Attention as modules: learned projections around :func:`lib.attention.attention` (chapters 6 and 9).

Two pairs of mirrored twins with the same parameter names and the same arithmetic::

    SelfAttention             NumPy, one head, forward only (no gradients, no dropout)            chapter 6
    TorchSelfAttention        its ``torch.nn.Module`` twin: trainable, dropout, any device and dtype
    MultiHeadAttention        NumPy, h heads (grouped-query with n_kv_heads < n_heads), a KV cache   chapter 9
    TorchMultiHeadAttention   its twin, calling ``torch.nn.functional.scaled_dot_product_attention`` on 4-D inputs

This module imports without torch: the torch classes are built the first time they are asked for.

Shape vocabulary, as in :mod:`lib.attention`, plus the sizes of the projections and the heads::

    ...   batch dimensions        L     query length          S     key length (self-attention: L = S)
    D     d_model, the size of each input token      E     d_k, the query and key size
    Ev    d_v, the value size                        Do    d_out, the output size (Ev without an output projection)
    H     n_heads, query heads    Hkv   n_kv_heads, key/value heads (Hkv = H except in grouped-query attention)
    d     d_head = D / H, the size of one head's queries, keys and values

    one head:  x (..., L, D)   w_q (D, E)   w_k (D, E)   w_v (D, Ev)   w_o (Ev, Do)   output (..., L, Do)
    H heads:   x (..., L, D)   w_q (D, D)   w_k (D, Hkv·d)   w_v (D, Hkv·d)   w_o (D, D)
               q (..., H, L, d)   k, v (..., Hkv, S, d)   weights (..., H, L, S)   output (..., L, D)

Weights are stored as the book writes them, (in, out), so a projection is ``x @ w_q``: the transpose of the
(out, in) layout of ``torch.nn.Linear`` and of ``nn.MultiheadAttention``'s ``in_proj_weight``.
Masks follow :mod:`lib.attention`: a boolean mask is True where a query MAY attend a key (the opposite of
``nn.MultiheadAttention``), a floating mask is added to the scores.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from lib import attention as attn
from lib.backend import _NUMPY, _backend, _check_mask, _compute_dtype, _is_tensor

# TorchSelfAttention and TorchMultiHeadAttention are public too, created on first access by __getattr__ below.
__all__ = [
    "MultiHeadAttention",
    "SelfAttention",
    "from_multihead_attention",
    "grouped_attention",
    "merge_heads",
    "split_heads",
    "to_multihead_attention",
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


def split_heads(x, n_heads):
    """(..., L, H·d) -> (..., H, L, d): head i gets columns i·d to (i+1)·d - 1 of the last axis (chapter 9).

    The reshape cuts each token's row into H pieces of d; the transpose then moves the head axis in front of the
    token axis, so that every head's (L, d) block is one matrix of a batch. NumPy arrays or torch tensors.
    """
    n_heads = _check_size(n_heads, "n_heads")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, H·d), at least 2-D; got shape {tuple(x.shape)}")
    *batch, L, width = x.shape
    if width % n_heads:
        raise ValueError(f"x has {width} columns, not divisible by n_heads={n_heads} (x shape {tuple(x.shape)})")
    return x.reshape(*batch, L, n_heads, width // n_heads).swapaxes(-3, -2)  # (..., H, L, d)


def merge_heads(x):
    """(..., H, L, d) -> (..., L, H·d), the inverse of :func:`split_heads`: each token's heads side by side (chapter 9)."""
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


def _heads_mask(ops, mask, causal, batch, L, S, like):
    """The mask (..., L, S) every head applies: the caller's, checked, and with ``causal`` the bottom-right pattern."""
    if mask is not None:
        mask = _check_mask(ops, mask, tuple(batch) + (L, S), _compute_dtype(ops, like.dtype))
    if not causal:
        return mask
    allowed = attn.causal_mask(L, S, like=like, align="bottom-right")  # (L, S)
    if mask is None:
        return allowed
    if mask.dtype == allowed.dtype:  # both boolean: a key must pass both
        return mask & allowed
    return mask + ops.where(allowed, 0.0, -math.inf)  # a floating mask, with -inf where the future is


def _grouped(q, k, v, mask, return_weights, dropout=None):
    """grouped_attention's arithmetic on checked inputs; ``dropout``, if given, acts on the weights."""
    *batch, H, L, E = q.shape
    Hkv, S, Ev = k.shape[-3], k.shape[-2], v.shape[-1]
    q = q.reshape(*batch, Hkv, H // Hkv, L, E)  # (..., Hkv, g, L, E): the g query heads that share a key head
    k, v = k[..., None, :, :], v[..., None, :, :]  # (..., Hkv, 1, S, E): broadcast over the group, not copied
    if mask is not None:
        mask = mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))[..., None, None, :, :]  # (..., 1, 1, L, S)
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


def grouped_attention(q, k, v, mask=None, *, causal=False, return_weights=False):
    """Attention of H query heads on Hkv key/value heads, Hkv dividing H: output (..., H, L, Ev) (chapter 9).

    q (..., H, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), NumPy or torch. Query head i reads key/value head
    i // (H / Hkv), as ``scaled_dot_product_attention(..., enable_gqa=True)`` does and as ``repeat_interleave`` of
    the key/value heads would; the shared heads are broadcast, never copied. Hkv = H is plain multi-head
    attention, Hkv = 1 multi-query attention. ``mask``: boolean, True where a query may attend a key (the opposite
    of ``nn.MultiheadAttention``), or floating, added to the scores; it broadcasts to (..., L, S) and every head
    applies it. ``causal=True`` aligns the pattern bottom-right: query i is token S - L + i of the sequence and
    may attend keys j <= S - L + i (the usual causal mask when L = S; what new queries need when the first keys
    come from a cache). With ``return_weights=True`` returns (output, weights (..., H, L, S)).
    """
    ops = _backend({"q": q, "k": k, "v": v, "mask": mask})
    if ops is _NUMPY:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _, L, _, S = _check_heads_input(q, k, v)
    try:
        batch = np.broadcast_shapes(tuple(q.shape[:-3]), tuple(k.shape[:-3]), tuple(v.shape[:-3]))
    except ValueError:
        raise ValueError(
            f"the batch dimensions do not broadcast: q {tuple(q.shape[:-3])}, k {tuple(k.shape[:-3])}, "
            f"v {tuple(v.shape[:-3])}"
        ) from None
    mask = _heads_mask(ops, mask, causal, batch, L, S, q)
    return _grouped(q, k, v, mask, return_weights)


def _project_heads(module, x, source):
    """q (..., H, L, d) from x; k and v (..., Hkv, S, d) from source (x itself in self-attention)."""
    q = split_heads(x @ module.w_q, module.n_heads)  # (..., H, L, d)
    k = split_heads(source @ module.w_k, module.n_kv_heads)  # (..., Hkv, S, d)
    v = split_heads(source @ module.w_v, module.n_kv_heads)  # (..., Hkv, S, d)
    return q, k, v


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
        rng = np.random.default_rng(rng)
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

    def __call__(self, x, mask=None, *, causal=False, return_weights=False):
        """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

        ``mask`` and ``causal`` are passed to :func:`lib.attention.attention` (boolean True = may attend).
        """
        x = np.asarray(x)
        _check_input(x, self.d_model)
        q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
        # without weights the library takes its cheaper path, so the output is exactly attn.attention's
        out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights)  # (..., L, Ev)
        out, weights = out if return_weights else (out, None)
        if self.w_o is not None:
            out = out @ self.w_o  # (..., L, Do)
        return (out, weights) if return_weights else out


class MultiHeadAttention:
    """Multi-head attention in NumPy: x (..., L, D) -> output (..., L, D) (chapter 9).

    ``n_heads`` heads of size d = D / H attend side by side, each on its own d columns of the projections; their
    outputs, concatenated back to D columns, go through w_o. ``n_kv_heads`` (default ``n_heads``) below
    ``n_heads`` gives grouped-query attention: fewer key and value heads, each shared by H / Hkv query heads.
    Weights w_q (D, D), w_k and w_v (D, Hkv·d), w_o (D, D), no biases, each drawn from Xavier's U(-a, a) with
    ``rng`` (a seed or a ``numpy.random.Generator``) in ``dtype``.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, rng=None, dtype=np.float32):
        self.d_model, self.n_heads, self.n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads)
        self.d_head = self.d_model // self.n_heads
        rng = np.random.default_rng(rng)
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

    def __call__(self, x, mask=None, *, context=None, causal=False, cache=None, return_weights=False):
        """Attend: output (..., L, D), and the weights (..., H, L, S) too with ``return_weights=True``.

        Self-attention by default; ``context`` (..., S, D), with x's batch dimensions, supplies the keys and values
        for cross-attention. ``mask`` broadcasts to (..., L, S) and every head applies it (boolean True = may
        attend). ``causal=True`` is aligned bottom-right (:func:`grouped_attention`). With ``cache``, a
        :class:`lib.decoding.KVCache`, this call's keys and values are appended to it and the queries attend every
        key it holds: x is then the next tokens of a sequence whose earlier tokens went through the cache.
        """
        x = np.asarray(x)
        _check_input(x, self.d_model)
        source = x if context is None else _check_context(np.asarray(context), x, self.d_model)
        q, k, v = _project_heads(self, x, source)  # (..., H, L, d), (..., Hkv, S, d), (..., Hkv, S, d)
        if cache is not None:
            k, v = cache.append(k, v)  # (..., Hkv, S, d): every token so far
        out = grouped_attention(q, k, v, mask, causal=causal, return_weights=return_weights)  # (..., H, L, d)
        out, weights = out if return_weights else (out, None)
        out = merge_heads(out) @ self.w_o  # (..., L, D)
        return (out, weights) if return_weights else out


# --------------------------------------------------------------------------------------------------------------
# PyTorch, built on first use so that importing this module never imports torch
# --------------------------------------------------------------------------------------------------------------


def _check_dropout(dropout):
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_torch_input(x, weight, name, numpy_twin):
    """x must be a tensor on the weights' device and in their dtype; the message says which fix applies."""
    if not _is_tensor(x):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}; {numpy_twin} takes NumPy")
    if x.device != weight.device:
        raise ValueError(f"{name} is on device {x.device} but the module is on {weight.device}: move one of them")
    if x.dtype != weight.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} but the module's weights are {weight.dtype}: convert one")


def _build_torch_class():
    import torch
    from torch import nn

    class TorchSelfAttention(nn.Module):
        """Single-head self-attention as a ``torch.nn.Module``: x (..., L, D) -> output (..., L, Do) (chapter 6).

        The twin of :class:`SelfAttention`: same arguments, parameter names (w_q, w_k, w_v and, with ``d_out``,
        w_o), (in, out) layout and Xavier initialisation, drawn from torch's global generator. ``dropout`` is
        the probability of zeroing each attention weight while the module is training; ``module.eval()``
        turns it off.
        """

        def __init__(self, d_model, d_k, d_v=None, d_out=None, *, dropout=0.0, device=None, dtype=None):
            super().__init__()
            self.d_model, self.d_k, self.d_v, self.d_out = _check_dims(d_model, d_k, d_v, d_out)
            self.dropout = _check_dropout(dropout)
            for name, (fan_in, fan_out) in _shapes(self.d_model, self.d_k, self.d_v, self.d_out).items():
                w = torch.empty(fan_in, fan_out, device=device, dtype=dtype)
                a = xavier_bound(fan_in, fan_out)
                self.register_parameter(name, nn.Parameter(nn.init.uniform_(w, -a, a)))
            if self.d_out is None:
                self.register_parameter("w_o", None)

        def extra_repr(self):
            return _sizes(self)

        def num_parameters(self):
            """How many numbers the module learns."""
            return sum(p.numel() for p in self.parameters())

        def forward(self, x, mask=None, *, causal=False, return_weights=False):
            """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

            ``mask`` and ``causal`` are passed to :mod:`lib.attention` (boolean True = may attend). While
            training with ``dropout > 0`` the weights are dropped out before they mix the values, and the
            returned weights are the dropped-out ones.
            """
            _check_torch_input(x, self.w_q, "x", "SelfAttention")
            _check_input(x, self.d_model)
            q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
            if self.training and self.dropout > 0:
                weights = attn.attention_weights(q, k, mask, causal=causal)  # (..., L, L)
                weights = nn.functional.dropout(weights, self.dropout, training=True)
                out = weights @ v  # (..., L, Ev)
            else:
                out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights)  # (..., L, Ev)
                out, weights = out if return_weights else (out, None)
            if self.w_o is not None:
                out = out @ self.w_o  # (..., L, Do)
            return (out, weights) if return_weights else out

    TorchSelfAttention.__module__ = __name__
    TorchSelfAttention.__qualname__ = "TorchSelfAttention"
    return TorchSelfAttention


def _build_torch_multihead_class():
    import torch
    from torch import nn

    class TorchMultiHeadAttention(nn.Module):
        """Multi-head attention as a ``torch.nn.Module``: x (..., L, D) -> output (..., L, D) (chapter 9).

        The twin of :class:`MultiHeadAttention`: same arguments, parameter names (w_q, w_k, w_v, w_o), (in, out)
        layout and Xavier initialisation, drawn from torch's global generator. The heads go to
        ``torch.nn.functional.scaled_dot_product_attention`` as 4-D (B, H, L, d) tensors, the only shape its fused
        kernels take, with ``enable_gqa=True`` when n_kv_heads < n_heads. ``dropout`` is the probability of
        zeroing each attention weight while the module is training; ``module.eval()`` turns it off.
        """

        def __init__(self, d_model, n_heads, n_kv_heads=None, *, dropout=0.0, device=None, dtype=None):
            super().__init__()
            self.d_model, self.n_heads, self.n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads)
            self.d_head = self.d_model // self.n_heads
            self.dropout = _check_dropout(dropout)
            for name, (fan_in, fan_out) in _head_shapes(self.d_model, self.n_heads, self.n_kv_heads).items():
                w = torch.empty(fan_in, fan_out, device=device, dtype=dtype)
                a = xavier_bound(fan_in, fan_out)
                self.register_parameter(name, nn.Parameter(nn.init.uniform_(w, -a, a)))

        def extra_repr(self):
            return _head_sizes(self)

        def num_parameters(self):
            """How many numbers the module learns."""
            return sum(p.numel() for p in self.parameters())

        def forward(self, x, mask=None, *, context=None, causal=False, cache=None, return_weights=False):
            """Attend: output (..., L, D), and the weights (..., H, L, S) too with ``return_weights=True``.

            Arguments as :meth:`MultiHeadAttention.__call__` (boolean mask True = may attend, ``causal`` aligned
            bottom-right, ``cache`` a :class:`lib.decoding.KVCache`). Without ``return_weights`` the attention is
            ``scaled_dot_product_attention``; the weights, which it never returns, come from
            :func:`grouped_attention`, dropped out while training like the output they mix.
            """
            _check_torch_input(x, self.w_q, "x", "MultiHeadAttention")
            _check_input(x, self.d_model)
            source = x
            if context is not None:
                _check_torch_input(context, self.w_q, "context", "MultiHeadAttention")
                source = _check_context(context, x, self.d_model)
            q, k, v = _project_heads(self, x, source)  # (..., H, L, d), (..., Hkv, S, d), (..., Hkv, S, d)
            if cache is not None:
                k, v = cache.append(k, v)  # (..., Hkv, S, d): every token so far
            p = self.dropout if self.training else 0.0
            if return_weights:
                drop = None if p == 0 else (lambda w: nn.functional.dropout(w, p, training=True))
                out, weights = _grouped(q, k, v, self._mask(mask, causal, q, k), True, drop)  # (..., H, L, d)
            else:
                out, weights = _sdpa(q, k, v, mask, causal, p), None  # (..., H, L, d)
            out = merge_heads(out) @ self.w_o  # (..., L, D)
            return (out, weights) if return_weights else out

        @staticmethod
        def _mask(mask, causal, q, k):
            return _heads_mask(_backend({"q": q}), mask, causal, q.shape[:-3], q.shape[-2], k.shape[-2], q)

    def _sdpa(q, k, v, mask, causal, dropout_p):
        """scaled_dot_product_attention on (B, H, L, d) views of the heads, B the product of the batch dimensions.

        Every fused kernel needs 4-D inputs; given 3-D ones SDPA silently runs its unfused math kernel and builds
        the whole (L, S) matrix (chapter 7). A causal self-attention without a mask passes ``is_causal=True``, so a
        fused kernel may skip the masked blocks; anything else passes an explicit mask of our polarity.
        """
        *batch, H, L, d = q.shape
        Hkv, S, dv = k.shape[-3], k.shape[-2], v.shape[-1]
        B = math.prod(batch)
        is_causal = causal and mask is None and L == S  # top-left and bottom-right agree when L = S
        mask = _heads_mask(_backend({"q": q}), mask, causal and not is_causal, tuple(batch), L, S, q)
        if mask is not None:
            if mask.ndim <= 2:
                mask = mask.broadcast_to((L, S)).reshape(1, 1, L, S)
            else:
                mask = mask.broadcast_to((*batch, L, S)).reshape(B, 1, L, S)  # a view: broadcast dims have stride 0
            if mask.is_floating_point():
                mask = mask.to(q.dtype)  # SDPA adds a floating mask in the queries' dtype
        gqa = {"enable_gqa": True} if Hkv != H else {}  # torch >= 2.5
        out = nn.functional.scaled_dot_product_attention(
            q.reshape(B, H, L, d), k.reshape(B, Hkv, S, d), v.reshape(B, Hkv, S, dv),
            attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, **gqa,
        )  # (B, H, L, dv)
        return out.reshape(*batch, H, L, dv)  # (..., H, L, dv)

    TorchMultiHeadAttention.__module__ = __name__
    TorchMultiHeadAttention.__qualname__ = "TorchMultiHeadAttention"
    return TorchMultiHeadAttention


_TORCH_CLASSES = {"TorchSelfAttention": _build_torch_class, "TorchMultiHeadAttention": _build_torch_multihead_class}


def __getattr__(name):
    if name in _TORCH_CLASSES:
        cls = _TORCH_CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    """The module's names with the torch classes, which exist once asked for (so help() and the API page list them)."""
    return sorted(set(globals()) | set(_TORCH_CLASSES))


def to_multihead_attention(module):
    """A ``torch.nn.MultiheadAttention`` (batch_first, no biases) computing what ``module`` computes.

    ``module`` is a one-head :class:`SelfAttention` or :class:`TorchSelfAttention` with d_k = d_v = d_model (one
    head of ``nn.MultiheadAttention`` projects to embed_dim = d_model), or a :class:`MultiHeadAttention` or
    :class:`TorchMultiHeadAttention` without grouped key/value heads. The packed ``in_proj_weight`` (3D, D) is
    [w_qᵀ; w_kᵀ; w_vᵀ], rows as outputs, head i owning rows i·d to (i+1)·d - 1 of each block; ``out_proj`` gets
    w_oᵀ, or the identity when a one-head module has no w_o (then d_out must be d_model too). It keeps the
    module's dropout probability (0 for the NumPy modules), which acts only while it trains. Call it as
    ``mha(x, x, x)``; its masks use True = may NOT attend.
    """
    import torch
    from torch import nn

    D = module.d_model
    n_heads = getattr(module, "n_heads", None)
    if n_heads is None:
        for name in ("d_k", "d_v"):
            if getattr(module, name) != D:
                raise ValueError(
                    f"{name}={getattr(module, name)} but d_model={D}: one head of nn.MultiheadAttention projects "
                    "queries, keys and values to d_model"
                )
        if module.d_out not in (None, D):
            raise ValueError(f"d_out={module.d_out} but d_model={D}: nn.MultiheadAttention's out_proj is D x D")
        n_heads = 1
    elif module.n_kv_heads != n_heads:
        raise ValueError(
            f"n_kv_heads={module.n_kv_heads} but n_heads={n_heads}: nn.MultiheadAttention has one key/value head "
            "per query head (no grouped-query attention)"
        )
    state = module.state_dict()
    if isinstance(module, (SelfAttention, MultiHeadAttention)):
        state = {n: torch.from_numpy(w) for n, w in state.items()}
    like = state["w_q"]
    dropout = getattr(module, "dropout", 0.0)  # the NumPy modules have none
    mha = nn.MultiheadAttention(
        D, n_heads, dropout=dropout, bias=False, batch_first=True, device=like.device, dtype=like.dtype
    )
    w_o = state.get("w_o")
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([state["w_q"].T, state["w_k"].T, state["w_v"].T]))  # (3D, D)
        mha.out_proj.weight.copy_(torch.eye(D, dtype=like.dtype, device=like.device) if w_o is None else w_o.T)
    return mha


def from_multihead_attention(mha):
    """A :class:`TorchMultiHeadAttention` holding the weights of ``mha``, a ``torch.nn.MultiheadAttention``.

    The inverse of :func:`to_multihead_attention`: ``in_proj_weight`` (3D, D) is cut into its three (D, D) blocks,
    each transposed to the (in, out) layout, and ``out_proj.weight`` becomes w_oᵀ. The result has mha's heads,
    dropout, device and dtype. These modules have no biases, so mha's must be absent or zero (a freshly built
    ``nn.MultiheadAttention`` starts them at zero); keys and values of their own size (kdim, vdim) and
    ``add_bias_kv`` or ``add_zero_attn`` are refused. The result reads x as (..., L, D), batch first, whatever
    ``mha.batch_first`` says. Remember the polarity: our masks are True = may attend.
    """
    import torch

    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if not mha._qkv_same_embed_dim:
        raise ValueError(
            f"mha has kdim={mha.kdim}, vdim={mha.vdim} but embed_dim={mha.embed_dim}: only the packed "
            "in_proj_weight of kdim = vdim = embed_dim is supported"
        )
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("mha was built with add_bias_kv or add_zero_attn, which these modules do not have")
    for name, bias in (("in_proj_bias", mha.in_proj_bias), ("out_proj.bias", mha.out_proj.bias)):
        if bias is not None and bool((bias.detach() != 0).any()):
            raise ValueError(f"mha's {name} is not zero, and these modules have no biases: build it with bias=False")
    w = mha.in_proj_weight.detach()
    cls = globals().get("TorchMultiHeadAttention") or __getattr__("TorchMultiHeadAttention")  # built once
    module = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, device=w.device, dtype=w.dtype)
    w_q, w_k, w_v = w.chunk(3)  # each (D, D), rows as outputs
    with torch.no_grad():
        for name, value in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", mha.out_proj.weight.detach())):
            getattr(module, name).copy_(value.T)  # (in, out)
    return module
