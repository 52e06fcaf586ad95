"""What lib.flash's and lib.flash_decode's kernels compile to on each GPU Colab offers, read on a machine without
a GPU (chapter 9): a T4 (sm_75), an A100 (sm_80), an L4 (sm_89) and an H100 (sm_90).

    python tools/compile_report.py                       # sm_90: every tile choice, head sizes 64 and 128
    python tools/compile_report.py --arch sm_75 sm_89    # the tile tables of other architectures
    python tools/compile_report.py --head 128 --loop     # also the skeleton of each kernel's inner loop
    python tools/compile_report.py --markdown            # the table benchmarks/results.md shows
    python tools/compile_report.py --arch all --json     # every architecture, as JSON
    python tools/compile_report.py --window 256          # lib.flash with chapter 13's sliding window

Each kernel is compiled as Triton's JIT specialises a real launch on that architecture: the wrapper in lib/flash.py
(or lib/flash_decode.py) is run on "meta" tensors (shapes and strides, no memory) of a contiguous problem in the
dtype a chapter uses there (bfloat16; float16 on sm_75, whose tensor cores have no bfloat16 products), the arguments
it would launch with are caught, and each is typed by Triton's own specialisation rule (an int equal to 1, such as
the stride of the last dimension, becomes a constant; ints and pointers divisible by 16 are marked so). Compiled
with plain int32 strides and no such marks, the same kernel would use scalar 2-byte loads and a fraction of the
shared memory: a kernel that never runs. Triton's wheel ships ptxas and cuobjdump: registers and spills come from
ptxas's own report (-v), and so does its C7515 note (on sm_90, every wgmma waits for the one before); shared
memory from Triton's metadata; where each product runs (wgmma, mma.sync on the tensor cores, or FMA on the CUDA
cores) from Triton's GPU IR; and the loop skeleton from the SASS (cuobjdump). Compiled, not run: nothing here says
how fast a kernel is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import sys
from collections import Counter

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_report compiles real kernels: run it with TRITON_INTERPRET unset (or 0)")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default, said aloud to keep Triton quiet

import torch
import triton

TRITON_FLOOR = (3, 6)  # triton.knobs and native_specialize_impl, which the compile below relies on
if tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) < TRITON_FLOOR:
    sys.exit(f"compile_report needs Triton >= {'.'.join(map(str, TRITON_FLOOR))}; this is {triton.__version__}")

from triton import knobs  # after the version floor: an older Triton lacks it
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget

from lib import flash
from lib import flash_decode as fd
from lib.speed import half_dtype

ARCHS = tuple(flash.TILE_TABLES)  # "sm_75", "sm_80", "sm_89", "sm_90"
REGISTERS_PER_BLOCK = 64 * 1024  # 32-bit registers one thread block may use, on every one of them
SHAPE = {"Z": 64, "L": 4096, "S": 4096}  # batch · heads and lengths of the launch being specialised
DECODE_SHAPE = {"B": 4, "Hkv": 8, "S": 4096, "splits": 4}  # a decode step against a 4,096-token cache


def target(arch):
    """Triton's compile target for "sm_75" and the like."""
    return GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)


def arch_dtype(arch):
    """The dtype a chapter's launch has on this architecture (lib.speed.half_dtype)."""
    return half_dtype(capability=flash.TILE_TABLES[arch].capability)


