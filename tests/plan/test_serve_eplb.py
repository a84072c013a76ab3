"""Redundant experts (EPLB) in the serving planner: wide EP as SGLang and vLLM run DeepSeek-V3,
256 routed experts + 32 redundant replicas = 288 physical experts over 72 GPUs (4 per GPU).

Hand-derived figures (DeepSeek-V3: hidden 7168, expert ffn 2048, 58 MoE layers, top-8, no expert
biases): one routed expert is 3 x 7168 x 2048 = 44,040,192 weights, 88,080,384 bytes in bf16.
"""

import math

import pytest

from modelcarve.plan.serve.ep import DISPATCH_BYTES, COMBINE_BYTES, ep_round_trip_s
from modelcarve.plan.serve.goal import SERVE_LATENCY, SERVE_THROUGHPUT
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.memory import shard_facts
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

DEEPSEEK = get_model("deepseek-v3")
EXPERT_BF16 = 3 * 7168 * 2048 * 2  # 88,080,384 bytes
MOE_LAYERS = 58


def test_model_facts_the_figures_rest_on():
    m = DEEPSEEK
    assert (m.num_experts, m.top_k, m.hidden_size, m.expert_ffn_size, m.num_moe_layers) == (256, 8, 7168, 2048, 58)
    assert m.expert_params * 2 == EXPERT_BF16


def test_memory_per_rank_is_e_plus_r_over_ep_experts():
    # 288 / 72 = 4 experts per rank: the same weights per rank as 256 / 64 without EPLB.
    eplb = shard_facts(DEEPSEEK, tp=1, ep=72, weight_dtype="bf16", redundant_experts=32)
    plain = shard_facts(DEEPSEEK, tp=1, ep=64, weight_dtype="bf16")
    assert (eplb.experts_per_rank, plain.experts_per_rank, eplb.physical_experts) == (4, 4, 288)
    assert eplb.weights_bytes == plain.weights_bytes
    # Over ep=32: 288 / 32 = 9 experts per rank instead of 256 / 32 = 8, one expert more per MoE layer:
    # 58 x 88,080,384 = 5,108,662,272 bytes (4.76 GiB) more per rank.
    more = shard_facts(DEEPSEEK, tp=1, ep=32, weight_dtype="bf16", redundant_experts=32)
    base = shard_facts(DEEPSEEK, tp=1, ep=32, weight_dtype="bf16")
    assert (more.experts_per_rank, base.experts_per_rank) == (9, 8)
    assert more.weights_bytes - base.weights_bytes == MOE_LAYERS * EXPERT_BF16 == 5_108_662_272


def test_decode_costs_read_the_replicas_and_keep_the_all_to_all():
    cluster = parse_cluster("4x8xH100")
    args = (DEEPSEEK, cluster, 1, 1, 32, 32, "bf16", "bf16", 2048, 256, 1.25)
    plain = layout_costs(*args)
    eplb = layout_costs(*args, redundant_experts=32)
    # Expert bytes a rank may read per step: 58 layers x 9 experts x 88,080,384 B; routing spread
    # uniformly over 288 physical experts, so one routed token misses a given one with 1 - 8/288 = 35/36.
    assert eplb.experts_all == MOE_LAYERS * 9 * EXPERT_BF16
    assert plain.experts_all == MOE_LAYERS * 8 * EXPERT_BF16
    assert eplb.expert_miss == pytest.approx(35 / 36, rel=1e-15) and plain.expert_miss == pytest.approx(31 / 32, rel=1e-15)
    # Each token still goes to top-8 experts: the dispatch/combine is the same with or without replicas.
    assert eplb.comm_lines == plain.comm_lines
    # ... and on the EP tier that is, for 128 tokens per rank across nodes (8 of the 32 ranks per node),
    # crossing = 128 x 7168 x 1.25 x 8 x (32 - 8) / 32 elements, FP8 (1 + 4/128 B) out, bf16 back.
    tier = eplb.tier_ep
    assert tier.members_per_node == 8
    crossing = 128 * 7168 * 1.25 * 8 * 24 / 32
    hand = tier.latency_s + 0.5 * crossing * (DISPATCH_BYTES + COMBINE_BYTES) / tier.nic_bytes_per_s
    assert DISPATCH_BYTES == 1.03125 and COMBINE_BYTES == 2.0
    assert ep_round_trip_s(128, DEEPSEEK, 32, tier, 1.25) == pytest.approx(hand, rel=1e-12)
    # Expert weights read at batch b per rank: 58 x 9 x 88,080,384 x (1 - (35/36)^(32 b)) bytes.
    b = 4
    read = eplb.experts_all * (1 - eplb.expert_miss ** (b * 32))
    assert read == pytest.approx(MOE_LAYERS * 9 * EXPERT_BF16 * (1 - (35 / 36) ** 128), rel=1e-12)
    assert math.isclose(read / (MOE_LAYERS * 9 * EXPERT_BF16), 1 - (35 / 36) ** 128)


