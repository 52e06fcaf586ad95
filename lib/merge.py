"""The attention state (out, lse) of a block of keys, and the one merge that combines such states (chapter 12).

Chapter 7's online softmax keeps, for each query row, a running maximum m, a running total l of exp(score - m) and
an accumulator of exp(score - m) v. Divide the accumulator by l and fold m and l into one number, the row's
logsumexp lse = m + log l, and the pair (out, lse) says everything a later step needs about the keys seen so far:

    out (..., L, Ev)   the normalised attention output over those keys alone
    lse (..., L)       log sum_j exp(score_j) in the natural log; -inf if no key is allowed

Two states over disjoint sets of keys merge into the state over their union: lse = logaddexp(lse_a, lse_b) and
out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b, a convex combination. Split-KV decoding merges across kernel
programs, ring attention across processes, both with this rule. Shapes as in :mod:`lib.attention`.
"""

from __future__ import annotations

import math

import numpy as np

from lib.backend import (
    _NUMPY,
    _apply_mask,
    _backend,
    _causal_pattern,
    _check_axes,
    _check_causal,
    _compute_dtype,
    _from_axes,
    _prepare,
    _shape,
    _to_axes,
)

__all__ = ["attention_state", "merge_states"]


def _log(ops, x):
    if ops is _NUMPY:
        with np.errstate(divide="ignore"):  # log(0) = -inf is the empty row's lse, on purpose
            return np.log(x)
    return ops.torch.log(x)


def _lse_dtype(ops, dtype):
    """The logsumexp of half-precision input stays float32, as kernels store it: bf16 would round it by 0.4%."""
    return _compute_dtype(ops, dtype)


def attention_state(q, k, v, mask=None, *, causal=False, scale=None, key_padding_mask=None, axes="bhsd"):
    """The attention state of q over the keys k, v: (out (..., L, Ev), lse (..., L)) (chapter 12).

    ``out`` is attention(q, k, v) over these keys alone, in the caller's dtype; ``lse`` is each row's natural-log
    logsumexp of its allowed scores, log sum_j exp(score_j), in float32 for half-precision input and the caller's
    dtype otherwise. A row with no allowed key (all masked, or S = 0) gets zeros and lse = -inf, which the merge
    treats as "no keys". ``mask``: boolean, True where a query may attend a key (as SDPA; the opposite of
    ``nn.MultiheadAttention``), or floating, added to the scores. ``causal`` as in :func:`lib.attention.attention`:
    True or ``"top-left"`` lets query i attend keys j <= i, ``"bottom-right"`` keys j <= i + S - L.
    ``key_padding_mask`` (B, S), True or 1 on real tokens, as in :func:`lib.attention.attention`. ``axes="bshd"``
    takes q, k, v as flash-attn's (B, L, H, E) and answers as flash-attn does: out (B, L, H, Ev), lse (B, H, L).
    """
    named = _from_axes(axes, {"q": q, "k": k, "v": v})
    q, k, v = named["q"], named["k"], named["v"]
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale,
                                                                 key_padding_mask=key_padding_mask)
    causal = _check_causal(causal, L, S)  # None, or the offset of the causal diagonal
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (..., L, S)
    allowed = None if causal is None else _causal_pattern(ops, range(L), range(S), q, causal)
    scores = _apply_mask(ops, scores, mask, allowed)
    if S:
        m = ops.amax(scores, -1)  # (..., L, 1)
    else:
        m = ops.full(_shape(scores)[:-1] + (1,), -math.inf, scores)
    shift = ops.where(m == -math.inf, 0.0, m)  # an empty row shifts by 0, so -inf - -inf never makes NaN
    e = ops.exp(scores - shift)  # (..., L, S)
    total = ops.sum(e, -1)  # (..., L, 1)
    out = (e @ v) / ops.where(total == 0, 1.0, total)  # (..., L, Ev)
    lse = (shift + _log(ops, total))[..., 0]  # (..., L); log 0 = -inf where no key was allowed
    lse = ops.where(m[..., 0] == -math.inf, -math.inf, lse)
    out = ops.astype(ops.broadcast_to(out, batch + (L,) + _shape(v)[-1:]), out_dtype)
    lse = ops.astype(ops.broadcast_to(lse, batch + (L,)), _lse_dtype(ops, out_dtype))
    return _to_axes(axes, out), lse  # out (..., L, Ev) or (B, L, H, Ev); lse (..., L), (B, H, L) either way


