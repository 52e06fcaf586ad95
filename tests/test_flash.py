"""lib.flash, the Triton FlashAttention kernels, against PyTorch's kernel: forward and all three gradients.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1), in
float32 and float16 at small sizes, with tiles of 16 so that every case crosses several tiles each way. With a GPU
the tests marked ``gpu`` run the same oracle at realistic sizes in half precision.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lib import attention as attn
from lib import flash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cpu" if flash.INTERPRETED else "cuda"
needs_interpreter = pytest.mark.skipif(not flash.INTERPRETED, reason="checks the interpreter's fixed tiles")


def oracle(q, k, v, causal=False, scale=None, do=None):
    """SDPA in float64 on the CPU, batch dims broadcast by hand: output and, given do, the three gradients."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    ts = [x.detach().double().cpu().expand(batch + x.shape[-2:]).clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ts, is_causal=causal, scale=scale)
    if do is None:
        return out, None
    out.backward(do.double().cpu())
    grads = [t.grad.sum_to_size(x.shape) for t, x in zip(ts, (q, k, v))]  # undo the broadcast
    return out, grads


def run(q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = flash.flash_attention(q, k, v, **kw)
    out.backward(do)
    return out, [q.grad, k.grad, v.grad]


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


# (batch dims of q, k, v), L, S, E, Ev: L != S both ways, lengths off the tile grid, head sizes padded to 16, 32,
# 64 and 128, Ev != E, no batch dims, and batch dims that broadcast.
CASES = {
    "square": ((2, 3), (2, 3), (2, 3), 48, 48, 16, 16),
    "ragged-L<S": ((1, 2), (1, 2), (1, 2), 37, 53, 24, 24),
    "ragged-L>S": ((2,), (2,), (2,), 50, 19, 40, 40),
    "odd-head-72": ((1, 1), (1, 1), (1, 1), 33, 33, 72, 72),
    "head-128": ((1,), (1,), (1,), 40, 40, 128, 128),
    "Ev!=E": ((2,), (2,), (2,), 20, 35, 32, 8),
    "tiny-head": ((), (), (), 17, 18, 3, 5),
    "2-D": ((), (), (), 1, 1, 16, 16),
    "broadcast": ((2, 1), (1, 3), (1, 3), 21, 30, 16, 16),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_gradients_match_sdpa_float32(case, causal):
    bq, bk, bv, L, S, E, Ev = case
    q, k, v = randn(*bq, L, E), randn(*bk, S, E, seed=1), randn(*bv, S, Ev, seed=2)
    batch = torch.broadcast_shapes(bq, bk, bv)
    do = randn(*batch, L, Ev, seed=3)
    out, grads = run(q, k, v, do, causal=causal)
    expected, expected_grads = oracle(q, k, v, causal, do=do)
    assert out.dtype == torch.float32 and out.shape == batch + (L, Ev)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=2e-6)
    for name, got, want in zip("qkv", grads, expected_grads):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_custom_scale_and_non_contiguous_inputs():
    # (B, L, H, E) memory seen as (B, H, L, E): the kernels follow strides, they do not assume contiguity.
    q, k, v = (randn(2, n, 3, 32, seed=s).transpose(1, 2) for s, n in ((0, 24), (1, 40), (2, 40)))
    assert not q.is_contiguous()
    do = randn(2, 3, 24, 32, seed=3)
    out, grads = run(q, k, v, do, causal=True, scale=0.3)
    expected, expected_grads = oracle(q, k, v, True, scale=0.3, do=do)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=2e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [-0.5, -3.0, 0.0, 1e-30, 0.7])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_finite_scale_matches_the_reference_negative_and_zero_included(scale, causal):
    # a negative scale turns the row maximum into the minimum; 0 multiplies the masked -inf scores by 0. The
    # oracle is lib.attention in float64 (PyTorch's math SDPA scales q and k by sqrt(scale): NaN when negative).
    q, k, v = randn(1, 2, 32, 16, seed=4) * 2, randn(1, 2, 32, 16, seed=5) * 2, randn(1, 2, 32, 16, seed=6)
    do = randn(1, 2, 32, 16, seed=7)
    out, grads = run(q, k, v, do, causal=causal, scale=scale)
    ref = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    expected = attn.attention(*ref, causal=causal, scale=scale)
    expected.backward(do.double().cpu())
    expected, expected_grads = expected.detach(), [x.grad for x in ref]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=2e-5)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=2e-4, msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_kernels_states_merge_over_a_split_of_the_keys(causal):
    from lib.merge import attention_state, merge_states

    q, k, v = randn(2, 3, 40, 16, seed=8), randn(2, 3, 40, 16, seed=9), randn(2, 3, 40, 8, seed=10)
    out, lse = flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    want_out, want_lse = attention_state(*(x.double().cpu() for x in (q, k, v)), causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 40)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)  # natural log, not base 2
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=1e-5, atol=2e-6)
    # keys [0, 17) and [17, 40) by the kernel, merged with lib.merge: attention over all 40 keys. Causal, the
    # second part is the bottom rows of a top-left pattern; the rows with no key there get lse = -inf.
    first = flash.flash_attention(q, k[..., :17, :], v[..., :17, :], causal=causal, return_lse=True)
    if causal:  # queries 17.. over keys 17..: top-left on the lower-right block, and nothing for queries < 17
        low = flash.flash_attention(q[..., 17:, :], k[..., 17:, :], v[..., 17:, :], causal=True, return_lse=True)
        second = (torch.cat([torch.zeros_like(out[..., :17, :]), low[0]], -2),
                  torch.cat([torch.full_like(lse[..., :17], -math.inf), low[1]], -1))
    else:
        second = flash.flash_attention(q, k[..., 17:, :], v[..., 17:, :], return_lse=True)
    merged_out, merged_lse = merge_states([first, second])
    torch.testing.assert_close(merged_out.double().cpu(), want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(merged_lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


def test_the_logsumexp_is_differentiable():
    from lib.merge import attention_state

    q, k, v = randn(1, 2, 24, 16, seed=11), randn(1, 2, 30, 16, seed=12), randn(1, 2, 30, 8, seed=13)
    do, dlse = randn(1, 2, 24, 8, seed=14), randn(1, 2, 24, seed=15)
    ours = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash.flash_attention(*ours, return_lse=True)
    torch.autograd.backward([out, lse], [do, dlse])
    ref = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = attention_state(*ref)
    torch.autograd.backward([r_out, r_lse], [do.double().cpu(), dlse.double().cpu()])
    for name, a, b in zip("qkv", ours, ref):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=1e-4, atol=1e-5, msg=f"d{name}")
    only_lse = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    flash.flash_attention(*only_lse, return_lse=True)[1].sum().backward()  # the output unused: no NaN, no crash
    r_lse2 = attention_state(*(x.detach().double().cpu().requires_grad_() for x in (q, k, v)))[1]
    assert all(torch.isfinite(x.grad).all() for x in only_lse) and torch.isfinite(r_lse2).all()
    assert flash.flash_attention(q[..., :0, :], k, v, return_lse=True)[1].shape == (1, 2, 0)
    empty = flash.flash_attention(q, k[..., :0, :], v[..., :0, :], return_lse=True)[1]
    assert empty.shape == (1, 2, 24) and (empty == -math.inf).all()


@pytest.mark.parametrize("causal", [False, True])
def test_float16_is_as_close_as_sdpa_in_float16(causal):
    # The yardstick for half precision: our error against the float64 oracle is no worse than twice SDPA's own
    # float16 error (its CPU kernel, same inputs), plus a little.
    q, k, v = (randn(1, 2, n, 64, dtype=torch.float16, seed=s) for s, n in ((0, 45), (1, 60), (2, 60)))
    do = randn(1, 2, 45, 64, dtype=torch.float16, seed=3)
    out, grads = run(q, k, v, do, causal=causal)
    assert out.dtype == torch.float16 and all(g.dtype == torch.float16 for g in grads)
    expected, expected_grads = oracle(q, k, v, causal, do=do)
    theirs, their_grads = run_sdpa_cpu(q, k, v, do, causal)
    for got, sdpa_half, want in zip([out, *grads], [theirs, *their_grads], [expected, *expected_grads]):
        ours = (got.double().cpu() - want).abs().max().item()
        reference = (sdpa_half.double() - want).abs().max().item()
        assert ours <= 2 * reference + 1e-3, (ours, reference)


def run_sdpa_cpu(q, k, v, do, causal):
    ts = [x.detach().cpu().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ts, is_causal=causal)
    out.backward(do.cpu())
    return out, [t.grad for t in ts]


@needs_interpreter
def test_causal_skips_future_tiles_rather_than_masking_them():
    # Values past key 32 are NaN. A kernel that computed those tiles and masked the weights would still multiply
    # 0 by NaN; a kernel that skips them never reads them, so the first 32 queries stay exact.
    tile = flash.INTERPRETER_TILES
    assert tile.block_m == 16 and tile.block_n == 16
    q, k, v = randn(64, 16), randn(64, 16, seed=1), randn(64, 16, seed=2)
    v[32:] = float("nan")
    out = flash.flash_attention(q, k, v, causal=True)
    assert out[32:].isnan().any()
    expected, _ = oracle(q[:32], k[:32], v[:32], causal=True)
    torch.testing.assert_close(out[:32].double(), expected, rtol=1e-5, atol=2e-6)


def test_causal_takes_the_library_spellings_of_alignment():
    # The library spells causal alignment one way everywhere: True is "top-left"; "bottom-right" places the
    # diagonal S - L to the right, which this kernel cannot, so it is the same when L == S and refused otherwise.
    q, k, v = randn(2, 24, 16), randn(2, 24, 16, seed=1), randn(2, 24, 8, seed=2)
    top = flash.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(flash.flash_attention(q, k, v, causal="top-left"), top, rtol=0, atol=0)
    torch.testing.assert_close(flash.flash_attention(q, k, v, causal="bottom-right"), top, rtol=0, atol=0)
    with pytest.raises(ValueError, match="top-left.*flash_decode"):
        flash.flash_attention(q[:, :8], k, v, causal="bottom-right")
    with pytest.raises(ValueError, match="causal must be"):
        flash.flash_attention(q, k, v, causal="lower-right")
    with pytest.raises(TypeError, match="causal must be"):
        flash.flash_attention(q, k, v, causal=1.0)


def test_no_key_gives_zeros_and_no_query_gives_nothing():
    q, k, v = randn(2, 5, 16).requires_grad_(), randn(2, 0, 16), randn(2, 0, 8)
    out = flash.flash_attention(q, k, v)
    assert out.shape == (2, 5, 8) and (out == 0).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    assert flash.flash_attention(randn(2, 0, 16), randn(2, 4, 16), randn(2, 4, 8)).shape == (2, 0, 8)


def test_training_saves_nothing_of_size_L_by_S():
    L = S = 64
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    q, k, v = (randn(2, n, 16).requires_grad_() for n in (L, S, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        flash.flash_attention(q, k, v, causal=True).sum().backward()
    assert saved, "nothing was saved: the hook saw no tensor"
    assert max(math.prod(s) for s in saved) == 2 * L * 16  # q, k, v and the output; the logsumexp is 2 × L
    assert (2, L) in saved
    assert not any(s[-2:] == (L, S) for s in saved)


BAD_CALLS = [
    ("numpy", lambda q, k, v: flash.flash_attention(q.cpu().numpy(), k, v), TypeError, "torch tensors; q is a numpy"),
    ("mask", lambda q, k, v: flash.flash_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool)), ValueError,
     "takes no mask"),
    ("dtypes", lambda q, k, v: flash.flash_attention(q, k.half(), v), TypeError, "share one dtype"),
    ("float64", lambda q, k, v: flash.flash_attention(q.double(), k.double(), v.double()), TypeError, "float16"),
    ("ints", lambda q, k, v: flash.flash_attention(q.int(), k.int(), v.int()), TypeError, "float16"),
    ("E", lambda q, k, v: flash.flash_attention(q, k[..., :8], v), ValueError, "k has E=8 but q has E=16"),
    ("S", lambda q, k, v: flash.flash_attention(q, k, v[:, :3]), ValueError, "v has S=3 rows but k has S=8"),
    ("1-D", lambda q, k, v: flash.flash_attention(q[0, 0], k, v), ValueError, "at least 2-D"),
    ("head", lambda q, k, v: flash.flash_attention(*(torch.zeros(1, 4, 300, device=q.device) for _ in range(3))),
     ValueError, "E=300 is outside"),
    ("batch", lambda q, k, v: flash.flash_attention(q, k[:1].expand(3, 8, 16), v), ValueError, "do not broadcast"),
    ("causal", lambda q, k, v: flash.flash_attention(q, k, v, causal=1), TypeError, "causal must be False, True"),
    ("scale", lambda q, k, v: flash.flash_attention(q, k, v, scale="big"), TypeError, "scale must be a real"),
    ("devices", lambda q, k, v: flash.flash_attention(q, k.to("meta"), v), ValueError, "on one device"),
]


@pytest.mark.parametrize("call, exc, words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_named(call, exc, words):
    q, k, v = randn(2, 8, 16), randn(2, 8, 16, seed=1), randn(2, 8, 16, seed=2)
    with pytest.raises(exc, match=words):
        call(q, k, v)


def test_a_cpu_tensor_without_the_interpreter_says_how_to_run_it(monkeypatch):
    monkeypatch.setattr(flash, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flash.flash_attention(*(torch.zeros(4, 16) for _ in range(3)))


@needs_interpreter
def test_bfloat16_is_refused_in_the_interpreter():
    with pytest.raises(TypeError, match="bfloat16 is not supported in Triton's interpreter"):
        flash.flash_attention(*(torch.zeros(4, 16, dtype=torch.bfloat16) for _ in range(3)))


def test_the_numpy_reference_imports_neither_torch_nor_triton_and_a_missing_triton_is_named():
    code = (
        "import sys\n"
        "from lib import attention as attn\n"
        "from lib import tiles, cost, merge, positions, modules, decoding, paged\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)\n"
        "assert not hasattr(attn, 'flash_attention') and not hasattr(attn, 'flash_decode')\n"
        "sys.modules['triton'] = None\n"
        "try:\n"
        "    from lib import flash\n"
        "except ModuleNotFoundError as err:\n"
        "    assert 'pip install triton' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('no error without Triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})


def test_asking_for_the_interpreter_after_triton_was_imported_is_named():
    code = (
        "import os, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from lib import flash\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"})
    assert result.returncode != 0
    assert "set after Triton had been imported" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: realistic sizes, half precision
# ----------------------------------------------------------------------------------------------------------------


def errors_against_float32(fn, q, k, v, do, causal):
    """Max error of fn's output and gradients against SDPA in float32 on the same GPU."""
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    ref.backward(do.float())
    ts = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*ts, causal)
    out.backward(do)
    pairs = zip([out, *(t.grad for t in ts)], [ref, q32.grad, k32.grad, v32.grad])
    return [(a.float() - b).abs().max().item() for a, b in pairs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 1024, 64), (1, 8, 4096, 128), (1, 2, 8192, 64), (2, 3, 1000, 72)])
