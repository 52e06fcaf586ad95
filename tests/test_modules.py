"""lib.modules: the NumPy and torch attention twins (one head, many heads) against each other and nn.MultiheadAttention."""

import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from lib import attention as attn
from lib import decoding, modules
from lib.modules import (
    MultiHeadAttention,
    SelfAttention,
    grouped_attention,
    merge_heads,
    split_heads,
    xavier_bound,
)
from lib.nn import (
    TorchMultiHeadAttention,
    TorchSelfAttention,
    from_multihead_attention,
    to_multihead_attention,
)

TOL32 = {"rtol": 1e-5, "atol": 1e-6}


def twins(d_model=32, d_k=16, d_v=None, d_out=None, seed=0):
    """A NumPy module and a torch module holding the same weights."""
    np_mod = SelfAttention(d_model, d_k, d_v, d_out, rng=seed)
    torch_mod = TorchSelfAttention(d_model, d_k, d_v, d_out)
    torch_mod.load_state_dict({n: torch.from_numpy(w) for n, w in np_mod.state_dict().items()})
    return np_mod, torch_mod


def tokens(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Shapes, initialisation, import
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, batch, out_size",
    [((32, 16), (), 16), ((32, 16, 8), (3,), 8), ((32, 16, 8, 32), (2, 3), 32), ((4, 4, 4, 4), (1,), 4)],
)
def test_shapes(sizes, batch, out_size):
    np_mod, torch_mod = twins(*sizes)
    x = tokens(*batch, 8, sizes[0])
    out, weights = np_mod(x, return_weights=True)
    assert out.shape == batch + (8, out_size) and weights.shape == batch + (8, 8)
    t_out, t_weights = torch_mod(torch.from_numpy(x), return_weights=True)
    assert tuple(t_out.shape) == out.shape and tuple(t_weights.shape) == weights.shape


def test_the_chapter_run_8_tokens_of_32_to_16():
    out, weights = SelfAttention(32, 16, rng=0)(tokens(8, 32), return_weights=True)
    assert out.shape == (8, 16) and weights.shape == (8, 8)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
    assert out.dtype == np.float32 and weights.dtype == np.float32


def test_parameter_names_and_counts_match():
    np_mod, torch_mod = twins(32, 16, 8, 24)
    assert list(np_mod.state_dict()) == list(torch_mod.state_dict()) == ["w_q", "w_k", "w_v", "w_o"]
    assert np_mod.num_parameters() == torch_mod.num_parameters() == 32 * 16 * 2 + 32 * 8 + 8 * 24
    assert list(SelfAttention(8, 4).state_dict()) == list(TorchSelfAttention(8, 4).state_dict()) == ["w_q", "w_k", "w_v"]


def test_xavier_bound_is_torch_xavier_uniform():
    for fan_in, fan_out in [(32, 16), (512, 64), (7, 3)]:
        a = xavier_bound(fan_in, fan_out)
        std = math.sqrt(2.0 / (fan_in + fan_out))  # the std torch.nn.init.xavier_uniform_ aims for, gain 1
        assert a == pytest.approx(math.sqrt(3.0) * std)
        w = torch.nn.init.xavier_uniform_(torch.empty(fan_out, fan_in))
        assert float(w.abs().max()) <= a


def test_initial_weights_have_xavier_variance():
    torch.manual_seed(0)
    np_mod, torch_mod = SelfAttention(400, 200, rng=0), TorchSelfAttention(400, 200)
    target = 2.0 / (400 + 200)
    for mod_weights in (np_mod.state_dict(), {n: p.detach().numpy() for n, p in torch_mod.state_dict().items()}):
        for w in mod_weights.values():
            assert abs(float(np.var(w)) / target - 1) < 0.03
            assert float(np.abs(w).max()) <= xavier_bound(400, 200)


def test_the_same_seed_gives_the_same_weights():
    a, b = SelfAttention(16, 8, rng=3), SelfAttention(16, 8, rng=3)
    for n, w in a.state_dict().items():
        np.testing.assert_array_equal(w, b.state_dict()[n])


