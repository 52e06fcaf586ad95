"""lib.modules: the NumPy and torch self-attention twins against each other and against nn.MultiheadAttention."""

import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from lib import attention as attn
from lib import modules
from lib.modules import (
    SelfAttention,
    TorchSelfAttention,
    to_multihead_attention,
    xavier_bound,
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
    out = np_mod(x, attn.padding_mask([4, 6], 6))
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
    np_mod, torch_mod = twins(32, 16, 16, 32)
    x = tokens(2, 8, 32)
    out = torch_mod.to("cuda")(torch.from_numpy(x).to("cuda"), causal=True)
    assert out.device.type == "cuda"
    np.testing.assert_allclose(out.cpu().detach().numpy(), np_mod(x, causal=True), rtol=1e-4, atol=1e-5)
    mha_out, _ = to_multihead_attention(torch_mod)(*[torch.from_numpy(x).to("cuda")] * 3)
    torch.testing.assert_close(mha_out, torch_mod(torch.from_numpy(x).to("cuda")), rtol=1e-4, atol=1e-5)


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
