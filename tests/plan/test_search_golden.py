"""The guard of the search-speed work: the search's answers equal those recorded before it.

Each case of tests/plan/search_golden_cases.py's ``SUITE`` (dense, FP8, MoE, fused loss, a
serving goal) is searched afresh and compared, exactly (every float to the last digit, through
JSON), with its golden file: the top 10 layouts' whole estimates, the counts evaluated and
rejected per reason, and the alternatives. Pruning or caching that changed any of it fails here.
The two frontier-scale searches are checked by benchmarks/plan_speed.py against their golden files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from search_golden_cases import SUITE, golden_path, run  # noqa: E402


@pytest.mark.parametrize("case", SUITE, ids=[c[0] for c in SUITE])
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
