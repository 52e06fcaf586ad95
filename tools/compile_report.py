"""What lib.flash's kernels compile to on an H100 (sm_90), read on a machine without a GPU (chapter 9).

    python tools/compile_report.py                       # every tile choice, head sizes 64 and 128, a table
    python tools/compile_report.py --head 128 --loop     # also the skeleton of each kernel's inner loop
    python tools/compile_report.py --markdown            # the table benchmarks/results.md shows

Each kernel is compiled as Triton's JIT specialises a real launch: the wrapper in lib/flash.py is run on "meta"
tensors (shapes and strides, no memory) of a contiguous bfloat16 problem, the arguments it would launch with are
caught, and each is typed by Triton's own specialisation rule (an int equal to 1, such as the stride of the last
dimension, becomes a constant; ints and pointers divisible by 16 are marked so). Compiled with plain int32 strides
and no such marks, the same kernel would use scalar 2-byte loads and a fraction of the shared memory: a kernel that
never runs. Triton's wheel ships ptxas and cuobjdump: registers and spills come from ptxas's own report (-v),
shared memory from Triton's metadata, and the loop skeleton from the SASS (cuobjdump).
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
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget

from lib import flash

TARGET = GPUTarget("cuda", 90, 32)  # an H100
SMEM_PER_BLOCK = 227 * 1024  # shared memory one thread block may use on sm_90
REGISTERS_PER_SM = 64 * 1024  # 32-bit registers
SHAPE = {"Z": 64, "L": 4096, "S": 4096}  # batch · heads and lengths of the launch being specialised


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


def captured_launches(head, causal, variant, dtype=torch.bfloat16, shape=SHAPE):
    """{kernel name: Launch} for a forward and a backward pass of lib.flash on a contiguous (Z, L, head) problem."""
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
        o, lse = flash._forward(q, k, v, causal, head**-0.5, variant=variant)
        o = torch.empty(Z, L, head, device="meta", dtype=dtype)
        lse = torch.empty(Z, L, device="meta", dtype=torch.float32)
        flash._backward(q, k, v, o, lse, do, causal, head**-0.5, variant=variant)
        if variant.atomic_dq:  # the deterministic path's two kernels too, for the table
            deterministic = dataclasses.replace(variant, atomic_dq=False)
            flash._backward(q, k, v, o, lse, do, causal, head**-0.5, variant=deterministic)
    finally:
        for name, fn in saved.items():
            setattr(flash, name, fn)
    return caught


def specialise(launch, tiles=None):
    """(signature, constexprs, attrs) exactly as Triton's JIT would build them for this launch."""
    fn = launch.kernel
    values = dict(zip(fn.arg_names, launch.args))
    values.update(launch.kwargs)
    if tiles is not None:
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


def compile_launch(launch, tiles=None):
    """The compiled kernel for one launch, with ``tiles`` (a lib.flash.Tiles) or the preprocess kernel's own, and
    ptxas's own report of it (registers, spills): compiled afresh, never from Triton's cache, to have that report."""
    signature, constexprs, attrs = specialise(launch, tiles)
    options = {} if tiles is None else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    source = triton.compiler.ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=TARGET, options=options)
    compiled.ptxas_log = log.getvalue()
    return compiled


def resources(compiled):
    """Registers per thread and bytes spilled (stores), as ptxas reported them; shared memory from Triton."""
    log = compiled.ptxas_log
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas report for {compiled.metadata.name}: {log[-500:]!r}")
    return {"registers": int(regs.group(1)), "spill_bytes": int(spills.group(1)),
            "shared_bytes": compiled.metadata.shared, "threads": compiled.metadata.num_warps * 32}


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
    """Each backward branch's body, as a list of (opcode, text): the kernel's loops."""
    ops = _opcodes(sass)
    where = {name: i for i, (op, name) in enumerate(ops) if op == "LABEL"}
    bodies = []
    for i, (op, text) in enumerate(ops):
        target = text.split()[-1].lstrip(".") if op == "BRA" else None
        if target in where and where[target] < i:
            bodies.append([o for o in ops[where[target]:i + 1] if o[0] != "LABEL"])
    return bodies


