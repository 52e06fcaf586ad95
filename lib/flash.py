"""FlashAttention on a GPU: softmax(q kᵀ · scale) v as Triton kernels, forward and backward (chapter 9).

The algorithm is chapter 7's tiled loop the FlashAttention-2 way round: one program per (batch·head, query block)
keeps its queries, a running maximum, a running sum and an output accumulator on chip, and walks the key blocks.
Scores and weights exist only on chip, never in GPU memory (HBM); the kernel writes the output and, per query
row, the logsumexp of its scores. The backward pass reads that logsumexp and recomputes each tile's weights
instead of reading a saved (L, S) matrix: more arithmetic, far fewer bytes moved.

Shapes as in :mod:`lib.attention`: q (..., L, E), k (..., S, E), v (..., S, Ev). The wrapper flattens the batch
dimensions into one, Z, so every kernel sees q (Z, L, E), k (Z, S, E), v (Z, S, Ev), reached through strides.

On a CPU, Triton's interpreter runs the same kernels, slowly, when the environment variable TRITON_INTERPRET=1 is
set before Triton is first imported (by anything: some torch modules import it): the tests and chapter 9 use it at
small sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as err:
    if err.name != "triton":
        raise
    from lib.runtime import triton_hint

    raise ModuleNotFoundError(f"lib.flash: {triton_hint()}", name="triton") from None

from lib.backend import _check_axes, _check_causal, _check_scale, _from_axes, _to_axes

__all__ = ["LADDER", "Variant", "flash_attention"]

# triton.jit reads TRITON_INTERPRET when it defines each kernel below, so this is read at the same moment.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
if INTERPRETED and type(tl.max).__name__ != "InterpretedFunction":
    # triton.language defines its own helpers (tl.max, tl.sum, ...) with triton.jit when it is first imported.
    raise ImportError(
        "TRITON_INTERPRET=1 was set after Triton had been imported (some torch modules import it, for example "
        "torch.utils.flop_counter): set it before anything imports triton, e.g. first thing in the notebook"
    )

LOG2_E = 1.0 / math.log(2.0)  # exp(x) = exp2(x · log2 e): the kernels work in base 2, which the hardware does natively
LN_2 = math.log(2.0)  # the kernels' base-2 logsumexp times ln 2 is the natural one
MAX_HEAD = 256  # largest E or Ev: a (block, head) tile of q, k and v must fit in on-chip memory beside the scores
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: how many queries and keys a tile holds, and how the GPU runs a program."""

    block_m: int  # queries in a tile
    block_n: int  # keys in a tile
    num_warps: int  # 32-thread groups that share one program
    num_stages: int  # depth of the ring buffer of tiles in shared memory: num_stages − 1 loads in flight
    max_head: int = 256  # offered to the tuner only when E and Ev, padded, are at most this (registers run out)


# Small tiles for Triton's interpreter: at test sizes every case still crosses several tiles in each direction.
INTERPRETER_TILES = Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
# On a GPU each kernel is timed once per problem shape with each choice of its own list and keeps the fastest
# (triton.autotune). Larger query tiles reuse each key tile for more queries; larger key tiles mean fewer
# rescales; both cost shared memory and registers, and what fits differs from one GPU generation to the next. So
# each architecture has its own table, picked at launch from the GPU's compute capability (tile_table). Every
# choice of every table is compiled for its architecture by tools/compile_report.py in CI, as the JIT specialises
# a contiguous launch (bfloat16; float16 on sm_75, which has no bfloat16 tensor-core products): at head sizes 64
# and 128 (where its max_head allows), causal or not and with chapter 13's sliding window, none spills registers,
# all fit one block's shared memory, and from sm_80 on every product runs on the tensor cores (below it Triton has
# none; see TILE_TABLES). On sm_90 the products compile to the asynchronous warpgroup instruction (wgmma) when the
# product's left operand has at least 64 rows; the exceptions are named below.
T = Tiles
FORWARD_TILES = (  # left operands: the query tile (BLOCK_M rows) and the weights P (BLOCK_M rows)
    T(128, 64, num_warps=8, num_stages=3),
    T(128, 64, num_warps=8, num_stages=2),
    T(128, 128, num_warps=8, num_stages=2),
    T(64, 64, num_warps=4, num_stages=3),
    T(128, 64, num_warps=4, num_stages=3, max_head=64),  # spills 140 bytes at head size 128
    T(128, 128, num_warps=8, num_stages=3, max_head=64),  # 224 of 227 KiB at 128: no room for a change
)
BACKWARD_KV_TILES = (  # the two-kernel (deterministic) path's dK/dV kernel: left operands are key tiles
    T(64, 64, num_warps=8, num_stages=3),
    T(64, 64, num_warps=8, num_stages=2, max_head=64),
    T(32, 128, num_warps=8, num_stages=2),
    T(64, 128, num_warps=8, num_stages=2, max_head=64),
    T(32, 64, num_warps=4, num_stages=3),
)
# The atomic path's dK/dV kernel also holds a (BLOCK_M, E) share of dQ: at head size 128 only 32-query tiles leave
# it registers enough, and a 32-row left operand puts that one product (dS K) on the older mma.sync.
BACKWARD_KV_ATOMIC_TILES = (
    T(64, 64, num_warps=8, num_stages=2, max_head=64),
    T(64, 64, num_warps=8, num_stages=3, max_head=64),
    T(64, 128, num_warps=8, num_stages=2, max_head=64),
    T(32, 128, num_warps=8, num_stages=2),
    T(32, 128, num_warps=8, num_stages=3),
    T(32, 64, num_warps=8, num_stages=3),
)
BACKWARD_Q_TILES = (  # the dQ kernel: its left operand is a query tile, so BLOCK_M >= 64 (with 32, mma.sync)
    T(64, 64, num_warps=4, num_stages=3),
    T(64, 64, num_warps=8, num_stages=2),
    T(64, 64, num_warps=8, num_stages=3),
    T(128, 64, num_warps=8, num_stages=2),
    T(64, 32, num_warps=4, num_stages=3),
    T(64, 128, num_warps=8, num_stages=2, max_head=64),
)


@dataclass(frozen=True)
class TileTable:
    """Each kernel's tile choices for one GPU architecture, and the shared memory one thread block may use there."""

    arch: str  # the architecture the choices are compiled for, e.g. "sm_90"
    gpus: str  # the GPUs Colab offers of it
    shared_per_block: int  # bytes of shared memory one thread block may use (the opt-in maximum)
    forward: tuple
    backward_kv: tuple  # the deterministic path's dK/dV kernel
    backward_kv_atomic: tuple  # the dK/dV kernel that also adds dQ with atomics
    backward_q: tuple  # the deterministic path's dQ kernel

    @property
    def capability(self) -> tuple:
        return int(self.arch[3:-1]), int(self.arch[-1])

    def offers(self, field, E, EV=None):
        """Whether the kernel of ``field`` (e.g. "backward_kv_atomic") has a tile choice for head sizes E and Ev
        (padded to a power of two, as the kernels pad them)."""
        head = max(_head_block(E), _head_block(E if EV is None else EV))
        return any(head <= t.max_head for t in getattr(self, field))


