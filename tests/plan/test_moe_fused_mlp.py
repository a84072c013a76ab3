"""The fused grouped MLP of MoE layers (TrainOptions.moe_fused_mlp: Transformer Engine's op fuser,
Megatron-Core's --use-transformer-engine-op-fuser, Megatron-Bridge's cutedsl_fused_grouped_mlp presets):
the routed experts' activation and the quantisation of its output run in the GEMM epilogues, so the
layer prices neither their element-wise traffic nor that quantisation; each difference is derived by
hand from the bytes plan/train/layer.py names, at the planner's HBM rate."""

from __future__ import annotations

import dataclasses
from unittest.mock import patch

import pytest

from modelcarve.plan.cost import efficiency
from modelcarve.plan.cost.efficiency import memory_bound_time_s
from modelcarve.plan.train.calibration import _published_model
from modelcarve.plan.train.layer import layer_cost, quantise_bytes
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

SEQ, MBS, EP = 4096, 1, 8


def _layer(model, dtype: str, fused: bool, recompute: str = "none", per_launch: float = 0.0) -> dict:
    """One MoE layer's cost; the host's time to issue expert kernels is 0 unless ``per_launch`` says (the
    traffic tests compare GPU work alone; the host-issue bound is tested on its own below)."""
    cluster = parse_cluster("1x8xB200")
    with patch.object(efficiency, "MOE_HOST_S_PER_LAUNCH", per_launch):
        cost = TrainCostModel(model, cluster, TrainOptions(global_batch=64, seq=SEQ, load_imbalance=1.0,
                                                           moe_dispatcher="fused", moe_fused_mlp=fused))
        cost._dtype = dtype
        return layer_cost(cost, True, 1, 1, EP, MBS, False, recompute, SEQ)


@pytest.mark.parametrize("dtype", ["bf16", "mxfp8", "fp8cs"])
def test_fused_mlp_drops_the_routed_activation_and_its_quantisation(dtype):
    qwen = _published_model("qwen3-30b-a3b")  # 128 experts, top 8, expert ffn 768, SwiGLU, no shared expert
    dev = parse_cluster("1x8xB200").device
    routed = MBS * SEQ * qwen.top_k  # routed token copies on this rank (load imbalance 1, tp 1)
    fe = qwen.expert_ffn_size
    act = 6.0 * routed * fe  # SwiGLU: read gate and up (2 x 2 bytes), write the product (2 bytes)
    qf, qb = quantise_bytes(dtype)
    # forward: the activation pass and the quantisation of its output (the second GEMM's input)
    d_fwd = memory_bound_time_s(dev, act) + memory_bound_time_s(dev, qf * routed * fe)
    # backward: the activation's derivative (twice the forward's traffic, as every element-wise op here) and the
    # quantisation of the first GEMM's output gradient (gate and up: 2 fe per routed copy)
    d_bwd = 2.0 * memory_bound_time_s(dev, act) + memory_bound_time_s(dev, qb * routed * 2 * fe)
    plain, fused = _layer(qwen, dtype, False), _layer(qwen, dtype, True)
    assert plain["fwd_s"] - fused["fwd_s"] == pytest.approx(d_fwd, rel=1e-9)
    assert plain["bwd_s"] - fused["bwd_s"] == pytest.approx(d_bwd, rel=1e-9)
    # nothing else moves: communication, activations kept
    for key in ("ep_s", "ep_bytes", "tp_s", "act_bytes"):
        assert plain[key] == fused[key]


def test_fused_mlp_recomputes_no_routed_activation():
    qwen = _published_model("qwen3-30b-a3b")
    assert _layer(qwen, "mxfp8", False, "mlp_act")["recompute_s"] > 0.0
    assert _layer(qwen, "mxfp8", True, "mlp_act")["recompute_s"] == 0.0


def test_shared_experts_keep_their_activation():
    # DeepSeek-style shared experts run their own MLP, outside the fused grouped one
    qwen = _published_model("qwen3-30b-a3b")
    shared = dataclasses.replace(qwen, num_shared_experts=1)
    dev = parse_cluster("1x8xB200").device
    fe = qwen.expert_ffn_size
    kept = memory_bound_time_s(dev, 6.0 * MBS * SEQ * fe)  # the shared expert's SwiGLU over every token
    assert _layer(shared, "bf16", True, "mlp_act")["recompute_s"] == pytest.approx(kept, rel=1e-9)


def test_dense_layers_and_the_default_are_unchanged():
    llama = get_model("llama-3.1-8b")
    cluster = parse_cluster("1x8xB200")
    a = TrainCostModel(llama, cluster, TrainOptions(global_batch=64, seq=SEQ))
    b = TrainCostModel(llama, cluster, TrainOptions(global_batch=64, seq=SEQ, moe_fused_mlp=True))
    for cost in (a, b):
        cost._dtype = "bf16"
    assert layer_cost(a, False, 1, 1, 1, 1, False, "none", SEQ) == layer_cost(b, False, 1, 1, 1, 1, False, "none", SEQ)
    assert TrainOptions().moe_fused_mlp is False


def test_fused_mlp_issues_one_set_of_expert_kernels_from_the_host():
    # a device-initiated fused grouped MLP: the host issues one set of kernels for all 16 local experts, the
    # per-expert GroupedLinear one per expert: at 1 ms a launch, bf16's 2 forward launches are 2 ms of host
    # against 32 ms, each the layer's forward where its GPU work is shorter
    qwen = _published_model("qwen3-30b-a3b")
    gpu = _layer(qwen, "bf16", True)
    assert gpu["fwd_s"] < 2e-3
    assert _layer(qwen, "bf16", False, per_launch=1e-3)["fwd_s"] == pytest.approx(32e-3, rel=1e-12)
    assert _layer(qwen, "bf16", True, per_launch=1e-3)["fwd_s"] == pytest.approx(2e-3, rel=1e-12)