def family(opcode):
    for name, _ in SKELETON:
        if opcode == name or opcode.startswith(name + "."):
            return name
    return None


def main_loop(sass):
    """The loop with the most matrix instructions (the unmasked key loop of the forward kernel)."""
    candidates = loops(sass)
    if not candidates:
        return []
    return max(candidates, key=lambda body: (sum(family(op) in ("HGMMA", "HMMA") for op, _ in body), -len(body)))


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


KERNEL_TILES = {  # each kernel's tile list in lib.flash (the preprocess kernel has one fixed shape)
    "forward": lambda: flash.FORWARD_TILES,
    "backward_kv": lambda: flash.BACKWARD_KV_ATOMIC_TILES,
    "backward_kv_deterministic": lambda: flash.BACKWARD_KV_TILES,
    "backward_q": lambda: flash.BACKWARD_Q_TILES,
    "preprocess": lambda: (None,),
}


def tiles_for(kernel, head):
    """The tile choices the autotuner offers ``kernel`` at this head size."""
    return [t for t in KERNEL_TILES[kernel]() if t is None or head <= t.max_head]


def report(heads=(64, 128), causal=False, variant=None, kernels=tuple(KERNEL_TILES), with_loop=False, first=None):
    """One row per (kernel, head size, tile choice): registers, spills, shared memory, threads, and optionally the
    inner loop's instruction counts and skeleton. ``first=n`` compiles only each list's first n choices."""
    variant = variant or flash.DEFAULT
    rows = []
    for head in heads:
        launches = captured_launches(head, causal, variant)
        for name in kernels:
            if name not in launches:
                continue
            for tiles in tiles_for(name, head)[:first]:
                compiled = compile_launch(launches[name], tiles)
                row = {"kernel": name, "head": head, "tiles": _tiles_text(tiles), **resources(compiled),
                       "wgmma": "wgmma" in compiled.asm["ptx"], "mma_sync": "mma.sync" in compiled.asm["ptx"]}
                if with_loop:
                    body = main_loop(compiled.asm["sass"])
                    row["loop"] = loop_counts(body)
                    row["skeleton"] = skeleton(body)
                rows.append(row)
    return rows


def _tiles_text(t):
    return "-" if t is None else f"{t.block_m}×{t.block_n}, {t.num_warps} warps, {t.num_stages} stages"


def markdown(rows):
    lines = ["| kernel | head | tiles (M × N, warps, stages) | registers | spilled bytes | shared KiB | products |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        product = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "none")
        lines.append(f"| {r['kernel']} | {r['head']} | {r['tiles']} | {r['registers']} | {r['spill_bytes']} | "
                     f"{r['shared_bytes'] / 1024:.0f} | {product} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--variant", default=None, choices=list(flash.LADDER), help="a rung of lib.flash.LADDER")
    parser.add_argument("--kernels", nargs="+", default=list(KERNEL_TILES), choices=list(KERNEL_TILES))
    parser.add_argument("--loop", action="store_true", help="also the inner loop's skeleton")
    parser.add_argument("--first", type=int, default=None, help="compile only each list's first N tile choices")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variant = flash.LADDER[args.variant] if args.variant else None
    rows = report(args.head, args.causal, variant, args.kernels, args.loop, args.first)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            print(f"{r['kernel']:<12} d {r['head']:<4} {r['tiles']:<32} {r['registers']:>4} regs  "
                  f"{r['spill_bytes']:>5} B spilled  {r['shared_bytes'] / 1024:6.1f} KiB shared  "
                  f"{'wgmma' if r['wgmma'] else 'mma.sync' if r['mma_sync'] else '-'}")
            if args.loop:
                print("    loop:", ", ".join(f"{k} {v}" for k, v in r["loop"].items()))
                print("    ", " → ".join(r["skeleton"]))

if __name__ == "__main__":
    main()
