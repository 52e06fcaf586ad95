"""What a Triton kernel moves: the bytes each launch loads from and stores to global memory, counted in Triton's
interpreter on a CPU (chapter 8's IO count, run on the real kernel)::

    with traffic.count() as moved:
        flash.flash_attention(q, k, v)  # any code that launches kernels
    moved.bytes("K")        # bytes loaded from argument K, all programs
    print(moved.table())    # per kernel and argument: loaded, stored

Every ``tl.load``, ``tl.store`` and atomic, from a pointer block or a tensor descriptor, is counted lane by lane:
a lane whose mask is False moves nothing and is not counted; a lane counts its element's size in bytes. Each byte is
charged to the kernel argument (a tensor) whose memory it lies in, by name, as the kernel's signature names it. A
byte that lies in no argument (a scratch buffer the kernel allocates, say) is charged to ``"?"``. The count is of
accesses, not of distinct bytes: a tile read twice counts twice, which is what a kernel that re-reads K and V for
every query tile costs in HBM traffic when no cache catches the re-reads (chapter 8). Nothing here is timed.

Triton runs its interpreter only if ``TRITON_INTERPRET=1`` was set before Triton was imported; :func:`count` refuses
otherwise, since a compiled kernel's memory operations cannot be watched from Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections import defaultdict

import numpy as np

__all__ = ["Launch", "Traffic", "count", "flash_forward_bytes"]

UNKNOWN = "?"


@dataclasses.dataclass
class Launch:
    """One kernel launch: its name, its grid, and the bytes it loaded and stored, per argument name."""

    kernel: str
    grid: tuple[int, ...]
    loaded: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    stored: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    @property
    def programs(self) -> int:
        return int(np.prod(self.grid))


class Traffic:
    """The launches seen inside one :func:`count` block, in order."""

    def __init__(self):
        self.launches: list[Launch] = []

    def bytes(self, name: str | None = None, kind: str = "load", kernel: str | None = None) -> int:
        """Bytes moved, summed over launches (of ``kernel`` only, if given): ``kind`` is "load", "store" or "both";
        ``name`` is one argument's name (None: every argument)."""
        if kind not in ("load", "store", "both"):
            raise ValueError(f"kind must be 'load', 'store' or 'both', not {kind!r}")
        if kernel is not None and not any(launch.kernel == kernel for launch in self.launches):
            raise ValueError(f"no launch of a kernel named {kernel!r}; launched: {self.kernels()}")
        total = 0
        for launch in self.launches:
            if kernel is not None and launch.kernel != kernel:
                continue
            for table in ((launch.loaded,) if kind == "load" else (launch.stored,) if kind == "store"
                          else (launch.loaded, launch.stored)):
                total += sum(table.values()) if name is None else table.get(name, 0)
        return int(total)

    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self.launches]

    def table(self) -> str:
        """One line per (kernel, argument) that moved anything: bytes loaded and stored."""
        lines = [f"{'kernel':<24}{'argument':<10}{'loaded':>14}{'stored':>14}"]
        for launch in self.launches:
            for name in sorted(set(launch.loaded) | set(launch.stored)):
                lines.append(f"{launch.kernel:<24}{name:<10}{launch.loaded.get(name, 0):>14,}"
                             f"{launch.stored.get(name, 0):>14,}")
        return "\n".join(lines)


class _Ranges:
    """Address ranges of a launch's tensor arguments, to charge each address to its argument."""

    def __init__(self, named_tensors):
        spans = []
        for name, tensor in named_tensors:
            if tensor.numel() == 0:
                continue
            # from the tensor's first element to one past its last (negative strides are not Triton's)
            start = tensor.data_ptr()
            last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
            spans.append((start, start + (last + 1) * tensor.element_size(), name))
        spans.sort()
        self.starts = np.array([s for s, _, _ in spans], dtype=np.uint64)
        self.ends = np.array([e for _, e, _ in spans], dtype=np.uint64)
        self.names = [n for _, _, n in spans]

    def charge(self, addresses: np.ndarray, width: int, table: dict[str, int]):
        if addresses.size == 0:
            return
        addresses = addresses.astype(np.uint64, copy=False)
        index = np.searchsorted(self.starts, addresses, side="right") - 1
        inside = index >= 0
        inside[inside] &= addresses[inside] < self.ends[index[inside]]
        if (~inside).any():
            table[UNKNOWN] += int((~inside).sum()) * width
        if inside.any():
            counts = np.bincount(index[inside], minlength=len(self.names))
            for i, n in enumerate(counts):
                if n:
                    table[self.names[i]] += int(n) * width


