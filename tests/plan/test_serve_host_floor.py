"""The engine's per-sequence host floor (plan/serve/rates.ENGINE_SEQ_HOST_S) against a hand-derived figure."""

from modelcarve.plan.serve import rates
from modelcarve.plan.serve.time import _stage_step, layout_costs, serve_time
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


def test_constant_is_the_published_figure():
    # TensorRT-LLM PR #10273: 45.11 ms host step at 1536 sequences per executor -> 29.37 us per sequence.
    assert abs(rates.ENGINE_SEQ_HOST_S - 29.37e-6) < 0.01e-6


def test_floor_binds_for_a_small_moe_at_a_large_batch():
    # Qwen3-30B-A3B NVFP4 on one B200, 128/128: the GPU step at 1024 sequences is ~7.2 ms, the
    # host floor 1024 x 29.37 us = 30.07 ms, so the decode round is the floor and tokens/s ~ 1 / 29.37 us.
    model, cluster = get_model("qwen3-30b-a3b"), parse_cluster("1xB200")
    c = layout_costs(model, cluster, 1, 1, 1, 1, "nvfp4", "fp8", 128, 128)
    assert abs(_stage_step(c, 1024) - 1024 * 45.11e-3 / 1536) < 1e-9
    t = serve_time(model, cluster, tp=1, weight_dtype="nvfp4", kv_dtype="fp8", batch=1024, input_len=128, output_len=128)
    assert t.bound == "overhead"
    assert abs(t.decode_step_s - 30.07e-3) < 0.01e-3


def test_floor_is_hidden_under_a_long_gpu_step_and_split_by_attention_dp():
    # Llama-3.1-70B NVFP4 on one B200 at 64 sequences: the GPU step (~25 ms of weight reads) is far
    # above 64 x 29 us = 1.9 ms: no change. An MoE at tp 8 holds batch / 8 sequences per executor.
    c = layout_costs(get_model("llama-3.1-70b"), parse_cluster("1xB200"), 1, 1, 1, 1, "nvfp4", "fp8", 1000, 1000)
    assert _stage_step(c, 64) > 64 * rates.ENGINE_SEQ_HOST_S * 5
    moe = layout_costs(get_model("qwen3-235b-a22b"), parse_cluster("8xB200"), 8, 1, 1, 1, "nvfp4", "fp8", 128, 128)
    assert abs(moe.seq_host_s - rates.ENGINE_SEQ_HOST_S / 8) < 1e-12
