"""The hidden tests: for each graded exercise, inputs a student has never seen and the library's answer on them.

A spec is matched to an exercise by its title, words of the statement's first sentence (`**1. Without the
scaling.**`), in whichever chapter holds it, so a renumbered chapter or exercise keeps its test. The grader
(tools/grade.py) draws the inputs from the instructor's seed, the student and the spec's label; the student's
sandbox runs the student's own cells again with those inputs in place of the named ones (every other name of the
notebook keeps its value, so an answer copied from a variable the notebook holds, or typed in, is wrong), or calls
the student's function on them (`harness`), and sends back the answers as data. The library's answers are computed
here, in the grader's process, and never enter the sandbox.

`forbidden` names the library functions an exercise asks the student to write: the sandbox replaces them with one
that raises while the hidden test runs, and the grader refuses an answer whose cells name them. `banned` are further
words an answer may not contain. `variants` are the same exercise with other parameters, for a term whose
solutions must not be the public ones: `--variant NAME` grades them, `make_student.py --variant NAME` writes the
statements students see.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Close:
    """A number, list, array or tensor close to the library's, in any float precision or container."""

    rtol: float = 1e-6
    atol: float = 1e-9
    kind: str = "numbers"

    def describe(self) -> str:
        return f"{self.kind}, to rtol={self.rtol:g}, atol={self.atol:g}"


@dataclass(frozen=True)
class Whole:
    """A whole number: an int, a NumPy or torch integer, or a float with no fractional part."""

    kind: str = "a whole number"

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Holds:
    """A property the trusted side checks on the answers (and the inputs): `test(answers, inputs) -> message or
    None`."""

    test: Callable[[dict, dict], str | None]
    kind: str

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Spec:
    label: str  # stable, written in the score table's legend and the feedback
    title: str  # words of the exercise's first sentence, matched in the statement
    make: Callable[[np.random.Generator, dict], dict]  # the hidden inputs, by name (NumPy arrays, numbers)
    expect: Callable[[dict, dict], dict]  # the library's answers on those inputs
    compare: dict  # answer name -> Close, Whole or Holds
    torch_inputs: tuple[str, ...] = ()  # inputs handed to the student as torch tensors
    harness: str | None = None  # code that calls the student's functions on the inputs, binding the answers
    rerun: bool = True  # run the student's cells again on the hidden inputs (before the harness, if any)
    forbidden: tuple[str, ...] = ()  # library functions the answer may not call (dotted, importable)
    banned: tuple[str, ...] = ()  # further words the answer's cells may not contain
    poison: tuple[str, ...] = ()  # library functions that raise during the hidden test, though the cells may name
    # them (to check an answer the visible way)
    params: dict = field(default_factory=dict)  # the exercise's parameters, which a variant may change
    variants: dict = field(default_factory=dict)  # name -> (params, [(old statement text, new text)])
    draws: int = 1  # sets of hidden inputs: every one must pass
    also: tuple[str, ...] = ()  # further answers the sandbox sends, for a Holds check
    timeout: float = 120  # seconds the hidden test may run in the sandbox
    trusted: tuple[str, ...] = ()  # what the harness relies on (dotted): put back as it was before any student cell

    @property
    def answers(self) -> list[str]:
        return [*self.compare, *self.also]


# Words no graded answer may use: they run code the grader cannot read, reach outside the notebook, or reach the
# sandbox's own machinery (its plan, its channel to the grader). Honest answers to this course's exercises need
# none of them; a student's cell that uses one is not run at all.
ALWAYS_BANNED = ("exec", "eval", "compile", "__import__", "importlib", "globals", "locals", "vars", "__dict__",
                 "__builtins__", "builtins", "sys.modules", "gc", "inspect", "ctypes", "subprocess", "os.system",
                 "os.popen", "os._exit", "open", "pathlib", "io", "pickle", "marshal", "runpy", "socket", "urllib",
                 "_getframe", "__code__", "__globals__", "__closure__", "setattr", "delattr", "nbformat", "signal",
                 "resource", "threading", "multiprocessing", "__main__", "stdin", "fileno", "fdopen", "os.write",
                 "os.read", "dup", "dup2", "mmap", "pdb", "breakpoint", "tb_frame", "f_back", "f_globals", "f_locals",
                 "gi_frame", "cr_frame", "__traceback__", "__subclasses__", "__mro__", "__bases__", "__base__",
                 "_exit", "shelve", "dill", "cloudpickle", "ptrace", "codecs", "getattr", "__getattribute__",
                 "attrgetter", "methodcaller", "pydoc", "pkgutil", "get_field", "Formatter", "torch.ops", "aten",
                 "__reduce__", "__reduce_ex__", "__self__", "__func__", "__defaults__", "__kwdefaults__")
