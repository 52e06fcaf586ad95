"""The SM clock a GPU holds under a long bfloat16 matrix product, sampled by nvidia-smi while it runs.

Chapter 8 prices every unit of the SM at one clock; the datasheet's tensor rate assumes 1.83 GHz on an H100, and a
GPU at its power limit runs slower. This prints the matrix product's TFLOP/s and the clock it ran at (median, min,
max of the samples), with the power drawn and nvidia-smi's clock event reasons (0x4: the software power cap):

    python benchmarks/clock_under_load.py [--seconds 20] [--n 8192]

Needs a CUDA GPU and nvidia-smi. benchmarks/gpu_logs/2026-11-28_h200_clock_under_load.txt is one run.
"""

import argparse
import statistics
import subprocess
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to keep the tensor cores busy")
    parser.add_argument("--n", type=int, default=8192, help="the matrices are n x n, bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this measures a GPU's clock under load")
    query = "clocks.sm,power.draw,clocks_event_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "200"],
                           stdout=subprocess.PIPE, text=True)
    a, b = (torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):  # warm-up
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began, calls = time.perf_counter(), 0
    start.record()
    while time.perf_counter() - began < args.seconds:
        for _ in range(20):
            a @ b
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    smi.terminate()
    rows = [line.split(", ") for line in smi.stdout.read().strip().splitlines()]
    clocks = [float(row[0]) for row in rows[5:-2]]  # leave out the warm-up and the wind-down
    n = args.n
    print("torch", torch.__version__, "cuda", torch.version.cuda)
    print(f"bf16 {n}x{n}x{n} matmul, {calls} calls: {2 * n**3 * calls / seconds / 1e12:.0f} TFLOP/s over "
          f"{seconds:.1f} s")
    print(f"SM clock while it ran (nvidia-smi every 200 ms, {len(clocks)} samples): median "
          f"{statistics.median(clocks):.0f} MHz, min {min(clocks):.0f}, max {max(clocks):.0f}")
    middle = rows[len(rows) // 2]
    print("power W, event reasons (mid-run):", middle[1], middle[2])


if __name__ == "__main__":
    main()
