"""FlashAttention on a GPU: softmax(q kᵀ · scale) v as Triton kernels, forward and backward (chapter 8).

The algorithm is chapter 7's tiled loop the FlashAttention-2 way round: one program per (batch·head, query block)
keeps its queries, a running maximum, a running sum and an output accumulator on chip, and walks the key blocks.
Scores and weights exist only on chip, never in GPU memory (HBM); the kernel writes the output and, per query
row, the logsumexp of its scores. The backward pass reads that logsumexp and recomputes each tile's weights
instead of reading a saved (L, S) matrix: more arithmetic, far fewer bytes moved.

Shapes as in :mod:`lib.attention`: q (..., L, E), k (..., S, E), v (..., S, Ev). The wrapper flattens the batch
dimensions into one, Z, so every kernel sees q (Z, L, E), k (Z, S, E), v (Z, S, Ev), reached through strides.

On a CPU, Triton's interpreter runs the same kernels, slowly, when the environment variable TRITON_INTERPRET=1 is
set before Triton is first imported (by anything: some torch modules import it): the tests and chapter 8 use it at
small sizes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lib.backend import _check_flag, _check_scale

__all__ = ["flash_attention"]

# triton.jit reads TRITON_INTERPRET when it defines each kernel below, so this is read at the same moment.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
if INTERPRETED and type(tl.max).__name__ != "InterpretedFunction":
    # triton.language defines its own helpers (tl.max, tl.sum, ...) with triton.jit when it is first imported.
    raise ImportError(
        "TRITON_INTERPRET=1 was set after Triton had been imported (some torch modules import it, for example "
        "torch.utils.flop_counter): set it before anything imports triton, e.g. first thing in the notebook"
    )

LOG2_E = 1.0 / math.log(2.0)  # exp(x) = exp2(x · log2 e): the kernels work in base 2, which the hardware does natively
MAX_HEAD = 256  # largest E or Ev: a (block, head) tile of q, k and v must fit in on-chip memory beside the scores
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: how many queries and keys a tile holds, and how the GPU runs a program."""

    block_m: int  # queries in a tile
    block_n: int  # keys in a tile
    num_warps: int  # 32-thread groups that share one program
    num_stages: int  # how many key tiles the compiler may prefetch ahead of the one being used


# Small tiles for Triton's interpreter: at test sizes every case still crosses several tiles in each direction.
INTERPRETER_TILES = Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
# On a GPU each kernel is timed once per problem shape with each of these and keeps the fastest (triton.autotune).
# Larger query tiles reuse each key tile for more queries; larger key tiles mean fewer rescales; both cost on-chip
# memory and registers. Compiled for an H100 (sm_90), every backward choice and all but one forward choice (128 × 64
# with 4 warps at head size 128) run without spilling registers to memory at head sizes 64 and 128.
FORWARD_TILES = (
    Tiles(block_m=128, block_n=64, num_warps=4, num_stages=3),
    Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
    Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3),
    Tiles(block_m=64, block_n=64, num_warps=4, num_stages=4),
    Tiles(block_m=64, block_n=32, num_warps=4, num_stages=3),
)
BACKWARD_TILES = (
    Tiles(block_m=64, block_n=64, num_warps=8, num_stages=2),
    Tiles(block_m=64, block_n=64, num_warps=8, num_stages=3),
    Tiles(block_m=32, block_n=128, num_warps=8, num_stages=2),
    Tiles(block_m=64, block_n=128, num_warps=8, num_stages=2),
    Tiles(block_m=32, block_n=64, num_warps=4, num_stages=3),
)