# of those, the builtins: refused as names (`eval(...)`), not as attributes (`model.eval()`)
BUILTINS = ("exec", "eval", "compile", "open", "vars", "globals", "locals", "breakpoint", "__import__", "setattr",
            "delattr", "getattr")


def softmax_rows(scores):
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------------------------- chapter 4, worked example


def _tokens(rng, params=None):
    """Three tokens in a plane, near the chapter's: A's own score the largest of its row by a clear margin."""
    while True:
        Q = rng.uniform(0.2, 1.2, (3, 2)).round(2)
        K = rng.uniform(0.1, 1.1, (3, 2)).round(2)
        V = rng.uniform(0.0, 1.0, (3, 2)).round(2)
        raw = Q @ K.T
        lead = raw[0, 0] - raw[0, 1:].max()
        if lead > 0.05 and not np.allclose(raw, raw.T, atol=0.05):
            threshold = (params or {}).get("threshold", 0.5)
            if _smallest_c(Q, K, threshold) <= 12:
                return {"Q": Q, "K": K, "V": V, "d_k": 2, "raw": raw, "scaled": raw / math.sqrt(2)}


def _weights(q, K):
    return softmax_rows(np.atleast_2d(q) @ K.T / math.sqrt(K.shape[1]))[0]


def _smallest_c(Q, K, threshold=0.5):
    c = 1
    while _weights(c * Q[0], K)[0] <= threshold:
        c += 1
    return c


def _ex2_expect(inputs, params):
    c = _smallest_c(inputs["Q"], inputs["K"], params["threshold"])
    return {"c": c, "w": _weights(c * inputs["Q"][0], inputs["K"])}


def _ex3_make(rng, params):
    tokens = _tokens(rng)
    Q, K = tokens["Q"].copy(), tokens["K"]
    Q[0] = (1.0, 0.0)  # A's query points east, as in the statement
    s_AA = float(K[0, 0])
    rounded = _weights(Q[0], K).round(2)
    return {"Q": Q, "K": K, "s_AA_hidden": s_AA, "rounded_hidden": rounded, "d_k": 2}


def _ex3_expect(inputs, params):
    d_k = inputs["d_k"]
    east = inputs["s_AA_hidden"] + math.sqrt(d_k) * np.log(inputs["rounded_hidden"] / inputs["rounded_hidden"][0])
    return {"east_hidden": east, "shifted": _weights(inputs["Q"][0], inputs["K"] + np.array([0.3, 0.0]))}


def _ex4_expect(inputs, params):
    Q, K, V = inputs["Q"], inputs["K"], inputs["V"]
    raw = Q[1] @ K.T
    weights = softmax_rows(raw / math.sqrt(2))
    return {"raw_B": raw, "weights_B": weights, "out_B": weights @ V}


def _tokens_only(rng, params):
    t = _tokens(rng)
    return {"Q": t["Q"], "K": t["K"], "V": t["V"]}


