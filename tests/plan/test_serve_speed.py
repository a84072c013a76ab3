"""The serving search's fast paths agree with the straightforward computation: the batch search
with trying every batch, the screening step with the full decode step, the decode GEMM
efficiency with ``plan.efficiency``, and the whole throughput plan with a plan made by costing
every candidate at every batch through the public ``serve_time``."""

import pytest

from modelcarve.plan.serve import goal as serve_goal
from modelcarve.plan.cost.efficiency import matmul_efficiency
from modelcarve.plan.search import search
from modelcarve.plan.serve.memory import max_sequences, shard_facts
from modelcarve.plan.cost.efficiency import TILE
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.rates import _decode_gemm_efficiency
from modelcarve.plan.serve.time import _rates, _stage_step, _step_slope, serve_time
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

CASES = [
    # model, cluster, input, output, ttft ms, tpot ms: dense and MoE, pipelines, EP across nodes,
    # compute-bound batches, a bound no batch meets and bounds every batch meets.
    ("qwen3-32b", "2x8xH100", 2048, 256, 2000, 50),
    ("mixtral-8x7b", "2x8xH100", 2048, 512, 2000, 30),
    ("llama-3.1-8b", "8xH100", 128, 2048, 5000, 12),
    ("deepseek-v3", "4x8xH200", 2048, 256, 2000, 50),
    ("llama-2-7b", "4xA100-40GB", 512, 512, 300, 20),
]


def _fitting(model, cluster, shape):
    goal = serve_goal.SERVE_THROUGHPUT
    for layout in goal.candidates(model, cluster, **shape):
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype)
        fit = min(max_sequences(f, cluster.device.memory_bytes, shape["input_len"] + shape["output_len"]), serve_goal.MAX_BATCH)
        if fit >= 1:
            yield layout, fit


def _scan(c, max_b, ttft_s, tpot_s):
    """The straightforward batch choice: every batch, the largest that meets both bounds (1 if none)."""
    best = 1
    for b in range(1, max_b + 1):
        _, tpot, ttft, _ = _rates(c, b)
        if tpot <= tpot_s and ttft <= ttft_s:
            best = b
    return best


@pytest.mark.parametrize("name,cluster,input_len,output_len,ttft_ms,tpot_ms", CASES)
def test_batch_search_equals_trying_every_batch(name, cluster, input_len, output_len, ttft_ms, tpot_ms):
    model, cl = get_model(name), parse_cluster(cluster)
    shape = {"input_len": input_len, "output_len": output_len}
    kinds = set()
    for layout, fit in _fitting(model, cl, shape):
        c = layout_costs(model, cl, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype, input_len, output_len)
        expected = _scan(c, fit, ttft_ms / 1e3, tpot_ms / 1e3)
        batch, rates = serve_goal._largest_batch(c, fit, ttft_ms / 1e3, tpot_ms / 1e3)
        assert (batch, rates) == (expected, _rates(c, expected)), layout
        kinds.add("max" if batch == fit else "one" if batch == 1 else "inside")
    assert "inside" in kinds  # the bounds bind between 1 and the memory limit somewhere


def test_step_slope_value_is_the_stage_step_exactly():
    for name, cluster, tp, pp, ep, dp, wd, kd in [
        ("qwen3-32b", "2x8xH100", 2, 2, 1, 4, "fp8", "fp8"),
        ("kimi-k2", "4x8xH200", 8, 2, 2, 2, "fp8", "bf16"),
        ("deepseek-v3", "128x8xH200", 1, 32, 16, 32, "int4", "fp8"),
        ("llama-2-7b", "4xA100-40GB", 1, 1, 1, 4, "fp8", "bf16"),
    ]:
        c = layout_costs(get_model(name), parse_cluster(cluster), tp, pp, ep, dp, wd, kd, 2048, 256)
        for b in list(range(1, 300)) + [511, 512, 513, 1024]:
            assert _step_slope(c, b)[0] == _stage_step(c, b)