def _check_states(states, axes="bhsd"):
    try:
        states = None if isinstance(states, (str, bytes)) else list(states)
    except TypeError:
        states = None
    if states is None:
        raise TypeError("states must be an iterable of (out, lse) pairs")
    if not states:
        raise ValueError("merge_states needs at least one (out, lse) state, got none")
    for i, state in enumerate(states):
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError(f"states[{i}] must be a pair (out, lse), got {type(state).__name__}")
    named = {f"out{i}": s[0] for i, s in enumerate(states)} | {f"lse{i}": s[1] for i, s in enumerate(states)}
    for name, x in named.items():
        if x is None:
            raise TypeError(f"{name} is None: a state is a pair of arrays (out, lse)")
    ops = _backend(named)
    if ops is _NUMPY:  # plain lists and scalars are read as NumPy arrays
        try:
            named = {name: np.asarray(x) for name, x in named.items()}
        except (ValueError, TypeError) as err:
            raise TypeError(f"a state could not be read as numeric arrays: {err}") from None
        states = [(named[f"out{i}"], named[f"lse{i}"]) for i in range(len(states))]
    for name, x in named.items():
        floating = getattr(x.dtype, "is_floating_point", None)  # torch dtypes answer; NumPy's go by their kind
        if not (floating if floating is not None else np.dtype(x.dtype).kind == "f"):
            raise TypeError(f"{name} has dtype {x.dtype}; attention states are floating point (a weighted average "
                            "of integers would be truncated)")
    if axes == "bshd":
        for i, (out, lse) in enumerate(states):
            o, s = _shape(out), _shape(lse)
            if len(o) != 4 or s != (o[0], o[2], o[1]):
                raise ValueError(f"state {i}: axes='bshd' names flash-attn's layout, out (B, L, H, Ev) and lse "
                                 f"(B, H, L), but out has shape {o} and lse {s}")
        states = [(out.swapaxes(1, 2), lse) for out, lse in states]  # out (B, H, L, Ev)
    out0 = states[0][0]
    for i, (out, lse) in enumerate(states):
        if _shape(out)[:-1] != _shape(lse):
            raise ValueError(f"state {i}: out has shape {_shape(out)} (..., L, Ev) but lse has {_shape(lse)}, "
                             "expected (..., L)")
        if _shape(out) != _shape(out0):
            raise ValueError(f"state {i} has out of shape {_shape(out)} but state 0 has {_shape(out0)}: "
                             "states to merge must cover the same queries")
    return ops, states


def merge_states(states, *, axes="bhsd"):
    """Merge attention states over disjoint sets of keys into the state over all of them (chapter 12).

    ``states`` is an iterable of pairs (out (..., L, Ev), lse (..., L)) as :func:`attention_state` returns; any
    order and grouping give the same result, since a merged state is a state again. The new lse is a
    logaddexp taken against the largest lse, so no exponential exceeds 1 and gaps of hundreds stay finite;
    each out is weighted by exp(lse_i - lse), a weight in [0, 1]. A part with lse = -inf (no keys) gets weight 0;
    a row where no part had a key gets zeros and lse = -inf, never NaN. Half precision is merged in float32 and
    returned in its own dtype; out and lse come back in the dtypes of the first state's.

    ``axes="bshd"`` takes and returns flash-attn's layout, out (B, L, H, Ev) with ``softmax_lse`` (B, H, L); a
    pair whose shapes contradict it is refused. The default reads out (..., L, Ev) with lse (..., L): with
    flash-attn's tensors and L = H that check passes and the merge runs along the wrong axis, so name the layout.
    """
    ops, states = _check_states(states, _check_axes(axes))
    outs = [s[0] for s in states]
    lses = [s[1] for s in states]
    out_dtype = outs[0].dtype
    lse_dtype = lses[0].dtype
    cdtype = _compute_dtype(ops, out_dtype)
    lse_c = ops.stack([ops.astype(x, _compute_dtype(ops, lse_dtype)) for x in lses], 0)  # (P, ..., L)
    top = ops.amax(lse_c, 0)  # (1, ..., L)
    top = ops.where(top == -math.inf, 0.0, top)  # every part empty: take 0 so -inf - -inf is never formed
    weights = ops.exp(lse_c - top)  # (P, ..., L), each at most 1
    total = ops.sum(weights, 0)  # (1, ..., L); 0 only where every part was empty
    lse = (top + _log(ops, total))[0]  # (..., L)
    weights = weights / ops.where(total == 0, 1.0, total)  # exp(lse_i - lse), 0 for an empty part
    out = None
    for w, o in zip(weights, outs):
        term = ops.astype(w, cdtype)[..., None] * ops.astype(o, cdtype)  # (..., L, Ev)
        out = term if out is None else out + term
    return _to_axes(axes, ops.astype(out, out_dtype)), ops.astype(lse, lse_dtype)
