"""Serving time against hand-derived figures and invariants: the decode roofline never beats
the weight read, TP all-reduces at batch 1 cost latency not bytes, MoE reads only the experts
a batch touches, PP buys no latency and idles without enough requests in flight, prefill is
compute-bound."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelcarve.plan.cost import comm, efficiency
from modelcarve.plan.cost.efficiency import matmul_efficiency
from modelcarve.plan.serve.memory import shard_facts
from modelcarve.plan.serve.rates import (
    ALLREDUCE_FLOOR_S,
    DECODE_HBM_EFFICIENCY,
    LAYER_OVERHEAD_S,
    experts_touched_fraction,
    tp_all_reduce_s,
)
from modelcarve.plan.serve.time import serve_time
from modelcarve.spec.catalog import get_model, model_names
from modelcarve.spec.hardware import cluster_from_dict, parse_cluster

MODELS = [n for n in model_names() if not n.startswith("tiny")] + ["tiny-llama", "tiny-moe"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(MODELS),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 4]),
    ep=st.sampled_from([1, 2, 8]),
    batch=st.integers(1, 512),
    weight_dtype=st.sampled_from(["bf16", "fp8", "int8", "int4"]),
    kv_dtype=st.sampled_from(["bf16", "fp8"]),
    input_len=st.integers(1, 32768),
    output_len=st.integers(1, 4096),
    device=st.sampled_from(["H100", "A100-80GB", "H200", "B200", "MI300X"]),
)
def test_decode_never_beats_reading_the_weights(name, tp, pp, ep, batch, weight_dtype, kv_dtype, input_len, output_len, device):
    """TPOT >= one decode round >= the weights each device reads / its full HBM bandwidth, and
    what it reads is at least everything but the routed experts it does not need."""
    model = get_model(name)
    if model.num_heads % tp or model.ffn_size % tp or pp > model.num_layers:
        return
    if ep > 1 and (not model.is_moe or model.num_experts % ep or model.expert_ffn_size % tp):
        return
    cluster = parse_cluster(f"{tp * pp * ep}x{device}")
    t = serve_time(model, cluster, tp=tp, pp=pp, ep=ep, dp=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                   batch=batch, input_len=input_len, output_len=output_len)
    hbm = cluster.device.hbm_bytes_per_s
    f = shard_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    routed = f.stage_moe_layers * f.experts_per_rank * f.expert_bytes
    always_read = f.weights_bytes - f.embed_bytes - routed  # everything but the routed experts
    assert t.weights_read_bytes >= always_read
    if not model.is_moe:
        assert t.weights_read_bytes == pytest.approx(always_read)
    # With pp micro-batches a round is pp steps of the fullest stage, each reading its weights; with
    # fewer (batch < pp) a token walks every stage once, the fullest among them.
    steps = pp if batch >= pp else 1
    assert t.decode_step_s >= steps * t.weights_read_bytes / hbm
    assert t.tpot_s >= t.decode_step_s >= always_read / hbm
    assert t.tokens_per_s_per_device <= batch / t.tpot_s / (tp * pp) * (1 + 1e-9)


def test_batch1_decode_is_the_weight_read_at_achievable_bandwidth():
    """Llama-3.1-8B bf16, one A100-40GB: weights minus the embedding table over 0.8 x 1.555 TB/s,
    plus the fixed per-layer overhead."""
    model = get_model("llama-3.1-8b")
    cluster = parse_cluster("A100-40GB")
    t = serve_time(model, cluster, batch=1, input_len=1024, output_len=128)
    read = 2 * (model.total_params - model.vocab_size * model.hidden_size)
    expected = read / (1.555e12 * DECODE_HBM_EFFICIENCY) + 32 * LAYER_OVERHEAD_S
    assert t.bound == "memory"
    # KV of ~1090 tokens (137 MB) and activations add under 2%.
    assert expected < t.decode_step_s < expected * 1.02


def test_tp_all_reduce_at_batch_one_is_latency_not_bytes():
    cluster = parse_cluster("8xH100")
    tier = comm.group_tier(cluster, 8, 1)
    size = 1 * 5120 * 2  # one token's hidden state in bf16
    t = tp_all_reduce_s(size, 8, tier)
    one_shot = 2 * tier.latency_s + 7 * size / tier.bytes_per_s
    assert t == pytest.approx(max(ALLREDUCE_FLOOR_S, one_shot))
    assert 7 * size / tier.bytes_per_s < 0.1 * t  # the bytes are under 10% of it
    assert t < comm.all_reduce_s(size, 8, tier) / 3  # a ring would pay 14 latency steps
    # Qwen3-32B TP8 at batch 1: 2 all-reduces per layer, 64 layers, plus the logits gather.
    model = get_model("qwen3-32b")
    st_ = serve_time(model, cluster, tp=8, batch=1, input_len=128, output_len=128)
    gather = comm.all_gather_s(model.vocab_size * 2, 8, tier)
    assert st_.decode_parts["tp"] == pytest.approx(128 * max(ALLREDUCE_FLOOR_S, one_shot) + gather)


def test_tp_across_100gbe_costs_more_than_inside_a_node():
    model = get_model("qwen3-32b")
    eth = cluster_from_dict({"nodes": 2, "devices_per_node": 8, "device": "H100", "inter_link": "eth-100g", "nics_per_node": 1})
    inside = serve_time(model, eth, tp=8, dp=2, weight_dtype="fp8", batch=1)
    across = serve_time(model, eth, tp=16, weight_dtype="fp8", batch=1)
    assert across.comm["tp"]["tier"] == "inter" and inside.comm["tp"]["tier"] == "intra"
    # Tree all-reduce across 16 ranks: 2 x 4 latency steps of 15 us, 128 times per token.
    assert across.decode_parts["tp"] > 128 * 8 * 15e-6
    assert across.tpot_s > 3 * inside.tpot_s


def test_experts_touched():
    assert experts_touched_fraction(1, 8, 384) == pytest.approx(8 / 384)
    assert experts_touched_fraction(2, 2, 8) == pytest.approx(1 - (6 / 8) ** 2)
    assert experts_touched_fraction(10_000, 8, 384) == pytest.approx(1.0)


def test_moe_decode_reads_only_touched_experts():
    model = get_model("deepseek-v3")
    cluster = parse_cluster("8xH200")
    f = shard_facts(model, tp=8, weight_dtype="fp8")
    routed = f.stage_moe_layers * f.experts_per_rank * f.expert_bytes
    one = serve_time(model, cluster, tp=8, weight_dtype="fp8", batch=1)
    many = serve_time(model, cluster, tp=8, weight_dtype="fp8", batch=256)
    base = f.weights_bytes - f.embed_bytes - routed
    assert one.weights_read_bytes == pytest.approx(base + routed * 8 / 256)
    assert many.weights_read_bytes == pytest.approx(base + routed * (1 - (1 - 8 / 256) ** 256))
    assert one.weights_read_bytes < 0.2 * f.weights_bytes < many.weights_read_bytes


def test_pipeline_buys_no_latency_and_idles_at_batch_one():
    model = get_model("llama-3.1-70b")
    cluster = parse_cluster("8xH100")
    tp8 = serve_time(model, cluster, tp=8, weight_dtype="fp8", batch=1)
    pp2 = serve_time(model, cluster, tp=4, pp=2, weight_dtype="fp8", batch=1)
    assert pp2.bubble == pytest.approx(0.5)
    assert pp2.tpot_s > tp8.tpot_s
    full = serve_time(model, cluster, tp=4, pp=2, weight_dtype="fp8", batch=64)
    assert full.bubble == 0.0


def test_prefill_is_compute_bound_at_the_gemm_efficiency():
    """Llama-3.1-8B, 8192-token prompt on one H100 in bf16: causal forward FLOPs / achievable rate."""
    model = get_model("llama-3.1-8b")
    cluster = parse_cluster("H100")
    t = serve_time(model, cluster, batch=1, input_len=8192, output_len=16)
    h, n = model.hidden_size, 8192
    gemm_flops = n * 2 * model.matmul_params_active
    attn_flops = n * 2 * (n / 2) * 32 * 256 * 32  # scores and values over half the prompt, 32 heads, 32 layers
    eff = matmul_efficiency(cluster.device, n, 4 * h, h, "bf16")
    # the GEMMs at their shape's efficiency, attention at the attention kernels' peak (0.72 of H100's bf16)
    assert t.prefill_s == pytest.approx(gemm_flops / (989.4e12 * eff) + attn_flops / (989.4e12 * 0.72), rel=1e-9)
    assert t.ttft_s == t.prefill_s  # nothing else in flight


def test_throughput_grows_and_tpot_grows_with_batch():
    model = get_model("llama-3.1-70b")
    cluster = parse_cluster("2xH100")
    previous = None
    for batch in (1, 2, 8, 32, 128):
        t = serve_time(model, cluster, tp=2, weight_dtype="fp8", kv_dtype="fp8", batch=batch, input_len=1000, output_len=1000)
        if previous:
            assert t.tpot_s > previous.tpot_s
            assert t.tokens_per_s > previous.tokens_per_s
        previous = t


def test_pp_hand_off_across_100gbe_is_hand_derived():
    """Qwen3-32B TP8 x PP2 over two nodes with one 100 GbE NIC each, one sequence: each stage
    step ends with a 10 kB send over the device's 1/8 share of the NIC (86% achievable)."""
    model = get_model("qwen3-32b")
    eth = cluster_from_dict({"nodes": 2, "devices_per_node": 8, "device": "H100", "inter_link": "eth-100g", "nics_per_node": 1})
    t = serve_time(model, eth, tp=8, pp=2, weight_dtype="fp8", batch=1)
    share = 12.5e9 * 1 / 8 * 0.86
    hop = 15e-6 + 5120 * 2 / share
    assert t.comm["pp"]["tier"] == "inter"
    assert t.decode_parts["pp"] == pytest.approx(2 * hop)  # two stage steps per round at batch 1


