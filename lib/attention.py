"""Scaled dot-product attention, softmax(Q Kᵀ · scale) V, in NumPy and in PyTorch.

Every public function takes either NumPy arrays or torch tensors and answers in kind: NumPy in, NumPy out;
torch in, torch out on the tensors' own device (CPU, CUDA, MPS), differentiable. Mixing the two is a TypeError.

Shape vocabulary, used in every docstring and shape comment below:

    ...   batch dimensions (any number, broadcast between q, k, v and the mask)
    L     query length (how many tokens ask)
    S     key length (how many tokens answer); L != S is cross-attention
    E     query and key size (d_k in the book)
    Ev    value size (d_v in the book)

    q (..., L, E)   k (..., S, E)   v (..., S, Ev)   weights (..., L, S)   output (..., L, Ev)

Masks follow ``torch.nn.functional.scaled_dot_product_attention``: a boolean mask is True where a query MAY attend
a key; a floating mask is added to the scores. ``nn.MultiheadAttention``'s ``key_padding_mask`` and ``attn_mask``
use the opposite polarity (True = ignore). A query that may attend to nothing gets zero weights and a zero output.

Dtypes are kept: float32 in, float32 out. float16 and bfloat16 compute in float32 and return their own dtype;
integer inputs are promoted to the backend's default floating dtype.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "attention",
    "attention_loop",
    "attention_weights",
    "best_device",
    "causal_mask",
    "padding_mask",
    "softmax",
    "tiled_attention",
]

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


def _prepare(q, k, v, mask, scale, *, need_v=True):
    """Validate q, k, v and mask; return (ops, q, k, v, mask, scale, out_dtype, batch, L, S) ready to compute.

    q, k, v come back in the compute dtype, batch dims not yet broadcast; the mask comes back boolean or in the
    compute dtype, still at its own (broadcastable) shape.
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
    cdtype = _compute_dtype(ops, out_dtype)
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
        raise ValueError(
            f"mask of shape {mshape} does not broadcast to the scores' shape {scores_shape} "
            f"(..., L, S) with L={scores_shape[-2]}, S={scores_shape[-1]}"
        )
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


def _causal_pattern(ops, rows, cols, like):
    """Boolean (len(rows), len(cols)): True where key index j <= query index i (top-left aligned)."""
    r = ops.arange(rows.stop, like)[rows.start:]
    c = ops.arange(cols.stop, like)[cols.start:]
    return c[None, :] <= r[:, None]


# --------------------------------------------------------------------------------------------------------------
# Threads. NumPy runs each kernel on one core, so a large NumPy problem is cut into independent pieces (chunks of
# rows, blocks of queries) that a small pool of threads works through; NumPy releases the interpreter lock inside
# its kernels. Each thread then keeps BLAS to one thread of its own.
# --------------------------------------------------------------------------------------------------------------


PARALLEL_MIN_SCORES = 1 << 18  # below this many scores a thread pool costs more than it saves


def _workers():
    return max(1, min(4, os.cpu_count() or 1))


_BLAS_CONTROLLER = []  # threadpoolctl's controller, found once: finding the libraries takes a millisecond


def _one_blas_thread():
    """A context that holds BLAS to one thread, or None without threadpoolctl. Each worker then runs its small
    matrix products alone: a pool of workers each starting a team of BLAS threads runs many times slower."""
    if not _BLAS_CONTROLLER:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return None
        _BLAS_CONTROLLER.append(ThreadpoolController())
    return _BLAS_CONTROLLER[0].limit(limits=1, user_api="blas")


