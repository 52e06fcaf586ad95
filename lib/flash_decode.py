"""Split-KV decoding on a GPU (Flash-Decoding): a few new queries against a long key cache, in Triton (chapter 12).

While generating, each step brings one new query per head (or a few, L from 1 to about 16) and attends every key
in the cache. :func:`lib.flash.flash_attention` gives one program to each (batch · head, block of queries): at
batch 1 with 8 key/value heads that is 8 programs, on a GPU with 132 streaming multiprocessors (SMs). The fix
is to cut the keys into ``num_splits`` slices and give each slice its own program:

1. ``_decode_split``: one program per (query-row block, batch · key/value head, slice) runs chapter 7's online
   softmax over its slice's key tiles and writes a partial state: the output normalised over those keys alone
   (float32) and the row logsumexp of their scores (float32, base 2 inside the kernels). A slice with no key for
   a row, which happens to whole slices when S is short or ragged, writes zeros and -inf there.
2. ``_decode_merge``: one program per (query-row block, batch · key/value head) merges the slices' states,
   weighting slice s by exp(lse_s - max lse): the same online-softmax rescaling, one slice at a time, exact, and
   safe when a slice is empty (weight 0) or all are (zeros).

Grouped-query attention: the G = H / Hkv query heads that share one key/value head are packed, with their L
queries, into the G · L rows of one tile, so each program reads each key/value tile once for all of them.

Causal alignment: the L queries are the LAST L of the S tokens the keys cover (bottom-right, as
:func:`lib.decoding.decode_step`): query i sees keys j <= S - L + i. For L = 1 that is every key.

Shapes: q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), output (B, H, L, Ev). A paged cache
(:mod:`lib.paged`) is read through its block table inside the same kernel: :func:`flash_decode_paged`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as err:
    if err.name != "triton":
        raise
    from lib.runtime import triton_hint

    raise ModuleNotFoundError(f"lib.flash_decode: {triton_hint()}", name="triton") from None

from lib import cost
from lib import flash as _flash
from lib.backend import _check_axes, _check_scale, _from_axes, _to_axes
from lib.cost import choose_num_splits

__all__ = ["flash_decode", "flash_decode_paged", "flash_decode_partials", "split_count"]

INTERPRETED = _flash.INTERPRETED
LOG2_E = _flash.LOG2_E
LN_2 = math.log(2.0)  # the kernels' base-2 logsumexp times ln 2 is the natural one
MAX_HEAD = _flash.MAX_HEAD
DTYPES = _flash.DTYPES
MAX_ROWS = 64  # most (query head, query) rows in one tile; more rows take more row blocks, each reading K/V again
DEFAULT_GPU = "H100"  # whose SM count the heuristic assumes when there is no GPU to ask (lib.cost.gpu)


@dataclass(frozen=True)
class DecodeTiles:
    """One launch configuration for the split kernel; the query-row tile is sized from G · L at each call."""

    block_n: int  # keys in a tile
    num_warps: int
    num_stages: int  # key/value tiles in flight: decoding is memory-bound, so loads ahead matter most
    max_rows: int = MAX_ROWS  # the largest row tile: more rows than this take more row blocks

    @property
    def min_keys(self) -> int:
        """Fewest keys per slice the heuristic allows: four tiles, so the loads pipeline before the slice ends."""
        return 4 * self.block_n


INTERPRETER_TILES = DecodeTiles(block_n=16, num_warps=1, num_stages=1)
# Not tuned on a GPU yet (none was at hand): 64-key tiles of a 128-wide head are 16 KiB each in bf16. Compiled for
# an H100 (sm_90, Triton 3.9) with 16 query rows, the split kernel takes 147 registers a thread, spills nothing and
# uses 70 KiB of shared memory (of 227 KiB): room for two programs per SM.
GPU_TILES = DecodeTiles(block_n=64, num_warps=4, num_stages=3)
# Per architecture, as lib.flash.TILE_TABLES (and picked the same way, lib.flash.tile_table): compiled for each by
# tools/compile_report.py in CI at head sizes 64 and 128 and row tiles of 16 and the largest it allows: all fit and
# none spills.
DECODE_TILES = {
    # FMA products (lib.flash.TILE_TABLES): small tiles, and at most 32 rows, since a 64-row tile spills 680 bytes
    # at head size 128 (with 8 warps; more with any other count or key tile)
    "sm_75": DecodeTiles(block_n=16, num_warps=8, num_stages=1, max_rows=32),
    "sm_80": GPU_TILES,
    "sm_89": GPU_TILES,
    "sm_90": GPU_TILES,
}


# --------------------------------------------------------------------------------------------------------------
# The split kernel. One program: BLOCK_M packed rows (row r = query head g · L + query i of one key/value head),
# one slice of keys [lo, hi).
#   on chip: the q tile (BLOCK_M, E), one key tile kᵀ (E, BLOCK_N) and value tile (BLOCK_N, Ev) at a time, the
#            scores (BLOCK_M, BLOCK_N), and per row the running max m, sum l and accumulator acc (chapter 7).
#   reads:   q once, and each key and value of its slice once, for all G query heads of the key/value head.
#   writes:  the slice's partial state, or with DIRECT (one slice) the output itself.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_tiles(
    acc, l_i, m_i, q, K_h, V_h, TABLE_b, lo, hi, cols0, last, offs_e, offs_ev, sk_p, sk_s, sk_e, sv_p, sv_s, sv_e,
    qk_scale,
    E: tl.constexpr, EV: tl.constexpr, MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """The online softmax over key tiles lo, lo + BLOCK_N, ... < hi. ``last`` (BLOCK_M,) is each row's last
    visible key; MASKED tiles may pass it (the causal corner, or past S), the others are wholly visible. Paged,
    a key's row is found through the block table: page TABLE_b[j // PAGE], row j % PAGE within it."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0  # (BLOCK_N,) logical key indices
        if PAGED:
            if MASKED:
                page = tl.load(TABLE_b + cols // PAGE, mask=cols <= tl.max(last, 0), other=0)
            else:
                page = tl.load(TABLE_b + cols // PAGE)
            page = page.to(tl.int64)
            k_rows = page * sk_p + (cols % PAGE) * sk_s  # (BLOCK_N,) offsets of the keys' rows
            v_rows = page * sv_p + (cols % PAGE) * sv_s
        else:
            k_rows = cols.to(tl.int64) * sk_s
            v_rows = cols.to(tl.int64) * sv_s
        kt_ptrs = K_h + k_rows[None, :] + offs_e[:, None] * sk_e  # (BLOCK_E, BLOCK_N): kᵀ of this tile
        v_ptrs = V_h + v_rows[:, None] + offs_ev[None, :] * sv_e  # (BLOCK_N, BLOCK_EV)
        if MASKED:
            inside = cols <= tl.max(last, 0)  # keys that some row may see
            kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & inside[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=inside[:, None] & (offs_ev[None, :] < EV), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_e[:, None] < E, other=0.0)
            v = tl.load(v_ptrs, mask=offs_ev[None, :] < EV, other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 scores
        if MASKED:
            s = tl.where(cols[None, :] <= last[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf - 0) = 0
        p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # (BLOCK_M, BLOCK_EV)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _decode_split(
    Q, K, V, O, O_PART, LSE_PART, TABLE, LENS,
    sq_b, sq_h, sq_l, sq_e, sk_b, sk_h, sk_s, sk_e, sv_b, sv_h, sv_s, sv_e, so_b, so_h, so_l, so_e, st_b,
    S_ALL, L, G, HKV, NUM_SPLITS, qk_scale,
    E: tl.constexpr, EV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, VARLEN: tl.constexpr = False,
):
    row_block = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)  # batch · key/value head
    split = tl.program_id(2)
    b = z // HKV
    h_kv = z % HKV
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) packed rows g · L + i
    in_rows = rows < G * L
    head = h_kv * G + rows // L  # (BLOCK_M,) the query head of each row
    qi = rows % L  # (BLOCK_M,) which of the L new queries
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    cols0 = tl.arange(0, BLOCK_N)
    q = tl.load(
        Q + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_l + offs_e[None, :] * sq_e,
        mask=in_rows[:, None] & (offs_e[None, :] < E), other=0.0,
    )  # (BLOCK_M, BLOCK_E)
    if PAGED:  # K, V are page pools (pages, Hkv, PAGE, E); this sequence's length and block table
        S = tl.load(LENS + b)
        TABLE_b = TABLE + b * st_b
        K_h = K + h_kv * sk_h
        V_h = V + h_kv * sv_h
    else:
        if VARLEN:  # per-sequence cache lengths (flash-attn's cache_seqlens): sequence b holds its first LENS[b]
            S = tl.load(LENS + b)
        else:
            S = S_ALL
        TABLE_b = TABLE
        K_h = K + b * sk_b + h_kv * sk_h
        V_h = V + b * sv_b + h_kv * sv_h
    last = S - L + qi  # (BLOCK_M,) bottom-right causal: query i is token S - L + i

    # This slice: [lo, hi), a whole number of tiles long, so that only the tiles at S and in the causal corner
    # (keys S - L + 1 and later) need masks. A slice that starts at or past S is empty and writes an empty state.
    span = tl.cdiv(tl.cdiv(S, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * span
    hi = tl.maximum(tl.minimum(lo + span, S), lo)
    full = tl.maximum(tl.minimum(hi, ((S - L + 1) // BLOCK_N) * BLOCK_N), lo)  # tiles every row sees wholly

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, K_h, V_h, TABLE_b, lo, full, cols0, last, offs_e, offs_ev, sk_b, sk_s, sk_e, sv_b, sv_s,
        sv_e, qk_scale, E, EV, False, PAGED, PAGE, BLOCK_N, PRECISION,
    )
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, K_h, V_h, TABLE_b, full, hi, cols0, last, offs_e, offs_ev, sk_b, sk_s, sk_e, sv_b, sv_s,
        sv_e, qk_scale, E, EV, True, PAGED, PAGE, BLOCK_N, PRECISION,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_EV), normalised over this slice's keys
    if DIRECT:  # one slice: this is the answer
        tl.store(
            O + b * so_b + head[:, None] * so_h + qi[:, None] * so_l + offs_ev[None, :] * so_e,
            out.to(O.dtype.element_ty), mask=in_rows[:, None] & (offs_ev[None, :] < EV),
        )
    else:  # partial state, (Z, NUM_SPLITS, G · L, Ev) and (Z, NUM_SPLITS, G · L), contiguous float32
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))  # an empty row: -inf, weight 0
        base = (z * NUM_SPLITS + split) * (G * L) + rows  # (BLOCK_M,)
        tl.store(O_PART + base[:, None] * EV + offs_ev[None, :], out,
                 mask=in_rows[:, None] & (offs_ev[None, :] < EV))
        tl.store(LSE_PART + base, lse, mask=in_rows)


# --------------------------------------------------------------------------------------------------------------
# The merge kernel. One program: BLOCK_M packed rows of one key/value head, every slice in turn.
#   out = Σ_s exp2(lse_s - m) · out_s / Σ_s exp2(lse_s - m), m the running max of the lse_s, rescaled as it grows.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_merge(
    O_PART, LSE_PART, O, LSE, so_b, so_h, so_l, so_e, L, G, HKV, NUM_SPLITS,
    EV: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    row_block = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    b = z // HKV
    h_kv = z % HKV
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < G * L
    head = h_kv * G + rows // L
    qi = rows % L
    offs_ev = tl.arange(0, BLOCK_EV)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the slices' lse
    total = tl.zeros([BLOCK_M], tl.float32)  # running Σ exp2(lse_s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)  # running Σ exp2(lse_s - m) · out_s
    for split in range(NUM_SPLITS):
        base = (z * NUM_SPLITS + split) * (G * L) + rows
        lse_s = tl.load(LSE_PART + base, mask=in_rows, other=float("-inf"))  # (BLOCK_M,)
        out_s = tl.load(O_PART + base[:, None] * EV + offs_ev[None, :],
                        mask=in_rows[:, None] & (offs_ev[None, :] < EV), other=0.0)  # (BLOCK_M, BLOCK_EV)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key so far: every weight is exp2(-inf) = 0
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse_s - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * out_s
        total = total * alpha + w
        m = m_new
    total_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(
        O + b * so_b + head[:, None] * so_h + qi[:, None] * so_l + offs_ev[None, :] * so_e,
        (acc / total_safe[:, None]).to(O.dtype.element_ty), mask=in_rows[:, None] & (offs_ev[None, :] < EV),
    )
    lse = tl.where(total > 0.0, m + tl.math.log2(total_safe), float("-inf"))
    tl.store(LSE + z * (G * L) + rows, lse, mask=in_rows)


# --------------------------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------------------------


def _tiles(device=None):
    """The split kernel's tiles: the interpreter's, or those of the GPU's architecture (lib.flash.tile_table);
    without a CUDA device to ask, an H100's (DEFAULT_GPU)."""
    if INTERPRETED:
        return INTERPRETER_TILES
    if device is None or torch.device(device).type != "cuda":
        return GPU_TILES
    return DECODE_TILES[_flash.tile_table(device).arch]


def _row_block(rows, max_rows=MAX_ROWS):
    return min(max_rows, max(16, triton.next_power_of_2(rows)))  # tl.dot needs at least 16 rows


def _sms(device):
    """Streaming multiprocessors of the GPU the tensors are on; on a CPU, those of lib.cost's DEFAULT_GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cost.gpu(DEFAULT_GPU).sms


def split_count(B, H, L, Hkv, S, *, sms=None, tiles=None):
    """The slices ``num_splits=None`` gives (B, H, L) queries against (B, Hkv, S) keys, on ``sms`` SMs (default:
    DEFAULT_GPU's). The programs of one slice are B · Hkv · ⌈G · L / row tile⌉; see :func:`choose_num_splits`."""
    B, H, L, Hkv = (cost._count(n, x) for n, x in (("B", B), ("H", H), ("L", L), ("Hkv", Hkv)))
    S = cost._count("S", S, 0)
    if H % Hkv:
        raise ValueError(f"H={H} query heads are not a multiple of Hkv={Hkv} key/value heads")
    tiles = tiles or _tiles()
    programs = B * Hkv * triton.cdiv((H // Hkv) * L, _row_block((H // Hkv) * L, tiles.max_rows))
    sms = cost.gpu(DEFAULT_GPU).sms if sms is None else sms
    return choose_num_splits(max(1, programs), S, sms, min_keys=tiles.min_keys)


def _launch(q, k, v, out, num_splits, scale, direct, paged=None, tiles=None, lens=None):
    """Run the split kernel (and, unless ``direct``, the merge). Returns the partial states and the merged lse.
    ``lens``, an int32 (B,) tensor on q's device, gives each sequence of a dense cache its own length."""
    tiles = tiles or _tiles(q.device)
    B, H, L, E = q.shape
    Ev = v.shape[-1]
    Hkv = k.shape[1]
    G = H // Hkv
    rows = G * L
    block_m = _row_block(rows, tiles.max_rows)
    grid = (triton.cdiv(rows, block_m), B * Hkv, num_splits)
    f32 = {"device": q.device, "dtype": torch.float32}
    o_part = torch.empty((0,) if direct else (B * Hkv, num_splits, rows, Ev), **f32)
    lse_part = torch.empty((0,) if direct else (B * Hkv, num_splits, rows), **f32)
    varlen = paged is None and lens is not None
    if paged is None:  # the table (and without varlen the lengths) is not read: any int32 tensor will do
        table = torch.zeros(1, dtype=torch.int32, device=q.device)
        lens = table if lens is None else lens
        st_b, page, S = 0, 1, k.shape[2]
    else:
        table, lens, page = paged
        st_b, S = table.stride(0), 0
    options = {} if INTERPRETED else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    common = {"BLOCK_EV": _flash._head_block(Ev), "BLOCK_M": block_m}
    _decode_split[grid](
        q, k, v, out, o_part, lse_part, table, lens,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), st_b,
        S, L, G, Hkv, num_splits, scale * LOG2_E,
        E=E, EV=Ev, BLOCK_E=_flash._head_block(E), PAGED=paged is not None, PAGE=page, DIRECT=direct,
        PRECISION=_flash._precision(q.dtype), BLOCK_N=tiles.block_n, VARLEN=varlen, **common, **options,
    )
    if direct:
        return None, None, None
    lse = torch.empty((B * Hkv, rows), **f32)
    _decode_merge[grid[:2]](o_part, lse_part, out, lse, *out.stride(), L, G, Hkv, num_splits, EV=Ev, **common)
    return o_part, lse_part, lse


# --------------------------------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------------------------------


def _check_tensors(fn, named):
    for n, x in named.items():
        if not isinstance(x, torch.Tensor):
            kind = f"{type(x).__module__}.{type(x).__qualname__}"
            hint = " (for NumPy arrays use lib.decoding.decode_step)" if kind.startswith("numpy") else ""
            raise TypeError(f"{fn} takes torch tensors; {n} is a {kind}{hint}")
    devices = {n: x.device for n, x in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{', '.join(named)} must be on one device; got "
                         + ", ".join(f"{n} {d}" for n, d in devices.items()))
    dtypes = {n: x.dtype for n, x in named.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{', '.join(named)} must share one dtype; got "
                        + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
    if torch.is_grad_enabled() and any(x.requires_grad for x in named.values()):
        grad = next(n for n, x in named.items() if x.requires_grad)
        raise ValueError(f"{grad} requires grad, but {fn} is not differentiable (it is for inference): run it under "
                         "torch.no_grad(), or use lib.flash.flash_attention to train")
    q = named["q"]
    if q.dtype not in DTYPES:
        raise TypeError(f"{fn} computes in float16, bfloat16 or float32; got {q.dtype}")
    if INTERPRETED:
        if q.dtype == torch.bfloat16:
            raise TypeError("bfloat16 is not supported in Triton's interpreter (it computes wrong values there): "
                            "use float16 or float32 on the CPU, or run on a GPU")
    elif q.device.type != "cuda":
        raise ValueError(
            f"q is on {q.device}, but the Triton kernels run on a CUDA GPU. To run them on the CPU in Triton's "
            "interpreter (slow; for tests and small examples), set os.environ['TRITON_INTERPRET'] = '1' before "
            "Triton is first imported, by anything (some torch modules import it)"
        )
    elif q.dtype == torch.bfloat16 and torch.cuda.get_device_capability(q.device) < (8, 0):
        raise TypeError(f"bfloat16 needs a GPU of compute capability 8.0 or newer; {q.device} has "
                        f"{torch.cuda.get_device_capability(q.device)}: use float16")


def _check_heads(q, k, v, fn):
    """(B, H, L, Hkv, S, E, Ev) of q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), checked."""
    for n, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            dims = "(B, H, L, E)" if n == "q" else f"(B, Hkv, S, {'Ev' if n == 'v' else 'E'})"
            raise ValueError(f"{fn} takes 4-D {n} {dims}; got shape {tuple(x.shape)}")
    B, H, L, E = q.shape
    Bk, Hkv, S, Ek = k.shape
    if (Bk, Hkv, S) != tuple(v.shape[:3]):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, Hkv, S)")
    if Bk != B:
        raise ValueError(f"q has batch {B} but k and v have {Bk} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if Ek != E:
        raise ValueError(f"k has E={Ek} but q has E={E} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q has H={H} heads, not a multiple of the Hkv={Hkv} key/value heads: each key/value head "
                         "must serve the same number of query heads")
    Ev = v.shape[-1]
    for name, size in (("E", E), ("Ev", Ev)):
        if not 1 <= size <= MAX_HEAD:
            raise ValueError(f"head size {name}={size} is outside the kernel's 1..{MAX_HEAD}: use lib.attention")
    return B, H, L, Hkv, S, E, Ev


def _check_splits(num_splits, S):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an integer or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= max(S, 1):
        raise ValueError(f"num_splits must be between 1 and S={S} (one key per slice at most), got {num_splits}")
    return int(num_splits)


def _check_queries_fit(L, S):
    if L > S:
        raise ValueError(f"q brings L={L} new queries but the keys cover only S={S} tokens: the new queries are the "
                         "last L of the S tokens, so their keys must already be in k and v (append them first)")


def _decode(q, k, v, num_splits, scale, fn, lengths=None):
    """Checks shared by the public functions: (out, scale, num_splits), scale None when there is nothing to do."""
    B, H, L, Hkv, S, E, Ev = _check_heads(q, k, v, fn)
    scale = _check_scale(scale, E)
    lengths = [S] if lengths is None else lengths
    for n in lengths:
        _check_queries_fit(L, n)
    S_max = max(lengths)
    num_splits = _check_splits(num_splits, S_max)
    out = torch.empty((B, H, L, Ev), device=q.device, dtype=q.dtype)
    if B * H * L == 0:
        return out, None, num_splits
    if num_splits is None:
        num_splits = split_count(B, H, L, Hkv, S_max, sms=_sms(q.device), tiles=_tiles(q.device))
    return out, scale, num_splits


def _check_seqlens(cache_seqlens, B, L, S, device):
    """cache_seqlens as an int32 (B,) tensor on ``device``, each between L and S, or None; names what is wrong."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an integer or one integer per sequence, got a bool")
    if isinstance(cache_seqlens, numbers.Integral):
        values = [int(cache_seqlens)] * B
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.is_floating_point() or cache_seqlens.is_complex() or cache_seqlens.dtype == torch.bool:
            raise TypeError(f"cache_seqlens must hold integers, got dtype {cache_seqlens.dtype}")
        if cache_seqlens.ndim != 1 or cache_seqlens.shape[0] != B:
            raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), one length per sequence of q; got "
                             f"{tuple(cache_seqlens.shape)}")
        values = cache_seqlens.tolist()
    else:
        try:
            values = list(cache_seqlens)
        except TypeError:
            raise TypeError(f"cache_seqlens must be an integer, a sequence of B integers or an integer tensor; got "
                            f"{type(cache_seqlens).__name__}") from None
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in values):
            raise TypeError(f"cache_seqlens must hold integers, got {values!r}")
        if len(values) != B:
            raise ValueError(f"cache_seqlens has {len(values)} lengths but q has B={B} sequences: one length each")
    for b, n in enumerate(values):
        if not L <= n <= S:
            raise ValueError(f"cache_seqlens[{b}] = {n} is outside [L, S] = [{L}, {S}]: each sequence holds at least "
                             "its L new queries' tokens, and at most the S rows k and v have")
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device == device:
        return cache_seqlens.to(torch.int32).contiguous()  # already on the device: no copy from the host
    return torch.tensor(values, dtype=torch.int32, device=device)


def flash_decode(q, k, v, *, cache_seqlens=None, num_splits=None, scale=None, axes="bhsd"):
    """Attention of a few new queries to a long key cache, split over the keys (Flash-Decoding; chapter 12).

    q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) torch tensors on a CUDA GPU in float16, bfloat16 or
    float32 (float16 and float32 also in Triton's interpreter on a CPU); returns (B, H, L, Ev) in q's dtype. H
    must be a multiple of Hkv: query heads h·G to h·G + G - 1 share key/value head h (grouped-query attention).
    The L new queries are the last L of the S tokens (L <= S), so query i sees keys 0 to S - L + i: the causal
    mask aligned bottom-right, no mask at all for L = 1. ``scale`` defaults to 1/sqrt(E).

    The keys are cut into ``num_splits`` slices of whole tiles, one program each per (batch, key/value head); each
    writes its slice's partial state and a second kernel merges them exactly (see the module's docstring).
    ``num_splits=None`` chooses the count with :func:`choose_num_splits` from the programs one slice needs and
    the GPU's SM count (on a CPU, the SM count of an H100). 1 <= num_splits <= S; slices that fall wholly past S
    when S is short are empty and weigh nothing in the merge. With one slice the kernel writes the output
    directly and the merge is skipped. Not differentiable: it is for inference.

    ``cache_seqlens`` gives each sequence its own cache length, as flash-attn's ``flash_attn_with_kvcache``: an
    integer, a sequence of B integers or an integer (B,) tensor, each between L and S. Sequence b then holds its
    first ``cache_seqlens[b]`` rows of k and v, its L new queries are the last L of those tokens, and the rows
    past its length are never read. It is read per sequence, never paired with the heads.

    ``axes="bshd"`` takes flash-attn's layout, q (B, L, H, E) and the cache k (B, S, Hkv, E), v (B, S, Hkv, Ev),
    and returns (B, L, H, Ev); the kernels read it through its strides, with no copy. With the default
    ``"bhsd"``, a flash-attn cache whose S equals Hkv would pass every shape check and be read along the wrong
    axis: name the layout.
    """
    _check_tensors("flash_decode", {"q": q, "k": k, "v": v})
    if _check_axes(axes) == "bshd":
        named = _from_axes(axes, {"q": q, "k": k, "v": v})
        out = flash_decode(named["q"], named["k"], named["v"], cache_seqlens=cache_seqlens, num_splits=num_splits,
                           scale=scale)
        return _to_axes(axes, out)
    B, _, L, _, S = _check_heads(q, k, v, "flash_decode")[:5]
    lens = _check_seqlens(cache_seqlens, B, L, S, q.device)
    out, scale, num_splits = _decode(q, k, v, num_splits, scale, "flash_decode")
    if scale is None:  # nothing to compute
        return out
    _launch(q, k, v, out, num_splits, scale, direct=num_splits == 1, lens=lens)
    return out


def flash_decode_partials(q, k, v, *, num_splits, scale=None):
    """The slices' partial states of :func:`flash_decode`, before the merge: ``(outs, lses)`` (chapter 12).

    outs (num_splits, B, H, L, Ev) float32: each slice's output normalised over its own keys; lses (num_splits,
    B, H, L) float32: the natural-log logsumexp of each row's scaled scores over those keys. A slice with no key
    for a row gives zeros and -inf there. These are the attention states of :mod:`lib.merge`: merging them in any
    order gives flash_decode's output.
    """
    _check_tensors("flash_decode_partials", {"q": q, "k": k, "v": v})
    if num_splits is None:
        raise TypeError("flash_decode_partials needs num_splits: how many slices to cut the keys into")
    out, scale, num_splits = _decode(q, k, v, num_splits, scale, "flash_decode_partials")
    B, H, L, Ev = out.shape
    if scale is None:
        return (torch.zeros((num_splits or 1, B, H, L, Ev), dtype=torch.float32, device=q.device),
                torch.full((num_splits or 1, B, H, L), -math.inf, device=q.device))
    o_part, lse_part, _ = _launch(q, k, v, out, num_splits, scale, direct=False)
    return _unpack(o_part, B, H, L), _unpack(lse_part, B, H, L) * LN_2


def _unpack(part, B, H, L):
    """(B · Hkv, splits, G · L, ...) in the kernels' packing -> (splits, B, H, L, ...)."""
    Z, P, rows = part.shape[:3]
    Hkv = Z // B
    G = rows // L
    x = part.reshape(B, Hkv, P, G, L, *part.shape[3:])  # (B, Hkv, P, G, L, ...)
    x = x.movedim(2, 0)  # (P, B, Hkv, G, L, ...)
    return x.reshape(P, B, H, L, *part.shape[3:])


def flash_decode_paged(q, caches, *, num_splits=None, scale=None):
    """:func:`flash_decode` reading keys and values from paged caches through their block tables (chapter 12).

    q (B, H, L, E); ``caches`` a sequence of B :class:`lib.paged.PagedKVCache` that share one
    :class:`lib.paged.PagePool`, one per sequence, each holding keys (Hkv, S_b, E) and values (Hkv, S_b, Ev) of
    its own length S_b >= L. The kernel finds the physical page of logical key j of sequence b at
    ``block_table[b][j // page_size]``, row ``j % page_size``: the keys are never gathered into one tensor.
    ``num_splits`` counts slices per sequence (each sequence's keys are cut into that many); by default chosen
    for the longest. Returns (B, H, L, Ev) in q's dtype. The block tables and lengths are read where the caches
    keep them on the device (:attr:`lib.paged.PagedKVCache.device_block_table`): nothing is built on the host.
    """
    from lib.paged import PagedKVCache

    try:
        caches = list(caches) if not isinstance(caches, PagedKVCache) else [caches]
    except TypeError:
        raise TypeError(f"caches must be a list of lib.paged.PagedKVCache, got {type(caches).__name__}") from None
    if not caches or not all(isinstance(c, PagedKVCache) for c in caches):
        raise TypeError("flash_decode_paged's caches must be a list of lib.paged.PagedKVCache, one per sequence of q")
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches):
        raise ValueError("the caches must share one PagePool: the kernel reads a single pool of pages")
    if pool.key_pages is None or any(len(c) == 0 for c in caches):
        raise ValueError("every cache needs at least one token: append before decoding")
    if pool.key_pages.ndim != 4:
        raise ValueError(f"the pool holds keys of shape {tuple(pool.key_pages.shape[1:])} per page; flash_decode_paged "
                         "reads pages of (Hkv, page_size, E): append keys shaped (Hkv, l, E)")
    if not isinstance(q, torch.Tensor):
        _check_tensors("flash_decode_paged", {"q": q})
    if q.ndim == 4 and q.shape[0] != len(caches):
        raise ValueError(f"q has batch {q.shape[0]} but there are {len(caches)} caches: one per sequence")
    K, V = pool.key_pages, pool.value_pages  # (pages, Hkv, page_size, E), (pages, Hkv, page_size, Ev)
    _check_tensors("flash_decode_paged", {"q": q, "keys": K, "values": V})
    lengths = [len(c) for c in caches]
    # The heads' checks see k, v as (B, Hkv, S, E): the pool's page dimension stands in for the batch.
    k_view = K[:1].expand(len(caches), *K.shape[1:]) if q.ndim == 4 else K
    v_view = V[:1].expand(len(caches), *V.shape[1:]) if q.ndim == 4 else V
    out, scale, num_splits = _decode(q, k_view, v_view, num_splits, scale, "flash_decode_paged", lengths=lengths)
    if scale is None:
        return out
    # The caches keep their block tables and lengths on the device, updated as they grow: stacking them is a
    # copy on the device, with nothing built on the host or copied from it at decode time.
    table = torch.stack([c.device_block_table for c in caches])  # (B, num_pages) int32
    lens = torch.cat([c.device_length for c in caches])  # (B,) int32
    _launch(q, K, V, out, num_splits, scale, direct=num_splits == 1, paged=(table, lens, pool.page_size))
    return out