def test_ep_all_to_all_across_nodes_is_hand_derived():
    """Kimi K2 with 16-way EP over two 8xH200 nodes (attention data-parallel, tp=1), one sequence
    per rank: per MoE layer a dispatch and a combine of 8 routed copies of a 7168-wide token, x1.25
    for the busiest rank (the default); half of them leave the node through the device's own NDR NIC,
    as DeepEP sends them (plan/serve/ep.py): one network latency, dispatch in fp8 with a fp32 scale
    per 128 (1.03125 bytes per element), combine in bf16."""
    model = get_model("kimi-k2")
    cluster = parse_cluster("2x8xH200")
    t = serve_time(model, cluster, tp=1, dp=16, ep=16, weight_dtype="fp8", batch=1)
    crossing = 8 * 7168 * 1.25 * (16 - 8) / 16
    nic = 50e9 * 8 / 8 * 0.86
    a2a = 5e-6 + crossing * (1.03125 + 2) / 2 / nic  # the mean of the dispatch and the combine
    assert t.comm["ep"]["tier"] == "inter"
    assert t.decode_parts["ep"] == pytest.approx(2 * 60 * a2a)
    # Every EP rank's 16 x 1 tokens touch 16 x 8 of 384 experts' weights in expectation.
    inside = serve_time(model, parse_cluster("16xH200"), tp=1, dp=16, ep=16, weight_dtype="fp8", batch=1)
    assert inside.comm["ep"]["tier"] == "intra" and inside.decode_parts["ep"] < t.decode_parts["ep"]


