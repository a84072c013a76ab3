"""The goal registry: what a plan optimises, behind one protocol the single search reads.

Usage::

    from modelcarve.plan.goals import get_goal, GOALS
    goal = get_goal("train")
    result = goal.evaluate(model, cluster, Layout.parse("tp=8,pp=8,dp=24"), global_batch=2304, seq=2048)

A goal is any object with

* ``name: str`` and ``description: str``;
* ``candidates(model, cluster, **options) -> Iterable[candidate]``: every layout worth scoring
  (a candidate is whatever the goal's ``evaluate`` accepts; a ``Layout`` always works);
* ``evaluate(model, cluster, candidate, **options) -> dict``: that goal's estimate JSON, always
  with ``"fits": bool``, ``"warnings": [str]`` and ``"reject_reason": str | None`` (in words);
* ``score(result) -> float``: higher is better (e.g. tokens/s).

Optionally, for speed, ``prepare(model, cluster, **options) -> screen`` where
``screen(candidate) -> (score, reject_category, reject_reason)``: a cheap scorer without the
JSON, which the search runs over every candidate before it evaluates the best few in full.
``reject_category`` is a short stable phrase the search counts (``"does not fit in memory"``);
``reject_reason`` is the sentence about this candidate. Both are None when it is accepted.
A screen may carry ``screen.above(candidate, floor)``: the same answer as ``screen(candidate)``,
or None when the candidate would certainly be accepted with a score ``<= floor`` (a proven upper
bound, cheaper than the score). The search asks it once its top is full, with the top's lowest
score, for goals without a ``family`` (a pruned candidate's score is never seen).

The built-in goals are listed here (``train``: plan/train/goal.py; ``serve-latency`` and
``serve-throughput``: plan/serve/goal.py; ``serve-disagg``: plan/serve/disagg.py); the goal modules do not import this one, so the
registry sits above them. ``register`` adds another (tests, extensions).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

from modelcarve.spec.errors import ModelcarveError

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

Screen = Callable[[Any], "tuple[float, str | None, str | None]"]


@runtime_checkable
class Goal(Protocol):
    name: str
    description: str

    def candidates(self, model: "ModelSpec", cluster: "ClusterSpec", **options) -> Iterable[Any]: ...

    def evaluate(self, model: "ModelSpec", cluster: "ClusterSpec", candidate: Any, **options) -> dict: ...

    def score(self, result: dict) -> float: ...


BUILT_IN: dict[str, tuple[str, str]] = {
    "train": ("modelcarve.plan.train.goal", "GOAL"),
    "serve-latency": ("modelcarve.plan.serve.goal", "SERVE_LATENCY"),
    "serve-throughput": ("modelcarve.plan.serve.goal", "SERVE_THROUGHPUT"),
    "serve-disagg": ("modelcarve.plan.serve.disagg", "SERVE_DISAGG"),
}
"""The built-in goals: name -> (module, attribute), imported when first asked for (a training plan
does not load the serving planner: ~45 ms of a cold ``modelcarve plan``)."""

GOALS: dict[str, Goal] = {}
"""The goals loaded so far by name: built-in ones once asked for, and any added with ``register``
(which then win over a built-in of the same name)."""


def register(goal: Goal) -> Goal:
    """Add ``goal`` to the registry under ``goal.name`` (replacing one of the same name)."""
    GOALS[goal.name] = goal
    return goal


def get_goal(name: str) -> Goal:
    goal = GOALS.get(name)
    if goal is not None:
        return goal
    if name not in BUILT_IN:
        raise ModelcarveError(f"unknown goal {name!r}; known goals: {', '.join(goal_names())}")
    module, attr = BUILT_IN[name]
    goal = GOALS[name] = getattr(importlib.import_module(module), attr)
    return goal


def goal_names() -> list[str]:
    return sorted(set(GOALS) | set(BUILT_IN))
