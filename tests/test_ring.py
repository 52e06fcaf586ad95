"""lib.ring: ring and all-to-all attention on real gloo process groups, against autograd through SDPA.

Starting processes costs seconds, so one world of 3 ranks runs once for every case (``lib.ring.run_cases``: 2-rank
cases on a group of two of its ranks) and the tests read its results. Rendezvous goes through a file in a temporary folder, so parallel runs never share a port.
"""

import itertools
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from filelock import FileLock

from lib import ring

F64 = {"rtol": 1e-12, "atol": 1e-12}


def inputs(B, H, N, E, Ev, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, E, generator=gen).to(dtype) for _ in range(2))
    v, dout = (torch.randn(B, H, N, Ev, generator=gen).to(dtype) for _ in range(2))
    return {"q": q, "k": k, "v": v, "dout": dout}


GOOD = [
    (scheme, layout, causal)
    for scheme, layout in (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))
    for causal in (False, True)
]


def good_cases(world, N, H, seed=0):
    return [
        {"scheme": s, "layout": lay, "causal": c, **inputs(2, H, N, 8, 6, seed + i)}
        for i, (s, lay, c) in enumerate(GOOD)
    ]


def bad_cases(world):
    """Inputs that must be refused on every rank with a clear error, never a hang."""
    def per_rank(make):
        return [make(r) for r in range(world)]

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype)

    return [
        ("unequal", {"scheme": "ring", "shards": per_rank(lambda r: (t(1, 2, 4 + 2 * r, 4),) * 3)}),
        ("dtype", {"scheme": "ring", "shards": per_rank(
            lambda r: (t(1, 2, 4, 4, dtype=torch.float32 if r == 0 else torch.float64),) * 3)}),
        ("shape", {"scheme": "ring", "shards": per_rank(lambda r: (t(1, 2, 4, 4 + r),) * 3)}),
        ("odd", {"scheme": "ring", "layout": "zigzag", "shards": per_rank(lambda r: (t(1, 2, 3, 4),) * 3)}),
        ("heads", {"scheme": "ulysses", "shards": per_rank(lambda r: (t(1, 3, 4, 4),) * 3)}),
        ("causal", {"scheme": "ring", "causal": [False, True], "shards": per_rank(lambda r: (t(1, 2, 4, 4),) * 3)}),
        ("layout", {"scheme": "ring", "layout": ["contiguous", "zigzag"],
                    "shards": per_rank(lambda r: (t(1, 2, 4, 4),) * 3)}),
        ("scale", {"scheme": "ulysses", "scale": [None, 0.25], "shards": per_rank(lambda r: (t(1, 2, 4, 4),) * 3)}),
        ("one rank", {"scheme": "ring", "shards": per_rank(
            lambda r: (t(1, 2, 4, 4), t(1, 2, 4, 4 if r == 0 else 5), t(1, 2, 4, 4)))}),
    ]


