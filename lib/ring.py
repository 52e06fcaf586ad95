"""Attention across processes (chapter 12): ring attention and all-to-all ("Ulysses") on ``torch.distributed``.

A sequence of N tokens is split over the P ranks of a process group; each rank holds one shard of n = N/P query,
key and value rows, q (..., n, E), k (..., n, E), v (..., n, Ev), and gets back the attention output of its own
queries over all N keys, (..., n, Ev). The same code runs on gloo (CPU processes, as in CI) and NCCL (one GPU a rank).

- :func:`ring_attention` passes key/value blocks around the ring of ranks; each rank merges the attention state
  (:mod:`lib.merge`) of its queries over each block as it arrives. The next block's send and receive are posted
  before the current block is computed, so the transfer can hide behind the compute. Its backward pass is a second
  ring in which each block's key/value gradients travel with it and arrive back at the rank that owns the block.
- :func:`ulysses_attention` re-shards instead: one all-to-all turns sequence shards of all heads into the whole
  sequence for H/P heads, each rank attends locally, and a second all-to-all turns the result back.

Layouts say which tokens a rank holds. ``"contiguous"``: rank r holds tokens [r n, (r+1) n). ``"zigzag"``: the
sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so with a causal mask every rank has the same
work. :func:`shard` and :func:`unshard` convert between a whole sequence and its shards. :func:`launch` starts P
worker processes from a script or a notebook, and :func:`run_cases` is the worker that chapter 12 and the tests
give it. :func:`sent_bytes_per_rank` is the formula for the bytes each scheme sends, grouped-query heads included
(:func:`sent_bytes_per_layer` for a model's configuration), which :func:`bytes_sent` counts as they go;
:func:`causal_tile_counts` counts the causal work of each rank at each step, and :func:`hiding_block` predicts how
long a block must be for its compute to hide its transfer. Shapes as in :mod:`lib.attention`; masks are causal
only (top-left, as ``is_causal=True``, over global positions).
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
import pathlib
import struct
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from lib.backend import _check_axes, _from_axes, _to_axes
from lib.merge import attention_state, merge_states

__all__ = [
    "LAYOUTS",
    "bytes_sent",
    "causal_tile_counts",
    "hiding_block",
    "launch",
    "positions",
    "reset_bytes_sent",
    "ring_attention",
    "run_cases",
    "sent_bytes_per_layer",
    "sent_bytes_per_rank",
    "shard",
    "ulysses_attention",
    "unshard",
]

LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------------------------------
# Layouts: which global positions each rank holds
# --------------------------------------------------------------------------------------------------------------


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_split(N, world_size, layout):
    _check_layout(layout)
    if isinstance(N, bool) or not isinstance(N, numbers.Integral) or N < 0:
        raise ValueError(f"N must be a whole number of tokens, got {N!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    parts = world_size if layout == "contiguous" else 2 * world_size
    if N % parts:
        raise ValueError(
            f"a sequence of {N} tokens cannot be split into {parts} equal chunks for the {layout!r} layout "
            f"over {world_size} ranks: make the length a multiple of {parts}"
        )
    return N // world_size


def _runs(n, rank, world_size, layout):
    """The contiguous runs of a rank's n tokens: (local slice, first global position) for each."""
    if layout == "contiguous":
        return [(slice(0, n), rank * n)]
    h = n // 2
    return [(slice(0, h), rank * h), (slice(h, n), (2 * world_size - 1 - rank) * h)]


def _check_rank(rank, world_size):
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an integer, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be between 0 and world_size - 1 = {world_size - 1}, got {rank}")


def positions(N, rank, world_size, layout="contiguous"):
    """The global positions (n,) of the tokens rank ``rank`` holds when N tokens are split over ``world_size``."""
    n = _check_split(N, world_size, layout)
    _check_rank(rank, world_size)
    return torch.cat([torch.arange(start, start + s.stop - s.start) for s, start in _runs(n, rank, world_size, layout)])


def shard(x, rank, world_size, layout="contiguous"):
    """Rank ``rank``'s shard (..., N/P, E) of a whole sequence x (..., N, E), split along the token dim -2."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (..., N, E), got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., N, E), at least 2-D; got shape {tuple(x.shape)}")
    try:
        where = positions(x.shape[-2], rank, world_size, layout)
    except ValueError as err:
        raise ValueError(f"x has shape {tuple(x.shape)}: {err}") from None
    return x[..., where, :]  # (..., n, E)


def unshard(shards, layout="contiguous"):
    """The whole sequence (..., N, E) from the list of every rank's shard (..., n, E), in rank order."""
    try:
        shards = list(shards) if not isinstance(shards, torch.Tensor) else None
    except TypeError:
        shards = None
    if shards is None:
        raise TypeError("shards must be a list of every rank's shard")
    if not shards or not all(isinstance(s, torch.Tensor) and s.ndim >= 2 for s in shards):
        raise TypeError("shards must be a non-empty list of torch tensors (..., n, E), one per rank")
    P = len(shards)
    lengths = {s.shape[-2] for s in shards}
    if len(lengths) != 1:
        raise ValueError(f"shards of unequal length: {[s.shape[-2] for s in shards]} tokens")
    N = P * lengths.pop()
    whole = torch.cat(shards, dim=-2)  # (..., N, E) in rank order
    order = torch.cat([positions(N, r, P, layout) for r in range(P)])
    return whole[..., torch.argsort(order), :]  # (..., N, E) in sequence order


