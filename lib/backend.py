"""The plumbing under every attention path: NumPy and torch twins of a few operations, and the input checks.

Every algorithm in :mod:`lib.attention` and :mod:`lib.tiles` is written once against ``_NumpyOps`` and
``_TorchOps``, which spell the same small set of operations for each library. ``_prepare`` validates q, k, v and a
mask and names what is wrong. Nothing here is public: the chapters import :mod:`lib.attention`.
Shape vocabulary as in :mod:`lib.attention`: ``...`` batch, ``L`` queries, ``S`` keys, ``E`` q/k size, ``Ev`` v size.
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np

_NAMES = ("q", "k", "v")


# --------------------------------------------------------------------------------------------------------------
# Backends: the few operations whose spelling differs between NumPy and torch. Every algorithm below is written
# once against these; the NumPy twin may work in place (no autograd to protect), the torch twin never does.
# --------------------------------------------------------------------------------------------------------------


class _NumpyOps:
    name = "numpy"

    @staticmethod
    def is_half(dtype):
        return dtype == np.float16

    @staticmethod
    def default_float():
        return np.dtype(np.float64)

    @staticmethod
    def astype(x, dtype):
        return x.astype(dtype, copy=False)

    @staticmethod
    def amax(x, axis):
        return np.max(x, axis=axis, keepdims=True)

    @staticmethod
    def sum(x, axis):
        return np.sum(x, axis=axis, keepdims=True)

    @staticmethod
    def exp(x):
        return np.exp(x)

    @staticmethod
    def isnan(x):
        return np.isnan(x)

    @staticmethod
    def exp_(x):
        return np.exp(x, out=x)

    @staticmethod
    def sub_(x, y):
        return np.subtract(x, y, out=x)

    @staticmethod
    def add_(x, y):
        return np.add(x, y, out=x)

    @staticmethod
    def mul_(x, y):
        return np.multiply(x, y, out=x)

    @staticmethod
    def div_(x, y):
        return np.divide(x, y, out=x)

    @staticmethod
    def fill_where_not_(x, allowed, value):
        np.copyto(x, value, where=~allowed)
        return x

    @staticmethod
    def where(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def maximum(a, b):
        return np.maximum(a, b)

    @staticmethod
    def zeros(shape, like):
        return np.zeros(shape, dtype=like.dtype)

    @staticmethod
    def full(shape, value, like):
        return np.full(shape, value, dtype=like.dtype)

    @staticmethod
    def arange(n, like):
        return np.arange(n)

    @staticmethod
    def broadcast_to(x, shape):
        return np.broadcast_to(x, shape)

    @staticmethod
    def grow(x, other):
        """x, copied out to the broadcast shape of x and other when other has more or larger dims."""
        shape = np.broadcast_shapes(x.shape, other.shape)
        return x if shape == x.shape else np.broadcast_to(x, shape).copy()

    @staticmethod
    def stack(xs, axis):
        return np.stack(xs, axis=axis)

    @staticmethod
    def detach(x):
        return x


class _TorchOps:
    name = "torch"

    def __init__(self, torch):
        self.torch = torch

    def is_half(self, dtype):
        return dtype in (self.torch.float16, self.torch.bfloat16)

    def default_float(self):
        return self.torch.get_default_dtype()

    def astype(self, x, dtype):
        return x.to(dtype)

    def amax(self, x, axis):
        return x.amax(dim=axis, keepdim=True)

    def sum(self, x, axis):
        return x.sum(dim=axis, keepdim=True)

    def exp(self, x):
        return self.torch.exp(x)

    def isnan(self, x):
        return self.torch.isnan(x)

    def exp_(self, x):
        return x.exp()

    def sub_(self, x, y):
        return x - y

    def add_(self, x, y):
        return x + y

    def mul_(self, x, y):
        return x * y

    def div_(self, x, y):
        return x / y

    def fill_where_not_(self, x, allowed, value):
        return x.masked_fill(~allowed, value)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def maximum(self, a, b):
        return self.torch.maximum(a, b)

    def zeros(self, shape, like):
        return self.torch.zeros(shape, dtype=like.dtype, device=like.device)

    def full(self, shape, value, like):
        return self.torch.full(shape, value, dtype=like.dtype, device=like.device)

    def arange(self, n, like):
        return self.torch.arange(n, device=like.device)

    def broadcast_to(self, x, shape):
        return x.expand(shape)

    def grow(self, x, other):
        return x  # out-of-place torch operations broadcast by themselves

    def stack(self, xs, axis):
        return self.torch.stack(xs, dim=axis)

    def detach(self, x):
        return x.detach()


_NUMPY = _NumpyOps()


def _torch_module():
    """The torch module if it has been imported by anyone, else None (NumPy users never pay for importing it)."""
    return sys.modules.get("torch")


def _is_tensor(x):
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _kind(x):
    return "a torch.Tensor" if _is_tensor(x) else f"a {type(x).__module__}.{type(x).__qualname__}"


def _backend(named):
    """Pick the backend for a dict {name: array or None}; every non-None value must be of the same kind."""
    present = {n: x for n, x in named.items() if x is not None}
    tensors = [n for n, x in present.items() if _is_tensor(x)]
    if tensors and len(tensors) != len(present):
        other = next(n for n in present if n not in tensors)
        raise TypeError(
            f"{tensors[0]} is a torch.Tensor but {other} is {_kind(present[other])}: "
            "pass all NumPy arrays or all torch tensors"
        )
    if tensors:
        torch = _torch_module()
        devices = {n: present[n].device for n in tensors}
        first = tensors[0]
        for n in tensors[1:]:
            if devices[n] != devices[first]:
                raise ValueError(
                    f"{first} is on device {devices[first]} but {n} is on {devices[n]}: move them to one device"
                )
        return _TorchOps(torch)
    return _NUMPY


def _as_float(ops, x, name):
    """Check x's dtype and return it as a floating array (integers promoted, half precision kept for now)."""
    if ops is _NUMPY:
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x)
            except (ValueError, TypeError) as err:  # ragged nested lists
                raise TypeError(f"{name} could not be read as a numeric array: {err}") from None
        kind = x.dtype.kind
        if kind == "f":
            return x
        if kind in "iu":
            return x.astype(ops.default_float())
        what = {"b": "bool", "c": "complex"}.get(kind, str(x.dtype))
        raise TypeError(f"{name} has dtype {x.dtype} ({what}); attention needs real floating-point or integer input")
    torch = ops.torch
    if x.is_floating_point():
        return x
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {x.dtype}; attention needs real floating-point or integer input")
    return x.to(ops.default_float())


