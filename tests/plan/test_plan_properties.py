"""Properties every training estimate must keep, over layouts drawn from the planner's own space."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from modelcarve.plan.train.goal import enumerate_layouts
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

CASES = {
    "llama-3.1-70b": (parse_cluster("4x8xH100"), 64, 4096),
    "mixtral-8x7b": (parse_cluster("2x8xA100-80GB"), 32, 4096),
    "deepseek-v3": (parse_cluster("8x8xH200"), 128, 4096),
}
SPACES = {name: list(enumerate_layouts(get_model(name), cl, gbs, seq)) for name, (cl, gbs, seq) in CASES.items()}
COSTS = {name: TrainCostModel(get_model(name), cl, TrainOptions(global_batch=gbs, seq=seq))
         for name, (cl, gbs, seq) in CASES.items()}


def _with(cand, **changes):
    fields = ("tp", "cp", "pp", "dp", "ep", "mbs", "sp", "recompute", "zero", "dp_shard", "schedule", "virtual_stages")
    values = list(cand)
    for key, value in changes.items():
        values[fields.index(key)] = value
    return tuple(values)


draw = st.sampled_from(sorted(CASES)).flatmap(lambda name: st.tuples(st.just(name), st.sampled_from(SPACES[name])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw)
def test_screen_and_full_estimate_agree(item):
    name, cand = item
    cost = COSTS[name]
    score, category, _ = cost.screen(cand)
    est = cost.estimate(cand)
    if category is None:
        assert est["fits"] and score == pytest.approx(est["time"]["tokens_per_s"])
    else:
        assert not est["fits"] and est["reject_reason"]
    t = est["time"]
    parts = t["compute_s"] + t["bubble_s"] + t["optimizer_s"] + sum(est["comm"]["exposed_s_by_axis"].values())
    assert parts == pytest.approx(t["step_s"], rel=1e-9)
    assert 0 < t["mfu"] < 1 and 0 <= est["bubble_fraction"] < 1
    assert est["memory"]["peak_bytes"] == sum(est["memory"]["breakdown"].values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw)
def test_higher_zero_stages_never_hold_more_optimizer_state_or_gradients(item):
    name, cand = item
    if cand[3] * cand[1] == 1 or cand[9]:
        return  # no data-parallel group to shard over, or HSDP
    cost = COSTS[name]
    tp, cp, pp, dp, ep, mbs, sp, recompute = cand[:8]
    prof = cost.profile(tp, cp, pp, dp, ep, mbs, sp, recompute, cost.seq, cand[12], v=cand[11])
    # stage by stage: the worst stage itself may change with the ZeRO stage (activations vs states)
    for kind in prof["stages"]:
        parts = [cost.state_parts(prof, _with(cand, zero=z), kind) for z in (0, 1, 2, 3)]
        for lower, higher in zip(parts, parts[1:]):
            assert higher["optimizer_states"] <= lower["optimizer_states"]
            assert higher["gradients"] <= lower["gradients"]
            assert higher["weights"] <= lower["weights"]
        assert higher["weights"] <= lower["weights"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw)
def test_recomputation_trades_memory_for_time(item):
    name, cand = item
    cost = COSTS[name]
    none, sel, full = (cost.estimate(_with(cand, recompute=r)) for r in ("none", "selective", "full"))
    assert full["memory"]["breakdown"]["activations"] <= sel["memory"]["breakdown"]["activations"]
    assert sel["memory"]["breakdown"]["activations"] <= none["memory"]["breakdown"]["activations"]
    assert none["time"]["compute_s"] <= sel["time"]["compute_s"] <= full["time"]["compute_s"]
    assert none["time"]["mfu"] >= full["time"]["mfu"]
