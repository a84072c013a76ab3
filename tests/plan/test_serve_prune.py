"""Pruning in the search (``screen.above``, search.py; plan/serve/prune.py): the throughput
screen's ceiling is an upper bound on every candidate's score, a pruned search returns exactly
what an unpruned one returns, and the search's hook leaves goals that do not prune (training) as
they were."""

import json

import pytest

from modelcarve.plan import goals
from modelcarve.plan.serve import goal as serve_goal
from modelcarve.plan.search import search
from modelcarve.plan.serve.goal import _largest_batch
from modelcarve.plan.serve.prune import group_ceiling
from modelcarve.plan.serve.memory import max_sequences, shard_facts
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.time import _ensure_prefill, _rates
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

CASES = [
    # model, cluster, input, output, ttft ms, tpot ms: dense and MoE (EP inside and across nodes),
    # pipelines, compute-bound batches, bounds that bind, bounds no batch meets, no bounds.
    ("qwen3-32b", "2x8xH100", 2048, 256, 2000, 50),
    ("mixtral-8x7b", "2x8xH100", 2048, 512, 2000, 30),
    ("llama-3.1-8b", "8xH100", 128, 2048, 5000, 12),
    ("deepseek-v3", "4x8xH200", 2048, 256, 2000, 50),
    ("kimi-k2", "16x8xH200", 8192, 1024, 2000, 50),
    ("llama-2-7b", "4xA100-40GB", 512, 512, 300, 20),
    ("qwen3-32b", "8xH100", 1000, 1000, None, None),
]


def _bounds(ttft_ms, tpot_ms):
    inf = float("inf")
    return (ttft_ms / 1e3 if ttft_ms else inf), (tpot_ms / 1e3 if tpot_ms else inf)


@pytest.mark.parametrize("name,cluster,input_len,output_len,ttft_ms,tpot_ms", CASES)
def test_ceiling_bounds_every_admissible_batch(name, cluster, input_len, output_len, ttft_ms, tpot_ms):
    """For every candidate that fits: the ceiling is at least the tokens/s of the batch the search
    picks and of every batch (one in five, and the last) that meets both bounds."""
    model, cl = get_model(name), parse_cluster(cluster)
    ttft_s, tpot_s = _bounds(ttft_ms, tpot_ms)
    checked = 0
    for layout in serve_goal.SERVE_THROUGHPUT.candidates(model, cl, input_len=input_len, output_len=output_len):
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                        weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype)
        fit = min(max_sequences(f, cl.device.memory_bytes, input_len + output_len), serve_goal.MAX_BATCH)
        if fit < 1:
            continue
        c = layout_costs(model, cl, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype,
                     input_len, output_len)
        _ensure_prefill(c)
        ceiling = group_ceiling(c, fit, ttft_s, tpot_s)
        batch, (_, _, _, group) = _largest_batch(c, fit, ttft_s, tpot_s)
        assert group <= ceiling, (layout, batch)
        for b in sorted(set(range(1, fit + 1, 5)) | {fit}):
            _, tpot, ttft, group = _rates(c, b)
            if b == 1 or (tpot <= tpot_s and ttft <= ttft_s):
                assert group <= ceiling, (layout, b)
                checked += 1
        # Without bounds, the ceiling bounds every batch the memory allows.
        assert _rates(c, fit)[3] <= group_ceiling(c, fit, float("inf"), float("inf")), layout
    assert checked > 50


