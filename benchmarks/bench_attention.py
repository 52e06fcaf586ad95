"""Speed and peak memory of lib.attention and lib.tiled_attention against PyTorch's fused kernel.

    make bench                                   # CPU, float32, one head, d = 64, n = 1,024 ... 16,384
    .venv/bin/python benchmarks/bench_attention.py --sizes 4096 --reps 9
    .venv/bin/python benchmarks/bench_attention.py --torch-paths   # also the library's torch paths on CPU
    python benchmarks/bench_attention.py --device cuda --dtype bfloat16 float32 --sizes 1024 4096 16384

Every implementation runs on the same inputs, interleaved (A, B, C, A, B, C, ...) after one warm-up each, so a
machine that slows down mid-run slows all of them alike; the figure reported is the median. Thread pools such as
PyTorch's OpenMP threads, or OpenBLAS's when it runs threaded, keep spinning for a while after a call, so
interleaving times each implementation partly while its predecessor's threads still hold a core; --settle SECONDS
pauses before each timed call to show how much of a ratio that accounts for (see results.md). Ratios are to
PyTorch's `scaled_dot_product_attention` measured in the same run, and each output is compared with its output.
Peak memory is measured beyond the inputs and the output. On CPU each implementation runs once more in a fresh
process, with glibc told to hand large blocks back to the system at once (so freed memory cannot hide a peak), and
the rise of the resident-set high-water mark (Linux VmHWM, reset before the call) is its peak; timings come from
the normal process, where glibc's usual reuse of freed blocks applies. On CUDA, torch.cuda.max_memory_allocated.
It prints figures; nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from lib import attention as attn
from lib.tiles import tiled_attention

MiB = 1 << 20


def _status(field):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_peak(fn):
    """(seconds, bytes): one call's time, and its peak resident memory above where it started."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before
    del out
    return seconds, peak


def cuda_peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return start.elapsed_time(end) / 1000, peak


def implementations(n, d, device, dtype, seed=0, torch_paths=True):
    """{name: zero-argument callable}, all on the same q, k, v of shape (batch 1, heads 1, n, d).

    On CPU in float32 the NumPy paths run; the library's torch paths run on CUDA, and on CPU with torch_paths.

    Four dimensions matter: given three, PyTorch's CPU dispatcher skips its fused flash kernel for the plain
    matrix-form math, which is slower and holds the n × n matrix.
    """
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    torch_dtype = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(x).to(device=device, dtype=torch_dtype) for x in (q, k, v))
    impls = {"torch sdpa (fused)": lambda: F.scaled_dot_product_attention(tq, tk, tv)}
    if device == "cpu" and dtype == "float32":
        impls["lib.attention (numpy)"] = lambda: attn.attention(q, k, v)
        impls["lib.tiled_attention (numpy)"] = lambda: tiled_attention(q, k, v)
    if torch_paths or device != "cpu":
        impls["lib.attention (torch)"] = lambda: attn.attention(tq, tk, tv)
        impls["lib.tiled_attention (torch)"] = lambda: tiled_attention(tq, tk, tv)
    return impls, (tq, tk, tv)


def check_agreement(impls):
    """Every implementation's output against the fused kernel's, so a fast wrong answer cannot slip by."""
    reference = impls["torch sdpa (fused)"]().float().cpu().numpy()
    errors = {}
    for name, fn in impls.items():
        out = fn()
        out = out.float().cpu().numpy() if isinstance(out, torch.Tensor) else out
        errors[name] = float(np.abs(out - reference).max())
    return errors


def peak_in_fresh_process(name, n, d, dtype):
    """Peak memory of one implementation, measured in a new process whose glibc returns freed blocks at once."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    cmd = [sys.executable, __file__, "--peak-of", name, "--sizes", str(n), "--d", str(d), "--dtype", dtype]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def bench(n, d, device, dtype, reps, skip, settle, torch_paths):
    impls, _ = implementations(n, d, device, dtype, torch_paths=torch_paths)
    impls = {k: f for k, f in impls.items() if not any(s in k for s in skip)}
    measure = cuda_peak if device == "cuda" else cpu_peak
    errors = check_agreement(impls)
    times = {name: [] for name in impls}
    peaks = {name: [] for name in impls}
    for fn in impls.values():
        measure(fn)  # warm-up
    for _ in range(reps):
        for name, fn in impls.items():
            time.sleep(settle)
            seconds, peak = measure(fn)
            times[name].append(seconds)
            peaks[name].append(peak)
    if device == "cpu":
        peaks = {name: [peak_in_fresh_process(name, n, d, dtype)] for name in impls}
    out_bytes = n * d * torch.finfo(getattr(torch, dtype)).bits // 8
    base = statistics.median(times["torch sdpa (fused)"])
    rows = []
    for name in impls:
        t = statistics.median(times[name])
        extra = max(0, min(peaks[name]) - out_bytes)
        rows.append((name, t, t / base, extra, errors[name]))
    return rows


def machine(device):
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), NumPy {np.__version__}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--skip", nargs="*", default=[], help="leave out implementations whose name contains this")
    parser.add_argument(
        "--torch-paths", action="store_true", help="on CPU, also time the library's torch paths (always on CUDA)"
    )
    parser.add_argument("--settle", type=float, default=0.0, help="seconds to pause before each timed call")
    parser.add_argument(
        "--memory-only", type=int, metavar="N", help="only the NumPy tiled path's peak memory at this n, float32"
    )
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)  # internal: one implementation's peak, in bytes
    args = parser.parse_args()
    if args.peak_of:
        impls, _ = implementations(args.sizes[0], args.d, "cpu", args.dtype[0])
        print(cpu_peak(impls[args.peak_of])[1])
        return
    print(f"machine: {machine(args.device)}")
    if args.memory_only:
        n = args.memory_only
        seconds = cpu_peak(implementations(n, args.d, "cpu", "float32")[0]["lib.tiled_attention (numpy)"])[0]
        extra = peak_in_fresh_process("lib.tiled_attention (numpy)", n, args.d, "float32") - n * args.d * 4
        print(f"lib.tiled_attention (numpy), n = {n:,}, d = {args.d}, float32: {seconds:.2f} s, "
              f"peak beyond inputs and output {extra / MiB:.1f} MiB (the score matrix alone: {n * n * 4 / MiB:,.0f} MiB)")
        return
    for dtype in args.dtype:
        print(f"\n{args.device}, {dtype}, one head, d = {args.d}, median of {args.reps} interleaved runs, "
              f"{args.settle} s pause before each")
        print(f"{'n':>7}  {'implementation':<30} {'time (ms)':>10} {'÷ sdpa':>8} {'peak extra (MiB)':>17} "
              f"{'max |Δ| vs sdpa':>16}")
        for n in args.sizes:
            for name, t, ratio, extra, error in bench(
                n, args.d, args.device, dtype, args.reps, args.skip, args.settle, args.torch_paths
            ):
                print(f"{n:>7,}  {name:<30} {t * 1e3:>10.1f} {ratio:>8.2f} {extra / MiB:>17.1f} {error:>16.1e}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