# --------------------------------------------------------------------------------------------------------------
# Input checks: on this rank, then across ranks
# --------------------------------------------------------------------------------------------------------------


def _group_rank_size(group, what):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised process group: call torch.distributed.init_process_group() on every "
            "rank first (lib.ring.launch does it for you)"
        )
    rank = dist.get_rank(group)
    if rank < 0:  # get_rank answers -1 on a rank outside the group; its collectives would fail deep inside torch
        raise RuntimeError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the group it "
                           "was given; call it only on the group's ranks")
    return rank, dist.get_world_size(group)


def _peer(group, r):
    return r if group is None else dist.get_global_rank(group, r)


def _check_local(q, k, v, causal, what):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} takes torch tensors; {name} is a {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., n, E), at least 2-D; got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} has dtype {x.dtype}; {what} needs floating-point tensors")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has E={k.shape[-1]} but q has E={q.shape[-1]}")
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2]):
        raise ValueError(
            f"q, k and v must hold the same tokens of one sequence: they have {q.shape[-2]}, {k.shape[-2]} and "
            f"{v.shape[-2]} rows"
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k and v must have the same batch dims (..., Hkv), got {tuple(k.shape)}, {tuple(v.shape)}")
    grouped = q.ndim >= 3 and q.ndim == k.ndim and q.shape[:-3] == k.shape[:-3] and k.shape[-3] > 0 \
        and q.shape[-3] % k.shape[-3] == 0
    if q.shape[:-2] != k.shape[:-2] and not grouped:
        raise ValueError(f"q, k and v must have the same batch dims, or q (..., H, n, E) with k and v (..., Hkv, n, "
                         f"E) where Hkv divides H (grouped-query heads); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 8


def _signature(tensors):
    """One int64 row describing the tensors' shapes and dtypes, for comparison across ranks."""
    row = []
    for x in tensors:
        if x.ndim > _MAX_DIMS:
            raise ValueError(f"at most {_MAX_DIMS} dims are supported, got {x.ndim}")
        row += [x.ndim, *x.shape, *([-1] * (_MAX_DIMS - x.ndim)), _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -2]
    return torch.tensor(row, dtype=torch.int64, device=tensors[0].device)


def _describe(row, names):
    width = _MAX_DIMS + 2
    parts = []
    for i, name in enumerate(names):
        cell = row[i * width : (i + 1) * width]
        dims, dtype = cell[1 : 1 + cell[0]], cell[-1]
        kind = _DTYPES[dtype] if dtype >= 0 else "another dtype"
        parts.append(f"{name} {tuple(dims)} {kind}")
    return ", ".join(parts)


def _settings_row(settings, device):
    """One int64 per call setting, (name, value) pairs of causal, layout and scale, for comparison across ranks."""
    row = []
    for name, value in settings:
        if name == "layout":
            row.append(LAYOUTS.index(value))
        elif name == "scale":
            row.append(struct.unpack("<q", struct.pack("<d", float(value)))[0])  # the float64's bits, exactly
        else:
            row.append(int(value))
    return torch.tensor(row, dtype=torch.int64, device=device)


def _describe_settings(values, names):
    words = []
    for name, value in zip(names, values):
        if name == "layout":
            value = LAYOUTS[value]
        elif name == "scale":
            value = struct.unpack("<d", struct.pack("<q", value))[0]
        else:
            value = bool(value)
        words.append(f"{name}={value!r}")
    return ", ".join(words)


def _validate(q, k, v, causal, group, world_size, what, local=None, settings=()):
    """Check this rank's shards and settings, then compare every rank's: any problem raises on every rank.

    A rank that raised alone would leave the others blocked in their first send until the timeout, so each rank
    first shares whether its own checks passed, the shapes and dtypes of its shards and its ``settings`` ((name,
    value) pairs; a scale of None is resolved to 1/sqrt(E)), then all decide together. Ranks called with different
    settings would otherwise compute different attentions and return a silently wrong answer.
    """
    error = None
    try:
        _check_local(q, k, v, causal, what)
        if local is not None:
            local(q, k, v)
        resolved = [(n, 1.0 / math.sqrt(q.shape[-1]) if n == "scale" and x is None else x) for n, x in settings]
        mine = torch.cat([_signature([q, k, v]), _settings_row(resolved, q.device)])
    except (TypeError, ValueError) as err:
        error = err
        like = q if isinstance(q, torch.Tensor) else torch.empty(0)
        mine = torch.full((3 * (_MAX_DIMS + 2) + len(settings),), -3, dtype=torch.int64, device=like.device)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=group)
    rows = [r.tolist() for r in rows]
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[0] == -3]
    if bad:
        raise ValueError(f"{what}: rank {bad[0]} rejected its shards (its own error says why)")
    if all(row == rows[0] for row in rows):
        return
    width = _MAX_DIMS + 2
    tokens = [row[1 + row[0] - 2] for row in rows]  # each rank's n, dim -2 of q

    def without_tokens(row):
        row = list(row)
        for i in range(3):
            cell = row[i * width : (i + 1) * width]
            row[i * width + 1 + cell[0] - 2] = 0
        return row

    if len(set(tokens)) > 1 and all(without_tokens(row) == without_tokens(rows[0]) for row in rows):
        raise ValueError(f"{what}: shards of unequal length: the ranks hold {tokens} tokens; every rank must hold "
                         "the same number (split a sequence whose length is a multiple of the chunk count)")
    r = next(r for r, row in enumerate(rows) if row != rows[0])
    shapes = 3 * width
    if rows[r][:shapes] == rows[0][:shapes]:
        names = [name for name, _ in settings]
        raise ValueError(
            f"{what}: rank {r} was called with {_describe_settings(rows[r][shapes:], names)} but rank 0 with "
            f"{_describe_settings(rows[0][shapes:], names)}; every rank must pass the same {', '.join(names)}"
        )
    raise ValueError(
        f"{what}: rank {r} has {_describe(rows[r], ('q', 'k', 'v'))} but rank 0 has "
        f"{_describe(rows[0], ('q', 'k', 'v'))}; every rank must pass shards of the same shapes and dtype"
    )