KiB = 1024
# The other architectures multiply with mma.sync, whose operands pass through registers: at head size 128 the sm_90
# choices spill there, so each table holds smaller tiles or fewer stages. A T4 (sm_75) has no tensor-core path in
# Triton since 3.2 (triton-lang/triton#5066; Triton 3.9 says "Dot op using MMA for compute capability 75 has been
# deprecated. It falls back to the FMA path"): its products run as float32 FMA on the CUDA cores, which keep both
# operands in registers, so only small tiles fit there, and without cp.async (sm_80 and later) Triton does not
# pipeline the loads, so num_stages is 1. Its atomic dK/dV kernel, which also holds a share of dQ, spills at head
# size 128 with every tile (4 bytes with 16 × 16 and 8 warps, hundreds with any other): there the backward takes the
# two-kernel path instead (_backward_variant), which spills nothing.
TILE_TABLES = {
    "sm_75": TileTable(
        "sm_75", "T4", 64 * KiB,
        forward=(T(16, 32, num_warps=4, num_stages=1), T(32, 16, num_warps=4, num_stages=1),
                 T(32, 32, num_warps=8, num_stages=1)),
        backward_kv=(T(16, 16, num_warps=8, num_stages=1),),
        backward_kv_atomic=(T(16, 16, num_warps=8, num_stages=1, max_head=64),),  # none at 128: two kernels
        backward_q=(T(16, 16, num_warps=8, num_stages=1),),
    ),
    "sm_80": TileTable(
        "sm_80", "A100", 163 * KiB,
        forward=(T(64, 64, num_warps=8, num_stages=2), T(128, 32, num_warps=8, num_stages=2),
                 T(64, 32, num_warps=4, num_stages=2)),
        # (64 × 64 with 8 warps spills 4 bytes at head size 64 in both backward kernels here, not at 128; at 128,
        # 32 × 64 with 4 warps spills with a sliding window, and so do the atomic kernel's 4-warp choices)
        backward_kv=(T(32, 64, num_warps=8, num_stages=2), T(64, 32, num_warps=4, num_stages=2)),
        backward_kv_atomic=(T(32, 64, num_warps=8, num_stages=2), T(32, 64, num_warps=8, num_stages=3),
                            T(32, 32, num_warps=4, num_stages=2, max_head=64),
                            T(16, 64, num_warps=4, num_stages=2, max_head=64)),
        backward_q=(T(32, 64, num_warps=4, num_stages=2), T(64, 32, num_warps=4, num_stages=2),
                    T(32, 128, num_warps=8, num_stages=2)),
    ),
    "sm_89": TileTable(
        "sm_89", "L4", 99 * KiB,
        forward=(T(128, 32, num_warps=8, num_stages=2), T(64, 32, num_warps=4, num_stages=2),
                 T(128, 64, num_warps=8, num_stages=1)),
        backward_kv=(T(32, 64, num_warps=8, num_stages=2), T(64, 32, num_warps=4, num_stages=2)),
        # (at head size 128 the atomic kernel's 4-warp choices spill with a window, a 3-stage 32 × 64 one when causal)
        backward_kv_atomic=(T(32, 64, num_warps=8, num_stages=2), T(32, 32, num_warps=4, num_stages=2, max_head=64),
                            T(16, 64, num_warps=4, num_stages=2, max_head=64)),
        # (64 × 64 with 8 warps spills at head size 64 when causal or windowed)
        backward_q=(T(64, 32, num_warps=4, num_stages=2), T(32, 64, num_warps=4, num_stages=2),
                    T(128, 32, num_warps=8, num_stages=2, max_head=64)),
    ),
    "sm_90": TileTable("sm_90", "H100", 227 * KiB, FORWARD_TILES, BACKWARD_KV_TILES, BACKWARD_KV_ATOMIC_TILES,
                       BACKWARD_Q_TILES),
}
BACKWARD_TILES = BACKWARD_KV_TILES  # the name the sweeps used before the dQ kernel had its own list


# The shared memory one thread block may use (the opt-in maximum), by compute capability, from the datasheets:
# what arch_for assumes where torch cannot say (older torch has no shared_memory_per_block_optin).
SHARED_PER_BLOCK = {(7, 5): 64 * KiB, (8, 0): 163 * KiB, (8, 6): 99 * KiB, (8, 7): 163 * KiB, (8, 9): 99 * KiB,
                    (9, 0): 227 * KiB, (10, 0): 227 * KiB, (12, 0): 99 * KiB}


def arch_for(capability, shared_per_block=None):
    """The name of the table in TILE_TABLES for a GPU of compute capability ``(major, minor)`` whose thread blocks
    may use ``shared_per_block`` bytes of shared memory (None: SHARED_PER_BLOCK's datasheet figure, or 99 KiB for
    a capability it does not list).

    Hopper (9.0) and anything newer with its 227 KiB a block: sm_90. Otherwise from 8.0 on: sm_80's table (the
    A100's) with 163 KiB or more, sm_89's (the L4's) with 99 KiB or more (as the 8.6 and 12.0 cards have), and
    sm_75's (the T4's, 64 KiB) with less or before 8.0. Only the four named architectures are compiled in CI: a
    GPU of another capability gets the table of the one whose limits it shares, not a table compiled for it."""
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)):
        raise TypeError(f"capability must be a (major, minor) pair of ints, e.g. (9, 0); got {capability!r}")
    if capability < (7, 5):
        raise ValueError(f"the kernels need compute capability 7.5 (a T4) or newer; got {capability}")
    shared = SHARED_PER_BLOCK.get(capability, 99 * KiB) if shared_per_block is None else shared_per_block
    if capability >= (9, 0) and shared >= TILE_TABLES["sm_90"].shared_per_block:
        return "sm_90"
    if capability >= (8, 0) and shared >= TILE_TABLES["sm_80"].shared_per_block:
        return "sm_80"
    if capability >= (8, 0) and shared >= TILE_TABLES["sm_89"].shared_per_block:
        return "sm_89"
    return "sm_75"


