"""Attention as ``torch.nn`` modules (chapters 6 and 10): the torch twins of :mod:`lib.modules`' NumPy classes::

    TorchSelfAttention       one head, trainable, dropout, any device and dtype    ch. 6
    TorchMultiHeadAttention  h heads (grouped-query if n_kv_heads < n_heads), a KV
                             cache, calling scaled_dot_product_attention on 4-D
                             inputs                                                 ch. 10
    to_multihead_attention, from_multihead_attention
                             conversions to and from torch.nn.MultiheadAttention

This module imports torch, so a NumPy reader never loads it; :mod:`lib.modules` hands out the same names the first
time they are asked for (``from lib.modules import TorchMultiHeadAttention`` works too). The parameter names,
the (in, out) weight layout, the shape vocabulary, the two mask layouts and the meaning of ``causal`` are those of
:mod:`lib.modules`: boolean masks True = may attend; True for ``causal`` aligns by position, top-left without a
cache and bottom-right with one.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lib import attention as attn
from lib.backend import _causal_pattern, _check_causal, _check_flag, _TorchOps
from lib.modules import (
    MultiHeadAttention,
    SelfAttention,
    _check_context,
    _check_dims,
    _check_heads,
    _check_input,
    _grouped,
    _head_shapes,
    _head_sizes,
    _heads_mask,
    _heads_to_attend,
    _shapes,
    _sizes,
    merge_heads,
    xavier_bound,
)

__all__ = ["TorchMultiHeadAttention", "TorchSelfAttention", "from_multihead_attention", "to_multihead_attention"]

_OPS = _TorchOps(torch)


def _check_dropout(dropout):
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_torch_input(x, weight, name, numpy_twin):
    """x must be a tensor on the weights' device and in their dtype; the message says which fix applies."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}; {numpy_twin} takes NumPy")
    if x.device != weight.device:
        raise ValueError(f"{name} is on device {x.device} but the module is on {weight.device}: move one of them")
    if x.dtype != weight.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} but the module's weights are {weight.dtype}: convert one")


def _torch_mask(mask, x):
    """The caller's mask as a tensor on x's device: NumPy masks (such as lib.attention.padding_mask's for NumPy
    lengths) are converted; anything else that is not a tensor is refused, naming the argument."""
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    if isinstance(mask, np.ndarray):
        return torch.as_tensor(mask, device=x.device)
    raise TypeError(f"mask must be a torch.Tensor, a NumPy array or None, got {type(mask).__name__}")


class TorchSelfAttention(nn.Module):
    """Single-head self-attention as a ``torch.nn.Module``: x (..., L, D) -> output (..., L, Do) (chapter 6).

    The twin of :class:`lib.modules.SelfAttention`: same arguments, parameter names (w_q, w_k, w_v and, with
    ``d_out``, w_o), (in, out) layout and Xavier initialisation, drawn from torch's global generator. ``dropout``
    is the probability of zeroing each attention weight while the module is training; ``module.eval()`` turns it
    off.
    """

    def __init__(self, d_model, d_k, d_v=None, d_out=None, *, dropout=0.0, device=None, dtype=None):
        super().__init__()
        self.d_model, self.d_k, self.d_v, self.d_out = _check_dims(d_model, d_k, d_v, d_out)
        self.dropout = _check_dropout(dropout)
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

    def forward(self, x, mask=None, *, causal=False, return_weights=False, key_padding_mask=None):
        """Attend: output (..., L, Do), and the weights (..., L, L) too with ``return_weights=True``.

        ``mask``, ``key_padding_mask`` (B, S), True or 1 on real tokens, and ``causal`` are passed to :mod:`lib.attention` (boolean True = may attend; ``causal`` False,
        True or ``"top-left"``, or ``"bottom-right"``, which agree here since L = S). While training with
        ``dropout > 0`` the weights are dropped out before they mix the values, and the returned weights are the
        dropped-out ones.
        """
        _check_torch_input(x, self.w_q, "x", "SelfAttention")
        _check_input(x, self.d_model)
        mask = _torch_mask(mask, x)
        _check_flag(return_weights, "return_weights")
        q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v  # (..., L, E), (..., L, E), (..., L, Ev)
        if self.training and self.dropout > 0:
            weights = attn.attention_weights(q, k, mask, causal=causal, key_padding_mask=key_padding_mask)
            weights = nn.functional.dropout(weights, self.dropout, training=True)
            out = weights @ v  # (..., L, Ev)
        else:
            out = attn.attention(q, k, v, mask, causal=causal, return_weights=return_weights,
                                 key_padding_mask=key_padding_mask)  # (..., L, Ev)
            out, weights = out if return_weights else (out, None)
        if self.w_o is not None:
            out = out @ self.w_o  # (..., L, Do)
        return (out, weights) if return_weights else out


