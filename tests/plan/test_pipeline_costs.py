"""The pipeline timeline priced per stage (plan/predict/timeline.py ``model_records`` with
plan/train/pipeline_costs.py's ``schedule_costs``): unequal stages, sends and host time, each
against a timeline worked by hand; the planner's stage times against their parts."""

from __future__ import annotations

import pytest

from modelcarve.plan.predict.timeline import bubble, model_records


def test_unequal_stages_gpipe_by_hand():
    # p=2, m=4, stage 1 twice as slow (F 1 / 2, B 2 / 4):
    # rank 0: F0..F3 at 0-4; rank 1: F_i waits for rank 0's F_i and its own previous:
    #   F0 1-3, F1 3-5, F2 5-7, F3 7-9, then B0..B3 at 9-13, 13-17, 17-21, 21-25;
    # rank 0: B_i after rank 1's B_i: 13-15, 17-19, 21-23, 25-27. wall 27, busy 12 + 24.
    got = bubble(model_records("gpipe", 2, 4, f=[1.0, 2.0], b=[2.0, 4.0]))
    assert got["wall"] == 27.0 and got["busy"] == {0: 12.0, 1: 24.0}
    assert got["overall"] == pytest.approx(1 - 36 / 54, abs=1e-12)
    assert got["per_rank"][0] == pytest.approx(1 - 12 / 27, abs=1e-12)


def test_sends_and_host_time_by_hand():
    # p=2, m=2, F=1, B=2 per stage, send 0.5, host 0.25 after every action:
    # rank 0: F0 0-1, F1 1.25-2.25; rank 1: F0 1.5-2.5, F1 2.75-3.75, B0 4-6, B1 6.25-8.25;
    # rank 0: B0 6.5-8.5 (rank 1's B0 at 6 + 0.5), B1 8.75-10.75 (8.25 + 0.5). wall 10.75.
    recs = model_records("gpipe", 2, 2, f=[1.0, 1.0], b=[2.0, 2.0], send_s=0.5, host_s=0.25)
    start = {(r["kind"], r["rank"], r["mb"]): r["start"] for r in recs}
    assert start["F", 1, 0] == 1.5 and start["F", 0, 1] == 1.25 and start["F", 1, 1] == 2.75
    assert start["B", 1, 0] == 4.0 and start["B", 0, 0] == 6.5 and start["B", 0, 1] == 8.75
    got = bubble(recs)
    assert got["wall"] == 10.75 and got["overall"] == pytest.approx(1 - 12 / 21.5, abs=1e-12)


def test_zero_bubble_first_stage_runs_its_backward_as_w():
    recs = model_records("zero-bubble", 2, 4, f=[1.0, 1.0], b=[2.0, 2.0], i_share=[0.0, 0.5])
    dur = {(r["kind"], r["rank"]): r["end"] - r["start"] for r in recs}
    assert dur["I", 0] == 0.0 and dur["W", 0] == 2.0
    assert dur["I", 1] == 1.0 and dur["W", 1] == 1.0
    # every action ran once: m F, m I, m W per rank
    assert sorted(r["kind"] for r in recs).count("W") == 8


def test_per_stage_values_must_match_the_stages():
    with pytest.raises(ValueError, match="3 per-stage values; the pipeline has 4 stages"):
        model_records("interleaved-1f1b", 2, 4, 2, f=[1.0, 1.0, 1.0], b=2.0)


def test_uniform_numbers_keep_the_formula():
    from modelcarve.plan.cost.schedule import bubble_fraction

    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        assert bubble(model_records(schedule, 4, 8, v, f=[1.0 / v] * 4 * v, b=[2.0 / v] * 4 * v))["overall"] == \
            pytest.approx(bubble_fraction(schedule, 4, 8, v), abs=1e-12)


def _cluster():
    from modelcarve.spec.hardware import cluster_from_dict

    return cluster_from_dict(dict(
        nodes=1, devices_per_node=2, nics_per_node=1,
        device=dict(name="cpu-probed", memory_bytes=8 * 2**30, peak_flops=dict(fp32=2.5e11, bf16=5e11, tf32=2.5e11),
                    hbm_bytes_per_s=2.5e10, devices_per_node=2, nics_per_node=1, gemm_efficiency=1.0,
                    pipeline_action_s=3e-4),
        intra_link=dict(name="gloo-loopback", bytes_per_s=1.6e9, latency_s=6e-4),
        inter_link=dict(name="gloo-loopback", bytes_per_s=1.6e9, latency_s=6e-4)))


