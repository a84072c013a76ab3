"""The serving goals through the one search: the deployment questions of the seed essay, answered
by computed plans (quantisation removes the need to split; TP stays inside a node; a trillion-
parameter MoE needs two nodes and says what crossing costs)."""

import pytest

from modelcarve.plan.goals import get_goal
from modelcarve.plan.search import search
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import cluster_from_dict, parse_cluster
from modelcarve.spec.layout import Layout

ETH_2NODES = {"nodes": 2, "devices_per_node": 8, "device": "H100", "inter_link": "eth-100g", "nics_per_node": 1}
SHAPE = {"input_len": 2048, "output_len": 256}


@pytest.fixture(scope="module")
def qwen():
    return get_model("qwen3-32b")


def test_goals_are_registered():
    for name in ("serve-latency", "serve-throughput"):
        goal = get_goal(name)
        assert goal.name == name


@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_quantised_qwen3_32b_fits_one_h100_without_parallelism(qwen, dtype):
    plan = search(qwen, parse_cluster("H100"), "serve-latency", top=3, weight_dtypes=dtype, **SHAPE)
    best = plan["layouts"][0]
    assert best["fits"] and best["reject_reason"] is None
    layout = best["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["ep"]) == (1, 1, 1, 1)
    assert layout["weight_dtype"] == dtype
    assert best["memory"]["total_gib"] <= best["memory"]["budget_gib"]
    assert best["quality"].startswith(f"weights {dtype}")


def test_bf16_long_context_needs_two_devices_and_the_plan_says_so(qwen):
    shape = {"input_len": 126976, "output_len": 4096}  # 128k context (Qwen3 with YaRN)
    alone = search(qwen, parse_cluster("H100"), "serve-latency", weight_dtypes="bf16", **shape)
    assert alone["layouts"] == []
    assert sum(alone["rejected"].values()) == alone["evaluated"] > 0
    reason = alone["alternatives"][0]["reject_reason"]
    assert "> 72.0 GiB usable" in reason and "need at least 2 x H100" in reason

    pair = search(qwen, parse_cluster("2xH100"), "serve-latency", weight_dtypes="bf16", **shape)
    best = pair["layouts"][0]
    assert best["layout"]["tp"] * best["layout"]["pp"] == 2
    assert any("one model copy spans 2 devices (TP x PP x EP) because one H100 would need" in w for w in best["warnings"])
    assert any("exceeds qwen3-32b's trained 40960" in w for w in best["warnings"])


def test_tp_across_100gbe_ranks_below_tp_inside_a_node(qwen):
    cluster = cluster_from_dict(ETH_2NODES)
    goal = get_goal("serve-latency")
    opts = dict(weight_dtypes="fp8", kv_dtypes="fp8", **SHAPE)
    inside = goal.evaluate(qwen, cluster, Layout(tp=8, dp=2, weight_dtype="fp8", kv_dtype="fp8"), **opts)
    across = goal.evaluate(qwen, cluster, Layout(tp=16, weight_dtype="fp8", kv_dtype="fp8"), **opts)
    assert goal.score(inside) > goal.score(across)
    assert across["crosses_nodes"] == ["tp"] and inside["crosses_nodes"] == []
    assert any("TP=16 spans nodes" in w and "eth-100g" in w for w in across["warnings"])

    latency = search(qwen, cluster, "serve-latency", top=50, **opts)
    best = latency["layouts"][0]
    assert best["layout"]["tp"] <= 8 and "tp" not in best["crosses_nodes"]
    names = [r["name"] for r in latency["layouts"]]
    assert names.index(inside["name"]) < names.index(across["name"])

    throughput = search(qwen, cluster, "serve-throughput", top=5, ttft_ms=2000, tpot_ms=50, **opts)
    tbest = throughput["layouts"][0]
    # Throughput buys replicas (or stages), not the lowest-latency TP group.
    assert tbest["layout"]["dp"] > best["layout"]["dp"] or tbest["layout"]["pp"] > 1
    assert tbest["serve"]["tokens_per_s_per_device"] > 3 * best["serve"]["tokens_per_s_per_device"]
    assert tbest["serve"]["tpot_s"] <= 0.050 and tbest["serve"]["ttft_s"] <= 2.0
    assert "tp" not in tbest["crosses_nodes"]


def test_kimi_k2_fp8_needs_two_h200_nodes_and_names_the_crossing_axis():
    """128k-token requests (Moonshot's deployment guide: 16 H200 for fp8 at 128k), two in flight."""
    model = get_model("kimi-k2")
    shape = {"input_len": 126976, "output_len": 4096, "weight_dtypes": "fp8", "batch": 2}
    one_node = search(model, parse_cluster("8xH200"), "serve-latency", **shape)
    assert one_node["layouts"] == []
    assert set(one_node["rejected"]) == {"does not fit in memory"}

    two_nodes = search(model, parse_cluster("2x8xH200"), "serve-latency", top=3, **shape)
    best = two_nodes["layouts"][0]
    assert best["fits"] and best["crosses_nodes"]
    axis = best["crosses_nodes"][0]
    cost = best["comm"][axis]
    assert cost["tier"] == "inter" and cost["s_per_round"] > 0
    assert any("cross" in w or "spans nodes" in w for w in best["warnings"])

    # At batch 1 one node holds it only with pipeline stages and under 1 GiB to spare.
    single = search(model, parse_cluster("8xH200"), "serve-latency", top=20, **dict(shape, batch=1))
    for layout in single["layouts"]:
        assert layout["layout"]["pp"] > 1
        assert layout["memory"]["budget_gib"] - layout["memory"]["total_gib"] < 1.0


def test_throughput_goal_respects_both_bounds_and_chooses_the_batch(qwen):
    cluster = parse_cluster("8xH100")
    plan = search(qwen, cluster, "serve-throughput", top=5, ttft_ms=2000, tpot_ms=30, **SHAPE)
    assert plan["layouts"]
    for result in plan["layouts"]:
        serve = result["serve"]
        assert serve["tpot_s"] <= 0.030 and serve["ttft_s"] <= 2.0
        assert serve["batch"] >= 1
        # batch / TPOT per device, less the sequence's own prefill (not in a user's TPOT).
        upper = serve["batch"] / serve["tpot_s"] / (result["layout"]["tp"] * result["layout"]["pp"])
        assert 0.9 * upper < serve["tokens_per_s_per_device"] <= upper
    # A tighter TPOT bound admits a smaller batch on the same layout.
    goal = get_goal("serve-throughput")
    layout = Layout(tp=2, dp=4, weight_dtype="fp8", kv_dtype="fp8")
    loose = goal.evaluate(qwen, cluster, layout, tpot_ms=50, **SHAPE)["serve"]["batch"]
    tight = goal.evaluate(qwen, cluster, layout, tpot_ms=20, **SHAPE)["serve"]["batch"]
    assert tight < loose


def test_impossible_bounds_are_rejected_in_words(qwen):
    plan = search(qwen, parse_cluster("8xH100"), "serve-latency", ttft_ms=1, **SHAPE)
    assert plan["layouts"] == []
    assert "TTFT above the bound" in plan["rejected"]
    assert "exceeds 1 ms" in plan["alternatives"][0]["reject_reason"]


def test_estimate_of_an_invalid_layout_says_why(qwen):
    goal = get_goal("serve-latency")
    result = goal.evaluate(qwen, parse_cluster("8xH100"), Layout(tp=3, dp=2), **SHAPE)
    assert not result["fits"]
    assert "tp=3" in result["reject_reason"]


def test_result_json_shape(qwen):
    plan = search(qwen, parse_cluster("2xH100"), "serve-throughput", top=2, **SHAPE)
    assert set(plan) >= {"layouts", "rejected", "evaluated"}
    result = plan["layouts"][0]
    assert set(result) >= {"layout", "fits", "memory", "serve", "comm", "warnings"}
    assert set(result["serve"]) >= {"ttft_s", "tpot_s", "batch", "tokens_per_s", "tokens_per_s_per_device"}


@pytest.mark.parametrize(
    "name,cluster,layout,tpot_ms,ttft_ms",
    [
        ("qwen3-32b", "8xH100", Layout(tp=2, dp=4, weight_dtype="fp8", kv_dtype="fp8"), 20, 2000),
        ("llama-3.1-70b", "8xH100", Layout(tp=4, pp=2, weight_dtype="int4"), 60, 800),
        ("kimi-k2", "2x8xH200", Layout(tp=8, dp=2, ep=2, weight_dtype="fp8", kv_dtype="fp8"), 40, 3000),
    ],
)
def test_batch_search_finds_the_largest_admissible_batch(name, cluster, layout, tpot_ms, ttft_ms):
    """The bracketed search agrees with trying every batch."""
    from modelcarve.plan.serve.goal import _largest_batch
    from modelcarve.plan.serve.memory import max_sequences, shard_facts
    from modelcarve.plan.serve.layout_costs import layout_costs
    from modelcarve.plan.serve.time import _rates

    model, cl = get_model(name), parse_cluster(cluster)
    f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype)
    top = min(max_sequences(f, cl.device.memory_bytes, 2048 + 256), 1024)
    c = layout_costs(model, cl, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype, 2048, 256)

    def meets(b):
        _, tpot, ttft, _ = _rates(c, b)
        return tpot <= tpot_ms / 1e3 and ttft <= ttft_ms / 1e3

    expected = max([b for b in range(1, top + 1) if meets(b)], default=1)
    assert 1 < expected < top  # the bounds bind somewhere inside the range
    batch, rates = _largest_batch(c, top, ttft_ms / 1e3, tpot_ms / 1e3)
    assert batch == expected and rates == _rates(c, expected)