def _result_dtype(ops, xs):
    if ops is _NUMPY:
        return np.result_type(*xs)
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = ops.torch.promote_types(dtype, x.dtype)
    return dtype


def _compute_dtype(ops, dtype):
    """Half precision accumulates in float32: its 5-bit exponent overflows at exp(11.1)."""
    if ops.is_half(dtype):
        return np.dtype(np.float32) if ops is _NUMPY else ops.torch.float32
    return dtype


def _check_scale(scale, E):
    if scale is None:
        if E == 0:
            raise ValueError("q and k have E=0, so the default scale 1/sqrt(E) is undefined; pass scale=")
        return 1.0 / math.sqrt(E)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _shape(x):
    return tuple(x.shape)


def _prepare(q, k, v, mask, scale, *, need_v=True, keep_half=False):
    """Validate q, k, v and mask; return (ops, q, k, v, mask, scale, out_dtype, batch, L, S) ready to compute.

    q, k, v come back in the compute dtype (with ``keep_half``, half precision stays half), batch dims not yet
    broadcast; the mask comes back boolean or in the compute dtype, still at its own (broadcastable) shape.
    """
    named = {"q": q, "k": k, "v": v if need_v else None, "mask": mask}
    for n in ("q", "k") + (("v",) if need_v else ()):
        if named[n] is None:
            raise TypeError(f"{n} is required, got None")
    ops = _backend(named)
    arrays = [_as_float(ops, x, n) for n, x in zip(_NAMES, (q, k, v)) if x is not None]
    for n, x in zip(_NAMES, arrays):
        if x.ndim < 2:
            dims = "(..., L, E)" if n == "q" else "(..., S, E)" if n == "k" else "(..., S, Ev)"
            raise ValueError(f"{n} must have shape {dims}, at least 2-D; got shape {_shape(x)}")
    q, k = arrays[0], arrays[1]
    v = arrays[2] if need_v else None
    L, E = q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    if k.shape[-1] != E:
        raise ValueError(
            f"k has E={k.shape[-1]} but q has E={E}: queries and keys must have the same size "
            f"(q shape {_shape(q)}, k shape {_shape(k)})"
        )
    if need_v and v.shape[-2] != S:
        raise ValueError(
            f"v has S={v.shape[-2]} rows but k has S={S}: every key needs a value "
            f"(k shape {_shape(k)}, v shape {_shape(v)})"
        )
    batch_shapes = [_shape(x)[:-2] for x in arrays]
    try:
        batch = np.broadcast_shapes(*batch_shapes)
    except ValueError:
        listed = ", ".join(f"{n} {s}" for n, s in zip(_NAMES, batch_shapes))
        raise ValueError(f"the batch dimensions do not broadcast: {listed}") from None
    scale = _check_scale(scale, E)
    out_dtype = _result_dtype(ops, arrays)
    cdtype = out_dtype if keep_half else _compute_dtype(ops, out_dtype)
    q, k = ops.astype(q, cdtype), ops.astype(k, cdtype)
    if need_v:
        v = ops.astype(v, cdtype)
    if mask is not None:
        mask = _check_mask(ops, mask, batch + (L, S), cdtype)
    return ops, q, k, v, mask, scale, out_dtype, batch, L, S


