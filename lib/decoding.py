"""Generating token by token: a cache of keys and values, and the attention step that reads it (chapter 10).

A model that generates text runs once per new token. Each run needs the new token's query and the keys and values
of every token so far. In a causal model those keys and values never change once computed, since token j never
sees a later token. A :class:`KVCache` keeps them, so each step projects only the new tokens, and
:func:`decode_step` attends the new queries to everything the cache holds.

The new queries are the LAST l of the S tokens the keys cover, so their causal mask is aligned bottom-right:
query i may attend keys j <= S - l + i (:func:`lib.attention.causal_mask` with ``align="bottom-right"``,
``torch.nn.attention.bias.causal_lower_right``). ``is_causal=True`` aligns top-left instead, which for l < S
hides keys the new tokens are entitled to see, and raises no error. The library spells the two alignments
``causal="top-left"`` and ``causal="bottom-right"``; ``causal=True`` is top-left in every function of q, k and v
(as ``is_causal``), and aligns by position in the modules, which makes it bottom-right when they are given a cache.

Shape vocabulary as in :mod:`lib.modules`: ``...`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``l`` new
tokens, ``S`` tokens in the cache, ``E`` query/key size, ``Ev`` value size. NumPy arrays or torch tensors.
"""

from __future__ import annotations

import numbers

import numpy as np

from lib import modules
from lib.backend import _NUMPY, _backend, _check_axes, _from_axes, _to_axes

__all__ = ["KVCache", "decode_step"]  # the cache's size in bytes is counted by lib.cost.kv_cache_bytes


class KVCache:
    """Keys (..., Hkv, S, E) and values (..., Hkv, S, Ev) of the S tokens seen so far, room for ``capacity``.

    The storage, ``capacity`` rows of each, is allocated by the first :meth:`append`, with that call's leading
    dimensions, sizes, dtype and device (NumPy or torch); later appends must match them and are written in place.
    ``keys`` and ``values`` are views of the first ``len(cache)`` rows, never copies. One cache serves one
    attention layer; a model keeps one per layer. ``len(cache)`` is also the position of the next token, which
    rotary position embeddings need. One length serves the whole batch, so every sequence in it must have the same
    number of tokens: ragged prompts need padding masks, or the paged caches of serving systems.

    ``static=True`` makes a cache for cross-attention: its one append stores the keys and values of a context
    (an encoder's output, say), ``capacity`` defaults to their length, and it never grows afterwards;
    :class:`lib.modules.MultiHeadAttention` then reads it at every step instead of projecting the context again.

    Meant for inference: it refuses tensors that require grad, since its in-place writes would break their
    backward pass. Run the model under ``torch.no_grad()`` or ``torch.inference_mode()``.

    ``axes="bshd"`` takes and returns flash-attn's cache layout, k (B, l, Hkv, E) and v (B, l, Hkv, Ev), and
    ``keys``/``values`` (B, S, Hkv, ·), still views; an append of any other rank is refused. The modules and
    :func:`decode_step` take the default ``"bhsd"`` cache.
    """

    def __init__(self, capacity=None, *, static=False, axes="bhsd"):
        self.axes = _check_axes(axes)
        if not isinstance(static, (bool, np.bool_)):
            raise TypeError(f"static must be True or False, got {type(static).__name__}")
        self.static = bool(static)
        if capacity is None and not self.static:
            raise TypeError("capacity is required: how many tokens the cache can hold (a static cache sizes itself)")
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
                raise TypeError(f"capacity must be an integer, got {type(capacity).__name__}")
            if capacity < 1:
                raise ValueError(f"capacity must be at least 1 token, got {capacity}")
            capacity = int(capacity)
        self.capacity = capacity
        self._asked_capacity = capacity
        self._k = self._v = None
        self._length = 0

    def __len__(self):
        return self._length

    def __repr__(self):
        shape = "empty" if self._k is None else f"keys {tuple(self.keys.shape)}, values {tuple(self.values.shape)}"
        kind = ", static" if self.static else ""
        return f"KVCache({self._length} of {self.capacity} tokens, {shape}{kind})"

    @property
    def keys(self):
        """The cached keys, a (..., S, E) view ((B, S, Hkv, E) with ``axes="bshd"``); None before the first append."""
        return None if self._k is None else _to_axes(self.axes, self._k[..., : self._length, :])

    @property
    def values(self):
        """The cached values, a (..., S, Ev) view ((B, S, Hkv, Ev) with ``axes="bshd"``); None before the first
        append."""
        return None if self._v is None else _to_axes(self.axes, self._v[..., : self._length, :])

    @property
    def nbytes(self):
        """Bytes allocated for keys and values together (all ``capacity`` rows; 0 before the first append)."""
        if self._k is None:
            return 0
        return sum(int(np.prod(t.shape)) * _itemsize(t) for t in (self._k, self._v))

    def reset(self):
        """Forget every token: the next append starts a new sequence at position 0 (the storage is kept, so its
        shape, dtype and device still apply)."""
        self._length = 0
        if self.static:
            self._k = self._v = None  # a static cache may then hold another context
            self.capacity = self._asked_capacity

    def append(self, k, v):
        """Store keys k (..., l, E) and values v (..., l, Ev) of l new tokens; return (keys, values) of all S tokens."""
        for name, t in (("k", k), ("v", v)):
            if t is None:
                raise TypeError(f"{name} is required, got None")
        ops = _backend({"k": k, "v": v})
        if ops is _NUMPY:
            k, v = np.asarray(k), np.asarray(v)
        if self.axes != "bhsd":
            named = _from_axes(self.axes, {"k": k, "v": v})  # (B, Hkv, l, ·): stored as the library's layout
            k, v = named["k"], named["v"]
        for name, t in (("k", k), ("v", v)):
            if ops is not _NUMPY and t.requires_grad:
                raise ValueError(
                    f"{name} requires grad, and a KVCache is for inference: its in-place writes would fail the "
                    "backward pass. Run the model under torch.no_grad() or torch.inference_mode(), or pass "
                    f"{name}.detach()"
                )
            if t.ndim < 2:
                raise ValueError(f"{name} must have shape (..., l, size), at least 2-D; got shape {tuple(t.shape)}")
        if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
            raise ValueError(
                f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}: they need the same leading dimensions "
                "and one value per key"
            )
        if self.static and self._k is not None:
            raise ValueError(
                f"this static cache already holds the keys and values of a context of {self._length} tokens, and "
                "never grows: build another cache for another context"
            )
        if self._k is not None:
            for name, t, store in (("k", k, self._k), ("v", v, self._v)):
                _check_matches(name, t, store)
        new = k.shape[-2]  # l, the number of new tokens
        capacity = new if self.capacity is None else self.capacity  # a static cache holds exactly its context
        if self._length + new > capacity:  # checked before anything is stored: a refused append changes nothing
            raise ValueError(
                f"the cache holds {self._length} of {capacity} tokens: {new} more do not fit "
                f"(build it with capacity >= {self._length + new})"
            )
        if self._k is None:
            self._k = _empty_like(k, capacity)  # (..., capacity, E)
            self._v = _empty_like(v, capacity)  # (..., capacity, Ev)
            self.capacity = capacity
        self._k[..., self._length : self._length + new, :] = k  # written in place: earlier rows never move
        self._v[..., self._length : self._length + new, :] = v
        self._length += new
        return self.keys, self.values