# --------------------------------------------------------------------------------------------------------------
# Bytes on the wire, counted as they are sent
# --------------------------------------------------------------------------------------------------------------

_SENT = {"bytes": 0}


def bytes_sent():
    """Bytes this process has sent to other ranks through this module since :func:`reset_bytes_sent`."""
    return _SENT["bytes"]


def reset_bytes_sent():
    """Set this process's count of bytes sent back to 0."""
    _SENT["bytes"] = 0


def _positive_int(name, n):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    return int(n)


def sent_bytes_per_rank(scheme, N, world_size, *, batch_heads, E, Ev=None, batch_kv_heads=None, itemsize=4,
                        backward=False):
    """Bytes one rank sends in one call of ``scheme`` ("ring" or "ulysses"), from the formula (chapter 12).

    N tokens over P ranks, n = N/P a rank. ``batch_heads`` is the product of q's batch dims (batch x query heads),
    ``batch_kv_heads`` that of k's and v's (batch x key/value heads; with grouped-query attention G times fewer;
    default ``batch_heads``), ``itemsize`` bytes a number. Per key/value head, the ring's forward sends P-1
    key/value blocks of n rows, (P-1) n (E+Ev) numbers; its backward the P-1 blocks again and P blocks of their
    gradients. Ulysses' all-to-alls keep 1/P of each shard at home: forward q and the output per query head and k
    and v per key/value head, (P-1)/P n (E+Ev) each; its backward the same again. So with E = Ev the ring sends
    P/(G+1) times the all-to-all's bytes forward: less than the all-to-all while P < G+1.
    :func:`ring_attention` sends half precision as float32 (the dtype it computes in: pass ``itemsize=4``);
    :func:`ulysses_attention` sends the caller's dtype.
    """
    if scheme not in ("ring", "ulysses"):
        raise ValueError(f"scheme must be 'ring' or 'ulysses', got {scheme!r}")
    P, N = _positive_int("world_size", world_size), _positive_int("N", N)
    if N % P:
        raise ValueError(f"N={N} tokens do not split evenly over world_size={P} ranks")
    E, itemsize = _positive_int("E", E), _positive_int("itemsize", itemsize)
    Ev = E if Ev is None else _positive_int("Ev", Ev)
    heads = _positive_int("batch_heads", batch_heads)
    kv_heads = heads if batch_kv_heads is None else _positive_int("batch_kv_heads", batch_kv_heads)
    n = N // P
    if scheme == "ring":
        blocks = (P - 1) + ((P - 1) + P if backward and P > 1 else 0)  # key/value blocks, then their gradients
        numbers = blocks * n * kv_heads * (E + Ev)
    else:
        for name, count in (("batch_heads", heads), ("batch_kv_heads", kv_heads)):
            if count % P:
                raise ValueError(f"the all-to-all splits the heads over the {P} ranks, but {name}={count} is "
                                 f"not a multiple of {P} (copy the key/value heads, or use fewer ranks)")
        numbers = (P - 1) * n * (heads + kv_heads) * (E + Ev) // P * (2 if backward else 1)
    return numbers * itemsize