def _check_mask(ops, mask, scores_shape, cdtype):
    if ops is _NUMPY:
        mask = np.asarray(mask)
        kind = mask.dtype.kind
        is_bool, is_float = kind == "b", kind == "f"
    else:
        is_bool = mask.dtype == ops.torch.bool
        is_float = mask.is_floating_point()
    if not (is_bool or is_float):
        raise TypeError(
            f"mask has dtype {mask.dtype}: use a boolean mask (True = may attend) or a floating mask "
            "(added to the scores); integer masks are ambiguous"
        )
    mshape = _shape(mask)
    try:
        fits = np.broadcast_shapes(mshape, scores_shape) == scores_shape
    except ValueError:
        fits = False
    if not fits:
        hint = ""
        if len(mshape) > len(scores_shape) and len(mshape) >= 4 and mshape[-3:-1] == (1, 1):
            hint = (": a (B, 1, 1, S) padding mask is for split heads, scores (B, H, L, S); for scores (B, L, S) "
                    "build it with padding_mask(lengths, S, heads=False)")
        raise ValueError(
            f"mask of shape {mshape} does not broadcast to the scores' shape {scores_shape} "
            f"(..., L, S) with L={scores_shape[-2]}, S={scores_shape[-1]}{hint}"
        )
    if mask.ndim < 2:  # a key mask (S,) or a scalar: give it the (L, S) axes the tiles slice
        mask = mask.reshape((1,) * (2 - mask.ndim) + mshape)
    if is_bool:
        return mask
    mask = ops.astype(mask, cdtype)
    bad = ops.isnan(mask) | (mask == math.inf)
    if bool(bad.any()):
        raise ValueError("a floating mask may hold finite values and -inf only; it holds NaN or +inf")
    return mask