# --------------------------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------------------------


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

    With ``weights`` the matrix is divided by its row totals, the attention weights, and the output is their
    product with v. Without, the matrix is left undivided and the (..., L, Ev) output is divided instead: the
    same result, L·S divisions cheaper. Returns (matrix, output or None)."""
    limit = None
    if ops is _NUMPY and S and _workers() > 1 and math.prod(batch) * L * S >= PARALLEL_MIN_SCORES:
        limit = _one_blas_thread()
    if limit is not None:
        return _full_attention_in_chunks(q, k, v, mask, causal, scale, batch, L, S, weights, limit)
    scores = (q * scale) @ k.swapaxes(-1, -2)  # (..., L, S)
    allowed = _causal_pattern(ops, range(L), range(S), q) if causal else None
    e, total = _exp_shifted_(ops, _apply_mask(ops, scores, mask, allowed))
    if weights:
        w = ops.div_(e, total)
        return w, None if v is None else w @ v
    return e, ops.div_(e @ v, total)


ROW_CHUNK = 128  # rows in one chunk of the full matrix on NumPy: fewer make its matrix products inefficient


def _full_attention_in_chunks(q, k, v, mask, causal, scale, batch, L, S, weights, limit):
    """_full_attention on NumPy for a large problem: the full matrix, filled a chunk of rows at a time by a small
    pool of threads, each with one BLAS thread. A chunk goes through its product with kᵀ, its mask, its softmax
    and its product with v while it is still in cache, and no BLAS thread team is left spinning afterwards."""
    qs = np.broadcast_to(q * scale, batch + _shape(q)[-2:])  # (..., L, E)
    kt = np.broadcast_to(k, batch + _shape(k)[-2:]).swapaxes(-1, -2)  # (..., E, S)
    vb = None if v is None else np.broadcast_to(v, batch + _shape(v)[-2:])  # (..., S, Ev)
    mb = None if mask is None else np.broadcast_to(mask, batch + (L, S))
    scores = np.empty(batch + (L, S), dtype=qs.dtype)  # (..., L, S)
    out = None if v is None else np.empty(batch + (L, _shape(v)[-1]), dtype=qs.dtype)  # (..., L, Ev)
    chunks = [(b, slice(i, min(i + ROW_CHUNK, L))) for b in np.ndindex(*batch) for i in range(0, L, ROW_CHUNK)]

    def run(chunk):
        b, rows = chunk
        s = np.matmul(qs[b + (rows,)], kt[b], out=scores[b + (rows,)])  # (rows, S), a view of scores
        allowed = _causal_pattern(_NUMPY, rows, range(S), s) if causal else None
        e, total = _exp_shifted_(_NUMPY, _apply_mask(_NUMPY, s, None if mb is None else mb[b + (rows,)], allowed))
        if weights:
            np.divide(e, total, out=e)
            if out is not None:
                np.matmul(e, vb[b], out=out[b + (rows,)])
        else:
            np.divide(np.matmul(e, vb[b], out=out[b + (rows,)]), total, out=out[b + (rows,)])

    with limit, ThreadPoolExecutor(_workers()) as pool:
        list(pool.map(run, chunks))
    return scores, out


def attention_weights(q, k, mask=None, *, causal=False, scale=None):
    """The attention matrix softmax(q kᵀ · scale), shape (..., L, S); each row sums to 1 (chapter 2).

    q (..., L, E), k (..., S, E). ``mask``: boolean, True where a query may attend a key (the opposite of
    ``nn.MultiheadAttention``), or floating, added to the scores; broadcastable to (..., L, S). ``causal=True``
    also forbids key j > query i; with a mask, both apply. ``scale`` defaults to 1/sqrt(E). A fully masked row
    is all zeros.
    """
    ops, q, k, _, mask, scale, out_dtype, batch, L, S = _prepare(q, k, None, mask, scale, need_v=False)
    _check_flag(causal, "causal")
    w, _ = _full_attention(ops, q, k, None, mask, causal, scale, batch, L, S, weights=True)
    return ops.astype(w, out_dtype)  # (..., L, S)


def attention(q, k, v, mask=None, *, causal=False, scale=None, return_weights=False):
    """Scaled dot-product attention softmax(q kᵀ · scale) v, shape (..., L, Ev) (chapters 2 and 6).

    q (..., L, E), k (..., S, E), v (..., S, Ev); batch dims broadcast. ``mask``: boolean, True where a query
    may attend a key (as in ``torch.nn.functional.scaled_dot_product_attention``; ``nn.MultiheadAttention``
    uses True = ignore), or floating, added to the scores; broadcastable to (..., L, S). ``causal=True`` lets
    query i attend keys j <= i (top-left aligned); with a mask, both apply. ``scale`` defaults to 1/sqrt(E).
    A query with nothing to attend gets a zero output. With ``return_weights=True`` returns (output, weights).
    """
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale)
    _check_flag(causal, "causal")
    _check_flag(return_weights, "return_weights")
    w, out = _full_attention(ops, q, k, v, mask, causal, scale, batch, L, S, weights=return_weights)
    if return_weights:
        return ops.astype(out, out_dtype), ops.astype(w, out_dtype)  # (..., L, Ev), (..., L, S)
    return ops.astype(out, out_dtype)  # (..., L, Ev)


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------------------------
# Attention, token by token
# --------------------------------------------------------------------------------------------------------------


def attention_loop(q, k, v, mask=None, *, causal=False, scale=None):
    """Attention written token by token, with explicit loops over queries and keys (chapter 1).

    Same arguments, mask polarity (True = may attend) and result as :func:`attention`, computed one dot
    product and one exponential at a time. It is slow on purpose: the reference a reader can follow line by line.
    """
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale)
    _check_flag(causal, "causal")
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
                if (causal and j > i) or (mask_is_bool and not bool(mask[b + (i, j)])):
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
# Attention in tiles (FlashAttention's idea, chapter 7)
# --------------------------------------------------------------------------------------------------------------

DEFAULT_BLOCK = (256, 2048)


def _check_block(block_size):
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2:
        raise ValueError(f"block_size must be an int or a pair (query block, key block), got {block_size!r}")
    for b in pair:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"block_size must hold integers, got {type(b).__name__}")
        if b < 1:
            raise ValueError(f"block_size must be at least 1, got {b}")
    return int(pair[0]), int(pair[1])


def _slice_tile(x, rows, cols):
    """x[..., rows, cols] for an array broadcastable to (..., L, S): size-1 dims are kept, not sliced."""
    r = rows if x.shape[-2] != 1 else slice(None)
    c = cols if x.shape[-1] != 1 else slice(None)
    return x[..., r, c]


def _query_block(ops, q, k, v, mask, causal, scale, rows, bk, S):
    """Online softmax over key blocks for one block of queries (the torch path): output rows (..., bq, Ev) and
    nothing larger than (..., bq, bk) held at once. The textbook form: every tile is shifted by the running
    maximum, and what was accumulated is rescaled whenever that maximum grows."""
    qs = q[..., rows, :] * scale  # (..., bq, E)
    shape = _shape(qs)[:-1] + (1,)
    m = ops.full(shape, -math.inf, qs)  # running max of each row's scores
    total = ops.zeros(shape, qs)  # running sum of exp(score - m)
    acc = ops.zeros(_shape(qs)[:-1] + _shape(v)[-1:], qs)  # running sum of exp(score - m) v, (..., bq, Ev)
    kt = k.swapaxes(-1, -2)  # (..., E, S)
    for j0 in range(0, S, bk):
        cols = slice(j0, min(j0 + bk, S))
        if causal and cols.start > rows.stop - 1:
            break  # every later key block lies wholly in the future of this query block
        allowed = _tile_causal(ops, causal, rows, cols, qs)
        s = _apply_mask(ops, qs @ kt[..., cols], _tile_mask(mask, rows, cols), allowed)  # (..., bq, bk)
        m_new = ops.maximum(m, ops.detach(ops.amax(s, -1)))
        shift = ops.where(m_new == -math.inf, 0.0, m_new)  # a row with nothing allowed yet shifts by 0, not -inf
        p = ops.exp_(ops.sub_(s, shift))  # (..., bq, bk)
        if j0 == 0:  # nothing accumulated yet: no rescaling
            total, acc = ops.sum(p, -1), p @ v[..., cols, :]
        else:
            alpha = ops.exp_(m - shift)  # rescales what was accumulated under the old max; 0 while m is -inf
            total = ops.add_(ops.mul_(total, alpha), ops.sum(p, -1))
            acc = ops.add_(ops.mul_(acc, alpha), p @ v[..., cols, :])
        m = m_new
    return ops.div_(acc, ops.where(total == 0, 1.0, total))


def _tile_mask(mask, rows, cols):
    return None if mask is None else _slice_tile(mask, rows, cols)


def _tile_causal(ops, causal, rows, cols, like):
    """The causal pattern of a tile that crosses the diagonal, else None (the tile is wholly allowed)."""
    if causal and cols.stop - 1 > rows.start:
        return _causal_pattern(ops, range(rows.start, rows.stop), range(cols.start, cols.stop), like)
    return None


LAZY_LIMIT = 2.0**32  # NumPy tiles: a row of exp(score - shift) summing past this is redone with its own maximum
SHIFT_SAMPLE = 64  # the NumPy path's first shift is the largest allowed score among this many leading keys


def _lazy_query_block(q1, kt1, v1, mask, causal, rows, bk, S, scratch):
    """Online softmax for one block of queries on NumPy, rescaling only when it must: output rows (..., bq, Ev).

    Augmented operands save three passes over every tile. ``q1`` (..., bq, E+1) holds the scaled queries with
    minus each row's shift m in its last column, and ``kt1`` (..., E+1, S) holds kᵀ above a row of ones, so one
    matrix product gives score - m directly. ``v1`` (..., S, Ev+1) holds v beside a column of ones, so the
    product with the exponentials also gives their row sums. ``scratch`` (..., bq, bk) receives every tile.

    m starts at the largest allowed score among the first SHIFT_SAMPLE keys: a real score, so every row's
    total ends up at least 1. It stays put while exp(score - m) merely exceeds 1; only a tile whose row sums
    pass LAZY_LIMIT (or are not finite) is redone the textbook way, with its own maximum, and then what was
    accumulated is rescaled. Rows with nothing allowed yet (m = -inf) also take the textbook way.
    """
    E = q1.shape[-1] - 1
    bq = rows.stop - rows.start
    acc = np.zeros(q1.shape[:-1] + v1.shape[-1:], dtype=q1.dtype)  # sum of exp(score - m) [v, 1], (..., bq, Ev+1)
    head = slice(0, min(S, SHIFT_SAMPLE))
    m = np.full(q1.shape[:-1] + (1,), -math.inf, dtype=q1.dtype)  # (..., bq, 1)
    if S:
        allowed = _tile_causal(_NUMPY, causal, rows, head, q1)
        sample = _apply_mask(_NUMPY, q1[..., :E] @ kt1[..., :E, head], _tile_mask(mask, rows, head), allowed)
        m = sample.max(axis=-1, keepdims=True)
    q1[..., E:] = -m
    for j0 in range(0, S, bk):
        cols = slice(j0, min(j0 + bk, S))
        if causal and cols.start > rows.stop - 1:
            break  # every later key block lies wholly in the future of this query block
        tile = scratch[..., :bq, : cols.stop - cols.start]
        tmask, allowed = _tile_mask(mask, rows, cols), _tile_causal(_NUMPY, causal, rows, cols, q1)
        if np.isfinite(m).all():
            p = _apply_mask(_NUMPY, np.matmul(q1, kt1[..., cols], out=tile), tmask, allowed)  # score - m
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow here only sends the tile below
                part = np.exp(p, out=p) @ v1[..., cols, :]  # (..., bq, Ev+1)
            if np.isfinite(part).all() and (part[..., -1] <= LAZY_LIMIT).all():
                acc += part
                continue
        s = _apply_mask(_NUMPY, np.matmul(q1[..., :E], kt1[..., :E, cols], out=tile), tmask, allowed)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        shift = np.where(m_new == -math.inf, 0.0, m_new)  # nothing allowed yet: shift by 0
        part = np.exp(np.subtract(s, shift, out=s), out=s) @ v1[..., cols, :]
        acc *= np.exp(m - shift)  # 0 while m was -inf, 1 where the maximum did not move
        acc += part
        m = m_new
        q1[..., E:] = -shift
    total = acc[..., -1:]
    return np.divide(acc[..., :-1], np.where(total == 0, 1.0, total))


def tiled_attention(q, k, v, mask=None, *, causal=False, scale=None, block_size=DEFAULT_BLOCK):
    """Attention computed in tiles with an online softmax, never holding the (..., L, S) matrix (chapter 7).

    Same arguments, mask polarity (True = may attend) and result as :func:`attention`. ``block_size`` is an
    int or a pair (query block, key block): memory beyond the inputs and output grows like the tile,
    (..., query block, key block), not like L × S. For each block of queries it walks the key blocks with an
    online softmax: each row's exponentials are taken relative to a shift m, their running sum and their running
    sum of values are kept, and both are rescaled by exp(m_old - m_new) when m moves. The torch path moves m
    to the running maximum at every tile, as chapter 7 derives it. The NumPy path moves it only when a tile's
    exponentials would otherwise sum past ``LAZY_LIMIT``, which lets one matrix product subtract it and saves
    three passes over every tile. On NumPy a large problem's query blocks run on a small thread pool, each
    worker with one BLAS thread and one score buffer it reuses for every tile.
    """
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale)
    _check_flag(causal, "causal")
    bq, bk = _check_block(block_size)
    q = ops.broadcast_to(q, batch + _shape(q)[-2:])
    k = ops.broadcast_to(k, batch + _shape(k)[-2:])
    v = ops.broadcast_to(v, batch + _shape(v)[-2:])
    blocks = [slice(i0, min(i0 + bq, L)) for i0 in range(0, L, bq)]

    if ops is _NUMPY:
        E, Ev = _shape(q)[-1], _shape(v)[-1]
        kt1 = np.ones(batch + (E + 1, S), dtype=q.dtype)  # kᵀ above a row of ones
        kt1[..., :E, :] = k.swapaxes(-1, -2)
        v1 = np.ones(batch + (S, Ev + 1), dtype=q.dtype)  # v beside a column of ones
        v1[..., :Ev] = v
        out = np.empty(batch + (L, Ev), dtype=q.dtype)  # (..., L, Ev)
        big = math.prod(batch) * L * S >= PARALLEL_MIN_SCORES
        limit = _one_blas_thread() if big and len(blocks) > 1 and _workers() > 1 else None

        local = threading.local()  # each thread's score buffer, reused for every tile of every block it takes

        def run(rows):
            if not hasattr(local, "scratch"):
                local.scratch = np.empty(batch + (min(bq, L), min(bk, S)), dtype=q.dtype)  # (..., bq, bk)
            q1 = np.empty(batch + (rows.stop - rows.start, E + 1), dtype=q.dtype)
            np.multiply(q[..., rows, :], scale, out=q1[..., :E])
            out[..., rows, :] = _lazy_query_block(q1, kt1, v1, mask, causal, rows, bk, S, local.scratch)

        if limit is not None:  # a free thread takes the next block, so a thread slowed down holds up no other
            with limit, ThreadPoolExecutor(_workers()) as pool:
                list(pool.map(run, blocks))
        else:
            for rows in blocks:
                run(rows)
        return out.astype(out_dtype, copy=False)
    torch = ops.torch
    parts = [_query_block(ops, q, k, v, mask, causal, scale, rows, bk, S) for rows in blocks]
    out = torch.cat(parts, dim=-2) if parts else ops.zeros(batch + (L,) + _shape(v)[-1:], q)
    return out.to(out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Masks and devices
# --------------------------------------------------------------------------------------------------------------


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


def causal_mask(L, S=None, *, like=None):
    """Boolean (L, S) mask, True where query i may attend key j, i.e. j <= i (chapter 5).

    Aligned top-left, as ``is_causal=True`` in ``scaled_dot_product_attention``. ``S`` defaults to ``L``.
    Returns a NumPy array, or a torch tensor on ``like``'s device when ``like`` is a tensor.
    """
    L = _check_length(L, "L")
    S = L if S is None else _check_length(S, "S")
    ops = _like_ops(like)
    return _causal_pattern(ops, range(L), range(S), like if like is not None else np.empty(0))


def padding_mask(lengths, S):
    """Boolean (B, 1, S) mask, True on each sequence's first ``lengths[b]`` keys, the real tokens (chapter 5).

    Broadcasts against scores of shape (B, L, S). ``lengths`` is a 1-D sequence of integers, each between 0 and
    ``S``; a torch tensor gives a torch mask on its device.
    """
    S = _check_length(S, "S")
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
    return (positions[None, :] < lens[:, None])[:, None, :]  # (B, 1, S)


def best_device():
    """The best torch device here: CUDA, else Apple's MPS, else the CPU (the chapters' set-up uses it)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
