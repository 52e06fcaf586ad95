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


def _is_floating(ops, x):
    if ops is _NUMPY:
        return np.asarray(x).dtype.kind == "f"
    return x.is_floating_point()


def _same_float(ops, named):
    """[(name, array)] as floating arrays of one dtype; mixed floating dtypes are refused, as SDPA refuses them.

    Integers take the floating inputs' dtype (the backend's default float if none is floating). Promoting
    float32 with float64 silently would teach code that ``scaled_dot_product_attention`` rejects."""
    if ops is _NUMPY:
        named = [(n, x if isinstance(x, np.ndarray) else _as_float(ops, x, n)) for n, x in named]
    floats = [(n, x) for n, x in named if _is_floating(ops, x)]
    for n, x in floats[1:]:
        if x.dtype != floats[0][1].dtype:
            first, dtype = floats[0][0], floats[0][1].dtype
            raise TypeError(
                f"{n} has dtype {x.dtype} but {first} has {dtype}: q, k and v must share one dtype, as "
                f"scaled_dot_product_attention requires; cast with "
                + (f"{n}.astype({first}.dtype)" if ops is _NUMPY else f"{n}.to({first}.dtype)")
            )
    out = []
    for n, x in named:
        x = _as_float(ops, x, n)
        if floats and x.dtype != floats[0][1].dtype:  # an integer input, now in the default float
            x = ops.astype(x, floats[0][1].dtype)
        out.append(x)
    return out


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


def _prepare(q, k, v, mask, scale, *, need_v=True, keep_half=False, key_padding_mask=None):
    """Validate q, k, v and mask; return (ops, q, k, v, mask, scale, out_dtype, batch, L, S) ready to compute.

    q, k, v come back in the compute dtype (with ``keep_half``, half precision stays half), batch dims not yet
    broadcast; the mask comes back boolean or in the compute dtype, still at its own (broadcastable) shape, with
    ``key_padding_mask`` (B, S) folded into it (see :func:`_key_padding`).
    """
    named = {"q": q, "k": k, "v": v if need_v else None, "mask": mask, "key_padding_mask": key_padding_mask}
    for n in ("q", "k") + (("v",) if need_v else ()):
        if named[n] is None:
            raise TypeError(f"{n} is required, got None")
    ops = _backend(named)
    arrays = _same_float(ops, [(n, x) for n, x in zip(_NAMES, (q, k, v)) if x is not None])
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
        mask = _check_mask(ops, mask, batch + (L, S), cdtype, q_dtype=out_dtype)
    if key_padding_mask is not None:
        mask = _with_key_padding(ops, mask, _key_padding(ops, key_padding_mask, batch, S))
    return ops, q, k, v, mask, scale, out_dtype, batch, L, S


KEY_PADDING_FIX = "pass it as key_padding_mask= (True or 1 = a real token), or as mask=m[:, None, None, :]"


def _key_padding(ops, kpm, batch, S):
    """A (B, S) key padding mask, True or 1 on real tokens (Hugging Face's ``attention_mask``), as a boolean mask
    (B, 1, ..., 1, S) that meets the scores (B, ..., L, S) on their first axis: sequence b's tokens, every head
    and query of sequence b. ``nn.MultiheadAttention``'s key_padding_mask (True = ignore) is ``~m``."""
    if ops is _NUMPY:
        kpm = np.asarray(kpm)
        is_bool, kind = kpm.dtype.kind == "b", kpm.dtype.kind
        numeric = kind in "iuf"
    else:
        is_bool = kpm.dtype == ops.torch.bool
        numeric = not is_bool and not kpm.is_complex()
    if not (is_bool or numeric):
        raise TypeError(f"key_padding_mask has dtype {kpm.dtype}: pass booleans or 0/1, True or 1 = a real token")
    if not batch:
        raise ValueError(
            f"key_padding_mask holds one row per sequence (B, S), but q has no batch axis: scores (L, S) = "
            f"(..., {S}); give q a batch axis or pass a (S,) key mask as mask="
        )
    B = batch[0]
    if kpm.ndim != 2 or _shape(kpm)[1] != S or _shape(kpm)[0] not in (1, B):
        raise ValueError(
            f"key_padding_mask must have shape (B, S) = ({B}, {S}), one row per sequence, got {_shape(kpm)}"
        )
    if not is_bool:
        if bool(((kpm != 0) & (kpm != 1)).any()):
            raise ValueError("key_padding_mask holds values other than 0 and 1: it says which keys are real tokens "
                             "(1 or True) and which are padding (0 or False); an additive bias goes in mask=")
        kpm = kpm != 0
    return kpm.reshape(_shape(kpm)[:1] + (1,) * len(batch) + (S,))  # (B, 1, ..., 1, S)


def _with_key_padding(ops, mask, allowed):
    if mask is None:
        return allowed
    if _is_bool(ops, mask):
        return mask & allowed
    return ops.where(allowed, mask, -math.inf)