def _apply_mask(ops, scores, mask, allowed):
    """Add a floating mask, then set to -inf every score a boolean mask or the causal pattern forbids."""
    if mask is not None:
        scores = ops.grow(scores, mask)
        if _is_bool(ops, mask):
            allowed = mask if allowed is None else (mask & allowed)
        else:
            scores = ops.add_(scores, mask)
    if allowed is not None:
        scores = ops.fill_where_not_(scores, allowed, -math.inf)
    return scores


def _is_bool(ops, x):
    return x.dtype == (np.bool_ if ops is _NUMPY else ops.torch.bool)


def _causal_pattern(ops, rows, cols, like, offset=0):
    """Boolean (len(rows), len(cols)): True where key index j <= query index i + offset.

    ``offset`` places the diagonal: 0 is top-left alignment, S - L bottom-right (see :func:`_check_causal`)."""
    r = ops.arange(rows.stop, like)[rows.start:]
    c = ops.arange(cols.stop, like)[cols.start:]
    return c[None, :] <= r[:, None] + offset


CAUSAL_CHOICES = "False, True, 'top-left' or 'bottom-right'"


def _check_causal(causal, L, S, *, true="top-left"):
    """The causal alignment as an offset, or None for no causal pattern: query i may attend keys j <= i + offset.

    ``"top-left"`` gives offset 0 (query i is token i of the keys' sequence, as ``is_causal=True`` in
    ``scaled_dot_product_attention``); ``"bottom-right"`` gives S - L (the L queries are the last L of the S keys'
    tokens, as ``torch.nn.attention.bias.causal_lower_right``). ``True`` means ``true``: "top-left" for every
    function of q, k and v. Bottom-right with L > S would leave the first L - S queries with no key, so it raises.
    """
    if isinstance(causal, (bool, np.bool_)):
        if not causal:
            return None
        causal = true
    elif not isinstance(causal, str):
        raise TypeError(f"causal must be {CAUSAL_CHOICES}, got {type(causal).__name__}")
    if causal == "top-left":
        return 0
    if causal == "bottom-right":
        if L > S:
            raise ValueError(
                f"causal='bottom-right' with L={L} queries and S={S} keys would leave the first {L - S} queries "
                "with no key to attend: bottom-right alignment needs L <= S (use 'top-left' or a mask)"
            )
        return S - L
    raise ValueError(f"causal must be {CAUSAL_CHOICES}, got {causal!r}")


def _exp_shifted_(ops, x, axis=-1):
    """(exp(x - max), total) along axis, the exponentials in place for NumPy; softmax is their ratio.

    A row of -inf gives zeros: its max is replaced by 0 before the shift (so -inf - -inf never makes NaN) and
    its total of 0 by 1 (so 0/0 never does)."""
    if x.shape[axis] == 0:  # softmax over no entries: nothing to normalise
        return x, ops.full(_shape(x)[:axis % x.ndim] + (1,) + _shape(x)[axis % x.ndim + 1 :], 1.0, x)
    m = ops.detach(ops.amax(x, axis))
    m = ops.where(m == -math.inf, 0.0, m)
    x = ops.exp_(ops.sub_(x, m))
    total = ops.sum(x, axis)
    return x, ops.where(total == 0, 1.0, total)


def _safe_softmax_(ops, x, axis):
    """Softmax along axis, in place for NumPy; a row of -inf gives zeros."""
    x, total = _exp_shifted_(ops, x, axis)
    return ops.div_(x, total)


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def _check_length(n, name):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be non-negative, got {n}")
    return int(n)


def _like_ops(like):
    if like is None:
        return _NUMPY
    if _is_tensor(like):
        return _TorchOps(_torch_module())
    if isinstance(like, np.ndarray):
        return _NUMPY
    raise TypeError(f"like must be a NumPy array or a torch tensor, got {type(like).__name__}")