@pytest.mark.parametrize(
    "name,cluster,input_len,output_len,ttft_ms,tpot_ms", CASES + [("llama-3.1-405b", "16x8xH100", 2048, 256, 2000, 50)]
)
def test_pruning_answers_agree_with_the_screen_on_every_candidate(
    name, cluster, input_len, output_len, ttft_ms, tpot_ms
):
    """With no floor at all (inf) the pruning path decides every candidate it can: None only for
    one the screen accepts, and otherwise exactly the screen's answer (batch-1 TPOT rejections)."""
    model, cl = get_model(name), parse_cluster(cluster)
    opts = dict(input_len=input_len, output_len=output_len, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    screen = serve_goal.SERVE_THROUGHPUT.prepare(model, cl, **opts)
    kinds = set()
    for layout in serve_goal.SERVE_THROUGHPUT.candidates(model, cl, **opts):
        answer, full = screen.above(layout, float("inf")), screen(layout)
        if answer is None:
            assert full[1] is None, layout
            kinds.add("pruned")
        else:
            assert answer == full, layout
            kinds.add(full[1])
    assert "pruned" in kinds


def _unpruned(monkeypatch, goal):
    """Make ``goal`` screen without ``above`` (the search then never prunes)."""
    prepare = goal.prepare

    def plain(*args, **kwargs):
        screen = prepare(*args, **kwargs)
        return lambda candidate: screen(candidate)

    monkeypatch.setattr(goal, "prepare", plain)


@pytest.mark.parametrize(
    "name,cluster,input_len,output_len,ttft_ms,tpot_ms,top",
    [case + (5,) for case in CASES]
    + [("deepseek-v3", "32x8xH200", 4096, 1024, 2000, 50, 3), ("qwen3-32b", "2x8xH100", 2048, 256, 2000, 15, 1),
       ("llama-3.1-405b", "16x8xH100", 2048, 256, 2000, 50, 5)],
)
def test_pruned_search_returns_what_the_unpruned_search_returns(
    monkeypatch, name, cluster, input_len, output_len, ttft_ms, tpot_ms, top
):
    model, cl = get_model(name), parse_cluster(cluster)
    goal = serve_goal.SERVE_THROUGHPUT
    opts = dict(input_len=input_len, output_len=output_len, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    screen = goal.prepare(model, cl, **opts)
    pruned = [0]

    def counting(candidate, floor):
        answer = screen.above(candidate, floor)
        pruned[0] += answer is None
        return answer

    fast = search(model, cl, "serve-throughput", top=top, **opts)
    with monkeypatch.context() as m:
        counted_screen = lambda candidate: screen(candidate)  # noqa: E731
        counted_screen.above = counting
        m.setattr(goal, "prepare", lambda *a, **k: counted_screen)
        counted = search(model, cl, "serve-throughput", top=top, **opts)
    _unpruned(monkeypatch, goal)
    slow = search(model, cl, "serve-throughput", top=top, **opts)
    for result in (fast, counted, slow):
        result.pop("elapsed_s")
    assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True) == json.dumps(counted, sort_keys=True)
    if fast["layouts"] and fast["evaluated"] > 100:
        assert pruned[0] > 0  # the comparison is not vacuous where there are enough candidates


def test_latency_and_fixed_batch_screens_do_not_prune():
    model, cl = get_model("qwen3-32b"), parse_cluster("8xH100")
    assert not hasattr(serve_goal.SERVE_LATENCY.prepare(model, cl), "above")
    assert not hasattr(serve_goal.SERVE_THROUGHPUT.prepare(model, cl, batch=8), "above")
    assert hasattr(serve_goal.SERVE_THROUGHPUT.prepare(model, cl), "above")


class _Pruning:
    """A goal of our own whose screen prunes: candidates 0..29, score = value, odd ones rejected."""

    name = "test-pruning"
    description = "test goal"

    def __init__(self, prune: bool):
        self.prune = prune
        self.asked: list[tuple[int, float]] = []

    def candidates(self, model, cluster, **_):
        return [7, 3, 12, 0, 28, 5, 16, 9, 22, 2, 14, 26, 1, 20, 11, 18, 4, 24, 6, 10, 8]

    def prepare(self, model, cluster, **_):
        def screen(candidate):
            if candidate % 2:
                return float(candidate), "odd", f"{candidate} is odd"
            return float(candidate), None, None

        def above(candidate, floor):
            self.asked.append((candidate, floor))
            if candidate % 2 == 0 and candidate <= floor:  # ceiling = the value itself
                return None
            return screen(candidate)

        if self.prune:
            screen.above = above
        return screen

    def evaluate(self, model, cluster, candidate, **_):
        fits = candidate % 2 == 0
        return {"layout": candidate, "fits": fits, "warnings": [], "value": candidate,
                "reject_reason": None if fits else f"{candidate} is odd", "reject_category": None if fits else "odd"}

    def score(self, result):
        return result["value"]


def test_search_prunes_only_once_the_top_is_full_and_answers_the_same():
    answers = []
    for prune in (False, True):
        goal = goals.register(_Pruning(prune))
        try:
            found = search(None, None, "test-pruning", top=3)
        finally:
            goals.GOALS.pop("test-pruning")
        found.pop("elapsed_s")
        answers.append(found)
        if prune:
            # Asked once three candidates are accepted (7, 3 rejected; 12, 0, 28), with the
            # third-best score so far.
            assert goal.asked[0] == (5, 0.0) and len(goal.asked) == 21 - 5
            assert (14, 16.0) in goal.asked
    assert answers[0] == answers[1]
    assert [r["layout"] for r in answers[1]["layouts"]] == [28, 26, 24]
    assert answers[1]["evaluated"] == 21 and answers[1]["rejected"] == {"odd": 6}
