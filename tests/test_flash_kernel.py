"""lib.flash's launch machinery and design variants: every tile choice, every rung of the ladder, the addressing.

In Triton's interpreter (CPU, float32) each configuration that autotuning may pick on a GPU is forced in turn, so a
tile that miscomputes cannot hide behind the tuner's choice; each Variant's forward pass and gradients are checked
against SDPA. The tests marked ``gpu`` run where a CUDA device is present.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lib import flash

DEVICE = "cpu" if flash.INTERPRETED else "cuda"
needs_interpreter = pytest.mark.skipif(not flash.INTERPRETED, reason="forces tiles in the interpreter")


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


def reference(q, k, v, do, causal, scale):
    """SDPA in float64: output and the three gradients."""
    ts = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ts, is_causal=causal, scale=scale)
    out.backward(do.double().cpu())
    return out, [t.grad for t in ts]


def close(got, want, what):
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=2e-5, msg=what)


# Lengths off every tile grid (100 and 90 against tiles of 32 to 128), head 24 padded to 32.
Z, L, S, E = 1, 100, 90, 24
SCALE = E**-0.5


@pytest.fixture(scope="module")
def problem():
    q, k, v, do = randn(Z, L, E), randn(Z, S, E, seed=1), randn(Z, S, E, seed=2), randn(Z, L, E, seed=3)
    return q, k, v, do, {c: reference(q, k, v, do, c, SCALE) for c in (False, True)}


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("tiles", flash.FORWARD_TILES, ids=str)
def test_every_forward_tile_choice_computes_attention(problem, tiles, tma, causal):
    q, k, v, _, expected = problem
    assert flash._tma_ready(k, v)  # so the tma case really takes the descriptors
    o, lse = flash._forward(q, k, v, causal, SCALE, tiles=tiles, variant=flash.Variant(tma=tma))
    close(o, expected[causal][0], f"output with {tiles}")
    s = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    close(lse, torch.logsumexp(s, -1) / math.log(2), "logsumexp, base 2")


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("atomic, tiles", [(True, t) for t in flash.BACKWARD_KV_ATOMIC_TILES]
                         + [(False, t) for t in flash.BACKWARD_KV_TILES], ids=str)
def test_every_dk_dv_tile_choice_computes_the_gradients(problem, tiles, atomic, causal):
    q, k, v, do, expected = problem
    variant = flash.Variant(atomic_dq=atomic)
    o, lse = flash._forward(q, k, v, causal, SCALE)
    grads = flash._backward(q, k, v, o, lse, do, causal, SCALE, tiles=tiles, variant=variant)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected[causal][1]):
        close(got, want, f"{name} with {tiles}")


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", flash.BACKWARD_Q_TILES, ids=str)
def test_every_dq_tile_choice_computes_dq(problem, tiles, causal):
    q, k, v, do, expected = problem
    o, lse = flash._forward(q, k, v, causal, SCALE)
    dq, _, _ = flash._backward(q, k, v, o, lse, do, causal, SCALE, variant=flash.DETERMINISTIC, q_tiles=tiles)
    close(dq, expected[causal][1][0], f"dq with {tiles}")


def test_tile_lists_keep_the_tensor_core_shapes():
    # wgmma takes 64 rows of the left operand per warpgroup: the dQ kernel's left operand is a query tile, the
    # dK/dV kernel's a key tile. Smaller tiles compile to the older mma.sync (tools/compile_report.py shows it).
    assert all(t.block_m >= 64 for t in flash.FORWARD_TILES + flash.BACKWARD_Q_TILES)
    assert all(t.block_n >= 64 for t in flash.BACKWARD_KV_TILES + flash.BACKWARD_KV_ATOMIC_TILES)
    for tiles in (flash.FORWARD_TILES, flash.BACKWARD_KV_TILES, flash.BACKWARD_KV_ATOMIC_TILES, flash.BACKWARD_Q_TILES):
        assert len(set(tiles)) == len(tiles) and any(t.max_head >= 128 for t in tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rung", flash.LADDER, ids=str)
def test_every_rung_of_the_ladder_matches_sdpa(rung, causal):
    # Ragged both ways against the interpreter's 16-wide tiles, with a batch that broadcasts.
    q, k, v, do = randn(2, 1, 37, 24), randn(1, 2, 53, 24, seed=1), randn(1, 2, 53, 8, seed=2), randn(2, 2, 37, 8,
                                                                                                       seed=3)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flash.flash_attention(*leaves, causal=causal, variant=flash.LADDER[rung])
    out.backward(do)
    ts = [x.detach().double().cpu().expand(2, 2, *x.shape[-2:]).clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ts, is_causal=causal)
    want.backward(do.double().cpu())
    close(out, want.detach(), f"{rung} output")
    for name, leaf, t in zip("qkv", leaves, ts):
        close(leaf.grad, t.grad.sum_to_size(leaf.shape), f"{rung} d{name}")


def test_scores_far_below_zero_leave_ragged_keys_harmless():
    # Every score near -400: the logsumexp, in base 2, is near -577. A key past S loads as zeros, and its weight
    # exp2(0 - lse) overflows to inf: the atomic dQ path must mask it, or dQ turns NaN.
    q = torch.full((1, 20, 16), 10.0, device=DEVICE) + randn(1, 20, 16)
    k = torch.full((1, 20, 16), -10.0, device=DEVICE) + randn(1, 20, 16, seed=1)
    v, do = randn(1, 20, 16, seed=2), randn(1, 20, 16, seed=3)
    for causal in (False, True):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        flash.flash_attention(*leaves, causal=causal).backward(do)
        _, grads = reference(q, k, v, do, causal, 0.25)
        for name, leaf, want in zip("qkv", leaves, grads):
            assert leaf.grad.isfinite().all(), name
            # float32 scores near -400 carry absolute errors near 1e-5 into the weights: compare at that scale
            torch.testing.assert_close(leaf.grad.double().cpu(), want, rtol=1e-3, atol=2e-3 * want.abs().max().item())


def test_descriptors_only_where_strides_allow_them():
    x = randn(2, 10, 24)
    assert flash._tma_ready(x, x)
    assert not flash._tma_ready(randn(2, 10, 3))  # rows of 12 bytes: not 16-byte aligned
    assert not flash._tma_ready(x.transpose(1, 2))  # last stride not 1
    q, k, v = randn(1, 20, 3), randn(1, 20, 3, seed=1), randn(1, 20, 3, seed=2)
    out = flash.flash_attention(q, k, v, variant=flash.LADDER["+tma"])  # falls back to pointer loads
    close(out, reference(q, k, v, torch.zeros_like(q), False, 3**-0.5)[0], "output, pointer fallback")


def test_the_delta_kernel_matches_the_eager_sum():
    o, do = randn(3, 70, 40), randn(3, 70, 40, seed=1)
    got = flash._delta(o, do, flash.Variant(delta_kernel=True))
    want = flash._delta(o, do, flash.Variant(delta_kernel=False))
    assert got.shape == (3, 70) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_deterministic_runs_the_two_kernel_backward(monkeypatch):
    calls = []
    real = flash._run_backward_q
    monkeypatch.setattr(flash, "_run_backward_q", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (randn(1, 20, 16, seed=s).requires_grad_() for s in range(3))
    flash.flash_attention(q, k, v, deterministic=True).sum().backward()
    assert calls == [1]
    flash.flash_attention(q, k, v).sum().backward()
    assert calls == [1]  # the default sums dQ inside the dK/dV kernel


@pytest.mark.parametrize("kw, exc, words", [
    ({"deterministic": 1}, TypeError, "deterministic must be True or False"),
    ({"variant": "best"}, TypeError, "variant must be a lib.flash.Variant"),
    ({"variant": flash.Variant(), "deterministic": True}, ValueError, "atomic_dq=False"),
])
def test_bad_variant_arguments_are_named(kw, exc, words):
    x = randn(4, 16)
    with pytest.raises(exc, match=words):
        flash.flash_attention(x, x, x, **kw)


def test_the_grid_is_one_axis_so_batch_times_heads_has_no_65535_limit():
    grid = flash._grid(1000, 70_000, "BLOCK_M")({"BLOCK_M": 64})
    assert grid == (16 * 70_000,)  # CUDA's first grid axis takes 2**31 - 1 programs, its second only 65,535


def test_the_autotune_key_buckets_lengths_and_includes_batch_times_heads():
    assert [flash._bucket(n) for n in (1, 1000, 1024, 1025, 4096, 70_000)] == [1, 1024, 1024, 2048, 4096, 131072]
    for kernel in (flash._flash_forward, flash._flash_backward_kv, flash._flash_backward_q):
        keys = flash._tune_keys(kernel)
        assert {"TUNE_L", "TUNE_S", "TUNE_Z"} <= set(keys) and "L" not in keys and "S" not in keys


def test_the_launch_runs_under_the_tensors_own_device():
    assert isinstance(flash._device_guard(torch.device("cpu")), type(flash.contextlib.nullcontext()))
    guard = flash._device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


@pytest.mark.gpu
def test_cuda_more_than_65535_batch_heads_launch():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(70_000, 16, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    out = flash.flash_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensors_on_a_second_device_run_there():
    q, k, v = (torch.randn(2, 256, 64, device="cuda:1", dtype=torch.float16) for _ in range(3))
    torch.cuda.set_device(0)
    out = flash.flash_attention(q, k, v)
    assert out.device == q.device
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_long_rows_through_a_strided_view_past_2_to_the_31(causal):
    # A (1, L, H, E) tensor seen as (1, H, L, E): row stride H · E = 4,096, so row 524,288 sits at 2**31 elements.
    L, H, E = 524_288 + 64, 32, 128
    x = torch.zeros(1, L, H, E, device="cuda", dtype=torch.bfloat16)
    x[0, -64:, 0] = 1.0
    q = k = v = x.transpose(1, 2)
    out = flash.flash_attention(q[:, :1], k[:, :1], v[:, :1], causal=causal)
    assert out[0, 0, -1].float().sum().item() > 0  # the last rows were read, not wrapped to the start


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rung", list(flash.LADDER))
def test_cuda_every_rung_is_as_close_as_sdpa_in_bfloat16(rung, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))

    def errors(fn):
        ref_leaves = [x.float().detach().requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal)
        ref.backward(do.float())
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(do)
        pairs = zip([out, *(t.grad for t in leaves)], [ref, *(t.grad for t in ref_leaves)])
        return [(a.float() - b).abs().max().item() for a, b in pairs]

    ours = errors(lambda q, k, v: flash.flash_attention(q, k, v, causal=causal, variant=flash.LADDER[rung]))
    theirs = errors(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    for name, a, b in zip(["out", "dq", "dk", "dv"], ours, theirs):
        assert a <= 2 * b + 1e-3, f"{rung} {name}: ours {a:.2e}, SDPA {b:.2e}"


@needs_interpreter
@settings(max_examples=12, deadline=None)
@given(
    L=st.integers(1, 40), S=st.integers(1, 40), E=st.integers(1, 40), Ev=st.integers(1, 20),
    causal=st.booleans(), rung=st.sampled_from(sorted(flash.LADDER)), seed=st.integers(0, 2**16),
)
def test_any_shape_and_rung_matches_sdpa(L, S, E, Ev, causal, rung, seed):
    q, k, v, do = randn(2, L, E, seed=seed), randn(2, S, E, seed=seed + 1), randn(2, S, Ev, seed=seed + 2), \
        randn(2, L, Ev, seed=seed + 3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash.flash_attention(*leaves, causal=causal, variant=flash.LADDER[rung])
    out.backward(do)
    want, grads = reference(q, k, v, do, causal, E**-0.5)
    close(out, want.detach(), f"{rung} output")
    for name, leaf, g in zip("qkv", leaves, grads):
        close(leaf.grad, g, f"{rung} d{name}")
