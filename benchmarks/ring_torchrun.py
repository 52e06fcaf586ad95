"""Ring and all-to-all attention across real ranks, checked against attention on one device (chapter 12).

For readers with two or more GPUs (NCCL, one GPU a rank):

    torchrun --standalone --nproc-per-node=2 benchmarks/ring_torchrun.py
    torchrun --standalone --nproc-per-node=8 benchmarks/ring_torchrun.py --seq-len 65536 --dtype bfloat16

and on CPU processes (gloo), as CI-sized smoke test:

    torchrun --standalone --nproc-per-node=2 benchmarks/ring_torchrun.py --backend gloo --seq-len 256 --heads 4 --head-dim 16

Every rank builds the same q, k, v from one seed and takes its shard. For each scheme ("ring" in the contiguous and
zigzag layouts, "ulysses") and each mask (causal and not) it runs the forward and backward pass, gathers every
rank's output and gradients on rank 0 and compares them with SDPA over the whole sequence on rank 0's device, the
single-device result. It prints the largest differences, the median wall time of a forward + backward pass over
``--repeats`` runs after one warm-up (each run ends with a barrier, so the time is the slowest rank's), and the bytes each rank sent
against :func:`lib.ring.sent_bytes_per_rank` (the ring sends half precision as float32, the dtype
it computes in; the all-to-alls send the caller's dtype). Only rank 0 prints. This library's ring computes each block with
the matrix form of :mod:`lib.merge` in float32, so it shows the algorithm and its communication, not the speed of
a fused kernel; compare schemes with each other, not with FlashAttention.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from lib import ring

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--seq-len", type=int, default=8192, help="whole sequence length N (a multiple of 2 x ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="a multiple of the rank count, for ulysses")
    p.add_argument("--head-dim", type=int, default=64, help="head size E = Ev")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def sent_itemsize(scheme, dtype):
    """Bytes per number on the wire: the ring sends its float32 compute copies of half-precision blocks."""
    if scheme == "ring" and dtype in (torch.float16, torch.bfloat16):
        return 4
    return dtype.itemsize


def gather(x, world_size):
    """Every rank's shard of x, in rank order, on every rank."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous())
    return parts


def run(scheme, layout, causal, q, k, v, dout, rank, P, device):
    """This rank's output and gradients, and the bytes it sent, for one forward + backward pass."""
    xs = [ring.shard(x, rank, P, layout).to(device).requires_grad_() for x in (q, k, v)]
    ring.reset_bytes_sent()
    if scheme == "ring":
        out = ring.ring_attention(*xs, causal=causal, layout=layout)
    else:
        out = ring.ulysses_attention(*xs, causal=causal)
    out.backward(ring.shard(dout, rank, P, layout).to(device))
    return [out.detach()] + [x.grad for x in xs], ring.bytes_sent()


def main():
    args = parse()
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))

    if rank == 0:
        print(f"{P} ranks on {backend}, {device.type}; torch {torch.__version__}; "
              f"{datetime.date.today().isoformat()}")
        if device.type == "cuda":
            print(f"GPU: {torch.cuda.get_device_name(device)}")
        print(f"q, k, v {shape} {args.dtype}; errors against SDPA over the whole sequence on one device\n")
        print(f"{'scheme':<18} {'causal':<7} {'max |out|':>10} {'max |dq|':>10} {'max |dk|':>10} {'max |dv|':>10} "
              f"{'ms fwd+bwd':>11} {'MiB sent':>9} {'formula':>9}")
    for scheme, layout in (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous")):
        for causal in (False, True):
            times = []
            run(scheme, layout, causal, q, k, v, dout, rank, P, device)  # warm-up, untimed
            for _ in range(args.repeats):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                results, sent = run(scheme, layout, causal, q, k, v, dout, rank, P, device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                times.append(time.perf_counter() - start)
            whole = [ring.unshard(gather(x, P), layout) for x in results]  # (B, H, N, E) on every rank
            if rank == 0:
                ref = [x.to(device).clone().requires_grad_() for x in (q, k, v)]  # q, k, v stay leaves
                out = F.scaled_dot_product_attention(*ref, is_causal=causal)
                out.backward(dout.to(device))
                errs = [float((a.float() - b.float()).abs().max()) for a, b in
                        zip(whole, [out.detach()] + [x.grad for x in ref])]
                formula = ring.sent_bytes_per_rank(scheme, args.seq_len, P, batch_heads=args.batch * args.heads,
                                                   E=args.head_dim, itemsize=sent_itemsize(scheme, dtype),
                                                   backward=True)
                name = f"{scheme} {layout}" if scheme == "ring" else scheme
                print(f"{name:<18} {causal!s:<7} " + " ".join(f"{e:>10.2e}" for e in errs)
                      + f" {statistics.median(times) * 1e3:>11.1f} {sent / 2**20:>9.3f} {formula / 2**20:>9.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