def _empty_like(t, capacity):
    shape = tuple(t.shape[:-2]) + (capacity, t.shape[-1])
    if isinstance(t, np.ndarray):
        return np.zeros(shape, dtype=t.dtype)
    return t.new_zeros(shape)  # same dtype and device


def _itemsize(t):
    return t.itemsize if isinstance(t, np.ndarray) else t.element_size()


def _check_matches(name, t, store):
    if isinstance(store, np.ndarray) != isinstance(t, np.ndarray):
        raise TypeError(f"{name} is a {type(t).__name__} but the cache holds a {type(store).__name__}")
    if tuple(t.shape[:-2]) != tuple(store.shape[:-2]) or t.shape[-1] != store.shape[-1]:
        expected = tuple(store.shape[:-2]) + ("l", store.shape[-1])
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but the cache stores {expected}: every append needs the "
            "leading dimensions and size of the first"
        )
    if t.dtype != store.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but the cache stores {store.dtype}: convert it")
    if not isinstance(t, np.ndarray) and t.device != store.device:
        raise ValueError(f"{name} is on device {t.device} but the cache is on {store.device}: move it")


def decode_step(q, k, v, cache):
    """Attend l new tokens to every token so far: output (..., H, l, Ev) (chapter 10).

    q (..., H, l, E) are the new tokens' queries, k (..., Hkv, l, E) and v (..., Hkv, l, Ev) their keys and
    values. k and v are appended to ``cache``; then the queries attend all S cached keys with the causal mask
    aligned bottom-right (query i is token S - l + i, so it sees every earlier token and the new ones up to
    itself). Token by token, or l tokens at a time, this gives exactly the rows of full causal attention over the
    whole sequence. Hkv may divide H (grouped-query attention, :func:`lib.modules.grouped_attention`).
    """
    from lib.paged import PagedKVCache  # here only: a paged cache is welcome too

    if not isinstance(cache, (KVCache, PagedKVCache)):
        raise TypeError(f"cache must be a lib.decoding.KVCache or a lib.paged.PagedKVCache, got "
                        f"{type(cache).__name__}")
    ops = _backend({"q": q, "k": k, "v": v})
    if ops is _NUMPY:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim < 3:
        raise ValueError(f"q must have shape (..., H, l, E), at least 3-D; got shape {tuple(q.shape)}")
    modules._check_heads_input(q, k, v)  # before the append, so that a refused step leaves the cache as it was
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"q has {q.shape[-2]} new queries but k brings {k.shape[-2]} new keys: each new token has one of each"
        )
    keys, values = cache.append(k, v)  # (..., Hkv, S, E), (..., Hkv, S, Ev)
    return modules.grouped_attention(q, keys, values, causal="bottom-right")  # (..., H, l, Ev)
