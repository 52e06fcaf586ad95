"""A paged key-value cache: fixed-size pages in a shared pool, and a block table per sequence (chapter 12).

:class:`lib.decoding.KVCache` reserves ``capacity`` rows for one sequence up front: a server that does not know
how long each answer will be either reserves the longest for everyone, and wastes most of it, or copies caches as
they grow. PagedAttention (Kwon et al., 2023) borrows the operating system's answer, virtual memory: keys and
values live in pages of ``page_size`` tokens drawn from one :class:`PagePool`, and each sequence keeps a block
table, the list of its pages in order. Logical token j of a sequence is row ``j % page_size`` of page
``block_table[j // page_size]``. A sequence takes a page only when its last one is full, so at most
``page_size - 1`` rows per sequence are ever unused, and a finished sequence's pages go back to the pool at once.

Reading the keys back in order is a gather through the table (:meth:`PagedKVCache.keys`). A decoding kernel need
not gather: :func:`lib.flash_decode.flash_decode_paged` looks each key tile's page up in the table as it loads it.

Shapes: appends bring k (..., l, E) and v (..., l, Ev), as for :class:`~lib.decoding.KVCache`; the pool stores
pages of keys (pages, ..., page_size, E) and values (pages, ..., page_size, Ev). NumPy arrays or torch tensors.
"""

from __future__ import annotations

import heapq
import numbers

import numpy as np

from lib.backend import _NUMPY, _backend

__all__ = ["PagePool", "PagedKVCache"]


