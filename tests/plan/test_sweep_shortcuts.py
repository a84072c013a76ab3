"""The exact shortcuts of the train goal's sweep (plan/train/goal.py ``TrainGoal.sweep``), each
checked on its own: the pieces it reads instead of the full screen profile give the same
numbers, and the recomputation bound it relies on holds. The sweep's answer as a whole is checked
against search.py's loop in test_search_golden.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from modelcarve.plan.train.goal import GOAL, layout_blocks
from modelcarve.plan.train.layer import layer_base, layer_cost
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

sys.path.insert(0, str(Path(__file__).parent))

CASES = [
    ("deepseek-v2-lite", "1x8xH100", 64, 4096, "bf16"),
    ("llama-4-maverick", "8x8xH200", 256, 4096, "bf16"),  # interleaved MoE layers, virtual stages
    ("qwen3-30b-a3b", "2x8xH100", 256, 4096, "fp8cs"),
    ("gpt3-175b", "16x8xA100-80GB", 512, 2048, "bf16"),
]


def _blocks(case, every: int = 7):
    name, cluster, gbs, seq, dtype = case
    model, cl = get_model(name), parse_cluster(cluster)
    cost = TrainCostModel(model, cl, TrainOptions(global_batch=gbs, seq=seq))
    blocks = list(layout_blocks(model, cl, gbs, seq))
    return cost, dtype, blocks[::every]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_screen_rows_are_the_screen_profiles_rows(case):
    cost, dtype, blocks = _blocks(case)
    for tp, cp, pp, dp, mbs, ep, etp, sp, rc, _zeros, scheds in blocks:
        for _sched, v in scheds:
            rows = cost.screen_rows(tp, cp, pp, ep, mbs, sp, rc, cost.seq, dtype, etp, v)
            assert rows == cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq, dtype, etp, v)[1]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shared_memory_in_flight_is_each_blocks_own(case):
    """The sweep's ``_memory`` shares the per-stage memory in flight between blocks whose rows it
    proves equal (same tokens per micro-batch, tp, sp, recompute, dtype, expert TP and stage
    holdings, any cp, mbs and ep): each block's shared lists equal its own screen rows' ``_grown``."""
    from modelcarve.plan.train.space import _grown
    from modelcarve.plan.train.blocks import _memory, _plan

    cost, dtype, blocks = _blocks(case, every=1)
    shared: dict = {}
    specs_of: dict = {}
    hits = 0
    own_rows = cost.screen_rows
    built = []  # _memory builds a list from the block's own rows, or takes a shared one: count the builds
    cost.screen_rows = lambda *a: built.append(a) or own_rows(*a)
    for tp, cp, pp, dp, mbs, ep, etp, sp, rc, _zeros, scheds in blocks:
        specs = specs_of.setdefault(id(scheds), (scheds, [(sched, v, dtype, "delayed", (v, 0)) for sched, v in scheds]))[1]
        n_mb = cost.options.global_batch // (mbs * dp)
        for vj in dict.fromkeys(spec[4] for spec in specs):
            v = vj[0]
            n_built = len(built)
            memory = _memory(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype, etp, v, n_mb, cost._growth)
            hits += len(built) == n_built
            rows = own_rows(tp, cp, pp, ep, mbs, sp, rc, cost.seq, dtype, etp, v)
            own = [(_grown(rows, sched, pp, n_mb, kv, cost._growth), count) for _k, sched, kv, _ks, count in _plan(specs, vj)]
            assert memory == own
    assert hits  # the sharing is exercised


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_shared_layer_base_gives_the_same_layer(case):
    cost, dtype, blocks = _blocks(case, every=29)
    cost._dtype = dtype
    for tp, cp, _pp, _dp, mbs, ep, etp, sp, _rc, _zeros, _scheds in blocks:
        for moe in (False, True) if cost.model.is_moe else (False,):
            base = layer_base(cost, moe, tp, cp, ep, mbs, sp, cost.seq, etp)
            for rc in ("none", "selective", "full", "ops"):
                fresh = TrainCostModel(cost.model, cost.cluster, cost.options)
                fresh._dtype = dtype
                assert layer_cost(cost, moe, tp, cp, ep, mbs, sp, rc, cost.seq, etp, base) == layer_cost(
                    fresh, moe, tp, cp, ep, mbs, sp, rc, cost.seq, etp)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recomputation_never_raises_the_tokens_per_s_bound(case):
    """What the sweep's recomputation shortcut relies on: for the same rest of a layout, the bound
    ``tokens / step_base`` with recompute selective or full is at most the one without."""
    cost, dtype, blocks = _blocks(case, every=3)
    for tp, cp, pp, dp, mbs, ep, etp, sp, rc, _zeros, scheds in blocks:
        if rc != "none":
            continue
        for sched, v in scheds:
            def bound(mode):
                t_mb, _rows, _buf, p2p_s, n_mb, tokens = cost.screen_profile(
                    tp, cp, pp, dp, ep, mbs, sp, mode, cost.seq, dtype, etp, v)[:6]
                return tokens / cost.step_base(t_mb, p2p_s, sched, pp, n_mb, v)[3]

            top = bound("none")
            assert bound("selective") <= top and bound("full") <= top


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sequence_parallelism_never_lowers_the_tokens_per_s_bound(case):
    """What the sweep's sequence-parallel shortcut relies on: for the same rest of a recompute="none"
    layout, the bound ``tokens / step_base`` without SP is at most the one with it; and the buffers
    it reads alone (``screen_buffers``) are the screen profile's."""
    cost, dtype, blocks = _blocks(case, every=1)
    checked = 0
    for tp, cp, pp, dp, mbs, ep, etp, sp, _rc, _zeros, scheds in blocks[::3]:  # each taken as recompute="none"
        if sp or tp == 1 or cost.seq % tp:
            continue
        for sched, v in scheds:
            def bound(with_sp):
                lean = cost.screen_profile(tp, cp, pp, dp, ep, mbs, with_sp, "none", cost.seq, dtype, etp, v)
                t_mb, _rows, buffers, p2p_s, n_mb, tokens = lean[:6]
                assert buffers == cost.screen_buffers(mbs * cost.seq / cp, tp, pp, ep, with_sp, cp, etp)[1]
                return tokens / cost.step_base(t_mb, p2p_s, sched, pp, n_mb, v)[3]

            assert bound(False) <= bound(True)
            checked += 1
    assert checked


@pytest.mark.parametrize("top", [1, 3])
def test_sweep_with_a_short_top_gives_the_loops_answer(top, monkeypatch):
    """A short top leaves fewer settings quiet: more of them take the exact way."""
    from modelcarve.plan import goals
    from modelcarve.plan.search import search
    from search_golden_cases import answer
    from test_search_golden import _Unswept

    model, cluster = get_model("deepseek-v2-lite"), parse_cluster("2x8xH100")
    options = {"global_batch": 128, "seq": 4096}
    GOAL._models.clear()
    swept = json.loads(json.dumps(answer(search(model, cluster, "train", top=top, **options))))
    GOAL._models.clear()
    monkeypatch.setitem(goals.GOALS, "train", _Unswept(GOAL))
    looped = json.loads(json.dumps(answer(search(model, cluster, "train", top=top, **options))))
    assert swept == looped and swept["evaluated"] > 0