def test_cuda_half_precision_is_as_close_as_sdpa(shape, causal, dtype):
    B, H, n, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    ours = errors_against_float32(lambda q, k, v, c: flash.flash_attention(q, k, v, causal=c), q, k, v, do, causal)
    theirs = errors_against_float32(
        lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c), q, k, v, do, causal
    )
    for name, a, b in zip(["out", "dq", "dk", "dv"], ours, theirs):
        assert a <= 2 * b + 1e-3, f"{name}: ours {a:.2e}, SDPA in {dtype} {b:.2e}"


@pytest.mark.gpu
def test_cuda_float32_and_cross_attention_match_sdpa():
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 3, 300, 40, device="cuda", generator=g)
    k = torch.randn(2, 3, 517, 40, device="cuda", generator=g)
    v = torch.randn(2, 3, 517, 24, device="cuda", generator=g)
    do = torch.randn(2, 3, 300, 24, device="cuda", generator=g)
    for causal in (False, True):
        out, grads = run(q, k, v, do, causal=causal)
        expected, expected_grads = oracle(q, k, v, causal, do=do)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-5)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-4)


@needs_interpreter
def test_the_gpu_benchmark_runs_end_to_end_in_the_interpreter(tmp_path):
    # The benchmark's GPU timing cannot run here, but everything else can: every rung of the ladder, the comparison
    # with SDPA, the profiler's backend name at the timed shape and the CSV file that chapter 9 plots.
    table = tmp_path / "gpu.csv"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--device", "cpu", "--dtypes",
           "float32", "--d", "16", "--sizes", "20", "--batch", "1", "--heads", "2", "--reps", "1", "--csv", str(table)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert "sdpa runs _scaled_dot_product_flash_attention_for_cpu" in result.stdout
    for rung in flash.LADDER:  # full and causal, forward and forward + backward
        assert result.stdout.count(f"lib.flash_attention {rung} ") == 4, rung
    rows = table.read_text().splitlines()
    assert rows[0] == "device,torch,triton,cuda,date,timer,dtype,causal,d,n,pass,impl,backend,ms,tflops"
    assert len(rows) == 1 + 4 * (1 + len(flash.LADDER))
    assert {r.split(",")[11] for r in rows[1:]} == {"sdpa", *flash.LADDER}


