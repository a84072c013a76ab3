"""Serving memory against hand-derived figures: weights at each dtype (scales included), KV
cache per token (GQA sharded / replicated over TP, MLA latent), expert and pipeline sharding,
the maximum number of sequences, and when quantisation removes the need to split."""

import math

import pytest

from modelcarve.plan.cost.quant import WEIGHT_FORMATS, quality_note
from modelcarve.plan.serve.memory import (ENGINE_KV_MEMORY, ENGINE_MEMORY_RULES, GiB, MEMORY_FRACTION, MemoryRule, RUNTIME_BYTES, max_sequences,
                                           min_devices, serve_memory, shard_facts)
from modelcarve.spec.catalog import get_model, model_names
from modelcarve.spec.hardware import get_device

H100 = get_device("H100").memory_bytes


@pytest.mark.parametrize("name", model_names())
def test_bf16_weights_on_one_device_are_two_bytes_per_parameter(name):
    model = get_model(name)
    f = shard_facts(model, tp=1, weight_dtype="bf16")
    # Every parameter at 2 bytes; our per-device count omits only MLP/attention biases of GPT-style models.
    assert f.weights_bytes == pytest.approx(2 * model.total_params, rel=2e-4)


def test_int4_weights_carry_group_scales():
    """Qwen3-32B at int4 (g128, fp16 scale + 4-bit zero per group), embedding/head in bf16."""
    model = get_model("qwen3-32b")
    h, layers = 5120, 64
    attn = h * (2 * 64 * 128 + 2 * 8 * 128)
    mlp = 3 * h * 25600
    per_weight = 0.5 + 2.5 / 128  # 0.51953125 bytes
    embed_head = 2 * 151936 * h * 2
    norms = layers * (2 * h + 2 * 128) * 2 + h * 2
    expected = layers * (attn + mlp) * per_weight + embed_head + norms
    got = shard_facts(model, tp=1, weight_dtype="int4").weights_bytes
    assert got == pytest.approx(expected, rel=1e-9)
    assert WEIGHT_FORMATS["int4"].bytes_per_param(h) == pytest.approx(0.51953125)


def test_gqa_kv_cache_shards_over_tp_then_replicates():
    model = get_model("qwen3-32b")  # 64 layers, 8 kv heads of 128
    per_token = {tp: shard_facts(model, tp=tp).kv_bytes_per_token for tp in (1, 2, 8, 16, 32)}
    assert per_token[1] == 2 * 8 * 128 * 64 * 2 == 262144
    assert per_token[2] == per_token[1] / 2
    assert per_token[8] == per_token[1] / 8
    # tp > kv heads: each rank keeps one replicated kv head, no further saving.
    assert per_token[16] == per_token[8] == per_token[32]
    assert shard_facts(model, tp=1, kv_dtype="fp8").kv_bytes_per_token == per_token[1] / 2


def test_mla_kv_cache_is_the_latent_on_every_tp_rank():
    model = get_model("kimi-k2")  # 61 layers, kv_lora_rank 512 + rope 64
    for tp in (1, 8, 16):
        assert shard_facts(model, tp=tp, weight_dtype="fp8").kv_bytes_per_token == 61 * (512 + 64) * 2


def test_expert_parallelism_shards_only_routed_experts():
    model = get_model("kimi-k2")
    one = shard_facts(model, tp=8, ep=1, weight_dtype="fp8")
    sixteen = shard_facts(model, tp=8, ep=16, weight_dtype="fp8")
    routed = model.num_moe_layers * model.num_experts * one.expert_bytes
    assert one.weights_bytes - sixteen.weights_bytes == pytest.approx(routed * (1 - 1 / 16), rel=1e-12)


def test_pipeline_stage_holds_its_layers():
    model = get_model("qwen3-32b")
    whole = shard_facts(model, tp=1, pp=1)
    half = shard_facts(model, tp=1, pp=2)
    assert half.stage_layers == 32
    # The fullest stage: half the layers plus the embedding or the head (same size, untied).
    layers_half = (whole.weights_bytes - whole.head_bytes) / 2
    assert half.weights_bytes == pytest.approx(layers_half + 151936 * 5120 * 2, rel=1e-6)
    assert half.kv_bytes_per_token == whole.kv_bytes_per_token / 2