def tile_table(device):
    """The TileTable the kernels use on this CUDA device: :func:`arch_for` of its compute capability and the
    shared memory its blocks may use."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tile_table needs a CUDA device; got {device}")
    index = torch.cuda.current_device() if device.index is None else device.index
    return TILE_TABLES[_arch_of_device(index)]


@functools.cache
def _arch_of_device(index):
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", None)  # not in every torch
    return arch_for((props.major, props.minor), shared or None)


@dataclass(frozen=True)
class Variant:
    """Which of the kernel's design steps are on: each can be switched alone, to be measured alone (chapter 9)."""

    fold_scale: bool = True  # forward: max on raw scores, scale folded into the exponent's FMA (one op less a score)
    delta_kernel: bool = True  # backward: D = rowsum(dO ∘ O) in a Triton kernel, not in eager PyTorch
    atomic_dq: bool = True  # backward: 5 products in one kernel, dQ summed in float32 by atomic adds (not bitwise
    #                         reproducible); off: 7 products in two kernels, each output written by one program
    tma: bool = False  # forward: key and value tiles through tensor descriptors (TMA on Hopper), where strides allow
    lpt: bool = False  # causal: the query blocks with the most key tiles launched first (forward and dQ kernels)


DEFAULT = Variant()
DETERMINISTIC = Variant(atomic_dq=False)
# The ladder benchmarks/bench_gpu.py climbs: the kernel as first written, then one change at a time. (Asking
# Triton 3.9 to warp-specialise the pointer path's key loop, tl.range(..., warp_specialize=True), left its sm_90
# machine code unchanged; the +tma loop, which loads through descriptors as that pass wants, has not been tried. So
# that step is not a rung.)
LADDER = {
    "first": Variant(fold_scale=False, delta_kernel=False, atomic_dq=False),
    "+fold-scale": Variant(fold_scale=True, delta_kernel=False, atomic_dq=False),
    "+delta-kernel": Variant(fold_scale=True, delta_kernel=True, atomic_dq=False),
    "+atomic-dq": Variant(fold_scale=True, delta_kernel=True, atomic_dq=True),
    "+tma": Variant(fold_scale=True, delta_kernel=True, atomic_dq=True, tma=True),
    "+lpt": Variant(fold_scale=True, delta_kernel=True, atomic_dq=True, tma=True, lpt=True),
}


