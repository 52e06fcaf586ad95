"""Self-attention as a module: learned projections around :func:`lib.attention.attention` (chapter 6).

Two mirrored twins with the same parameter names and the same arithmetic:

    SelfAttention        NumPy, forward only (no gradients, no dropout)
    TorchSelfAttention   a ``torch.nn.Module``: trainable, dropout on the weights, any device and dtype

This module imports without torch: ``TorchSelfAttention`` is built the first time it is asked for.

Shape vocabulary, as in :mod:`lib.attention`, plus the sizes of the projections:

    ...   batch dimensions        L     sequence length (self-attention: L = S)
    D     d_model, the size of each input token      E     d_k, the query and key size
    Ev    d_v, the value size                        Do    d_out, the output size (Ev without an output projection)

    x (..., L, D)   w_q (D, E)   w_k (D, E)   w_v (D, Ev)   w_o (Ev, Do)   weights (..., L, L)   output (..., L, Do)

Weights are stored as the book writes them, (in, out), so a projection is ``x @ w_q``: the transpose of the
(out, in) layout of ``torch.nn.Linear`` and of ``nn.MultiheadAttention``'s ``in_proj_weight``.
Masks follow :mod:`lib.attention`: a boolean mask is True where a query MAY attend a key (the opposite of
``nn.MultiheadAttention``), a floating mask is added to the scores.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from lib import attention as attn

# TorchSelfAttention is public too, created on first access by the module __getattr__ below.
__all__ = ["SelfAttention", "to_multihead_attention", "xavier_bound"]

PARAMETER_NAMES = ("w_q", "w_k", "w_v", "w_o")


def xavier_bound(fan_in, fan_out):
    """Half-width a of Xavier/Glorot's uniform initialisation U(-a, a), a = sqrt(6 / (fan_in + fan_out)).

    Its variance a²/3 = 2 / (fan_in + fan_out) keeps activations near unit variance going forwards (which wants
    1/fan_in) and gradients going backwards (which wants 1/fan_out) as well as one number can (chapter 6).
    """
    fan_in = _check_size(fan_in, "fan_in")
    fan_out = _check_size(fan_out, "fan_out")
    return math.sqrt(6.0 / (fan_in + fan_out))


def _check_size(n, name):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{name} must be at least 1, got {n}")
    return int(n)


def _check_dims(d_model, d_k, d_v, d_out):
    """The four sizes as ints, d_v defaulting to d_k; d_out stays None when there is no output projection."""
    d_model = _check_size(d_model, "d_model")
    d_k = _check_size(d_k, "d_k")
    d_v = d_k if d_v is None else _check_size(d_v, "d_v")
    d_out = None if d_out is None else _check_size(d_out, "d_out")
    return d_model, d_k, d_v, d_out


def _shapes(d_model, d_k, d_v, d_out):
    """Parameter name -> (in, out) shape, in PARAMETER_NAMES order."""
    shapes = {"w_q": (d_model, d_k), "w_k": (d_model, d_k), "w_v": (d_model, d_v)}
    if d_out is not None:
        shapes["w_o"] = (d_v, d_out)
    return shapes


def _check_input(x, d_model):
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, d_model), at least 2-D; got shape {tuple(x.shape)}")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"x has d_model={x.shape[-1]} (its last dimension) but the module was built for d_model={d_model} "
            f"(x shape {tuple(x.shape)})"
        )


def _sizes(module):
    d_out = "" if module.d_out is None else f", d_out={module.d_out}"
    return f"d_model={module.d_model}, d_k={module.d_k}, d_v={module.d_v}{d_out}"


# --------------------------------------------------------------------------------------------------------------
# NumPy
# --------------------------------------------------------------------------------------------------------------


class SelfAttention:
    """Single-head self-attention in NumPy: x (..., L, D) -> output (..., L, Do) (chapter 6).

    ``d_v`` defaults to ``d_k``. With ``d_out`` an output projection w_o (Ev, Do) follows the attention; without
    it the output is the attention's own (..., L, Ev). Every weight is drawn from Xavier's U(-a, a) with
    ``rng`` (a seed or a ``numpy.random.Generator``) in ``dtype``.
    """

    def __init__(self, d_model, d_k, d_v=None, d_out=None, *, rng=None, dtype=np.float32):
        self.d_model, self.d_k, self.d_v, self.d_out = _check_dims(d_model, d_k, d_v, d_out)
        rng = np.random.default_rng(rng)
        for name, (fan_in, fan_out) in _shapes(self.d_model, self.d_k, self.d_v, self.d_out).items():
            a = xavier_bound(fan_in, fan_out)
            setattr(self, name, rng.uniform(-a, a, size=(fan_in, fan_out)).astype(dtype))
        if self.d_out is None:
            self.w_o = None

    def __repr__(self):
        return f"SelfAttention({_sizes(self)})"

    def state_dict(self):
        """Parameter name -> a copy of the weight, (in, out); the same names as :class:`TorchSelfAttention`."""
        return {n: getattr(self, n).copy() for n in PARAMETER_NAMES if getattr(self, n) is not None}

    def load_state_dict(self, state):
        """Copy weights in from a dict such as another module's ``state_dict()`` (torch tensors are accepted)."""
        expected = _shapes(self.d_model, self.d_k, self.d_v, self.d_out)
        if set(state) != set(expected):
            raise ValueError(f"state has parameters {sorted(state)} but {self!r} has {sorted(expected)}")
        for name, shape in expected.items():
            value = state[name]
            if hasattr(value, "detach"):  # a torch tensor, possibly on a GPU
                value = value.detach().cpu().numpy()
            value = np.asarray(value)
            if value.shape != shape:
                raise ValueError(f"{name} has shape {value.shape} but {self!r} needs {shape}")
            setattr(self, name, value.astype(getattr(self, name).dtype, copy=True))

    def num_parameters(self):
        """How many numbers the module learns."""
        return sum(w.size for w in self.state_dict().values())

    def __call__(self, x, mask=None, *, causal=False, return_weights=False):
        """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

        ``mask`` and ``causal`` are passed to :func:`lib.attention.attention` (boolean True = may attend).
        """
        x = np.asarray(x)
        _check_input(x, self.d_model)
        q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
        # without weights the library takes its cheaper path, so the output is exactly attn.attention's
        out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights)  # (..., L, Ev)
        out, weights = out if return_weights else (out, None)
        if self.w_o is not None:
            out = out @ self.w_o  # (..., L, Do)
        return (out, weights) if return_weights else out


