"""Chapter 9's timing cell, on a GPU: lib.flash's forward kernel against torch's SDPA at the chapter's shape.

    python benchmarks/gpu_chapter9.py                 # bfloat16 (float16 below sm_80), batch 4, 16 heads, n 4,096, d 64
    python benchmarks/gpu_chapter9.py --n 16384 --d 128 --causal

It prints the device, the torch and Triton versions, both medians and the ratio (lib.speed.flash_against_sdpa),
then the figure that benchmarks/gpu_results.csv records at the same shape, for comparison. Triton compiles and
tunes the kernel on its first call, which takes most of the run (well under a minute on an H100 or H200).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from lib.speed import flash_against_sdpa, recorded_flash_against_sdpa


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--timer", default="graph", choices=["graph", "bench", "events"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("No CUDA GPU here: this script times one (chapter 9 shows the recorded run instead).")
    import triton

    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"Triton {triton.__version__}")
    start = time.perf_counter()
    run = flash_against_sdpa(args.batch, args.heads, args.n, args.d, args.causal, timer=args.timer)
    print(*run.lines(), sep="\n")
    print(f"({time.perf_counter() - start:.0f} s, Triton's tuning included)")
    try:
        recorded = recorded_flash_against_sdpa(ROOT / "benchmarks" / "gpu_results.csv", args.n, args.d, args.causal,
                                               run.dtype, args.batch, args.heads)
    except ValueError as err:
        print(f"nothing recorded to compare with: {err}")
        return
    print("recorded in benchmarks/gpu_results.csv:")
    print(*(f"  {line}" for line in recorded.lines()), sep="\n")


if __name__ == "__main__":
    main()