def test_schedule_costs_are_the_planners_stages_plus_the_head():
    """small-llama (8 layers, hidden 384, vocabulary 8192) at pp=2, seq 64, fp32: both stages hold
    4 layers; the last adds the head, a (64 x 384) @ (384 x 8192) GEMM forward, two more backward,
    and the loss's 14 bytes a logit streamed. Interleaved v=2 cuts each rank's into two stages of
    2 layers, the head on stage 3."""
    from modelcarve.plan.cost.efficiency import gemm_time_s, memory_bound_time_s
    from modelcarve.plan.train.pipeline_costs import schedule_costs
    from modelcarve.plan.train.model import TrainCostModel, TrainOptions
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec, cluster = get_model("small-llama"), _cluster()
    layout = Layout.parse("pp=2,schedule=1f1b,gbs=8,mbs=1,seq=64,param_dtype=fp32")
    c = schedule_costs(spec, cluster, layout)
    head_f = gemm_time_s(cluster.device, 64, 8192, 384, 1.0, "fp32")
    loss = memory_bound_time_s(cluster.device, 14.0 * 64 * 8192)
    assert c["f"][1] - c["f"][0] == pytest.approx(head_f, rel=1e-12)
    assert c["b"][1] - c["b"][0] == pytest.approx(2 * head_f + loss, rel=1e-12)
    prof = TrainCostModel(spec, cluster, TrainOptions(global_batch=8, seq=64)).profile(1, 1, 2, 1, 1, 1, False, "none", 64,
                                                                                        dtype="fp32")
    assert c["f"] == pytest.approx([prof["stages"]["first"]["fwd_s"], prof["stages"]["last"]["fwd_s"]], rel=1e-12)
    assert c["host_s"] == 3e-4 and c["send_s"] == pytest.approx(prof["p2p_s"], rel=1e-12) and c["i_share"] == [0.0, 0.5]
    v2 = schedule_costs(spec, cluster, Layout.parse("pp=2,schedule=interleaved-1f1b,virtual_stages=2,gbs=8,mbs=1,seq=64,"
                                                    "param_dtype=fp32"))
    assert len(v2["f"]) == 4 and v2["f"][0] == v2["f"][1] == v2["f"][2] == pytest.approx(c["f"][0] / 2, rel=1e-12)
    assert v2["f"][3] == pytest.approx(c["f"][0] / 2 + head_f, rel=1e-12)
    with pytest.raises(ValueError, match="no pipeline"):
        schedule_costs(spec, cluster, Layout.parse("dp=2,gbs=2,seq=64"))


def test_probed_device_runs_gemms_at_its_measured_rate():
    """A probed device's peaks are achieved rates (``gemm_efficiency`` 1.0, plan/cost/efficiency.py
    ``achieved``): the training planner prices its GEMMs at them, with none of the GPU-fitted ramp
    or tile model on top, as the serving planner does. The head of small-llama at seq 64:
    2 x 64 x 8192 x 384 / 2.5e11 = 1.6106 ms (the GPU model's 0.7 x 64/128 x 8192/8256 x 384/448 = 0.30 of
    the peak gave 3.4x that);
    the loss's 14 bytes a logit: 14 x 64 x 8192 / 2.5e10 = 0.2936 ms."""
    from modelcarve.plan.cost.efficiency import gemm_time_s, matmul_efficiency, memory_bound_time_s

    dev = _cluster().device
    assert matmul_efficiency(dev, 64, 8192, 384, "fp32") == 1.0
    assert gemm_time_s(dev, 64, 8192, 384, 1.0, "fp32") == pytest.approx(2 * 64 * 8192 * 384 / 2.5e11, rel=1e-12)
    assert memory_bound_time_s(dev, 14.0 * 64 * 8192) == pytest.approx(14.0 * 64 * 8192 / 2.5e10, rel=1e-12)