# --------------------------------------------------------------------------------------------------------------
# Forward. One program computes BLOCK_M rows of the output for one z (one batch element and head):
#   on chip: its q tile (BLOCK_M, E), one key tile kᵀ (E, BLOCK_N) and value tile (BLOCK_N, Ev) at a time, the
#            scores of that pair (BLOCK_M, BLOCK_N), and per row the running max m, running sum l and output acc.
#   reads:   q once; k and v once per query block, ⌈L / BLOCK_M⌉ times in all (about half that when causal).
#   writes:  its output rows (BLOCK_M, Ev) and their logsumexp (BLOCK_M,), once.
# Everything is in base 2: s holds score · log2 e, so exp2(s - m) = exp(score - max).
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _forward_tiles(
    acc, l_i, m_i, q, K_z, V_z, lo, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The online softmax over key tiles lo, lo + BLOCK_N, ... < hi. MASKED tiles may reach past S or into a
    row's causal future; the others are wholly allowed, and skip the comparisons. A tile's addresses are formed
    where it is loaded, from the base pointers K_z, V_z and vectors of offsets: a tensor of BLOCK_E × BLOCK_N
    pointers kept across the loop would take registers that the matrix products need."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0  # (BLOCK_N,) key indices of this tile
        kt_ptrs = K_z + cols[None, :] * sk_s + offs_e[:, None] * sk_e  # (BLOCK_E, BLOCK_N): kᵀ of this tile
        v_ptrs = V_z + cols[:, None] * sv_s + offs_ev[None, :] * sv_e  # (BLOCK_N, BLOCK_EV)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & (cols[None, :] < S), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < S) & (offs_ev[None, :] < EV), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_e[:, None] < E, other=0.0)  # (BLOCK_E, BLOCK_N)
            v = tl.load(v_ptrs, mask=offs_ev[None, :] < EV, other=0.0)  # (BLOCK_N, BLOCK_EV)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            allowed = cols[None, :] < S
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: exp2(-inf - 0) = 0
        p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N), weights up to the row's final 1 / l
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # (BLOCK_M, BLOCK_EV)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_forward(
    Q, K, V, O, LSE,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, so_z, so_l, so_e,
    L, S, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M  # first query row of this program
    z = tl.program_id(1).to(tl.int64)  # batch·head index; 64-bit so that z · stride cannot overflow
    rows = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols0 = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key offsets within a tile
    offs_e = tl.arange(0, BLOCK_E)  # (BLOCK_E,) E padded to a power of two; the padding is loaded as 0
    offs_ev = tl.arange(0, BLOCK_EV)  # (BLOCK_EV,)
    q = tl.load(
        Q + z * sq_z + rows[:, None] * sq_l + offs_e[None, :] * sq_e,
        mask=(rows[:, None] < L) & (offs_e[None, :] < E),
        other=0.0,
    )  # (BLOCK_M, BLOCK_E), read once and kept on chip
    K_z = K + z * sk_z  # this z's keys and values
    V_z = V + z * sv_z
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)  # running sum of exp2(s - m) v

    # Key tiles [0, full) lie inside S and wholly in the past of every row here; tiles [full, hi) need masks.
    # Causal: tiles that start after this block's last query are never visited, the skipped half of the work.
    if CAUSAL:
        hi = tl.minimum(S, start_m + BLOCK_M)
        full = (tl.minimum(S, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = S
        full = (S // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _forward_tiles(
        acc, l_i, m_i, q, K_z, V_z, 0, full, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
        E, EV, False, CAUSAL, BLOCK_N, PRECISION,
    )
    acc, l_i, m_i = _forward_tiles(
        acc, l_i, m_i, q, K_z, V_z, full, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
        E, EV, True, CAUSAL, BLOCK_N, PRECISION,
    )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no key gets 0, not 0/0
    out = acc / l_safe[:, None]  # the one division, deferred to the end
    tl.store(
        O + z * so_z + rows[:, None] * so_l + offs_ev[None, :] * so_e,
        out.to(O.dtype.element_ty),
        mask=(rows[:, None] < L) & (offs_ev[None, :] < EV),
    )
    tl.store(LSE + z * L + rows, m_i + tl.math.log2(l_safe), mask=rows < L)  # logsumexp, base 2


# --------------------------------------------------------------------------------------------------------------
# Backward, given dO (the gradient of the output), the saved logsumexp and D = rowsum(dO ∘ O) (one per query):
#   P = exp2(s - lse)   dV = Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - D)   dQ = scale · dS K   dK = scale · dSᵀ Q
# _flash_backward_kv: one program per (z, key block) owns dK and dV of BLOCK_N keys and walks the query blocks:
#   on chip: its k and v tiles, dK and dV accumulators, one query block's q, dO, lse and D at a time, and the
#            transposed weights Pᵀ (BLOCK_N, BLOCK_M) recomputed for that pair.
#   reads:   k and v once; q, dO, lse and D once per key block.   writes: dK and dV, once.
# _flash_backward_q: one program per (z, query block) owns dQ and walks the key blocks, recomputing P the same way.
# Two kernels rather than one with atomic adds into dQ: each output is written by exactly one program.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _backward_kv_tiles(
    dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, lo, hi, cols, rows0, offs_e, offs_ev, L, sq_l, sq_e, sdo_l, sdo_e,
    qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Accumulate dK and dV of one key block over query blocks lo, lo + BLOCK_M, ... < hi."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + rows0  # (BLOCK_M,) query indices
        in_rows = rows < L
        q_ptrs = Q_z + rows[:, None] * sq_l + offs_e[None, :] * sq_e  # (BLOCK_M, BLOCK_E)
        do_ptrs = DO_z + rows[:, None] * sdo_l + offs_ev[None, :] * sdo_e  # (BLOCK_M, BLOCK_EV)
        q = tl.load(q_ptrs, mask=in_rows[:, None] & (offs_e[None, :] < E), other=0.0)
        do = tl.load(do_ptrs, mask=in_rows[:, None] & (offs_ev[None, :] < EV), other=0.0)
        lse = tl.load(LSE_z + rows, mask=in_rows, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA_z + rows, mask=in_rows, other=0.0)  # (BLOCK_M,)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), scores transposed
        pt = tl.math.exp2(st - lse[None, :])  # Pᵀ, recomputed
        if MASKED:  # rows past L hold zeros anyway; the causal future must be zeroed
            pt = tl.where(in_rows[None, :] & (rows[None, :] >= cols[:, None]), pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)  # (BLOCK_N, BLOCK_EV) += Pᵀ dO
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = (dO Vᵀ)ᵀ
        dst = pt * (dpt - delta[None, :])  # dSᵀ
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)  # (BLOCK_N, BLOCK_E) += dSᵀ Q
    return dk, dv


@triton.jit
def _flash_backward_kv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, sdo_z, sdo_l, sdo_e,
    sdk_z, sdk_s, sdk_e, sdv_z, sdv_s, sdv_e,
    L, S, qk_scale, scale,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N  # first key of this program
    z = tl.program_id(1).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    rows0 = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    in_cols = cols < S
    k = tl.load(
        K + z * sk_z + cols[:, None] * sk_s + offs_e[None, :] * sk_e,
        mask=in_cols[:, None] & (offs_e[None, :] < E), other=0.0,
    )  # (BLOCK_N, BLOCK_E)
    v = tl.load(
        V + z * sv_z + cols[:, None] * sv_s + offs_ev[None, :] * sv_e,
        mask=in_cols[:, None] & (offs_ev[None, :] < EV), other=0.0,
    )  # (BLOCK_N, BLOCK_EV)
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    Q_z = Q + z * sq_z  # this z's queries and output gradients
    DO_z = DO + z * sdo_z
    LSE_z = LSE + z * L
    DELTA_z = DELTA + z * L

    # Causal: queries before this key block never see it, so start at the query block holding query start_n; the
    # blocks that straddle the diagonal need the mask, the ones wholly below it do not. Otherwise every block, and
    # only the ragged last one could need a mask, which the zeros it loads make unnecessary.
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        below = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(L, BLOCK_M) * BLOCK_M)
        below = tl.maximum(below, lo)
    else:
        lo = 0
        below = 0
    dk, dv = _backward_kv_tiles(
        dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, lo, below, cols, rows0, offs_e, offs_ev, L, sq_l, sq_e, sdo_l,
        sdo_e, qk_scale, E, EV, True, CAUSAL, BLOCK_M, PRECISION,
    )
    dk, dv = _backward_kv_tiles(
        dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, tl.maximum(lo, below), L, cols, rows0, offs_e, offs_ev, L,
        sq_l, sq_e, sdo_l, sdo_e, qk_scale, E, EV, False, CAUSAL, BLOCK_M, PRECISION,
    )
    out_mask_e = in_cols[:, None] & (offs_e[None, :] < E)
    tl.store(DK + z * sdk_z + cols[:, None] * sdk_s + offs_e[None, :] * sdk_e, (dk * scale).to(DK.dtype.element_ty),
             mask=out_mask_e)
    tl.store(DV + z * sdv_z + cols[:, None] * sdv_s + offs_ev[None, :] * sdv_e, dv.to(DV.dtype.element_ty),
             mask=in_cols[:, None] & (offs_ev[None, :] < EV))