class TorchMultiHeadAttention(nn.Module):
    """Multi-head attention as a ``torch.nn.Module``: x (..., L, D) -> output (..., L, D) (chapter 10).

    The twin of :class:`lib.modules.MultiHeadAttention`: same arguments, parameter names (w_q, w_k, w_v, w_o),
    (in, out) layout and Xavier initialisation, drawn from torch's global generator. The heads go to
    ``torch.nn.functional.scaled_dot_product_attention`` as 4-D (B, H, L, d) tensors, the only shape its fused
    kernels take, in the form that keeps them open (see :func:`sdpa_arguments`). ``dropout`` is the probability of
    zeroing each attention weight while the module is training; ``module.eval()`` turns it off.
    """

    def __init__(self, d_model, n_heads, n_kv_heads=None, *, dropout=0.0, device=None, dtype=None):
        super().__init__()
        self.d_model, self.n_heads, self.n_kv_heads = _check_heads(d_model, n_heads, n_kv_heads)
        self.d_head = self.d_model // self.n_heads
        self.dropout = _check_dropout(dropout)
        for name, (fan_in, fan_out) in _head_shapes(self.d_model, self.n_heads, self.n_kv_heads).items():
            w = torch.empty(fan_in, fan_out, device=device, dtype=dtype)
            a = xavier_bound(fan_in, fan_out)
            self.register_parameter(name, nn.Parameter(nn.init.uniform_(w, -a, a)))

    def extra_repr(self):
        return _head_sizes(self)

    def num_parameters(self):
        """How many numbers the module learns."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, x, mask=None, *, context=None, causal=False, cache=None, rotate=None, return_weights=False,
                key_padding_mask=None):
        """Attend: output (..., L, D), and the weights (..., H, L, S) too with ``return_weights=True``.

        Arguments as :meth:`lib.modules.MultiHeadAttention.__call__`: ``mask`` (boolean True = may attend, or
        floating, added) is (..., L, S), shared by every head, or (..., 1 or H, L, S), per head; ``causal`` True
        aligns by position, top-left without a cache and bottom-right with one; ``cache`` a
        :class:`lib.decoding.KVCache`, static with ``context``; ``rotate(t, start)`` turns the queries and new keys
        of self-attention by position (rotary embeddings) before the keys are cached. Without ``return_weights``
        the attention is ``scaled_dot_product_attention``; the weights, which it never returns, come from
        :func:`lib.modules.grouped_attention`'s arithmetic, dropped out while training like the output they mix.
        ``key_padding_mask`` (B, S), True or 1 on a real key (Hugging Face's ``attention_mask``; ``~m`` for
        ``nn.MultiheadAttention``'s), is read per sequence, whatever L and the number of heads are.
        """
        _check_torch_input(x, self.w_q, "x", "MultiHeadAttention")
        _check_input(x, self.d_model)
        mask = _torch_mask(mask, x)
        _check_flag(return_weights, "return_weights")

        def check(context):
            _check_torch_input(context, self.w_q, "context", "MultiHeadAttention")
            return _check_context(context, x, self.d_model)

        q, k, v, follows_cache = _heads_to_attend(self, x, context, cache, check, rotate)  # q (..., H, L, d)
        L, S = q.shape[-2], k.shape[-2]
        offset = _check_causal(causal, L, S, true="bottom-right" if follows_cache else "top-left")
        p = self.dropout if self.training else 0.0
        if return_weights:
            drop = None if p == 0 else (lambda w: nn.functional.dropout(w, p, training=True))
            full_mask = _heads_mask(_OPS, mask, offset, x.shape[:-2], self.n_heads, L, S, q, key_padding_mask)
            out, weights = _grouped(q, k, v, full_mask, True, drop)  # (..., H, L, d), (..., H, L, S)
        else:
            mask = _heads_mask(_OPS, mask, None, x.shape[:-2], self.n_heads, L, S, q,
                               key_padding_mask)  # the caller's alone
            out, weights = _sdpa(q, k, v, mask, offset, p), None  # (..., H, L, d)
        out = merge_heads(out) @ self.w_o  # (..., L, D)
        return (out, weights) if return_weights else out


def sdpa_arguments(q, k, v, mask, causal):
    """The 4-D q, k, v and keywords for ``scaled_dot_product_attention`` that compute the heads' attention.

    q (..., H, L, d), k and v (..., Hkv, S, d), ``mask`` None or (..., 1 or H, L, S) from the caller (not the causal
    pattern), ``causal`` None or the offset of the causal diagonal. The batch dimensions fold into one, B, since
    every fused kernel needs 4-D inputs (given 3-D ones SDPA runs its unfused math kernel and builds the whole
    (L, S) matrix, chapter 7). The causal pattern is passed in the form that keeps the fused kernels open:

    - no mask at all when every query may attend every key: a one-token decode step (bottom-right, L = 1), or S = 1;
    - ``is_causal=True`` for top-left (the same as bottom-right when L = S);
    - ``causal_lower_right(L, S)`` for bottom-right with L > 1 (chunked prefill after a cache), which the flash and
      memory-efficient CUDA kernels take natively, without a dense mask;
    - a dense mask only when the caller gave one, the causal pattern folded into it.

    Grouped-query heads use ``enable_gqa=True``, except with a dense mask: CUDA's flash kernel refuses every dense
    mask, and the memory-efficient kernel has refused unequal head counts, so masked GQA fell back to the math
    kernel; the key/value heads are repeated instead (as Hugging Face's ``use_gqa_in_sdpa`` does). Returns
    (q, k, v, keywords).
    """
    *batch, H, L, d = q.shape
    Hkv, S, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    B = math.prod(batch)
    q4, k4, v4 = q.reshape(B, H, L, d), k.reshape(B, Hkv, S, d), v.reshape(B, Hkv, S, dv)
    keywords = {}
    if mask is None:
        if causal is not None and causal < S - 1:  # some query has keys in its future
            if causal == 0:
                keywords["is_causal"] = True
            else:
                keywords["attn_mask"] = causal_lower_right(L, S)
    else:
        if causal is not None:
            allowed = _causal_pattern(_OPS, range(L), range(S), q, causal)  # (L, S)
            mask = mask & allowed if mask.dtype == torch.bool else mask + torch.where(allowed, 0.0, -math.inf)
        *mb, h, ml, ms = mask.shape
        if all(n == 1 for n in mb):
            mask = mask.reshape(1, h, ml, ms)
        else:
            mask = mask.expand(*batch, h, ml, ms).reshape(B, h, ml, ms)  # (B, 1 or H, L, S)
        keywords["attn_mask"] = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        if Hkv != H:  # repeat the key/value heads rather than pair enable_gqa with a dense mask
            k4, v4 = k4.repeat_interleave(H // Hkv, dim=1), v4.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, d)
    if k4.shape[1] != H:
        keywords["enable_gqa"] = True  # torch >= 2.5
    return q4, k4, v4, keywords


def _sdpa(q, k, v, mask, causal, dropout_p):
    """The heads' attention (..., H, L, dv) by ``scaled_dot_product_attention`` (see :func:`sdpa_arguments`)."""
    *batch, H, L, _ = q.shape
    q4, k4, v4, keywords = sdpa_arguments(q, k, v, mask, causal)
    out = nn.functional.scaled_dot_product_attention(q4, k4, v4, dropout_p=dropout_p, **keywords)  # (B, H, L, dv)
    return out.reshape(*batch, H, L, v.shape[-1])  # (..., H, L, dv)


def to_multihead_attention(module):
    """A ``torch.nn.MultiheadAttention`` (batch_first, no biases) computing what ``module`` computes.

    ``module`` is a one-head :class:`lib.modules.SelfAttention` or :class:`TorchSelfAttention` with
    d_k = d_v = d_model (one head of ``nn.MultiheadAttention`` projects to embed_dim = d_model), or a
    :class:`lib.modules.MultiHeadAttention` or :class:`TorchMultiHeadAttention` without grouped key/value heads.
    The packed ``in_proj_weight`` (3D, D) is [w_qᵀ; w_kᵀ; w_vᵀ], rows as outputs, head i owning rows i·d to
    (i+1)·d - 1 of each block; ``out_proj`` gets w_oᵀ, or the identity when a one-head module has no w_o (then
    d_out must be d_model too). It keeps the module's dropout probability (0 for the NumPy modules), which acts
    only while it trains. Call it as ``mha(x, x, x)``; its masks use True = may NOT attend.
    """
    if not isinstance(module, (SelfAttention, MultiHeadAttention, TorchSelfAttention, TorchMultiHeadAttention)):
        raise TypeError(f"module must be a SelfAttention, MultiHeadAttention or one of their torch twins, got "
                        f"{type(module).__name__}")
    D = module.d_model
    n_heads = getattr(module, "n_heads", None)
    if n_heads is None:
        for name in ("d_k", "d_v"):
            if getattr(module, name) != D:
                raise ValueError(
                    f"{name}={getattr(module, name)} but d_model={D}: one head of nn.MultiheadAttention projects "
                    "queries, keys and values to d_model"
                )
        if module.d_out not in (None, D):
            raise ValueError(f"d_out={module.d_out} but d_model={D}: nn.MultiheadAttention's out_proj is D x D")
        n_heads = 1
    elif module.n_kv_heads != n_heads:
        raise ValueError(
            f"n_kv_heads={module.n_kv_heads} but n_heads={n_heads}: nn.MultiheadAttention has one key/value head "
            "per query head (no grouped-query attention)"
        )
    state = module.state_dict()
    if isinstance(module, (SelfAttention, MultiHeadAttention)):
        state = {n: torch.from_numpy(w) for n, w in state.items()}
    like = state["w_q"]
    dropout = getattr(module, "dropout", 0.0)  # the NumPy modules have none
    mha = nn.MultiheadAttention(
        D, n_heads, dropout=dropout, bias=False, batch_first=True, device=like.device, dtype=like.dtype
    )
    w_o = state.get("w_o")
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([state["w_q"].T, state["w_k"].T, state["w_v"].T]))  # (3D, D)
        mha.out_proj.weight.copy_(torch.eye(D, dtype=like.dtype, device=like.device) if w_o is None else w_o.T)
    return mha


def from_multihead_attention(mha):
    """A :class:`TorchMultiHeadAttention` holding the weights of ``mha``, a ``torch.nn.MultiheadAttention``.

    The inverse of :func:`to_multihead_attention`: ``in_proj_weight`` (3D, D) is cut into its three (D, D) blocks,
    each transposed to the (in, out) layout, and ``out_proj.weight`` becomes w_oᵀ. The result has mha's heads,
    dropout, device and dtype. These modules have no biases, so mha's must be absent or zero (a freshly built
    ``nn.MultiheadAttention`` starts them at zero); keys and values of their own size (kdim, vdim) and
    ``add_bias_kv`` or ``add_zero_attn`` are refused. The result reads x as (..., L, D), batch first, whatever
    ``mha.batch_first`` says. Remember the polarity: our masks are True = may attend.
    """
    if not isinstance(mha, nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if not mha._qkv_same_embed_dim:
        raise ValueError(
            f"mha has kdim={mha.kdim}, vdim={mha.vdim} but embed_dim={mha.embed_dim}: only the packed "
            "in_proj_weight of kdim = vdim = embed_dim is supported"
        )
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("mha was built with add_bias_kv or add_zero_attn, which these modules do not have")
    for name, bias in (("in_proj_bias", mha.in_proj_bias), ("out_proj.bias", mha.out_proj.bias)):
        if bias is not None and bool((bias.detach() != 0).any()):
            raise ValueError(f"mha's {name} is not zero, and these modules have no biases: build it with bias=False")
    w = mha.in_proj_weight.detach()
    module = TorchMultiHeadAttention(mha.embed_dim, mha.num_heads, dropout=mha.dropout, device=w.device, dtype=w.dtype)
    w_q, w_k, w_v = w.chunk(3)  # each (D, D), rows as outputs
    with torch.no_grad():
        for name, value in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", mha.out_proj.weight.detach())):
            getattr(module, name).copy_(value.T)  # (in, out)
    return module