def sdpa_reference(case):
    q, k, v = (case[x].clone().requires_grad_() for x in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case["causal"], scale=case.get("scale"),
                                         enable_gqa=q.shape[-3] != k.shape[-3])
    out.backward(case["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


SUBGROUP = (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))


def world_cases():
    """Cases for one world of 3 ranks: 2-rank cases on the group of ranks 0 and 1, 3-rank cases on the whole
    world, and cases on the group of global ranks 1 and 2 (group ranks 0 and 1), whose peers must be mapped, with
    a scale other than 1/sqrt(E), which the backward pass must use too."""
    two = [dict(case, ranks=[0, 1]) for case in good_cases(2, N=16, H=4)]
    bad = [(name, dict(case, ranks=[0, 1])) for name, case in bad_cases(2)]
    three = good_cases(3, N=18, H=3, seed=10)
    sub = [{"scheme": s, "layout": lay, "causal": True, "ranks": [1, 2], "scale": 0.3,
            **inputs(1, 2, 8, 4, 4, 20 + i)} for i, (s, lay) in enumerate(SUBGROUP)]
    half = [{"scheme": s, "layout": lay, "causal": True, "ranks": [0, 1], **inputs(1, 2, 16, 8, 8, 30 + i,
                                                                                    dtype=torch.bfloat16)}
            for i, (s, lay) in enumerate(SUBGROUP)]
    lse = [{"scheme": "ring", "layout": lay, "causal": c, **inputs(2, 3, 18, 4, 5, 40 + i),
            "dlse": torch.randn(2, 3, 18, generator=torch.Generator().manual_seed(50 + i), dtype=torch.float64)}
           for i, (lay, c) in enumerate((("contiguous", True), ("zigzag", True), ("contiguous", False)))]
    gqa = [dict(case, ranks=[0, 1]) for case in grouped_cases()]
    return two, bad, three, sub, half, lse, gqa


def grouped_cases():
    """Grouped-query heads on two ranks: 4 query heads on 2 key/value heads (and on 1 for the ring)."""
    cases = []
    for i, (scheme, layout, Hkv) in enumerate((("ring", "contiguous", 2), ("ring", "zigzag", 1),
                                               ("ulysses", "contiguous", 2))):
        full = inputs(2, 4, 16, 8, 6, 60 + i)
        case = {"scheme": scheme, "layout": layout, "causal": True, **full}
        case["k"], case["v"] = full["k"][:, :Hkv].clone(), full["v"][:, :Hkv].clone()
        cases.append(case)
    for i, scheme in enumerate(("ring", "ulysses")):  # flash-attn's (B, n, H, E) shards, with n = H = 4
        cases.append({"scheme": scheme, "layout": "contiguous", "causal": True, "axes": "bshd",
                      **inputs(2, 4, 8, 8, 6, 70 + i)})
    return cases


def run_world():
    two, bad, three, sub, half, lse, gqa = world_cases()
    cases = two + [case for _, case in bad] + three + sub + half + lse + gqa
    results = ring.launch(ring.run_cases, 3, cases, timeout=120)
    cut = np.cumsum([0, len(two), len(bad), len(three), len(sub), len(half), len(lse), len(gqa)]).tolist()
    part = [[r[a:b] for r in results] for a, b in itertools.pairwise(cut)]
    return {
        "two": part[0][:2],
        "bad": dict(zip([name for name, _ in bad], zip(*part[1][:2]))),
        "three": part[2],
        "sub": part[3][1:],
        "outside": part[3][0],
        "half": part[4][:2],
        "lse": part[5],
        "gqa": part[6][:2],
    }


@pytest.fixture(scope="session")
def world(tmp_path_factory, worker_id):
    """The 3-rank world's results, computed once even when pytest-xdist spreads these tests over workers."""
    if worker_id == "master":
        return run_world()
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(shared / "ring-world.lock"):
        stored = shared / "ring-world.pt"
        if not stored.exists():
            torch.save(run_world(), stored)
        return torch.load(stored, weights_only=False)


def assert_matches_sdpa(cases, per_rank, tol):
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        assert all("error" not in r for r in ranks), ranks[0].get("error")
        ref = sdpa_reference(case)
        layout = case["layout"]
        for name in ("out", "dq", "dk", "dv"):
            ours = ring.unshard([r[name] for r in ranks], layout)
            what = f"{case['scheme']} {layout} causal={case['causal']}: {name}"
            torch.testing.assert_close(ours, ref[name], **tol, msg=lambda m, w=what: f"{w}\n{m}")


def test_the_ring_returns_the_natural_log_logsumexp_and_its_gradient_flows(world):
    from lib.merge import attention_state

    for i, case in enumerate(world_cases()[5]):
        ranks = [r[i] for r in world["lse"]]
        assert all("error" not in r for r in ranks), ranks[0].get("error")
        q, k, v = (case[x].clone().requires_grad_() for x in ("q", "k", "v"))
        out, lse = attention_state(q, k, v, causal=case["causal"])
        torch.autograd.backward([out, lse], [case["dout"], case["dlse"]])
        layout = case["layout"]
        torch.testing.assert_close(ring.unshard([r["out"] for r in ranks], layout), out.detach(), **F64)
        lse_ours = ring.unshard([r["lse"][..., None] for r in ranks], layout)[..., 0]
        torch.testing.assert_close(lse_ours, lse.detach(), **F64)
        for name, ref in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(ring.unshard([r[name] for r in ranks], layout), ref, **F64)


def test_two_ranks_forward_and_gradients_equal_autograd_through_sdpa(world):
    assert_matches_sdpa(world_cases()[0], world["two"], F64)


def test_bytes_counted_in_the_run_match_the_formula(world):
    two, _, three, *_ = world_cases()
    for cases, per_rank, P in ((two, world["two"], 2), (three, world["three"], 3)):
        check_bytes(cases, per_rank, P)


def test_grouped_query_heads_equal_sdpa_and_send_only_the_key_value_heads(world):
    """Chapter 12's P/(G+1) table, measured: the ring and the all-to-all on two gloo processes with Hkv < H."""
    cases = world_cases()[6]
    assert_matches_sdpa(cases, world["gqa"], F64)
    check_bytes(cases, world["gqa"], 2)
    ring_bytes = world["gqa"][0][0]["bytes_forward"]  # 4 query heads on 2 key/value heads: half the MHA blocks
    assert ring_bytes == ring.sent_bytes_per_rank("ring", 16, 2, batch_heads=8, E=8, Ev=6, itemsize=8) // 2


def check_bytes(cases, per_rank, P):
    for i, case in enumerate(cases):
        B, H, N, E = case["q"].shape
        Ev = case["v"].shape[-1]
        kw = {"batch_heads": B * H, "batch_kv_heads": B * case["k"].shape[-3], "E": E, "Ev": Ev, "itemsize": 8}
        for r in per_rank:
            assert r[i]["bytes_forward"] == ring.sent_bytes_per_rank(case["scheme"], N, P, **kw)
            total = r[i]["bytes_forward"] + r[i]["bytes_backward"]
            assert total == ring.sent_bytes_per_rank(case["scheme"], N, P, backward=True, **kw)


@pytest.mark.parametrize(
    "name, message",
    [
        ("unequal", r"shards of unequal length: the ranks hold \[4, 6\] tokens"),
        ("dtype", r"rank 1 has q \(1, 2, 4, 4\) torch.float64.* but rank 0 has q \(1, 2, 4, 4\) torch.float32"),
        ("shape", r"rank 1 has q \(1, 2, 4, 5\)"),
        ("odd", r"zigzag layout .* even number of tokens; got 3"),
        ("heads", r"H must be a multiple of 2; got H=3"),
        ("causal", (r"ring_attention: rank 1 was called with causal=True, layout='contiguous', scale=0.5 but rank 0 "
                    r"with causal=False, layout='contiguous', scale=0.5; every rank must pass the same causal, layout")),
        ("layout", (r"rank 1 was called with causal=False, layout='zigzag', scale=0.5 but rank 0 with causal=False, "
                    r"layout='contiguous'")),
        ("scale", (r"ulysses_attention: rank 1 was called with causal=False, scale=0.25 but rank 0 with "
                   r"causal=False, scale=0.5")),
    ],
)
def test_bad_shards_raise_the_same_clear_error_on_every_rank(world, name, message):
    for result in world["bad"][name]:
        assert result["error"].startswith("ValueError: ")
        assert __import__("re").search(message, result["error"]), result["error"]


def test_a_rank_that_rejects_its_input_makes_the_others_raise_too(world):
    rank0, rank1 = world["bad"]["one rank"]  # only rank 1 passed keys with E=5
    assert rank1["error"] == "ValueError: k has E=5 but q has E=4"
    assert rank0["error"] == "ValueError: ring_attention: rank 1 rejected its shards (its own error says why)"


def test_three_ranks_forward_and_gradients_equal_autograd_through_sdpa(world):
    assert_matches_sdpa(world_cases()[2], world["three"], F64)


def test_a_subgroup_of_global_ranks_1_and_2_with_its_own_scale_equals_sdpa(world):
    assert all(r is None for r in world["outside"])  # rank 0 is not in the group
    assert_matches_sdpa(world_cases()[3], world["sub"], F64)


def test_bfloat16_shards_keep_their_dtype_and_match_sdpa_in_float64(world):
    half = world_cases()[4]
    for i, case in enumerate(half):
        ranks = [r[i] for r in world["half"]]
        assert all(r[name].dtype == torch.bfloat16 for r in ranks for name in ("out", "dq", "dk", "dv"))
        wide = {x: case[x].double() for x in ("q", "k", "v", "dout")}
        ref = sdpa_reference({**case, **wide})
        for name in ("out", "dq", "dk", "dv"):
            ours = ring.unshard([r[name] for r in ranks], case["layout"]).double()
            torch.testing.assert_close(ours, ref[name], rtol=2e-2, atol=2e-2)


def test_without_a_process_group_the_error_says_so():
    assert not dist.is_initialized()
    x = torch.zeros(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        ring.ring_attention(x, x, x)
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        ring.ulysses_attention(x, x, x)


def test_a_rank_outside_the_group_it_was_given_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1 if group is not None else 2)
    x = torch.zeros(1, 2, 4, 4)
    for fn in (ring.ring_attention, ring.ulysses_attention):
        with pytest.raises(RuntimeError, match=r"global rank 2\) is not a member of the group"):
            fn(x, x, x, group=object())


def test_nccl_needs_a_gpu_for_every_rank():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU for each of 2 ranks")
    with pytest.raises(ValueError, match=r"2 ranks need 2 GPUs, this machine has \d"):
        ring.launch(fail_on_rank_one, 2, backend="nccl")


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # rank 0 would wait here for ever without the launcher's watch
    return rank


def test_a_failing_rank_raises_in_the_caller_instead_of_hanging():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed first.*rank one fails on purpose"):
        ring.launch(fail_on_rank_one, 2, timeout=60)


def sleep_for_a_minute(rank, world_size):
    time.sleep(60)  # a rank that hangs, as one blocked in a collective would


def test_a_hanging_rank_is_stopped_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[0\] of 1 did not finish within 3 s and were stopped"):
        ring.launch(sleep_for_a_minute, 1, timeout=3)
    assert time.monotonic() - start < 20


def test_launch_refuses_workers_it_cannot_import():
    with pytest.raises(ValueError, match="module-level function"):
        ring.launch(lambda rank, world: rank, 2)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_shard_and_unshard_are_inverse_and_cover_every_position_once(layout, P):
    N = 4 * P
    x = torch.arange(N * 3, dtype=torch.float32).reshape(1, N, 3)
    parts = [ring.shard(x, r, P, layout) for r in range(P)]
    assert all(p.shape == (1, N // P, 3) for p in parts)
    assert torch.equal(ring.unshard(parts, layout), x)
    assert sorted(torch.cat([ring.positions(N, r, P, layout) for r in range(P)]).tolist()) == list(range(N))


def test_zigzag_holds_chunks_r_and_2p_minus_1_minus_r():
    assert ring.positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert ring.positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="cannot be split into 4 equal chunks"):
        ring.shard(torch.zeros(6, 2), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.positions(8, 0, 2, "striped")


def critical_path(counts):
    """Tiles on the critical path (each ring step waits for its slowest rank) over the ideal share total / P."""
    P = len(counts[0])
    total = sum(map(sum, counts))
    return Fraction(sum(max(step) for step in counts) * P, total)


@pytest.mark.parametrize("P, ratio", [(2, 1.49), (4, 1.74), (8, 1.86)])
def test_causal_contiguous_ring_is_imbalanced_and_zigzag_is_not(P, ratio):
    contiguous = ring.causal_tile_counts(4096, P, "contiguous", tile=64)
    zigzag = ring.causal_tile_counts(4096, P, "zigzag", tile=64)
    assert sum(map(sum, contiguous)) == sum(map(sum, zigzag)) == 64 * 65 // 2  # every tile on or below the diagonal
    assert round(float(critical_path(contiguous)), 2) == ratio
    assert critical_path(zigzag) == 1
    slowest = max(range(P), key=lambda r: sum(step[r] for step in contiguous))
    assert slowest == P - 1  # the last rank's queries see every key block
    assert float(critical_path(contiguous)) < (2 * P - 1) / P


def test_tile_counts_of_small_rings():
    assert ring.causal_tile_counts(8, 2, "contiguous", tile=4) == [[1, 1], [0, 1]]
    assert ring.causal_tile_counts(8, 2, "zigzag", tile=2) == [[3, 3], [2, 2]]


@pytest.mark.parametrize("layout, rank, P, expected", [
    ("contiguous", 0, 3, [(4, 4)]),  # rank 0 meets only its own block; the later ones lie in its future
    ("contiguous", 2, 3, [(4, 4), (4, 4), (4, 4)]),
    ("zigzag", 0, 2, [(2, 2)] * 5),  # queries|keys chunks, step 0: 0|0, 3|0, 3|3; step 1: 3|1, 3|2
])
def test_the_ring_computes_no_block_pair_that_lies_wholly_in_the_future(monkeypatch, layout, rank, P, expected):
    """One rank of a stand-in ring (its transfers return the same tensors): which (queries, keys) pairs it computes."""
    pairs, real = [], ring.attention_state

    def attention_state(q, k, v, mask=None, **kwargs):
        pairs.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, mask, **kwargs)

    monkeypatch.setattr(ring, "_group_rank_size", lambda group, what: (rank, P))
    monkeypatch.setattr(ring, "_validate", lambda *args, **kwargs: None)
    monkeypatch.setattr(ring, "_peer", lambda group, r: r)
    monkeypatch.setattr(ring, "_exchange", lambda tensors, *args: (([], tensors), [t.clone() for t in tensors]))
    monkeypatch.setattr(ring, "attention_state", attention_state)
    x = torch.randn(1, 4, 2)
    ring.ring_attention(x, x, x, causal=True, layout=layout)
    assert pairs == expected


def _one_process_ring(monkeypatch, exchange, events, forward=True):
    """A stand-in ring of 3 ranks in this one process: transfers go through ``exchange``, and each block's
    backward computation (and forward one, with ``forward``) appends "compute" to ``events``."""

    def computing(fn):
        def wrapped(*args):
            events.append("compute")
            return fn(*args)
        return wrapped

    monkeypatch.setattr(ring, "_group_rank_size", lambda group, what: (0, 3))
    monkeypatch.setattr(ring, "_validate", lambda *args, **kwargs: None)
    monkeypatch.setattr(ring, "_peer", lambda group, r: r)
    monkeypatch.setattr(ring, "_exchange", exchange)
    if forward:
        monkeypatch.setattr(ring, "_block_state", computing(ring._block_state))
    monkeypatch.setattr(ring, "_block_grads", computing(ring._block_grads))


def test_each_step_posts_the_next_blocks_transfer_before_computing(monkeypatch):
    """The schedule, recorded in one process: a stand-in ring of 3 ranks whose transfers return the same block."""
    events = []

    def exchange(tensors, send_to, recv_from, group):
        events.append("send")
        return ([], tensors), [t.clone() for t in tensors]

    _one_process_ring(monkeypatch, exchange, events)
    q = torch.randn(1, 6, 4, requires_grad=True)
    out = ring.ring_attention(q, q, q)
    assert events == ["send", "compute", "send", "compute", "compute"]
    events.clear()
    out.sum().backward()
    # keys and values for the next step go out before the compute; the gradients follow it, one hop a step
    assert events == ["send", "compute", "send", "send", "compute", "send", "compute", "send"]


def test_the_backward_waits_for_a_gradient_transfer_only_after_the_next_computation(monkeypatch):
    events, kinds = [], []

    def exchange(tensors, send_to, recv_from, group):
        # a step posts the next blocks first, and its gradients after its computation and waits
        after_work = events and (events[-1] == "compute" or events[-1].startswith("wait"))
        kinds.append("grads" if after_work else "blocks")
        tag = f"{kinds[-1]}{len(kinds)}"
        events.append(f"post {tag}")
        return ([tag], tensors), [t.clone() for t in tensors]

    def wait(transfer):
        events.append(f"wait {transfer[0][0]}")

    _one_process_ring(monkeypatch, exchange, events, forward=False)
    monkeypatch.setattr(ring, "_wait", wait)
    q = torch.randn(1, 6, 4, requires_grad=True)
    out = ring.ring_attention(q, q, q)
    events.clear()
    kinds.clear()
    out.sum().backward()
    grads = [e.split()[1] for e in events if e.startswith("post grads")]
    assert len(grads) == 3  # one hop a step, the last bringing each block's gradients home
    for tag in grads[:-1]:  # each transfer is waited for after the next step's computation, which it overlaps
        posted, waited = events.index(f"post {tag}"), events.index(f"wait {tag}")
        assert "compute" in events[posted:waited], events
    assert events[-1] == f"wait {grads[-1]}"


def test_hiding_block_is_flops_over_link_bandwidth():
    # 4 n^2 E FLOPs at F per second against 2 n E numbers of 2 bytes at B per second: equal at n = F / B
    F_h100, B_h100 = 989.4e12, 450e9
    n = ring.hiding_block("H100")
    assert n == pytest.approx(F_h100 / B_h100)
    E = 128
    assert 4 * n**2 * E / F_h100 == pytest.approx(2 * n * E * 2 / B_h100)
    with pytest.raises(ValueError, match="no NVLink rate for 'T4'"):
        ring.hiding_block("T4")


# ------------------------------------------------------------------------------------------------------------------
# Bytes with grouped-query heads: the ring carries key/value heads only, the all-to-all query heads too
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P, ratio", [(2, Fraction(2, 5)), (4, Fraction(4, 5)), (8, Fraction(8, 5))])
def test_with_grouped_heads_the_ring_sends_p_over_g_plus_1_of_the_all_to_alls_bytes(P, ratio):
    # Llama 3 8B: 32 query heads share 8 key/value heads (G = 4) of 128 numbers
    ring_bytes = ring.sent_bytes_per_layer("ring", "Llama-3-8B", 131_072, P)
    ulysses_bytes = ring.sent_bytes_per_layer("ulysses", "Llama-3-8B", 131_072, P)
    assert Fraction(ring_bytes, ulysses_bytes) == ratio
    assert (ring_bytes < ulysses_bytes) == (P < 5)  # the ring sends less up to P = G = 4
    n = 131_072 // P
    assert ring_bytes == (P - 1) * n * 8 * 2 * 128 * 2  # P-1 blocks of keys and values, 8 heads, bfloat16
    # every query head with its own key/value head (Llama 2 7B): P/2, the ring never sends less
    mha = [ring.sent_bytes_per_layer(s, "Llama-2-7B", 131_072, P) for s in ("ring", "ulysses")]
    assert Fraction(*mha) == Fraction(P, 2)


def test_the_rings_bytes_follow_the_key_value_heads_and_the_all_to_alls_both():
    kw = {"E": 16, "Ev": 8, "itemsize": 2}
    base = ring.sent_bytes_per_rank("ring", 64, 4, batch_heads=8, batch_kv_heads=2, **kw)
    assert ring.sent_bytes_per_rank("ring", 64, 4, batch_heads=32, batch_kv_heads=2, **kw) == base
    assert ring.sent_bytes_per_rank("ring", 64, 4, batch_heads=8, **kw) == 4 * base  # default: as many as q
    assert base == 3 * 16 * 2 * (16 + 8) * 2
    both = ring.sent_bytes_per_rank("ring", 64, 4, batch_heads=8, batch_kv_heads=2, backward=True, **kw)
    assert both == (3 + 3 + 4) * 16 * 2 * (16 + 8) * 2  # blocks again, then P blocks of gradients
    ulysses = ring.sent_bytes_per_rank("ulysses", 64, 4, batch_heads=8, batch_kv_heads=4, **kw)
    assert ulysses == 3 * 16 * (8 + 4) * (16 + 8) * 2 // 4
    assert ring.sent_bytes_per_rank("ulysses", 64, 4, batch_heads=8, batch_kv_heads=4, backward=True,
                                    **kw) == 2 * ulysses


@pytest.mark.parametrize("P, H, Hkv", [(2, 4, 2), (4, 8, 4), (4, 8, 8)])
def test_the_all_to_all_count_is_what_its_transport_sends_with_grouped_heads(monkeypatch, P, H, Hkv):
    """The all-to-all of one rank in one process: a stand-in exchange that keeps the slices, counted as sent."""
    def all_to_all_single(out, x, group=None):
        out.copy_(x)

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    B, n, E, Ev = 2, 3, 4, 5
    ring.reset_bytes_sent()
    q = ring._seq_to_heads(torch.randn(B, H, n, E), None, P)  # (B, H/P, P n, E)
    for width in (E, Ev):
        ring._seq_to_heads(torch.randn(B, Hkv, n, width), None, P)
    ring._heads_to_seq(torch.randn(B, H // P, P * n, Ev), None, P)
    assert q.shape == (B, H // P, P * n, E)
    sent = ring.bytes_sent()
    ring.reset_bytes_sent()
    assert sent == ring.sent_bytes_per_rank("ulysses", P * n, P, batch_heads=B * H, batch_kv_heads=B * Hkv,
                                            E=E, Ev=Ev, itemsize=4)


@pytest.mark.parametrize("call, message", [
    (lambda: ring.sent_bytes_per_rank("tree", 8, 2, batch_heads=1, E=4), "scheme must be 'ring' or 'ulysses'"),
    (lambda: ring.sent_bytes_per_rank("ring", 10, 4, batch_heads=1, E=4), "N=10 tokens do not split evenly"),
    (lambda: ring.sent_bytes_per_rank("ring", 8, 2, batch_heads=0, E=4), "batch_heads must be an integer >= 1"),
    (lambda: ring.sent_bytes_per_rank("ring", 8, 2, batch_heads=2, batch_kv_heads=1.5, E=4),
     "batch_kv_heads must be an integer"),
    (lambda: ring.sent_bytes_per_rank("ulysses", 8, 4, batch_heads=8, batch_kv_heads=2, E=4),
     "batch_kv_heads=2 is not a multiple of 4"),
    (lambda: ring.sent_bytes_per_layer("ulysses", "Llama-3-8B", 4096, 16), "world_size must divide both"),
    (lambda: ring.sent_bytes_per_layer("ring", "Llama-9", 4096, 2), "Llama-9.*no shape for that model"),
    (lambda: ring.hiding_block("H100", group=0), "group must be an integer >= 1"),
    (lambda: ring.hiding_block("H100", flops_per_s=-1.0), "flops_per_s must be a positive number"),
])
def test_bad_counting_arguments_raise_errors_that_name_them(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_model_of_the_wrong_type_is_refused_by_name():
    with pytest.raises(TypeError, match="model must be a lib.cost.Transformer"):
        ring.sent_bytes_per_layer("ring", 8, 4096, 2)


def test_grouped_heads_and_achieved_rates_lower_the_hiding_block_and_the_backward_raises_it():
    datasheet = ring.hiding_block("H100")
    assert ring.hiding_block("H100", group=4) == pytest.approx(datasheet / 4)  # 4 query heads a transferred block
    assert ring.hiding_block("H100", flops_per_s=603e12) == pytest.approx(603e12 / 450e9)
    # backward step: 5 products (10 G n^2 E FLOPs) against bf16 keys and values and fp32 gradients (12 n E bytes)
    n = ring.hiding_block("H100", backward=True)
    assert 10 * n**2 * 128 / 989.4e12 == pytest.approx(12 * n * 128 / 450e9)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_the_step_by_step_schedule_computes_each_causal_tile_once_as_the_counts_say(layout, P):
    from lib.diagrams import ring_step_tiles

    steps = ring_step_tiles(4096, P, layout)  # (step, query tile, key tile): the rank computing it, or -1
    T = 4096 // 64
    assert steps.shape == (P, T, T)
    computed = (steps >= 0).sum(axis=0)
    assert (computed == np.tril(np.ones((T, T), dtype=int))).all()  # every tile on or below the diagonal, once
    drawn = [[int((steps[t] == r).sum()) for r in range(P)] for t in range(P)]
    assert drawn == ring.causal_tile_counts(4096, P, layout)
    with pytest.raises(ValueError, match="straddle two ranks"):
        ring_step_tiles(96, 2, layout, tile=32)
