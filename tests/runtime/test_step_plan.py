"""The engine's typed step plan (runtime/engine/step_plan.py): built from the scheduler's choice,
unchanged through the pickle rank 0 broadcasts."""

from __future__ import annotations

import pickle

from modelcarve.runtime.engine.scheduler import Scheduled, Sequence
from modelcarve.runtime.engine.step_plan import StepItem, StepPlan


def _seq(prompt, table):
    return Sequence(request_id="r", prompt=list(prompt), params=None, block_table=list(table))


def test_plan_from_scheduled_and_through_pickle():
    a = _seq(range(10, 20), [3, 4])
    b = _seq([7, 8, 9], [5])
    # replica 0: a prefill chunk of a (positions 4..7) that does not sample; replica 1: all of b, sampling
    plan = StepPlan.from_scheduled([[Scheduled(a, 4, 4, False)], [Scheduled(b, 0, 3, True)]])
    assert plan.replicas == [[StepItem([14, 15, 16, 17], 4, [3, 4], False)], [StepItem([7, 8, 9], 0, [5], True)]]
    assert plan.for_replica(1)[0].sample and plan.for_replica(2) == []
    back = pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == plan and isinstance(back.replicas[0][0], StepItem)
    assert plan and not StepPlan() and not StepPlan([[], []])  # an empty plan is the idle heartbeat


def test_plan_messages_one_for_a_decode_step_two_for_a_long_prefill():
    """ModelRunner.broadcast / send_plan: a decode step's plan (a few hundred bytes) is one
    PLAN_FIRST-byte message (length + bytes); a plan whose pickle exceeds PLAN_FIRST - 8 bytes is
    that message plus one with the rest; both read back equal; None (the end of the loop) too."""
    from modelcarve.runtime.engine.model_runner import PLAN_FIRST, _plan_from, _plan_messages

    decode = StepPlan([[StepItem([5], 40 + i, [3, 4, 9], True) for i in range(16)]])
    prefill = StepPlan([[StepItem(list(range(3000)), 0, list(range(200)), True) for _ in range(4)]])
    for plan, count in ((decode, 1), (prefill, 2), (None, 1)):
        parts = _plan_messages(plan)
        assert len(parts) == count and parts[0].numel() == PLAN_FIRST
        queue = list(parts[1:])

        def receive(into):
            into.copy_(queue.pop(0))

        head = parts[0].clone()
        assert _plan_from(head, receive) == plan
        assert not queue