CHAPTER_4 = [
    Spec(
        label="worked-example/without-scaling", draws=3, title="Without the scaling",
        make=lambda rng, p: _tokens(rng),
        expect=lambda i, p: {"unscaled_A": softmax_rows(i["Q"] @ i["K"].T)[0]},
        compare={"unscaled_A": Close(kind="A's three weights")},
    ),
    Spec(
        label="worked-example/longer-query", draws=3, title="A longer query",
        make=lambda rng, p: _tokens(rng, p), expect=_ex2_expect,
        compare={"c": Whole("the smallest whole factor c"), "w": Close(kind="A's three weights at that c")},
        params={"threshold": 0.5},
        variants={"two-thirds": ({"threshold": 2 / 3}, [("more than half of its attention",
                                                        "more than two thirds of its attention")])},
    ),
    Spec(
        label="worked-example/keys-from-weights", draws=3, title="Keys from weights",
        make=_ex3_make, expect=_ex3_expect,
        harness="east_hidden = recover_east(s_AA_hidden, rounded_hidden, d_k)\n",
        compare={"east_hidden": Close(kind="the three eastward components recover_east returns"),
                 "shifted": Close(kind="A's three weights after the shift")},
    ),
    Spec(
        label="worked-example/row-by-hand", draws=3, title="row by hand",
        make=_tokens_only, expect=_ex4_expect,
        compare={"raw_B": Close(kind="B's three raw scores"), "weights_B": Close(kind="B's three weights"),
                 "out_B": Close(kind="B's output, two numbers")},
        forbidden=("lib.attention.attention_weights", "lib.attention.attention", "lib.attention.softmax",
                   "lib.attention.scores"),
        banned=("attn", "torch", "scipy", "np.exp", "np.dot", "np.matmul", "np.einsum", "dot", "matmul", "einsum",
                "tensordot", "inner", "@"),
    ),
]


# --------------------------------------------------------------------------------- chapter 9, FlashAttention


def _ex9_2_make(rng, params):
    L, S, E = int(rng.integers(5, 9)), int(rng.integers(5, 9)), int(rng.integers(2, 5))  # E apart from L, S
    return {"q_h": rng.standard_normal((L, E)), "k_h": rng.standard_normal((S, E)),
            "v_h": rng.standard_normal((S, E)), "do_h": rng.standard_normal((L, E)),
            "causal_h": bool(rng.integers(0, 2)) and L <= S}


def _ex9_2_expect(inputs, params):
    import torch

    from lib import attention as attn

    q, k, v = (torch.tensor(inputs[n], dtype=torch.float64, requires_grad=True) for n in ("q_h", "k_h", "v_h"))
    out = attn.attention(q, k, v, causal=inputs["causal_h"])
    out.backward(torch.tensor(inputs["do_h"], dtype=torch.float64))
    return {"o_h": out.detach().numpy(), "dq_h": q.grad.numpy(), "dk_h": k.grad.numpy(), "dv_h": v.grad.numpy(),
            "saved_h": None}


def _no_square(answers, inputs):
    L, S = inputs["q_h"].shape[0], inputs["k_h"].shape[0]
    shapes = answers.get("saved_h")
    if not isinstance(shapes, list):
        return "the tensors your forward saves could not be listed"
    square = [s for s in shapes if isinstance(s, list) and len(s) >= 2 and s[-2:] == [L, S]]
    return f"your forward saves a ({L}, {S}) tensor: recompute P in the backward" if square else None


HARNESS_9_2 = """\
import torch as _torch
_q, _k, _v = (t.clone().requires_grad_(True) for t in (q_h, k_h, v_h))
saved_h = []
def _pack(t):
    saved_h.append(list(t.shape))
    return t
with _torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
    o_h = RecomputedAttention.apply(_q, _k, _v, causal_h)
o_h.backward(do_h)
dq_h, dk_h, dv_h = _q.grad, _k.grad, _v.grad
"""


def _ex9_3_make(rng, params):
    L, S = int(rng.integers(17, 60)), int(rng.integers(17, 60))
    E = int(rng.choice([16, 32]))
    return {"q_h": rng.standard_normal((L, E)).astype(np.float32),
            "k_h": rng.standard_normal((S, E)).astype(np.float32)}


def _ex9_3_expect(inputs, params):
    q, k = inputs["q_h"].astype(np.float64), inputs["k_h"].astype(np.float64)
    L, S = q.shape[0], k.shape[0]
    s = q @ k.T / math.sqrt(q.shape[1])
    s[np.triu(np.ones((L, S), dtype=bool), 1)] = -np.inf
    return {"wrapped_h": s, "launched_h": s, "untouched_h": None}


HARNESS_9_3 = """\
import torch as _torch
import triton as _triton
_L, _E = q_h.shape
_S = k_h.shape[0]
wrapped_h = causal_scores(q_h, k_h)
_buf = _torch.full(((_L + 16) * _S,), 7.0)
causal_tile_kernel[(_triton.cdiv(_L, 16), _triton.cdiv(_S, 16))](q_h, k_h, _buf, _L, _S, _E ** -0.5, E=_E, BLOCK=16)
launched_h = _buf[: _L * _S].reshape(_L, _S)
untouched_h = bool((_buf[_L * _S:] == 7.0).all())
"""


