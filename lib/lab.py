"""The kernel lab (chapter 9): a learner writes FlashAttention's forward kernel in Triton, and it is graded on a CPU,
in Triton's interpreter, by what it computes (against PyTorch's SDPA in float64) and by the bytes it moves
(:mod:`lib.traffic`, against chapter 8's count for the course's own kernel).

The kernel a learner writes has this signature, and :func:`launch` runs it (the learner writes only the body)::

    kernel(Q, K, V, O, LSE, L, S, scale, sq_z, sq_l, sk_z, sk_s, sv_z, sv_s, so_z, so_l,
           E: constexpr, EV: constexpr, BLOCK_M: constexpr, BLOCK_N: constexpr,
           BLOCK_E: constexpr, BLOCK_EV: constexpr, CAUSAL: constexpr)

- the grid is (ceil(L / BLOCK_M), Z): program (i, z) computes output rows i·BLOCK_M ... i·BLOCK_M + BLOCK_M − 1 of
  the z-th (batch, head) pair, rows past L excluded;
- Q (Z, L, E), K (Z, S, E), V (Z, S, EV) and O (Z, L, EV) are in the inputs' dtype, with the strides given (the
  last axis has stride 1); LSE (Z, L) is float32, each row's natural-log logsumexp of its scaled scores;
- ``scale`` multiplies every score q · k; CAUSAL lets query i see keys j <= i only;
- BLOCK_E and BLOCK_EV are E and EV rounded up to a power of two, at least 16 (``tl.arange`` and ``tl.dot`` need
  that): lanes past E or EV must be masked.

:func:`grade` runs the lab's steps on shapes drawn from a seed (the learner never sees them): ragged lengths, L != S,
head sizes 16 to 128, float32 and float16, causal and not. Each step scores 1 or 0 with a sentence that says why,
and never prints an expected value.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from lib import flash, traffic

__all__ = ["STEPS", "TOLERANCE", "Case", "Step", "grade", "hidden_cases", "launch", "time_against_sdpa", "verdict"]

STEPS = ("output", "logsumexp", "causal", "tile skip", "bytes")
# the stated tolerances: |got - expected| <= atol + rtol · |expected|, elementwise, against float64
TOLERANCE = {torch.float32: (2e-3, 2e-3), torch.float16: (1e-2, 1e-2)}
LSE_TOLERANCE = 2e-3  # absolute, in nats
BYTES_FACTOR = 1.1  # the bytes step: at most 1.1 times what the course's kernel moves on the same shapes and tiles


@dataclasses.dataclass(frozen=True)
class Case:
    Z: int
    L: int
    S: int
    E: int
    EV: int
    causal: bool
    dtype: torch.dtype
    block_m: int = 16
    block_n: int = 16

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"Z={self.Z}, L={self.L}, S={self.S}, E={self.E}, EV={self.EV}, causal={self.causal}, {dtype}, "
                f"tiles {self.block_m}x{self.block_n}")


@dataclasses.dataclass
class Step:
    name: str
    score: int | None  # None: the step cannot run here (bytes are counted only in the interpreter)
    why: str
    ratio: float | None = None  # the bytes step: moved / what the course's kernel moves


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _is_triton_kernel(kernel) -> bool:
    import triton

    return isinstance(kernel, (triton.runtime.JITFunction, getattr(triton.runtime.interpreter, "InterpretedFunction",
                                                                    ())))


def launch(kernel, q, k, v, *, causal=False, scale=None, block_m=16, block_n=16, constants=None):
    """Run a lab kernel on q (Z, L, E), k (Z, S, E), v (Z, S, EV) torch tensors; returns (O, LSE). O starts as NaN, so
    a row the kernel never writes shows. ``constants``: compile-time arguments the kernel takes besides the lab's
    (a learner's own switches), by name."""
    if not _is_triton_kernel(kernel):
        raise TypeError(f"the lab grades a Triton kernel (a function decorated with @triton.jit), not "
                        f"{type(kernel).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-d torch tensor (Z, length, head size)")
    Z, L, E = q.shape
    S, EV = v.shape[1], v.shape[2]
    if k.shape != (Z, S, E) or v.shape[0] != Z:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = 1 / math.sqrt(E) if scale is None else float(scale)
    o = torch.full((Z, L, EV), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((Z, L), float("nan"), dtype=torch.float32, device=q.device)
    grid = (-(-L // block_m), Z)
    kernel[grid](
        q, k, v, o, lse, L, S, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        E=E, EV=EV, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=_block(E), BLOCK_EV=_block(EV), CAUSAL=bool(causal),
        **(constants or {}),
    )
    return o, lse


def hidden_cases(seed: int, step: str) -> list[Case]:
    """The shapes a step is graded on, drawn from ``seed``: the same seed gives the same cases."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, not {step!r}")
    rng = random.Random(f"{seed}:{step}")
    cases = []
    dtypes = [torch.float32, torch.float16]
    heads = [16, 24, 40, 64, 96, 128]
    for i in range(4):
        E = rng.choice(heads)
        EV = E if i % 2 == 0 else rng.choice(heads)
        L = rng.randint(1, 70)
        causal = step in ("causal", "tile skip")
        # L != S in the other steps; the causal rule here is top-left, kept on L == S plus one L < S case
        S = L if causal and i != 3 else rng.randint(max(1, L if causal else 1), 80)
        block_m, block_n = rng.choice([(16, 16), (32, 16), (16, 32)])
        cases.append(Case(Z=rng.randint(1, 3), L=L, S=S, E=E, EV=EV, causal=causal, dtype=dtypes[i % 2],
                          block_m=block_m, block_n=block_n))
    return cases


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(case.Z, n, d, generator=g, dtype=torch.float64).to(case.dtype)
            for n, d in ((case.L, case.E), (case.S, case.E), (case.S, case.EV))]


def _expected(case: Case, q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(case.E)
    if case.causal:
        allowed = torch.ones(case.L, case.S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out, torch.logsumexp(scores, dim=-1)


def _outside_tolerance(case: Case, o, out):
    """Elementwise, where O misses the float64 answer by more than the lab's stated tolerance (NaN misses)."""
    atol, rtol = TOLERANCE[case.dtype]
    return ~((o.double() - out).abs() <= atol + rtol * out.abs())


def _run(kernel, case: Case, seed: int, constants=None):
    """Inputs, O, LSE and the bytes moved (None when Triton compiles the kernel for a GPU: bytes are counted only in
    the interpreter). O and LSE come back on the CPU."""
    q, k, v = _inputs(case, seed)
    if flash.INTERPRETED:
        with traffic.count() as moved:
            o, lse = launch(kernel, q, k, v, causal=case.causal, block_m=case.block_m, block_n=case.block_n,
                            constants=constants)
        return (q, k, v), o, lse, moved
    if not torch.cuda.is_available():
        raise ValueError("the lab runs its kernel on a CUDA GPU, or in Triton's interpreter: set "
                         "os.environ['TRITON_INTERPRET'] = '1' before anything imports Triton")
    o, lse = launch(kernel, *(t.cuda() for t in (q, k, v)), causal=case.causal, block_m=case.block_m,
                    block_n=case.block_n, constants=constants)
    return (q, k, v), o.cpu(), lse.cpu(), None


def _attempt(step: str, kernel, case: Case, seed: int, constants):
    """(the run, None), or (None, the step's 0) when the learner's kernel fails, in whatever way it fails."""
    try:
        return _run(kernel, case, seed, constants), None
    except Exception as error:  # noqa: BLE001 - any failure of the learner's kernel is that step's 0
        return None, Step(step, 0, f"the kernel raised {type(error).__name__}: {str(error).splitlines()[0][:160]}")


def _check_values(step: str, kernel, cases: list[Case], seed: int, what: str, constants) -> Step:
    for index, case in enumerate(cases):
        run, failed = _attempt(step, kernel, case, seed + index, constants)
        if failed:
            return failed
        (q, k, v), o, lse, moved = run
        if moved is not None and (moved.bytes("Q") == 0 or moved.bytes("O", "store") == 0):
            return Step(step, 0, f"the kernel read no Q or wrote no O on {case.describe()}: the lab grades the work "
                                 "done in Triton")
        out, expected_lse = _expected(case, q, k, v)
        if what == "output":
            atol, rtol = TOLERANCE[case.dtype]
            bad = _outside_tolerance(case, o, out)
            if bad.any():
                z, row, col = (int(i) for i in bad.nonzero()[0])
                unwritten = " (never written)" if torch.isnan(o[z, row, col]) else ""
                return Step(step, 0, f"O differs from attention on {case.describe()}: first at z={z}, row {row}, "
                                     f"column {col}{unwritten}; tolerance atol {atol}, rtol {rtol}")
        else:
            bad = ~((lse.double() - expected_lse).abs() <= LSE_TOLERANCE)
            if bad.any():
                z, row = (int(i) for i in bad.nonzero()[0])
                return Step(step, 0, f"LSE differs from the natural-log logsumexp of the scaled scores on "
                                     f"{case.describe()}: first at z={z}, row {row}; tolerance {LSE_TOLERANCE}")
    return Step(step, 1, f"right on {len(cases)} hidden shapes")


def _course_bytes(case: Case) -> dict[str, int]:
    return traffic.flash_forward_bytes(case.L, case.S, case.E, case.EV, block_m=case.block_m,
                                       block_n=case.block_n, causal=case.causal, batch_heads=case.Z,
                                       bytes_per_number=case.dtype.itemsize)


def _check_bytes(step: str, kernel, cases: list[Case], seed: int, constants) -> Step:
    if not flash.INTERPRETED:
        return Step(step, None, "not graded here: bytes are counted in Triton's interpreter (TRITON_INTERPRET=1), "
                                "on a CPU")
    moved_total = course_total = floor_total = 0
    reread = {"K": [0, 0], "V": [0, 0]}  # bytes moved, bytes the course's kernel moves
    for index, case in enumerate(cases):
        run, failed = _attempt(step, kernel, case, seed + index, constants)
        if failed:
            return failed
        (q, k, v), o, _, moved = run
        out, _ = _expected(case, q, k, v)
        if _outside_tolerance(case, o, out).any():
            return Step(step, 0, f"bytes count only for a right answer, and O is wrong on {case.describe()}")
        course = _course_bytes(case)
        if step == "tile skip" and (moved.bytes("K") > course["K"] or moved.bytes("V") > course["V"]):
            return Step(step, 0, f"with the causal mask the kernel reads {moved.bytes('K') / course['K']:.2f}x the "
                                 f"K bytes of the course's kernel on {case.describe()}, which skips the key tiles "
                                 "wholly in a query tile's future")
        moved_total += moved.bytes(kind="both")
        course_total += sum(course.values())
        b = case.dtype.itemsize
        floor_total += case.Z * ((case.L * case.E + case.S * (case.E + case.EV) + case.L * case.EV) * b + 4 * case.L)
        for name, pair in reread.items():
            pair[0] += moved.bytes(name)
            pair[1] += course[name]
    ratio = moved_total / course_total
    reads = (f"moves {ratio:.2f}x the course kernel's bytes ({moved_total / floor_total:.2f}x the floor of reading "
             f"Q, K, V and writing O and LSE once); it reads K {reread['K'][0] / reread['K'][1]:.2f}x and V "
             f"{reread['V'][0] / reread['V'][1]:.2f}x as often as the course's kernel")
    if step == "tile skip":
        return Step(step, 1, f"skips the future tiles on {len(cases)} hidden shapes; {reads}", ratio)
    if ratio > BYTES_FACTOR:
        return Step(step, 0, f"right, but it {reads}: the step asks for at most {BYTES_FACTOR}x", ratio)
    return Step(step, 1, f"it {reads}", ratio)


def grade(kernel, seed: int, steps=STEPS, constants=None) -> list[Step]:
    """Grade a lab kernel on the hidden shapes of ``seed``; one :class:`Step` per step asked for. ``constants``:
    compile-time arguments of the kernel's own, beyond the lab's signature, passed to every launch."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown steps {unknown}; the lab's steps are {STEPS}")
    if not _is_triton_kernel(kernel):
        return [Step(s, 0, f"not a Triton kernel (a {type(kernel).__name__}): the lab grades a function decorated "
                           "with @triton.jit") for s in steps]
    results = []
    for step in steps:
        cases = hidden_cases(seed, step)
        if step in ("output", "causal"):
            results.append(_check_values(step, kernel, cases, seed, "output", constants))
        elif step == "logsumexp":
            results.append(_check_values(step, kernel, cases, seed, "logsumexp", constants))
        else:
            results.append(_check_bytes(step, kernel, cases, seed, constants))
    return results


def time_against_sdpa(kernel, *, L=4096, E=64, Z=32, causal=False, dtype=torch.float16, block_m=64, block_n=64,
                      constants=None):
    """On a CUDA GPU: the median milliseconds of a lab kernel and of PyTorch's SDPA on the same (Z, L, E) inputs,
    side by side in one run (lib.speed.gpu_milliseconds: Triton's do_bench, the median). Returns (kernel ms, SDPA
    ms)."""
    if flash.INTERPRETED or not torch.cuda.is_available():
        raise ValueError("timing needs a CUDA GPU and Triton's compiler (TRITON_INTERPRET unset)")
    from lib.speed import gpu_milliseconds

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(Z, L, E, device="cuda", dtype=dtype, generator=g) for _ in range(3))

    def ours_call():
        return launch(kernel, q, k, v, causal=causal, block_m=block_m, block_n=block_n, constants=constants)

    def sdpa_call():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))

    ours_call(), sdpa_call()  # Triton compiles on its first call
    ours, _ = gpu_milliseconds(ours_call, timer="bench")
    sdpa, _ = gpu_milliseconds(sdpa_call, timer="bench")
    return ours, sdpa


def verdict(case: Case, q, k, v, o, lse, moved: dict[str, int]) -> str | None:
    """What is wrong with one run of a lab kernel, or None: ``o`` and ``lse`` it computed from q, k, v (any arrays),
    ``moved`` the bytes it moved per argument name, loads and stores together (lib.traffic). The grader calls this
    on the trusted side with what a sandbox sent back; the message never gives an expected value."""
    if not moved.get("Q") or not moved.get("O"):
        return f"the kernel read no Q or wrote no O on {case.describe()}: the lab grades the work done in Triton"
    q, k, v, o, lse = (torch.as_tensor(t).double() for t in (q, k, v, o, lse))
    out, expected_lse = _expected(case, q, k, v)
    atol, rtol = TOLERANCE[case.dtype]
    if o.shape != out.shape or _outside_tolerance(case, o, out).any():
        return f"O differs from attention on {case.describe()} (tolerance atol {atol}, rtol {rtol})"
    if lse.shape != expected_lse.shape or not ((lse - expected_lse).abs() <= LSE_TOLERANCE).all():
        return f"LSE is not the natural-log logsumexp of the scaled scores on {case.describe()}"
    course = _course_bytes(case)
    if case.causal and (moved.get("K", 0) > course["K"] or moved.get("V", 0) > course["V"]):
        return (f"with the causal mask the kernel reads key tiles wholly in a query tile's future on "
                f"{case.describe()}")
    ratio = sum(moved.values()) / sum(course.values())
    if ratio > BYTES_FACTOR:
        return f"it moves {ratio:.2f}x the course kernel's bytes on {case.describe()}: at most {BYTES_FACTOR}x"
    return None
