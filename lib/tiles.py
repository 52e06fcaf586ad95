"""Attention in tiles with an online softmax (chapter 7): never more than one (query block, key block) tile at once.

The torch path is the textbook loop chapter 7 derives: each tile is shifted by the running row maximum, and what
was accumulated is rescaled whenever that maximum grows. The NumPy path is the same algorithm tuned for a CPU: it
moves the shift only when it must (``LAZY_LIMIT``), lets augmented matrix products subtract it and sum the rows,
and runs query blocks on the thread pool of :mod:`lib.speed`. The GPU kernel is :mod:`lib.flash`.
Shape vocabulary as in :mod:`lib.attention`.
"""

from __future__ import annotations

import math
import numbers
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lib import speed
from lib.backend import (
    _NUMPY,
    _apply_mask,
    _causal_pattern,
    _check_causal,
    _prepare,
    _shape,
)

__all__ = ["tile_count", "tiled_attention"]


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


def _check_window(window, causal):
    """None, or the window as an int: a sliding window needs the causal pattern it slides along (chapter 13)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an integer or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window must be at least 1 (keys a query sees, itself included), got {window}")
    if causal is None:
        raise ValueError("window needs causal=True (or 'bottom-right'): the window is the last `window` keys up to "
                         "each query's own position")
    return int(window)


def _key_range(rows, bk, S, causal, window):
    """The starts of the key blocks a block of query rows visits: none wholly in the causal future of its last
    row, and, with a sliding window, none wholly older than the window of its first row (chapter 13)."""
    lo = 0 if window is None else max(0, rows.start + causal - window + 1) // bk * bk
    hi = S if causal is None else min(S, rows.stop + causal)  # the last row sees keys j <= rows.stop - 1 + causal
    return range(lo, max(lo, hi), bk)


def tile_count(L, S, block_size=DEFAULT_BLOCK, *, causal=False, window=None):
    """How many (query block, key block) tiles :func:`tiled_attention` computes for L queries and S keys."""
    offset = _check_causal(causal, L, S)
    window = _check_window(window, offset)
    bq, bk = _check_block(block_size)
    return sum(len(_key_range(slice(i0, min(i0 + bq, L)), bk, S, offset, window)) for i0 in range(0, L, bq))


def _slice_tile(x, rows, cols):
    """x[..., rows, cols] for an array broadcastable to (..., L, S): size-1 dims are kept, not sliced."""
    r = rows if x.shape[-2] != 1 else slice(None)
    c = cols if x.shape[-1] != 1 else slice(None)
    return x[..., r, c]


def _query_block(ops, q, k, v, mask, causal, scale, rows, bk, S, window=None):
    """Online softmax over key blocks for one block of queries (the torch path): output rows (..., bq, Ev) and
    nothing larger than (..., bq, bk) held at once. The textbook form: every tile is shifted by the running
    maximum, and what was accumulated is rescaled whenever that maximum grows."""
    qs = q[..., rows, :] * scale  # (..., bq, E)
    shape = _shape(qs)[:-1] + (1,)
    m = ops.full(shape, -math.inf, qs)  # running max of each row's scores
    total = ops.zeros(shape, qs)  # running sum of exp(score - m)
    acc = ops.zeros(_shape(qs)[:-1] + _shape(v)[-1:], qs)  # running sum of exp(score - m) v, (..., bq, Ev)
    kt = k.swapaxes(-1, -2)  # (..., E, S)
    keys = _key_range(rows, bk, S, causal, window)  # key blocks wholly in the future or past the window: skipped
    for j0 in keys:
        cols = slice(j0, min(j0 + bk, S))
        allowed = _tile_causal(ops, causal, rows, cols, qs, window)
        s = _apply_mask(ops, qs @ kt[..., cols], _tile_mask(mask, rows, cols), allowed)  # (..., bq, bk)
        m_new = ops.maximum(m, ops.detach(ops.amax(s, -1)))
        shift = ops.where(m_new == -math.inf, 0.0, m_new)  # a row with nothing allowed yet shifts by 0, not -inf
        p = ops.exp_(ops.sub_(s, shift))  # (..., bq, bk)
        if j0 == keys.start:  # nothing accumulated yet: no rescaling
            total, acc = ops.sum(p, -1), p @ v[..., cols, :]
        else:
            alpha = ops.exp_(m - shift)  # rescales what was accumulated under the old max; 0 while m is -inf
            total = ops.add_(ops.mul_(total, alpha), ops.sum(p, -1))
            acc = ops.add_(ops.mul_(acc, alpha), p @ v[..., cols, :])
        m = m_new
    return ops.div_(acc, ops.where(total == 0, 1.0, total))


def _tile_mask(mask, rows, cols):
    return None if mask is None else _slice_tile(mask, rows, cols)


def _tile_causal(ops, causal, rows, cols, like, window=None):
    """The causal pattern of a tile that crosses the diagonal (or the window's edge), else None (wholly allowed).

    ``causal`` is None or the offset of the diagonal: key j is allowed for query i when j <= i + causal, and with
    a ``window`` also when j > i + causal - window (chapter 13)."""
    allowed = None
    if causal is not None and cols.stop - 1 > rows.start + causal:
        allowed = _causal_pattern(ops, range(rows.start, rows.stop), range(cols.start, cols.stop), like, causal)
    if window is not None and cols.start <= rows.stop - 1 + causal - window:  # some key too old for some row
        recent = ~_causal_pattern(ops, range(rows.start, rows.stop), range(cols.start, cols.stop), like,
                                  causal - window)
        allowed = recent if allowed is None else allowed & recent
    return allowed


LAZY_LIMIT = 2.0**32  # NumPy tiles: a row of exp(score - shift) summing past this is redone with its own maximum
SHIFT_SAMPLE = 64  # the NumPy path's first shift is the largest allowed score among this many leading keys


def _lazy_query_block(q1, kt1, v1, mask, causal, rows, bk, S, scratch, window=None):
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
    keys = _key_range(rows, bk, S, causal, window)  # key blocks wholly in the future or past the window: skipped
    head = slice(keys.start, min(S, keys.start + SHIFT_SAMPLE))
    m = np.full(q1.shape[:-1] + (1,), -math.inf, dtype=q1.dtype)  # (..., bq, 1)
    if head.stop > head.start:
        allowed = _tile_causal(_NUMPY, causal, rows, head, q1, window)
        sample = _apply_mask(_NUMPY, q1[..., :E] @ kt1[..., :E, head], _tile_mask(mask, rows, head), allowed)
        m = sample.max(axis=-1, keepdims=True)
    q1[..., E:] = -m
    for j0 in keys:
        cols = slice(j0, min(j0 + bk, S))
        tile = scratch[..., :bq, : cols.stop - cols.start]
        tmask, allowed = _tile_mask(mask, rows, cols), _tile_causal(_NUMPY, causal, rows, cols, q1, window)
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


def tiled_attention(q, k, v, mask=None, *, causal=False, scale=None, block_size=DEFAULT_BLOCK, window=None,
                    key_padding_mask=None):
    """Attention computed in tiles with an online softmax; its forward pass never holds the (..., L, S) matrix.

    Same arguments, mask polarity (True = may attend), ``key_padding_mask``, ``causal`` alignments (True or
    ``"top-left"``, and ``"bottom-right"``) and result as :func:`attention`. ``block_size`` is an
    int or a pair (query block, key block): memory beyond the inputs and output grows like the tile,
    (..., query block, key block), not like L × S. For each block of queries it walks the key blocks with an
    online softmax: each row's exponentials are taken relative to a shift m, their running sum and their running
    sum of values are kept, and both are rescaled by exp(m_old - m_new) when m moves. The torch path moves m
    to the running maximum at every tile, as chapter 7 derives it. The NumPy path moves it only when a tile's
    exponentials would otherwise sum past ``LAZY_LIMIT``, which lets one matrix product subtract it and saves
    three passes over every tile. On NumPy a large problem's query blocks run on a small thread pool, each
    worker with one BLAS thread and one score buffer it reuses for every tile (chapter 7).

    Under autograd the torch path keeps every tile for the backward pass, so training memory still grows like
    L × S; :func:`lib.flash.flash_attention` recomputes the tiles instead (chapter 8).

    ``window`` (with ``causal``) is a sliding window: query i sees only the last ``window`` keys up to its own
    position, i + offset - window < j <= i + offset, and key blocks wholly outside every row's window are never
    visited, so the work grows like L × window, not L × S (:func:`tile_count`; chapter 13).
    """
    ops, q, k, v, mask, scale, out_dtype, batch, L, S = _prepare(q, k, v, mask, scale,
                                                                 key_padding_mask=key_padding_mask)
    causal = _check_causal(causal, L, S)
    window = _check_window(window, causal)
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
        big = math.prod(batch) * L * S >= speed.PARALLEL_MIN_SCORES
        limit = speed.one_blas_thread() if big and len(blocks) > 1 and speed.workers() > 1 else None

        local = threading.local()  # each thread's score buffer, reused for every tile of every block it takes

        def run(rows):
            if not hasattr(local, "scratch"):
                local.scratch = np.empty(batch + (min(bq, L), min(bk, S)), dtype=q.dtype)  # (..., bq, bk)
            q1 = np.empty(batch + (rows.stop - rows.start, E + 1), dtype=q.dtype)
            np.multiply(q[..., rows, :], scale, out=q1[..., :E])
            out[..., rows, :] = _lazy_query_block(q1, kt1, v1, mask, causal, rows, bk, S, local.scratch, window)

        if limit is not None:  # a free thread takes the next block, so a thread slowed down holds up no other
            with limit, ThreadPoolExecutor(speed.workers()) as pool:
                list(pool.map(run, blocks))
        else:
            for rows in blocks:
                run(rows)
        return out.astype(out_dtype, copy=False)
    torch = ops.torch
    parts = [_query_block(ops, q, k, v, mask, causal, scale, rows, bk, S, window) for rows in blocks]
    out = torch.cat(parts, dim=-2) if parts else ops.zeros(batch + (L,) + _shape(v)[-1:], q)
    return out.to(out_dtype)