def _ex9_1_make(rng, params):
    return {"B_h": int(rng.integers(1, 9)), "H_h": int(rng.integers(1, 33)), "n_h": int(rng.choice([512, 1024, 4096])),
            "d_h": int(rng.choice([64, 128])), "products_h": int(rng.choice([5, 7]))}


def _ex9_1_expect(i, p):
    forward = i["B_h"] * i["H_h"] * 4 * i["n_h"] ** 2 * i["d_h"] / 2
    return {"flops_h": forward * (1 + i["products_h"] / 2)}


def _ex9_4_make(rng, params):
    # one hidden case of the lab (lib.lab): ragged lengths, L != S, head sizes 16 to 128, float32 or float16
    heads = (16, 24, 40, 64, 96, 128)
    causal = bool(rng.integers(0, 2))
    L = int(rng.integers(1, 71))
    S = L if causal and rng.integers(0, 2) else int(rng.integers(L if causal else 1, 81))
    E, EV = int(rng.choice(heads)), int(rng.choice(heads))
    dtype = np.float32 if rng.integers(0, 2) else np.float16
    block_m, block_n = ((16, 16), (32, 16), (16, 32))[int(rng.integers(0, 3))]
    return {"q_h": rng.standard_normal((1, L, E)).astype(dtype), "k_h": rng.standard_normal((1, S, E)).astype(dtype),
            "v_h": rng.standard_normal((1, S, EV)).astype(dtype), "causal_h": causal, "block_m_h": block_m,
            "block_n_h": block_n}


def _ex9_4_case(inputs):
    import torch

    from lib import lab

    (Z, L, E), S, EV = inputs["q_h"].shape, inputs["k_h"].shape[1], inputs["v_h"].shape[2]
    dtype = torch.float16 if inputs["q_h"].dtype == np.float16 else torch.float32
    return lab.Case(Z=Z, L=L, S=S, E=E, EV=EV, causal=inputs["causal_h"], dtype=dtype, block_m=inputs["block_m_h"],
                    block_n=inputs["block_n_h"])


def _ex9_4_verdict(answers, inputs):
    from lib import lab

    moved = answers.get("moved_h")
    if not isinstance(moved, dict) or not all(isinstance(b, (int, float)) for b in moved.values()):
        return "the bytes the kernel moved could not be counted"
    return lab.verdict(_ex9_4_case(inputs), inputs["q_h"], inputs["k_h"], inputs["v_h"], answers.get("o_h"),
                       answers.get("lse_h"), {name: int(b) for name, b in moved.items()})


HARNESS_9_4 = """\
from lib import lab as _lab, traffic as _traffic
with _traffic.count() as _moved:
    o_h, lse_h = _lab.launch(flash_forward_kernel, q_h, k_h, v_h, causal=causal_h, block_m=block_m_h,
                             block_n=block_n_h)
moved_h = {_name: _moved.bytes(_name, "both") for _name in ("Q", "K", "V", "O", "LSE")}
"""