def test_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import numpy as np\n"
        "from lib.modules import SelfAttention\n"
        "out = SelfAttention(6, 4, rng=0)(np.ones((3, 6)))\n"
        "assert out.shape == (3, 4)\n"
    )
    root = pathlib.Path(modules.__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------------------------------
# Parity: NumPy vs torch, and both vs nn.MultiheadAttention
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(32, 16), (32, 16, 8), (32, 16, 8, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_and_torch_agree(sizes, causal):
    np_mod, torch_mod = twins(*sizes)
    x = tokens(2, 8, 32)
    out, weights = np_mod(x, causal=causal, return_weights=True)
    t_out, t_weights = torch_mod(torch.from_numpy(x), causal=causal, return_weights=True)
    np.testing.assert_allclose(t_out.detach().numpy(), out, **TOL32)
    np.testing.assert_allclose(t_weights.detach().numpy(), weights, **TOL32)


def test_module_is_the_library_attention_on_its_projections():
    np_mod = SelfAttention(12, 5, 7, rng=2)
    x = tokens(6, 12)
    expected = attn.attention(x @ np_mod.w_q, x @ np_mod.w_k, x @ np_mod.w_v)
    np.testing.assert_allclose(np_mod(x), expected, rtol=1e-6, atol=1e-7)  # float32: near-zero entries need an absolute bound


def packed_by_hand(torch_mod):
    """nn.MultiheadAttention with one head and no biases, its weights copied in without the library's helper."""
    D = torch_mod.d_model
    mha = torch.nn.MultiheadAttention(D, 1, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([torch_mod.w_q.T, torch_mod.w_k.T, torch_mod.w_v.T]))
        mha.out_proj.weight.copy_(torch_mod.w_o.T)
    return mha


@pytest.mark.parametrize("d_out", [16, None])
def test_agrees_with_multihead_attention(d_out):
    np_mod, torch_mod = twins(16, 16, 16, d_out)
    x = torch.from_numpy(tokens(3, 8, 16))
    expected = torch_mod(x)
    for source in (np_mod, torch_mod):
        mha = to_multihead_attention(source)
        out, weights = mha(x, x, x)
        torch.testing.assert_close(out, expected, **TOL32)
        torch.testing.assert_close(weights, torch_mod(x, return_weights=True)[1], **TOL32)
    if d_out is not None:
        torch.testing.assert_close(packed_by_hand(torch_mod)(x, x, x)[0], expected, **TOL32)


def test_causal_mask_passes_through_with_multihead_attention_polarity():
    _, torch_mod = twins(16, 16, 16, 16)
    x = torch.from_numpy(tokens(2, 8, 16))
    allowed = attn.causal_mask(8, like=x)  # True = may attend
    expected = torch_mod(x, causal=True)
    torch.testing.assert_close(torch_mod(x, allowed), expected)
    out, _ = to_multihead_attention(torch_mod)(x, x, x, attn_mask=~allowed)  # MHA: True = may NOT attend
    torch.testing.assert_close(out, expected, **TOL32)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_future_tokens_cannot_change_earlier_outputs(backend):
    np_mod, torch_mod = twins(32, 16, 16, 32)
    x = tokens(8, 32)
    changed = x.copy()
    changed[5:] = tokens(3, 32, seed=9)
    if backend == "numpy":
        a, b = np_mod(x, causal=True), np_mod(changed, causal=True)
    else:
        a, b = (torch_mod(torch.from_numpy(v), causal=True).detach().numpy() for v in (x, changed))
    np.testing.assert_array_equal(a[:5], b[:5])
    assert not np.allclose(a[5:], b[5:])


def test_padding_mask_passes_through():
    np_mod, _ = twins(32, 16)
    x = tokens(2, 6, 32)
    out = np_mod(x, attn.padding_mask([4, 6], 6, heads=False))
    np.testing.assert_allclose(out[0, :4], np_mod(x[0, :4])[:4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], np_mod(x[1]), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------
# Training, dropout, dtypes, devices
# ----------------------------------------------------------------------------------------------------------------


def test_one_gradient_step_lowers_the_loss():
    torch.manual_seed(0)
    student, teacher = TorchSelfAttention(16, 8, d_out=16), TorchSelfAttention(16, 8, d_out=16)
    x = torch.randn(4, 6, 16)
    with torch.no_grad():
        target = teacher(x)
    optimiser = torch.optim.SGD(student.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss(student(x), target)
    loss.backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in student.parameters())
    optimiser.step()
    with torch.no_grad():
        after = torch.nn.functional.mse_loss(student(x), target)
    assert float(after) < float(loss.detach())


def test_dropout_acts_only_while_training():
    torch.manual_seed(0)
    mod = TorchSelfAttention(16, 8, dropout=0.5)
    x = torch.randn(6, 16)
    mod.eval()
    _, plain_w = mod(x, return_weights=True)
    np.testing.assert_allclose(plain_w.sum(-1).detach().numpy(), 1.0, rtol=1e-6)
    mod.train()
    dropped_out, dropped_w = mod(x, return_weights=True)
    kept = dropped_w != 0
    assert not bool(kept.all())
    torch.testing.assert_close(dropped_w[kept], 2 * plain_w[kept])  # survivors are scaled by 1 / (1 - p)
    torch.testing.assert_close(dropped_out, dropped_w @ (x @ mod.w_v))


def test_float32_stays_float32_and_bfloat16_runs():
    np_mod, torch_mod = twins(16, 8)
    x = tokens(5, 16)
    assert np_mod(x).dtype == np.float32
    reference = torch_mod(torch.from_numpy(x))
    half = torch_mod.to(torch.bfloat16)
    out = half(torch.from_numpy(x).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


def test_load_state_dict_round_trip_from_torch():
    np_mod, torch_mod = twins(16, 8, 4, 16)
    with torch.no_grad():
        for p in torch_mod.parameters():
            p.mul_(2)
    np_mod.load_state_dict(torch_mod.state_dict())
    x = tokens(5, 16)
    np.testing.assert_allclose(np_mod(x), torch_mod(torch.from_numpy(x)).detach().numpy(), **TOL32)


@pytest.mark.gpu
def test_parity_on_cuda():
    np_mod, torch_mod = twins(32, 16, 16, 32)  # d_k = 16 < d_model: one head, not convertible to nn.MultiheadAttention
    x = tokens(2, 8, 32)
    xc = torch.from_numpy(x).to("cuda")
    out = torch_mod.to("cuda")(xc, causal=True)
    assert out.device.type == "cuda"
    np.testing.assert_allclose(out.cpu().detach().numpy(), np_mod(x, causal=True), rtol=1e-4, atol=1e-5)
    _, square = twins(32, 32, 32, 32)  # d_k = d_v = d_out = d_model: what one head of nn.MultiheadAttention holds
    square = square.to("cuda")
    mha_out, _ = to_multihead_attention(square)(xc, xc, xc)
    torch.testing.assert_close(mha_out, square(xc), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multihead_parity_on_cuda(dtype):
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(64, 4, device="cuda", dtype=dtype).eval()
    x = torch.randn(2, 128, 64, device="cuda", dtype=dtype)
    mha = to_multihead_attention(mod).eval()
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(mod(x, causal=True), mha(x, x, x, attn_mask=~attn.causal_mask(128, like=x))[0], **tol)
    torch.testing.assert_close(mod(x), mod(x, return_weights=True)[0], **tol)  # fused kernel against the reference


# ----------------------------------------------------------------------------------------------------------------
# Bad input is named
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SelfAttention, TorchSelfAttention])
@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((0, 4), ValueError, "d_model must be at least 1"),
        ((8, -1), ValueError, "d_k must be at least 1"),
        ((8, 4, 0), ValueError, "d_v must be at least 1"),
        ((8, 4.0), TypeError, "d_k must be an integer"),
        ((8, 4, None, True), TypeError, "d_out must be an integer"),
    ],
)
def test_bad_sizes_are_named(cls, args, exc, words):
    with pytest.raises(exc, match=words):
        cls(*args)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_wrong_d_model_is_named(backend):
    np_mod, torch_mod = twins(32, 16)
    x = tokens(8, 31)
    mod, x = (np_mod, x) if backend == "numpy" else (torch_mod, torch.from_numpy(x))
    with pytest.raises(ValueError, match=r"x has d_model=31 .* built for d_model=32"):
        mod(x)
    with pytest.raises(ValueError, match="at least 2-D"):
        mod(x[0, :0] if backend == "numpy" else torch.zeros(32))


def test_torch_module_names_dtype_device_and_type_problems():
    _, torch_mod = twins(8, 4)
    with pytest.raises(ValueError, match="dtype torch.float64 but the module's weights are torch.float32"):
        torch_mod(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        torch_mod(np.zeros((3, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="dropout must be a probability"):
        TorchSelfAttention(8, 4, dropout=1.0)


def test_bad_state_and_multihead_sizes_are_named():
    np_mod = SelfAttention(8, 4, rng=0)
    with pytest.raises(ValueError, match=r"w_q has shape \(4, 8\) but .* needs \(8, 4\)"):
        np_mod.load_state_dict({**np_mod.state_dict(), "w_q": np.zeros((4, 8))})
    with pytest.raises(ValueError, match="state has parameters"):
        np_mod.load_state_dict({"w_q": np_mod.w_q})
    with pytest.raises(ValueError, match="d_k=4 but d_model=8"):
        to_multihead_attention(np_mod)
    with pytest.raises(ValueError, match="d_out=6 but d_model=8"):
        to_multihead_attention(SelfAttention(8, 8, d_out=6))


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = modules.Nope


# ================================================================================================================
# Multi-head attention (chapter 10)
# ================================================================================================================


def mh_twins(d_model=12, n_heads=3, n_kv_heads=None, seed=0):
    """A NumPy and a torch multi-head module holding the same weights."""
    np_mod = MultiHeadAttention(d_model, n_heads, n_kv_heads, rng=seed)
    torch_mod = TorchMultiHeadAttention(d_model, n_heads, n_kv_heads)
    torch_mod.load_state_dict({n: torch.from_numpy(w) for n, w in np_mod.state_dict().items()})
    return np_mod, torch_mod.eval()


def sdpa_kernels(fn):
    """Names of the aten scaled-dot-product kernels that ran inside fn()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}


# ----------------------------------------------------------------------------------------------------------------
# Heads: split, merge, grouped
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_split_heads_gives_each_head_its_columns_and_merge_undoes_it(backend):
    x = tokens(2, 5, 12)
    x = torch.from_numpy(x) if backend == "torch" else x
    heads = split_heads(x, 3)
    assert tuple(heads.shape) == (2, 3, 5, 4)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(heads[:, i]), np.asarray(x[..., 4 * i : 4 * (i + 1)]))
    np.testing.assert_array_equal(np.asarray(merge_heads(heads)), np.asarray(x))
    assert tuple(split_heads(x[0], 4).shape) == (4, 5, 3)  # no batch dimension


def test_a_reshape_without_transpose_mixes_tokens():
    x = tokens(2, 5, 12)
    wrong = x.reshape(2, 3, 5, 4)  # the same shape as split_heads(x, 3), other numbers
    assert wrong.shape == split_heads(x, 3).shape
    np.testing.assert_array_equal(wrong[0, 0, 1], x[0, 0, 4:8])  # "head 0, token 1" is token 0's second head
    assert not np.array_equal(wrong, split_heads(x, 3))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_grouped_attention_is_attention_on_repeated_kv_heads(backend, n_kv):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 4, 5, 3), (2, n_kv, 7, 3), (2, n_kv, 7, 6)])
    g = 4 // n_kv
    expected = attn.attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1))  # head i reads kv head i // g
    if backend == "torch":
        q, k, v = (torch.from_numpy(t) for t in (q, k, v))
    out, weights = grouped_attention(q, k, v, return_weights=True)
    assert tuple(out.shape) == (2, 4, 5, 6) and tuple(weights.shape) == (2, 4, 5, 7)
    np.testing.assert_allclose(np.asarray(out), expected, **TOL32)
    if backend == "torch":
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, sdpa, **TOL32)
        torch.testing.assert_close(sdpa, torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)), **TOL32)


def test_grouped_attention_causal_true_is_top_left_as_is_causal_and_bottom_right_is_named():
    rng = np.random.default_rng(4)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in [(1, 2, 3, 4), (1, 2, 8, 4), (1, 2, 8, 4)])
    bottom_right = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 8))
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(top_left, bottom_right, atol=1e-3)
    torch.testing.assert_close(grouped_attention(q, k, v, causal="bottom-right"), bottom_right, **TOL32)
    for spelling in (True, "top-left"):
        torch.testing.assert_close(grouped_attention(q, k, v, causal=spelling), top_left, **TOL32)
    with pytest.raises(ValueError, match="first 5 queries with no key"):
        grouped_attention(k, q, q, causal="bottom-right")


# ----------------------------------------------------------------------------------------------------------------
# Parity with nn.MultiheadAttention
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_multihead_agrees_with_nn_multihead_attention(n_heads):
    torch.manual_seed(n_heads)
    mod = TorchMultiHeadAttention(16, n_heads).eval()
    mha = to_multihead_attention(mod).eval()
    x = torch.randn(3, 6, 16)
    out, weights = mod(x, return_weights=True)
    ref, ref_weights = mha(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(mod(x), ref, **TOL32)  # the fused path
    torch.testing.assert_close(out, ref, **TOL32)  # the reference path that also returns the weights
    torch.testing.assert_close(weights, ref_weights, **TOL32)
    assert tuple(weights.shape) == (3, n_heads, 6, 6)


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_masks_agree_with_nn_multihead_attention_once_flipped(n_heads):
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(16, n_heads).eval()
    mha = to_multihead_attention(mod).eval()
    x = torch.randn(3, 6, 16)
    may_attend = attn.causal_mask(6, like=x)  # True = may attend
    pad = attn.padding_mask(torch.tensor([6, 4, 2]), 6, heads=False)  # (B, 1, S), True on real tokens
    key_padding_mask = ~pad[:, 0, :]  # nn.MultiheadAttention: (B, S), True = ignore
    cases = [
        (mod(x, causal=True), mha(x, x, x, attn_mask=~may_attend)[0]),
        (mod(x, may_attend), mha(x, x, x, attn_mask=~may_attend)[0]),
        (mod(x, pad), mha(x, x, x, key_padding_mask=key_padding_mask)[0]),
        (mod(x, pad, causal=True), mha(x, x, x, attn_mask=~may_attend, key_padding_mask=key_padding_mask)[0]),
    ]
    for ours, theirs in cases:
        torch.testing.assert_close(ours, theirs, **TOL32)
    additive = torch.zeros(6, 6).masked_fill(~may_attend, -math.inf)  # a floating mask: added in both conventions
    torch.testing.assert_close(mod(x, additive), mha(x, x, x, attn_mask=additive)[0], **TOL32)


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_cross_attention_with_a_different_key_length(n_heads):
    torch.manual_seed(1)
    mod = TorchMultiHeadAttention(16, n_heads).eval()
    mha = to_multihead_attention(mod).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    pad = attn.padding_mask(torch.tensor([9, 6]), 9, heads=False)
    out, weights = mod(x, pad, context=memory, return_weights=True)
    ref, ref_weights = mha(x, memory, memory, key_padding_mask=~pad[:, 0, :], average_attn_weights=False)
    assert tuple(out.shape) == (2, 5, 16) and tuple(weights.shape) == (2, n_heads, 5, 9)
    torch.testing.assert_close(out, ref, **TOL32)
    torch.testing.assert_close(weights, ref_weights, **TOL32)
    torch.testing.assert_close(mod(x, pad, context=memory), ref, **TOL32)


def test_loading_from_nn_multihead_attention_and_back():
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()  # biases present but zero, as built
    mod = from_multihead_attention(mha).eval()
    assert (mod.n_heads, mod.d_head) == (4, 4) and isinstance(mod, TorchMultiHeadAttention)
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(mod(x), mha(x, x, x)[0], **TOL32)
    again = to_multihead_attention(mod)
    torch.testing.assert_close(again.in_proj_weight, mha.in_proj_weight)
    torch.testing.assert_close(again.out_proj.weight, mha.out_proj.weight)


def test_conversions_keep_the_dropout_probability():
    # A converted module must train with the dropout of the original, in either direction.
    for mod in (TorchMultiHeadAttention(16, 4, dropout=0.25), TorchSelfAttention(8, 8, dropout=0.25)):
        mha = to_multihead_attention(mod)
        assert mha.dropout == 0.25
    assert from_multihead_attention(to_multihead_attention(TorchMultiHeadAttention(16, 4, dropout=0.25))).dropout == 0.25
    assert to_multihead_attention(MultiHeadAttention(16, 4, rng=0)).dropout == 0.0


def test_numpy_module_converts_to_nn_multihead_attention():
    np_mod, _ = mh_twins(16, 4)
    x = tokens(2, 6, 16)
    out, _ = to_multihead_attention(np_mod)(*[torch.from_numpy(x)] * 3)
    np.testing.assert_allclose(out.detach().numpy(), np_mod(x), **TOL32)


# ----------------------------------------------------------------------------------------------------------------
# The twins, grouped-query attention, the fused kernel
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(12, 3), (12, 1), (24, 6, 3), (24, 6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_numpy_and_torch_agree(sizes, causal):
    np_mod, torch_mod = mh_twins(*sizes)
    x = tokens(2, 5, sizes[0])
    out, weights = np_mod(x, causal=causal, return_weights=True)
    t_out, t_weights = torch_mod(torch.from_numpy(x), causal=causal, return_weights=True)
    np.testing.assert_allclose(t_out.detach().numpy(), out, **TOL32)
    np.testing.assert_allclose(t_weights.detach().numpy(), weights, **TOL32)
    np.testing.assert_allclose(torch_mod(torch.from_numpy(x), causal=causal).detach().numpy(), out, **TOL32)


def test_multihead_twins_agree_on_cross_attention_masks_and_batches():
    np_mod, torch_mod = mh_twins(12, 3)
    x, memory = tokens(3, 2, 5, 12), tokens(3, 2, 7, 12, seed=2)  # two batch dimensions
    mask = np.random.default_rng(5).random((3, 1, 5, 7)) > 0.3
    out = np_mod(x, mask, context=memory, causal=True)
    t_out = torch_mod(torch.from_numpy(x), torch.from_numpy(mask), context=torch.from_numpy(memory), causal=True)
    np.testing.assert_allclose(t_out.detach().numpy(), out, **TOL32)


def test_grouped_query_module_is_multihead_with_repeated_kv_heads():
    gqa = TorchMultiHeadAttention(24, 6, 2).eval()
    full = TorchMultiHeadAttention(24, 6).eval()
    d, g = gqa.d_head, 3

    def repeat_heads(w):  # (D, Hkv·d) -> (D, H·d): each key/value head's columns repeated for its g query heads
        return w.reshape(24, 2, 1, d).expand(24, 2, g, d).reshape(24, 6 * d)

    full.load_state_dict({"w_q": gqa.w_q, "w_k": repeat_heads(gqa.w_k), "w_v": repeat_heads(gqa.w_v), "w_o": gqa.w_o})
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(gqa(x, causal=True), full(x, causal=True), **TOL32)
    torch.testing.assert_close(gqa(x, return_weights=True)[1], full(x, return_weights=True)[1], **TOL32)
    assert gqa.num_parameters() == 2 * 24 * 24 + 2 * 24 * 2 * d < full.num_parameters() == 4 * 24 * 24


def test_heads_cost_the_parameters_of_one_wide_head():
    assert MultiHeadAttention(12, 3).num_parameters() == MultiHeadAttention(12, 1).num_parameters() == 4 * 12 * 12
    assert TorchMultiHeadAttention(12, 4).num_parameters() == 4 * 12 * 12
    assert list(MultiHeadAttention(12, 3).state_dict()) == list(TorchMultiHeadAttention(12, 3).state_dict())


def test_torch_module_runs_a_fused_kernel_on_4d_heads():
    _, mod = mh_twins(16, 4)
    x = torch.randn(2, 32, 16)
    fused = sdpa_kernels(lambda: mod(x, causal=True))
    assert fused and all("math" not in name for name in fused), fused
    unbatched = sdpa_kernels(lambda: mod(x[0]))  # one sequence: still viewed as (1, H, L, d)
    assert unbatched and all("math" not in name for name in unbatched), unbatched


def test_fully_masked_rows_give_zeros_not_nan():
    np_mod, torch_mod = mh_twins(12, 3)
    x = tokens(2, 5, 12)
    mask = np.ones((2, 5, 5), dtype=bool)
    mask[1, 2] = False  # query 2 of sequence 1 may attend nothing
    out = np_mod(x, mask)
    t_out = torch_mod(torch.from_numpy(x), torch.from_numpy(mask))
    assert np.isfinite(out).all() and bool(torch.isfinite(t_out).all())
    np.testing.assert_allclose(out[1, 2], 0, atol=1e-7)
    np.testing.assert_allclose(t_out.detach().numpy(), out, **TOL32)


def test_multihead_gradients_reach_every_weight():
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(12, 3, 1)
    x = torch.randn(2, 5, 12, requires_grad=True)
    mod(x, causal=True).square().sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in mod.parameters())
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    mod64 = TorchMultiHeadAttention(6, 2, dtype=torch.float64)
    x64 = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mod64(t, causal=True), (x64,))


def test_multihead_dropout_acts_only_while_training():
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(12, 3, dropout=0.5)
    x = torch.randn(2, 5, 12)
    mod.eval()
    plain = mod(x)
    torch.testing.assert_close(mod(x), plain)
    _, plain_w = mod(x, return_weights=True)
    mod.train()
    assert not torch.allclose(mod(x), plain)  # SDPA's dropout_p
    _, dropped_w = mod(x, return_weights=True)
    kept = dropped_w != 0
    assert not bool(kept.all())
    torch.testing.assert_close(dropped_w[kept], 2 * plain_w[kept])


def test_multihead_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from lib.modules import MultiHeadAttention\n"
        "from lib.decoding import KVCache\n"
        "m = MultiHeadAttention(12, 3, 1, rng=0)\n"
        "cache = KVCache(4)\n"
        "out = np.concatenate([m(np.ones((1, 2, 12)), cache=cache, causal=True) for _ in range(2)], axis=1)\n"
        "assert out.shape == (1, 4, 12) and len(cache) == 4\n"
    )
    root = pathlib.Path(modules.__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------------------------------
# Bad input to the multi-head modules is named
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [MultiHeadAttention, TorchMultiHeadAttention])
@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((10, 3), ValueError, "d_model=10 is not divisible by n_heads=3"),
        ((12, 4, 3), ValueError, "n_heads=4 is not a multiple of n_kv_heads=3"),
        ((12, 0), ValueError, "n_heads must be at least 1"),
        ((12, 2.0), TypeError, "n_heads must be an integer"),
        ((12, 4, 0), ValueError, "n_kv_heads must be at least 1"),
    ],
)
def test_bad_head_sizes_are_named(cls, args, exc, words):
    with pytest.raises(exc, match=words):
        cls(*args)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bad_multihead_inputs_are_named(backend):
    np_mod, torch_mod = mh_twins(12, 3)
    mod = np_mod if backend == "numpy" else torch_mod

    def arr(a):
        return a if backend == "numpy" else torch.from_numpy(a)

    x = arr(tokens(2, 5, 12))
    with pytest.raises(ValueError, match=r"x has d_model=11 .* built for d_model=12"):
        mod(arr(tokens(2, 5, 11)))
    with pytest.raises(ValueError, match="at least 2-D"):
        mod(arr(tokens(12)))
    with pytest.raises(ValueError, match=r"context has d_model=8"):
        mod(x, context=arr(tokens(2, 7, 8)))
    with pytest.raises(ValueError, match=r"context has batch dimensions \(3,\) but x has \(2,\)"):
        mod(x, context=arr(tokens(3, 7, 12)))
    with pytest.raises(TypeError, match="mask has dtype .*int.*integer masks are ambiguous"):
        mod(x, arr(np.ones((5, 5), dtype=np.int64)))
    with pytest.raises(ValueError, match=r"mask of shape \(5, 4\) fits neither .* \(..., L, S\) = \(2, 5, 5\)"):
        mod(x, arr(np.ones((5, 4), dtype=bool)))
    with pytest.raises(ValueError, match=r"\(..., 1 or H, L, S\) = \(2, 3, 5, 5\)"):
        mod(x, arr(np.ones((2, 2, 5, 5), dtype=bool)))  # two heads' masks for three heads


def test_bad_multihead_conversions_are_named():
    with pytest.raises(ValueError, match="n_kv_heads=1 but n_heads=3: nn.MultiheadAttention has one key/value head"):
        to_multihead_attention(MultiHeadAttention(12, 3, 1))
    with pytest.raises(TypeError, match="must be a torch.nn.MultiheadAttention"):
        from_multihead_attention(TorchMultiHeadAttention(12, 3))
    biased = torch.nn.MultiheadAttention(12, 3, batch_first=True)
    with torch.no_grad():
        biased.in_proj_bias.fill_(0.1)
    with pytest.raises(ValueError, match="in_proj_bias is not zero"):
        from_multihead_attention(biased)
    with pytest.raises(ValueError, match="kdim=6, vdim=6 but embed_dim=12"):
        from_multihead_attention(torch.nn.MultiheadAttention(12, 3, kdim=6, vdim=6))
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        from_multihead_attention(torch.nn.MultiheadAttention(12, 3, add_bias_kv=True))


def test_bad_grouped_attention_inputs_are_named():
    q, k = np.zeros((2, 4, 5, 3)), np.zeros((2, 3, 7, 3))
    with pytest.raises(ValueError, match="q has 4 heads, not a multiple of the 3 key/value heads"):
        grouped_attention(q, k, k)
    with pytest.raises(ValueError, match="v has 2 heads but k has 3"):
        grouped_attention(q, k, np.zeros((2, 2, 7, 3)))
    with pytest.raises(ValueError, match="q must have shape .* at least 3-D"):
        grouped_attention(np.zeros((5, 3)), k, k)
    with pytest.raises(ValueError, match="the last axis|not divisible by n_heads=5"):
        split_heads(np.zeros((2, 5, 12)), 5)
    with pytest.raises(ValueError, match="at least 3-D"):
        merge_heads(np.zeros((5, 12)))


# ----------------------------------------------------------------------------------------------------------------
# One meaning per spelling of causal; cross-attention with a cache; SDPA's 4-D masks
# ----------------------------------------------------------------------------------------------------------------


def heads_reference(mod, x, source, attn_mask):
    """The module's output by SDPA in float64 on repeated key/value heads, with one (..., H or 1, L, S) mask."""
    w = {n: p.detach().double() for n, p in mod.state_dict().items()}
    q = split_heads(x.double() @ w["w_q"], mod.n_heads)
    k = split_heads(source.double() @ w["w_k"], mod.n_kv_heads).repeat_interleave(mod.n_heads // mod.n_kv_heads, -3)
    v = split_heads(source.double() @ w["w_v"], mod.n_kv_heads).repeat_interleave(mod.n_heads // mod.n_kv_heads, -3)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return (merge_heads(out) @ w["w_o"]).float()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_module_causal_true_aligns_by_position(backend):
    # Without a cache the queries and keys both start at position 0 (top-left, SDPA's is_causal); after a cache
    # the L new queries are the last L tokens (bottom-right); the strings say either alignment outright.
    np_mod, torch_mod = mh_twins(12, 3, 1)
    x, ctx = torch.from_numpy(tokens(2, 6, 12)), torch.from_numpy(tokens(2, 4, 12, seed=2))
    mod = torch_mod if backend == "torch" else (lambda a, *r, **kw: torch.from_numpy(np_mod(a.numpy(), *r, **kw)))
    top_left = heads_reference(torch_mod, x[:, :3], ctx, attn.causal_mask(3, 4, like=x))
    bottom_right = heads_reference(torch_mod, x[:, :3], ctx, attn.causal_mask(3, 4, like=x, align="bottom-right"))
    for spelling in (True, "top-left"):
        torch.testing.assert_close(mod(x[:, :3], context=ctx if backend == "torch" else ctx.numpy(), causal=spelling),
                                   top_left, **TOL32)
    torch.testing.assert_close(
        mod(x[:, :3], context=ctx if backend == "torch" else ctx.numpy(), causal="bottom-right"), bottom_right, **TOL32
    )
    with pytest.raises(ValueError, match="first 2 queries with no key"):  # 6 queries on 4 keys: rows 0-1 empty
        mod(x, context=ctx if backend == "torch" else ctx.numpy(), causal="bottom-right")
    whole = heads_reference(torch_mod, x, x, attn.causal_mask(6, like=x))
    cache = decoding.KVCache(6)
    with torch.no_grad():
        mod(x[:, :2], causal=True, cache=cache)
        chunk = mod(x[:, 2:5], causal=True, cache=cache)  # 3 new queries on 5 keys: bottom-right
    torch.testing.assert_close(chunk, whole[:, 2:5], **TOL32)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_cross_attention_with_a_static_cache_projects_the_context_once(backend, monkeypatch):
    np_mod, torch_mod = mh_twins(12, 3)
    x, ctx = tokens(2, 4, 12), tokens(2, 3, 12, seed=2)
    mod = np_mod
    if backend == "torch":
        mod, x, ctx = torch_mod, torch.from_numpy(x), torch.from_numpy(ctx)
    with torch.no_grad():
        expected = mod(x, context=ctx)
    projected = []
    original = modules._project_kv
    monkeypatch.setattr(modules, "_project_kv", lambda m, s: projected.append(tuple(s.shape)) or original(m, s))
    cache = decoding.KVCache(static=True)
    with torch.no_grad():
        steps = [mod(x[:, t : t + 1], context=ctx, cache=cache) for t in range(4)]
    assert projected == [(2, 3, 12)] and len(cache) == 3 and cache.capacity == 3  # 3 keys after 4 steps, not 12
    joined = np.concatenate(steps, 1) if backend == "numpy" else torch.cat(steps, 1)
    np.testing.assert_allclose(np.asarray(joined), np.asarray(expected), **TOL32)
    with pytest.raises(ValueError, match="cannot be passed with context.*KVCache\\(static=True\\)"):
        mod(x, context=ctx, cache=decoding.KVCache(8))
    with pytest.raises(ValueError, match="this KVCache is static.*pass context="):
        mod(x, cache=cache)
    with pytest.raises(ValueError, match="one static cache serves one context"):
        mod(x, context=ctx[:, :2], cache=cache)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("n_kv", [3, 1])
def test_modules_take_sdpa_4d_masks_per_head_and_float_biases(backend, n_kv):
    np_mod, torch_mod = mh_twins(12, 3, n_kv)
    x = torch.from_numpy(tokens(2, 5, 12))
    g = torch.Generator().manual_seed(0)
    pad = attn.padding_mask(torch.tensor([5, 3]), 5, heads=False)  # (B, 1, S), shared by every head
    per_head = torch.rand(2, 3, 5, 5, generator=g) < 0.7  # (B, H, L, S)
    per_head[..., 0] = True
    slopes = torch.tensor([0.5, 0.25, 0.125])[:, None, None]  # ALiBi-like: a distance penalty per head
    distance = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs()
    alibi = (-slopes * distance).expand(2, 3, 5, 5)  # (B, H, L, S), float
    cases = [
        (pad, pad[:, None]),  # (B, 1, S) shared is (B, 1, 1, S) per head
        (attn.padding_mask(torch.tensor([5, 3]), 5, heads=True), pad[:, None]),
        (pad[:, None].expand(2, 1, 5, 5), pad[:, None]),  # (B, 1, L, S)
        (per_head, per_head),
        (alibi, alibi),
    ]
    for mask, reference_mask in cases:
        expected = heads_reference(torch_mod, x, x, reference_mask)
        if backend == "torch":
            got, weights = torch_mod(x, mask), torch_mod(x, mask, return_weights=True)[0]
            torch.testing.assert_close(weights, expected, **TOL32)
        else:
            got = torch.from_numpy(np_mod(x.numpy(), mask.numpy()))
        torch.testing.assert_close(got, expected, **TOL32)
    with_causal = heads_reference(torch_mod, x, x, per_head & attn.causal_mask(5, like=x))
    got = torch_mod(x, per_head, causal=True) if backend == "torch" else torch.from_numpy(
        np_mod(x.numpy(), per_head.numpy(), causal=True))
    torch.testing.assert_close(got, with_causal, **TOL32)


class _SDPASpy:
    """Records the key heads and keywords lib.nn hands to every scaled_dot_product_attention call."""

    def __init__(self, monkeypatch):
        import lib.nn

        self.calls, original = [], lib.nn.sdpa_arguments

        def spy(*args):
            q, k, v, keywords = original(*args)
            self.calls.append({"k_heads": k.shape[1], **keywords})
            return q, k, v, keywords

        monkeypatch.setattr(lib.nn, "sdpa_arguments", spy)


def test_torch_module_passes_the_cheapest_form_of_the_causal_pattern(monkeypatch):
    from torch.nn.attention.bias import CausalBias

    spy = _SDPASpy(monkeypatch)
    _, mod = mh_twins(16, 4, 2)
    x = torch.randn(2, 7, 16)
    cache = decoding.KVCache(7)
    with torch.no_grad():
        mod(x[:, :3], causal=True, cache=cache)  # prefill: L = S, is_causal
        mod(x[:, 3:5], causal=True, cache=cache)  # a chunk of 2 after 3 cached: causal_lower_right
        mod(x[:, 5:6], causal=True, cache=cache)  # one token: every key is allowed, no mask
        mod(x, attn.padding_mask(torch.tensor([7, 4]), 7), causal=True)  # a dense mask: heads repeated, no GQA
    prefill, chunk, step, padded = spy.calls
    assert prefill.get("is_causal") and prefill.get("attn_mask") is None and prefill.get("enable_gqa")
    assert isinstance(chunk.get("attn_mask"), CausalBias) and not chunk.get("is_causal") and chunk.get("enable_gqa")
    assert step.get("attn_mask") is None and not step.get("is_causal") and step.get("enable_gqa")
    assert padded["attn_mask"].shape == (2, 1, 7, 7) and not padded.get("enable_gqa") and padded["k_heads"] == 4


@pytest.mark.parametrize("n_kv", [4, 2])
def test_decode_chunks_and_masked_gqa_run_the_fused_cpu_kernel(n_kv):
    # Every fused kernel needs 4-D inputs (FIELD_NOTES); on CPU (torch 2.13) its flash kernel also takes masks and GQA.
    _, mod = mh_twins(16, 4, n_kv)
    x = torch.randn(2, 9, 16)
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu"
    cache = decoding.KVCache(9)
    with torch.no_grad():
        mod(x[:, :4], causal=True, cache=cache)
        for name, call in [
            ("chunk after a cache", lambda: mod(x[:, 4:7], causal=True, cache=cache)),
            ("one-token decode step", lambda: mod(x[:, 7:8], causal=True, cache=cache)),
            ("padding mask", lambda: mod(x, attn.padding_mask(torch.tensor([9, 5]), 9), causal=True)),
            ("per-head mask", lambda: mod(x, torch.ones(2, 4, 9, 9, dtype=torch.bool))),
        ]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                call()
            ran = {e.name for e in prof.events()}
            assert fused in ran and not any("_math" in op for op in ran), (name, ran)
            if name == "one-token decode step":  # no mask is built: every cached key is allowed
                assert not ran & {"aten::arange", "aten::le", "aten::ones", "aten::tril", "aten::where"}, ran


def _rope(t, start):
    """Rotary position embeddings on (..., heads, l, d): pairs of columns turned by position · frequency."""
    d = t.shape[-1]
    positions = torch.arange(start, start + t.shape[-2], dtype=t.dtype)[:, None]  # (l, 1)
    angles = positions / 10000 ** (torch.arange(0, d, 2, dtype=t.dtype) / d)  # (l, d/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = t[..., 0::2], t[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_rotate_turns_queries_and_keys_by_position_before_they_are_cached(backend):
    np_mod, torch_mod = mh_twins(12, 3, 1)
    x = torch.from_numpy(tokens(2, 6, 12))
    if backend == "torch":
        mod, rotate = torch_mod, _rope
    else:
        def mod(a, **kw):
            return torch.from_numpy(np_mod(a.numpy(), **kw))

        def rotate(t, start):
            return _rope(torch.from_numpy(t), start).numpy()

    with torch.no_grad():
        whole = mod(x, causal=True, rotate=rotate)
        cache = decoding.KVCache(6)
        steps = [mod(x[:, :3], causal=True, cache=cache, rotate=rotate)]
        steps += [mod(x[:, t : t + 1], causal=True, cache=cache, rotate=rotate) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, **TOL32)
    assert not torch.allclose(whole, mod(x, causal=True), atol=1e-3)  # the rotation did something
    seen = []
    with torch.no_grad():
        later = decoding.KVCache(4)
        mod(x[:, :2], causal=True, cache=later)
        mod(x[:, 2:4], causal=True, cache=later, rotate=lambda t, start: seen.append(start) or t)
    assert seen == [2, 2]  # queries, then keys, of the tokens at positions 2 and 3
    with pytest.raises(ValueError, match="rotate .* not to cross-attention"):
        mod(x, context=x if backend == "torch" else x.numpy(), rotate=rotate)


@settings(max_examples=60)
@given(
    st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 2)]),
    st.integers(1, 2), st.integers(0, 4), st.integers(1, 4),
    st.sampled_from([False, True, "top-left", "bottom-right"]),
    st.sampled_from(["none", "shared", "per-head", "one-head", "float"]),
    st.integers(0, 2**16),
)
def test_sdpa_path_equals_the_grouped_arithmetic_for_any_cache_mask_and_alignment(heads, B, cached, L, causal, kind, seed):
    # The torch module's fast path (SDPA with no mask, is_causal, causal_lower_right or a dense mask, GQA or
    # repeated heads) against its NumPy twin, which always builds the whole mask: equal for every combination.
    H, Hkv = heads
    np_mod, torch_mod = mh_twins(8, H, Hkv, seed=seed % 7)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, cached + L, 8)).astype(np.float32)
    S = cached + L
    mask = None
    if kind == "shared":
        mask = rng.random((B, L, S)) < 0.7
    elif kind == "per-head":
        mask = rng.random((B, H, L, S)) < 0.7
    elif kind == "one-head":
        mask = rng.random((B, 1, 1, S)) < 0.7
    elif kind == "float":
        mask = (rng.standard_normal((B, H, L, S)) * 2).astype(np.float32)
    np_cache, t_cache = decoding.KVCache(S), decoding.KVCache(S)
    with torch.no_grad():
        if cached:
            np_mod(x[:, :cached], causal=True, cache=np_cache)
            torch_mod(torch.from_numpy(x[:, :cached]), causal=True, cache=t_cache)
        expected = np_mod(x[:, cached:], mask, causal=causal, cache=np_cache)
        tx, tm = torch.from_numpy(x[:, cached:]), None if mask is None else torch.from_numpy(mask)
        got = torch_mod(tx, tm, causal=causal, cache=t_cache)
        t_cache._length = cached  # the same step again, through the weights path
        got_w, _ = torch_mod(tx, tm, causal=causal, cache=t_cache, return_weights=True)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_w.numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n_kv", [8, 2])
def test_decode_chunks_and_masked_gqa_stay_off_the_math_kernel_on_cuda(n_kv):
    # The cases chapter 10 teaches; before, a dense mask (with enable_gqa under GQA) sent them to the math kernel.
    torch.manual_seed(0)
    mod = TorchMultiHeadAttention(512, 8, n_kv, device="cuda", dtype=torch.float16).eval()
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.float16)
    cache = decoding.KVCache(256)
    with torch.no_grad():
        mod(x[:, :128], causal=True, cache=cache)
        for name, call in [
            ("chunk after a cache", lambda: mod(x[:, 128:192], causal=True, cache=cache)),
            ("one-token decode step", lambda: mod(x[:, 192:193], causal=True, cache=cache)),
            ("padding mask", lambda: mod(x, attn.padding_mask(torch.tensor([256, 100], device="cuda"), 256))),
        ]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                call()
            ran = {e.name for e in prof.events() if e.name.startswith("aten::") and "attention" in e.name}
            fused = {op for op in ran if "flash" in op or "efficient" in op or "cudnn" in op}
            assert fused and not any("math" in op for op in ran), (name, ran)