def _count(value, name, least):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return int(value)


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens' keys and values, shared by the sequences that draw on it.

    The storage, ``key_pages`` (pages, ..., page_size, E) and ``value_pages`` (pages, ..., page_size, Ev), is
    allocated by the first append of any sequence, with that call's leading dimensions, head sizes, dtype and
    device; every later append, of any sequence, must match them. Free pages are handed out lowest first.
    """

    def __init__(self, num_pages, page_size):
        self.num_pages = _count(num_pages, "num_pages", 1)
        self.page_size = _count(page_size, "page_size", 1)
        self.key_pages = self.value_pages = None
        self._free = list(range(self.num_pages))  # a heap: the lowest free page first

    def __repr__(self):
        held = "empty" if self.key_pages is None else f"pages of keys {tuple(self.key_pages.shape[1:])}"
        return f"PagePool({self.free_pages} of {self.num_pages} pages free, {self.page_size} tokens each, {held})"

    @property
    def free_pages(self):
        """How many pages no sequence holds."""
        return len(self._free)

    @property
    def nbytes(self):
        """Bytes allocated for keys and values together, every page (0 before the first append)."""
        if self.key_pages is None:
            return 0
        return sum(int(np.prod(t.shape)) * _itemsize(t) for t in (self.key_pages, self.value_pages))

    def _take(self, n):
        return [heapq.heappop(self._free) for _ in range(n)]

    def _give_back(self, pages):
        for page in pages:
            heapq.heappush(self._free, page)

    def _storage_for(self, k, v):
        """Allocate the pages on first use; otherwise check that k, v match what the pages hold."""
        if self.key_pages is None:
            self.key_pages = _zeros(k, self.num_pages, self.page_size)  # (pages, ..., page_size, E)
            self.value_pages = _zeros(v, self.num_pages, self.page_size)  # (pages, ..., page_size, Ev)
            return
        for name, t, store in (("k", k, self.key_pages), ("v", v, self.value_pages)):
            if isinstance(store, np.ndarray) != isinstance(t, np.ndarray):
                raise TypeError(f"{name} is a {type(t).__name__} but the pool holds a {type(store).__name__}")
            if tuple(t.shape[:-2]) != tuple(store.shape[1:-2]) or t.shape[-1] != store.shape[-1]:
                expected = tuple(store.shape[1:-2]) + ("l", store.shape[-1])
                raise ValueError(f"{name} has shape {tuple(t.shape)} but the pool stores {expected}: every append "
                                 "needs the leading dimensions and size of the first")
            if t.dtype != store.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the pool stores {store.dtype}: convert it")
            if not isinstance(t, np.ndarray) and t.device != store.device:
                raise ValueError(f"{name} is on device {t.device} but the pool is on {store.device}: move it")


class PagedKVCache:
    """One sequence's keys and values, kept in pages of a :class:`PagePool` and found through a block table.

    Used like :class:`lib.decoding.KVCache` (``append`` returns all keys and values so far, so
    :func:`lib.decoding.decode_step` takes either), but :meth:`keys` and :meth:`values` are gathered copies, not
    views: the rows are not contiguous. :meth:`release` hands the pages back when the sequence ends. Meant for
    inference: tensors that require grad are refused.
    """

    def __init__(self, pool):
        if not isinstance(pool, PagePool):
            raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        self.pool = pool
        self._table = []  # physical page of each logical page, in order
        self._length = 0
        # The same table and length on the pool's device (torch pools): updated by append and release, so that a
        # decoding kernel reads them there without any copy from the host at decode time (CUDA graphs need that).
        self._device_table = self._device_length = None

    def __len__(self):
        return self._length

    def __repr__(self):
        return (f"PagedKVCache({self._length} tokens in {len(self._table)} pages of {self.pool.page_size}, "
                f"block table {self._table})")

    @property
    def block_table(self):
        """The physical pages holding logical pages 0, 1, ... of this sequence, a tuple of ints."""
        return tuple(self._table)

    @property
    def device_block_table(self):
        """The block table on the pool's device: an int32 tensor of ``num_pages`` entries whose first
        ``len(block_table)`` are the table (the rest are unused); None for a NumPy pool or before the first append.
        :meth:`append` writes the pages it takes into it, so a decoding step copies nothing from the host."""
        return self._device_table

    @property
    def device_length(self):
        """The cache's length on the pool's device, an int32 tensor of one element (None as for the table)."""
        return self._device_length

    def keys(self):
        """The S cached keys in order, (..., S, E), gathered through the block table; None while the pool is empty."""
        return self._gather(self.pool.key_pages)

    def values(self):
        """The S cached values in order, (..., S, Ev), gathered through the table; None while the pool is empty."""
        return self._gather(self.pool.value_pages)

    def _gather(self, pages):
        if pages is None:
            return None
        if isinstance(pages, np.ndarray):
            picked = np.moveaxis(pages[np.asarray(self._table, dtype=np.intp)], 0, -3)  # (..., P, page_size, size)
        else:
            import torch

            index = torch.tensor(self._table, dtype=torch.long, device=pages.device)
            picked = pages.index_select(0, index).movedim(0, -3)  # (..., P, page_size, size)
        rows = len(self._table) * self.pool.page_size
        whole = picked.reshape(*picked.shape[:-3], rows, picked.shape[-1])  # (..., P · page_size, size)
        return whole[..., : self._length, :]  # (..., S, size)

    def append(self, k, v):
        """Store keys k (..., l, E) and values v (..., l, Ev) of l new tokens; return (keys, values) of all S tokens.

        New pages are taken from the pool only when the last one is full. If the pool has too few free pages,
        nothing is written and a ValueError says how many are missing.
        """
        for name, t in (("k", k), ("v", v)):
            if t is None:
                raise TypeError(f"{name} is required, got None")
        ops = _backend({"k": k, "v": v})
        if ops is _NUMPY:
            k, v = np.asarray(k), np.asarray(v)
        else:
            for name, t in (("k", k), ("v", v)):
                if t.requires_grad:
                    raise ValueError(f"{name} requires grad, but a cache is for inference: run the model under "
                                     f"torch.no_grad() (or append {name}.detach())")
        for name, t in (("k", k), ("v", v)):
            if t.ndim < 2:
                raise ValueError(f"{name} must have shape (..., l, size), at least 2-D; got shape {tuple(t.shape)}")
        if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
            raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}: they need the same leading "
                             "dimensions and one value per key")
        pool = self.pool
        new = k.shape[-2]  # l
        size = pool.page_size
        needed = -(-(self._length + new) // size) - len(self._table)  # pages to take: ⌈(S + l) / size⌉ - held
        if needed > pool.free_pages:
            raise ValueError(f"the pool has {pool.free_pages} free pages of {size} tokens, but {new} more tokens "
                             f"after {self._length} need {needed}: build a larger pool or release finished "
                             "sequences")
        pool._storage_for(k, v)
        taken = pool._take(needed)
        if self._device_table is None and not isinstance(pool.key_pages, np.ndarray):
            import torch

            device = pool.key_pages.device
            self._device_table = torch.zeros(pool.num_pages, dtype=torch.int32, device=device)
            self._device_length = torch.zeros(1, dtype=torch.int32, device=device)
            if self._table:  # pages held before (a cache released and used again keeps none)
                self._device_table[: len(self._table)] = torch.tensor(self._table, dtype=torch.int32)
        if taken and self._device_table is not None:
            import torch

            start = len(self._table)
            self._device_table[start : start + len(taken)] = torch.tensor(taken, dtype=torch.int32)
        self._table += taken
        done = 0
        while done < new:  # fill the last page, then whole pages, then the start of the last
            position = self._length + done
            page, row = self._table[position // size], position % size
            n = min(size - row, new - done)
            pool.key_pages[page, ..., row : row + n, :] = k[..., done : done + n, :]
            pool.value_pages[page, ..., row : row + n, :] = v[..., done : done + n, :]
            done += n
        self._length += new
        if self._device_length is not None:
            self._device_length.fill_(self._length)  # the length travels as a kernel argument, not a copy
        return self.keys(), self.values()

    def release(self):
        """Hand every page back to the pool; the cache is then empty and may be used again."""
        self.pool._give_back(self._table)
        self._table = []
        self._length = 0
        if self._device_length is not None:
            self._device_length.fill_(0)


def _zeros(t, pages, page_size):
    shape = (pages, *t.shape[:-2], page_size, t.shape[-1])
    if isinstance(t, np.ndarray):
        return np.zeros(shape, dtype=t.dtype)
    return t.new_zeros(shape)  # same dtype and device


def _itemsize(t):
    return t.itemsize if isinstance(t, np.ndarray) else t.element_size()