CHAPTER_9 = [
    Spec(
        label="flash-kernel/step-flops", title="FLOPs of a causal training step", draws=3,
        make=_ex9_1_make, expect=_ex9_1_expect, harness="flops_h = step_flops(B_h, H_h, n_h, d_h, products_h)\n",
        rerun=False, compare={"flops_h": Close(1e-9, 0, "the FLOPs step_flops returns")},
    ),
    Spec(
        label="flash-kernel/recomputation", draws=3, title="Write recomputation yourself",
        make=_ex9_2_make, expect=_ex9_2_expect, torch_inputs=("q_h", "k_h", "v_h", "do_h"),
        harness=HARNESS_9_2, rerun=False, trusted=("torch.autograd.graph.saved_tensors_hooks",),
        compare={"o_h": Close(1e-6, 1e-8, "the output, (L, E)"), "dq_h": Close(1e-6, 1e-8, "dq, (L, E)"),
                 "dk_h": Close(1e-6, 1e-8, "dk, (S, E)"), "dv_h": Close(1e-6, 1e-8, "dv, (S, E)"),
                 "saved_h": Holds(_no_square, "no (L, S) tensor saved for the backward")},
        forbidden=("lib.attention.attention", "torch.nn.functional.scaled_dot_product_attention",
                   "torch.autograd.grad", "torch.func.vjp", "torch.func.grad"),
        banned=("scaled_dot_product_attention", "autograd.grad", "vjp", "enable_grad", "attn.attention("),
    ),
    Spec(
        label="flash-kernel/masked-tile", title="A masked tile, in Triton",
        make=_ex9_3_make, expect=_ex9_3_expect, torch_inputs=("q_h", "k_h"), harness=HARNESS_9_3, rerun=False,
        compare={"wrapped_h": Close(1e-5, 1e-5, "causal_scores(q, k): the (L, S) masked scores"),
                 "launched_h": Close(1e-5, 1e-5, "the (L, S) tile the kernel stores when launched directly"),
                 "untouched_h": Holds(lambda a, i: None if a.get("untouched_h") is True
                                      else "the kernel stores past row L or column S", "nothing stored outside")},
        forbidden=("torch.matmul", "torch.Tensor.matmul", "torch.Tensor.__matmul__", "torch.mm", "torch.einsum",
                   "torch.nn.functional.scaled_dot_product_attention"),
    ),
    Spec(
        label="flash-kernel/lab-forward", title="The lab: FlashAttention's forward pass", draws=4,
        make=_ex9_4_make, expect=lambda inputs, params: {"o_h": None}, torch_inputs=("q_h", "k_h", "v_h"),
        harness=HARNESS_9_4, rerun=False, also=("lse_h", "moved_h"),
        trusted=("lib.lab.launch", "lib.traffic.count", "lib.traffic.Traffic.bytes"),
        compare={"o_h": Holds(_ex9_4_verdict, "O and LSE within the lab's tolerances of attention, the future "
                                             "tiles skipped, at most 1.1x the course kernel's bytes")},
        forbidden=("torch.matmul", "torch.Tensor.matmul", "torch.Tensor.__matmul__", "torch.mm", "torch.einsum",
                   "torch.nn.functional.scaled_dot_product_attention", "lib.flash.flash_attention"),
        banned=("traffic", "lab.", "flash_attention", "torch."),
    ),
]


# ------------------------------------------------------------------------------ chapter 10, training, no positions


def _ex10_3_make(rng, params):
    import torch

    from lib.model import TwoCopies

    digits = rng.integers(0, 10, (400, 8))
    mirror, previous = (t.numpy() for t in TwoCopies.answers(torch.as_tensor(digits)))
    return {"held_out": digits, "mirror": mirror, "previous": previous}


def _blind_checks(answers, inputs):
    digits, target = inputs["held_out"], inputs["mirror"]
    predicted = answers.get("blind_predictions")
    if not isinstance(predicted, np.ndarray) or predicted.shape != digits.shape:
        return "`blind` is not a model whose first output is the mirror logits, (N, 8, 10)"
    if answers.get("blind_has_positions") is not False:
        return "`blind` still has position embeddings"
    accuracy = float((predicted == target).mean())
    counts = np.stack([(digits == d).sum(1) for d in range(10)], axis=1)  # (N, 10)
    others = counts[:, None, :] - np.eye(10, dtype=int)[digits]  # per position, the other seven's counts
    mode_share = float((others.max(-1) / 7).mean())  # guessing the commonest other digit
    if accuracy >= mode_share + 0.02:
        return "`blind` finds the mirror better than a model without positions can"
    if accuracy < 0.5 * mode_share:
        return "`blind` does no better than chance: train it with the chapter's recipe"
    reported = answers.get("blind_acc")
    if not isinstance(reported, (int, float, np.ndarray)) or np.size(reported) != 1 or abs(
            float(np.asarray(reported).ravel()[0]) - accuracy) > 1e-6:
        return "`blind_acc` is not `blind`'s held-out accuracy on the mirror, measured"
    try:
        share = np.asarray(answers.get("blind_share"), dtype=np.float64)
    except (TypeError, ValueError):
        share = None
    if share is None or share.shape != (2,):
        return "`blind_share` is not one share per head (2 numbers)"
    return None


HARNESS_10_3 = """\
import torch as _torch
with _torch.no_grad():
    blind_predictions = blind(held_out)[0].argmax(-1)
blind_has_positions = blind.position is not None
"""

