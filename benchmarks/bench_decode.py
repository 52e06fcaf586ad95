"""One decoding step against a long key cache: `flash_decode` (one slice and the default count), SDPA, `flash_attention`.

    python benchmarks/bench_decode.py                       # the grid below, on a CUDA GPU, the machine's own Python
    python benchmarks/bench_decode.py --lengths 131072 --csv benchmarks/decode_results.csv
    python benchmarks/bench_decode.py --smoke               # a tiny run in Triton's interpreter on the CPU (tests)

Default grid: batch 1, 32 query heads sharing 8 key/value heads (grouped-query attention), head size 128, bfloat16,
one new query per head, cache lengths S = 4,096 to 131,072. Implementations:

- ``flash_decode 1 split``: lib.flash_decode with num_splits=1, one program per key/value head (8 programs);
- ``flash_decode auto``: lib.flash_decode with num_splits=None, the count lib.cost.choose_num_splits gives for this
  GPU's SM count (printed);
- ``torch sdpa``: F.scaled_dot_product_attention(..., enable_gqa=True); the backend that ran is named from the
  profiler;
- ``flash_attention``: lib.flash.flash_attention with the 4 query heads of each key/value head packed as 4 query
  rows, q (B, Hkv, 4, d) against k (B, Hkv, S, d): exact for one new query, and no copy of K or V.

Each is timed twice (medians): as GPU time, the call captured in a CUDA graph and replayed
(``triton.testing.do_bench_cudagraph``), as a decoder that replays its step does, so the host's Python and launch
overhead stays out; and as ``triton.testing.do_bench`` times it, between two CUDA events with the L2 cache cleared
before each call, which also counts the time the GPU waits for the host to launch (column "with host"). The
bandwidth is computed from the graph time; at short lengths (S <= 16,384 here: 134 MB or less) the replays may find
part of the cache still in L2, which only a long cache rules out. Decoding is memory-bound: the figure that matters is the
bandwidth achieved, the bytes of keys and values read (lib.cost.decode_bytes) over the time, as a share of the
GPU's datasheet HBM bandwidth (lib.cost.GPUS, chosen from the device name; --gpu to name it). The goal for
flash_decode is 80 % or more at long lengths. Every output is compared with SDPA's. Nothing passes or fails here.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LABELS = {
    "split1": "flash_decode 1 split",
    "auto": "flash_decode auto",
    "sdpa": "torch sdpa",
    "flash": "flash_attention",
}


def parse():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--queries", type=int, default=1, help="new queries per head (L)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--impls", nargs="+", default=list(LABELS), choices=list(LABELS))
    parser.add_argument("--gpu", help="name in lib.cost.GPUS whose HBM bandwidth is the peak (default: from the device)")
    parser.add_argument("--csv", help="also write every figure to this CSV file")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes in Triton's interpreter on the CPU: checks the script, measures nothing")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.heads, args.kv_heads, args.d, args.dtype = [200], 4, 2, 16, "float32"
    return args


def gpu_entry(cost, name, chosen):
    """The lib.cost datasheet for this device, or None when the name does not say which (a PCIe card, say)."""
    if chosen:
        return cost.gpu(chosen)
    if "PCIe" in name or "NVL" in name:  # same chip name, different memory: not the SXM datasheet
        return None
    for key, entry in cost.GPUS.items():
        if key in name:
            return entry
    return None


def main():
    args = parse()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before torch or lib import Triton
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F
    import triton

    from lib import cost
    from lib import flash_decode as fd
    from lib.flash import flash_attention

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("No CUDA GPU here: this benchmark measures GPU kernels. Run it on a machine with one, or try --smoke.")
        return
    if device.type == "cpu" and not fd.INTERPRETED:
        sys.exit("--smoke runs in Triton's interpreter, but Triton was imported before TRITON_INTERPRET was set")
    dtype = getattr(torch, args.dtype)
    B, H, Hkv, d, L = args.batch, args.heads, args.kv_heads, args.d, args.queries
    G = H // Hkv
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    entry = gpu_entry(cost, name, args.gpu)
    peak = entry.hbm_bytes_per_s if entry else None
    header = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda or "none", "date": datetime.date.today().isoformat()}
    print(", ".join(f"{k} {v}" for k, v in header.items()))
    print(f"batch {B}, {H} query heads, {Hkv} key/value heads, d {d}, {args.dtype}, {L} new quer{'y' if L == 1 else 'ies'}"
          f" per head; {sms or cost.gpu(fd.DEFAULT_GPU).sms} SMs for the split rule; peak HBM {'unknown' if peak is None else f'{peak / 1e12:.2f} TB/s ({entry.name} datasheet)'}"
          + ("; smoke run: timings mean nothing" if args.smoke else ""))

    def timed(fn):
        """(GPU time of a graph replay, time between events around a launch from the host), in ms."""
        if device.type == "cuda":
            return (triton.testing.do_bench_cudagraph(fn, return_mode="median"),
                    triton.testing.do_bench(fn, return_mode="median"))
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms

    def sdpa_backend(q, k, v, mask):
        with torch.profiler.profile() as prof:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        names = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
        names += [e.name for e in prof.events() if e.name.startswith("aten::_") and "attention" in e.name]
        return names[0].removeprefix("aten::") if names else "unknown"

    def setup(S):
        """The inputs at cache length S and a zero-argument call of each implementation on them."""
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, H, L, d, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(B, Hkv, S, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        mask = None
        if L > 1:  # the new queries are the last L tokens: bottom-right causal
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(L, S)._materialize(device=device)
        auto = fd.split_count(B, H, L, Hkv, S, sms=sms)
        calls = {
            "split1": (lambda: fd.flash_decode(q, k, v, num_splits=1), 1),
            "auto": (lambda: fd.flash_decode(q, k, v), auto),
            "sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), None),
        }
        if L == 1:  # packed heads are exact only for one query per head (no causal corner)
            calls["flash"] = (lambda: flash_attention(q.view(B, Hkv, G, d), k, v).view(B, H, 1, d), None)
        return calls, mask, q, k, v

    writer = None
    out_file = open(args.csv, "w", newline="") if args.csv else None  # noqa: SIM115 (closed below)
    if out_file:
        writer = csv.DictWriter(out_file, fieldnames=[*header, "dtype", "B", "H", "Hkv", "d", "L", "S", "impl",
                                                      "splits", "ms", "ms_with_host", "gb_per_s", "share_of_peak",
                                                      "max_err"])
        writer.writeheader()
    print(f"\n{'S':>7}  {'implementation':<22} {'splits':>6} {'programs':>8} {'ms':>9} {'with host':>9} {'GB/s':>8} {'% peak':>7}  "
          "max |out - sdpa|")
    try:
        for S in args.lengths:
            calls, mask, q, k, v = setup(S)
            with torch.no_grad():
                reference = calls["sdpa"][0]().float()
                backend = sdpa_backend(q, k, v, mask)
                nbytes = cost.decode_bytes(B, Hkv, S, d, d, q.element_size())
                for impl in args.impls:
                    if impl not in calls:
                        continue
                    fn, splits = calls[impl]
                    error = (fn().float() - reference).abs().max().item()
                    runs = [timed(fn) for _ in range(1 if args.smoke else 3)]
                    ms, ms_host = (statistics.median(r[i] for r in runs) for i in (0, 1))
                    rate = nbytes / (ms / 1e3)
                    share = rate / peak if peak else None
                    programs = "" if splits is None else B * Hkv * splits
                    print(f"{S:>7}  {LABELS[impl]:<22} {splits or '':>6} {programs:>8} {ms:9.4f} {ms_host:9.4f} "
                          f"{rate / 1e9:8.1f} "
                          f"{'' if share is None else f'{100 * share:6.1f}%':>7}  {error:.1e}")
                    if impl == "sdpa":
                        print(f"{'':>9}(sdpa ran {backend})")
                    if writer:
                        writer.writerow({**header, "dtype": args.dtype, "B": B, "H": H, "Hkv": Hkv, "d": d, "L": L,
                                         "S": S, "impl": impl, "splits": splits or "", "ms": round(ms, 5),
                                         "ms_with_host": round(ms_host, 5),
                                         "gb_per_s": round(rate / 1e9, 1),
                                         "share_of_peak": "" if share is None else round(share, 3),
                                         "max_err": f"{error:.2e}"})
    finally:
        if out_file:
            out_file.close()


if __name__ == "__main__":
    main()