def sent_bytes_per_layer(scheme, model, N, world_size, *, batch=1, itemsize=2, backward=False):
    """Bytes one rank sends for one attention layer of ``model`` (a :class:`lib.cost.Transformer` or its name).

    :func:`sent_bytes_per_rank` with the model's query heads, key/value heads (``n_kv_heads``) and head size, for
    ``batch`` sequences of N tokens over ``world_size`` ranks, ``itemsize`` bytes a number (2: bfloat16, as fused
    kernels send). The all-to-all cannot give P ranks a share of fewer than P key/value heads without copying
    them, so it refuses ``world_size`` above ``n_kv_heads``.
    """
    from lib import cost

    shape = cost.model(model) if isinstance(model, str) else model
    if not isinstance(shape, cost.Transformer):
        raise TypeError(f"model must be a lib.cost.Transformer or one of {', '.join(cost.MODELS)}, got "
                        f"{type(model).__name__}")
    batch, P = _positive_int("batch", batch), _positive_int("world_size", world_size)
    if scheme == "ulysses" and (shape.n_kv_heads % P or shape.n_heads % P):
        raise ValueError(f"the all-to-all gives each of {P} ranks a share of {shape.name}'s {shape.n_heads} query "
                         f"and {shape.n_kv_heads} key/value heads: world_size must divide both")
    return sent_bytes_per_rank(scheme, N, world_size, batch_heads=batch * shape.n_heads, E=shape.d_head,
                               batch_kv_heads=batch * shape.n_kv_heads, itemsize=itemsize, backward=backward)


# NVLink between the SXM parts, one direction (NVIDIA's datasheets give both directions together: 900 GB/s for the
# H100 and H200, 600 GB/s for the A100). The T4 has none.
NVLINK_BYTES_PER_S = {"H100": 450e9, "H200": 450e9, "A100": 300e9}


def hiding_block(gpu_name, *, group=1, flops_per_s=None, backward=False):
    """Tokens per rank above which a ring step's compute outlasts its transfer (chapter 12): a prediction.

    One forward step, per key/value head: the block's attention for its G = ``group`` query heads, 4 G n² E FLOPs
    on the tensor cores (two matrix products, no mask), against passing its keys and values on, 2 n E numbers of 2
    bytes (bfloat16) over NVLink in one direction. The two take equal time at n = F / (G B), whatever E, with F
    the FLOP rate (``flops_per_s``; default the datasheet's dense tensor rate, which no attention kernel reaches)
    and B the link's bytes per second. With ``backward`` the step of the backward ring: five products (2.5 times
    the FLOPs) against the keys and values in bfloat16 and their gradients in float32 (three times the bytes), so
    1.2 times the forward's threshold. A causal step that computes half a block needs twice either. This models a
    ring that sends bfloat16, as fused implementations do; :func:`ring_attention` sends half precision as float32.
    """
    from lib import cost

    if gpu_name not in NVLINK_BYTES_PER_S:
        raise ValueError(f"no NVLink rate for {gpu_name!r}; known: {', '.join(NVLINK_BYTES_PER_S)}")
    group = _positive_int("group", group)
    flops = cost.gpu(gpu_name).tensor_flops if flops_per_s is None else flops_per_s
    if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or not 0 < flops < math.inf:
        raise ValueError(f"flops_per_s must be a positive number, got {flops_per_s!r}")
    forward = flops / (group * NVLINK_BYTES_PER_S[gpu_name])
    return forward * (3 / 2.5 if backward else 1.0)  # three times the bytes for 2.5 times the FLOPs


def _exchange(tensors, send_to, recv_from, group):
    """Post sends of ``tensors`` to ``send_to`` and receives of as many from ``recv_from``.

    Returns (transfer, buffers): pass ``transfer`` to :func:`_wait`; the buffers hold what arrives once it has.
    The transfer keeps the sent tensors referenced, so none is freed while its send is in flight.
    """
    tensors = [t.contiguous() for t in tensors]
    buffers = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, recv_from, group) for b in buffers]
    requests = dist.batch_isend_irecv(ops)
    _SENT["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
    return (requests, tensors), buffers


def _wait(transfer):
    requests, _sent = transfer  # the sent tensors stay referenced until here
    for request in requests:
        request.wait()


# --------------------------------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------------------------------


def _relation(qa, lq, kb, lk):
    """How a causal mask treats a run of queries [qa, qa+lq) against a run of keys [kb, kb+lk)."""
    if kb > qa + lq - 1:
        return "none"  # every key lies in the future of every query: skip the pair
    if kb + lk - 1 <= qa:
        return "all"  # every key lies at or before every query: no mask needed
    return "some"


def _pair_mask(qa, lq, kb, lk, device):
    qpos = torch.arange(qa, qa + lq, device=device)
    kpos = torch.arange(kb, kb + lk, device=device)
    return kpos[None, :] <= qpos[:, None]  # (lq, lk), True = may attend


def _pairs(qruns, kruns, causal, device):
    """(query slice, key slice, mask or None) for each pair of runs a causal mask leaves something of."""
    for qs, qa in qruns:
        for ks, kb in kruns:
            lq, lk = qs.stop - qs.start, ks.stop - ks.start
            rel = _relation(qa, lq, kb, lk) if causal else "all"
            if rel == "none":
                continue
            yield qs, ks, (None if rel == "all" else _pair_mask(qa, lq, kb, lk, device))


def _empty_state(q, Ev):
    return q.new_zeros(q.shape[:-1] + (Ev,)), q.new_full(q.shape[:-1], -math.inf)


def _block_state(q, kb, vb, qruns, kruns, causal, scale):
    """The state (out (..., n, Ev), lse (..., n)) of this rank's queries over one key/value block."""
    per_run = {qs.start: [] for qs, _ in qruns}
    for qs, ks, mask in _pairs(qruns, kruns, causal, q.device):
        per_run[qs.start].append(attention_state(q[..., qs, :], kb[..., ks, :], vb[..., ks, :], mask, scale=scale))
    outs, lses = [], []
    for qs, _ in qruns:
        parts = per_run[qs.start]
        out, lse = merge_states(parts) if parts else _empty_state(q[..., qs, :], vb.shape[-1])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)  # (..., n, Ev), (..., n)