CHAPTER_10 = [
    Spec(
        label="head-to-model/no-positions", title="Attention without positions",
        make=_ex10_3_make, expect=lambda i, p: {}, torch_inputs=("held_out", "mirror", "previous"),
        harness=HARNESS_10_3,
        compare={"blind_predictions": Holds(_blind_checks, "a model trained without positions (its held-out "
                                                           "mirror accuracy, measured, and one share per head)")},
        also=("blind_has_positions", "blind_acc", "blind_share"), timeout=300,
    ),
]

def _ex10_1_make(rng, params):
    return {"q_ex": rng.standard_normal((1, 6, 7, 4)).astype(np.float32),
            "k_ex": rng.standard_normal((1, 2, 7, 4)).astype(np.float32),
            "v_ex": rng.standard_normal((1, 2, 7, 4)).astype(np.float32)}


def _ex10_1_expect(i, p):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.tensor(i[n], dtype=torch.float64) for n in ("q_ex", "k_ex", "v_ex"))
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    return {"outputs_h": whole.numpy(), "lengths_h": [3, 1, 1, 1, 1], "keys_so_far": i["k_ex"],
            "values_so_far": i["v_ex"]}


HARNESS_10_1 = """\
import torch as _torch
outputs_h = _torch.cat(list(outputs), dim=-2)
lengths_h = [o.shape[-2] for o in outputs]
"""


def _ex10_5_make(rng, params):
    L, E = int(rng.integers(3, 40)), int(rng.choice([4, 8, 12, 16, 32]))
    return {"x_h": rng.standard_normal((L, E)).astype(np.float32), "offset_h": int(rng.integers(0, 200))}


def _ex10_5_expect(i, p):
    import torch

    from lib import positions

    want = positions.apply_rope(torch.tensor(i["x_h"], dtype=torch.float64), offset=i["offset_h"]).numpy()
    return {"wrapped_h": want, "launched_h": want}


HARNESS_10_5 = """\
import torch as _torch
import triton as _triton
from lib import positions as _positions
_L, _E = x_h.shape
wrapped_h = rope(x_h, offset_h)
_theta = _torch.tensor(_positions.rope_frequencies(_E), dtype=_torch.float32)
launched_h = _torch.zeros_like(x_h)
rope_kernel[(_L,)](x_h, launched_h, _theta, offset_h, _E, BLOCK=_triton.next_power_of_2(_E // 2))
"""

CHAPTER_10 += [
    Spec(
        label="head-to-model/gqa-decode", title="A decode step for grouped-query attention", draws=2,
        make=_ex10_1_make, expect=_ex10_1_expect, torch_inputs=("q_ex", "k_ex", "v_ex"), harness=HARNESS_10_1,
        compare={"lengths_h": Close(0, 0, "the new tokens at each step"),
                 "outputs_h": Close(1e-5, 1e-6, "every step's output, joined along the tokens"),
                 "keys_so_far": Close(0, 0, "the cached keys"), "values_so_far": Close(0, 0, "the cached values")},
        banned=("is_causal", "enable_gqa", "decoding"),
    ),
    Spec(
        label="head-to-model/rope-kernel", title="RoPE as a Triton kernel", draws=2,
        make=_ex10_5_make, expect=_ex10_5_expect, torch_inputs=("x_h",), harness=HARNESS_10_5, rerun=False,
        compare={"wrapped_h": Close(1e-5, 3e-5, "rope(x, offset): the rotated (L, E) rows"),
                 "launched_h": Close(1e-5, 3e-5, "the rows the kernel stores when launched directly")},
        forbidden=("lib.positions.apply_rope",), banned=("apply_rope",),
    ),
]