@triton.jit
def _backward_q_tiles(
    dq, q, do, lse, delta, K_z, V_z, lo, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Accumulate dQ of one query block over key tiles lo, lo + BLOCK_N, ... < hi."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        kt_ptrs = K_z + cols[None, :] * sk_s + offs_e[:, None] * sk_e  # (BLOCK_E, BLOCK_N)
        vt_ptrs = V_z + cols[None, :] * sv_s + offs_ev[:, None] * sv_e  # (BLOCK_EV, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & (cols[None, :] < S), other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_ev[:, None] < EV) & (cols[None, :] < S), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_e[:, None] < E, other=0.0)  # (BLOCK_E, BLOCK_N)
            vt = tl.load(vt_ptrs, mask=offs_ev[:, None] < EV, other=0.0)  # (BLOCK_EV, BLOCK_N)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])  # P, recomputed
        if MASKED:
            allowed = cols[None, :] < S
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) = dO Vᵀ
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)  # (BLOCK_M, BLOCK_E) += dS K
    return dq


@triton.jit
def _flash_backward_q(
    Q, K, V, DO, LSE, DELTA, DQ,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, sdo_z, sdo_l, sdo_e, sdq_z, sdq_l, sdq_e,
    L, S, qk_scale, scale,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    z = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    in_rows = rows < L
    q = tl.load(Q + z * sq_z + rows[:, None] * sq_l + offs_e[None, :] * sq_e,
                mask=in_rows[:, None] & (offs_e[None, :] < E), other=0.0)  # (BLOCK_M, BLOCK_E)
    do = tl.load(DO + z * sdo_z + rows[:, None] * sdo_l + offs_ev[None, :] * sdo_e,
                 mask=in_rows[:, None] & (offs_ev[None, :] < EV), other=0.0)  # (BLOCK_M, BLOCK_EV)
    lse = tl.load(LSE + z * L + rows, mask=in_rows, other=0.0)
    delta = tl.load(DELTA + z * L + rows, mask=in_rows, other=0.0)
    K_z = K + z * sk_z
    V_z = V + z * sv_z
    dq = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    if CAUSAL:  # the same split of key tiles as the forward pass
        hi = tl.minimum(S, start_m + BLOCK_M)
        full = (tl.minimum(S, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = S
        full = (S // BLOCK_N) * BLOCK_N
    dq = _backward_q_tiles(
        dq, q, do, lse, delta, K_z, V_z, 0, full, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
        E, EV, False, CAUSAL, BLOCK_N, PRECISION,
    )
    dq = _backward_q_tiles(
        dq, q, do, lse, delta, K_z, V_z, full, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e,
        qk_scale,
        E, EV, True, CAUSAL, BLOCK_N, PRECISION,
    )
    tl.store(DQ + z * sdq_z + rows[:, None] * sdq_l + offs_e[None, :] * sdq_e, (dq * scale).to(DQ.dtype.element_ty),
             mask=in_rows[:, None] & (offs_e[None, :] < E))


# --------------------------------------------------------------------------------------------------------------
# Launching: tiles chosen by autotuning on a GPU, fixed in the interpreter.
# --------------------------------------------------------------------------------------------------------------


def _launcher(kernel, choices):
    """The kernel, tuned on a GPU among ``choices`` once per (L, S, E, Ev, causal, dtype); in the interpreter, the
    kernel with INTERPRETER_TILES (tuning there would only multiply the wait). A ``tiles=`` argument forces one
    configuration, for sweeps (benchmarks/bench_gpu.py --sweep)."""
    configs = [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps, num_stages=t.num_stages)
        for t in choices
    ]
    tuned = None if INTERPRETED else triton.autotune(configs=configs, key=["L", "S", "E", "EV", "CAUSAL"])(kernel)

    def launch(grid, *args, tiles=None, **kw):
        if tiles is None and tuned is not None:
            return tuned[grid](*args, **kw)
        t = tiles or INTERPRETER_TILES
        launch_options = {} if INTERPRETED else {"num_warps": t.num_warps, "num_stages": t.num_stages}
        return kernel[grid](*args, **kw, BLOCK_M=t.block_m, BLOCK_N=t.block_n, **launch_options)

    return launch


_run_forward = _launcher(_flash_forward, FORWARD_TILES)
_run_backward_kv = _launcher(_flash_backward_kv, BACKWARD_TILES)
_run_backward_q = _launcher(_flash_backward_q, BACKWARD_TILES)


def _head_block(n):
    return max(16, triton.next_power_of_2(n))  # tl.dot needs each side at least 16


def _precision(dtype):
    """float32 is multiplied in full IEEE float32 (no TF32 rounding); for half precision Triton ignores it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(q, k, v, causal, scale, tiles=None):
    """q (Z, L, E), k (Z, S, E), v (Z, S, Ev) -> output (Z, L, Ev) and logsumexp (Z, L), base 2, float32."""
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    o = torch.empty((Z, L, EV), device=q.device, dtype=q.dtype)
    lse = torch.empty((Z, L), device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), Z)
    _run_forward(
        grid, q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), L, S, scale * LOG2_E,
        E=E, EV=EV, BLOCK_E=_head_block(E), BLOCK_EV=_head_block(EV), CAUSAL=causal, PRECISION=_precision(q.dtype),
        tiles=tiles,
    )
    return o, lse


def _backward(q, k, v, o, lse, do, causal, scale, tiles=None):
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    delta = (do.float() * o.float()).sum(-1).contiguous()  # (Z, L): D = rowsum(dO ∘ O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = {"E": E, "EV": EV, "BLOCK_E": _head_block(E), "BLOCK_EV": _head_block(EV), "CAUSAL": causal,
                  "PRECISION": _precision(q.dtype)}
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    _run_backward_kv(
        lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), Z),
        q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), *dv.stride(), L, S, scale * LOG2_E, scale,
        tiles=tiles, **common,
    )
    _run_backward_q(
        lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), Z),
        q, k, v, do, lse, delta, dq, *strides, *dq.stride(), L, S, scale * LOG2_E, scale, tiles=tiles, **common,
    )
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the logsumexp: nothing of size L × S."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


# --------------------------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------------------------


def _check(q, k, v, mask):
    named = {"q": q, "k": k, "v": v}
    for n, x in named.items():
        if not isinstance(x, torch.Tensor):
            kind = f"{type(x).__module__}.{type(x).__qualname__}"
            hint = " (for NumPy arrays use attn.attention)" if kind.startswith("numpy") else ""
            raise TypeError(f"flash_attention takes torch tensors; {n} is a {kind}{hint}")
    if mask is not None:
        raise ValueError(
            "flash_attention takes no mask: its kernel knows only causal=True. For a boolean or additive mask use "
            "attn.attention(q, k, v, mask) or attn.tiled_attention"
        )
    devices = {n: x.device for n, x in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, k and v must be on one device; got q {devices['q']}, k {devices['k']}, v {devices['v']}")
    dtypes = {n: x.dtype for n, x in named.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, k and v must share one dtype; got q {dtypes['q']}, k {dtypes['k']}, v {dtypes['v']}")
    dtype, device = q.dtype, q.device
    if dtype not in DTYPES:
        raise TypeError(
            f"flash_attention computes in float16, bfloat16 or float32; got {dtype} (attn.attention takes any float)"
        )
    if INTERPRETED:
        if dtype == torch.bfloat16:
            raise TypeError("bfloat16 is not supported in Triton's interpreter (it computes wrong values there): "
                            "use float16 or float32 on the CPU, or run on a GPU")
    elif device.type != "cuda":
        raise ValueError(
            f"q is on {device}, but the Triton kernel runs on a CUDA GPU. To run it on the CPU in Triton's "
            "interpreter (slow; for tests and small examples), set os.environ['TRITON_INTERPRET'] = '1' before "
            "Triton is first imported, by anything (some torch modules import it)"
        )
    elif dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
        raise TypeError(f"bfloat16 needs a GPU of compute capability 8.0 or newer; {device} has "
                        f"{torch.cuda.get_device_capability(device)}: use float16")
    for n, x in named.items():
        if x.ndim < 2:
            raise ValueError(f"{n} must be at least 2-D, (..., {'L' if n == 'q' else 'S'}, E); got shape "
                             f"{tuple(x.shape)}")
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    if k.shape[-1] != E:
        raise ValueError(f"k has E={k.shape[-1]} but q has E={E} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if k.shape[-2] != S:
        raise ValueError(f"v has S={S} rows but k has S={k.shape[-2]} (k {tuple(k.shape)}, v {tuple(v.shape)})")
    for name, size in (("E", E), ("Ev", Ev)):
        if not 1 <= size <= MAX_HEAD:
            raise ValueError(f"head size {name}={size} is outside the kernel's 1..{MAX_HEAD}: use attn.attention")
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dimensions do not broadcast: q {tuple(q.shape[:-2])}, "
                         f"k {tuple(k.shape[:-2])}, v {tuple(v.shape[:-2])}") from None
    return tuple(batch), L, S, E, Ev


def flash_attention(q, k, v, mask=None, *, causal=False, scale=None):
    """FlashAttention-2 in Triton: softmax(q kᵀ · scale) v without the (..., L, S) matrix (chapter 8).

    q (..., L, E), k (..., S, E), v (..., S, Ev) torch tensors on a CUDA GPU, in float16, bfloat16 or float32,
    batch dims broadcast; returns (..., L, Ev) in the inputs' dtype. Any L and S (not only multiples of the tile
    sizes) and head sizes 1 to 256 (padded inside to a power of two, at least 16). ``causal=True`` lets query i
    attend keys j <= i (top-left aligned, as :func:`lib.attention.attention`), and key tiles wholly in a query
    tile's future are skipped, not computed. ``scale`` defaults to 1/sqrt(E). There is no ``mask``: for other
    masks use :func:`lib.attention.attention`. A query with no key (S = 0) gets zeros.

    Products of half-precision inputs run on the tensor cores and accumulate in float32; the softmax statistics
    and the output accumulator are float32. float32 inputs are multiplied in IEEE float32 (no TF32), exact but
    far slower: the kernel is built for half precision. Differentiable: the backward pass recomputes each tile's
    weights from the saved row logsumexp, so training saves nothing of size L × S. On a CPU the kernels run in
    Triton's interpreter if TRITON_INTERPRET=1 was set before Triton was first imported (not for bfloat16).
    """
    batch, L, S, E, Ev = _check(q, k, v, mask)
    _check_flag(causal, "causal")
    scale = _check_scale(scale, E)
    Z = math.prod(batch)
    if Z == 0 or L == 0 or S == 0:  # nothing to attend, or nobody asking: zeros, still tied to the inputs
        zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
        return zero + torch.zeros(batch + (L, Ev), dtype=q.dtype, device=q.device)
    q3 = q.expand(batch + (L, E)).reshape(Z, L, E)  # (Z, L, E), a view whenever the batch dims allow
    k3 = k.expand(batch + (S, E)).reshape(Z, S, E)  # (Z, S, E)
    v3 = v.expand(batch + (S, Ev)).reshape(Z, S, Ev)  # (Z, S, Ev)
    out = _FlashAttention.apply(q3, k3, v3, bool(causal), scale)  # (Z, L, Ev)
    return out.reshape(batch + (L, Ev))
