"""The modelling terms the NeMo / Megatron-Bridge calibration added, each against a hand-derived
figure, and the published rows as the planner reads them (data/training_published.csv).

* all-to-all dispatcher host stall (plan/cost/efficiency.py ``MOE_HOST_S_PER_LAUNCH``): per MoE pass
  max(0, host - GPU) with host = per-launch time x the pass's kernels per expert x local experts
  (tests/plan/test_plan_moe_launch.py derives them); so forward + backward add at most their two
  host times, nothing when the constant is 0, nothing for Mixtral's single large local expert
  (its expert GEMMs outlast the host), and with MLP recomputation a third pass;
* sliding-window layers (gpt-oss: even layers, window 128) in the flash attention share;
* recomputation: the inferred one is one per recipe across systems; the recipe's own where it is stated;
* the calibration summary itself, as regression bounds on what benchmarks/calibrate_training.py
  measured (on the publisher-corrected 25.11 rows and the refitted constants: MAPE 14.15% over 53
  rows, 12.36% over the 32 fitted rows: bounds 15% / 13%, i.e. the measured value plus under one
  point, so a change that loses accuracy fails here). Issue 25 (the planner prices the runtime's
  pipeline split, spec/stages.py, instead of ceil(layers / pp) per stage) moved them to 14.87% /
  12.76% with the constants unrefitted; the bounds are unchanged.
"""

from __future__ import annotations

import dataclasses
from unittest.mock import patch

import pytest

from modelcarve.plan.cost import efficiency
from modelcarve.plan.train.calibration import _published_model, nemo_cases
from modelcarve.plan.train.layer import _causal_share, expert_launches, layer_cost
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


def _moe_layer(model, cluster, dispatcher, ep, mbs, recompute="none", per_launch=None):
    value = efficiency.MOE_HOST_S_PER_LAUNCH if per_launch is None else per_launch
    with patch.object(efficiency, "MOE_HOST_S_PER_LAUNCH", value):
        cost = TrainCostModel(model, cluster, TrainOptions(global_batch=64, seq=4096, load_imbalance=1.0,
                                                            moe_dispatcher=dispatcher))
        cost._dtype = "bf16"
        return layer_cost(cost, True, 1, 1, ep, mbs, False, recompute, 4096)


def test_alltoall_host_stall_is_bounded_by_the_host_launch_time():
    qwen, b200 = _published_model("qwen3-30b-a3b"), parse_cluster("1x8xB200")
    n_fwd, n_bwd = expert_launches("bf16")
    host_fwd = efficiency.MOE_HOST_S_PER_LAUNCH * n_fwd * 128 / 8  # 16 local experts
    host_bwd = efficiency.MOE_HOST_S_PER_LAUNCH * n_bwd * 128 / 8
    fused = _moe_layer(qwen, b200, "fused", 8, 1, per_launch=0.0)  # the GPU's work alone: no host to wait for
    a2a = _moe_layer(qwen, b200, "alltoall", 8, 1)
    extra = a2a["compute_s"] - fused["compute_s"]
    assert 0.0 < extra <= host_fwd + host_bwd + 1e-12  # forward and backward, each at most its host time
    # the forward stall is host minus the forward's MoE GPU time: positive, less than host
    assert 0.0 < a2a["fwd_s"] - fused["fwd_s"] <= host_fwd
    # MLP recomputation re-runs the MoE forward: its stall once more
    rc_fused = _moe_layer(qwen, b200, "fused", 8, 1, "core_attn+layernorm+mlp", per_launch=0.0)
    rc_a2a = _moe_layer(qwen, b200, "alltoall", 8, 1, "core_attn+layernorm+mlp")
    assert rc_a2a["recompute_s"] - rc_fused["recompute_s"] == pytest.approx(a2a["fwd_s"] - fused["fwd_s"], rel=1e-9)
    # no host cost, no stall
    assert _moe_layer(qwen, b200, "alltoall", 8, 1, per_launch=0.0)["compute_s"] == pytest.approx(fused["compute_s"])
    # Mixtral 8x7B, EP8: one local expert of 14336 x 4096 at 8192 tokens: its GEMMs outlast 2 and 4 launches
    mixtral = get_model("mixtral-8x7b")
    assert _moe_layer(mixtral, b200, "alltoall", 8, 2)["compute_s"] == pytest.approx(
        _moe_layer(mixtral, b200, "fused", 8, 2)["compute_s"], rel=1e-12)


