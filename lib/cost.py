"""What attention costs on a named machine: operations, bytes moved, and the time each one's rate allows.

A small cost model shared by chapters 7 to 12. Nothing here times anything: these are counts and datasheet rates,
so every figure they give is a prediction, and the chapters say so where they print one. Shapes follow
:mod:`lib.attention`: ``L`` queries, ``S`` keys, ``E`` the query/key size, ``Ev`` the value size.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

__all__ = [
    "GPU", "GPUS", "MODELS", "ScoreLedger", "Transformer", "attainable_flops", "attended_pairs", "attention_bytes",
    "attention_crossover", "attention_flops", "attention_share", "cache_outweighs_weights", "choose_num_splits",
    "decode_attention_intensity", "decode_bytes", "decode_fits", "decode_memory_bytes", "decode_step",
    "decode_tokens_per_s", "forward_flops", "fp32_per_score", "gpu", "intensity", "kv_cache_bytes",
    "l2_bytes_per_score", "layer_step_flops", "ledger_ceilings", "max_decode_batch", "model", "roofline_seconds",
    "score_ledger", "smem_bytes_per_score", "wave_efficiency",
]


@dataclass(frozen=True)
class GPU:
    """A GPU's datasheet rates (dense, no sparsity) and the few on-chip facts the chapters reason with."""

    name: str
    tensor_flops: float  # bf16/fp16 dense matrix products on the tensor cores, FLOP/s
    fp32_flops: float  # float32 fused multiply-adds on the ordinary cores, FLOP/s (an FMA counts 2)
    hbm_bytes_per_s: float  # memory bandwidth between HBM and the chip, bytes/s
    hbm_bytes: float  # memory capacity, bytes
    sms: int  # streaming multiprocessors
    clock_hz: float  # boost clock the rates above assume
    exp_per_clock_per_sm: int  # exponentials (ex2 on the special-function units) per clock per SM
    smem_per_block: int  # shared memory one thread block may use, bytes
    smem_bytes_per_clock_per_sm: int = 128  # shared-memory bandwidth: 32 banks of 4 bytes a clock
    tensor_clock_hz: float | None = None  # the clock tensor_flops assumes, where NVIDIA quotes it at another one

    def at_clock(self, clock_hz: float) -> GPU:
        """The same GPU with every unit of the SM priced at one clock, ``clock_hz`` (chapter 8): the tensor cores,
        the float32 lanes, the exponentials and shared memory. HBM keeps its own clock and its bandwidth."""
        clock_hz = _amount("clock_hz", clock_hz)
        if not clock_hz > 0:
            raise ValueError(f"clock_hz must be above 0, got {clock_hz!r}")
        tensor_clock = self.clock_hz if self.tensor_clock_hz is None else self.tensor_clock_hz
        return dataclasses.replace(self, tensor_flops=self.tensor_flops * clock_hz / tensor_clock,
                                   fp32_flops=self.fp32_flops * clock_hz / self.clock_hz, clock_hz=clock_hz,
                                   tensor_clock_hz=None)

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP per byte of HBM traffic) above which the tensor cores, not memory, set the pace."""
        return self.tensor_flops / self.hbm_bytes_per_s

    @property
    def exp_per_s(self) -> float:
        """Exponentials per second over the whole chip."""
        return self.exp_per_clock_per_sm * self.sms * self.clock_hz

    @property
    def smem_bytes_per_s(self) -> float:
        """Shared-memory bytes per second over the whole chip, every SM reading or writing at its clock rate."""
        return self.smem_bytes_per_clock_per_sm * self.sms * self.clock_hz


# NVIDIA's datasheets for the SXM parts (H100, H200, A100) and the PCIe T4 (free Colab's GPU). The exponential rate
# is the special-function units' 16 results per clock per SM of compute capability 8.x and 9.0 (CUDA C++
# Programming Guide, arithmetic instruction throughput); the shared-memory rate is the same guide's 32 banks, each
# 32 bits wide a clock. The H100's and H200's 989.4 TFLOP/s is 4,096 FLOPs a clock on each of 132 SMs at 1.83 GHz,
# while their float32 rate assumes the 1.98 GHz boost clock: ``at_clock`` puts every unit on one clock.
GPUS = {
    "H100": GPU("NVIDIA H100 SXM5 80GB", 989.4e12, 66.9e12, 3.35e12, 80e9, 132, 1.98e9, 16, 227 * 1024,
                tensor_clock_hz=1.83e9),
    "H200": GPU("NVIDIA H200 SXM 141GB", 989.4e12, 66.9e12, 4.8e12, 141e9, 132, 1.98e9, 16, 227 * 1024,
                tensor_clock_hz=1.83e9),
    "A100": GPU("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 2.039e12, 80e9, 108, 1.41e9, 16, 163 * 1024),
    "T4": GPU("NVIDIA T4", 65e12, 8.1e12, 320e9, 16e9, 40, 1.59e9, 16, 64 * 1024),
}


def gpu(name: str) -> GPU:
    """The GPU called ``name`` (one of ``GPUS``), with a clear error for any other name. A :class:`GPU` is
    returned as it is, so every function here takes a GPU or its name."""
    return _gpu(name, "name")


def _named(value, argument, kind, table, missing):
    """``value`` itself if it is a ``kind``, else the entry of ``table`` it names, with a clear error naming
    ``argument`` for anything else."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a lib.cost.{kind.__name__} or one of the names {', '.join(table)}; got "
                        f"{type(value).__name__}")
    if value not in table:
        raise ValueError(f"{argument}={value!r}: {missing}; known: {', '.join(table)}")
    return table[value]


