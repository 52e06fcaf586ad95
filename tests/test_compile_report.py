"""tools/compile_report.py: lib.flash and lib.flash_decode compiled for every GPU Colab offers, as Triton's JIT
specialises a real launch there: a T4 (sm_75, float16), an A100 (sm_80), an L4 (sm_89) and an H100 (sm_90).

The interpreter forgives what the compiler does not, so every tile choice of every architecture's table is
compiled here, on the CPU, with the ptxas that ships in Triton's wheel, at head sizes 64 and 128: none may spill
registers, all must fit one thread block's shared memory on that architecture, and from sm_80 on every matrix
product must run on the tensor cores (wgmma on sm_90, mma.sync on sm_80 and sm_89), and on sm_90 ptxas must not
serialise the default forward and dQ kernels' wgmma (its note C7515).
Triton has had no tensor-core path below sm_80 since 3.2 (triton-lang/triton#5066): on the T4 every product is FMA,
and the test says so, to notice the day a Triton brings it back. Each architecture is compiled once per test
session, in a subprocess with the interpreter off (this test process has it on).
"""

import functools
import json
import os
import subprocess
import sys

import pytest

from lib import flash
from lib import flash_decode as fd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1024
# One thread block's shared memory (the opt-in maximum) on each, from NVIDIA's datasheets.
SHARED_PER_BLOCK = {"sm_75": 64 * KiB, "sm_80": 163 * KiB, "sm_89": 99 * KiB, "sm_90": 227 * KiB}
ARCHS = list(SHARED_PER_BLOCK)
ENV = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
FIELDS = {"forward": "forward", "backward_kv": "backward_kv_atomic", "backward_kv_deterministic": "backward_kv",
          "backward_q": "backward_q"}
# Where a table offers a kernel no choice at a head size, and what runs instead: on a T4 the atomic dK/dV kernel
# spills at head size 128 with every tile (its FMA products hold both operands in registers, and it also holds dQ),
# so the backward takes the two-kernel path there (lib.flash._backward_variant).
NOT_OFFERED = {("sm_75", "backward_kv", 128): ("backward_kv_deterministic", "backward_q")}
PRODUCTS = {"forward": 4, "backward_kv": 10, "backward_kv_deterministic": 8, "backward_q": 6, "decode": 4,
            "decode_paged": 4}  # tl.dot calls in each kernel's two loops (masked and unmasked)


