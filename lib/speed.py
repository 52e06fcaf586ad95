"""How the full matrix is computed fast, apart from what it computes: NumPy on several cores, torch on a GPU.

On a CPU, NumPy runs each kernel on one core, so a large NumPy problem is cut into independent pieces (chunks of
rows, blocks of queries) that a small pool of threads works through; NumPy releases the interpreter lock inside its
kernels. Each worker keeps BLAS to one thread of its own. On a GPU, half-precision inputs stay in half precision
for the matrix products, the scores in float32 for the softmax. This is speed machinery, not part of the
algorithm: :mod:`lib.attention` and :mod:`lib.tiles` compute the same without it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import warnings
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


# --------------------------------------------------------------------------------------------------------------
# Timing on a GPU: lib.flash against PyTorch's fused kernel
# --------------------------------------------------------------------------------------------------------------

TIMERS = ("graph", "bench", "events")


def gpu_milliseconds(fn, timer="graph", reps=10):
    """The GPU time of one call ``fn()`` in ms, and the timer that took it, as ``(ms, timer)``.

    ``graph``: ``fn`` captured in a CUDA graph and replayed (``triton.testing.do_bench_cudagraph``, the median), so
    that the host's Python and launch overhead, tens of microseconds, stays out of the figure; a call that cannot be
    captured is timed by ``bench`` instead. ``bench``: ``triton.testing.do_bench``, CUDA events around each of many
    calls with the L2 cache flushed between them, the median. ``events``: one call between two CUDA events. Both
    Triton timers warm up first; call ``fn`` once before anyway, since Triton compiles and tunes on a first call.
    """
    import torch

    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}; got {timer!r}")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise ValueError(f"reps must be a positive int; got {reps!r}")
    from triton.testing import do_bench, do_bench_cudagraph

    if timer == "graph":
        try:
            return do_bench_cudagraph(fn, rep=20 * reps, return_mode="median"), "graph"
        except Exception:  # noqa: BLE001  (any capture failure: time it with do_bench)
            timer = "bench"
    if timer == "bench":
        return do_bench(fn, rep=20 * reps, return_mode="median"), "bench"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), "events"


def sdpa_backend(q, k, v, causal, grad=False):
    """The aten operator torch's SDPA dispatches to for these inputs (flash, efficient, cudnn or math), read from
    the profiler, with gradients on when a backward pass is to be timed, since that can change its choice."""
    import torch
    import torch.nn.functional as F

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch 2.11 warns that the profiler clears its events
        with torch.profiler.profile() as prof, torch.set_grad_enabled(grad):
            leaves = [x.detach().requires_grad_(grad) for x in (q, k, v)]
            F.scaled_dot_product_attention(*leaves, is_causal=causal)
        events = prof.events()
    names = [e.name for e in events if e.name.startswith("aten::_scaled_dot_product")]
    names += [e.name for e in events if e.name.startswith("aten::_") and "attention" in e.name]
    return names[0].removeprefix("aten::") if names else "unknown"


@dataclasses.dataclass(frozen=True)
class SpeedRun:
    """The forward times of lib.flash's default kernel and of SDPA at one shape on one GPU (chapter 9): median ms
    each, the machine and the versions. ``ratio`` is the kernel's time over SDPA's; above 1 means slower."""

    device: str
    torch: str
    triton: str
    date: str
    dtype: str
    batch: int
    heads: int
    n: int
    d: int
    causal: bool
    flash_ms: float
    sdpa_ms: float
    sdpa_backend: str
    timer: str

    @property
    def ratio(self):
        return self.flash_ms / self.sdpa_ms

    def lines(self):
        """The run in three lines of at most 88 characters."""
        mask = "causal" if self.causal else "not causal"
        shape = f"batch {self.batch}, {self.heads} heads, n {self.n:,}, d {self.d}, {mask}"
        times = f"flash_attention {self.flash_ms:.3f} ms, SDPA ({self.sdpa_backend}) {self.sdpa_ms:.3f} ms"
        return [f"{self.device}, torch {self.torch}, Triton {self.triton}, {self.date}",
                f"forward, {self.dtype}, {shape}; timer {self.timer}",
                f"{times}: ratio {self.ratio:.2f}"]


def _positive_ints(**sizes):
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int; got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1; got {value}")


def flash_against_sdpa(batch=4, heads=16, n=4096, d=64, causal=False, timer="graph", reps=10, rounds=3):
    """Time lib.flash's forward kernel against torch's SDPA on this machine's GPU, side by side: a ``SpeedRun``.

    Inputs are (batch, heads, n, d) in the half precision this GPU multiplies on its tensor cores (``half_dtype``).
    Each is checked against SDPA first (that first call also lets Triton compile and tune the kernel), then the two
    are timed in turn ``rounds`` times (``gpu_milliseconds``, so that drift in clock or temperature touches both),
    and the median of each is kept. Without a CUDA GPU it raises: there is nothing to time.
    """
    import datetime

    import torch
    import torch.nn.functional as F

    _positive_ints(batch=batch, heads=heads, n=n, d=d, reps=reps, rounds=rounds)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}; got {timer!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("flash_against_sdpa times a CUDA GPU, and there is none here")
    import triton

    from lib import flash

    dtype = half_dtype("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    calls = {"flash": lambda: flash.flash_attention(q, k, v, causal=causal),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    times, used = {name: [] for name in calls}, set()
    with torch.no_grad():
        torch.testing.assert_close(calls["flash"](), calls["sdpa"](), rtol=2e-2, atol=2e-2)
        for _ in range(rounds):
            for name, fn in calls.items():
                ms, how = gpu_milliseconds(fn, timer, reps)
                times[name].append(ms)
                used.add(how)
    return SpeedRun(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), dtype=str(dtype).removeprefix("torch."), batch=batch,
                    heads=heads, n=n, d=d, causal=causal, flash_ms=statistics.median(times["flash"]),
                    sdpa_ms=statistics.median(times["sdpa"]),
                    sdpa_backend=sdpa_backend(q, k, v, causal).removeprefix("_scaled_dot_product_"),
                    timer="+".join(sorted(used)))


def recorded_flash_against_sdpa(path, n=4096, d=64, causal=False, dtype="bfloat16", batch=4, heads=16):
    """The same comparison as ``flash_against_sdpa``, read from a CSV that ``benchmarks/bench_gpu.py --csv`` wrote
    (``benchmarks/gpu_results.csv``): the forward rows of SDPA and of the ladder's default rung, ``+atomic-dq``
    (``lib.flash.DEFAULT``), at this shape. The CSV does not record batch and heads: pass those of the run, by
    default bench_gpu.py's own, batch 4 and 16 heads. Raises ValueError when the file has no such pair."""
    import csv

    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["pass"] == "forward" and r["ms"]
                and (r["n"], r["d"], r["causal"], r["dtype"]) == (str(n), str(d), str(causal), dtype)]
    found = {r["impl"]: r for r in rows if r["impl"] in ("sdpa", "+atomic-dq")}
    if len(found) != 2:
        raise ValueError(f"{path} has no forward pair of sdpa and +atomic-dq at n {n}, d {d}, causal {causal}, "
                         f"{dtype}")
    ours, theirs = found["+atomic-dq"], found["sdpa"]
    return SpeedRun(device=ours["device"], torch=ours["torch"], triton=ours["triton"], date=ours["date"],
                    dtype=dtype, batch=batch, heads=heads, n=n, d=d, causal=causal, flash_ms=float(ours["ms"]),
                    sdpa_ms=float(theirs["ms"]), sdpa_backend=theirs["backend"].removeprefix("_scaled_dot_product_"),
                    timer=ours["timer"])