def _sum_to(x, shape):
    """x summed over the axes where ``shape`` has 1 and x does not: a broadcast key/value head's gradient."""
    axes = [i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1]
    return x.sum(dim=axes, keepdim=True) if axes else x


def _block_grads(q, kb, vb, out_lse, dout, D, qruns, kruns, causal, scale):
    """This rank's queries' contributions (dq, dk, dv) from one key/value block, recomputing its probabilities."""
    _, lse = out_lse
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kb), torch.zeros_like(vb)
    for qs, ks, mask in _pairs(qruns, kruns, causal, q.device):
        qi, ki, vi = q[..., qs, :], kb[..., ks, :], vb[..., ks, :]
        s = (qi @ ki.transpose(-1, -2)) * scale  # (..., lq, lk)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        row = lse[..., qs]
        row = torch.where(row == -math.inf, 0.0, row)  # a row with no key: its scores are all -inf, p = 0
        p = torch.exp(s - row[..., None])  # (..., lq, lk), the final attention weights of this pair
        dv[..., ks, :] += _sum_to(p.transpose(-1, -2) @ dout[..., qs, :], dv.shape)
        ds = p * (dout[..., qs, :] @ vi.transpose(-1, -2) - D[..., qs, None])  # (..., lq, lk)
        dq[..., qs, :] += (ds @ ki) * scale
        dk[..., ks, :] += _sum_to((ds.transpose(-1, -2) @ qi) * scale, dk.shape)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, scale, group, rank, P):
        n = q.shape[-2]
        qruns = _runs(n, rank, P, layout)
        send_to, recv_from = _peer(group, (rank + 1) % P), _peer(group, (rank - 1) % P)
        kb, vb, state = k, v, None
        for step in range(P):
            if step < P - 1:  # the next block is in flight while this one is computed
                requests, (k_next, v_next) = _exchange([kb, vb], send_to, recv_from, group)
            owner = (rank - step) % P
            block = _block_state(q, kb, vb, qruns, _runs(n, owner, P, layout), causal, scale)
            state = block if state is None else merge_states([state, block])
            if step < P - 1:
                _wait(requests)
                kb, vb = k_next, v_next
        out, lse = state
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (causal, layout, scale, group, rank, P)
        ctx.set_materialize_grads(False)  # an unused lse brings None, not zeros to subtract
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, layout, scale, group, rank, P = ctx.setup
        n = q.shape[-2]
        qruns = _runs(n, rank, P, layout)
        send_to, recv_from = _peer(group, (rank + 1) % P), _peer(group, (rank - 1) % P)
        dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype)
        D = (dout * out).sum(-1)  # (..., n): the softmax backward's row term, sum_e dout * out
        if dlse is not None:  # d lse / d score_j = p_j: a gradient on lse enters as D - dlse
            D = D - dlse.to(D.dtype)
        dq = torch.zeros_like(q)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k), torch.zeros_like(v)  # the gradients of the block in hand travel with it
        grads_in_flight, arriving = None, None  # the previous step's gradient transfer, waited for when needed
        for step in range(P):
            if step < P - 1:
                requests, (k_next, v_next) = _exchange([kb, vb], send_to, recv_from, group)
            owner = (rank - step) % P
            gq, gk, gv = _block_grads(q, kb, vb, (out, lse), dout, D, qruns, _runs(n, owner, P, layout), causal, scale)
            dq += gq
            if grads_in_flight is not None:  # this block's gradient sum so far, sent by the previous rank
                _wait(grads_in_flight)
                dkb, dvb = arriving
            dkb, dvb = dkb + gk, dvb + gv
            if step < P - 1:
                _wait(requests)
                kb, vb = k_next, v_next
            if P > 1:  # posted now, waited for at the next step, after its computation: the transfer overlaps it;
                # after the last step this send brings each block's gradients home to their owner
                grads_in_flight, arriving = _exchange([dkb, dvb], send_to, recv_from, group)
        if grads_in_flight is not None:
            _wait(grads_in_flight)
            dkb, dvb = arriving
        return dq, dkb, dvb, None, None, None, None, None, None


