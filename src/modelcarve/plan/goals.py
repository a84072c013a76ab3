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

Goals register themselves here by name; the serving goals live in ``plan/serve_goal.py``.
"""

from __future__ import annotations

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


GOALS: dict[str, Goal] = {}


def register(goal: Goal) -> Goal:
    """Add ``goal`` to the registry under ``goal.name`` (replacing one of the same name)."""
    GOALS[goal.name] = goal
    return goal


BUILTIN_GOAL_MODULES = ("train_goal", "serve_goal")
"""Modules under modelcarve.plan that register goals when imported."""


_builtin_loaded = False


def _load_builtin() -> None:
    # Imported here, not at module top, so goal modules can import this one to register. Loaded
    # once, whatever is registered already (importing one goal module must not hide the others).
    global _builtin_loaded
    if _builtin_loaded:
        return
    _builtin_loaded = True
    import importlib

    for module in BUILTIN_GOAL_MODULES:
        try:
            importlib.import_module(f"modelcarve.plan.{module}")
        except ModuleNotFoundError as err:  # a goal module not written yet in this checkout
            if err.name != f"modelcarve.plan.{module}":
                raise


def get_goal(name: str) -> Goal:
    _load_builtin()
    if name not in GOALS:
        raise ModelcarveError(f"unknown goal {name!r}; known goals: {', '.join(sorted(GOALS))}")
    return GOALS[name]


def goal_names() -> list[str]:
    _load_builtin()
    return sorted(GOALS)
