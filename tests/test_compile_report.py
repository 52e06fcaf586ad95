"""tools/compile_report.py: lib.flash compiled for an H100 (sm_90) as Triton's JIT specialises a real launch.

The interpreter forgives what the compiler does not, so every tile choice of every kernel is compiled here, on the
CPU, with the ptxas that ships in Triton's wheel, at head sizes 64 and 128: none may spill registers, all must fit
one thread block's shared memory, and the matrix products must compile to wgmma. The compile runs in a subprocess
with the interpreter off (this test process has it on).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_PER_BLOCK = 227 * 1024

CODE = """
import json, sys
sys.path.insert(0, "tools")
import compile_report as cr
rows = cr.report(heads=({head},), kernels=({kernel!r},), causal={causal}, with_loop={loop}, first={first})
print(json.dumps(rows))
"""


def compile_rows(head, kernel, causal=False, loop=False, first=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    code = CODE.format(head=head, kernel=kernel, causal=causal, loop=loop, first=first)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


TILES = {"forward": "FORWARD_TILES", "backward_kv": "BACKWARD_KV_ATOMIC_TILES",
         "backward_kv_deterministic": "BACKWARD_KV_TILES", "backward_q": "BACKWARD_Q_TILES"}


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("kernel", list(TILES))
def test_no_tile_choice_spills_and_all_fit_shared_memory(kernel, head):
    from lib import flash

    rows = compile_rows(head, kernel)
    offered = [t for t in getattr(flash, TILES[kernel]) if head <= t.max_head]
    assert len(rows) == len(offered) >= 3
    for row, tiles in zip(rows, offered):
        where = f"{kernel}, head {head}, {row['tiles']}"
        assert row["spill_bytes"] == 0, f"{where} spills {row['spill_bytes']} bytes"
        assert 0 < row["shared_bytes"] <= SMEM_PER_BLOCK, f"{where} needs {row['shared_bytes']} bytes shared"
        assert row["registers"] * row["threads"] <= 64 * 1024, where
        assert row["wgmma"], f"{where} has no wgmma"
        # Only the atomic path's dQ share, dS K, with a 32-row left operand, may fall back to mma.sync.
        assert not row["mma_sync"] or (kernel == "backward_kv" and tiles.block_m < 64), f"{where} uses mma.sync"


def test_the_forward_loop_reads_as_a_hopper_flash_loop():
    # The launched kernel, not a kernel with untyped strides: 16-byte asynchronous copies into shared memory, the
    # warpgroup products and their waits, one exponential per score, and the scale folded into an FMA.
    (row,) = compile_rows(128, "forward", causal=True, loop=True, first=1)
    assert row["tiles"] == "128×64, 8 warps, 3 stages"
    loop = row["loop"]
    assert loop["LDGSTS"] > 0 and loop["HGMMA"] > 0 and loop["WARPGROUP.DEPBAR"] > 0
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
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("rung", ["first", "+tma", "+lpt"])
def test_every_rung_of_the_forward_compiles_without_spills(rung):
    # The default is compiled above, tile by tile; here the first version (scale not folded), the TMA rung, and the
    # LPT rung, which changes only a causal launch's block order.
    code = CODE.format(head=128, kernel="forward", causal=rung == "+lpt", loop=True, first=1).replace(
        "rows = cr.report(", f"rows = cr.report(variant=cr.flash.LADDER[{rung!r}], ")
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout.splitlines()[-1])
    assert row["spill_bytes"] == 0 and row["shared_bytes"] <= SMEM_PER_BLOCK and row["wgmma"]
    loop = row["loop"]
    if rung == "first":  # the extra multiply per score: 30 more FMUL a thread than the folded loop's 66
        assert loop["FMUL"] == 96 and loop["LDGSTS"] > 0
    else:  # TMA copies and mbarrier waits instead of cp.async
        assert loop.get("UTMALDG", 0) > 0 and loop.get("SYNCS", 0) > 0 and "LDGSTS" not in loop
