"""How the full matrix is computed fast, apart from what it computes: NumPy on several cores, torch on a GPU.

On a CPU, NumPy runs each kernel on one core, so a large NumPy problem is cut into independent pieces (chunks of
rows, blocks of queries) that a small pool of threads works through; NumPy releases the interpreter lock inside its
kernels. Each worker keeps BLAS to one thread of its own. On a GPU, half-precision inputs stay in half precision
for the matrix products, the scores in float32 for the softmax. This is speed machinery, not part of the
algorithm: :mod:`lib.attention` and :mod:`lib.tiles` compute the same without it.
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lib.backend import _NUMPY, _apply_mask, _causal_pattern, _exp_shifted_, _shape

PARALLEL_MIN_SCORES = 1 << 18  # below this many scores a thread pool costs more than it saves


def workers():
    return max(1, min(4, os.cpu_count() or 1))


_BLAS_CONTROLLER = []  # threadpoolctl's controller, found once: finding the libraries takes a millisecond


def one_blas_thread():
    """A context that holds BLAS to one thread, or None without threadpoolctl. Each worker then runs its small
    matrix products alone: a pool of workers each starting a team of BLAS threads runs many times slower."""
    if not _BLAS_CONTROLLER:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return None
        _BLAS_CONTROLLER.append(ThreadpoolController())
    return _BLAS_CONTROLLER[0].limit(limits=1, user_api="blas")


ROW_CHUNK = 128  # rows in one chunk of the full matrix on NumPy: fewer make its matrix products inefficient


def full_attention_in_chunks(q, k, v, mask, causal, scale, batch, L, S, weights, limit):
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
        allowed = None if causal is None else _causal_pattern(_NUMPY, rows, range(S), s, causal)
        e, total = _exp_shifted_(_NUMPY, _apply_mask(_NUMPY, s, None if mb is None else mb[b + (rows,)], allowed))
        if weights:
            np.divide(e, total, out=e)
            if out is not None:
                np.matmul(e, vb[b], out=out[b + (rows,)])
        else:
            np.divide(np.matmul(e, vb[b], out=out[b + (rows,)]), total, out=out[b + (rows,)])

    with limit, ThreadPoolExecutor(workers()) as pool:
        list(pool.map(run, chunks))
    return scores, out


# --------------------------------------------------------------------------------------------------------------
# torch on a GPU, half precision
# --------------------------------------------------------------------------------------------------------------


def half_attention_on_gpu_applies(q, k, v, mask):
    """True for torch float16 or bfloat16 q, k and v of one dtype on a CUDA device, with no mask."""
    torch = sys.modules.get("torch")
    if torch is None or mask is not None or not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype and q.device.type == "cuda"


def half_attention_on_gpu(q, k, v, causal, scale):
    """softmax(q kᵀ · scale) v and its weights for half-precision q, k, v: scores in float32, weights in half.

    The scores leave the first product in float32 and stay there through the mask and the softmax, as in the
    fused kernels, which keep them in float32 registers: rounded to half precision first, a score of 300 would
    carry an error of up to 0.125, which the softmax turns into a relative error of about 13 % in its weight. The
    weights are then rounded to half precision for the product with v, which runs on the tensor cores. The
    first product is ``torch.bmm`` with ``out_dtype=torch.float32`` on the tensor cores where torch offers it
    (CUDA, no autograd), else a float32 product of upcast q and k. ``causal`` is None or the offset of the causal
    diagonal (:func:`lib.backend._check_causal`); the pattern is built on the device. S must be at least 1.
    """
    torch = sys.modules["torch"]
    s = _scores_in_float32(torch, q * scale, k)  # (..., L, S), float32
    if causal is not None:
        L, S = s.shape[-2:]
        future = torch.ones(L, S, dtype=torch.bool, device=s.device).triu_(1 + causal)  # (L, S): j > i + causal
        s = s.masked_fill_(future, -math.inf)
    w = torch.softmax(s, dim=-1).to(q.dtype)  # (..., L, S): softmax in float32, stored in half precision
    return w @ v, w  # (..., L, Ev), (..., L, S)


def _scores_in_float32(torch, q, k):
    """q kᵀ (..., L, S) in float32 from half-precision q (..., L, E) and k (..., S, E), never rounded to half."""
    if q.device.type == "cuda" and not (q.requires_grad or k.requires_grad):
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
        q3 = q.expand(*batch, L, E).reshape(-1, L, E)  # (B, L, E), B the product of the batch dimensions
        k3 = k.expand(*batch, S, E).reshape(-1, S, E)  # (B, S, E)
        try:
            return torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32).reshape(*batch, L, S)  # (..., L, S)
        except (TypeError, RuntimeError, NotImplementedError):  # an older torch without bmm's out_dtype
            pass
    return q.float() @ k.float().transpose(-1, -2)  # (..., L, S)


# --------------------------------------------------------------------------------------------------------------
# Which half precision a GPU multiplies on its tensor cores
# --------------------------------------------------------------------------------------------------------------


def half_dtype(device=None, *, capability=None):
    """The 16-bit dtype whose products run on this device's tensor cores: ``torch.bfloat16`` from compute
    capability 8.0 (A100, L4, H100), ``torch.float16`` before it (a T4, sm_75, multiplies float16 on its tensor
    cores but has no bfloat16 products) and on a CPU, where Triton's interpreter computes bfloat16 wrongly.

    ``device`` a torch.device, a string such as "cuda:0", or None for the current CUDA device if there is one;
    or ``capability=(major, minor)`` instead of a device, for a GPU that is not here (tools/compile_report.py).
    """
    import torch

    if capability is not None:
        if device is not None:
            raise TypeError("half_dtype takes a device or a capability, not both")
        if (not isinstance(capability, tuple) or len(capability) != 2
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)):
            raise TypeError(f"capability must be a (major, minor) pair of ints, e.g. (7, 5); got {capability!r}")
        return torch.bfloat16 if capability >= (8, 0) else torch.float16
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        raise TypeError(f"device must be a torch.device or a name such as 'cuda:0'; got {device!r}") from None
    if device.type != "cuda":
        return torch.float16
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