def _interpreter():
    from triton.runtime import interpreter

    from lib import flash  # lib.flash read TRITON_INTERPRET when Triton was set up

    if not flash.INTERPRETED:
        raise ValueError(
            "traffic.count watches kernels in Triton's interpreter: set os.environ['TRITON_INTERPRET'] = '1' before "
            "anything imports Triton (or torch modules that import it), then import lib"
        )
    return interpreter


def _active(ptrs, mask):
    addresses = np.asarray(ptrs.data)
    if mask is None:
        return addresses.ravel()
    keep = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    return addresses[keep]


def _width(ptrs) -> int:
    return ptrs.get_element_ty().primitive_bitwidth // 8


@contextlib.contextmanager
def count():
    """Count the bytes every Triton launch in the block moves (see the module's docstring); yields a
    :class:`Traffic`. Blocks do not nest."""
    interpreter = _interpreter()
    builder_type = interpreter.InterpreterBuilder
    executor_type = interpreter.GridExecutor
    if getattr(executor_type, "_traffic_counting", False):
        raise ValueError("traffic.count blocks do not nest: count once, around everything you want counted")
    traffic = Traffic()
    current: dict[str, object] = {}
    originals = {
        "load": builder_type.create_masked_load,
        "store": builder_type.create_masked_store,
        "rmw": getattr(builder_type, "create_atomic_rmw", None),
        "cas": getattr(builder_type, "create_atomic_cas", None),
        "args": executor_type._init_args_hst,
        "grid_dim": builder_type.set_grid_dim,
    }

    def launch_ranges():
        if "ranges" not in current:
            raise ValueError("a Triton memory operation ran outside a kernel launch")
        return current["ranges"], current["launch"]

    # the arguments after the pointers and the mask (cache and eviction policies) differ between Triton releases:
    # they pass through untouched
    def masked_load(self, ptrs, mask, *rest):
        ranges, launch = launch_ranges()
        ranges.charge(_active(ptrs, mask), _width(ptrs), launch.loaded)
        return originals["load"](self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        ranges, launch = launch_ranges()
        ranges.charge(_active(ptrs, mask), _width(ptrs), launch.stored)
        return originals["store"](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, rmw_op, ptr, val, mask, *rest):
        ranges, launch = launch_ranges()
        active = _active(ptr, mask)
        ranges.charge(active, _width(ptr), launch.loaded)
        ranges.charge(active, _width(ptr), launch.stored)
        return originals["rmw"](self, rmw_op, ptr, val, mask, *rest)

    def atomic_cas(self, ptr, *rest):
        ranges, launch = launch_ranges()
        active = _active(ptr, None)
        ranges.charge(active, _width(ptr), launch.loaded)
        ranges.charge(active, _width(ptr), launch.stored)
        return originals["cas"](self, ptr, *rest)

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = originals["args"](self, args_dev, kwargs)
        named = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        tensors = [(name, value) for name, value in named.items() if hasattr(value, "data_ptr")]
        current["ranges"] = _Ranges(tensors)
        current["launch"] = Launch(kernel=getattr(self.fn, "__name__", "kernel"), grid=())
        traffic.launches.append(current["launch"])
        return args_hst, kwargs_hst

    def set_grid_dim(self, *grid):
        if "launch" in current:
            current["launch"].grid = tuple(int(g) for g in grid)
        return originals["grid_dim"](self, *grid)

    builder_type.create_masked_load = masked_load
    builder_type.create_masked_store = masked_store
    if originals["rmw"] is not None:
        builder_type.create_atomic_rmw = atomic_rmw
    if originals["cas"] is not None:
        builder_type.create_atomic_cas = atomic_cas
    builder_type.set_grid_dim = set_grid_dim
    executor_type._init_args_hst = init_args
    executor_type._traffic_counting = True
    try:
        yield traffic
    finally:
        builder_type.create_masked_load = originals["load"]
        builder_type.create_masked_store = originals["store"]
        if originals["rmw"] is not None:
            builder_type.create_atomic_rmw = originals["rmw"]
        if originals["cas"] is not None:
            builder_type.create_atomic_cas = originals["cas"]
        builder_type.set_grid_dim = originals["grid_dim"]
        executor_type._init_args_hst = originals["args"]
        executor_type._traffic_counting = False


def flash_forward_bytes(L, S=None, E=64, Ev=None, *, block_m, block_n, causal=False, batch_heads=1,
                        bytes_per_number=2):
    """Bytes lib.flash's forward kernel moves, per argument, by chapter 8's count: Q read once, K and V read once
    for each of the ceil(L / block_m) query tiles, the output written once and one float32 logsumexp per query.

    With ``causal=True`` a query tile reads only the key tiles of ``block_n`` keys that begin before its last
    query (the tiles wholly in its future are skipped; a tile that the diagonal crosses is read whole, its
    lanes past S masked). Returns a dict
    {"Q", "K", "V", "O", "LSE"} of bytes; :func:`count` measures the same on the running kernel.
    """
    S = L if S is None else S
    Ev = E if Ev is None else Ev
    for name, value in (("L", L), ("S", S), ("E", E), ("Ev", Ev), ("block_m", block_m), ("block_n", block_n),
                        ("batch_heads", batch_heads), ("bytes_per_number", bytes_per_number)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (0 if name in "LS" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name in 'LS' else 'positive'} int, not {value!r}")
    tiles = -(-L // block_m)
    keys = 0
    for start_m in range(0, tiles * block_m, block_m):
        last = min(S, start_m + block_m) if causal else S  # one past the last key this tile may see
        full = (min(S, start_m + 1) if causal else S) // block_n * block_n  # key tiles needing no mask
        keys += full + (min(S - full, -(-(last - full) // block_n) * block_n) if last > full else 0)
    b = bytes_per_number
    return {"Q": batch_heads * L * E * b, "K": batch_heads * keys * E * b, "V": batch_heads * keys * Ev * b,
            "O": batch_heads * L * Ev * b, "LSE": batch_heads * L * 4}


def forward_table(L, S, E, *, block_m, block_n, causal=False, batch_heads=1, dtype="float16") -> str:
    """Run lib.flash's forward kernel once on random CPU tensors in the interpreter, count what it moves, and set the
    count beside :func:`flash_forward_bytes`: one line per argument, then the totals."""
    import torch

    from lib import flash

    torch_dtype = {"float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float16' or 'float32' (the interpreter has no bfloat16), not {dtype!r}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_heads, n, E, generator=g).to(torch_dtype) for n in (L, S, S))
    with count() as moved:
        flash._forward(q, k, v, causal, E**-0.5,
                       tiles=flash.Tiles(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1))
    formula = flash_forward_bytes(L, S, E, block_m=block_m, block_n=block_n, causal=causal,
                                  batch_heads=batch_heads, bytes_per_number=torch_dtype.itemsize)
    lines = [f"{'argument':<9}{'counted bytes':>15}{'formula':>15}"]
    for name, expected in formula.items():
        lines.append(f"{name:<9}{moved.bytes(name, 'both'):>15,}{expected:>15,}")
    lines.append(f"{'total':<9}{moved.bytes(kind='both'):>15,}{sum(formula.values()):>15,}")
    return "\n".join(lines)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lib.traffic",
        description="Count the bytes lib.flash's forward kernel moves, in Triton's interpreter (run with "
                    "TRITON_INTERPRET=1), beside chapter 8's formula.")
    parser.add_argument("--L", type=int, default=256)
    parser.add_argument("--S", type=int, default=None)
    parser.add_argument("--E", type=int, default=64)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--batch-heads", type=int, default=1)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)
    print(forward_table(args.L, args.L if args.S is None else args.S, args.E, block_m=args.block_m,
                        block_n=args.block_n, causal=args.causal, batch_heads=args.batch_heads, dtype=args.dtype))


if __name__ == "__main__":
    main()