def _gpu(value, argument):
    return _named(value, argument, GPU, GPUS, "no rates for that GPU")


# --------------------------------------------------------------------------------------------------------------
# Decoding (chapter 12): how many pieces to cut a long key cache into, so that one new token keeps a GPU busy.
# --------------------------------------------------------------------------------------------------------------


def wave_efficiency(programs: int, sms: int) -> float:
    """Share of the SMs' time doing work when ``programs`` equal programs run in waves of ``sms`` at a time.

    One program per SM at a time: ``programs / sms`` waves, the last one possibly partial, so the chip is busy for
    ``waves / ceil(waves)`` of the time. 8 programs on 132 SMs: 0.06; 132: 1.0; 133: about 0.5.
    """
    programs, sms = _count("programs", programs), _count("sms", sms)
    return (programs / sms) / -(-programs // sms)  # waves / ⌈waves⌉


def choose_num_splits(programs: int, keys: int, sms: int, *, min_keys: int = 256, max_splits: int = 128,
                      tolerance: float = 0.85) -> int:
    """How many slices of the keys split-KV decoding should use (chapter 12).

    ``programs`` is how many programs one slice needs (batch · key/value heads · query blocks), ``keys`` the cache
    length S, ``sms`` the GPU's streaming multiprocessors. Rules, in order:

    1. if ``programs`` already fill the SMs, one slice: splitting would only add a merge;
    2. a slice holds at least ``min_keys`` keys (else each program does too little to pay for writing its partial
       state and for the merge), and there are at most ``max_splits``: so at most ``min(max_splits, keys //
       min_keys)`` slices, and at least 1;
    3. among the counts allowed, the smallest whose wave efficiency (``wave_efficiency(programs · splits, sms)``) is
       within ``tolerance`` of the best one: more slices than that add merge work and no busier SMs.

    It is modelled on FlashAttention-2's ``num_splits_heuristic``, simplified: that rule counts two programs per SM
    (it is passed twice the SM count) and stops splitting once the programs fill 80% of them; here ``sms`` is the
    number of programs that run at once, and splitting stops only when they fill all of it (chapter 12).
    """
    programs, keys, sms = _count("programs", programs), _count("keys", keys, 0), _count("sms", sms)
    min_keys, max_splits = _count("min_keys", min_keys), _count("max_splits", max_splits)
    if programs >= sms:
        return 1
    most = max(1, min(max_splits, keys // min_keys))
    efficiency = {p: wave_efficiency(programs * p, sms) for p in range(1, most + 1)}
    best = max(efficiency.values())
    return min(p for p, e in efficiency.items() if e >= tolerance * best)


def decode_bytes(batch: int, kv_heads: int, keys: int, E: int, Ev: int, bytes_per_number: float) -> int:
    """Bytes of keys and values one decoding step must read from HBM at least: each cached key and value once.

    batch · kv_heads · keys · (E + Ev) · bytes_per_number. The queries and outputs (a few rows per head) are left
    out: at decoding sizes they are a fraction of a percent. Divided by ``gpu(...).hbm_bytes_per_s`` it gives the
    least time the step can take, a prediction; divided by a measured time, the bandwidth achieved.
    """
    batch, kv_heads, keys = _count("batch", batch), _count("kv_heads", kv_heads), _count("keys", keys, 0)
    E, Ev, bytes_per_number = _count("E", E), _count("Ev", Ev), _bytes_per_number(bytes_per_number)
    return _whole(batch * kv_heads * keys * (E + Ev) * bytes_per_number)


# Chapter 8: the ledger per score. A fused attention kernel spends, on each query-key pair (one score), tensor-core
# FLOPs for its matrix products, one exponential, and a handful of float32 instructions for the online softmax;
# each goes to its own unit, at its own rate. Dividing by the rates gives the time each unit needs per score.
# --------------------------------------------------------------------------------------------------------------

# float32 instructions per score in the forward loop, counted in the SASS of lib.flash's loop compiled for sm_90
# (tools/compile_report.py --loop, 128 × 64 tiles, 8 warps, 32 scores a thread). Two parts: the softmax proper (the
# max, the subtraction fused with the scale, the row sum, the 16-bit pack: 124 instructions for 32 scores with the
# scale folded into the exponent's FMA, 154 without), and the rescale of the float32 accumulator by alpha, one FMUL
# per accumulator entry per key tile, that is Ev / BLOCK_N per score. Compiled: 156 at head size 64 and 188 at 128
# (folded), 186 and 218 (not folded). Other kernels pick other tiles; the count is this library's, not SDPA's.
FP32_SOFTMAX_FOLDED = 124 / 32
FP32_SOFTMAX_UNFOLDED = 154 / 32
FP32_PER_SCORE_FOLDED = 188 / 32  # head size 128, as compiled
FP32_PER_SCORE_UNFOLDED = 218 / 32
# Of those, the ones that do not issue at the FMA pipe's 128 lanes a clock per SM. FMNMX (the running maximum): the
# CUDA C++ Programming Guide's throughput table, row "compare, minimum, maximum", gives 64 a clock per SM on compute
# capability 8.6, 8.9 and 9.0, half their 128 float32 adds and multiplies (on 8.0 both are 64: full rate there).
# F2FP (the pack of two float32 weights into 16 bits) has no row of its own. The ledger assumes it issues at that
# same half rate; if it falls in the guide's catch-all row, "all other type conversions" (16 a clock per SM on 9.0,
# one eighth of the float32 rate), each takes 8 lane slots instead of 2: ``score_ledger(..., f2fp_slots=8)``
# prices that case. 36 FMNMX + 16 F2FP for 32 scores, at either head size.
FMNMX_PER_SCORE = 36 / 32
F2FP_PER_SCORE = 16 / 32
FP32_HALF_RATE_PER_SCORE = FMNMX_PER_SCORE + F2FP_PER_SCORE  # 52 / 32
F2FP_SLOTS_CATCH_ALL = 8  # lane slots per F2FP at the guide's "all other type conversions" rate on 9.0

# Two rates measured on one NVIDIA H100 80GB (torch 2.11.0+cu130, Triton 3.6, November 2026), rounded as recorded
# ("about") in benchmarks/results.md beside SDPA's 417 and 603 TFLOP/s of the same run: a large bfloat16 matrix
# product, and a copy timed as bytes read plus bytes written a second. Approximate, and one run.
H100_MEASURED_MATMUL_FLOPS = 790e12
H100_MEASURED_COPY_BYTES_PER_S = 3.0e12


def fp32_per_score(d: int, block_n: int = 64, folded: bool = True) -> float:
    """Float32 instructions per score of the forward loop at head size ``d`` with key tiles of ``block_n`` (chapter 8):
    the softmax's own, plus the accumulator's rescale, ``d / block_n``."""
    d, block_n = _count("d", d), _count("block_n", block_n)
    if not isinstance(folded, bool):
        raise TypeError(f"folded must be True or False, got {type(folded).__name__}")
    return (FP32_SOFTMAX_FOLDED if folded else FP32_SOFTMAX_UNFOLDED) + d / block_n


@dataclass(frozen=True)
class ScoreLedger:
    """What one score costs a fused attention kernel on a GPU: work per unit, and seconds per unit (chapter 8)."""

    gpu: GPU
    d: int  # head size
    tensor_flops: float  # per score: 2·d per matrix product
    exponentials: float  # per score
    fp32_ops: float  # per score, float32 instructions (one lane each), all of them
    hbm_bytes: float  # per score: the compulsory traffic (q, k, v, o once) shared over the n scores of a row
    fp32_half_rate_ops: float = 0.0  # per score, extra lane slots of the slow ones among fp32_ops (1 per half-rate op)
    smem_bytes: float | None = None  # per score, shared-memory traffic of the tiles (None: no tiles given)
    l2_bytes: float | None = None  # per score, the re-reads of K and V, one per query tile (None: no tiles given)

    def l2_bytes_per_s(self, tflops: float) -> float:
        """The L2 bandwidth (bytes/s) the re-reads of K and V need for a kernel running at ``tflops`` TFLOP/s (tensor
        FLOPs, as the convention counts them). NVIDIA publishes no L2 bandwidth to divide by."""
        if self.l2_bytes is None:
            raise ValueError("this ledger has no tiles: pass tiles=(block_m, block_n) to score_ledger")
        return self.l2_bytes * _amount("tflops", tflops) * 1e12 / self.tensor_flops

    @property
    def seconds(self) -> dict:
        """Seconds per score on each unit, at the GPU's datasheet rates; a half-rate instruction takes two lanes' time
        (one extra slot), an eighth-rate one eight."""
        lane_slots = self.fp32_ops + self.fp32_half_rate_ops  # an FMA is 2 FLOPs, 1 instruction
        return {
            "tensor cores": self.tensor_flops / self.gpu.tensor_flops,
            "exponential unit": self.exponentials / self.gpu.exp_per_s,
            "float32 lanes": lane_slots / (self.gpu.fp32_flops / 2),
            "HBM": self.hbm_bytes / self.gpu.hbm_bytes_per_s,
            **({} if self.smem_bytes is None else {"shared memory": self.smem_bytes / self.gpu.smem_bytes_per_s}),
        }

    def bound(self, overlap: str) -> float:
        """Seconds per score if the units run one after another ("serial"), if the exponentials and the float32
        work overlap each other but not the products ("softmax"), or if everything overlaps ("full"). The products
        take the longer of the tensor cores' time and the shared-memory time their operands need."""
        t = self.seconds
        core, ex, fp = max(t["tensor cores"], t.get("shared memory", 0.0)), t["exponential unit"], t["float32 lanes"]
        if overlap == "serial":
            return max(core + ex + fp, t["HBM"])
        if overlap == "softmax":
            return max(core + max(ex, fp), t["HBM"])
        if overlap == "full":
            return max(t.values())
        raise ValueError(f"overlap is 'serial', 'softmax' or 'full'; got {overlap!r}")

    def tflops(self, overlap: str) -> float:
        """The TFLOP/s a kernel would report under that bound, counting the tensor-core FLOPs only."""
        return self.tensor_flops / self.bound(overlap) / 1e12


def smem_bytes_per_score(d: int, block_m: int = 128, block_n: int = 64, *, elt: int = 2, rows_per_mma: int = 64,
                         q_in_smem: bool = True, p_in_smem: bool = False) -> float:
    """Bytes of shared-memory traffic per score of the forward loop with ``block_m`` × ``block_n`` tiles (chapter 8).

    Per key tile: the K and V tiles are written once from HBM (2·block_n·d numbers); every group of
    ``rows_per_mma`` query rows (a warp group on Hopper, whose wgmma takes 64 rows) reads the K tile for QKᵀ and the
    V tile for PV (2·block_n·d each group); the query tile is read once more when it is an operand in shared memory
    (``q_in_smem``, block_m·d); and P is written and read back when it goes through shared memory instead of
    registers (``p_in_smem``, 2·block_m·block_n). Divided by block_m·block_n scores, times ``elt`` bytes."""
    d, block_m, block_n = _count("d", d), _count("block_m", block_m), _count("block_n", block_n)
    elt, rows_per_mma = _count("elt", elt), _count("rows_per_mma", rows_per_mma)
    for name, flag in (("q_in_smem", q_in_smem), ("p_in_smem", p_in_smem)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__}")
    groups = -(-block_m // rows_per_mma)  # ⌈block_m / rows_per_mma⌉ groups each read K and V
    numbers_moved = 2 * block_n * d * (1 + groups) + q_in_smem * block_m * d + p_in_smem * 2 * block_m * block_n
    return numbers_moved * elt / (block_m * block_n)


def l2_bytes_per_score(d: int, block_m: int = 128, *, Ev: int | None = None, elt: int = 2) -> float:
    """Bytes of K and V each score costs the L2 cache when every query tile of ``block_m`` rows reads them again
    (chapter 8): (d + Ev)·elt / block_m. A kernel at R tensor FLOP/s needs R / (4d) · this many bytes a second."""
    d, block_m, elt = _count("d", d), _count("block_m", block_m), _count("elt", elt)
    Ev = d if Ev is None else _count("Ev", Ev)
    return (d + Ev) * elt / block_m


def score_ledger(gpu: GPU, d: int, n: int = 4096, products: int = 2, exponentials: float = 1.0,
                 fp32_ops: float | None = None, elt: int = 2, half_rate: bool = True,
                 f2fp_slots: float = 2, tiles: tuple[int, int] | None = None) -> ScoreLedger:
    """The ledger per score of attention with head size ``d`` over ``n`` keys (chapter 8). The forward pass has 2
    products and 1 exponential a score; a backward pass 5 products (7 with a separate dQ kernel) and 1 or 2.
    ``fp32_ops`` defaults to the library's compiled forward loop, :func:`fp32_per_score` ``(d)``, of which
    ``FP32_HALF_RATE_PER_SCORE`` issue at half rate; ``half_rate=False`` counts every one at the FMA rate (the
    simplification, to price it). ``f2fp_slots`` is the lane slots each F2FP takes with ``half_rate``: 2 (half rate,
    the assumption) or ``F2FP_SLOTS_CATCH_ALL`` (the guide's "all other type conversions" row). ``tiles``,
    (block_m, block_n), adds the shared-memory bar (:func:`smem_bytes_per_score`) and the L2 re-reads
    (:func:`l2_bytes_per_score`), and counts the accumulator's rescale for that key tile."""
    device = _gpu(gpu, "gpu")  # a GPU or its name
    smem = l2 = None
    if tiles is not None:
        if not isinstance(tiles, tuple) or len(tiles) != 2:
            raise TypeError(f"tiles must be a tuple (block_m, block_n), got {tiles!r}")
        tiles = (_count("tiles[0] (block_m)", tiles[0]), _count("tiles[1] (block_n)", tiles[1]))
        smem, l2 = smem_bytes_per_score(d, *tiles, elt=elt), l2_bytes_per_score(d, tiles[0], elt=elt)
    d, n, products, elt = _count("d", d), _count("n", n), _count("products", products), _count("elt", elt)
    exponentials = _amount("exponentials", exponentials)
    block_n = 64 if tiles is None else tiles[1]
    fp32_ops = fp32_per_score(d, block_n) if fp32_ops is None else _amount("fp32_ops", fp32_ops)
    f2fp_slots = _amount("f2fp_slots", f2fp_slots)
    if f2fp_slots < 1:
        raise ValueError(f"f2fp_slots must be at least 1 (a full-rate instruction); got {f2fp_slots}")
    if half_rate and FP32_HALF_RATE_PER_SCORE > fp32_ops:
        raise ValueError(f"fp32_ops={fp32_ops} is fewer than the {FP32_HALF_RATE_PER_SCORE} half-rate instructions "
                         "it must include")
    slow = FMNMX_PER_SCORE + (f2fp_slots - 1) * F2FP_PER_SCORE if half_rate else 0.0
    return ScoreLedger(device, d, 2 * d * products, exponentials, fp32_ops, 4 * n * d * elt / (n * n), slow, smem, l2)


def ledger_ceilings(gpu: GPU, d: int, n: int = 4096, f2fp_slots: float = 2) -> tuple[float, float]:
    """Two ceilings on the forward TFLOP/s of a kernel whose products and softmax take turns (chapter 8): all units in
    turn ("serial"), and the softmax's two units overlapping each other but not the products ("softmax"). Only a
    kernel that runs its softmax under its products can pass the second. Pass a :class:`GPU` (or its name) with a
    measured ``tensor_flops`` (``dataclasses.replace``) for the ceilings at the rate matrix products really reach;
    ``f2fp_slots`` as in :func:`score_ledger`."""
    ledger = score_ledger(gpu, d, n, f2fp_slots=f2fp_slots)  # which takes a GPU or its name
    return ledger.tflops("serial"), ledger.tflops("softmax")


# --------------------------------------------------------------------------------------------------------------
# Chapters 7, 10 and 11: counting attention, a transformer's forward pass, and the decode step on the roofline
# --------------------------------------------------------------------------------------------------------------


def _amount(name, x):
    """A finite, non-negative real number (FLOPs, bytes, instructions), or a clear error naming it."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not 0 <= x < float("inf"):
        raise ValueError(f"{name} must be finite and non-negative, got {x!r}")
    return x


def _count(name, n, low=1):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")
    return int(n)


def _bytes_per_number(value):
    """Bytes a stored number takes: 2 for float16, 4 for float32, and fractions for packed formats (0.5 for int4,
    1.0625 for fp8 with one float16 scale per 32 numbers); any finite real above 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"bytes_per_number must be a number (2 for float16, 0.5 for int4), got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bytes_per_number must be finite and above 0 (2 for float16, 0.5 for int4), got {value!r}")
    return int(value) if float(value).is_integer() else float(value)


def _whole(nbytes):
    """A byte count as an int where it is whole (every format with whole bytes), else as a float."""
    return int(nbytes) if float(nbytes).is_integer() else nbytes


def attended_pairs(L, S=None, *, causal=False):
    """How many (query, key) pairs are scored: L·S, or those a causal mask keeps (chapter 7).

    ``causal`` as in :func:`lib.attention.attention`: False; True or ``"top-left"``, query i sees keys j <= i,
    Σ_i min(i + 1, S) pairs; ``"bottom-right"``, query i is token S - L + i and sees keys j <= S - L + i,
    L·(S - L) + L(L + 1)/2 pairs (needs L <= S). With L = S both are n(n + 1)/2, about half of n². A kernel that
    skips the masked tiles does about this much work.
    """
    L = _count("L", L)
    S = L if S is None else _count("S", S)
    if isinstance(causal, bool) and not causal:
        return L * S
    if not isinstance(causal, (bool, str)):
        raise TypeError(f"causal must be False, True, 'top-left' or 'bottom-right'; got {type(causal).__name__}")
    if causal is True or causal == "top-left":
        full = min(L, S)  # rows 0 .. S-1 see i + 1 keys; any later row sees all S
        return full * (full + 1) // 2 + (L - full) * S
    if causal == "bottom-right":
        if L > S:
            raise ValueError(f"causal='bottom-right' with L={L} queries after S={S} keys: it needs L <= S")
        return L * (S - L) + L * (L + 1) // 2
    raise ValueError(f"causal must be False, True, 'top-left' or 'bottom-right'; got {causal!r}")


def attention_flops(L, S=None, E=64, Ev=None, *, heads=1, batch=1, causal=False):
    """FLOPs of attention's two matrix products, Q Kᵀ and weights·V: 2·pairs·(E + Ev) per head (chapter 7).

    A multiply-add counts 2 FLOPs; the softmax (a few operations per score) is left out, as ``FlopCounterMode``
    and the FlashAttention papers leave it out. With L = S = n and E = Ev = d, this is 4 n² d per head.
    """
    E = _count("E", E)
    Ev = E if Ev is None else _count("Ev", Ev)
    pairs = attended_pairs(L, S, causal=causal)
    return 2 * pairs * (E + Ev) * _count("heads", heads) * _count("batch", batch)


def attention_bytes(L, S=None, E=64, Ev=None, *, heads=1, kv_heads=None, batch=1, bytes_per_number=2,
                    scores=False):
    """Bytes attention moves to and from GPU memory: q, k, v read and the output written once (chapter 7).

    That is what a fused kernel moves (FlashAttention keeps the scores on chip). ``scores=True`` adds what an
    unfused implementation moves besides: the L×S scores written, read by the softmax, the weights written and read
    again by the product with V, 4·L·S numbers per head. Keys and values are counted once per key/value head.
    """
    L = _count("L", L)
    S = L if S is None else _count("S", S)
    E = _count("E", E)
    Ev = E if Ev is None else _count("Ev", Ev)
    heads = _count("heads", heads)
    kv_heads = heads if kv_heads is None else _count("kv_heads", kv_heads)
    numbers_moved = heads * (L * E + L * Ev) + kv_heads * S * (E + Ev)
    if scores:
        numbers_moved += 4 * heads * L * S
    return _whole(numbers_moved * _count("batch", batch) * _bytes_per_number(bytes_per_number))


def intensity(flops, nbytes):
    """Arithmetic intensity: FLOPs per byte of memory traffic (chapter 7)."""
    flops, nbytes = _amount("flops", flops), _amount("nbytes", nbytes)
    if not nbytes > 0:
        raise ValueError(f"nbytes must be positive, got {nbytes!r}")
    return flops / nbytes


def roofline_seconds(flops, nbytes, device):
    """The least time ``flops`` and ``nbytes`` can take on ``device`` (a :class:`GPU` or a name in ``GPUS``).

    The roofline bound max(flops / peak, bytes / bandwidth): a prediction from datasheet rates, never a measurement.
    It counts the tensor cores' rate, so it is the bound for half-precision matrix products.
    """
    device = _gpu(device, "device")
    flops, nbytes = _amount("flops", flops), _amount("nbytes", nbytes)
    return max(flops / device.tensor_flops, nbytes / device.hbm_bytes_per_s)


def attainable_flops(arithmetic_intensity, device):
    """FLOP/s the roofline allows at an intensity: min(peak, intensity · bandwidth) (chapter 7)."""
    device = _gpu(device, "device")
    arithmetic_intensity = _amount("arithmetic_intensity", arithmetic_intensity)
    return min(device.tensor_flops, arithmetic_intensity * device.hbm_bytes_per_s)


def layer_step_flops(new, keys, d_model, *, kv_size=None):
    """FLOPs of one multi-head attention layer run on ``new`` tokens against ``keys`` keys (chapter 10).

    The four projections, 2·new·D·(2D + 2·kv_size) with kv_size = Hkv·d_head (D without grouping), and the two
    products of attention over every (query, key) pair, 4·new·keys·D. No mask is subtracted: this is what
    PyTorch's math kernel multiplies, masked pairs included, and what ``FlopCounterMode`` counts.
    """
    new, keys, d_model = _count("new", new), _count("keys", keys), _count("d_model", d_model)
    kv_size = d_model if kv_size is None else _count("kv_size", kv_size)
    return 2 * new * d_model * (2 * d_model + 2 * kv_size) + 4 * new * keys * d_model


@dataclass(frozen=True)
class Transformer:
    """The shape of a decoder-only transformer with a gated (SwiGLU) MLP, as the Llama family has."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int  # the MLP's hidden size; gated: three (d_model, d_ff) matrices
    vocab: int
    context: int  # the trained context length, tokens

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def layer_params(self) -> int:
        """Matrix parameters of one layer: W_Q and W_O (D×D), W_K and W_V (D×Hkv·d), three MLP matrices."""
        kv = self.n_kv_heads * self.d_head
        return 2 * self.d_model**2 + 2 * self.d_model * kv + 3 * self.d_model * self.d_ff

    @property
    def params(self) -> int:
        """Every parameter: layers (matrices and two RMSNorm vectors), the final norm, untied in and out embeddings."""
        return self.n_layers * (self.layer_params + 2 * self.d_model) + self.d_model + 2 * self.vocab * self.d_model

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token in 16-bit numbers: 2 (keys, values) · layers · Hkv · d_head · 2 bytes."""
        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.d_head, 1, 2)


# Published configurations (each model's config.json on the Hugging Face hub, and the papers' tables:
# Llama 2, arXiv:2307.09288, Table 1; Llama 3, arXiv:2407.21783, Table 3). Both untie the embeddings.
MODELS = {
    "Llama-2-7B": Transformer("Llama 2 7B", 32, 4096, 32, 32, 11008, 32000, 4096),
    "Llama-3-8B": Transformer("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, 8192),
}


def model(name: str) -> Transformer:
    """The transformer called ``name`` (one of ``MODELS``), with a clear error for any other name. A
    :class:`Transformer` is returned as it is, so every function here takes a shape or its name."""
    return _model(name, "name")


def _model(name, argument):
    return _named(name, argument, Transformer, MODELS, "no shape for that model")


def forward_flops(shape, n_tokens, *, causal=True):
    """FLOPs of one forward pass over ``n_tokens`` tokens, split into "dense" and "attention" (chapter 7).

    dense: the layers' matrix products, 2 · layer_params per token per layer (projections and MLP). attention:
    Q Kᵀ and weights·V over the pairs a causal mask keeps, 4 · d_model per pair per layer. Left out: the
    embedding lookup, the output read-out (2 · vocab · d_model per token), softmax, norms and activations.
    """
    shape, n = _model(shape, "shape"), _count("n_tokens", n_tokens)
    dense = 2 * shape.layer_params * n * shape.n_layers
    attention = 4 * shape.d_model * attended_pairs(n, causal=causal) * shape.n_layers
    return {"dense": dense, "attention": attention}


def attention_share(shape, n_tokens):
    """The share of a causal forward pass's layer FLOPs spent in attention's two products (chapter 7)."""
    shape = _model(shape, "shape")
    flops = forward_flops(shape, n_tokens)
    return flops["attention"] / (flops["attention"] + flops["dense"])


def attention_crossover(shape):
    """The length n at which causal attention's FLOPs equal the dense layers' (chapter 7).

    Per layer, attention does 2·d_model·(n + 1) FLOPs per token on average and the dense products 2·layer_params,
    so they meet at n = layer_params / d_model - 1. Returned as a float.
    """
    shape = _model(shape, "shape")
    return shape.layer_params / shape.d_model - 1


def _read_weights(shape):
    """Weights one decode step reads: every layer matrix and the output read-out (the input embedding reads only
    the new tokens' rows, and the norms are a few vectors: both left out)."""
    return shape.n_layers * shape.layer_params + shape.vocab * shape.d_model


def decode_step(shape, context, *, batch=1, bytes_per_number=2):
    """FLOPs and bytes of one decode step: ``batch`` new tokens, each after ``context`` cached ones (chapter 11).

    Bytes: every layer matrix and the output read-out read once for the whole batch (the input embedding reads
    only ``batch`` rows, left out), plus each sequence's KV cache of ``context`` tokens. FLOPs: 2 per weight per
    token, plus attention's 4 · H · d_head per cached token per layer. Returns a dict with "flops",
    "weight_bytes", "cache_bytes" and "bytes". ``shape`` is a :class:`Transformer` or a name in ``MODELS``.
    """
    shape = _model(shape, "shape")
    context, batch = _count("context", context, 0), _count("batch", batch)
    bytes_per_number = _bytes_per_number(bytes_per_number)
    read_weights = _read_weights(shape)
    weight_bytes = read_weights * bytes_per_number
    cache_bytes = kv_cache_bytes(shape.n_layers, shape.n_kv_heads, shape.d_head, context, bytes_per_number, batch)
    flops = batch * (2 * read_weights + 4 * shape.n_layers * shape.n_heads * shape.d_head * context)
    return {"flops": flops, "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
            "bytes": weight_bytes + cache_bytes}


def decode_attention_intensity(n_heads, n_kv_heads, bytes_per_number=2):
    """FLOPs per byte of cache in a decode step's attention: 2·H / (Hkv · bytes), g = H/Hkv at 2 bytes (chapter 11).

    Each cached token's key and value (2·Hkv·d_head numbers) serve H queries of 4·d_head FLOPs. Batching does
    not raise it: every sequence reads its own cache.
    """
    n_heads, n_kv_heads = _count("n_heads", n_heads), _count("n_kv_heads", n_kv_heads)
    return 2 * n_heads / (n_kv_heads * _bytes_per_number(bytes_per_number))


def decode_memory_bytes(shape, context, *, batch=1, bytes_per_number=2):
    """Bytes a decoding set-up keeps in GPU memory at least: every parameter, and ``batch`` KV caches of
    ``context`` tokens (chapter 11). Activations, workspace and the framework's own reserve come on top."""
    shape = _model(shape, "shape")
    context, batch = _count("context", context, 0), _count("batch", batch)
    bytes_per_number = _bytes_per_number(bytes_per_number)
    cache = kv_cache_bytes(shape.n_layers, shape.n_kv_heads, shape.d_head, context, bytes_per_number, batch)
    return shape.params * bytes_per_number + cache


def decode_fits(shape, device, context, *, batch=1, bytes_per_number=2):
    """Whether :func:`decode_memory_bytes` fits in the GPU's memory, ``gpu(device).hbm_bytes`` (chapter 11)."""
    need = decode_memory_bytes(shape, context, batch=batch, bytes_per_number=bytes_per_number)
    return need <= _gpu(device, "device").hbm_bytes


def max_decode_batch(shape, device, context, *, bytes_per_number=2):
    """The largest batch whose weights and KV caches of ``context`` tokens fit in the GPU's memory; 0 when not
    even the weights and one cache do (chapter 11)."""
    shape, device = _model(shape, "shape"), _gpu(device, "device")
    context = _count("context", context, 0)
    bytes_per_number = _bytes_per_number(bytes_per_number)
    room = device.hbm_bytes - shape.params * bytes_per_number
    per_sequence = kv_cache_bytes(shape.n_layers, shape.n_kv_heads, shape.d_head, context, bytes_per_number)
    if room < 0:
        return 0
    if per_sequence == 0:
        raise ValueError("context=0 caches nothing: any batch fits the cache; the bound is elsewhere")
    return int(room // per_sequence)


def decode_tokens_per_s(shape, device, context, *, batch=1, bytes_per_number=2):
    """The roofline's upper bound on tokens generated per second, all ``batch`` sequences together (chapter 11).

    A prediction from datasheet rates: a real server also pays for kernel launches, the softmax, sampling and
    whatever the kernels leave unused of the bandwidth. A set-up that cannot run is refused with a ValueError
    rather than given a rate: one whose weights and KV caches (:func:`decode_memory_bytes`) exceed the GPU's
    memory (see :func:`max_decode_batch`), or whose context exceeds the model's trained context.
    """
    shape, device = _model(shape, "shape"), _gpu(device, "device")
    context, batch = _count("context", context, 0), _count("batch", batch)
    if context > shape.context:
        raise ValueError(f"context={context} cached tokens exceed {shape.name}'s trained context of {shape.context} "
                         "tokens: its positions past that were never trained")
    need = decode_memory_bytes(shape, context, batch=batch, bytes_per_number=bytes_per_number)
    if need > device.hbm_bytes:
        most = max_decode_batch(shape, device, context, bytes_per_number=bytes_per_number)
        raise ValueError(f"{shape.name} at batch={batch} with {context} cached tokens each needs {need / 1e9:.1f} GB "
                         f"of weights and KV cache, more than the {device.name}'s {device.hbm_bytes / 1e9:.0f} GB: "
                         f"at most batch={most} fits (lib.cost.max_decode_batch)")
    step = decode_step(shape, context, batch=batch, bytes_per_number=bytes_per_number)
    return batch / roofline_seconds(step["flops"], step["bytes"], device)


def cache_outweighs_weights(shape, *, batch=1, bytes_per_number=2):
    """The cached length (tokens per sequence) at which a batch's KV cache holds as many bytes as the weights a
    decode step reads (the layers and the output read-out, as :func:`decode_step` counts them): past it, the
    cache dominates every step's traffic."""
    shape = _model(shape, "shape")
    per_token = kv_cache_bytes(shape.n_layers, shape.n_kv_heads, shape.d_head, 1, _bytes_per_number(
                               bytes_per_number), _count("batch", batch))
    return _read_weights(shape) * bytes_per_number / per_token


def kv_cache_bytes(n_layers, n_kv_heads, d_head, n_tokens, bytes_per_number, batch=1):
    """Bytes of a model's KV cache: 2 (keys and values) · layers · kv heads · d_head · tokens · bytes · batch.

    ``bytes_per_number`` is 2 for float16/bfloat16, 4 for float32, 0.5 for int4 and fractions for formats with
    scales (fp8 with a float16 scale per 32 numbers is 1.0625); the count is an int when it is whole. Grouped-query attention shrinks the cache by
    n_heads / n_kv_heads, since only the key/value heads are cached.
    """
    sizes = {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "d_head": d_head, "batch": batch}
    for name, n in {**sizes, "n_tokens": n_tokens}.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(n).__name__}")
        if n < (0 if name == "n_tokens" else 1):
            raise ValueError(f"{name} must be at least {0 if name == 'n_tokens' else 1}, got {n}")
    b = _bytes_per_number(bytes_per_number)
    return _whole(2 * n_layers * n_kv_heads * d_head * n_tokens * b * batch)


# --------------------------------------------------------------------------------------------------------------
# Chapter 13: what the variants of the formula cache and score. A sliding window caps the cache of its layers at
# `window` tokens and a row's scores at `window`; latent attention caches one latent and one rotary key per token
# for all heads; linear attention keeps a fixed state. Counts, not measurements.
# --------------------------------------------------------------------------------------------------------------


def band_scores(n, window=None):
    """(query, key) scores a causal sliding window of ``window`` keys computes over n tokens (all of them: None).

    Row i scores min(i + 1, window) keys, so the total grows like n · window once n passes the window, against
    n (n + 1) / 2 for the causal mask (:func:`lib.tiles.tile_count` counts the tiles a kernel visits for it).
    """
    n = _count("n", n, 0)
    w = n if window is None else min(n, _count("window", window))
    return w * (w + 1) // 2 + (n - w) * w  # the first w rows fill up, the rest score w keys each


def mla_cache_bytes(n_layers, d_latent, d_rope, n_tokens, bytes_per_number, batch=1):
    """Bytes of a multi-head latent attention cache: layers · (d_latent + d_rope) · tokens · bytes · batch.

    One latent and one decoupled rotary key per token and layer, shared by every head (DeepSeek-V2).
    """
    n_layers, d_latent, d_rope = _count("n_layers", n_layers), _count("d_latent", d_latent), _count("d_rope", d_rope)
    n_tokens, batch = _count("n_tokens", n_tokens, 0), _count("batch", batch)
    return _whole(n_layers * (d_latent + d_rope) * n_tokens * _bytes_per_number(bytes_per_number) * batch)


def windowed_cache_bytes(windows, n_kv_heads, d_head, n_tokens, bytes_per_number, batch=1):
    """Bytes of a KV cache whose layers hold at most their window: ``windows`` has one entry per layer, an int for
    a sliding-window layer (a rolling cache of that many slots) or None for a global layer (every token)."""
    if not windows:
        raise ValueError("windows needs one entry per layer: an int window, or None for a global layer")
    n_tokens = _count("n_tokens", n_tokens, 0)
    kept = [n_tokens if w is None else min(n_tokens, _count("window", w)) for w in windows]
    return sum(kv_cache_bytes(1, n_kv_heads, d_head, k, bytes_per_number, batch) for k in kept)


def linear_state_bytes(n_layers, n_heads, d_head, d_v, bytes_per_number):
    """Bytes of a linear-attention model's recurrent state: per layer and head, a d_head × d_v matrix and a d_head
    normaliser, whatever the number of tokens."""
    sizes = [_count(n, v) for n, v in (("n_layers", n_layers), ("n_heads", n_heads), ("d_head", d_head),
                                       ("d_v", d_v))]
    n_layers, n_heads, d_head, d_v = sizes
    return _whole(n_layers * n_heads * (d_head * d_v + d_head) * _bytes_per_number(bytes_per_number))


# Published configurations (each model's config.json on the Hugging Face Hub, and the papers cited in chapter 13).
# MHA, GQA and MQA are the same cache with as many key/value heads as query heads, a few, or one; "as MHA" is what
# DeepSeek-V3's 128 heads would cache as keys and values of 128 numbers each, the comparison DeepSeek-V2's paper
# makes (its keys are in fact 128 + 64 wide: the cost of MHA is, if anything, understated).
CACHE_CONFIGS = {
    "Llama 2 7B (MHA)": {"n_layers": 32, "n_kv_heads": 32, "d_head": 128},
    "Llama 3 70B (GQA, 8 groups)": {"n_layers": 80, "n_kv_heads": 8, "d_head": 128},
    "Falcon 7B (MQA)": {"n_layers": 32, "n_kv_heads": 1, "d_head": 64},
    "DeepSeek-V3 as MHA": {"n_layers": 61, "n_kv_heads": 128, "d_head": 128},
    "DeepSeek-V3 (MLA)": {"n_layers": 61, "d_latent": 512, "d_rope": 64},
}


def cache_bytes_per_token(config, bytes_per_number=2):
    """Cache bytes one token adds, for a CACHE_CONFIGS entry (or a dict like one): MLA if it has ``d_latent``."""
    if "d_latent" in config:
        return mla_cache_bytes(config["n_layers"], config["d_latent"], config["d_rope"], 1, bytes_per_number)
    return kv_cache_bytes(config["n_layers"], config["n_kv_heads"], config["d_head"], 1, bytes_per_number)