@pytest.mark.parametrize("device_cluster,weight_dtype", [("H100", "fp8"), ("H200", "int4"), ("A100-40GB", "fp8"), ("MI300X", "int8"), ("H100", "bf16")])
def test_decode_gemm_efficiency_is_matmul_efficiency_exactly(device_cluster, weight_dtype):
    cluster = parse_cluster(f"8x{device_cluster}")
    for name, tp in [("qwen3-32b", 1), ("qwen3-32b", 8), ("deepseek-v3", 4)]:
        model = get_model(name)
        c = layout_costs(model, cluster, tp, 1, 1, 8 // tp, weight_dtype, "bf16", 2048, 256)
        for m in list(range(1, TILE, 3)) + list(range(TILE, 1100, 7)) + [2048, 4096, 8192]:  # decode rows, prefill chunks
            assert _decode_gemm_efficiency(c, m) == matmul_efficiency(c.device, m, c.n_gemm, model.hidden_size, c.compute_dtype)


@pytest.mark.parametrize("name,cluster,input_len,output_len,ttft_ms,tpot_ms", [CASES[0], CASES[2], CASES[4], ("mixtral-8x7b", "8xH100", 2048, 512, 2000, 30)])
def test_throughput_plan_equals_costing_every_batch(name, cluster, input_len, output_len, ttft_ms, tpot_ms):
    """The whole plan: the same winner, at the same batch, with the same figures (1e-9 relative)
    as costing every candidate at every batch through the public ``serve_time``."""
    model, cl = get_model(name), parse_cluster(cluster)
    shape = {"input_len": input_len, "output_len": output_len}
    plan = search(model, cl, "serve-throughput", top=3, ttft_ms=ttft_ms, tpot_ms=tpot_ms, **shape)
    costed = {}
    for layout, fit in _fitting(model, cl, shape):
        kw = dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.dp, weight_dtype=layout.weight_dtype,
                  kv_dtype=layout.kv_dtype, input_len=input_len, output_len=output_len)
        batch = 1
        for b in range(1, fit + 1):
            t = serve_time(model, cl, batch=b, **kw)
            if t.tpot_s <= tpot_ms / 1e3 and t.ttft_s <= ttft_ms / 1e3:
                batch = b
        t = serve_time(model, cl, batch=batch, **kw)
        if t.tpot_s > tpot_ms / 1e3 or t.ttft_s > ttft_ms / 1e3:
            continue
        rank = serve_goal._QUALITY_RANK[layout.weight_dtype]
        costed[serve_goal._name(layout)] = (t.tokens_per_s_per_device * (1 - 1e-9 * rank), t)
    top = max(score for score, _ in costed.values())
    # Exact ties (an MLA model's attention costs the same with a bf16 or an fp8 KV cache) may go
    # either way; anything else is the one winner.
    tied = {name for name, (score, _) in costed.items() if score == top}
    winner = plan["layouts"][0]
    assert winner["name"] in tied
    t = costed[winner["name"]][1]
    assert winner["serve"]["batch"] == t.batch
    for key, value in t.to_dict().items():
        if isinstance(value, float):
            assert winner["serve"][key] == pytest.approx(value, rel=1e-9, abs=0.0), key


def test_candidates_are_the_layouts_the_constructor_builds():
    """The enumeration copies one Layout per mesh into its dtype variants instead of constructing
    each: equal, equally hashed, and independent of one another."""
    from modelcarve.spec.layout import Layout

    model, cl = get_model("deepseek-v3"), parse_cluster("2x8xH200")
    shape = {"input_len": 1000, "output_len": 100, "weight_dtypes": "bf16,fp8,int8,int4"}  # wider than the floor
    seen = list(serve_goal.SERVE_THROUGHPUT.candidates(model, cl, **shape))
    assert len({(c.weight_dtype, c.kv_dtype) for c in seen}) == 8
    for c in seen:
        built = Layout(tp=c.tp, pp=c.pp, dp=c.dp, ep=c.ep, weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype, seq=1100)
        assert c == built and hash(c) == hash(built) and vars(c) == vars(built) and c.short() == built.short()
    assert len(set(seen)) == len(seen)


def test_layout_dict_is_to_dict():
    from modelcarve.spec.layout import Layout

    for layout in (Layout(), Layout(tp=2, pp=4, dp=8, ep=2, weight_dtype="int4", kv_dtype="fp8", seq=9000),
                   Layout.parse("tp=8,pp=4,dp=2,zero=1,mbs=1")):
        fast = serve_goal._layout_dict(layout)
        assert fast == layout.to_dict() and list(fast) == list(layout.to_dict())


def test_step_growth_bound_holds():
    """The bound the batch search uses to skip a band: where ``_step_slope`` promises growth, the
    next batch's step is at least that much larger."""
    promised = 0
    for name, cluster, tp, pp, ep, dp, wd, kd in [
        ("qwen3-32b", "2x8xH100", 1, 1, 1, 16, "int4", "bf16"),
        ("qwen3-32b", "2x8xH100", 2, 2, 1, 4, "fp8", "fp8"),
        ("kimi-k2", "4x8xH200", 8, 2, 2, 2, "fp8", "bf16"),
        ("deepseek-v3", "128x8xH200", 1, 32, 16, 32, "int4", "fp8"),
        ("llama-2-7b", "4xA100-40GB", 1, 1, 1, 4, "bf16", "bf16"),
    ]:
        c = layout_costs(get_model(name), parse_cluster(cluster), tp, pp, ep, dp, wd, kd, 2048, 256)
        for b in range(1, 1100):
            grows = _step_slope(c, b)[4]
            if grows >= 0:
                promised += 1
                assert _stage_step(c, b + 1) >= (_stage_step(c, b) + grows) * (1 - 1e-12), (name, b)
    assert promised > 1000


def test_context_and_facts_builders_set_every_field():
    """``layout_costs`` and ``_compute_facts`` fill their records without the dataclass constructor
    (for speed): a field added to either must be assigned there too."""
    import dataclasses

    from modelcarve.plan.serve.memory import ShardFacts
    from modelcarve.plan.serve.layout_costs import LayoutCosts

    c = layout_costs(get_model("kimi-k2"), parse_cluster("4x8xH200"), 8, 2, 2, 2, "fp8", "bf16", 2048, 256)
    for record, cls in ((c, LayoutCosts), (c.f, ShardFacts)):
        missing = [field.name for field in dataclasses.fields(cls) if not hasattr(record, field.name)]
        assert not missing, (cls.__name__, missing)
