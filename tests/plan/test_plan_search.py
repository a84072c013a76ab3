"""Bubble fractions, the factorisation helpers and the generic search, with a goal of our own."""

import math

import pytest

from modelcarve.plan import goals
from modelcarve.plan.cost.schedule import bubble_fraction
from modelcarve.plan.search import divisors, factorizations, search
from modelcarve.plan.train.goal import enumerate_layouts, candidate_layout
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster


@pytest.mark.parametrize("p,m", [(2, 1), (4, 8), (8, 64), (64, 512)])
def test_bubble_fractions(p, m):
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
    # interleaving divides the bubble time by v (Narayanan et al. 2021, Sec. 2.2.2)
    assert bubble_fraction("interleaved-1f1b", p, m, v=4) == pytest.approx(((p - 1) / 4) / (m + (p - 1) / 4))
    # ZB-H1 keeps a third of 1F1B's bubble
    assert bubble_fraction("zero-bubble", p, m) == pytest.approx(((p - 1) / 3) / (m + (p - 1) / 3))
    assert bubble_fraction("1f1b", 1, m) == 0.0


def test_divisors_and_factorizations():
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    triples = list(factorizations(12, 3))
    assert all(math.prod(t) == 12 for t in triples)
    assert len(set(triples)) == len(triples) == 18  # 2^2 over 3 axes: C(4,2) = 6 ways, 3 over 3 axes: 3 ways
    restricted = list(factorizations(64, 2, allowed=[[1, 2, 4, 8]]))
    assert restricted == [(1, 64), (2, 32), (4, 16), (8, 8)]


class _Knapsack:
    """A goal of our own: candidates are integers, 'fits' below a limit, score = value."""

    name = "test-knapsack"
    description = "test goal"

    def candidates(self, model, cluster, limit=10, **_):
        return range(20)

    def evaluate(self, model, cluster, candidate, limit=10, **_):
        fits = candidate < limit
        return {"layout": candidate, "short": str(candidate), "fits": fits, "warnings": [],
                "reject_reason": None if fits else f"{candidate} >= {limit}", "value": candidate}

    def score(self, result):
        return result["value"]


def test_search_ranks_a_goal_without_a_screen():
    goals.register(_Knapsack())
    try:
        result = search(None, None, "test-knapsack", top=3, limit=10)
    finally:
        goals.GOALS.pop("test-knapsack")
    assert [r["layout"] for r in result["layouts"]] == [9, 8, 7]
    assert result["evaluated"] == 20
    assert sum(result["rejected"].values()) == 10


def test_train_candidates_are_valid_unique_layouts():
    model, cluster = get_model("tiny-moe"), parse_cluster("2x4xH100")
    cands = list(enumerate_layouts(model, cluster, global_batch=16, seq=512))
    assert len(cands) == len(set(cands)) > 100
    for cand in cands:
        candidate_layout(cand, 16, 512).validate(model, cluster)
    axes = {(c[0], c[1], c[2], c[3], c[4]) for c in cands}
    assert (2, 1, 2, 2, 2) in axes  # tp=2 cp=1 pp=2 dp=2 ep=2
    assert {c[10] for c in cands} >= {"1f1b", "gpipe", "zero-bubble", "interleaved-1f1b"}
    assert {c[8] for c in cands} == {0, 1, 2, 3}


def test_every_builtin_goal_is_found_even_after_one_goal_module_was_imported():
    import modelcarve.plan.train.goal  # noqa: F401  registers "train" on import

    names = goals.goal_names()
    assert "train" in names
    assert {"serve-latency", "serve-throughput"} <= set(names)
