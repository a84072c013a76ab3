"""Models sized in the dtype their checkpoint ships (issue 27 item 2): gpt-oss's routed experts
in MXFP4 by default, and the no-fit error naming the layout that comes closest to fitting."""

import pytest

from modelcarve.plan.search import nothing_qualifies, search
from modelcarve.plan.serve.goal import SERVE_LATENCY
from modelcarve.plan.serve.memory import GiB, memory_from_facts, shard_facts
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


def test_gpt_oss_experts_are_sized_as_released():
    """gpt-oss-120b: 36 MoE layers x 128 experts x 3 SwiGLU matrices of 2880 x 2880 = 114,661,785,600
    routed-expert weights. bf16 stores 2 bytes each; MXFP4 0.5 byte plus one e8m0 scale byte per
    32 weights = 0.53125. The difference: 114,661,785,600 x (2 - 0.53125) = 168,409,497,600 bytes
    = 156.84 GiB, which takes one device's weights from 217.6 GiB to 60.8 GiB."""
    model = get_model("gpt-oss-120b")
    assert model.expert_checkpoint_dtype == "mxfp4"
    bf16 = shard_facts(model, tp=1, weight_dtype="bf16", kv_dtype="bf16")
    released = shard_facts(model, tp=1, weight_dtype="bf16", kv_dtype="bf16", expert_dtype="mxfp4")
    experts = 36 * 128 * 3 * 2880 * 2880
    assert experts == 114_661_785_600
    assert bf16.weights_bytes - released.weights_bytes == pytest.approx(experts * (2 - 0.53125), rel=1e-12)
    assert released.weights_bytes / GiB == pytest.approx(60.77, abs=0.01)


def test_gpt_oss_120b_plans_on_one_h100():
    """Before: "need at least 4 x H100" (217.6 GiB of bf16 weights). As released (60.8 GiB of
    weights with bf16 attention/embeddings and MXFP4 experts, 60.5 GiB with fp8 attention) it fits
    the 72 GiB usable of one 80 GiB H100 (0.90 of it)."""
    model, cluster = get_model("gpt-oss-120b"), parse_cluster("1xH100")
    plan = search(model, cluster, "serve-latency", top=4)
    assert plan["layouts"], plan["rejected"]
    for result in plan["layouts"]:
        assert result["expert_dtype"] == "mxfp4" and result["name"].endswith("(experts mxfp4)")
        assert result["memory"]["weights_gib"] < 61.0 and result["memory"]["fits"]
    bf16 = [r for r in plan["layouts"] if r["layout"]["weight_dtype"] == "bf16"][0]
    assert bf16["memory"]["weights_gib"] == pytest.approx(60.77, abs=0.01)
    assert any("as gpt-oss-120b's checkpoint ships them" in w for w in bf16["warnings"])


def test_asking_for_a_weight_dtype_sizes_every_matrix_in_it():
    """--weight-dtypes bf16 is the user asking: the experts go bf16 too, and 217.6 GiB do not fit."""
    model, cluster = get_model("gpt-oss-120b"), parse_cluster("1xH100")
    plan = search(model, cluster, "serve-latency", top=1, weight_dtypes="bf16")
    assert not plan["layouts"]
    assert "217.6 GiB" in str(nothing_qualifies(plan, "none"))


def test_no_fit_error_names_the_layout_closest_to_fitting():
    """kimi-k2, bf16 weights, 8 x H200 (126.4 GiB usable each): nothing fits. Before, the error named
    DP8 (the whole model on each device: 1,914.1 GiB, 15.1x the usable memory). The closest is the
    layout with the smallest need per device over the usable memory: TP8 (every matrix and the
    vocabulary split 8 ways: 242.6 GiB, 1.92x). Checked against every candidate's own figure."""
    model, cluster = get_model("kimi-k2"), parse_cluster("8xH200")
    plan = search(model, cluster, "serve-latency", top=1, weight_dtypes="bf16")
    message = str(nothing_qualifies(plan, "none"))
    assert "the closest: TP8 " in message and "242.6 GiB > 126.4 GiB" in message
    ratios = []
    for layout in SERVE_LATENCY.candidates(model, cluster, weight_dtypes="bf16"):
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype="bf16", kv_dtype=layout.kv_dtype)
        mem = memory_from_facts(f, cluster.device.memory_bytes, batch=1, context=2304)
        ratios.append((mem.total_bytes / mem.budget_bytes, layout.short()))
    best = min(ratios)
    assert best[1] == "TP8" and best[0] == pytest.approx(242.6 / 126.4, abs=0.01)
    assert max(ratios)[0] == pytest.approx(1914.1 / 126.4, abs=0.01)


def test_pareto_and_disagg_size_experts_as_released_too():
    """The same rule (``served_expert_dtype``) in ``--pareto`` and ``serve-disagg``: before, both sized
    gpt-oss's experts in the weight dtype, so ``--pareto`` on 1 x H100 had no point at all and
    serve-disagg on 2 x H100 (one device a pool) found no unit that fits (217.6 GiB of bf16
    weights each). As released, each device holds the 60.77 GiB of the test above (bf16 weights)."""
    from modelcarve.plan.serve.disagg import decode_unit, prefill_unit
    from modelcarve.plan.serve.options import serve_options
    from modelcarve.plan.serve.pareto import pareto_front
    from modelcarve.spec.layout import Layout

    model = get_model("gpt-oss-120b")
    one, two = parse_cluster("1xH100"), parse_cluster("2xH100")
    front = pareto_front(model, one)
    assert front["points"] > 0 and front["front"]
    assert all(p["name"].endswith("(experts mxfp4)") for p in front["front"])
    assert pareto_front(model, one, weight_dtypes="bf16")["points"] == 0

    opts = serve_options()
    unit = Layout(tp=1, weight_dtype="bf16", kv_dtype="bf16")
    for phase in (prefill_unit, decode_unit):
        figures = phase(model, two, unit, opts)
        assert figures is not None and figures["weights_gib"] == pytest.approx(60.77, abs=0.01)
    plan = search(model, two, "serve-disagg", top=2)
    assert plan["layouts"]
    for result in plan["layouts"]:
        assert result["expert_dtype"] == "mxfp4" and result["name"].endswith("(experts mxfp4)")
    assert not search(model, two, "serve-disagg", top=1, weight_dtypes="bf16")["layouts"]