def _compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ring_attention(q, k, v, *, causal=False, layout="contiguous", scale=None, group=None, return_lse=False,
                   axes="bhsd"):
    """Attention of this rank's queries over the keys of every rank, passing key/value blocks round a ring.

    Call it on every rank of ``group`` (default: the whole world), each with its shard q (..., n, E), k (..., n, E),
    v (..., n, Ev) of one sequence split in ``layout`` ("contiguous" or "zigzag", see :func:`shard`). With
    grouped-query heads, q (..., H, n, E) and k, v (..., Hkv, n, E), Hkv dividing H: only the Hkv key/value heads
    travel round the ring (the bytes :func:`sent_bytes_per_rank` counts with ``batch_kv_heads``), and query head
    h reads key/value head h // (H / Hkv), as SDPA's ``enable_gqa``. Returns this
    rank's output rows (..., n, Ev) in the caller's dtype (half precision computed in float32). ``causal=True``
    masks by global position (key j <= query i), and block pairs wholly in the future are skipped, not computed.
    Differentiable: the backward pass is a second ring that returns each block's key/value gradients to its owner;
    each gradient transfer is waited for only at the next step, after that step's computation, which it overlaps.
    ``return_lse=True`` returns ``(out, lse)``, lse (..., n) the natural-log logsumexp of each of this rank's rows
    over every allowed key of the sequence (float32 for half-precision input): the attention state of
    :mod:`lib.merge`, differentiable too.
    Raises RuntimeError without a process group or on a rank outside ``group``; ValueError, on every rank, when the
    ranks' shards differ in shape or dtype, the layout cannot split them, or the ranks pass different ``causal``,
    ``layout`` or ``scale``. ``axes="bshd"`` takes and returns flash-attn's (B, n, H, E) shards (lse stays
    (B, H, n)); ``layout`` is how the sequence is split over the ranks, ``axes`` the order of a shard's axes.
    """
    rank, P = _group_rank_size(group, "ring_attention")
    if _check_axes(axes) == "bshd":
        named = _from_axes(axes, {"q": q, "k": k, "v": v})
        got = ring_attention(named["q"], named["k"], named["v"], causal=causal, layout=layout, scale=scale,
                             group=group, return_lse=return_lse)
        return (_to_axes(axes, got[0]), got[1]) if return_lse else _to_axes(axes, got)

    def even(q, k, v):
        _check_layout(layout)
        if layout == "zigzag" and q.shape[-2] % 2:
            raise ValueError(f"the zigzag layout gives each rank two equal chunks, so a shard needs an even "
                             f"number of tokens; got {q.shape[-2]}")

    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False; got {return_lse!r}")
    settings = [("causal", causal), ("layout", layout), ("scale", scale)]
    _validate(q, k, v, causal, group, P, "ring_attention", even, settings)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    cdtype = _compute_dtype(q.dtype)
    dtype, grouped = q.dtype, q.shape[:-2] != k.shape[:-2]
    if grouped:  # (..., Hkv, G, n, E) against (..., Hkv, 1, n, E): the group broadcasts, nothing is copied or sent
        q, k, v = q.unflatten(-3, (k.shape[-3], -1)), k.unsqueeze(-3), v.unsqueeze(-3)
    out, lse = _RingAttention.apply(q.to(cdtype), k.to(cdtype), v.to(cdtype), causal, layout, float(scale), group,
                                    rank, P)
    if grouped:
        out, lse = out.flatten(-4, -3), lse.flatten(-3, -2)  # (..., H, n, Ev), (..., H, n)
    return (out.to(dtype), lse) if return_lse else out.to(dtype)


# --------------------------------------------------------------------------------------------------------------
# All-to-all ("Ulysses")
# --------------------------------------------------------------------------------------------------------------


def _all_to_all(x, group, P):
    """x (P, ...) -> (P, ...): slice i goes to rank i, and slice j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    _SENT["bytes"] += x.numel() * x.element_size() * (P - 1) // P  # the slice for this rank stays home
    return out


def _seq_to_heads(x, group, P):
    """(..., H, n, E) sequence shards of all heads -> (..., H/P, P n, E) the whole sequence for H/P heads."""
    *batch, H, n, E = x.shape
    x = x.reshape(*batch, P, H // P, n, E).movedim(-4, 0)  # (P, ..., H/P, n, E): slice i for rank i
    x = _all_to_all(x, group, P)  # slice j: rank j's tokens of my heads
    return x.movedim(0, -3).reshape(*batch, H // P, P * n, E)  # (..., H/P, N, E)


def _heads_to_seq(y, group, P):
    """(..., H/P, P n, E) -> (..., H, n, E): the inverse of :func:`_seq_to_heads`."""
    *batch, h, N, E = y.shape
    y = y.reshape(*batch, h, P, N // P, E).movedim(-3, 0)  # (P, ..., H/P, n, E): slice i = rank i's tokens
    y = _all_to_all(y, group, P)  # slice j: my tokens of rank j's heads
    return y.movedim(0, -4).reshape(*batch, P * h, N // P, E)  # (..., H, n, E)


class _SeqToHeads(torch.autograd.Function):
    """The all-to-all is a permutation of slices between ranks; its adjoint is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, P):
        ctx.setup = (group, P)
        return _seq_to_heads(x, group, P)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, *ctx.setup), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, P):
        ctx.setup = (group, P)
        return _heads_to_seq(y, group, P)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, *ctx.setup), None, None


