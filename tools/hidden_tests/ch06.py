"""The hidden tests of chapters/06_attention_module.ipynb (see tools/grading_specs.py for what a spec holds)."""

from __future__ import annotations

import math

import numpy as np
from grading_specs import Close, Holds, Spec, Whole, softmax_rows


def _attend(q, k, v, causal=False):
    """Single-head attention in float64, the trusted side's own lines: (..., L, E) x 3 -> (..., L, Ev)."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # (..., L, S)
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    return softmax_rows(s) @ v


# ------------------------------------------------------------------ exercise 1, the module on PyTorch's kernel


def _sdpa_make(rng, params):
    d_model, d_k = int(rng.choice([6, 10, 12, 20])), int(rng.choice([4, 8, 12]))
    B, n = int(rng.integers(1, 4)), int(rng.integers(3, 12))
    draw = lambda *shape: rng.uniform(-0.6, 0.6, shape).astype(np.float32)
    return {"x_h": rng.standard_normal((B, n, d_model)).astype(np.float32), "w_q_h": draw(d_model, d_k),
            "w_k_h": draw(d_model, d_k), "w_v_h": draw(d_model, d_k), "w_o_h": draw(d_k, d_model)}


def _sdpa_expect(i, p):
    x = i["x_h"].astype(np.float64)
    q, k, v = (x @ i[name].astype(np.float64) for name in ("w_q_h", "w_k_h", "w_v_h"))
    w_o = i["w_o_h"].astype(np.float64)
    return {"plain_h": _attend(q, k, v) @ w_o, "causal_h": _attend(q, k, v, causal=True) @ w_o}


def _through_sdpa(answers, inputs):
    calls = answers.get("sdpa_calls_h")
    if not isinstance(calls, int) or calls < 2:
        return "sdpa_forward does not call torch.nn.functional.scaled_dot_product_attention"
    return None


HARNESS_SDPA = """\
import torch as _torch
from torch.nn.attention import SDPBackend as _Backend, sdpa_kernel as _only
from torch.overrides import TorchFunctionMode as _Mode
from lib.nn import TorchSelfAttention as _Module


