"""The dropless all-to-all dispatcher's host stall, priced per expert kernel launch
(plan/cost/efficiency.py ``MOE_HOST_S_PER_LAUNCH``, plan/train/layer.py ``expert_launches``),
against figures derived by hand.

After the per-expert token counts reach the host the stream is drained, and the GPU runs no
faster than the host issues each local expert's kernels. Per expert and pass (Transformer
Engine GroupedLinear, two expert linears fc1 and fc2):

* forward: one GEMM per linear, plus its input's quantisation under FP8;
* backward: a data- and a weight-gradient GEMM per linear, plus the output gradient's quantisation;
* quantisation kernels: none in bf16, one under delayed scaling and MXFP8, three under current
  scaling (amax, scale, cast).

So bf16 (2, 4), FP8 delayed / MXFP8 (4, 6), FP8 current scaling (8, 10) launches per expert.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest

from modelcarve.plan.cost import efficiency
from modelcarve.plan.train.calibration import _published_model
from modelcarve.plan.train.layer import expert_launches, layer_base
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.hardware import parse_cluster


def test_launch_counts_per_expert_and_pass():
    assert expert_launches("bf16") == (2, 4)
    assert expert_launches("fp16") == (2, 4)
    assert expert_launches("fp8") == (4, 6)  # delayed scaling: the amax is fused into the cast
    assert expert_launches("mxfp8") == (4, 6)  # one kernel writes both copies and their block scales
    assert expert_launches("fp8cs") == (8, 10)  # current scaling: amax, scale, cast per quantisation


def _cost(dtype: str, dispatcher: str) -> TrainCostModel:
    # Qwen3-30B-A3B (128 experts, top-8, expert FFN 768) on H100 with EP8: 16 local experts,
    # micro-batch 2 of 4096 tokens, as the Megatron-Bridge 25.11 H100 FP8-CS row runs it
    qwen, h100 = _published_model("qwen3-30b-a3b"), parse_cluster("2x8xH100")
    cost = TrainCostModel(qwen, h100, TrainOptions(global_batch=512, seq=4096, load_imbalance=1.0, moe_dispatcher=dispatcher))
    cost._dtype = dtype
    return cost


def _base(dtype: str, dispatcher: str, per_launch: float):
    with patch.object(efficiency, "MOE_HOST_S_PER_LAUNCH", per_launch):
        return layer_base(_cost(dtype, dispatcher), True, 1, 1, 8, 2, False, 4096)


def test_fp8_current_scaling_stall_by_hand():
    # 50 us per launch, 16 local experts: forward 8 x 16 x 50 us = 6.4 ms of host, backward 10 x 16 x
    # 50 us = 8.0 ms; the stall is what the host takes beyond the MoE GPU work (forward g, backward 2 g)
    a2a = _base("fp8cs", "alltoall", 50e-6)
    fused = _base("fp8cs", "fused", 0.0)  # the GPU's work alone
    moe_fwd = a2a["g_ffn"] + efficiency.memory_bound_time_s(parse_cluster("2x8xH100").device,
                                                             a2a["ew_act"] + a2a["ew_moe"])
    assert moe_fwd < 6.4e-3  # these small expert GEMMs finish before the host has issued them all
    assert a2a["stall_fwd"] == pytest.approx(6.4e-3 - moe_fwd, rel=1e-9)
    assert a2a["fwd"] - fused["fwd"] == pytest.approx(6.4e-3 - moe_fwd, rel=1e-9)
    assert a2a["bwd"] - fused["bwd"] == pytest.approx(max(0.0, 8.0e-3 - 2.0 * moe_fwd), rel=1e-9)


def test_precision_sets_the_launch_count():
    # bf16 forward host 2 x 16 x 50 us = 1.6 ms against FP8-CS's 6.4 ms: current scaling's
    # quantisation kernels are what make the same layout host-bound
    bf16 = _base("bf16", "alltoall", 50e-6)
    moe_fwd = bf16["g_ffn"] + efficiency.memory_bound_time_s(parse_cluster("2x8xH100").device,
                                                              bf16["ew_act"] + bf16["ew_moe"])
    assert bf16["stall_fwd"] == pytest.approx(max(0.0, 1.6e-3 - moe_fwd), abs=1e-15)
    assert _base("fp8cs", "alltoall", 50e-6)["stall_fwd"] > bf16["stall_fwd"] + 3.0e-3
    # no launch cost, no stall, whatever the precision
    for dtype in ("bf16", "fp8", "fp8cs", "mxfp8"):
        assert _base(dtype, "alltoall", 0.0)["fwd"] == pytest.approx(_base(dtype, "fused", 0.0)["fwd"], rel=1e-12)


def test_without_the_sync_the_layer_lasts_at_least_the_host_issue_time():
    # the flex dispatcher (DeepEP / HybridEP) sends no counts to the host, which issues ahead: the layer's pass
    # lasts max(its GPU work, the host's 6.4 ms / 8.0 ms of expert kernels), not the MoE block's stall on top
    gpu = _base("fp8cs", "fused", 0.0)
    fused = _base("fp8cs", "fused", 50e-6)
    assert gpu["fwd"] < 6.4e-3  # this layer's whole forward is shorter than the host's issue time
    assert fused["fwd"] == pytest.approx(6.4e-3, rel=1e-12)
    assert fused["bwd"] == pytest.approx(max(gpu["bwd"], 8.0e-3), rel=1e-12)
    assert fused["stall_fwd"] == pytest.approx(6.4e-3 - gpu["fwd"], rel=1e-9)
    # an all-to-all layer waits for the host after the counts (its MoE block), the flex one for its whole pass
    assert _base("fp8cs", "alltoall", 50e-6)["fwd"] > fused["fwd"]


@pytest.mark.parametrize("options, sets", [({}, 16), ({"moe_expert_kernels": "grouped"}, 1),
                                           ({"moe_fused_mlp": True}, 1), ({"cuda_graph": "full_iteration"}, 0),
                                           ({"cuda_graph": "partial"}, 16)])
def test_who_issues_the_expert_kernels(options, sets):
    # TE's GroupedLinear: each of 16 local experts its kernels; one grouped GEMM (torchtitan's _grouped_mm) or the
    # device-initiated fused MLP: one set; a full-iteration CUDA graph: the host issues none; layer-wise graphs leave
    # dropless experts eager
    from modelcarve.plan.train.layer import expert_kernel_sets

    assert expert_kernel_sets(TrainOptions(**options), 16.0) == sets


def _finish(dtype: str, dispatcher: str, per_launch: float, recompute: str):
    from modelcarve.plan.train.layer import _layer_finish

    base = _base(dtype, dispatcher, per_launch)
    return base, _layer_finish(_cost(dtype, dispatcher), base, recompute)


def test_recomputation_under_the_flex_dispatcher_by_hand():
    # The host issues the backward's expert kernels (FP8-CS: 10 x 16 x 50 us = 8.0 ms) and, when the MoE block is
    # recomputed, its forward's again (8 x 16 x 50 us = 6.4 ms), ahead of the GPU: backward + recomputation last
    # max(GPU work, 14.4 ms of host), whatever share of it the recomputation is charged.
    gpu, host = 8.0e-3, 6.4e-3
    for recompute in ("full", "mlp"):
        base, out = _finish("fp8cs", "fused", 50e-6, recompute)
        _, free = _finish("fp8cs", "fused", 0.0, recompute)  # no launch cost: the GPU's recomputation alone
        assert base["host_bwd"] == pytest.approx(gpu, rel=1e-12) and base["host_fwd"] == pytest.approx(host, rel=1e-12)
        rc = base["fwd_gpu"] if recompute == "full" else free["recompute_s"]  # full: the whole forward again
        assert out["recompute_s"] + out["bwd_s"] == pytest.approx(max(base["bwd_gpu"] + rc, gpu + host), rel=1e-12)
        assert out["compute_s"] == pytest.approx(out["fwd_s"] + out["bwd_s"] + out["recompute_s"], rel=1e-12)
    # the host's 8 ms bound the backward, so a recomputation that issues no expert kernel (the attention core:
    # GPU work alone) runs in the host's shadow while it fits there
    base, core = _finish("fp8cs", "fused", 50e-6, "core_attn")
    _, alone = _finish("fp8cs", "fused", 0.0, "core_attn")
    assert base["bwd_gpu"] + alone["recompute_s"] < gpu
    assert core["recompute_s"] == 0.0 and alone["recompute_s"] > 0.0
    # the all-to-all dispatcher syncs on the counts: its recomputed MoE block stalls again, on top of the GPU work
    base, a2a = _finish("fp8cs", "alltoall", 50e-6, "mlp")
    _, a2a_free = _finish("fp8cs", "alltoall", 0.0, "mlp")
    assert a2a["recompute_s"] == pytest.approx(a2a_free["recompute_s"] + base["stall_fwd"], rel=1e-12)
