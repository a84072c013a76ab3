"""plan/cost/unfused.py: the element-wise work Megatron-Core runs outside its fused kernels for YaRN
rotary with an attention scale, a clamped GLU and expert output biases (gpt-oss has all three).

Hand-derived: the bytes per element counted from Megatron-LM's code (the module doc), the concentration
factor of Megatron's YaRN, which models take which path, and what one gpt-oss layer's forward, backward
and recomputation gain in seconds: exactly those bytes at HBM speed.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from modelcarve.plan.cost.efficiency import memory_bound_time_s
from modelcarve.plan.train.calibration import _published_model
from modelcarve.plan.train.layer import _layer_finish, layer_base
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.plan.cost.unfused import NONE, features, unfused_bytes, yarn_mscale
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


def test_megatrons_yarn_concentration_factor():
    # gpt-oss names no mscale: 0.1 ln 32 + 1; DeepSeek-V3's mscale = mscale_all_dim = 1: the ratio is 1
    assert yarn_mscale(get_model("gpt-oss-120b")) == pytest.approx(0.1 * math.log(32.0) + 1.0, rel=1e-12)
    assert yarn_mscale(get_model("deepseek-v3")) == 1.0
    assert yarn_mscale(get_model("llama-3.1-8b")) == 1.0  # llama3 rotary, not yarn
    assert features(get_model("gpt-oss-120b")) == (True, True, True)
    for name in ("deepseek-v3", "kimi-k2", "llama-3.1-70b", "qwen3-30b-a3b", "mixtral-8x7b", "llama-4-maverick"):
        assert features(get_model(name)) == (False, False, False), name


def test_bytes_per_element_by_hand():
    oss = get_model("gpt-oss-120b")
    q, f1, f2 = 1000.0, 300.0, 70.0
    x = unfused_bytes(oss, q_kv_elems=q, fc1_elems=f1, fc2_elems=f2, fused_mlp=False, fp32_probs=False)
    # rotary 2 x (12 - 2) / 2 x (9 - 2); clamp 2 x 4 / 2 x 5; bf16 bias 12 / 12
    assert x.fwd == 20 * q + 8 * f1 + 12 * f2 and x.bwd == 14 * q + 10 * f1 + 12 * f2
    assert x.moe_fwd == 8 * f1 + 12 * f2 and x.act_fwd == 8 * f1
    wide = unfused_bytes(oss, q_kv_elems=q, fc1_elems=f1, fc2_elems=f2, fused_mlp=False, fp32_probs=True)
    assert wide.fwd == 20 * q + 8 * f1 + 28 * f2 and wide.bwd == 14 * q + 10 * f1 + 36 * f2
    # the fused grouped MLP runs the clamp and the bias in its epilogues: the rotary alone is left
    fused = unfused_bytes(oss, q_kv_elems=q, fc1_elems=f1, fc2_elems=f2, fused_mlp=True, fp32_probs=True)
    assert (fused.fwd, fused.bwd, fused.moe_fwd) == (20 * q, 14 * q, 0.0)
    assert unfused_bytes(get_model("qwen3-30b-a3b"), q_kv_elems=q, fc1_elems=f1, fc2_elems=f2, fused_mlp=False,
                         fp32_probs=False) is NONE


def _layer(model, recompute: str):
    cluster = parse_cluster("16x4xGB200")
    cost = TrainCostModel(model, cluster, TrainOptions(global_batch=1280, seq=4096, moe_dispatcher="alltoall",
                                                              load_imbalance=1.0))
    base = layer_base(cost, True, 1, 1, 64, 4, False, 4096)
    return cost, base, _layer_finish(cost, base, recompute)


def test_one_gpt_oss_layer_gains_exactly_those_bytes():
    # gpt-oss on 64 GB200, EP64, micro-batch 4 x 4096: T = 16,384 tokens, 65,536 routed (top-4, balanced as the
    # recipes force it: load_imbalance 1)
    oss = _published_model("gpt-oss-120b")
    plain = dataclasses.replace(oss, activation="swiglu", mlp_bias=False, rope_scaling=())
    assert features(plain) == (False, False, False)
    cost, x, out = _layer(oss, "layernorm+mlp_act")
    _, p, plain_out = _layer(plain, "layernorm+mlp_act")
    dev = cost.device
    T, routed = 16384.0, 65536.0
    qk, fc1, fc2 = T * (64 + 8) * 64, routed * 2 * 2880, routed * 2880
    fwd_b, bwd_b = 20 * qk + 8 * fc1 + 12 * fc2, 14 * qk + 10 * fc1 + 12 * fc2
    assert x["fwd"] - p["fwd"] == pytest.approx(memory_bound_time_s(dev, fwd_b), rel=1e-9)
    assert x["bwd"] - p["bwd"] == pytest.approx(memory_bound_time_s(dev, bwd_b), rel=1e-9)
    # the recomputed MoE activation clamps and concatenates again
    assert out["recompute_s"] - plain_out["recompute_s"] == pytest.approx(memory_bound_time_s(dev, 8 * fc1), rel=1e-9)
    # 6.8 + 7.1 + 3.0 GB: 2.64 ms more of a 16k-token micro-batch's layer on GB200 (8 TB/s at HBM_EFFICIENCY 0.8),
    # against about 13 ms priced before
    extra = out["compute_s"] - plain_out["compute_s"]
    assert extra == pytest.approx(memory_bound_time_s(dev, fwd_b + bwd_b + 8 * fc1), rel=1e-9)
    assert extra == pytest.approx(2.64e-3, abs=0.005e-3)


def test_only_megatrons_code_takes_them():
    # torchtitan (param_policy torch) and this project's runtime run their own ops: none of Megatron-Core's paths
    oss = _published_model("gpt-oss-120b")
    cluster = parse_cluster("16x4xGB200")
    for policy in ("torch", "modelcarve"):
        cost = TrainCostModel(oss, cluster, TrainOptions(global_batch=1280, seq=4096, moe_dispatcher="alltoall",
                                                         load_imbalance=1.0, param_policy=policy))
        base = layer_base(cost, True, 1, 1, 64, 4, False, 4096)
        assert base["x_fwd_s"] == base["x_moe_s"] == base["x_act_s"] == 0.0
    _, megatron, _ = _layer(oss, "none")
    assert megatron["x_fwd_s"] > 0.0
