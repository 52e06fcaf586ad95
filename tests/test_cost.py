"""lib.cost: counts checked by hand, against FlopCounterMode, and the published sizes of two named models."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lib import attention as attn
from lib import cost
from lib.cost import kv_cache_bytes
from lib.decoding import KVCache
from lib.nn import TorchMultiHeadAttention


def test_attention_flops_by_hand_and_by_flop_counter():
    assert cost.attention_flops(1024, E=64) == 4 * 1024**2 * 64 == 268_435_456
    assert cost.attention_flops(3, 5, E=4, Ev=2, heads=2, batch=3) == 2 * 15 * 6 * 2 * 3
    q, k, v = torch.randn(2, 96, 16), torch.randn(2, 80, 16), torch.randn(2, 80, 8)
    with FlopCounterMode(display=False) as counter:
        attn.attention(q, k, v)
    assert counter.get_total_flops() == cost.attention_flops(96, 80, 16, 8, batch=2)


def test_causal_pairs():
    assert cost.attended_pairs(4, causal=True) == 10  # 1 + 2 + 3 + 4
    # bottom-right: the last two rows of a 5 x 5 triangle
    assert cost.attended_pairs(2, 5, causal="bottom-right") == 4 + 5
    assert cost.attended_pairs(1, 7, causal="bottom-right") == 7
    for L, S in ((3, 5), (4, 8), (5, 3), (1, 7), (6, 6)):
        top_left = int(attn.causal_mask(L, S).sum())
        assert cost.attended_pairs(L, S, causal=True) == cost.attended_pairs(L, S, causal="top-left") == top_left
        if L <= S:
            bottom = int(attn.causal_mask(L, S, align="bottom-right").sum())
            assert cost.attended_pairs(L, S, causal="bottom-right") == bottom
    assert cost.attended_pairs(4, 8, causal="top-left") == 10  # 1 + 2 + 3 + 4, not the bottom-right 26
    with pytest.raises(ValueError, match="causal"):
        cost.attended_pairs(4, 8, causal="bogus")
    with pytest.raises(ValueError, match="L <= S"):
        cost.attended_pairs(5, 3, causal="bottom-right")


def test_attention_bytes_and_intensity():
    # one head, n = 1024, d = 64, float16: q, k, v read and the output written, 4 n d numbers of 2 bytes
    fused = cost.attention_bytes(1024, E=64)
    assert fused == 4 * 1024 * 64 * 2 == 524_288
    assert cost.intensity(cost.attention_flops(1024, E=64), fused) == 512.0  # n / 2 FLOP per byte at d = 64
    unfused = cost.attention_bytes(1024, E=64, scores=True)
    assert unfused == fused + 4 * 1024**2 * 2
    # grouped: keys and values counted once per key/value head
    assert cost.attention_bytes(1, 100, 8, heads=4, kv_heads=1, bytes_per_number=1) == 4 * 16 + 100 * 16
    with pytest.raises(ValueError, match="nbytes"):
        cost.intensity(1, 0)


def test_roofline():
    h100 = cost.gpu("H100")
    assert h100.ridge == pytest.approx(295.34, abs=0.01)
    assert cost.roofline_seconds(989.4e12, 1.0, "H100") == pytest.approx(1.0)  # compute bound
    assert cost.roofline_seconds(1.0, 3.35e12, h100) == pytest.approx(1.0)  # memory bound
    assert cost.attainable_flops(1.0, h100) == 3.35e12
    assert cost.attainable_flops(1000.0, h100) == h100.tensor_flops
    with pytest.raises(ValueError, match="known"):
        cost.roofline_seconds(1, 1, "V100")


def test_layer_step_flops_match_the_flop_counter():
    torch.manual_seed(0)
    layer = TorchMultiHeadAttention(32, 4, n_kv_heads=2).eval()
    stream = torch.randn(1, 9, 32)
    cache = KVCache(9)
    with torch.no_grad():
        layer(stream[:, :8], causal=True, cache=cache)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            layer(stream[:, 8:], causal=True, cache=cache)
    assert counter.get_total_flops() == cost.layer_step_flops(1, 9, 32, kv_size=16)
    assert cost.layer_step_flops(2, 2, 256) == 4 * 2 * 2 * 256**2 + 2 * 2 * 2 * 2 * 256


def test_published_parameter_counts():
    # Llama 2 7B: 6,738,415,616 parameters; Llama 3 8B: 8,030,261,248 (the models' safetensors indexes)
    llama2, llama3 = cost.model("Llama-2-7B"), cost.model("Llama-3-8B")
    assert llama2.params == 6_738_415_616
    assert llama3.params == 8_030_261_248
    assert llama2.layer_params == 4 * 4096**2 + 3 * 4096 * 11008
    assert llama2.kv_bytes_per_token == kv_cache_bytes(32, 32, 128, 1, 2) == 524_288
    assert llama3.kv_bytes_per_token == 131_072
    with pytest.raises(ValueError, match="known"):
        cost.model("GPT-5")


def test_attention_versus_mlp_crossover_for_llama_2_7b():
    llama2 = cost.model("Llama-2-7B")
    # 2 (4·4096² + 3·4096·11008) = 404,750,336 FLOPs per token per layer in the dense products
    assert 2 * llama2.layer_params == 404_750_336
    assert cost.attention_crossover(llama2) == 49_407
    assert round(100 * cost.attention_share(llama2, 4096)) == 8
    assert round(100 * cost.attention_share(llama2, 65536)) == 57
    n = 49_407
    flops = cost.forward_flops(llama2, n)
    assert flops["attention"] == flops["dense"]  # exactly equal at the crossover
    assert cost.attention_share(llama2, n - 1000) < 0.5 < cost.attention_share(llama2, n + 1000)


def test_decode_step_llama_2_7b_on_an_h100():
    llama2 = cost.model("Llama-2-7B")
    step = cost.decode_step(llama2, 4096)
    layers_and_head = 32 * llama2.layer_params + 32000 * 4096
    assert step["weight_bytes"] == 2 * layers_and_head == 13_214_154_752
    assert step["cache_bytes"] == 2 * 2**30
    assert step["flops"] == 2 * layers_and_head + 4 * 32 * 32 * 128 * 4096
    assert cost.intensity(step["flops"], step["bytes"]) == 1.0  # MHA in 16 bits: exactly 1 FLOP per byte
    rate = cost.decode_tokens_per_s(llama2, "H100", 4096)
    assert rate == pytest.approx(3.35e12 / step["bytes"]) and 215 < rate < 220
    # batching shares the weights, not the caches: each token still reads its own cache
    per_token_16 = cost.decode_tokens_per_s(llama2, "H100", 4096, batch=16) / 16
    assert per_token_16 < rate / 3  # 16 caches of 2.1 GB outweigh the 13.2 GB of weights
    assert cost.decode_tokens_per_s("Llama-2-7B", "H100", 4096) == rate  # names as well as objects


def test_decode_bound_checks_memory_and_context():
    llama2 = cost.model("Llama-2-7B")
    # 256 caches of 4,096 tokens are 563 GB: no rate for a set-up that does not fit in 80 GB
    assert cost.decode_memory_bytes(llama2, 4096, batch=256) / 1e9 == pytest.approx(563.2, abs=0.1)
    with pytest.raises(ValueError, match="at most batch=30 fits"):
        cost.decode_tokens_per_s(llama2, "H100", 4096, batch=256)
    assert cost.max_decode_batch(llama2, "H100", 4096) == 30
    assert cost.decode_fits(llama2, "H100", 4096, batch=30) and not cost.decode_fits(llama2, "H100", 4096, batch=31)
    assert cost.decode_tokens_per_s(llama2, "H100", 4096, batch=30) > 0
    assert cost.max_decode_batch(llama2, "H200", 4096) == 59
    with pytest.raises(ValueError, match="trained context"):
        cost.decode_tokens_per_s(llama2, "H200", 10**6)
    assert cost.max_decode_batch(llama2, "T4", 4096) == 1  # 13.5 GB of weights leave room for one 2 GB cache


def test_decode_attention_intensity_is_the_group_size():
    assert cost.decode_attention_intensity(32, 32) == 1.0
    assert cost.decode_attention_intensity(32, 8) == 4.0
    assert cost.decode_attention_intensity(32, 8, bytes_per_number=1) == 8.0


def test_cache_outweighs_weights():
    llama2, llama3 = cost.model("Llama-2-7B"), cost.model("Llama-3-8B")
    t2 = cost.cache_outweighs_weights(llama2)
    # the weights a decode step reads, as decode_step counts them: not the input embedding, nor the norms
    read = cost.decode_step(llama2, 0)["weight_bytes"]
    assert t2 == read / 524_288 == 13_214_154_752 / 524_288 and math.floor(t2) == 25_204
    assert cost.cache_outweighs_weights(llama2) < llama2.params * 2 / 524_288
    assert cost.cache_outweighs_weights(llama3) == cost.decode_step(llama3, 0)["weight_bytes"] / 131_072
    assert cost.cache_outweighs_weights(llama2, batch=8) == t2 / 8


# ------------------------------------------------------------------------------ the ledger per score (chapter 8)


def test_ledger_at_d_64_ties_the_tensor_cores_and_the_exponentials():
    t = cost.score_ledger(cost.gpu("H100"), 64).seconds
    assert 0.9 < t["tensor cores"] / t["exponential unit"] < 1.2
    assert t["HBM"] < 0.2 * t["tensor cores"]  # the compulsory traffic is not what binds
    t128 = cost.score_ledger(cost.gpu("H100"), 128).seconds
    assert t128["tensor cores"] == pytest.approx(2 * t["tensor cores"])
    assert t128["exponential unit"] == t["exponential unit"]


def test_ledger_counts_fmnmx_and_f2fp_at_half_rate():
    h100 = cost.gpu("H100")
    slow, fast = cost.score_ledger(h100, 64), cost.score_ledger(h100, 64, half_rate=False)
    lane = 2 / h100.fp32_flops  # seconds of one float32 instruction per lane, whole GPU
    extra = slow.seconds["float32 lanes"] - fast.seconds["float32 lanes"]
    assert extra == pytest.approx(cost.FP32_HALF_RATE_PER_SCORE * lane)
    assert slow.tflops("serial") < fast.tflops("serial")
    assert slow.tflops("softmax") == fast.tflops("softmax")  # the exponentials are the longer of the two there
    with pytest.raises(ValueError, match="fp32_ops"):
        cost.score_ledger(h100, 64, fp32_ops=1.0)


def test_ledger_ceilings_order_and_measured_rate():
    import dataclasses

    h100 = cost.gpu("H100")
    low, high = cost.ledger_ceilings(h100, 64)
    assert low < high < cost.score_ledger(h100, 64).tflops("full")
    measured = dataclasses.replace(h100, tensor_flops=790e12)
    # at the matrix rate measured on an H100, 603 TFLOP/s (SDPA, d 128) is above the turn-taking ceiling
    assert cost.ledger_ceilings(measured, 128, n=8192)[1] < 603 < cost.ledger_ceilings(h100, 128, n=8192)[1]
    with pytest.raises(ValueError, match="overlap"):
        cost.score_ledger(h100, 64).bound("some")
    with pytest.raises(ValueError, match="d must be an integer >= 1"):
        cost.score_ledger(h100, 0)


def test_f2fp_slots_price_the_conversion_and_refuse_less_than_one_slot():
    h100 = cost.gpu("H100")
    half, catch_all = (cost.score_ledger(h100, 64, f2fp_slots=s) for s in (2, cost.F2FP_SLOTS_CATCH_ALL))
    # the slower conversion row only lengthens the float32 bar, and by the F2FP instructions alone
    assert catch_all.seconds["float32 lanes"] > half.seconds["float32 lanes"]
    assert catch_all.seconds["tensor cores"] == half.seconds["tensor cores"]
    assert cost.ledger_ceilings(h100, 64, f2fp_slots=cost.F2FP_SLOTS_CATCH_ALL)[0] < cost.ledger_ceilings(h100, 64)[0]
    with pytest.raises(ValueError, match="f2fp_slots"):
        cost.score_ledger(h100, 64, f2fp_slots=0.5)
    with pytest.raises(TypeError, match="f2fp_slots"):
        cost.score_ledger(h100, 64, f2fp_slots="2")


def test_fractional_bytes_per_number_count_packed_caches():
    """int4 caches (0.5 bytes a number) and fp8 with a float16 scale per 32 numbers (1 + 2/32 bytes)."""
    fp16 = cost.kv_cache_bytes(32, 8, 128, 4096, 2)
    assert cost.kv_cache_bytes(32, 8, 128, 4096, 0.5) == fp16 // 4
    assert isinstance(cost.kv_cache_bytes(32, 8, 128, 4096, 0.5), int)
    assert cost.kv_cache_bytes(32, 8, 128, 4096, 1 + 2 / 32) == fp16 * (1 + 2 / 32) / 2
    assert cost.decode_bytes(1, 8, 4096, 128, 128, 0.5) == cost.decode_bytes(1, 8, 4096, 128, 128, 2) // 4
    assert cost.max_decode_batch("Llama-2-7B", "H100", 4096, bytes_per_number=0.5) > \
        cost.max_decode_batch("Llama-2-7B", "H100", 4096)
    for bad, error in ((0, ValueError), (-1, ValueError), (float("nan"), ValueError), ("2", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="bytes_per_number"):
            cost.kv_cache_bytes(32, 8, 128, 4096, bad)


# ------------------------------------------------------- one clock, shared memory and L2 (chapter 8's ledger)


def test_at_clock_puts_every_unit_of_the_h100_on_the_tensor_rates_clock():
    h100 = cost.gpu("H100")
    one = h100.at_clock(1.83e9)
    assert one.tensor_flops == pytest.approx(989.4e12)  # the datasheet quotes it at 1.83 GHz already
    assert one.fp32_flops == pytest.approx(66.9e12 * 1.83 / 1.98)  # the boost clock's float32 rate, rescaled
    assert one.exp_per_s == pytest.approx(16 * 132 * 1.83e9)
    assert one.hbm_bytes_per_s == h100.hbm_bytes_per_s  # HBM keeps its own clock
    # at one clock a score at d = 64 costs the tensor cores and the exponential unit the same 1/16 of a clock
    t = cost.score_ledger(one, 64).seconds
    assert t["tensor cores"] == pytest.approx(t["exponential unit"], rel=1e-3)
    assert cost.score_ledger(h100, 64).seconds["exponential unit"] < t["exponential unit"]  # boost: faster
    # a lower clock slows every unit in proportion
    half = one.at_clock(0.915e9)
    assert half.tensor_flops == pytest.approx(one.tensor_flops / 2) and half.exp_per_s == pytest.approx(
        one.exp_per_s / 2)
    assert cost.gpu("A100").at_clock(1.41e9).fp32_flops == pytest.approx(19.5e12)  # quoted at one clock already
    with pytest.raises(ValueError, match="clock_hz"):
        h100.at_clock(0)


def test_shared_memory_bytes_per_score_by_hand():
    # 128 x 64 tiles, d = 64, bf16: K and V written (16 KiB), each of two 64-row groups reads K and V (32 KiB), Q
    # read again (16 KiB): 64 KiB for 8,192 scores
    assert cost.smem_bytes_per_score(64, 128, 64) == 64 * 1024 / (128 * 64) == 8.0
    assert cost.smem_bytes_per_score(128, 128, 64) == 16.0
    assert cost.smem_bytes_per_score(128, 128, 128) == 14.0  # the query tile read half as often
    # P through shared memory instead of registers: written and read, 2 numbers of 2 bytes a score
    assert cost.smem_bytes_per_score(64, 128, 64, p_in_smem=True) == 8.0 + 4.0
    assert cost.smem_bytes_per_score(64, 128, 64, q_in_smem=False) == 8.0 - 64 * 2 / 64
    with pytest.raises(TypeError, match="p_in_smem"):
        cost.smem_bytes_per_score(64, p_in_smem=1)
    with pytest.raises(ValueError, match="block_n"):
        cost.smem_bytes_per_score(64, 128, 0)


def test_shared_memory_falls_as_either_tile_grows_and_ties_the_tensor_cores_at_128_by_64():
    for d in (64, 128):
        for block_m in (64, 128, 256):
            bytes_n = [cost.smem_bytes_per_score(d, block_m, n) for n in (32, 64, 128, 256)]
            assert bytes_n == sorted(bytes_n, reverse=True) and len(set(bytes_n)) == 4
        bytes_m = [cost.smem_bytes_per_score(d, m, 64) for m in (64, 128, 256, 512)]
        assert bytes_m == sorted(bytes_m, reverse=True) and len(set(bytes_m)) == 4
    one = cost.gpu("H100").at_clock(1.83e9)
    for d in (64, 128):
        t = cost.score_ledger(one, d, tiles=(128, 64)).seconds
        assert t["shared memory"] == pytest.approx(t["tensor cores"], rel=1e-3)  # 32 FLOP a byte on both sides
        assert cost.score_ledger(one, d, tiles=(128, 128)).seconds["shared memory"] < t["tensor cores"]
    assert "shared memory" not in cost.score_ledger(one, 64).seconds  # no tiles, no bar


def test_shared_memory_bar_bounds_the_products_when_it_is_the_longer():
    one = cost.gpu("H100").at_clock(1.83e9)
    narrow = cost.score_ledger(one, 128, tiles=(64, 64))  # 20 bytes a score: longer than the tensor cores
    t = narrow.seconds
    assert t["shared memory"] > t["tensor cores"]
    assert narrow.bound("softmax") == pytest.approx(t["shared memory"] + max(t["exponential unit"],
                                                                             t["float32 lanes"]))
    assert narrow.tflops("serial") < cost.score_ledger(one, 128, tiles=(128, 64)).tflops("serial")


def test_l2_rereads_by_hand_and_falling_with_the_query_tile():
    assert cost.l2_bytes_per_score(64, 128) == 2.0  # (64 + 64) numbers of 2 bytes over 128 rows
    assert cost.l2_bytes_per_score(128, 128) == 4.0
    assert cost.l2_bytes_per_score(128, 64, Ev=64, elt=4) == (128 + 64) * 4 / 64
    rows = [cost.l2_bytes_per_score(128, m) for m in (32, 64, 128, 256)]
    assert rows == sorted(rows, reverse=True) and len(set(rows)) == 4
    # SDPA's 603 TFLOP/s at d = 128 with 128-row tiles needs 603e12 / 128 bytes a second from L2: 4.7 TB/s
    ledger = cost.score_ledger(cost.gpu("H100"), 128, tiles=(128, 64))
    assert ledger.l2_bytes_per_s(603) == pytest.approx(603e12 / 128)
    assert 4.7e12 < ledger.l2_bytes_per_s(603) < 4.72e12
    with pytest.raises(ValueError, match="tiles"):
        cost.score_ledger(cost.gpu("H100"), 128).l2_bytes_per_s(603)
    with pytest.raises(TypeError, match="tiles"):
        cost.score_ledger(cost.gpu("H100"), 128, tiles=[128, 64])
    with pytest.raises(ValueError, match="tiles"):
        cost.score_ledger(cost.gpu("H100"), 128, tiles=(128, 0))
