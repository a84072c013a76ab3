"""The guard of the search-speed work: the search's answers equal those recorded before it.

Each case of tests/plan/search_golden_cases.py's ``SUITE`` (dense, FP8, MoE, fused loss, a
serving goal) is searched afresh and compared, exactly (every float to the last digit, through
JSON), with its golden file: the top 10 layouts' whole estimates, the counts evaluated and
rejected per reason, and the alternatives. Pruning or caching that changed any of it fails here.
The two frontier-scale searches (``FRONTIER``, about a second each here) are checked too: once
only benchmarks/plan_speed.py checked them, and a cost-model change that moved DeepSeek-V3's
answer went unrecorded until it was next run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from search_golden_cases import FRONTIER, SUITE, golden_path, run  # noqa: E402


@pytest.mark.parametrize("case", SUITE + FRONTIER, ids=[c[0] for c in SUITE + FRONTIER])
def test_search_reproduces_golden(case):
    from modelcarve.plan.train import goal as train_goal

    train_goal.GOAL._models.clear()  # a fresh cost model, as a new plan sees it
    expected = json.loads(golden_path(case).read_text())
    got = run(case)
    assert got["evaluated"] == expected["evaluated"]
    assert got["rejected"] == expected["rejected"]
    assert [row.get("short") for row in got["layouts"]] == [row.get("short") for row in expected["layouts"]]
    assert got["layouts"] == expected["layouts"]
    assert got["alternatives"] == expected["alternatives"]


class _Unswept:
    """The train goal without its ``sweep``: search.py then runs its own screening loop."""

    sweep = None

    def __init__(self, goal):
        self._goal = goal

    def __getattr__(self, name):
        return getattr(self._goal, name)


SWEEP_CASES = [
    ("llama-4-maverick", "8x8xH200", {"global_batch": 256, "seq": 4096}),  # interleaved MoE layers, virtual stages
    ("gemma-3-27b", "2x8xA100-80GB", {"global_batch": 128, "seq": 8192, "precision": "bf16"}),
    ("qwen3-30b-a3b", "2x8xH100", {"global_batch": 256, "seq": 4096, "precision": "fp8-cs"}),
    ("gpt3-175b", "16x8xA100-80GB", {"global_batch": 512, "seq": 2048, "loss": "chunked"}),
    ("deepseek-v2-lite", "1x8xH100", {"global_batch": 64, "seq": 4096}),
    ("deepseek-v2-lite-bf16-grads", "1x8xH100", {"global_batch": 64, "seq": 4096, "grad_dtype": "bf16"}),
]


@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c[0] for c in SWEEP_CASES])
def test_sweep_gives_the_screening_loops_answer(case, monkeypatch):
    """The train goal's sweep and search.py's candidate-by-candidate loop agree exactly (top 10,
    counts, alternatives), each from a fresh cost model."""
    from modelcarve.plan import goals
    from modelcarve.plan.search import search
    from modelcarve.plan.train import goal as train_goal
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster
    from search_golden_cases import answer

    model, cluster = get_model(case[0].removesuffix("-bf16-grads")), parse_cluster(case[1])
    train_goal.GOAL._models.clear()
    swept = json.loads(json.dumps(answer(search(model, cluster, "train", top=10, **case[2]))))
    train_goal.GOAL._models.clear()
    monkeypatch.setitem(goals.GOALS, "train", _Unswept(train_goal.GOAL))
    looped = json.loads(json.dumps(answer(search(model, cluster, "train", top=10, **case[2]))))
    assert swept["evaluated"] == looped["evaluated"] > 0
    assert swept == looped
