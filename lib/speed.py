"""NumPy on several cores: a small thread pool, one BLAS thread per worker, and the full matrix filled in chunks.

NumPy runs each kernel on one core, so a large NumPy problem is cut into independent pieces (chunks of rows, blocks
of queries) that a small pool of threads works through; NumPy releases the interpreter lock inside its kernels.
Each worker keeps BLAS to one thread of its own. This is speed machinery for the CPU, not part of the algorithm:
:mod:`lib.attention` and :mod:`lib.tiles` give the same results without it.
"""

from __future__ import annotations

import os
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
        allowed = _causal_pattern(_NUMPY, rows, range(S), s) if causal else None
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