def run(*args):
    result = subprocess.run([sys.executable, "tools/compile_report.py", *args], capture_output=True, text=True,
                            env=ENV, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@functools.cache
def compiled(arch):
    """Every row of the report for ``arch``: each kernel, each tile choice, head sizes 64 and 128."""
    return run("--arch", arch, "--json")


def test_the_tables_cover_the_four_architectures_with_their_datasheet_limits():
    assert set(flash.TILE_TABLES) == set(ARCHS) == set(fd.DECODE_TILES)
    for arch, table in flash.TILE_TABLES.items():
        assert table.arch == arch and table.shared_per_block == SHARED_PER_BLOCK[arch]
        for field in FIELDS.values():
            choices = getattr(table, field)
            assert len(set(choices)) == len(choices) >= (1 if arch == "sm_75" else 2), (arch, field)
            kernel = next(k for k, f in FIELDS.items() if f == field)
            assert any(t.max_head >= 128 for t in choices) != ((arch, kernel, 128) in NOT_OFFERED), (arch, field)
    # The H100's table is the one chapter 9 and the benchmarks name.
    assert flash.TILE_TABLES["sm_90"].forward is flash.FORWARD_TILES
    assert fd.DECODE_TILES["sm_90"] is fd.GPU_TILES


@pytest.mark.parametrize("capability, shared, arch", [
    ((7, 5), None, "sm_75"), ((8, 0), None, "sm_80"), ((8, 6), None, "sm_89"), ((8, 9), None, "sm_89"),
    ((9, 0), None, "sm_90"), ((12, 0), None, "sm_89"), ((10, 0), 227 * KiB, "sm_90"), ((9, 0), 99 * KiB, "sm_89"),
    ((8, 0), 64 * KiB, "sm_75"),
])
def test_a_gpu_gets_the_table_whose_limits_it_meets(capability, shared, arch):
    assert flash.arch_for(capability, shared) == arch
    table = flash.TILE_TABLES[arch]
    assert table.capability <= capability or arch == "sm_89"  # sm_89's table asks nothing of 8.9 that 8.0 lacks
    assert table.shared_per_block <= (shared or flash.SHARED_PER_BLOCK[capability])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_backward_runs_two_kernels_where_the_table_has_no_atomic_choice(arch):
    table = flash.TILE_TABLES[arch]
    for E, EV in ((64, 64), (128, 128), (64, 128), (100, 40), (16, 16)):
        variant = flash._backward_variant(flash.DEFAULT, table, E, EV)
        two_kernels = (arch, "backward_kv", 128) in NOT_OFFERED and max(E, EV) > 64
        assert variant == (flash.DETERMINISTIC if two_kernels else flash.DEFAULT), (E, EV)
        assert table.offers("backward_kv_atomic", E, EV) != two_kernels
        assert table.offers("backward_kv", E, EV) and table.offers("backward_q", E, EV)
        # a variant that already runs two kernels, or one rung of the ladder, keeps everything else it asked for
        assert flash._backward_variant(flash.DETERMINISTIC, table, E, EV) == flash.DETERMINISTIC
        tma = flash._backward_variant(flash.LADDER["+tma"], table, E, EV)
        assert tma.tma and tma.atomic_dq != two_kernels


def test_arch_for_refuses_what_it_cannot_place():
    with pytest.raises(ValueError, match="7.5"):
        flash.arch_for((7, 0))
    with pytest.raises(TypeError, match="capability"):
        flash.arch_for("sm_90")
    with pytest.raises(ValueError, match="CUDA device"):
        flash.tile_table("cpu")


def test_half_dtype_is_float16_below_sm_80():
    import torch

    from lib.speed import half_dtype

    assert half_dtype(capability=(7, 5)) == torch.float16
    assert half_dtype(capability=(8, 0)) == half_dtype(capability=(9, 0)) == torch.bfloat16
    assert half_dtype("cpu") == torch.float16  # Triton's interpreter computes bfloat16 wrongly
    with pytest.raises(TypeError, match="capability"):
        half_dtype(capability=7.5)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("kernel", [*FIELDS, "decode", "decode_paged", "preprocess", "decode_merge"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_tile_choice_fits_spills_nothing_and_runs_on_the_tensor_cores(arch, kernel, head):
    rows = [r for r in compiled(arch) if r["kernel"] == kernel and r["head"] == head]
    if kernel in FIELDS:
        offered = [t for t in getattr(flash.TILE_TABLES[arch], FIELDS[kernel]) if head <= t.max_head]
    else:
        offered = [None] * (2 if kernel in ("decode", "decode_merge") else 1)  # decode: row tiles of 16 and the most
    assert len(rows) == len(offered) >= (0 if (arch, kernel, head) in NOT_OFFERED else 1)
    for instead in NOT_OFFERED.get((arch, kernel, head), ()):  # what runs in its place is compiled and offered
        assert any(r["kernel"] == instead and r["head"] == head for r in compiled(arch)), (arch, kernel, instead)
    if kernel in ("decode", "decode_merge"):
        most = fd.DECODE_TILES[arch].max_rows
        assert [r["tiles"].split("×")[0].split()[0] for r in rows] == ["16", str(most)], rows
    for row, tiles in zip(rows, offered):
        where = f"{arch} {kernel}, head {head}, {row['tiles']}"
        assert row["dtype"] == ("float16" if arch == "sm_75" else "bfloat16")
        assert row["spill_bytes"] == 0, f"{where} spills {row['spill_bytes']} bytes"
        assert row["shared_bytes"] <= SHARED_PER_BLOCK[arch], f"{where} needs {row['shared_bytes']} bytes"
        assert row["shared_bytes"] > 0 or kernel == "decode_merge", where  # the merge reduces in registers
        assert row["registers"] * row["threads"] <= 64 * 1024, where
        products = row["products"]
        if kernel not in PRODUCTS:  # the delta and merge kernels multiply no matrices
            assert products == {"wgmma": 0, "mma": 0, "fma": 0}, where
            continue
        if arch == "sm_75":  # Triton 3.9: "Dot op using MMA for compute capability 75 has been deprecated"
            assert products == {"wgmma": 0, "mma": 0, "fma": PRODUCTS[kernel]} and not row["tensor_cores"], where
            continue
        assert products["fma"] == 0 and row["tensor_cores"], f"{where} multiplies on the CUDA cores: {products}"
        assert products["wgmma"] + products["mma"] == PRODUCTS[kernel], where
        if arch != "sm_90":
            assert products["wgmma"] == 0 and row["mma_sync"], where
        elif kernel in FIELDS:
            # Only the atomic path's dQ share, dS K, with a 32-row left operand, may fall back to mma.sync.
            assert row["wgmma"], f"{where} has no wgmma"
            assert not products["mma"] or (kernel == "backward_kv" and tiles.block_m < 64), f"{where}: mma.sync"


FLASH_KERNELS = ("forward", "backward_kv", "backward_kv_deterministic", "backward_q")
# The default, neither, is compiled above. Triton builds a separate kernel for an int divisible by 16 and for one
# that is not: a window of 255 is compiled too, at each kernel's first choice.
MODES = {"causal": ("--causal",), "window": ("--window", "256"), "window-255": ("--window", "255", "--first", "1")}


@functools.cache
def compiled_in(arch, mode):
    """lib.flash's kernels on ``arch``, causal or with chapter 13's sliding window: every tile choice, both heads."""
    return run("--arch", arch, *MODES[mode], "--kernels", *FLASH_KERNELS, "--json")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_and_windowed_kernels_fit_and_spill_nothing_either(arch, mode):
    # The masks add comparisons and registers: a choice clean without them can spill with them (sm_89's 64 × 64 dQ
    # tile did, at head size 64, causal).
    rows = compiled_in(arch, mode)
    for kernel in FLASH_KERNELS:
        for head in (64, 128):
            offered = [t for t in getattr(flash.TILE_TABLES[arch], FIELDS[kernel]) if head <= t.max_head]
            offered = offered[:1] if "--first" in MODES[mode] else offered
            assert len([r for r in rows if (r["kernel"], r["head"]) == (kernel, head)]) == len(offered)
    for row in rows:
        where = f"{arch} {mode} {row['kernel']}, head {row['head']}, {row['tiles']}"
        assert row["spill_bytes"] == 0, f"{where} spills {row['spill_bytes']} bytes"
        assert row["shared_bytes"] <= SHARED_PER_BLOCK[arch], where
        assert row["tensor_cores"] == (arch != "sm_75"), where
        assert not row["wgmma_serialised"], f"{where}: ptxas serialised its wgmma (C7515)"
    if mode.startswith("window"):  # a window leaves every visited tile masked: the unmasked loops are not compiled
        products = {r["kernel"]: r["products"] for r in rows if r["head"] == 64}
        assert all(sum(products[kernel].values()) == PRODUCTS[kernel] // 2 for kernel in FLASH_KERNELS), products


def test_ptxas_serialises_no_wgmma_of_any_kernel():
    # ptxas's C7515 note: "wgmma.mma_async instructions are serialized due to non wgmma instructions defining
    # accumulator registers of a wgmma between start and end of the pipeline stage", every product waiting for the
    # one before. The forward and dQ kernels enter each key loop only when it has a tile, which keeps it away: at
    # every tile choice, both head sizes, with and without the causal mask (both loops then run). The causal and
    # windowed compiles of every kernel are checked for it too (test_causal_and_windowed_kernels_...).
    causal = compiled_in("sm_90", "causal")
    for rows in (compiled("sm_90"), causal):
        rows = [r for r in rows if r["kernel"] in ("forward", "backward_q")]
        assert {(r["kernel"], r["head"]) for r in rows} == {(k, h) for k in ("forward", "backward_q")
                                                             for h in (64, 128)}
        serialised = [(r["kernel"], r["head"], r["tiles"]) for r in rows if r["wgmma_serialised"]]
        assert not serialised, f"ptxas serialised the wgmma of {serialised}"
        assert all(r["wgmma"] for r in rows)
    assert not any(r["wgmma_serialised"] for arch in ("sm_80", "sm_89") for r in compiled(arch))  # no wgmma there
    assert not any(r["wgmma_serialised"] for r in compiled("sm_90"))  # nor in the backward kernels


def test_the_report_reads_the_c7515_note_from_ptxas():
    # The check above would pass vacuously if the note were never read: the flag comes from ptxas's own -v report.
    code = r"""
import sys, types
sys.path.insert(0, "tools")
import compile_report as cr
report = "ptxas info : Used 182 registers, used 1 barriers\n0 bytes spill stores, 0 bytes spill loads\n"
note = "ptxas info : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
meta = types.SimpleNamespace(shared=1024, num_warps=8, name="k")
flags = [cr.resources(types.SimpleNamespace(ptxas_log=log, metadata=meta))["wgmma_serialised"]
         for log in (report, note + report)]
assert flags == [False, True], flags
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_forward_loop_reads_as_a_hopper_flash_loop():
    # The launched kernel, not a kernel with untyped strides: 16-byte asynchronous copies into shared memory, the
    # warpgroup products and their waits, one exponential per score, and the scale folded into an FMA.
    (row,) = run("--head", "128", "--kernels", "forward", "--causal", "--loop", "--first", "1", "--json")
    assert row["tiles"] == "128×64, 8 warps, 3 stages"
    loop = row["loop"]
    assert loop["LDGSTS"] > 0 and loop["HGMMA"] > 0 and loop["WARPGROUP.DEPBAR"] > 0
    # the products are chained, not each waited on: QKᵀ's eight and PV's four need a wait or two, not twelve
    assert not row["wgmma_serialised"] and loop["WARPGROUP.DEPBAR"] <= 2 < loop["HGMMA"]
    scores_per_thread = 128 * 64 // 256
    assert scores_per_thread <= loop["MUFU.EX2"] <= scores_per_thread + 4  # plus the row rescales
    assert loop["FFMA"] >= scores_per_thread  # s · scale − m, one instruction per score
    assert any("HGMMA.64x64x16" in step for step in row["skeleton"])
    assert 90 <= row["shared_bytes"] / 1024 <= 227  # 3 stages of k and v tiles, not the untyped kernel's 64 KiB


def test_the_specialisation_is_the_jits():
    code = (
        "import sys, torch\nsys.path.insert(0, 'tools')\nimport compile_report as cr\nfrom lib import flash\n"
        "l = cr.captured_launches(128, False, flash.DEFAULT)['forward']\n"
        "sig, const, attrs = cr.specialise(l, flash.FORWARD_TILES[0])\n"
        "assert const['sq_e'] == 1 and const['sk_e'] == 1, const\n"
        "assert sig['Q'] == '*bf16' and sig['LSE'] == '*fp32' and sig['sq_l'] == 'i32', sig\n"
        "names = [l.kernel.arg_names[i[0]] for i in attrs]\n"
        "assert {'Q', 'K', 'V', 'O', 'sq_l', 'sk_s', 'L', 'S'} <= set(names), names\n"
        "d = cr.decode_launches(128, 16, torch.float16)['decode']\n"
        "sig, const, attrs = cr.specialise(d, cr.fd.DECODE_TILES['sm_75'])\n"
        "assert sig['Q'] == '*fp16' and const['BLOCK_M'] == 16 and const['sq_e'] == 1, (sig, const)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("rung", ["first", "+tma", "+lpt"])
def test_every_rung_of_the_forward_compiles_without_spills(rung):
    # The default is compiled above, tile by tile; here the first version (scale not folded), the TMA rung, and the
    # LPT rung, which changes only a causal launch's block order.
    causal = ["--causal"] if rung == "+lpt" else []
    (row,) = run("--head", "128", "--kernels", "forward", "--variant", rung, "--loop", "--first", "1", "--json",
                 *causal)
    assert row["spill_bytes"] == 0 and row["shared_bytes"] <= SHARED_PER_BLOCK["sm_90"] and row["wgmma"]
    loop = row["loop"]
    if rung == "first":  # the extra multiply per score: 30 more FMUL a thread than the folded loop's 66
        assert loop["FMUL"] == 96 and loop["LDGSTS"] > 0
    else:  # TMA copies and mbarrier waits instead of cp.async
        assert loop.get("UTMALDG", 0) > 0 and loop.get("SYNCS", 0) > 0 and "LDGSTS" not in loop
        assert not row["wgmma_serialised"]


def test_each_key_loop_is_counted_on_its_own_pointer_and_tma_alike():
    # The forward kernel has two key loops, unmasked then masked. On the TMA rung ptxas puts the retry of each
    # mbarrier wait out of line after the kernel's end, and that code branches back into the loops: the span of
    # such a branch holds both loops and the barrier set-up between them, and is no loop. Each loop is one key
    # tile of 128 x 64 with 8 warps: 32 scores a thread and two row rescales, QKᵀ's 8 products and PV's 4, one
    # wait.
    rows = {rung: run("--head", "128", "--kernels", "forward", "--loop", "--first", "1", "--json",
                      *(("--variant", rung) if rung else ()))[0] for rung in (None, "+tma")}
    for rung, row in rows.items():
        assert row["tiles"] == "128×64, 8 warps, 3 stages"
        assert len(row["key_loops"]) == 2, (rung, [body["instructions"] for body in row["key_loops"]])
        unmasked, masked = row["key_loops"]
        assert row["loop"] == unmasked and unmasked["instructions"] < masked["instructions"] < 500, rung
        for body in row["key_loops"]:
            assert body["MUFU.EX2"] == 128 * 64 // 256 + 2, (rung, body)
            assert body["HGMMA"] == 128 // 16 + 64 // 16 and body["WARPGROUP.DEPBAR"] == 1, (rung, body)
            float32 = sum(body[op] for op in ("FFMA", "FMUL", "FADD", "FMNMX", "F2FP"))
            assert float32 == 188, (rung, body)
            if rung:  # TMA copies of k and v, waited on through mbarriers
                assert body["UTMALDG"] == 2 and body["SYNCS"] > 0 and "LDGSTS" not in body, body
            else:  # 16-byte cp.async copies, no mbarrier
                assert body["LDGSTS"] > 0 and "UTMALDG" not in body and "SYNCS" not in body, body
        assert any("UTMALDG" in step for step in row["skeleton"]) == bool(rung)


def test_a_branch_back_from_after_the_kernels_end_is_no_loop():
    # Made-up SASS in Triton's print format: a loop (LBB1 to its branch), then EXIT, then the out-of-line retry of
    # an mbarrier wait, which spins on itself and then jumps back into the loop. The loop and the spin are loops;
    # the jump back, whose span holds the EXIT, is not.
    code = r"""
import sys
sys.path.insert(0, "tools")
import compile_report as cr
lines = ["MOV R1, c[0x0][0x28];", "LBB1:", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24;",
         "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3;", "@!P0 BRA LBB3;", "LBB2:", "MUFU.EX2 R5, R5;",
         "@P1 BRA LBB1;", "EXIT;", "LBB3:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3;", "@!P0 BRA LBB3;",
         "BRA LBB2;"]
sass = "\n".join(line if line.endswith(":") else "--:-:-:-:5\t" + line for line in lines)
bodies = [[op for op, _ in body] for body in cr.loops(sass)]
assert bodies == [["HGMMA.64x64x16.F32.BF16", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA", "MUFU.EX2", "BRA"],
                  ["SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA"]], bodies
(key,) = cr.key_loops(sass)
assert cr.main_loop(sass) == key and cr.loop_counts(key)["MUFU.EX2"] == 1
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]


# Every architecture's tile shapes also compute attention: forced in turn in Triton's interpreter (CPU, float32), on
# lengths off every tile grid, forward and both backward paths against SDPA in float64.
SHAPES = sorted({(t.block_m, t.block_n) for table in flash.TILE_TABLES.values()
                 for field in FIELDS.values() for t in getattr(table, field)})


@pytest.mark.skipif(not flash.INTERPRETED, reason="forces tiles in the interpreter")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_tables_tile_shapes_compute_attention(shape, causal):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, n, 24, generator=g) for n in (100, 90, 90, 100))
    scale = 24**-0.5
    tiles = flash.Tiles(*shape, num_warps=4, num_stages=1)
    ts = [x.double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ts, is_causal=causal, scale=scale)
    want.backward(do.double())
    o, lse = flash._forward(q, k, v, causal, scale, tiles=tiles)
    torch.testing.assert_close(o.double(), want.detach(), rtol=1e-4, atol=2e-5)
    for variant in (flash.DEFAULT, flash.DETERMINISTIC):
        grads = flash._backward(q, k, v, o, lse, do, causal, scale, tiles=tiles, variant=variant, q_tiles=tiles)
        for name, got, t in zip("qkv", grads, ts):
            torch.testing.assert_close(got.double(), t.grad, rtol=1e-4, atol=2e-5, msg=f"d{name}, {variant}")
