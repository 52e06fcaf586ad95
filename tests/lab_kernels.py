"""Kernels handed in to the kernel lab (lib.lab): the official solution, a correct one written another way, and the
mistakes the grade must catch. tests/test_lab.py grades each."""

import torch
import triton
import triton.language as tl


@triton.jit
def official(Q, K, V, O, LSE, L, S, scale, sq_z, sq_l, sk_z, sk_s, sv_z, sv_s, so_z, so_l,
             E: tl.constexpr, EV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr,
             SKIP: tl.constexpr = True, RESCALE: tl.constexpr = True, DIAGONAL: tl.constexpr = True):
    # the solution: the online softmax over key tiles, the future tiles skipped. Each switch set to False
    # makes one mistake: SKIP, future key tiles are read too; RESCALE, acc and l are not rescaled when the
    # running maximum grows; DIAGONAL, the causal mask hides each query's own key (j < i)
    start_m = tl.program_id(0) * BLOCK_M
    z = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    q = tl.load(Q + z * sq_z + rows[:, None] * sq_l + offs_e[None, :],
                mask=(rows[:, None] < L) & (offs_e[None, :] < E), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    hi = tl.minimum(S, start_m + BLOCK_M) if CAUSAL and SKIP else S
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + cols0
        kt = tl.load(K + z * sk_z + cols[None, :] * sk_s + offs_e[:, None],
                     mask=(cols[None, :] < S) & (offs_e[:, None] < E), other=0.0)
        v = tl.load(V + z * sv_z + cols[:, None] * sv_s + offs_ev[None, :],
                    mask=(cols[:, None] < S) & (offs_ev[None, :] < EV), other=0.0)
        s = tl.dot(q, kt) * scale
        allowed = cols[None, :] < S
        if CAUSAL:
            if DIAGONAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            else:
                allowed = allowed & (cols[None, :] < rows[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new) if RESCALE else tl.full([BLOCK_M], 1.0, tl.float32)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    l_safe = tl.where(l == 0.0, 1.0, l)
    tl.store(O + z * so_z + rows[:, None] * so_l + offs_ev[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=(rows[:, None] < L) & (offs_ev[None, :] < EV))
    tl.store(LSE + z * L + rows, m + tl.log(l_safe), mask=rows < L)


@triton.jit
def another_way(Q, K, V, O, LSE, L, S, scale, sq_z, sq_l, sk_z, sk_s, sv_z, sv_s, so_z, so_l,
                E: tl.constexpr, EV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr):
    # base-2 exponentials with the scale folded in, K loaded untransposed, the last tile counted from the mask
    LOG2E: tl.constexpr = 1.4426950408889634
    pid, zz = tl.program_id(0), tl.program_id(1)
    i = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    j0 = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_E)
    dv = tl.arange(0, BLOCK_EV)
    q_base = Q + zz.to(tl.int64) * sq_z
    k_base = K + zz.to(tl.int64) * sk_z
    v_base = V + zz.to(tl.int64) * sv_z
    q = tl.load(q_base + i[:, None] * sq_l + d[None, :], mask=(i[:, None] < L) & (d[None, :] < E), other=0.0)
    run_max = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    out = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    n_keys = S
    if CAUSAL:
        n_keys = tl.minimum(S, pid * BLOCK_M + BLOCK_M)
    n_tiles = tl.cdiv(n_keys, BLOCK_N)
    for t in range(n_tiles):
        j = t * BLOCK_N + j0
        k = tl.load(k_base + j[:, None] * sk_s + d[None, :], mask=(j[:, None] < S) & (d[None, :] < E), other=0.0)
        vv = tl.load(v_base + j[:, None] * sv_s + dv[None, :], mask=(j[:, None] < S) & (dv[None, :] < EV),
                     other=0.0)
        x = tl.dot(q, tl.trans(k)) * (scale * LOG2E)
        keep = (j[None, :] < S) & ((j[None, :] <= i[:, None]) | (not CAUSAL))
        x = tl.where(keep, x, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        w = tl.exp2(x - shift[:, None])
        correction = tl.exp2(run_max - shift)
        run_sum = run_sum * correction + tl.sum(w, axis=1)
        out = out * correction[:, None]
        out += tl.dot(w.to(vv.dtype), vv)
        run_max = new_max
    denom = tl.where(run_sum > 0.0, run_sum, 1.0)
    tl.store(O + zz.to(tl.int64) * so_z + i[:, None] * so_l + dv[None, :], (out / denom[:, None]).to(O.dtype.element_ty),
             mask=(i[:, None] < L) & (dv[None, :] < EV))
    lse2 = tl.where(run_max == float("-inf"), 0.0, run_max) + tl.log2(denom)
    tl.store(LSE + zz * L + i, lse2 / LOG2E, mask=i < L)


@triton.jit
def two_passes(Q, K, V, O, LSE, L, S, scale, sq_z, sq_l, sk_z, sk_s, sv_z, sv_s, so_z, so_l,
               E: tl.constexpr, EV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr):
    # right, without the online softmax: one pass over K for each row's maximum, a second over K and V
    start_m = tl.program_id(0) * BLOCK_M
    z = tl.program_id(1).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    q = tl.load(Q + z * sq_z + rows[:, None] * sq_l + offs_e[None, :],
                mask=(rows[:, None] < L) & (offs_e[None, :] < E), other=0.0)
    hi = tl.minimum(S, start_m + BLOCK_M) if CAUSAL else S
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + cols0
        kt = tl.load(K + z * sk_z + cols[None, :] * sk_s + offs_e[:, None],
                     mask=(cols[None, :] < S) & (offs_e[:, None] < E), other=0.0)
        allowed = cols[None, :] < S
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None])
        m = tl.maximum(m, tl.max(tl.where(allowed, tl.dot(q, kt) * scale, float("-inf")), 1))
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_EV], tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + cols0
        kt = tl.load(K + z * sk_z + cols[None, :] * sk_s + offs_e[:, None],
                     mask=(cols[None, :] < S) & (offs_e[:, None] < E), other=0.0)
        v = tl.load(V + z * sv_z + cols[:, None] * sv_s + offs_ev[None, :],
                    mask=(cols[:, None] < S) & (offs_ev[None, :] < EV), other=0.0)
        allowed = cols[None, :] < S
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None])
        p = tl.where(allowed, tl.exp(tl.dot(q, kt) * scale - m[:, None]), 0.0)
        l += tl.sum(p, 1)
        acc += tl.dot(p.to(v.dtype), v)
    l_safe = tl.where(l == 0.0, 1.0, l)
    tl.store(O + z * so_z + rows[:, None] * so_l + offs_ev[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=(rows[:, None] < L) & (offs_ev[None, :] < EV))
    tl.store(LSE + z * L + rows, m + tl.log(l_safe), mask=rows < L)


@triton.jit
def does_nothing(Q, K, V, O, LSE, L, S, scale, sq_z, sq_l, sk_z, sk_s, sv_z, sv_s, so_z, so_l,
                 E: tl.constexpr, EV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CAUSAL: tl.constexpr):
    # an empty kernel: a wrapper around it would compute the answer with torch
    pass


def torch_wrapper(q, k, v, causal=False):
    """Not a kernel: the answer from PyTorch."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