def test_sliding_window_layers_in_the_attention_share():
    oss = _published_model("gpt-oss-120b")
    assert oss.sliding_layers == tuple(range(0, 36, 2)) and oss.sliding_window == 128
    s, w = 4096, 128
    band = (w * s - w * w / 2) / (s * s)  # causal band of width w over the s x s score blocks
    assert _causal_share(oss, s) == pytest.approx(0.5 * 0.5 + 0.5 * band, rel=1e-12)
    assert _causal_share(get_model("llama-3.1-8b"), s) == 0.5
    no_window = dataclasses.replace(oss, sliding_layers=(), sliding_window=None)
    assert _causal_share(no_window, s) == 0.5


def test_every_row_answered_and_recompute_is_one_per_recipe():
    cases = nemo_cases()
    assert len(cases) >= 50 and not [c.name for c in cases if c.unanswered]
    by_recipe: dict = {}
    for c in cases:
        if not c.recompute_inferred:  # a preset's own per-system recompute is a fact, not inferred
            continue
        key = (c.source, c.model.name, c.name.split()[1], c.layout.short().replace("-FP8", "").replace("-MXFP8", ""),
               c.layout.mbs, c.layout.gbs, c.layout.seq)
        by_recipe.setdefault(key, set()).add(c.layout.recompute)
    assert all(len(modes) == 1 for modes in by_recipe.values()), {k: v for k, v in by_recipe.items() if len(v) > 1}
    stated = {c.name: c.layout.recompute for c in cases if "llama-3.1-70b fp8-cs 64xGB" in c.name and "MB-" in c.name}
    assert stated and set(stated.values()) == {"none"}  # the recipe offloads activations instead
    # what each release ran beyond the layout: Megatron-Bridge's presets reduce gradients in bf16, hold FP8
    # weights with no bf16 copy, and weigh the expert activation (MCore 0.13+); NeMo 2 (MCore <= 0.12) the combine,
    # and its 25.x FP8 performance scripts reduce in bf16 too (24.07 predates them)
    for c in cases:
        bridge = c.source.startswith("MB-")
        assert c.layout.grad_dtype == ("fp32" if c.source == "NEMO-24.07" else "bf16"), c.name
        assert c.options.fp8_param_gather is bridge and c.options.moe_probs_on_combine is not bridge, c.name
    dispatch = {c.name: c.options.moe_dispatcher for c in cases if c.model.is_moe}
    assert dispatch["qwen3-30b-a3b mxfp8 8xGB200 (MB-25.11)"] == "fused"
    assert dispatch["qwen3-30b-a3b mxfp8 8xB200 (MB-25.11)"] == "alltoall"
    # 26.04.01 (Megatron-Bridge v0.4.2): Qwen3-235B's B300 config moved to the flex dispatcher, its B200 one did not
    assert dispatch["qwen3-235b-a22b mxfp8 256xB300 (MB-26.04.01)"] == "fused"
    assert dispatch["qwen3-235b-a22b mxfp8 256xB200 (MB-26.04.01)"] == "alltoall"
    # 26.06 (v0.5.0): gpt-oss runs MXFP8 with HybridEP on GB300 / GB200 / B300; the presets' partial CUDA graphs and
    # FP8 attention are read as notes (unpriced), their full-iteration CUDA graphs and CuTeDSL fused grouped MLP are
    # priced (cuda_graph, moe_fused_mlp); the H100
    # Qwen3-30B preset sets none of them
    assert dispatch["gpt-oss-120b mxfp8 64xGB300 (MB-26.06)"] == "fused"
    notes = {c.name: c.unmodelled for c in cases if c.source in ("MB-26.06", "MB-26.08")}
    fused = {c.name: c.options.moe_fused_mlp for c in cases}
    graphs = {c.name: c.options.cuda_graph for c in cases}
    assert notes["gpt-oss-120b mxfp8 64xGB300 (MB-26.08)"] == ("fp8_dot_product_attention",)
    assert graphs["gpt-oss-120b mxfp8 64xGB300 (MB-26.08)"] == "full_iteration"
    assert fused["gpt-oss-120b mxfp8 64xGB300 (MB-26.08)"] and fused["deepseek-v3 mxfp8 256xGB200 (MB-26.06)"]
    assert notes["deepseek-v3 mxfp8 256xB300 (MB-26.06)"] == ("cuda_graph=transformer_engine",)
    assert graphs["deepseek-v3 mxfp8 256xB300 (MB-26.06)"] == "partial"
    assert graphs["qwen3-30b-a3b fp8-cs 16xH100 (MB-26.06)"] == "none"
    assert not fused["deepseek-v3 mxfp8 256xB300 (MB-26.06)"]
    assert notes["qwen3-30b-a3b fp8-cs 16xH100 (MB-26.06)"] == ()
    assert not fused["qwen3-30b-a3b fp8-cs 16xH100 (MB-26.06)"]
    assert all(c.unmodelled == () for c in cases if c.source not in ("MB-26.06", "MB-26.08"))
    assert not any(c.options.moe_fused_mlp for c in cases if c.source not in ("MB-26.06", "MB-26.08"))