def test_max_sequences_is_the_largest_batch_that_fits():
    model = get_model("llama-3.1-8b")
    mem = serve_memory(model, H100, weight_dtype="bf16", context=4096)
    assert mem.max_sequences > 1
    fits = serve_memory(model, H100, weight_dtype="bf16", context=4096, batch=mem.max_sequences)
    over = serve_memory(model, H100, weight_dtype="bf16", context=4096, batch=mem.max_sequences + 1)
    assert fits.fits and not over.fits
    # Hand check: free memory / (KV bytes per sequence + its logits), floored.
    free = MEMORY_FRACTION * H100 - mem.weights_bytes - mem.runtime_bytes - 4096 * shard_facts(model, tp=1).act_bytes_per_token
    per_seq = 32 * 2 * 8 * 128 * 2 * 4096 + 4 * 128256
    assert mem.max_sequences == math.floor(free / per_seq)


def test_tensorrt_llm_sizes_the_kv_cache_from_the_memory_the_weights_leave():
    """TensorRT-LLM's rule (``free_gpu_memory_fraction`` 0.9 of what is free after the weights, runtime and
    activations) against vLLM's (``gpu_memory_utilization`` 0.9 of the device), by hand: Llama-3.1-70B, fp8
    weights, bf16 KV, TP2 on an H100, 4096-token sequences. The device rule leaves 0.9 x 80 GiB minus the fixed
    part for KV; the free rule 0.9 x (80 GiB minus the fixed part): 0.1 x the fixed part more."""
    model = get_model("llama-3.1-70b")
    f = shard_facts(model, tp=2, weight_dtype="fp8", kv_dtype="bf16")
    context = 4096
    fixed = f.weights_bytes + RUNTIME_BYTES + context * f.act_bytes_per_token  # chunk = min(8192, 4096)
    # 80 layers x 4 local KV heads (8 / tp 2) x 128 x k and v x 2 bytes, per token; fp32 logits of the local vocabulary
    per_seq = 80 * 4 * 128 * 2 * 2 * context + 4 * 128256 / 2
    assert f.kv_bytes_per_token == 80 * 4 * 128 * 2 * 2
    device = math.floor((0.9 * H100 - fixed) / per_seq)
    free = math.floor(0.9 * (H100 - fixed) / per_seq)
    trtllm = ENGINE_MEMORY_RULES["trtllm"]
    assert (trtllm.fraction, trtllm.of) == (0.9, "free") and ENGINE_MEMORY_RULES["vllm"] == MemoryRule(0.9, "device")
    assert all(ENGINE_KV_MEMORY[engine] == rule.of for engine, rule in ENGINE_MEMORY_RULES.items())
    assert max_sequences(f, H100, context) == device
    assert max_sequences(f, H100, context, rule=trtllm) == free
    assert free > device  # ~35 GiB of weights: 3.5 GiB more KV
    mem = serve_memory(model, H100, tp=2, weight_dtype="fp8", kv_dtype="bf16", context=context, batch=free, rule=trtllm)
    assert mem.fits and mem.max_sequences == free
    assert mem.budget_bytes == pytest.approx(fixed + 0.9 * (H100 - fixed), rel=1e-12)
    assert not serve_memory(model, H100, tp=2, weight_dtype="fp8", kv_dtype="bf16", context=context, batch=free + 1, rule=trtllm).fits


def test_qwen3_32b_quantised_fits_one_h100_bf16_long_context_needs_two():
    model = get_model("qwen3-32b")
    for dtype in ("fp8", "int4"):
        assert serve_memory(model, H100, weight_dtype=dtype, context=2048 + 256).fits
    # bf16 weights alone are 61 GiB of the 72 GiB usable; a 131072-token context adds 32 GiB of KV.
    long = serve_memory(model, H100, weight_dtype="bf16", context=131072)
    assert not long.fits
    assert long.weights_bytes / GiB == pytest.approx(61.0, abs=0.1)
    assert long.kv_bytes / GiB == pytest.approx(32.0)
    assert serve_memory(model, H100, tp=2, weight_dtype="bf16", context=131072).fits
    assert min_devices(model, H100, weight_dtype="bf16", context=131072) == 2
    assert min_devices(model, H100, weight_dtype="int4", context=131072) == 1


def test_every_weight_dtype_has_a_quality_note():
    for name in WEIGHT_FORMATS:
        assert len(quality_note(name)) > 20
    assert "KV fp8" in quality_note("int4", "fp8")


def test_caches_never_mix_two_models_of_one_name():
    """The per-layout caches key on object identity and hold the object: a spec built later with
    the same name (and possibly the same id) but other dimensions gets its own figures."""
    for _ in range(3):
        small = get_model("qwen3-32b").replace(num_layers=8, name="probe")
        big = get_model("qwen3-32b").replace(num_layers=16, name="probe")
        a = shard_facts(small, tp=1).weights_bytes
        b = shard_facts(big, tp=1).weights_bytes
        assert b > a
        assert a == pytest.approx(2 * small.total_params, rel=1e-6)
        del small, big
