"""The ladder: each design step of lib.flash timed alone against PyTorch's fused kernel (chapter 9).

    make bench-gpu                                  # the full grid below, on the machine's own Python
    python benchmarks/bench_gpu.py --dtypes bfloat16 --d 64 --sizes 4096 --passes forward
    python benchmarks/bench_gpu.py --sweep --sizes 4096 8192      # every tile configuration of lib.flash, alone
    python benchmarks/bench_gpu.py --csv benchmarks/gpu_results.csv   # also write the figures for chapter 9
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --device cpu --dtypes float32 --d 16 --sizes 20 --reps 1

The rungs are lib.flash.LADDER: the kernel as first written ("first"), then one change at a time, each kept:
the scale folded into the exponent's FMA, the delta term in a Triton kernel, the 5-product backward with dQ summed by
atomic adds, the forward's key and value tiles loaded through tensor descriptors (TMA), and, causal, the heaviest
query blocks launched first (LPT). Beside them run torch's SDPA (the backend it picked at each timed shape is named from the profiler,
with gradients on when the backward is timed, since that can change its choice) and, on request (--impls),
lib.attention and lib.tiled_attention.

Default grid: bfloat16 and float16; batch 4, 16 heads; head size 64 and 128; n = 1,024 to 16,384; causal and not;
forward, and forward + backward. Each implementation is checked against SDPA's output first, warmed up (which lets
Triton tune lib.flash), then timed as GPU time: by default each call is captured in a CUDA graph and replayed
(triton.testing.do_bench_cudagraph), so that Python and launch overhead on the host, tens of microseconds, does
not land inside the measurement at small n; --timer bench uses triton.testing.do_bench (CUDA events around each
call, L2 flushed between calls), --timer events one call between two events. The median is reported, with its
ratio to SDPA's time in the same run.

TFLOP/s count the matrix products only, by the usual convention: forward 4·B·H·n²·d (two products of 2·n²·d),
halved when causal although the diagonal tiles are computed whole; forward + backward 3.5 times that (the backward
counted as 5 products, 2.5 forwards, whether a kernel does 5 or 7). It prints figures; nothing here passes or
fails. Without CUDA it says so and stops, unless TRITON_INTERPRET=1 and --device cpu ask for a smoke run in
Triton's interpreter (wall-clock timing there, figures meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from lib import attention as attn
from lib.speed import gpu_milliseconds, sdpa_backend
from lib.tiles import tiled_attention

RUNGS = ("first", "+fold-scale", "+delta-kernel", "+atomic-dq", "+tma", "+lpt")  # lib.flash.LADDER, in order
IMPLEMENTATIONS = ("sdpa", *RUNGS, "attention", "tiled")
DEFAULT_IMPLS = ("sdpa", *RUNGS)
LABELS = {
    "sdpa": "torch sdpa (fused)",
    **{rung: f"lib.flash_attention {rung}" for rung in RUNGS},
    "attention": "lib.attention (torch)",
    "tiled": "lib.tiled_attention (torch)",
}


def _flash(rung):
    def call(q, k, v, causal):
        from lib import flash

        return flash.flash_attention(q, k, v, causal=causal, variant=flash.LADDER[rung])
    return call


CALLS = {
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    **{rung: _flash(rung) for rung in RUNGS},
    "attention": lambda q, k, v, causal: attn.attention(q, k, v, causal=causal),
    "tiled": lambda q, k, v, causal: tiled_attention(q, k, v, causal=causal),
}


class Timer:
    """GPU time of one call, in ms: CUDA graph replays (graph), do_bench (bench) or two events (events); on the
    CPU smoke run, perf_counter."""

    def __init__(self, device, kind="graph", reps=10):
        self.cuda, self.kind, self.reps = device.type == "cuda", kind, reps
        self.used = kind if self.cuda else "perf_counter"  # what timed the last call

    def __call__(self, fn):
        if not self.cuda:
            self.used = "perf_counter"
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        ms, self.used = gpu_milliseconds(fn, self.kind, self.reps)
        return ms


def flops(B, H, n, d, causal, passes):
    forward = 4 * B * H * n * n * d / (2 if causal else 1)
    return forward * (3.5 if passes == "forward+backward" else 1.0)


def task(name, q, k, v, do, causal, passes):
    """A zero-argument callable running one implementation's forward, or forward and backward."""
    call = CALLS[name]
    if passes == "forward":
        def forward():
            with torch.no_grad():
                return call(q, k, v, causal)
        return forward
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def both():
        for x in leaves:
            x.grad = None
        call(*leaves, causal).backward(do)
    return both