def test_the_recipe_feature_columns_are_optional(tmp_path):
    # a CSV without the cuda_graph / cutedsl_mlp / fp8_attention columns (or with them empty) reads as before
    head = "source,system,model,gpus,precision,gbs,mbs,seq,fsdp,tp,pp,cp,vp,ep,tokens_per_gpu,tflops_per_gpu"
    row = "MB-25.11,GB200,qwen3-30b-a3b,8,mxfp8,512,4,4096,0,1,1,1,1,8,23766,547"
    (tmp_path / "old.csv").write_text(f"# header\n{head},dispatcher,recompute\n{row},fused,infer\n")
    (tmp_path / "new.csv").write_text(f"{head},dispatcher,recompute,offload_layers,a2a_overlap,cuda_graph,cutedsl_mlp,"
                                      f"fp8_attention\n{row},fused,infer,,,,,\n{row},fused,infer,,1,none,0,\n")
    old, new = nemo_cases(tmp_path / "old.csv"), nemo_cases(tmp_path / "new.csv")
    assert old[0].unmodelled == () and [c.unmodelled for c in new] == [(), ()]
    assert old[0].layout == new[0].layout and old[0].options == new[0].options


def test_calibration_summary_regression_bounds():
    import math

    errs, by_source = [], {}
    for c in nemo_cases():
        est = TrainCostModel(c.model, c.cluster, c.options).estimate(c.layout)
        err = est["time"]["tokens_per_s"] / c.cluster.num_devices / c.published_tokens_per_device - 1
        errs.append((c.name, err))
        by_source.setdefault(c.source, []).append(abs(err))
    assert all(math.isfinite(e) for _, e in errs)
    mape = sum(abs(e) for _, e in errs) / len(errs)
    # The code's constants are fitted to every release (benchmarks/calibrate_training.py shipped_fit, since
    # 2026-12-06); how they fare on a release they did not see is the leave-one-source-out table
    # (docs/calibration_training.md), so these are guards against drifting, not out-of-sample figures.
    # measured 9.7% over the 135 rows (13.8% with the constants fitted to the 32 MB-25.11 rows alone, under which
    # the later releases were forward-in-time checks: 26.02.01 14.1%, 26.04.01 12.7%, 26.06 11.7%, 26.08 11.7%)
    assert len(errs) == 135 and mape <= 0.105, mape
    # (rows, bound) per release; measured 9.8 / 8.2 / 9.1 / 10.0 / 10.3 / 9.9 / 9.0 / 10.1%
    bounds = {"MB-25.11": (32, 0.11), "NEMO-25.04": (7, 0.095), "NEMO-25.02": (7, 0.10), "NEMO-24.07": (7, 0.11),
              "MB-26.02.01": (27, 0.115), "MB-26.04.01": (29, 0.11), "MB-26.06": (18, 0.10), "MB-26.08": (8, 0.11)}
    assert set(by_source) == set(bounds)
    for source, (rows, bound) in bounds.items():
        got = by_source[source]
        assert len(got) == rows and sum(got) / rows <= bound, (source, sum(got) / rows)
    # the row that was +143% before the dispatcher stall was modelled
    assert [abs(e) <= 0.15 for name, e in errs if name == "qwen3-30b-a3b mxfp8 8xB200 (MB-25.11)"] == [True]