def test_load_imbalance_scales_the_ep_all_to_all():
    model = get_model("deepseek-v3")
    cluster = parse_cluster("2x8xH200")
    even = serve_time(model, cluster, tp=1, dp=16, ep=16, weight_dtype="fp8", batch=8, load_imbalance=1.0)
    skew = serve_time(model, cluster, tp=1, dp=16, ep=16, weight_dtype="fp8", batch=8, load_imbalance=2.0)
    latency = 5e-6 * 2 * model.num_moe_layers  # the alpha part (one per exchange, plan/serve/ep.py) does not scale
    assert skew.decode_parts["ep"] - latency == pytest.approx(2 * (even.decode_parts["ep"] - latency))
    assert skew.tpot_s > even.tpot_s


def test_ep_straggler_cost_is_reported():
    model = get_model("deepseek-v3")
    cluster = parse_cluster("2x8xH200")
    even = serve_time(model, cluster, tp=1, dp=16, ep=16, weight_dtype="fp8", batch=8, load_imbalance=1.0)
    skew = serve_time(model, cluster, tp=1, dp=16, ep=16, weight_dtype="fp8", batch=8, load_imbalance=1.5)
    assert even.comm["ep"]["straggler_s_per_round"] == 0.0
    # What the straggler adds is exactly the difference to a balanced all-to-all.
    assert skew.comm["ep"]["straggler_s_per_round"] == pytest.approx(skew.decode_parts["ep"] - even.decode_parts["ep"])
    assert "ep_straggler" not in skew.decode_parts