class _Calls(_Mode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


_module = _Module(x_h.shape[-1], w_q_h.shape[1], d_out=x_h.shape[-1]).eval()
with _torch.no_grad():
    for _name, _w in (("w_q", w_q_h), ("w_k", w_k_h), ("w_v", w_v_h), ("w_o", w_o_h)):
        getattr(_module, _name).copy_(_w)
_calls = _Calls()
with _calls, _only(_Backend.FLASH_ATTENTION):
    plain_h = sdpa_forward(_module, x_h)
    causal_h = sdpa_forward(_module, x_h, causal=True)
sdpa_calls_h = _calls.names.count("scaled_dot_product_attention")
"""


# ------------------------------------------------------------------ exercise 2, an identity output projection


def _identity_make(rng, params):
    d = int(rng.choice([3, 5, 6, 8, 12]))
    a = math.sqrt(6 / (2 * d))
    draw = lambda: rng.uniform(-a, a, (d, d)).astype(np.float32)
    return {"x_h": rng.standard_normal((int(rng.integers(1, 3)), int(rng.integers(3, 9)), d)).astype(np.float32),
            "w_q_h": draw(), "w_k_h": draw(), "w_v_h": draw()}


def _identity_expect(i, p):
    x = i["x_h"].astype(np.float64)
    q, k, v = (x @ i[name].astype(np.float64) for name in ("w_q_h", "w_k_h", "w_v_h"))
    return {"mha_out_h": _attend(q, k, v), "out_proj_h": np.eye(x.shape[-1])}


HARNESS_IDENTITY = """\
import torch as _torch
from lib import modules as _modules

_layer = _modules.SelfAttention(x_h.shape[-1], x_h.shape[-1], rng=0)
_layer.load_state_dict({"w_q": w_q_h, "w_k": w_k_h, "w_v": w_v_h})
_mha = identity_out_proj(_layer)
is_mha_h = isinstance(_mha, _torch.nn.MultiheadAttention)
_x = _torch.from_numpy(x_h)
with _torch.no_grad():
    mha_out_h = _mha(_x, _x, _x)[0]
out_proj_h = _mha.out_proj.weight
"""


# ------------------------------------------------------------------ exercise 3, parameters and operations


def _counts_make(rng, params):
    heads = int(rng.choice([2, 3, 4, 6, 8, 16]))
    return {"d_model_h": heads * int(rng.choice([8, 16, 24, 32])), "heads_h": heads,
            "n_h": int(rng.integers(5, 90))}


def _counts_expect(i, p):
    d, h, n = i["d_model_h"], i["heads_h"], i["n_h"]
    # FlopCounterMode counts a multiply-add as 2: two (n x n x d_model) products, whatever the heads
    return {"params_h": 4 * d * d, "flops_one_h": 4 * n * n * d, "flops_many_h": 4 * n * n * d,
            "weights_one_h": n * n, "weights_many_h": h * n * n}


HARNESS_COUNTS = """\
params_h = layer_parameters(d_model_h, heads_h)
flops_one_h, weights_one_h = attention_work(n_h, d_model_h, 1)
flops_many_h, weights_many_h = attention_work(n_h, d_model_h, heads_h)
"""


# ------------------------------------------------------------------ exercise 4, a square projection


def _gains_make(rng, params):
    f_in = int(rng.integers(2, 300))
    f_out = int(rng.integers(2, 300))
    return {"f_in_h": f_in, "f_out_h": f_out if f_out != f_in else f_out + 7}


def _gains_expect(i, p):
    f_in, f_out = i["f_in_h"], i["f_out_h"]
    return {"gains_h": [2 * f_in / (f_in + f_out), 2 * f_out / (f_in + f_out)]}


SPECS = [
    Spec(
        label="attention-module/sdpa-forward", title="The module on PyTorch's kernel", draws=2,
        make=_sdpa_make, expect=_sdpa_expect, torch_inputs=("x_h", "w_q_h", "w_k_h", "w_v_h", "w_o_h"),
        harness=HARNESS_SDPA, rerun=False,
        compare={"plain_h": Close(1e-4, 1e-5, "sdpa_forward(module, x): the module's (B, n, d_model) output, "
                                              "with only the flash kernel allowed"),
                 "causal_h": Close(1e-4, 1e-5, "sdpa_forward(module, x, causal=True), likewise"),
                 "sdpa_calls_h": Holds(_through_sdpa, "that it calls scaled_dot_product_attention (the module's "
                                                      "own forward raises while the test runs)")},
        poison=("lib.attention.attention", "lib.attention.attention_weights"),
    ),
    Spec(
        label="attention-module/identity-out-proj", title="An identity output projection", draws=2,
        make=_identity_make, expect=_identity_expect, harness=HARNESS_IDENTITY, rerun=False,
        compare={"mha_out_h": Close(1e-5, 1e-6, "the (B, n, d) output of identity_out_proj(layer)(x, x, x), the "
                                                "layer's own output"),
                 "out_proj_h": Close(0, 1e-7, "its out_proj weight, the identity"),
                 "is_mha_h": Holds(lambda a, i: None if a.get("is_mha_h") is True
                                   else "identity_out_proj does not return an nn.MultiheadAttention",
                                   "an nn.MultiheadAttention built by hand (to_multihead_attention raises while "
                                   "the test runs)")},
        poison=("lib.nn.to_multihead_attention",),
    ),
    Spec(
        label="attention-module/parameters-and-flops", title="Counting parameters and operations", draws=2,
        make=_counts_make, expect=_counts_expect, harness=HARNESS_COUNTS, rerun=False,
        compare={"params_h": Whole("layer_parameters(d_model, heads), a whole number"),
                 "flops_one_h": Whole("attention_work(n, d_model, 1)'s FLOPs, as FlopCounterMode counts them"),
                 "weights_one_h": Whole("attention_work(n, d_model, 1)'s number of weights"),
                 "flops_many_h": Whole("attention_work(n, d_model, heads)'s FLOPs"),
                 "weights_many_h": Whole("attention_work(n, d_model, heads)'s number of weights")},
    ),
    Spec(
        label="attention-module/xavier-gains", title="A square projection", draws=3,
        make=_gains_make, expect=_gains_expect, harness="gains_h = xavier_gains(f_in_h, f_out_h)\n", rerun=False,
        compare={"gains_h": Close(1e-6, 0, "xavier_gains(f_in, f_out): the forward and the backward gain, for "
                                           "f_in != f_out")},
    ),
]