class _Pointer:
    """A tensor as the specialiser sees it: a dtype and an address (a fresh CUDA allocation is 256-byte aligned)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        return 1 << 20


@dataclasses.dataclass
class Launch:
    kernel: object
    args: tuple
    kwargs: dict


def captured_launches(head, causal, variant, dtype=torch.bfloat16, shape=SHAPE, window=None):
    """{kernel name: Launch} for a forward and a backward pass of lib.flash on a contiguous (Z, L, head) problem
    (with ``window``, chapter 13's sliding window, which needs ``causal``)."""
    Z, L, S = shape["Z"], shape["L"], shape["S"]
    caught = {}

    def catcher(name, kernel):
        def launch(grid, *args, tiles=None, **kwargs):
            caught[name] = Launch(kernel, args, kwargs)
        return launch

    class Indexable:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: caught.__setitem__(self.name, Launch(self.kernel, args, kwargs))

    patches = {
        "_run_forward": catcher("forward", flash._flash_forward),
        "_run_backward_kv_atomic": catcher("backward_kv", flash._flash_backward_kv),
        "_run_backward_kv": catcher("backward_kv_deterministic", flash._flash_backward_kv),
        "_run_backward_q": catcher("backward_q", flash._flash_backward_q),
        "_backward_preprocess": Indexable("preprocess", flash._backward_preprocess),
    }
    saved = {name: getattr(flash, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(flash, name, fn)
        q, k, v, do = (torch.empty(Z, n, head, device="meta", dtype=dtype) for n in (L, S, S, L))
        o, lse = flash._forward(q, k, v, causal, head**-0.5, variant=variant, window=window)
        o = torch.empty(Z, L, head, device="meta", dtype=dtype)
        lse = torch.empty(Z, L, device="meta", dtype=torch.float32)
        flash._backward(q, k, v, o, lse, do, causal, head**-0.5, variant=variant, window=window)
        if variant.atomic_dq:  # the deterministic path's two kernels too, for the table
            deterministic = dataclasses.replace(variant, atomic_dq=False)
            flash._backward(q, k, v, o, lse, do, causal, head**-0.5, variant=deterministic, window=window)
    finally:
        for name, fn in saved.items():
            setattr(flash, name, fn)
    return caught


def decode_launches(head, rows, dtype, paged=False, shape=DECODE_SHAPE):
    """{kernel name: Launch} for one lib.flash_decode step whose key/value heads each serve ``rows`` query rows
    (G · L packed into one tile): the split kernel and the merge, over a contiguous (or paged) cache."""
    B, Hkv, S, splits = shape["B"], shape["Hkv"], shape["S"], shape["splits"]
    caught = {}

    class Indexable:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: caught.__setitem__(self.name, Launch(self.kernel, args, kwargs))

    saved = fd._decode_split, fd._decode_merge
    try:
        fd._decode_split = Indexable("decode_paged" if paged else "decode", saved[0])
        fd._decode_merge = Indexable("decode_merge", saved[1])
        q = torch.empty(B, Hkv * rows, 1, head, device="meta", dtype=dtype)  # one new query a head: G = rows
        out = torch.empty_like(q)
        if paged:
            page = 16
            pages = B * S // page
            k = torch.empty(pages, Hkv, page, head, device="meta", dtype=dtype)
            table = torch.empty(B, S // page, device="meta", dtype=torch.int32)
            lens = torch.empty(B, device="meta", dtype=torch.int32)
            fd._launch(q, k, k, out, splits, head**-0.5, direct=False, paged=(table, lens, page),
                       tiles=fd.GPU_TILES)
        else:
            k = torch.empty(B, Hkv, S, head, device="meta", dtype=dtype)
            fd._launch(q, k, k, out, splits, head**-0.5, direct=False, tiles=fd.GPU_TILES)
    finally:
        fd._decode_split, fd._decode_merge = saved
    return caught


def specialise(launch, tiles=None):
    """(signature, constexprs, attrs) exactly as Triton's JIT would build them for this launch."""
    fn = launch.kernel
    values = dict(zip(fn.arg_names, launch.args))
    values.update(launch.kwargs)
    if isinstance(tiles, fd.DecodeTiles):  # the decode kernel's row tile is sized from G · L, not chosen
        values.update(BLOCK_N=tiles.block_n)
    elif tiles is not None:
        values.update(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            value = _Pointer(value.dtype)
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            signature[name], constexprs[name] = "constexpr", key
        else:
            signature[name] = kind
            if key:
                attrs[(i,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_launch(launch, tiles=None, arch="sm_90"):
    """The compiled kernel for one launch on ``arch``, with ``tiles`` (a lib.flash.Tiles or
    lib.flash_decode.DecodeTiles) or the kernel's own fixed shape, and ptxas's own report of it (registers, spills,
    notes): compiled afresh, never from Triton's cache, to have that report."""
    signature, constexprs, attrs = specialise(launch, tiles)
    options = {} if tiles is None else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    source = triton.compiler.ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=target(arch), options=options)
    compiled.ptxas_log = log.getvalue()
    return compiled


def resources(compiled):
    """Registers per thread and bytes spilled (stores), as ptxas reported them, and whether it serialised the
    kernel's wgmma (its C7515 note); shared memory from Triton."""
    log = compiled.ptxas_log
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas report for {compiled.metadata.name}: {log[-500:]!r}")
    return {"registers": int(regs.group(1)), "spill_bytes": int(spills.group(1)),
            "shared_bytes": compiled.metadata.shared, "threads": compiled.metadata.num_warps * 32,
            "wgmma_serialised": "(C7515)" in log}


_DOT = re.compile(r"= (tt\.dot|ttng\.warp_group_dot) .*-> tensor<[^,>]+, #(\w+)")


def products(ttgir):
    """How many of the kernel's matrix products run where, from Triton's GPU IR: {"wgmma": n, "mma": n, "fma": n}.
    A product Triton could not map to the tensor cores keeps a blocked layout and becomes FMA loops."""
    counts = {"wgmma": 0, "mma": 0, "fma": 0}
    for line in ttgir.splitlines():
        m = _DOT.search(line)
        if m is None:
            continue
        if m.group(1) == "ttng.warp_group_dot":
            counts["wgmma"] += 1
        else:
            counts["mma" if m.group(2).startswith("mma") else "fma"] += 1
    return counts


# The instructions that make up an attention loop on Hopper, in the order a reader meets them.
SKELETON = [
    ("UTMALDG", "TMA tile load"),
    ("LDGSTS", "cp.async copy, global to shared"),
    ("LDG", "plain load to registers"),
    ("SYNCS", "mbarrier wait/arrive"),
    ("BAR.SYNC", "block-wide barrier"),
    ("WARPGROUP.ARRIVE", "fence before wgmma"),
    ("HGMMA", "wgmma, async warpgroup product"),
    ("HMMA", "mma.sync, warp product"),
    ("WARPGROUP.DEPBAR", "wait for wgmma"),
    ("MUFU.EX2", "exponential"),
    ("FFMA", "float32 fused multiply-add"),
    ("FMUL", "float32 multiply"),
    ("FADD", "float32 add"),
    ("FMNMX", "float32 max"),
    ("F2FP", "pack to 16-bit"),
    ("RED", "atomic reduction to memory"),
    ("ATOM", "atomic to memory"),
]
_INSTRUCTION = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")


def _opcodes(sass):
    """[(opcode, instruction text)] for one kernel's SASS as Triton prints it (control codes, a tab, the
    instruction), with label lines as ('LABEL', name)."""
    out = []
    for line in sass.splitlines():
        line = line.strip()
        if re.fullmatch(r"\.?\w+:", line):
            out.append(("LABEL", line.rstrip(":").lstrip(".")))
            continue
        text = line.split("\t", 1)[1] if "\t" in line else line
        m = _INSTRUCTION.match(text)
        if m and not text.startswith("Function"):
            out.append((m.group(1), text.rstrip(";")))
    return out


def loops(sass):
    """The kernel's loops in program order, each body a list of (opcode, text): the code from a label to a branch
    back to it. A backward branch whose span holds an EXIT is no loop: ptxas places the retry of an mbarrier wait
    (the TMA path's) out of line after the kernel's end, and that code jumps back to where the wait was, so its
    span would run from inside the first key loop through the second to the end."""
    ops = _opcodes(sass)
    where = {name: i for i, (op, name) in enumerate(ops) if op == "LABEL"}
    bodies = []
    for i, (op, text) in enumerate(ops):
        target = text.split()[-1].lstrip(".") if op == "BRA" else None
        if target in where and where[target] < i:
            body = [o for o in ops[where[target]:i + 1] if o[0] != "LABEL"]
            if not any(o == "EXIT" for o, _ in body):
                bodies.append(body)
    return bodies


def family(opcode):
    for name, _ in SKELETON:
        if opcode == name or opcode.startswith(name + "."):
            return name
    return None


def _matrix_instructions(body):
    return sum(family(op) in ("HGMMA", "HMMA") for op, _ in body)


def key_loops(sass):
    """The loops that multiply matrices, in program order, each on its own: in lib.flash's forward kernel the
    unmasked key loop, then the masked one (the two calls of its loop helper)."""
    return [body for body in loops(sass) if _matrix_instructions(body)]


def main_loop(sass):
    """The key loop with the most matrix instructions, the shortest of those (the unmasked key loop of the forward
    kernel: the masked one adds its comparisons)."""
    candidates = key_loops(sass)
    if not candidates:
        return []
    return max(candidates, key=lambda body: (_matrix_instructions(body), -len(body)))


def loop_counts(body):
    """How many of each skeleton instruction one iteration issues (per thread), and the total."""
    counts = Counter(family(op) for op, _ in body)
    counts.pop(None, None)
    return {name: counts[name] for name, _ in SKELETON if counts[name]} | {"instructions": len(body)}


_KIND = {"UTMALDG": "copy", "LDGSTS": "copy", "LDG": "copy", "SYNCS": "barrier", "BAR.SYNC": "barrier",
         "WARPGROUP.DEPBAR": "wait", "MUFU.EX2": "softmax", "FFMA": "softmax", "FMUL": "softmax", "FADD": "softmax",
         "FMNMX": "softmax", "F2FP": "softmax", "RED": "atomic", "ATOM": "atomic"}


def skeleton(body):
    """The loop in program order as phases, e.g. ['8× LDGSTS', '1× BAR.SYNC', '8× HGMMA.64x64x16 (+wait)',
    '34 MUFU.EX2 + 188 float32', ...]: a product directly followed by its wait is one step, and the exponentials
    and float32 arithmetic between two other steps are one phase, since their order is the scheduler's. Where
    ptxas serialises a kernel's wgmma (the C7515 note of its -v report), every product is followed by its wait."""
    steps = []  # [kind, label, count] or for softmax [kind, Counter]
    for op, _ in body:
        name = family(op)
        if name in ("HGMMA", "HMMA"):
            steps.append(["mma", op.split(".F32")[0], 1])
            continue
        kind = _KIND.get(name)
        if kind is None:
            continue
        if kind == "wait" and steps and steps[-1][0] == "mma" and not steps[-1][1].endswith("(+wait)"):
            steps[-1][1] += " (+wait)"
            continue
        if kind == "softmax":
            if steps and steps[-1][0] == "softmax":
                steps[-1][1][name] += 1
            else:
                steps.append(["softmax", Counter({name: 1})])
            continue
        steps.append([kind, op if kind != "copy" else name, 1])
    merged = []
    for step in steps:
        if merged and step[0] != "softmax" and merged[-1][0] == step[0] and merged[-1][1] == step[1]:
            merged[-1][2] += step[2]
        else:
            merged.append(step)
    out = []
    for step in merged:
        if step[0] == "softmax":
            ex2 = step[1].pop("MUFU.EX2", 0)
            fp32 = sum(step[1].values())
            out.append(" + ".join(([f"{ex2} MUFU.EX2"] if ex2 else []) + ([f"{fp32} float32"] if fp32 else [])))
        else:
            out.append(f"{step[2]}× {step[1]}")
    return out


KERNEL_TILES = {  # each kernel's tile list in an architecture's table (the others have one fixed shape)
    "forward": lambda arch: flash.TILE_TABLES[arch].forward,
    "backward_kv": lambda arch: flash.TILE_TABLES[arch].backward_kv_atomic,
    "backward_kv_deterministic": lambda arch: flash.TILE_TABLES[arch].backward_kv,
    "backward_q": lambda arch: flash.TILE_TABLES[arch].backward_q,
    "preprocess": lambda arch: (None,),
    "decode": lambda arch: (fd.DECODE_TILES[arch],),
    "decode_paged": lambda arch: (fd.DECODE_TILES[arch],),
    "decode_merge": lambda arch: (None,),
}


def decode_rows(arch):
    """The split kernel's row tiles compiled on ``arch``: 16 (G · L up to 16, e.g. 4 query heads a key/value head
    and one new query) and the largest its table allows (lib.flash_decode.DecodeTiles.max_rows)."""
    return 16, fd.DECODE_TILES[arch].max_rows


def not_offered(archs, heads, kernels=tuple(KERNEL_TILES)):
    """The (arch, kernel, head) whose table offers no tile choice at that head size: such a launch never happens
    (on a T4 at head size 128 the backward runs the two-kernel path instead of the atomic one)."""
    return [(arch, kernel, head) for arch in archs for kernel in kernels for head in heads
            if not tiles_for(kernel, head, arch)]


def tiles_for(kernel, head, arch="sm_90"):
    """The tile choices the autotuner offers ``kernel`` at this head size on ``arch``."""
    return [t for t in KERNEL_TILES[kernel](arch) if t is None or head <= getattr(t, "max_head", head)]


def report(heads=(64, 128), causal=False, variant=None, kernels=tuple(KERNEL_TILES), with_loop=False, first=None,
           arch="sm_90", window=None):
    """One row per (kernel, head size, tile choice) on ``arch``: registers, spills, shared memory, threads, where
    the products run, whether ptxas serialised the wgmma, and optionally the inner loop's instruction counts and
    skeleton. ``first=n`` compiles only each list's first n choices; ``window`` compiles lib.flash's kernels for
    a sliding window of that many keys (causal)."""
    variant = variant or flash.DEFAULT
    dtype = arch_dtype(arch)
    rows = []
    for head in heads:
        launches = {}
        if any(k in kernels for k in ("forward", "backward_kv", "backward_kv_deterministic", "backward_q",
                                      "preprocess")):
            launches |= {(k, None): v for k, v in captured_launches(head, causal or window is not None, variant,
                                                                    dtype, window=window).items()}
        rows16 = decode_rows(arch)[0]
        for n in decode_rows(arch) if {"decode", "decode_merge"} & set(kernels) else ():
            launches |= {(k, n): v for k, v in decode_launches(head, n, dtype).items()}
        if "decode_paged" in kernels:
            launches |= {(k, rows16): v for k, v in decode_launches(head, rows16, dtype, True).items()
                         if k == "decode_paged"}
        for (name, n_rows), launch in launches.items():
            if name not in kernels:
                continue
            for tiles in tiles_for(name, head, arch)[:first]:
                compiled = compile_launch(launch, tiles, arch)
                row = {"arch": arch, "dtype": str(dtype).removeprefix("torch."), "kernel": name, "head": head,
                       "tiles": _tiles_text(tiles, n_rows), **resources(compiled),
                       "shared_limit": flash.TILE_TABLES[arch].shared_per_block,
                       "products": products(compiled.asm["ttgir"]),
                       "wgmma": "wgmma" in compiled.asm["ptx"], "mma_sync": "mma.sync" in compiled.asm["ptx"]}
                row["tensor_cores"] = row["products"]["fma"] == 0
                if with_loop:
                    body = main_loop(compiled.asm["sass"])
                    row["loop"] = loop_counts(body)
                    row["skeleton"] = skeleton(body)
                    row["key_loops"] = [loop_counts(b) for b in key_loops(compiled.asm["sass"])]
                rows.append(row)
    order = {name: i for i, name in enumerate(KERNEL_TILES)}
    return sorted(rows, key=lambda r: (order[r["kernel"]], r["head"]))


def _tiles_text(t, rows=None):
    if isinstance(t, fd.DecodeTiles):
        return f"{rows}×{t.block_n}, {t.num_warps} warps, {t.num_stages} stages"
    if t is None:
        return "-" if rows is None else f"{rows} rows"
    return f"{t.block_m}×{t.block_n}, {t.num_warps} warps, {t.num_stages} stages"


def _where(r):
    """Where the products run: wgmma, mma.sync (both tensor cores), FMA (CUDA cores), or '-' (there are none)."""
    p = r["products"]
    names = [f"{n} {name}" for name, n in (("wgmma", p["wgmma"]), ("mma.sync", p["mma"]), ("FMA", p["fma"])) if n]
    return " + ".join(names) or "-"


def markdown(rows):
    lines = [("| arch | kernel | head | tiles (M × N, warps, stages) | registers | spilled bytes | shared KiB | "
              "products | wgmma serialised |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        serial = ("yes" if r["wgmma_serialised"] else "no") if r["products"]["wgmma"] else "-"
        lines.append(f"| {r['arch']} | {r['kernel']} | {r['head']} | {r['tiles']} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} of {r['shared_limit'] // 1024} | "
                     f"{_where(r)} | {serial} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["sm_90"], choices=[*ARCHS, "all"],
                        help="the architectures to compile for (all: every one in lib.flash.TILE_TABLES)")
    parser.add_argument("--head", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=None, help="lib.flash with a sliding window (implies --causal)")
    parser.add_argument("--variant", default=None, choices=list(flash.LADDER), help="a rung of lib.flash.LADDER")
    parser.add_argument("--kernels", nargs="+", default=list(KERNEL_TILES), choices=list(KERNEL_TILES))
    parser.add_argument("--loop", action="store_true", help="also the inner loop's skeleton")
    parser.add_argument("--first", type=int, default=None, help="compile only each list's first N tile choices")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variant = flash.LADDER[args.variant] if args.variant else None
    archs = ARCHS if "all" in args.arch else args.arch
    rows = [r for arch in archs for r in report(args.head, args.causal, variant, args.kernels, args.loop, args.first,
                                                 arch, args.window)]
    missing = [f"{arch} {kernel} at head size {head}" for arch, kernel, head in not_offered(archs, args.head,
                                                                                          args.kernels)]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print(markdown(rows))
        if missing:
            print(f"\nNo tile choice offered, so never launched: {'; '.join(missing)} (the backward runs the "
                  "two-kernel path there).")
    else:
        for r in rows:
            serial = "  wgmma serialised (C7515)" if r["wgmma_serialised"] else ""
            print(f"{r['arch']} {r['kernel']:<12} d {r['head']:<4} {r['tiles']:<32} {r['registers']:>4} regs  "
                  f"{r['spill_bytes']:>5} B spilled  {r['shared_bytes'] / 1024:6.1f} of {r['shared_limit'] // 1024} "
                  f"KiB shared  {_where(r)}{serial}")
            if args.loop:
                for i, counts in enumerate(r["key_loops"], 1):
                    print(f"    key loop {i} of {len(r['key_loops'])}:", ", ".join(f"{k} {v}" for k, v in counts.items()))
                print("    the loop below:", ", ".join(f"{k} {v}" for k, v in r["loop"].items()))
                print("    ", " → ".join(r["skeleton"]))
        for line in missing:
            print(f"{line}: no tile choice offered, so never launched (the backward runs the two-kernel path)")

if __name__ == "__main__":
    main()