def test_contrasts_explain_in_words_why_tp_stays_inside_the_node(qwen):
    from modelcarve.plan.serve.why import contrasts

    cluster = cluster_from_dict(ETH_2NODES)
    plan = search(qwen, cluster, "serve-latency", top=1, **SHAPE)
    why = {item["shape"]: item for item in contrasts(qwen, cluster, "serve-latency", plan["layouts"][0], **SHAPE)}
    across = why["TP across nodes"]
    assert "slower" in across["verdict"] and "eth-100g" in across["why"] and "all-reduces" in across["why"]
    assert "GB of weights per step" in why["replicas only"]["why"]


@pytest.mark.parametrize(
    "name,cluster,goal,options",
    [
        ("qwen3-32b", ETH_2NODES, "serve-latency", {"input_len": 40000}),
        ("qwen3-32b", ETH_2NODES, "serve-latency", {"ttft_ms": 60, "batch": 4}),
        ("qwen3-32b", ETH_2NODES, "serve-throughput", {"ttft_ms": 2000, "tpot_ms": 15}),
        ("mixtral-8x7b", "2x8xH100", "serve-throughput", {"tpot_ms": 30}),
    ],
)
def test_screen_agrees_with_full_evaluation(name, cluster, goal, options):
    """The search's fast scorer and the full estimate agree on every candidate: same verdict,
    same rejection category, same score."""
    from modelcarve.plan.goals import get_goal

    model = get_model(name)
    cl = cluster_from_dict(cluster) if isinstance(cluster, dict) else parse_cluster(cluster)
    g = get_goal(goal)
    opts = dict(SHAPE, **options)
    screen = g.prepare(model, cl, **opts)
    verdicts = set()
    for layout in g.candidates(model, cl, **opts):
        score, category, _ = screen(layout)
        result = g.evaluate(model, cl, layout, **opts)
        assert category == result.get("reject_category"), (layout.short(), category, result.get("reject_reason"))
        if category is None:
            assert result["fits"] and result["reject_reason"] is None
            assert score == pytest.approx(g.score(result), rel=1e-9)
        verdicts.add(category)
    assert None in verdicts and len(verdicts) > 1  # both accepted and rejected candidates were compared