def _ex10_2_expect(i, p):
    import torch
    import torch.nn.functional as F

    from lib import modules, positions
    from lib.model import CausalSelfAttention

    torch.manual_seed(3)  # the chapter's `rotary`, built as the chapter builds it
    rotary = CausalSelfAttention(12, 3).eval()
    x = torch.tensor(i["x"])
    with torch.no_grad():
        keys, values, outs = None, None, []
        for t in range(x.shape[1]):  # every token rotated as if it stood at position 0
            xt = x[:, t : t + 1]
            q, k, v = (modules.split_heads(xt @ w, 3) for w in (rotary.w_q, rotary.w_k, rotary.w_v))
            q, k = positions.apply_rope(q, offset=0), positions.apply_rope(k, offset=0)
            keys = k if keys is None else torch.cat([keys, k], dim=-2)
            values = v if values is None else torch.cat([values, v], dim=-2)
            outs.append(modules.merge_heads(F.scaled_dot_product_attention(q, keys, values)) @ rotary.w_o)
        return {"right_rope": rotary(x).numpy(), "wrong_rope": torch.cat(outs, dim=1).numpy()}


def _ex10_4_make(rng, params):
    layers, heads, head_dim = int(rng.integers(2, 49)), int(rng.integers(2, 33)), int(rng.choice([32, 64, 128]))
    return {"layers_h": layers, "heads_h": heads, "head_dim_h": head_dim, "tokens_h": int(rng.integers(100, 9000)),
            "bytes_h": int(rng.choice([1, 2, 4])), "parameters_h": float(rng.integers(10**7, 10**10)) + 0.5}


def _ex10_4_expect(i, p):
    per_token = 2 * i["layers_h"] * i["heads_h"] * i["head_dim_h"] * i["bytes_h"]
    return {"cache_h": per_token * i["tokens_h"],
            "after_h": math.floor(i["parameters_h"] * i["bytes_h"] / per_token) + 1}


CHAPTER_10 += [
    Spec(
        label="head-to-model/rope-offset", title="RoPE with a forgotten offset", draws=2,
        make=lambda rng, p: {"x": rng.standard_normal((2, 5, 12)).astype(np.float32)},
        expect=_ex10_2_expect, torch_inputs=("x",),
        compare={"right_rope": Close(1e-5, 1e-6, "the decoded outputs, (B, n, d_model)"),
                 "wrong_rope": Close(1e-5, 1e-6, "the outputs decoded at offset 0, (B, n, d_model)")},
        banned=("decoding", "KVCache", "cache", "rotary(", "forward", "__call__"),
    ),
    Spec(
        label="head-to-model/cache-bytes", title="kv_cache_bytes_by_hand(layers, heads, head_dim", draws=3,
        make=_ex10_4_make, expect=_ex10_4_expect, rerun=False,
        harness="cache_h = kv_cache_bytes_by_hand(layers_h, heads_h, head_dim_h, tokens_h, bytes_h)\n"
                "after_h = tokens_to_outweigh(parameters_h, layers_h, heads_h, head_dim_h, bytes_h)\n",
        compare={"cache_h": Whole("the cache's bytes, a whole number"),
                 "after_h": Whole("the smallest whole number of tokens whose cache outweighs the parameters")},
        poison=("lib.cost.kv_cache_bytes",),
    ),
]

# the other chapters' hidden tests, a module each; they import this module's classes, defined above
from hidden_tests import ch01, ch02, ch03, ch05, ch06, ch07, ch08, ch12, ch13

SPECS = [*ch01.SPECS, *ch02.SPECS, *ch03.SPECS, *CHAPTER_4, *ch05.SPECS, *ch06.SPECS, *ch07.SPECS, *ch08.SPECS,
         *CHAPTER_9, *CHAPTER_10, *ch12.SPECS, *ch13.SPECS]


def statement_of(exercise, text: str) -> str:
    """The exercise's own paragraph of its statement cell, from its `**N.` on."""
    match = re.search(rf"^\*\*{exercise.number}[.)].*?(?=^\*\*\d+[.)]|\Z)", text, re.MULTILINE | re.DOTALL)
    return match.group(0) if match else ""


def specs_for(exercises: list, cells: dict[str, str], specs=None) -> dict[int, Spec]:
    """Each graded exercise's spec, the one whose title its statement holds (`cells`: cell id -> source)."""
    found = {}
    for exercise in exercises:
        if not exercise.graded:
            continue
        statement = " ".join(statement_of(exercise, cells[exercise.statement]).split()).lower()
        matches = [s for s in (SPECS if specs is None else specs) if " ".join(s.title.split()).lower() in statement]
        if len(matches) > 1:
            raise ValueError(f"exercise {exercise.number}: specs {[s.label for s in matches]} all match it")
        if matches:
            found[exercise.number] = matches[0]
    return found