# --------------------------------------------------------------------------------------------------------------
# Addressing. A program's grid index is one integer, split into (z, block): CUDA allows 2³¹ − 1 programs on the
# grid's first axis but only 65,535 on the second, and B · H alone can pass that. Consecutive programs share z, so
# the blocks of one head run side by side and read its keys and values through the same L2 lines.
# Each tile's base address is advanced by a scalar 64-bit offset (z · stride_z + start · stride_row), and only the
# offsets inside a tile, at most BLOCK · stride, are 32-bit vectors: a (B, L, H, E) tensor seen as (B, H, L, E) has
# a row stride of H · E, so (L − 1) · H · E passes 2³¹ at L = 524,288 for H = 32, E = 128.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _split_program(n_rows, BLOCK: tl.constexpr, REVERSE: tl.constexpr = False):
    """(z, first row) of this program on a one-axis grid of Z · ⌈n_rows / BLOCK⌉ programs. REVERSE hands out each
    z's blocks last first: with a causal mask the last query blocks have the most key tiles, and starting the
    longest jobs first (LPT) leaves fewer SMs idle at the end of the grid."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_rows, BLOCK)
    block = pid % n_blocks
    if REVERSE:
        block = n_blocks - 1 - block
    return pid // n_blocks, block * BLOCK


# --------------------------------------------------------------------------------------------------------------
# Forward. One program computes BLOCK_M rows of the output for one z (one batch
# element and head):
#   on chip: its q tile (BLOCK_M, E), one key tile kᵀ (E, BLOCK_N) and value tile
#            (BLOCK_N, Ev) at a time, the scores of that pair (BLOCK_M, BLOCK_N),
#            and per row the running max m, running sum l and output acc.
#   reads:   q once; k and v once per query block, ⌈L / BLOCK_M⌉ times in all
#            (about half that when causal).
#   writes:  its output rows (BLOCK_M, Ev) and their logsumexp (BLOCK_M,), once.
# Everything is in base 2: m and the logsumexp are in units of score · scale · log2 e,
# so exp2(s − m) = exp(x − max).
# FOLD (Variant.fold_scale): the row max is taken on the raw scores, which the positive scale does not reorder, and
# the scale enters in one fused multiply-add, s · qk_scale − m, right before the exponential, as Triton's tutorial
# does. Without it every score is first multiplied by qk_scale: one more float32 instruction per score.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _forward_tiles(
    acc, l_i, m_i, q, K_z, V_z, lo, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr, WINDOW=0, WINDOWED: tl.constexpr = False,
):
    """The online softmax over key tiles lo, lo + BLOCK_N, ... < hi. MASKED tiles may reach past S or into a
    row's causal future; the others are wholly allowed, and skip the comparisons. A tile's addresses are formed
    where it is loaded, from the tile's 64-bit base and 32-bit offsets within it: a tensor of BLOCK_E × BLOCK_N
    pointers kept across the loop would take registers that the matrix products need. TMA: K_z and V_z are tensor
    descriptors, and one instruction copies a whole tile (rows past S and columns past E arrive as zeros).
    WINDOWED (chapter 13): the MASKED tiles also drop keys older than each row's window of WINDOW keys."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0  # (BLOCK_N,) key indices of this tile
        if TMA:
            kt = tl.trans(K_z.load([start_n, 0]))  # (BLOCK_E, BLOCK_N)
            v = V_z.load([start_n, 0])  # (BLOCK_N, BLOCK_EV)
        else:
            # this tile's first key, a 64-bit scalar
            K_t = K_z + tl.cast(start_n, tl.int64) * sk_s
            V_t = V_z + tl.cast(start_n, tl.int64) * sv_s
            # (BLOCK_E, BLOCK_N): kᵀ of this tile
            kt_ptrs = K_t + cols0[None, :] * sk_s + offs_e[:, None] * sk_e
            # (BLOCK_N, BLOCK_EV)
            v_ptrs = V_t + cols0[:, None] * sv_s + offs_ev[None, :] * sv_e
            kt_in = offs_e[:, None] < E  # the head size padded to BLOCK_E loads as 0
            v_in = offs_ev[None, :] < EV
            if MASKED:  # and so do the keys past S
                kt_in = kt_in & (cols[None, :] < S)
                v_in = v_in & (cols[:, None] < S)
            kt = tl.load(kt_ptrs, mask=kt_in, other=0.0)  # (BLOCK_E, BLOCK_N)
            v = tl.load(v_ptrs, mask=v_in, other=0.0)  # (BLOCK_N, BLOCK_EV)
        # (BLOCK_M, BLOCK_N), raw scores q · k
        s = tl.dot(q, kt, input_precision=PRECISION)
        if not FOLD:
            s = s * qk_scale  # the extra multiply per score
        if MASKED:
            allowed = cols[None, :] < S
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            if WINDOWED:  # the sliding window (chapter 13): only the last WINDOW keys
                allowed = allowed & (cols[None, :] > rows[:, None] - WINDOW)
            s = tl.where(allowed, s, float("-inf"))
        if FOLD:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # (BLOCK_M,)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        # a masked tile may leave a row with nothing allowed yet: shift by 0, not -inf
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        if FOLD:
            # one FMA and one exponential per score
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        else:
            # (BLOCK_M, BLOCK_N), weights up to the row's final 1 / l
            p = tl.math.exp2(s - m_new[:, None])
        # rescales what was summed under the old maximum
        alpha = tl.math.exp2(m_i - m_new)
        # the tutorial's order: the row sum is folded into l after the product is issued
        if FOLD:
            l_ij = tl.sum(p, 1)
            acc = tl.dot(
                p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION
            )
            l_i = l_i * alpha + l_ij
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            # (BLOCK_M, BLOCK_EV)
            acc = tl.dot(
                p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION
            )
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_forward(
    Q, K, V, O, LSE,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, so_z, so_l, so_e,
    L, S, qk_scale, TUNE_L, TUNE_S, TUNE_Z,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW=0, WINDOWED: tl.constexpr = False,
):
    # batch·head index, first query row of this program
    z, start_m = _split_program(L, BLOCK_M, CAUSAL and LPT)
    z = z.to(tl.int64)  # 64-bit so that z · stride cannot overflow
    rows0 = tl.arange(0, BLOCK_M)  # (BLOCK_M,) row offsets within the tile
    rows = start_m + rows0  # (BLOCK_M,) query indices, for the masks
    cols0 = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key offsets within a tile
    # (BLOCK_E,) E padded to a power of two; the padding is loaded as 0
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)  # (BLOCK_EV,)
    Q_t = Q + z * sq_z + tl.cast(start_m, tl.int64) * sq_l  # this tile's first query
    q = tl.load(
        Q_t + rows0[:, None] * sq_l + offs_e[None, :] * sq_e,
        mask=(rows[:, None] < L) & (offs_e[None, :] < E),
        other=0.0,
    )  # (BLOCK_M, BLOCK_E), read once and kept on chip
    K_z = K + z * sk_z  # this z's keys and values
    V_z = V + z * sv_z
    # the same, as tensor descriptors: shape, strides (the last is 1) and the
    # tile a copy brings
    if TMA:
        K_z = tl.make_tensor_descriptor(
            K_z, shape=[S, E], strides=[sk_s, 1], block_shape=[BLOCK_N, BLOCK_E]
        )
        V_z = tl.make_tensor_descriptor(
            V_z, shape=[S, EV], strides=[sv_s, 1], block_shape=[BLOCK_N, BLOCK_EV]
        )
    # running max of each row's scores (base 2)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
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
    lo = 0
    # Sliding window (chapter 13): tiles wholly older than the first row's window are never visited; every
    # visited tile takes the masked path, which also cuts the window's lower edge.
    if WINDOWED:
        lo = (tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        full = lo
    # Each loop is entered only when it has a tile. On sm_90 a loop's last P V product is still running when the
    # loop ends, and Triton waits for it there; a path that skipped the loop would reach that wait with acc set by
    # plain copies, and ptxas then serialises every wgmma of the kernel (its note C7515: each product waits for the
    # one before). tools/compile_report.py reports the note; tests/test_compile_report.py checks it is absent.
    if lo < full:
        acc, l_i, m_i = _forward_tiles(
            acc, l_i, m_i, q, K_z, V_z, lo, full, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e,
            qk_scale, E, EV, False, CAUSAL, BLOCK_N, PRECISION, FOLD, TMA,
        )
    if full < hi:
        acc, l_i, m_i = _forward_tiles(
            acc, l_i, m_i, q, K_z, V_z, full, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e,
            qk_scale, E, EV, True, CAUSAL, BLOCK_N, PRECISION, FOLD, TMA, WINDOW, WINDOWED,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no key gets 0, not 0/0
    out = acc / l_safe[:, None]  # the one division, deferred to the end
    O_t = O + z * so_z + tl.cast(start_m, tl.int64) * so_l
    tl.store(
        O_t + rows0[:, None] * so_l + offs_ev[None, :] * so_e,
        out.to(O.dtype.element_ty),
        mask=(rows[:, None] < L) & (offs_ev[None, :] < EV),
    )
    # logsumexp, base 2
    tl.store(LSE + z * L + rows, m_i + tl.math.log2(l_safe), mask=rows < L)


# --------------------------------------------------------------------------------------------------------------
# Backward, given dO (the gradient of the output), the saved logsumexp and
# D = rowsum(dO ∘ O) (one per query):
#   P = exp2(s - lse)   dV = Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - D)
#   dQ = scale · dS K   dK = scale · dSᵀ Q
# _backward_preprocess: D, one program per (z, block of rows), in float32
#   (Variant.delta_kernel); otherwise PyTorch computes it eagerly, with two float32
#   copies of dO and O and four launches.
# _flash_backward_kv: one program per (z, key block) owns dK and dV of BLOCK_N keys
#   and walks the query blocks:
#   on chip: its k and v tiles, dK and dV accumulators, one query block's q, dO, lse
#            and D at a time, and the transposed weights Pᵀ (BLOCK_N, BLOCK_M)
#            recomputed for that pair.
#   reads:   k and v once; q, dO, lse and D once per key block.
#   writes:  dK and dV, once.
# Then dQ, one of two ways (Variant.atomic_dq):
#   ATOMIC: the same program also forms that pair's share of dQ, dS K, and adds it
#           with float32 atomic adds into a zeroed (Z, L, E) buffer: 5 products per
#           tile pair, one main kernel; the order of the additions, hence the last
#           bits of dQ, varies from run to run.
#   otherwise: _flash_backward_q, one program per (z, query block), owns dQ and walks
#           the key blocks, recomputing P and dP: 7 products in all and two main
#           kernels, but every output is written by exactly one program, so
#           the result is the same bit for bit on every run.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _backward_preprocess(
    O, DO, DELTA, so_z, so_l, so_e, sdo_z, sdo_l, sdo_e, L,
    EV: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """D = rowsum(dO ∘ O) for BLOCK_M rows of one z, accumulated in float32."""
    z, start_m = _split_program(L, BLOCK_M)
    z = z.to(tl.int64)
    rows0 = tl.arange(0, BLOCK_M)
    rows = start_m + rows0
    offs_ev = tl.arange(0, BLOCK_EV)
    mask = (rows[:, None] < L) & (offs_ev[None, :] < EV)
    o = tl.load(O + z * so_z + tl.cast(start_m, tl.int64) * so_l + rows0[:, None] * so_l + offs_ev[None, :] * so_e,
                mask=mask, other=0.0)  # (BLOCK_M, BLOCK_EV)
    do = tl.load(DO + z * sdo_z + tl.cast(start_m, tl.int64) * sdo_l + rows0[:, None] * sdo_l + offs_ev[None, :] * sdo_e,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + z * L + rows, delta, mask=rows < L)


@triton.jit
def _backward_kv_tiles(
    dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, DQ_z, lo, hi, cols, rows0, offs_e, offs_ev, L, S, sq_l, sq_e, sdo_l,
    sdo_e, sdq_l, qk_scale, scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC: tl.constexpr, WINDOW=0, WINDOWED: tl.constexpr = False,
):
    """Accumulate dK and dV of one key block over query blocks lo, lo + BLOCK_M, ... < hi (and, ATOMIC, add each
    pair's share of dQ into DQ). WINDOWED: the MASKED blocks also drop the queries whose window of WINDOW keys has
    moved past a key."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + rows0  # (BLOCK_M,) query indices
        in_rows = rows < L
        Q_t = Q_z + tl.cast(start_m, tl.int64) * sq_l  # this query tile's first row, a 64-bit scalar
        DO_t = DO_z + tl.cast(start_m, tl.int64) * sdo_l
        q_ptrs = Q_t + rows0[:, None] * sq_l + offs_e[None, :] * sq_e  # (BLOCK_M, BLOCK_E)
        do_ptrs = DO_t + rows0[:, None] * sdo_l + offs_ev[None, :] * sdo_e  # (BLOCK_M, BLOCK_EV)
        q = tl.load(q_ptrs, mask=in_rows[:, None] & (offs_e[None, :] < E), other=0.0)
        do = tl.load(do_ptrs, mask=in_rows[:, None] & (offs_ev[None, :] < EV), other=0.0)
        lse = tl.load(LSE_z + rows, mask=in_rows, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA_z + rows, mask=in_rows, other=0.0)  # (BLOCK_M,)
        # (BLOCK_N, BLOCK_M), raw scores transposed
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        # Pᵀ, recomputed: one FMA and one exponential a score
        pt = tl.math.exp2(st * qk_scale - lse[None, :])
        # keys past S, rows past L (their lse is a stand-in 0) and the causal future
        # get weight 0
        if MASKED:
            allowed = in_rows[None, :] & (cols[:, None] < S)
            if CAUSAL:
                allowed = allowed & (rows[None, :] >= cols[:, None])
            if WINDOWED:
                allowed = allowed & (rows[None, :] - WINDOW < cols[:, None])
            pt = tl.where(allowed, pt, 0.0)
        # (BLOCK_N, BLOCK_EV) += Pᵀ dO
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        # (BLOCK_N, BLOCK_M) = (dO Vᵀ)ᵀ
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])  # dSᵀ
        # (BLOCK_N, BLOCK_E) += dSᵀ Q
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
        # this pair's share of dQ, (BLOCK_M, BLOCK_E) = dS K, added into the
        # float32 buffer
        if ATOMIC:
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=PRECISION)
            DQ_t = DQ_z + tl.cast(start_m, tl.int64) * sdq_l
            tl.atomic_add(DQ_t + rows0[:, None] * sdq_l + offs_e[None, :], dq * scale,
                          mask=in_rows[:, None] & (offs_e[None, :] < E), sem="relaxed")
    return dk, dv


@triton.jit
def _flash_backward_kv(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, sdo_z, sdo_l, sdo_e,
    sdk_z, sdk_s, sdk_e, sdv_z, sdv_s, sdv_e, sdq_z, sdq_l,
    L, S, qk_scale, scale, TUNE_L, TUNE_S, TUNE_Z,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW=0, WINDOWED: tl.constexpr = False,
):
    z, start_n = _split_program(S, BLOCK_N)  # first key of this program
    z = z.to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N)
    cols = start_n + cols0  # (BLOCK_N,)
    rows0 = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    in_cols = cols < S
    K_t = K + z * sk_z + tl.cast(start_n, tl.int64) * sk_s
    V_t = V + z * sv_z + tl.cast(start_n, tl.int64) * sv_s
    k = tl.load(K_t + cols0[:, None] * sk_s + offs_e[None, :] * sk_e,
                mask=in_cols[:, None] & (offs_e[None, :] < E), other=0.0)  # (BLOCK_N, BLOCK_E)
    v = tl.load(V_t + cols0[:, None] * sv_s + offs_ev[None, :] * sv_e,
                mask=in_cols[:, None] & (offs_ev[None, :] < EV), other=0.0)  # (BLOCK_N, BLOCK_EV)
    dk = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_EV], tl.float32)
    Q_z = Q + z * sq_z  # this z's queries and output gradients
    DO_z = DO + z * sdo_z
    LSE_z = LSE + z * L
    DELTA_z = DELTA + z * L
    DQ_z = DQ_ACC + z * sdq_z

    # Causal: queries before this key block never see it, so start at the query block holding query start_n; the
    # blocks that straddle the diagonal need the mask, the ones wholly below it do not. Otherwise every block, with
    # no mask: rows past L load as zeros and add nothing. A ragged key block (keys past S) takes the masked path
    # throughout: its missing keys load as zeros, whose weight exp2(0 − lse) is not 0 and overflows for lse < −128.
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        below = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(L, BLOCK_M) * BLOCK_M)
        below = tl.maximum(below, lo)
    else:
        lo = 0
        below = 0
    # Sliding window (chapter 13): a key is seen by the WINDOW queries from itself on, so the query blocks past the
    # last of those, for this block's last key, are never visited; every visited block takes the masked path.
    if WINDOWED:
        below = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1 + WINDOW, BLOCK_M) * BLOCK_M, tl.cdiv(L, BLOCK_M) * BLOCK_M)
        below = tl.maximum(below, lo)
    else:  # a ragged key block (above); with a window every visited block is masked already
        below = tl.where(start_n + BLOCK_N > S, tl.cdiv(L, BLOCK_M) * BLOCK_M, below)
    # With a window the loop below is the only one, and is entered only when it has a block, as the forward loops
    # are (ptxas's C7515 otherwise); without one, the guard is left out, for the same reason.
    if not WINDOWED or lo < below:
        dk, dv = _backward_kv_tiles(
            dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, DQ_z, lo, below, cols, rows0, offs_e, offs_ev, L, S, sq_l,
            sq_e, sdo_l, sdo_e, sdq_l, qk_scale, scale, E, EV, True, CAUSAL, BLOCK_M, PRECISION, ATOMIC, WINDOW,
            WINDOWED,
        )
    if not WINDOWED:  # a window leaves no block unmasked
        dk, dv = _backward_kv_tiles(
            dk, dv, k, v, Q_z, DO_z, LSE_z, DELTA_z, DQ_z, tl.maximum(lo, below), L, cols, rows0, offs_e, offs_ev,
            L, S, sq_l, sq_e, sdo_l, sdo_e, sdq_l, qk_scale, scale, E, EV, False, CAUSAL, BLOCK_M, PRECISION, ATOMIC,
        )
    DK_t = DK + z * sdk_z + tl.cast(start_n, tl.int64) * sdk_s
    DV_t = DV + z * sdv_z + tl.cast(start_n, tl.int64) * sdv_s
    tl.store(DK_t + cols0[:, None] * sdk_s + offs_e[None, :] * sdk_e, (dk * scale).to(DK.dtype.element_ty),
             mask=in_cols[:, None] & (offs_e[None, :] < E))
    tl.store(DV_t + cols0[:, None] * sdv_s + offs_ev[None, :] * sdv_e, dv.to(DV.dtype.element_ty),
             mask=in_cols[:, None] & (offs_ev[None, :] < EV))


@triton.jit
def _backward_q_tiles(
    dq, q, do, lse, delta, K_z, V_z, lo, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, WINDOW=0, WINDOWED: tl.constexpr = False,
):
    """Accumulate dQ of one query block over key tiles lo, lo + BLOCK_N, ... < hi (WINDOWED: the MASKED tiles also
    drop keys older than each row's window, as in the forward pass)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        K_t = K_z + tl.cast(start_n, tl.int64) * sk_s
        V_t = V_z + tl.cast(start_n, tl.int64) * sv_s
        kt_ptrs = K_t + cols0[None, :] * sk_s + offs_e[:, None] * sk_e  # (BLOCK_E, BLOCK_N)
        vt_ptrs = V_t + cols0[None, :] * sv_s + offs_ev[:, None] * sv_e  # (BLOCK_EV, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & (cols[None, :] < S), other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_ev[:, None] < EV) & (cols[None, :] < S), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_e[:, None] < E, other=0.0)  # (BLOCK_E, BLOCK_N)
            vt = tl.load(vt_ptrs, mask=offs_ev[:, None] < EV, other=0.0)  # (BLOCK_EV, BLOCK_N)
        s = tl.dot(q, kt, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - lse[:, None])  # P, recomputed
        if MASKED:
            allowed = cols[None, :] < S
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            if WINDOWED:
                allowed = allowed & (cols[None, :] > rows[:, None] - WINDOW)
            p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) = dO Vᵀ
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)  # (BLOCK_M, BLOCK_E) += dS K
    return dq


@triton.jit
def _flash_backward_q(
    Q, K, V, DO, LSE, DELTA, DQ,
    sq_z, sq_l, sq_e, sk_z, sk_s, sk_e, sv_z, sv_s, sv_e, sdo_z, sdo_l, sdo_e, sdq_z, sdq_l, sdq_e,
    L, S, qk_scale, scale, TUNE_L, TUNE_S, TUNE_Z,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, LPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW=0, WINDOWED: tl.constexpr = False,
):
    z, start_m = _split_program(L, BLOCK_M, CAUSAL and LPT)
    z = z.to(tl.int64)
    rows0 = tl.arange(0, BLOCK_M)
    rows = start_m + rows0
    cols0 = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    in_rows = rows < L
    Q_t = Q + z * sq_z + tl.cast(start_m, tl.int64) * sq_l
    DO_t = DO + z * sdo_z + tl.cast(start_m, tl.int64) * sdo_l
    q = tl.load(Q_t + rows0[:, None] * sq_l + offs_e[None, :] * sq_e,
                mask=in_rows[:, None] & (offs_e[None, :] < E), other=0.0)  # (BLOCK_M, BLOCK_E)
    do = tl.load(DO_t + rows0[:, None] * sdo_l + offs_ev[None, :] * sdo_e,
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
    lo = 0
    if WINDOWED:  # the forward pass's window: tiles wholly older than it skipped, the rest masked
        lo = (tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        full = lo
    if lo < full:  # each loop entered only when it has a tile, as in the forward kernel (ptxas's C7515)
        dq = _backward_q_tiles(
            dq, q, do, lse, delta, K_z, V_z, lo, full, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e,
            qk_scale, E, EV, False, CAUSAL, BLOCK_N, PRECISION,
        )
    if full < hi:
        dq = _backward_q_tiles(
            dq, q, do, lse, delta, K_z, V_z, full, hi, rows, cols0, offs_e, offs_ev, S, sk_s, sk_e, sv_s, sv_e,
            qk_scale, E, EV, True, CAUSAL, BLOCK_N, PRECISION, WINDOW, WINDOWED,
        )
    DQ_t = DQ + z * sdq_z + tl.cast(start_m, tl.int64) * sdq_l
    tl.store(DQ_t + rows0[:, None] * sdq_l + offs_e[None, :] * sdq_e, (dq * scale).to(DQ.dtype.element_ty),
             mask=in_rows[:, None] & (offs_e[None, :] < E))


# --------------------------------------------------------------------------------------------------------------
# Launching: tiles chosen by autotuning on a GPU, fixed in the interpreter.
# --------------------------------------------------------------------------------------------------------------


def _bucket(n):
    """The autotuner's view of a length or a batch·head count: the next power of two, so that a new length retunes
    only when it crosses one, while Z = 1 and Z = 64 (a few programs, or many waves of them) are tuned apart."""
    return triton.next_power_of_2(max(int(n), 1))


def _tune_keys(kernel):
    """The arguments whose values select a tuned configuration (Triton adds every tensor's dtype)."""
    keys = ("TUNE_L", "TUNE_S", "TUNE_Z", "E", "EV", "CAUSAL", "FOLD", "ATOMIC", "TMA", "LPT", "WINDOWED")
    return [name for name in keys if name in kernel.arg_names]


def _launcher(kernel, field, reset_to_zero=None):
    """The kernel, tuned on a GPU among the choices of its ``field`` in the GPU's TileTable (tile_table) once per
    (E, Ev, causal, dtype, variant) and power-of-two bucket of L, S and Z; in the interpreter, the kernel with
    INTERPRETER_TILES (tuning there would only multiply the wait). A ``tiles=`` argument forces one configuration
    (the tests, and benchmarks/bench_gpu.py --sweep)."""
    tuned = {}  # architecture -> the autotuned kernel over that architecture's choices

    def tuned_for(table):
        if table.arch not in tuned:
            choices = getattr(table, field)
            configs = [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps,
                                     num_stages=t.num_stages) for t in choices]
            limit = {id(c): t.max_head for c, t in zip(configs, choices)}

            def fitting(configs, named_args, **kwargs):  # the choices that compile without spilling at this head
                head = max(kwargs["BLOCK_E"], kwargs["BLOCK_EV"])
                return [c for c in configs if head <= limit[id(c)]] or configs

            tuned[table.arch] = triton.autotune(configs=configs, key=_tune_keys(kernel), reset_to_zero=reset_to_zero,
                                                prune_configs_by={"early_config_prune": fitting})(kernel)
        return tuned[table.arch]

    def launch(grid, *args, tiles=None, **kw):
        if tiles is None and not INTERPRETED:
            return tuned_for(tile_table(args[0].device))[grid](*args, **kw)
        t = tiles or INTERPRETER_TILES
        launch_options = {} if INTERPRETED else {"num_warps": t.num_warps, "num_stages": t.num_stages}
        return kernel[grid](*args, **kw, BLOCK_M=t.block_m, BLOCK_N=t.block_n, **launch_options)

    return launch


_run_forward = _launcher(_flash_forward, "forward")
_run_backward_kv = _launcher(_flash_backward_kv, "backward_kv")
_run_backward_kv_atomic = _launcher(_flash_backward_kv, "backward_kv_atomic", reset_to_zero=["DQ_ACC"])
_run_backward_q = _launcher(_flash_backward_q, "backward_q")
PREPROCESS_ROWS = 64  # rows of dO and O per program of the delta kernel


def _head_block(n):
    return max(16, triton.next_power_of_2(n))  # tl.dot needs each side at least 16


def _precision(dtype):
    """float32 is multiplied in IEEE float32 (products rounded to float32, no TF32); half precision ignores it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _device_guard(device):
    """Launch on the tensors' own GPU: Triton launches on the current device, which need not be theirs."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _grid(n_rows, Z, block):
    return lambda meta: (triton.cdiv(n_rows, meta[block]) * Z,)


def _tma_ready(*tensors):
    """Whether tensor descriptors can address these tensors: last stride 1, the others and the base 16-byte aligned.
    Otherwise the kernel keeps its pointer loads, which take any strides."""
    return all(
        x.stride(-1) == 1 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
        and x.data_ptr() % 16 == 0 for x in tensors
    )


_ALLOCATOR_SET = []


def _scratch_for_descriptors():
    """Descriptors made inside a kernel need a little global scratch memory: Triton asks an allocator for it."""
    if not INTERPRETED and not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET.append(True)


def _forward(q, k, v, causal, scale, tiles=None, variant=None, window=None):
    """q (Z, L, E), k (Z, S, E), v (Z, S, Ev) -> output (Z, L, Ev) and logsumexp (Z, L),
    base 2, float32."""
    variant = variant or DEFAULT
    tma = variant.tma and _tma_ready(k, v)
    if tma:
        _scratch_for_descriptors()
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    o = torch.empty((Z, L, EV), device=q.device, dtype=q.dtype)
    lse = torch.empty((Z, L), device=q.device, dtype=torch.float32)
    with _device_guard(q.device):
        _run_forward(
            _grid(L, Z, "BLOCK_M"), q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), L, S,
            scale * LOG2_E, _bucket(L), _bucket(S), _bucket(Z),
            E=E, EV=EV, BLOCK_E=_head_block(E), BLOCK_EV=_head_block(EV), CAUSAL=causal,
            PRECISION=_precision(q.dtype), FOLD=variant.fold_scale, TMA=tma,
            LPT=variant.lpt, tiles=tiles,
            WINDOW=window or 0, WINDOWED=window is not None,  # chapter 13
        )
    return o, lse


def _delta(o, do, variant):
    """D = rowsum(dO ∘ O), (Z, L) float32: a Triton kernel, or eager PyTorch (Variant.delta_kernel off)."""
    if not variant.delta_kernel:
        return (do.float() * o.float()).sum(-1).contiguous()  # (Z, L)
    Z, L, EV = o.shape
    delta = torch.empty((Z, L), device=o.device, dtype=torch.float32)
    _backward_preprocess[(triton.cdiv(L, PREPROCESS_ROWS) * Z,)](
        o, do, delta, *o.stride(), *do.stride(), L, EV=EV, BLOCK_EV=_head_block(EV), BLOCK_M=PREPROCESS_ROWS,
    )
    return delta


def _backward_variant(variant, table, E, EV):
    """The variant the backward runs on a GPU of this TileTable: ``variant`` itself, or its two-kernel
    (deterministic) form where the table has no atomic dK/dV choice for these head sizes (a T4 at head size 128)."""
    if variant.atomic_dq and not table.offers("backward_kv_atomic", E, EV):
        return dataclasses.replace(variant, atomic_dq=False)
    return variant


def _backward(q, k, v, o, lse, do, causal, scale, tiles=None, variant=None, q_tiles=None, dlse=None, window=None):
    """The three gradients. ``tiles`` forces the dK/dV kernel's configuration, ``q_tiles`` the dQ kernel's;
    ``window`` is the forward pass's sliding window (with ``causal``).

    ``dlse`` (Z, L), the gradient of the natural-log logsumexp, if it was used: since d lse / d score_j = P_j,
    it enters as dS = P ∘ (dP - (D - dlse)), that is D - dlse in place of D."""
    variant = variant or DEFAULT
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    if tiles is None and not INTERPRETED and q.device.type == "cuda":
        variant = _backward_variant(variant, tile_table(q.device), E, EV)
    common = {"E": E, "EV": EV, "BLOCK_E": _head_block(E), "BLOCK_EV": _head_block(EV), "CAUSAL": causal,
              "PRECISION": _precision(q.dtype), "WINDOW": window or 0, "WINDOWED": window is not None}
    tune = (_bucket(L), _bucket(S), _bucket(Z))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    with _device_guard(q.device):
        delta = _delta(o, do, variant)
        if dlse is not None:
            delta = (delta - dlse.float()).contiguous()
        if variant.atomic_dq:
            dq_acc = torch.zeros((Z, L, E), device=q.device, dtype=torch.float32)  # (Z, L, E), summed by atomics
        else:
            dq_acc = torch.zeros(1, device=q.device, dtype=torch.float32)  # not read: ATOMIC is off
        run_kv = _run_backward_kv_atomic if variant.atomic_dq else _run_backward_kv
        run_kv(
            _grid(S, Z, "BLOCK_N"), q, k, v, do, lse, delta, dk, dv, dq_acc, *strides, *dk.stride(), *dv.stride(),
            *(dq_acc.stride()[:2] if variant.atomic_dq else (0, 0)), L, S, scale * LOG2_E, scale, *tune,
            ATOMIC=variant.atomic_dq, tiles=tiles, **common,
        )
        if variant.atomic_dq:
            return dq_acc.to(q.dtype), dk, dv
        dq = torch.empty_like(q)
        _run_backward_q(
            _grid(L, Z, "BLOCK_M"), q, k, v, do, lse, delta, dq, *strides, *dq.stride(), L, S, scale * LOG2_E,
            scale, *tune, LPT=variant.lpt, tiles=q_tiles, **common,
        )
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the logsumexp: nothing of size L × S."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, variant, window=None):
        o, lse = _forward(q, k, v, causal, scale, variant=variant, window=window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.variant, ctx.window = causal, scale, variant, window
        ctx.set_materialize_grads(False)  # an unused lse brings None, not a tensor of zeros to subtract
        return o, lse * LN_2  # the natural-log logsumexp, (Z, L) float32

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, variant=ctx.variant, dlse=dlse,
                               window=ctx.window)
        return dq, dk, dv, None, None, None, None


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
            "attn.attention(q, k, v, mask) or lib.tiles.tiled_attention"
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


def _check_variant(variant, deterministic):
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
    if variant is None:
        return DETERMINISTIC if deterministic else DEFAULT
    if not isinstance(variant, Variant):
        raise TypeError(f"variant must be a lib.flash.Variant (e.g. lib.flash.LADDER['first']); got {variant!r}")
    if deterministic and variant.atomic_dq:
        raise ValueError("deterministic=True needs a variant with atomic_dq=False: atomic adds into dQ run in no "
                         "fixed order")
    return variant


def flash_attention(q, k, v, mask=None, *, causal=False, scale=None, deterministic=False, variant=None,
                    return_lse=False, window=None, axes="bhsd"):
    """FlashAttention-2 in Triton: softmax(q kᵀ · scale) v without the (..., L, S) matrix (chapter 9).

    q (..., L, E), k (..., S, E), v (..., S, Ev) torch tensors on a CUDA GPU, in float16, bfloat16 or float32,
    batch dims broadcast; returns (..., L, Ev) in the inputs' dtype. Any L and S (not only multiples of the tile
    sizes) and head sizes 1 to 256 (padded inside to a power of two, at least 16). ``causal=True`` (or
    ``"top-left"``) lets query i attend keys j <= i (as :func:`lib.attention.attention`; ``"bottom-right"`` is the same
    when L == S and refused otherwise), and key tiles wholly in a query
    tile's future are skipped, not computed. ``scale`` defaults to 1/sqrt(E). There is no ``mask``: for other
    masks use :func:`lib.attention.attention`. A query with no key (S = 0) gets zeros. Any finite scale: a
    negative one is run as the positive scale on -q, and 0 (every allowed key weighs the same) as scale 1 on 0·q,
    so the kernel's running maximum is always a maximum and no masked score becomes -inf · 0.

    ``return_lse=True`` returns ``(out, lse)``: lse (..., L) float32 is each row's natural-log logsumexp of its
    allowed scaled scores, log Σ_j exp(scale · q·k_j) (-inf for a row with no key), so that (out, lse) is the
    attention state of :mod:`lib.merge` and merges with :func:`lib.merge.merge_states`. It is differentiable
    too: a gradient flowing into lse reaches q and k.

    The backward pass sums dQ with float32 atomic adds, in no fixed order, so dQ's last bits can differ from run
    to run on a GPU; ``deterministic=True`` runs the two-kernel backward instead (7 matrix products instead of 5,
    every output written by one program), and so does a T4 at head size 128, where the one-kernel form spills
    registers. ``variant`` picks the kernel's design steps one by one
    (:class:`Variant`, :data:`LADDER`), for measuring each alone.

    Products of half-precision inputs run on the tensor cores (from compute capability 8.0; on a T4 Triton
    multiplies on the CUDA cores) and accumulate in float32; the softmax statistics and the output accumulator are
    float32. float32 inputs are multiplied in IEEE float32 (products rounded to float32,
    no TF32), far slower: the kernel is built for half precision. Differentiable: the backward pass recomputes each tile's
    weights from the saved row logsumexp, so training saves nothing of size L × S. On a CPU the kernels run in
    Triton's interpreter if TRITON_INTERPRET=1 was set before Triton was first imported (not for bfloat16).

    ``window`` (with ``causal=True``) is a sliding window: query i sees keys i - window < j <= i, and key tiles
    wholly older than a query tile's window are skipped, so the work grows like L × window (chapter 13), in the
    backward pass too, where the query tiles a key tile's window never reaches are skipped.

    ``axes="bshd"`` takes q, k, v as flash-attn's (B, L, H, E) and returns (B, L, H, Ev) (lse stays (B, H, L),
    as flash-attn's ``softmax_lse``); the default ``"bhsd"`` is (..., H, L, E).
    """
    if _check_axes(axes) == "bshd":
        named = _from_axes(axes, {"q": q, "k": k, "v": v})
        got = flash_attention(named["q"], named["k"], named["v"], mask, causal=causal, scale=scale,
                              deterministic=deterministic, variant=variant, return_lse=return_lse, window=window)
        return (_to_axes(axes, got[0]), got[1]) if return_lse else _to_axes(axes, got)
    batch, L, S, E, Ev = _check(q, k, v, mask)
    offset = _check_causal(causal, L, S)  # None, or the diagonal's offset: 0 is top-left
    if offset not in (None, 0):
        raise ValueError(
            f"flash_attention's kernel aligns the causal pattern top-left (query i sees keys j <= i); "
            f"causal={causal!r} with L={L} queries and S={S} keys needs the offset {offset}: use "
            "lib.flash_decode.flash_decode (the last L of S tokens) or lib.attention.attention"
        )
    causal = offset == 0
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an integer or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be at least 1 (keys a query sees, itself included), got {window}")
        if not causal:
            raise ValueError("window needs causal=True: the window is the last `window` keys up to each query")
        if window >= L:  # query i < L sees every key j <= i: plain causal, which also keeps the kernels' int32
            window = None  # arithmetic (key + window) from overflowing for a window near 2**31
    scale = _check_scale(scale, E)
    variant = _check_variant(variant, deterministic)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False; got {return_lse!r}")
    Z = math.prod(batch)
    if Z == 0 or L == 0 or S == 0:  # nothing to attend, or nobody asking: zeros, still tied to the inputs
        zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
        out = zero + torch.zeros(batch + (L, Ev), dtype=q.dtype, device=q.device)
        if not return_lse:
            return out
        return out, zero.float() + torch.full(batch + (L,), -math.inf, device=q.device)
    q3 = q.expand(batch + (L, E)).reshape(Z, L, E)  # (Z, L, E), a view whenever the batch dims allow
    k3 = k.expand(batch + (S, E)).reshape(Z, S, E)  # (Z, S, E)
    v3 = v.expand(batch + (S, Ev)).reshape(Z, S, Ev)  # (Z, S, Ev)
    if scale < 0:  # scale · q·k = |scale| · (-q)·k: the kernel's maximum stays a maximum
        q3, scale = -q3, -scale
    elif scale == 0:  # every score 0: scale 1 on 0·q keeps the masked -inf scores -inf (no -inf · 0)
        q3, scale = q3 * 0, 1.0
    out, lse = _FlashAttention.apply(q3, k3, v3, bool(causal), scale, variant, window)  # (Z, L, Ev), (Z, L)
    if return_lse:
        return out.reshape(batch + (L, Ev)), lse.reshape(batch + (L,))
    return out.reshape(batch + (L, Ev))