def ulysses_attention(q, k, v, *, causal=False, scale=None, group=None, axes="bhsd"):
    """Attention over the whole sequence by re-sharding heads with two all-to-alls ("Ulysses", chapter 12).

    q (..., H, n, E), k (..., Hkv, n, E), v (..., Hkv, n, Ev): this rank's contiguous shard of the sequence for
    all heads, H and Hkv multiples of the group's size P (Hkv = H, or Hkv dividing H for grouped-query heads:
    only the Hkv key/value heads are sent). An all-to-all gives each rank all N tokens of H/P query heads and
    the Hkv/P key/value heads they read, it runs ordinary attention on them, and a second all-to-all returns its
    output rows (..., H, n, Ev). Differentiable (the all-to-all's backward is the inverse all-to-all). Errors as
    for :func:`ring_attention`; ``axes="bshd"`` as there.
    """
    _, P = _group_rank_size(group, "ulysses_attention")
    if _check_axes(axes) == "bshd":
        named = _from_axes(axes, {"q": q, "k": k, "v": v})
        out = ulysses_attention(named["q"], named["k"], named["v"], causal=causal, scale=scale, group=group)
        return _to_axes(axes, out)

    def heads(q, k, v):
        if q.ndim < 3:
            raise ValueError(f"ulysses_attention needs a head dim: q (..., H, n, E), got shape {tuple(q.shape)}")
        if q.shape[-3] % P:
            raise ValueError(f"ulysses_attention gives each of the {P} ranks H/P heads, so H must be a multiple "
                             f"of {P}; got H={q.shape[-3]}")
        if k.shape[-3] % P:
            raise ValueError(f"ulysses_attention gives each of the {P} ranks Hkv/P key/value heads, so Hkv must be "
                             f"a multiple of {P}; got Hkv={k.shape[-3]} (repeat the key/value heads, or use the "
                             "ring)")

    _validate(q, k, v, causal, group, P, "ulysses_attention", heads, [("causal", causal), ("scale", scale)])
    qh, kh, vh = (_SeqToHeads.apply(x, group, P) for x in (q, k, v))  # (..., H/P, N, E)
    from lib.attention import attention

    if qh.shape[-3] != kh.shape[-3]:  # grouped: (..., Hkv/P, G, N, E) against (..., Hkv/P, 1, N, E)
        out = attention(qh.unflatten(-3, (kh.shape[-3], -1)), kh.unsqueeze(-3), vh.unsqueeze(-3), causal=causal,
                        scale=scale).flatten(-4, -3)  # (..., H/P, N, Ev)
    else:
        out = attention(qh, kh, vh, causal=causal, scale=scale)  # (..., H/P, N, Ev)
    return _HeadsToSeq.apply(out, group, P)  # (..., H, n, Ev)


# --------------------------------------------------------------------------------------------------------------
# Causal work per rank
# --------------------------------------------------------------------------------------------------------------


def causal_tile_counts(N, world_size, layout="contiguous", tile=64):
    """Tiles each rank computes at each ring step under a causal mask: a list of P rows, one per step, of P counts.

    Each rank cuts each of its runs of tokens (one for "contiguous", two for "zigzag") into tiles of ``tile``
    tokens, its queries and each arriving key block alike. A (query tile, key tile) pair is computed when at least
    one of its keys is at or before one of its queries; pairs wholly in the future are skipped, as a tiled kernel
    skips them. (:func:`ring_attention`, in plain torch, skips only whole runs that lie in the future and computes
    a run pair on the diagonal in full, under a mask.) Counts are exact integers; the runs must be multiples of
    ``tile`` long.
    """
    n = _check_split(N, world_size, layout)
    P = world_size
    runs = [_runs(n, r, P, layout) for r in range(P)]
    for s, _ in runs[0]:
        if (s.stop - s.start) % tile:
            raise ValueError(f"runs of {s.stop - s.start} tokens do not cut into tiles of {tile}")

    def tiles(rank):
        return [(start + i, tile) for s, start in runs[rank] for i in range(0, s.stop - s.start, tile)]

    counts = []
    for step in range(P):
        row = []
        for rank in range(P):
            owner = (rank - step) % P
            row.append(sum(_relation(a, lq, b, lk) != "none" for a, lq in tiles(rank) for b, lk in tiles(owner)))
        counts.append(row)
    return counts


# --------------------------------------------------------------------------------------------------------------
# Starting processes from a script or a notebook
# --------------------------------------------------------------------------------------------------------------


def _worker(fn, rank, world_size, folder, backend, timeout, args):
    """One rank: silence its output, join the group through a file, run fn, store its result or traceback."""
    folder = pathlib.Path(folder)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # a notebook's kernel captures its children's output streams: workers print nothing
    os.dup2(devnull, 2)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=(folder / "rendezvous").as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, folder / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - whatever stops a rank, its caller must hear why
        (folder / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # leave at once: a rank blocked in a collective would keep the process alive
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_importable(fn):
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"launch starts fresh processes that import the worker by name, so {qualname or fn!r} must be a "
            "module-level function of an importable module (not defined in a notebook cell, a script run as "
            "__main__, or inside another function)"
        )


