"""Scaled dot-product attention, softmax(Q Kᵀ · scale) V, in NumPy and in PyTorch.

Every public function takes either NumPy arrays or torch tensors and answers in kind: NumPy in, NumPy out;
torch in, torch out on the tensors' own device (CPU, CUDA, MPS), differentiable. Mixing the two is a TypeError.

Shape vocabulary, used in every docstring and shape comment below:

    ...   batch dimensions (any number, broadcast between q, k, v and the mask)
    L     query length (how many tokens ask)
    S     key length (how many tokens answer); L != S is cross-attention
    E     query and key size (d_k in the book)
    Ev    value size (d_v in the book)

    q (..., L, E)   k (..., S, E)   v (..., S, Ev)
    weights (..., L, S)   output (..., L, Ev)

Masks follow ``torch.nn.functional.scaled_dot_product_attention``: a boolean mask is True where a query MAY attend
a key; a floating mask is added to the scores. ``nn.MultiheadAttention``'s ``key_padding_mask`` and ``attn_mask``
use the opposite polarity (True = ignore). A query that may attend to nothing gets zero weights and a zero output.

Dtypes are kept: float32 in, float32 out. float16 and bfloat16 compute in float32 and return their own dtype (except
in :func:`attention` on a CUDA GPU without a mask, which multiplies in half precision and softmaxes float32
scores: see :mod:`lib.speed`); integer inputs are promoted to the backend's default floating dtype.
"""

from __future__ import annotations

import math
import numbers
import warnings

import numpy as np

from lib import speed
from lib.backend import (
    _NUMPY,
    _apply_mask,
    _as_float,
    _backend,
    _causal_pattern,
    _check_causal,
    _check_flag,
    _check_length,
    _compute_dtype,
    _exp_shifted_,
    _from_axes,
    _is_bool,
    _is_tensor,
    _like_ops,
    _prepare,
    _safe_softmax_,
    _shape,
    _to_axes,
    _torch_module,
    _TorchOps,
)

__all__ = [
    "attention",
    "attention_loop",
    "attention_weights",
    "best_device",
    "causal_mask",
    "padding_mask",
    "softmax",
]  # the reference imports nothing above it: the tiles live in lib.tiles, the kernels in lib.flash and
# lib.flash_decode, each exported from there alone