# --------------------------------------------------------------------------------------------------------------
# PyTorch, built on first use so that importing this module never imports torch
# --------------------------------------------------------------------------------------------------------------


def _build_torch_class():
    import torch
    from torch import nn

    class TorchSelfAttention(nn.Module):
        """Single-head self-attention as a ``torch.nn.Module``: x (..., L, D) -> output (..., L, Do) (chapter 6).

        The twin of :class:`SelfAttention`: same arguments, parameter names (w_q, w_k, w_v and, with ``d_out``,
        w_o), (in, out) layout and Xavier initialisation, drawn from torch's global generator. ``dropout`` is
        the probability of zeroing each attention weight while the module is training; ``module.eval()``
        turns it off.
        """

        def __init__(self, d_model, d_k, d_v=None, d_out=None, *, dropout=0.0, device=None, dtype=None):
            super().__init__()
            self.d_model, self.d_k, self.d_v, self.d_out = _check_dims(d_model, d_k, d_v, d_out)
            if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
                raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
            self.dropout = float(dropout)
            for name, (fan_in, fan_out) in _shapes(self.d_model, self.d_k, self.d_v, self.d_out).items():
                w = torch.empty(fan_in, fan_out, device=device, dtype=dtype)
                a = xavier_bound(fan_in, fan_out)
                self.register_parameter(name, nn.Parameter(nn.init.uniform_(w, -a, a)))
            if self.d_out is None:
                self.register_parameter("w_o", None)

        def extra_repr(self):
            return _sizes(self)

        def num_parameters(self):
            """How many numbers the module learns."""
            return sum(p.numel() for p in self.parameters())

        def forward(self, x, mask=None, *, causal=False, return_weights=False):
            """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

            ``mask`` and ``causal`` are passed to :mod:`lib.attention` (boolean True = may attend). While
            training with ``dropout > 0`` the weights are dropped out before they mix the values, and the
            returned weights are the dropped-out ones.
            """
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}; SelfAttention takes NumPy")
            _check_input(x, self.d_model)
            w_q = self.w_q
            if x.device != w_q.device:
                raise ValueError(f"x is on device {x.device} but the module is on {w_q.device}: move one of them")
            if x.dtype != w_q.dtype:
                raise ValueError(f"x has dtype {x.dtype} but the module's weights are {w_q.dtype}: convert one")
            q, k, v = x @ w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
            if self.training and self.dropout > 0:
                weights = attn.attention_weights(q, k, mask, causal=causal)  # (..., L, L)
                weights = nn.functional.dropout(weights, self.dropout, training=True)
                out = weights @ v  # (..., L, Ev)
            else:
                out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights)  # (..., L, Ev)
                out, weights = out if return_weights else (out, None)
            if self.w_o is not None:
                out = out @ self.w_o  # (..., L, Do)
            return (out, weights) if return_weights else out

    TorchSelfAttention.__module__ = __name__
    TorchSelfAttention.__qualname__ = "TorchSelfAttention"
    return TorchSelfAttention


def __getattr__(name):
    if name == "TorchSelfAttention":
        cls = _build_torch_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def to_multihead_attention(module):
    """A one-head ``torch.nn.MultiheadAttention`` (batch_first, no biases) computing what ``module`` computes.

    ``module`` is a :class:`SelfAttention` or :class:`TorchSelfAttention` with d_k = d_v = d_model, since one
    head of ``nn.MultiheadAttention`` projects to embed_dim = d_model. Its packed ``in_proj_weight`` (3D, D) is
    [w_qᵀ; w_kᵀ; w_vᵀ], rows as outputs; ``out_proj`` gets w_oᵀ, or the identity when the module has no w_o
    (then d_out must be d_model too). Call it as ``mha(x, x, x)``; its masks use True = may NOT attend.
    """
    import torch
    from torch import nn

    D = module.d_model
    for name in ("d_k", "d_v"):
        if getattr(module, name) != D:
            raise ValueError(
                f"{name}={getattr(module, name)} but d_model={D}: one head of nn.MultiheadAttention projects "
                "queries, keys and values to d_model"
            )
    if module.d_out not in (None, D):
        raise ValueError(f"d_out={module.d_out} but d_model={D}: nn.MultiheadAttention's out_proj is D x D")
    state = module.state_dict()
    if isinstance(module, SelfAttention):
        state = {n: torch.from_numpy(w) for n, w in state.items()}
    like = state["w_q"]
    mha = nn.MultiheadAttention(D, 1, bias=False, batch_first=True, device=like.device, dtype=like.dtype)
    w_o = state.get("w_o")
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([state["w_q"].T, state["w_k"].T, state["w_v"].T]))  # (3D, D)
        mha.out_proj.weight.copy_(torch.eye(D, dtype=like.dtype, device=like.device) if w_o is None else w_o.T)
    return mha