def _check_mask(ops, mask, scores_shape, cdtype, q_dtype=None):
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
    batch, (L, S) = scores_shape[:-2], scores_shape[-2:]
    if fits and is_bool and len(mshape) == 2 and len(batch) >= 1 and batch[0] == L > 1 and mshape[0] == L:
        raise ValueError(
            f"a 2-D boolean mask of shape {mshape} is ambiguous on scores {scores_shape}, whose batch B={L} equals "
            f"the query length L={L}: it would be read as (L, S), one row per query. If it is a (B, S) padding mask "
            f"(one row per sequence), {KEY_PADDING_FIX}; if it is an (L, S) mask shared by every sequence, pass "
            "mask=m[None] (or causal=True for the causal pattern)"
        )
    if not fits:
        hint = ""
        if len(mshape) > len(scores_shape) and len(mshape) >= 4 and mshape[-3:-1] == (1, 1):
            hint = (": a (B, 1, 1, S) padding mask is for split heads, scores (B, H, L, S); for scores (B, L, S) "
                    "build it with padding_mask(lengths, S, heads=False)")
        elif len(mshape) == 2 and batch and mshape == (batch[0], S):
            hint = f": a (B, S) padding mask, one row per sequence? {KEY_PADDING_FIX}"
        raise ValueError(
            f"mask of shape {mshape} does not broadcast to the scores' shape {scores_shape} "
            f"(..., L, S) with L={scores_shape[-2]}, S={scores_shape[-1]}{hint}"
        )
    if mask.ndim < 2:  # a key mask (S,) or a scalar: give it the (L, S) axes the tiles slice
        mask = mask.reshape((1,) * (2 - mask.ndim) + mshape)
    if is_bool:
        return mask
    if q_dtype is not None and _less_precise(ops, mask.dtype, q_dtype):
        raise TypeError(
            f"mask has dtype {mask.dtype} but q has {q_dtype}: a floating mask less precise than q is refused, as "
            "scaled_dot_product_attention refuses it (its large negative fill is not a large negative in q's "
            "dtype); build the mask in q's dtype, or pass a boolean mask (True = may attend)"
        )
    bad = ops.isnan(mask) | (mask == math.inf)
    if bool(bad.any()):
        raise ValueError("a floating mask may hold finite values and -inf only; it holds NaN or +inf")
    if mask.ndim and math.prod(mshape) and bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()):
        raise ValueError(
            "a floating mask is added to the scores, and this one holds only 0 and 1, so it masks nothing; did you "
            "mean `mask.bool()` (True = may attend) or `key_padding_mask=` (a (B, S) mask, 1 = a real token)?"
        )
    return ops.astype(mask, cdtype)


def _less_precise(ops, mask_dtype, q_dtype):
    """A floating mask of fewer mantissa bits than q's (float16 on float64); a more precise one (NumPy's float64
    masks on float32 q) is rounded to q's dtype, where -inf stays -inf."""
    if ops is _NUMPY:
        if np.dtype(q_dtype).kind != "f":
            return False
        return np.finfo(mask_dtype).bits < np.finfo(q_dtype).bits or np.finfo(mask_dtype).eps > np.finfo(q_dtype).eps
    torch = ops.torch
    if not q_dtype.is_floating_point:
        return False
    return torch.finfo(mask_dtype).eps > torch.finfo(q_dtype).eps


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


AXES = ("bhsd", "bshd")


def _check_axes(axes):
    """The named axis order of q, k, v and the output: ``"bhsd"`` (..., H, S, D), the library's and SDPA's, or
    ``"bshd"`` (B, S, H, D), flash-attn's and a model's activations before the heads are moved forward."""
    if not isinstance(axes, str) or axes not in AXES:
        raise ValueError(f"axes must be 'bhsd' (batch, heads, tokens, size: the library's and SDPA's layout) or "
                         f"'bshd' (batch, tokens, heads, size: flash-attn's), got {axes!r}")
    return axes


def _from_axes(axes, named):
    """{name: tensor} in the layout ``axes`` names, each as (B, H, S, D); a tensor whose rank contradicts the
    layout is refused. (B, S, H, D) has exactly four axes, so a 'bshd' tensor of any other rank is not one."""
    if _check_axes(axes) == "bhsd":
        return named
    out = {}
    for name, x in named.items():
        if x is None:
            out[name] = x
            continue
        shape = _shape(x)
        if len(shape) != 4:
            raise ValueError(f"axes='bshd' names {name} as (B, S, H, D), four axes, but {name} has shape {shape}")
        out[name] = x.swapaxes(1, 2)  # (B, H, S, D)
    return out


def _to_axes(axes, x):
    """A (B, H, L, D) result back in the caller's layout."""
    return x if axes == "bhsd" else x.swapaxes(1, 2)
