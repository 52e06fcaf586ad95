"""The kernel lab (lib.lab) on a CUDA GPU: grade a lab kernel compiled by Triton, then time it against SDPA.

    python benchmarks/gpu_lab.py FILE.py:KERNEL [--seed 7] [--n 1024 4096] [--d 64 128] [--blocks 64x64 128x64]

FILE.py defines KERNEL, a @triton.jit function with the lab's signature (lib.lab's docstring). The grade runs the
value steps (output, logsumexp, causal) on the hidden shapes of --seed, compiled for this GPU; the byte steps are
counted only in Triton's interpreter and say so. Then, for each size, head size and tile shape, the kernel and
PyTorch's SDPA are timed side by side on the same float16 inputs (batch·heads 32; Triton's do_bench medians), causal
and not, and the ratio printed. Nothing here is a test: it prints what it measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton

from lib import lab


def load_kernel(spec: str):
    path, _, name = spec.partition(":")
    if not name:
        raise SystemExit("name the kernel as FILE.py:KERNEL")
    module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--blocks", nargs="+", default=["64x64", "128x64"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: grade in the interpreter instead (TRITON_INTERPRET=1, lib.lab.grade)")
    kernel = load_kernel(args.kernel)
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"Triton {triton.__version__}")
    for step in lab.grade(kernel, args.seed):
        print(f"{step.name:<10} {'-' if step.score is None else step.score}  {step.why}")
    print(f"{'n':>6} {'d':>4} {'causal':>6} {'tiles':>7} {'kernel ms':>10} {'SDPA ms':>8} {'SDPA / kernel':>14}")
    for n in args.n:
        for d in args.d:
            for causal in (False, True):
                for blocks in args.blocks:
                    block_m, block_n = (int(b) for b in blocks.split("x"))
                    try:
                        ours, sdpa = lab.time_against_sdpa(kernel, L=n, E=d, causal=causal, block_m=block_m,
                                                           block_n=block_n)
                    except Exception as error:  # noqa: BLE001 - a tile shape that does not fit is reported, not fatal
                        print(f"{n:>6} {d:>4} {causal!s:>6} {blocks:>7}  failed: {type(error).__name__}: "
                              f"{str(error).splitlines()[0][:80]}")
                        continue
                    print(f"{n:>6} {d:>4} {causal!s:>6} {blocks:>7} {ours:>10.3f} {sdpa:>8.3f} {sdpa / ours:>14.2f}")


if __name__ == "__main__":
    main()