def run_shape(args, dtype, d, n, causal, passes, device, timer, writer, header):
    B, H = args.batch, args.heads
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, n, d, device=device, dtype=dtype, generator=g) for _ in range(4))
    reference = CALLS["sdpa"](q, k, v, causal).float()
    backend = sdpa_backend(q, k, v, causal, grad=passes == "forward+backward")
    print(f"  {n:>6}  sdpa runs {backend}")
    tasks, notes = {}, {}
    for name in args.impls:
        try:
            error = (CALLS[name](q, k, v, causal).float() - reference).abs().max().item()
            fn = task(name, q, k, v, do, causal, passes)
            fn()  # warm-up; Triton tunes lib.flash here
        except torch.OutOfMemoryError:
            notes[name] = "out of memory"
            torch.cuda.empty_cache()
            continue
        tasks[name], notes[name] = fn, f"max |out - sdpa| {error:.1e}"
    times, timed_by = {name: [] for name in tasks}, {}
    for _ in range(args.reps if not timer.cuda or timer.kind == "events" else 1):
        for name, fn in tasks.items():  # interleaved, so that clock and temperature drift touch all alike
            times[name].append(timer(fn))
            timed_by[name] = timer.used
    work = flops(B, H, n, d, causal, passes)
    base = statistics.median(times["sdpa"]) if "sdpa" in times else None
    for name in args.impls:
        if name not in times:
            print(f"  {n:>6}  {LABELS[name]:<30} {notes[name]}")
            continue
        ms = statistics.median(times[name])
        ratio = f"{ms / base:6.2f}x" if base else "      "
        print(f"  {n:>6}  {LABELS[name]:<30} {ms:9.3f} ms  {work / ms / 1e9:7.1f} TFLOP/s  {ratio}  {notes[name]}")
        if writer:
            writer.writerow({**header, "timer": timed_by[name], "dtype": str(dtype).removeprefix("torch."),
                             "causal": causal, "d": d, "n": n, "pass": passes, "impl": name,
                             "backend": backend if name == "sdpa" else "triton", "ms": round(ms, 4),
                             "tflops": round(work / ms / 1e9, 1)})


def sweep(args, device, timer):
    """Every tile configuration of lib.flash, forced one at a time, forward and backward kernels apart."""
    from triton.runtime.errors import OutOfResources

    from lib import flash

    for dtype in args.dtypes:
        for d in args.d:
            for n in args.sizes:
                for causal in args.causal:
                    B, H = args.batch, args.heads
                    q, k, v, do = (torch.randn(B * H, n, d, device=device, dtype=dtype) for _ in range(4))
                    scale = d**-0.5
                    o, lse = flash._forward(q, k, v, causal, scale)
                    print(f"{dtype} d {d} n {n} causal {causal}")
                    kinds = (("forward", flash.FORWARD_TILES),
                             ("backward dK/dV + atomic dQ", flash.BACKWARD_KV_ATOMIC_TILES),
                             ("backward dK/dV, deterministic", flash.BACKWARD_KV_TILES),
                             ("backward dQ, deterministic", flash.BACKWARD_Q_TILES))
                    for kind, choices in kinds:
                        for tiles in (t for t in choices if d <= t.max_head):  # the tuner's offer at this d
                            if kind == "forward":
                                fn = functools.partial(flash._forward, q, k, v, causal, scale, tiles=tiles)
                            elif kind.endswith("atomic dQ"):
                                fn = functools.partial(flash._backward, q, k, v, o, lse, do, causal, scale,
                                                       tiles=tiles)
                            elif "dK/dV" in kind:  # the dQ kernel's own choice left to the tuner
                                fn = functools.partial(flash._backward, q, k, v, o, lse, do, causal, scale,
                                                       tiles=tiles, variant=flash.DETERMINISTIC)
                            else:
                                fn = functools.partial(flash._backward, q, k, v, o, lse, do, causal, scale,
                                                       q_tiles=tiles, variant=flash.DETERMINISTIC)
                            try:
                                fn()
                                ms = statistics.median(timer(fn) for _ in range(args.reps))
                            except OutOfResources as err:  # a tile too large for this GPU's on-chip memory
                                print(f"  {kind:<30} {tiles}: {err}")
                                continue
                            factor = 1.0 if kind == "forward" else 2.5
                            tflops = flops(B, H, n, d, causal, "forward") * factor / ms / 1e9
                            print(f"  {kind:<30} {tiles}: {ms:8.3f} ms  {tflops:6.1f} TFLOP/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--d", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--passes", nargs="+", default=["forward", "forward+backward"],
                        choices=["forward", "forward+backward"])
    parser.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=IMPLEMENTATIONS)
    parser.add_argument("--timer", default="graph", choices=["graph", "bench", "events"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--csv", help="also write every figure to this CSV file (chapter 9 plots it)")
    parser.add_argument("--sweep", action="store_true", help="time each of lib.flash's tile configurations")
    args = parser.parse_args()
    args.dtypes = [getattr(torch, name) for name in args.dtypes]
    args.causal = [c == "true" for c in args.causal]
    if "sdpa" not in args.impls:
        args.impls.insert(0, "sdpa")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("No CUDA GPU here: this benchmark measures the GPU paths. Run it on a machine with one (make bench-gpu).")
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs lib.flash in Triton's interpreter: set TRITON_INTERPRET=1 (a smoke run only)")

    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    header = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda or "none", "date": datetime.date.today().isoformat()}
    print(", ".join(f"{k} {v}" for k, v in header.items()) + f"; batch {args.batch}, {args.heads} heads")
    timer = Timer(device, args.timer, args.reps)
    if args.sweep:
        sweep(args, device, timer)
        return
    with open(args.csv, "w", newline="") if args.csv else contextlib.nullcontext() as out:
        writer = None
        if out:
            fields = [*header, "timer", "dtype", "causal", "d", "n", "pass", "impl", "backend", "ms", "tflops"]
            writer = csv.DictWriter(out, fieldnames=fields)
            writer.writeheader()
        for dtype in args.dtypes:
            for d in args.d:
                for causal in args.causal:
                    for passes in args.passes:
                        print(f"\n{str(dtype).removeprefix('torch.')}, d {d}, {'causal' if causal else 'full'}, "
                              f"{passes}, timed by {timer.used}")
                        for n in args.sizes:
                            run_shape(args, dtype, d, n, causal, passes, device, timer, writer, header)


if __name__ == "__main__":
    main()