def test_estimate_accepts_wide_ep_over_72_gpus():
    cluster = parse_cluster("9x8xH100")
    result = SERVE_THROUGHPUT.evaluate(DEEPSEEK, cluster, "tp=1,dp=72,ep=72,redundant_experts=32,weight_dtype=fp8")
    assert result["fits"] and result["layout"]["redundant_experts"] == 32
    assert result["name"].startswith("DP72-EP72-EPLB32")
    assert any("288 physical experts" in w and "4 per EP rank" in w for w in result["warnings"])
    # same weights per device as DP64-EP64 (4 experts per rank either way)
    plain = SERVE_THROUGHPUT.evaluate(DEEPSEEK, parse_cluster("8x8xH100"), "tp=1,dp=64,ep=64,weight_dtype=fp8")
    assert "redundant_experts" not in plain["layout"]
    assert result["memory"]["weights_gib"] == plain["memory"]["weights_gib"]
    refused = SERVE_LATENCY.evaluate(DEEPSEEK, cluster, "tp=1,dp=72,ep=72,weight_dtype=fp8")
    assert not refused["fits"] and "redundant_experts=32 (EPLB)" in refused["reject_reason"]


def test_search_candidates_have_no_redundant_experts_unless_asked():
    cluster = parse_cluster("9x8xH100")
    assert all(not layout.redundant_experts for layout in SERVE_THROUGHPUT.candidates(DEEPSEEK, cluster))


def test_search_tries_eplb_layouts_only_when_asked(capsys):
    """``plan --redundant-experts 32``: the serving search adds, for every ep dividing 256 + 32 = 288
    (9, 18, 36, 72, ...) but not 256, the layout with 32 replicas (where ep divides 256 replicas would only add memory:
    the planner does not derive a lower load imbalance from them); without the flag none has any."""
    import json

    from modelcarve.cli import main

    args = ["plan", "--goal", "serve-throughput", "--model", "deepseek-v3", "--cluster", "9x8xH100", "--input-len", "2000",
            "--output-len", "1000", "--weight-dtypes", "fp8", "--kv-dtypes", "fp8", "--json", "--top", "20"]
    assert main(args + ["--redundant-experts", "32"]) == 0
    with_r = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    without = json.loads(capsys.readouterr().out)

    def layouts(result):
        return [row["layout"] for row in result["layouts"]]

    eplb = [lay for lay in layouts(with_r) if lay.get("redundant_experts")]
    assert eplb and all(lay["redundant_experts"] == 32 and 288 % lay["ep"] == 0 and 256 % lay["ep"] for lay in eplb)
    assert not [lay for lay in layouts(without) if lay.get("redundant_experts")]
    assert main(args + ["--redundant-experts", "-1"]) == 2
    assert "redundant" in capsys.readouterr().err