# ----------------------------------------------------------------------------------------------------------------
# Chapter 9's timing cell: lib.speed.flash_against_sdpa on a GPU, the recorded run elsewhere
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_flash_against_sdpa_times_both_on_the_gpu():
    from lib import speed

    run = speed.flash_against_sdpa(batch=1, heads=4, n=1024, d=64, reps=2, rounds=2)
    assert run.device == torch.cuda.get_device_name() and run.torch == torch.__version__
    assert run.dtype == str(speed.half_dtype("cuda")).removeprefix("torch.")
    assert 0 < run.flash_ms < 1e3 and 0 < run.sdpa_ms < 1e3 and run.ratio == run.flash_ms / run.sdpa_ms
    assert run.timer in ("graph", "bench", "bench+graph") and "math" not in run.sdpa_backend
    assert all(len(line) <= 88 for line in run.lines())
    ms, used = speed.gpu_milliseconds(lambda: torch.ones(1, device="cuda"), "events")
    assert ms > 0 and used == "events"


def test_the_recorded_run_is_read_from_the_committed_csv():
    import csv

    from lib import speed

    path = os.path.join(ROOT, "benchmarks", "gpu_results.csv")
    with open(path) as f:
        rows = {(r["impl"], r["d"], r["causal"]): r for r in csv.DictReader(f)
                if (r["pass"], r["n"], r["dtype"]) == ("forward", "4096", "bfloat16")}
    for d, causal in ((64, False), (128, True)):
        run = speed.recorded_flash_against_sdpa(path, n=4096, d=d, causal=causal)
        ours, theirs = rows["+atomic-dq", str(d), str(causal)], rows["sdpa", str(d), str(causal)]
        assert (run.flash_ms, run.sdpa_ms) == (float(ours["ms"]), float(theirs["ms"]))
        assert (run.device, run.date, run.triton) == (ours["device"], ours["date"], ours["triton"])
        assert run.ratio == float(ours["ms"]) / float(theirs["ms"]) and run.sdpa_backend == "cudnn_attention"
        assert all(len(line) <= 88 for line in run.lines())
    with pytest.raises(ValueError, match="n 100"):
        speed.recorded_flash_against_sdpa(path, n=100)


def test_flash_against_sdpa_refuses_bad_arguments_and_a_machine_without_a_gpu():
    from lib import speed

    with pytest.raises(TypeError, match="n must be an int"):
        speed.flash_against_sdpa(n=4096.0)
    with pytest.raises(ValueError, match="heads must be at least 1"):
        speed.flash_against_sdpa(heads=0)
    with pytest.raises(ValueError, match="timer"):
        speed.flash_against_sdpa(timer="wall")
    with pytest.raises(ValueError, match="timer"):
        speed.gpu_milliseconds(lambda: None, "wall")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU|there is none"):
            speed.flash_against_sdpa()