def launch(fn, world_size, *args, timeout=60.0, backend="gloo"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes, one rank each; return their results.

    Each process joins a ``backend`` process group ("gloo" on CPUs; "nccl" gives rank r GPU r) through a file in a
    fresh temporary folder, so no port is fixed and parallel test runs cannot collide. Processes are spawned, so
    ``fn`` must live in an importable module, and a script that calls ``launch`` must do so under
    ``if __name__ == "__main__":`` (each new process imports the script again). Workers print nothing; their results come back through files, as a
    list in rank order. If a rank raises, its traceback is raised here as RuntimeError; if the ranks do not finish
    within ``timeout`` seconds (also each collective's timeout), they are stopped and RuntimeError is raised.
    """
    _check_importable(fn)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"the nccl backend gives each rank a GPU of its own (NCCL refuses two ranks on one GPU): "
                         f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ring-") as folder:
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"  # warnings printed while a child imports would reach a notebook
        try:
            procs = [
                context.Process(target=_worker, args=(fn, r, world_size, folder, backend, timeout, args))
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("PYTHONWARNINGS", None)
            else:
                os.environ["PYTHONWARNINGS"] = saved
        deadline = time.monotonic() + timeout
        failed = None
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                break
            time.sleep(0.02)
        running = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        files = {r: pathlib.Path(folder) / f"rank{r}.err" for r in range(world_size)}
        files = {r: f for r, f in files.items() if f.exists()}
        if files:  # the rank that failed first; the others often failed because it left
            first = min(files, key=lambda r: files[r].stat().st_mtime_ns)
            also = f" (ranks {sorted(files)} failed)" if len(files) > 1 else ""
            raise RuntimeError(f"rank {first} of {world_size} failed first{also}:\n{files[first].read_text()}")
        if failed is not None:
            raise RuntimeError(f"rank {failed} of {world_size} exited with code {procs[failed].exitcode}")
        if running:
            raise RuntimeError(f"ranks {running} of {world_size} did not finish within {timeout} s and were stopped")
        return [torch.load(pathlib.Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# --------------------------------------------------------------------------------------------------------------
# A worker that checks both schemes (chapter 12 and the tests run it)
# --------------------------------------------------------------------------------------------------------------


def run_cases(rank, world_size, cases):
    """Worker for :func:`launch`: run each case on this rank's shards and return what it computed.

    A case is a dict with ``scheme`` ("ring" or "ulysses"), ``causal``, ``layout`` (ring only) and the whole
    sequence's ``q``, ``k``, ``v`` and ``dout`` (the output's gradient); or ``shards``, a list of per-rank
    ``(q, k, v)``, to pass inputs as they are; optionally ``scale``. With ``dlse`` (the whole sequence's (..., N)
    gradient of the logsumexp; ring only) the call asks for ``return_lse=True``, the backward pass takes both
    gradients, and the result also holds this rank's ``lse``. A list in place of ``causal``, ``layout`` or
    ``scale`` gives each rank its own value (to test ranks that disagree). With ``ranks``, a list of global ranks, the case runs on a
    subgroup of just those ranks (every rank creates the group; the others return None for it). For each case it
    returns a dict with this rank's ``out``, ``dq``, ``dk``, ``dv`` and the bytes it sent forward and backward,
    or ``error``: "TypeName: message" if the call raised.
    """
    results = []
    for case in cases:
        group, me, size = None, rank, world_size
        if "ranks" in case:
            group = dist.new_group(case["ranks"])  # every rank must take part in creating it
            if rank not in case["ranks"]:
                results.append(None)
                continue
            me, size = case["ranks"].index(rank), len(case["ranks"])
        mine = {x: case.get(x, default) for x, default in (("causal", False), ("layout", "contiguous"), ("scale", None))}
        mine = {x: value[me] if isinstance(value, list) else value for x, value in mine.items()}  # per-rank lists
        fn = ring_attention if case["scheme"] == "ring" else ulysses_attention
        kwargs = {"causal": mine["causal"], "scale": mine["scale"], "group": group}
        layout = mine["layout"]
        if case["scheme"] == "ring":
            kwargs["layout"] = layout
        if "dlse" in case:
            kwargs["return_lse"] = True
        bshd = case.get("axes") == "bshd"  # the shards are passed as (B, n, H, E) and the results turned back
        if bshd:
            kwargs["axes"] = "bshd"
        try:
            if "shards" in case:
                q, k, v = case["shards"][me]
            else:
                q, k, v = (shard(case[x], me, size, layout) for x in ("q", "k", "v"))
            if bshd:
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
            reset_bytes_sent()
            out = fn(q, k, v, **kwargs)
            out, lse = out if "dlse" in case else (out, None)
            forward_bytes = bytes_sent()
            reset_bytes_sent()
            dout = shard(case["dout"], me, size, layout) if "dout" in case else torch.ones_like(out)
            if bshd and "dout" in case:
                dout = dout.transpose(1, 2)
            if lse is None:
                out.backward(dout)
            else:
                dlse = shard(case["dlse"][..., None], me, size, layout)[..., 0]
                torch.autograd.backward([out, lse], [dout, dlse])
            result = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                      "bytes_forward": forward_bytes, "bytes_backward": bytes_sent()}
            if bshd:
                result.update({name: result[name].transpose(1, 2) for name in ("out", "dq", "dk", "dv")})
            if lse is not None:
                result["lse"] = lse.detach()
            results.append(result)
        except (ValueError, TypeError, RuntimeError) as err:
            results.append({"error": f"{type(err).__name__}: {err}"})
    return results
