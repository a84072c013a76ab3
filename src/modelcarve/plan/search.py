"""The one search: enumerate a goal's candidates, screen them all, evaluate the best in full.

Usage::

    from modelcarve.plan.search import search
    result = search(model, cluster, "train", top=5, global_batch=1536, seq=2048)
    result["layouts"][0]["layout"]        # the winner, as Layout.to_dict()

Returns ``{"layouts": [...], "rejected": {category: count}, "evaluated": int,
"alternatives": [...], "elapsed_s": float}``: ``layouts`` are the ``top`` best fitting
candidates, best first, each the goal's estimate JSON with its ``"layout"``; ``rejected`` counts
the candidates dropped per reason; ``alternatives`` are, for goals with a ``family``
(candidate kinds such as "tensor parallelism across nodes"), the best of each kind with ``why``
it ranks below the winner (from the goal's ``compare``), then the best-scoring rejected
candidate of each reason, with its ``reject_reason`` in words.

Goals with a ``prepare`` (see goals.py) are screened with their cheap scorer and only the
finalists go through ``evaluate``; the others are evaluated in full. A goal with a
``sweep(model, cluster, top, **options)`` screens its whole space itself and returns what the
screening loop here would leave (``_screen_all``: the top heap, rejected counts, best rejected
per category, best per family, candidates evaluated), exactly: it is that loop, made faster by
the goal's knowledge of its space (the train goal's, plan/train/goal.py, says what it skips and why). A screen with an ``above``
(goals.py) is asked, once the top is full, to screen a candidate only if it can beat the
``top``-th score so far: it may answer None instead, for a candidate it proves would be accepted
with a score no higher (the search's answer is then the same as without asking; the candidate
counts as evaluated, since it was screened). ``nothing_qualifies`` words the one-line error
for a search without a winner. The helpers that factorise a device count over mesh axes are
plan/factors.py's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING, Any

from modelcarve.plan.factors import divisors, factorizations  # noqa: F401 - re-exported for the search's callers
from modelcarve.plan.goals import get_goal
from modelcarve.spec.errors import ModelcarveError

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec


# --- the search --------------------------------------------------------------------------------
def search(model: "ModelSpec", cluster: "ClusterSpec", goal_name: str, top: int = 5, **options) -> dict:
    """Rank every candidate of goal ``goal_name`` for ``model`` on ``cluster`` (see module doc)."""
    if top < 1:
        raise ModelcarveError(f"top={top} must be at least 1")
    goal = get_goal(goal_name)
    started = time.perf_counter()
    prepare = getattr(goal, "prepare", None)
    if prepare is not None:
        found = _screened(goal, prepare(model, cluster, **options), model, cluster, top, options)
    else:
        found = _full(goal, model, cluster, top, options)
    found["elapsed_s"] = time.perf_counter() - started
    return found


def _screened(goal, screen, model, cluster, top: int, options: dict) -> dict:
    sweep = getattr(goal, "sweep", None)
    if sweep is not None:
        best, rejected, best_rejected, best_family, evaluated = sweep(model, cluster, top, **options)
    else:
        best, rejected, best_rejected, best_family, evaluated = _screen_all(goal, screen, model, cluster, top, options)
    return _finalists(goal, model, cluster, options, best, rejected, best_rejected, best_family, evaluated)


def _screen_all(goal, screen, model, cluster, top: int, options: dict) -> tuple:
    """Screen every candidate: the top (a min-heap of ``(score, position, candidate)``), the
    rejected counts, the best rejected of each category and the best of each family."""
    best: list[tuple[float, int, Any]] = []  # min-heap of the top accepted
    rejected: dict[str, int] = {}
    best_rejected: dict[str, tuple[float, Any, str]] = {}
    family_of = getattr(goal, "family", None)
    best_family: dict[str, tuple[float, Any]] = {}
    evaluated = 0
    counter = itertools.count()
    # Pruning skips a candidate entirely, so only where nothing but the top reads accepted scores.
    above = getattr(screen, "above", None) if family_of is None else None
    for candidate in goal.candidates(model, cluster, **options):
        evaluated += 1
        if above is not None and len(best) == top:
            screened = above(candidate, best[0][0])
            if screened is None:  # accepted, and provably not above the top's last: no change
                continue
            score, category, reason = screened
        else:
            score, category, reason = screen(candidate)
        if category is None:
            item = (score, next(counter), candidate)
            if len(best) < top:
                heapq.heappush(best, item)
            elif score > best[0][0]:
                heapq.heapreplace(best, item)
            if family_of is not None:
                family = family_of(model, cluster, candidate)
                if family is not None:
                    held = best_family.get(family)
                    if held is None or score > held[0]:
                        best_family[family] = (score, candidate)
            continue
        rejected[category] = rejected.get(category, 0) + 1
        held = best_rejected.get(category)
        if held is None or score > held[0]:
            best_rejected[category] = (score, candidate, reason)
    return best, rejected, best_rejected, best_family, evaluated


def _finalists(goal, model, cluster, options: dict, best: list, rejected: dict, best_rejected: dict,
               best_family: dict, evaluated: int) -> dict:
    """The screened top evaluated in full, best first, and the alternatives (module doc)."""
    layouts = [goal.evaluate(model, cluster, c, **options) for _, _, c in best]
    layouts.sort(key=goal.score, reverse=True)
    alternatives = []
    compare = getattr(goal, "compare", None)
    in_top = {c for _, _, c in best}
    for family, (_, candidate) in sorted(best_family.items(), key=lambda kv: -kv[1][0]):
        if candidate in in_top or not layouts:
            continue
        result = goal.evaluate(model, cluster, candidate, **options)
        result["family"] = family
        result["why"] = compare(result, layouts[0]) if compare else None
        alternatives.append(result)
    for category, (_, candidate, reason) in sorted(best_rejected.items(), key=lambda kv: -kv[1][0]):
        result = goal.evaluate(model, cluster, candidate, **options)
        result["reject_category"] = category
        result["reject_reason"] = result.get("reject_reason") or reason
        result["why"] = result["reject_reason"]
        alternatives.append(result)
    return {"layouts": layouts, "rejected": rejected, "evaluated": evaluated, "alternatives": alternatives}


def _full(goal, model, cluster, top: int, options: dict) -> dict:
    accepted: list[dict] = []
    rejected: dict[str, int] = {}
    best_rejected: dict[str, dict] = {}
    evaluated = 0
    for candidate in goal.candidates(model, cluster, **options):
        evaluated += 1
        result = goal.evaluate(model, cluster, candidate, **options)
        reason = result.get("reject_reason")
        if result.get("fits") and not reason:
            accepted.append(result)
            continue
        category = result.get("reject_category") or reason or "rejected"
        rejected[category] = rejected.get(category, 0) + 1
        held = best_rejected.get(category)
        if held is None or goal.score(result) > goal.score(held):
            best_rejected[category] = result
    accepted.sort(key=goal.score, reverse=True)
    alternatives = sorted(best_rejected.values(), key=goal.score, reverse=True)
    return {"layouts": accepted[:top], "rejected": rejected, "evaluated": evaluated, "alternatives": alternatives}


def nothing_qualifies(result: dict, headline: str) -> ModelcarveError:
    """The one-line error for a search with no winner: counts per reason and the closest miss."""
    reasons = "; ".join(f"{n} x {r}" for r, n in sorted(result["rejected"].items(), key=lambda kv: -kv[1]))
    closest = result["alternatives"][0].get("reject_reason") if result["alternatives"] else None
    return ModelcarveError(
        f"{headline} ({result['evaluated']} evaluated" + (f": {reasons})" if reasons else ")")
        + (f"; the closest: {closest}" if closest else "")
    )