# --------------------------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------------------------


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis`` (chapter 1 derives it; chapter 3 shows why the shift matters).

    Subtracts each row's maximum before exponentiating, so large inputs cannot overflow. A row that is entirely
    ``-inf`` gives zeros, not NaN. float16/bfloat16 are computed in float32 and returned in their own dtype.
    """
    ops = _backend({"x": x})
    x = _as_float(ops, x, "x")
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an integer, got {type(axis).__name__}")
    if not -x.ndim <= axis < x.ndim or x.ndim == 0:
        raise ValueError(f"axis {axis} is out of range for an input with {x.ndim} dimensions")
    out_dtype = x.dtype
    work = ops.astype(x, _compute_dtype(ops, out_dtype))
    if ops is _NUMPY:
        work = work.copy() if work is x else work  # never overwrite the caller's array
    return ops.astype(_safe_softmax_(ops, work, axis), out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Attention, the matrix form
# --------------------------------------------------------------------------------------------------------------


def _full_attention(ops, q, k, v, mask, causal, scale, batch, L, S, weights):
    """The whole (..., L, S) matrix of exp(score - row max), and with ``v`` the output (..., L, Ev).

    ``causal`` is None or the offset of the causal diagonal (:func:`lib.backend._check_causal`).
    With ``weights`` the matrix is divided by its row totals, the attention weights, and the output is their
    product with v. Without, the matrix is left undivided and the (..., L, Ev) output is divided instead: the
    same result, L·S divisions cheaper. Returns (matrix, output or None)."""
    limit = None
    if ops is _NUMPY and S and speed.workers() > 1 and math.prod(batch) * L * S >= speed.PARALLEL_MIN_SCORES:
        limit = speed.one_blas_thread()
    if limit is not None:
        return speed.full_attention_in_chunks(q, k, v, mask, causal, scale, batch, L, S, weights, limit)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (..., L, S)
    allowed = None if causal is None else _causal_pattern(ops, range(L), range(S), q, causal)
    e, total = _exp_shifted_(ops, _apply_mask(ops, scores, mask, allowed))
    if weights:
        w = ops.div_(e, total)
        return w, None if v is None else w @ v
    return e, ops.div_(e @ v, total)


def attention_weights(q, k, mask=None, *, causal=False, scale=None, key_padding_mask=None):
    """The attention matrix softmax(q kᵀ · scale), shape (..., L, S); each row sums to 1 (chapter 2).

    q (..., L, E), k (..., S, E). ``mask``: boolean, True where a query may attend a key (the opposite of
    ``nn.MultiheadAttention``), or floating, added to the scores; broadcastable to (..., L, S). ``causal`` as in
    :func:`attention`: False (the default), True or ``"top-left"``, or ``"bottom-right"``. ``scale`` defaults
    to 1/sqrt(E). ``key_padding_mask`` as in :func:`attention`. A fully masked row is all zeros.
    """
    ops, q, k, _, mask, scale, out_dtype, batch, L, S = _prepare(q, k, None, mask, scale, need_v=False,
                                                                 key_padding_mask=key_padding_mask)
    causal = _check_causal(causal, L, S)
    w, _ = _full_attention(ops, q, k, None, mask, causal, scale, batch, L, S, weights=True)
    return ops.astype(w, out_dtype)  # (..., L, S)


def attention(q, k, v, mask=None, *, causal=False, scale=None, return_weights=False, key_padding_mask=None,
              axes="bhsd"):
    """Scaled dot-product attention softmax(q kᵀ · scale) v, shape (..., L, Ev) (chapters 2 and 6).

    q (..., L, E), k (..., S, E), v (..., S, Ev); batch dims broadcast. ``mask``: boolean, True where a query
    may attend a key (as in ``torch.nn.functional.scaled_dot_product_attention``; ``nn.MultiheadAttention``
    uses True = ignore), or floating, added to the scores; broadcastable to (..., L, S). ``causal``: False
    (the default); True or ``"top-left"``, query i may attend keys j <= i, as ``is_causal=True`` in
    ``scaled_dot_product_attention``; or ``"bottom-right"``, the L queries are the last L of the S keys' tokens and
    query i may attend keys j <= i + S - L, as ``torch.nn.attention.bias.causal_lower_right`` (it needs L <= S,
    else ValueError). The two alignments agree when L == S; with a mask, both apply.
    ``scale`` defaults to 1/sqrt(E). A query with nothing to attend gets a zero output. With
    ``return_weights=True`` returns (output, weights).

    ``key_padding_mask`` (B, S), one row per sequence, True or 1 on a real token and False or 0 on padding, as
    Hugging Face's ``attention_mask``; it meets the scores (B, ..., L, S) on their first axis, whatever L is.
    ``nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore) is passed as ``key_padding_mask=~m``. Both
    masks apply. A floating ``mask`` of only 0 and 1 (``attention_mask.to(dtype)``) is refused, since adding it
    masks nothing, and so is a 2-D boolean mask on scores whose batch B equals L, which could be (L, S) or (B, S).

    ``axes`` names the layout of q, k, v and the output: ``"bhsd"`` (the default, (..., H, L, E) as SDPA) or
    ``"bshd"`` (B, L, H, E) as flash-attn and a model's projections before the heads move forward; the weights
    are (B, H, L, S) either way.

    float16 and bfloat16 on a CUDA GPU without a mask keep q, k, v and the weights in half precision: the matrix
    products run on the tensor cores, the scores are produced and softmaxed in float32, and the weights are
    rounded to half precision only for the product with v (see :func:`lib.speed.half_attention_on_gpu`).
    Elsewhere half precision is computed in float32.
    """
    named = _from_axes(axes, {"q": q, "k": k, "v": v})
    q, k, v = named["q"], named["k"], named["v"]
    fast = speed.half_attention_on_gpu_applies(q, k, v, mask) and key_padding_mask is None
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale, keep_half=fast,
                                                                 key_padding_mask=key_padding_mask)
    causal = _check_causal(causal, L, S)
    _check_flag(return_weights, "return_weights")
    if fast and S:
        out, w = speed.half_attention_on_gpu(q, k, v, causal, scale)
    else:
        w, out = _full_attention(ops, q, k, v, mask, causal, scale, batch, L, S, weights=return_weights)
    out = _to_axes(axes, ops.astype(out, out_dtype))  # (..., L, Ev), or (B, L, H, Ev) for axes="bshd"
    if return_weights:
        return out, ops.astype(w, out_dtype)  # (..., L, S)
    return out


# --------------------------------------------------------------------------------------------------------------
# Attention, token by token
# --------------------------------------------------------------------------------------------------------------


def attention_loop(q, k, v, mask=None, *, causal=False, scale=None, key_padding_mask=None):
    """Attention written token by token, with explicit loops over queries and keys (chapter 1).

    Same arguments, mask polarity (True = may attend), ``key_padding_mask``, ``causal`` alignments and result as
    :func:`attention`,
    computed one dot product and one exponential at a time. It is slow on purpose: the reference a reader can
    follow line by line.
    """
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale,
                                                                 key_padding_mask=key_padding_mask)
    causal = _check_causal(causal, L, S)
    q = ops.broadcast_to(q, batch + _shape(q)[-2:])
    k = ops.broadcast_to(k, batch + _shape(k)[-2:])
    v = ops.broadcast_to(v, batch + _shape(v)[-2:])
    if mask is not None:
        mask = ops.broadcast_to(mask, batch + (L, S))
    mask_is_bool = mask is not None and _is_bool(ops, mask)
    outputs = []
    for b in np.ndindex(*batch):
        rows = []
        for i in range(L):
            scores = []  # score of query i against every key j; a forbidden key scores -inf
            for j in range(S):
                s = (q[b + (i,)] * k[b + (j,)]).sum() * scale
                if mask is not None and not mask_is_bool:
                    s = s + mask[b + (i, j)]
                if (causal is not None and j > i + causal) or (mask_is_bool and not bool(mask[b + (i, j)])):
                    s = s - math.inf
                scores.append(s)
            finite = [float(ops.detach(s)) for s in scores if float(ops.detach(s)) != -math.inf]
            top = max(finite, default=0.0)  # shift by the max so no exponential overflows
            exps = [ops.exp(s - top) for s in scores]  # exp(-inf) = 0 removes a forbidden key
            total = sum(exps)
            if not finite:
                total = total + 1.0  # nothing to attend: the weights stay 0 rather than 0/0
            out = ops.zeros(_shape(v)[-1:], v)  # (Ev,)
            for j in range(S):
                out = out + (exps[j] / total) * v[b + (j,)]
            rows.append(out)
        outputs.append(ops.stack(rows, 0) if rows else ops.zeros((0,) + _shape(v)[-1:], v))
    result = ops.stack(outputs, 0) if outputs else ops.zeros((0, L) + _shape(v)[-1:], v)
    return ops.astype(result.reshape(batch + (L,) + _shape(v)[-1:]), out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Masks and devices
# --------------------------------------------------------------------------------------------------------------


def causal_mask(L, S=None, *, like=None, align="top-left"):
    """Boolean (L, S) mask, True where query i may attend key j (chapters 5 and 10).

    ``align="top-left"`` (the default, as ``is_causal=True`` in ``scaled_dot_product_attention``): query i may
    attend keys j <= i. ``align="bottom-right"`` (as ``torch.nn.attention.bias.causal_lower_right``): the last
    query is aligned with the last key, so query i may attend keys j <= i + (S - L); this is what L new queries
    need when the first S - L keys come from a cache of earlier tokens. The two agree when L == S. ``S``
    defaults to ``L``. Returns a NumPy array, or a torch tensor on ``like``'s device when ``like`` is a tensor.
    Bottom-right with L > S leaves the first L - S rows all False, and warns (as ``causal_lower_right`` does); the
    attention functions refuse ``causal="bottom-right"`` in that case.
    """
    L = _check_length(L, "L")
    S = L if S is None else _check_length(S, "S")
    if not isinstance(align, str) or align not in ("top-left", "bottom-right"):
        raise ValueError(f"align must be 'top-left' or 'bottom-right', got {align!r}")
    ops = _like_ops(like)
    like = like if like is not None else np.empty(0)
    if align == "top-left":
        return _causal_pattern(ops, range(L), range(S), like)
    if L > S:
        warnings.warn(
            f"a bottom-right causal mask with L={L} > S={S} leaves the first {L - S} queries with no key to attend",
            stacklevel=2,
        )
    rows = ops.arange(L, like)[:, None] + (S - L)  # (L, 1): the key position each query sits at
    return ops.arange(S, like)[None, :] <= rows  # (L, S)


def padding_mask(lengths, S, *, heads=True):
    """Boolean mask, True on each sequence's first ``lengths[b]`` keys, the real tokens (chapter 5).

    A per-sequence argument is read per sequence: the mask is (B, 1, 1, S) by default, SDPA's 4-D layout, which
    broadcasts against multi-head scores (B, H, L, S) as sequence b on every head of sequence b. For single-head
    scores (B, L, S) pass ``heads=False``: the mask is then (B, 1, S). Each layout refuses the other's scores
    with a ValueError (a (B, 1, S) mask against (B, H, L, S) would broadcast as (1, B, 1, S) and pair sequence b
    with head b). The multi-head modules and :func:`lib.modules.grouped_attention` take either.
    ``lengths`` is a 1-D sequence of integers, each between 0 and ``S``; a torch tensor gives a torch mask on
    its device.
    """
    S = _check_length(S, "S")
    _check_flag(heads, "heads")
    if _is_tensor(lengths):
        ops = _TorchOps(_torch_module())
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == ops.torch.bool:
            raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
        lens = lengths
    else:
        ops = _NUMPY
        lens = np.asarray(lengths)
        if lens.dtype.kind not in "iu":
            raise TypeError(f"lengths must hold integers, got dtype {lens.dtype}")
    if lens.ndim != 1:
        raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {_shape(lens)}")
    if lens.shape[0] and bool((lens < 0).any()):
        raise ValueError(f"lengths must be non-negative, got {lens.tolist()}")
    if lens.shape[0] and bool((lens > S).any()):
        raise ValueError(f"lengths must be at most S={S}, got {lens.tolist()}")
    positions = ops.arange(S, lens)  # (S,)
    mask = (positions[None, :] < lens[:, None])[:, None, :]  # (B, 1, S)
    return mask[:, None] if heads else mask  # (B, 1, 1, S), or (B, 1, S) with heads=False


def best_device():
    """The best torch device here: CUDA, else Apple's MPS, else the CPU (the chapters' set-up uses it)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