def test_fp4_prefill_prices_attention_at_the_attention_peak_not_the_fp4_gemm_peak():
    """Qwen3-30B-A3B (48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of ffn 768,
    vocab 151936, untied) prefilling one 20,000-token prompt on one B200 in NVFP4, by hand.

    GEMM parameters a token goes through, per layer: q 2048x4096 + k, v 2048x512 + o 4096x2048 =
    18,874,368; router 2048x128 = 262,144; 8 routed experts x 3 x 2048x768 = 37,748,736; 48 layers =
    2,730,491,904, plus the LM head 151,936 x 2048 = 311,164,928: 3.04e9, 6.08 GFLOP a token, at
    9 PFLOP/s x FP4_GEMM_FRACTION x the 8192-row chunk's GEMM efficiency. Causal attention's scores
    and values: 2 x 10,000 (half the prompt) x 32 heads x 256 x 48 layers = 7.86 GFLOP a token, more
    than the GEMMs at this length, run by bf16 flash attention: 2.25 PFLOP/s x 0.55 (B200's large-GEMM
    fraction, efficiency.BLACKWELL_PEAK_FRACTION) = 1.24 PFLOP/s. Priced at the FP4 GEMM rate (3.2 PFLOP/s
    when this test was written) attention took a third of the time it does (6.4 us a token against 2.5 us). The routed experts' GEMMs run per expert, on the
    rows routed to it (the training planner's rule): 8192 x 8 / 128 = 512 rows, fc1 (gate and up)
    512 x 2048 -> 1536 and fc2 512 x 768 -> 2048, each at its own efficiency."""
    from modelcarve.plan.serve import rates as serve_rates

    model, cluster = get_model("qwen3-30b-a3b"), parse_cluster("B200")
    n = 20_000
    t = serve_time(model, cluster, weight_dtype="nvfp4", kv_dtype="fp8", batch=1, input_len=n, output_len=16)
    gemm_params = 48 * (18_874_368 + 262_144 + 37_748_736) + 311_164_928
    assert gemm_params == 3_041_656_832
    attn_flops = 2 * (n / 2) * 32 * 256 * 48
    assert attn_flops == 7_864_320_000
    eff = matmul_efficiency(cluster.device, 8192, 4 * 2048, 2048, "fp4")
    peak = 9e15 * serve_rates.FP4_GEMM_FRACTION
    expert_params = 48 * 37_748_736
    gemm_s = n * 2 * (gemm_params - expert_params) / (peak * eff)
    gemm_s += n * 2 * expert_params * 2 / 3 / (peak * matmul_efficiency(cluster.device, 512, 1536, 2048, "fp4"))
    gemm_s += n * 2 * expert_params / 3 / (peak * matmul_efficiency(cluster.device, 512, 2048, 768, "fp4"))
    attn_s = n * attn_flops / (2.25e15 * 0.55)
    assert efficiency.BLACKWELL_PEAK_FRACTION["B200"] == 0.55  # the fraction written into attn_s above
    assert t.prefill_s == pytest.approx(gemm_s + attn_s, rel=1e-9)
    assert attn_s / n == pytest.approx(6.36e-6, rel=1e-2)  # 6.4 us a token of attention alone
