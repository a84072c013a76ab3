"""The engine's step plan: what rank 0 tells every rank to compute in one engine step (typed).

vLLM v1's ``SchedulerOutput`` in our terms: the scheduler (scheduler.py) picks, per DP replica,
the sequences that run and how many of their tokens (``Scheduled``); ``StepPlan.from_scheduled``
turns that into plain data a follower rank can act on without the scheduler's state: per
replica, per sequence, the token ids computed this step, the first position, the block table
and whether the step samples the sequence's next token. Rank 0 broadcasts it
(``ModelRunner.broadcast``, pickled; ``None`` is the end of the followers' loop and an empty
plan the idle heartbeat), and every rank's ``ModelRunner.execute`` runs its replica's share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class StepItem(NamedTuple):
    """One sequence's share of a step (a tuple on the wire: small to pickle)."""

    token_ids: list[int]
    """The tokens computed this step: a prefill chunk, or the one token of a decode."""
    start: int
    """Position of ``token_ids[0]`` in the sequence (the KV cache already holds ``0..start-1``)."""
    block_table: list[int]
    """The sequence's KV-cache blocks, in order."""
    sample: bool
    """The step yields this sequence's next token (its last row's logits go back to rank 0)."""


DUMMY_ITEM = StepItem([0], 0, [0], False)
"""What an idle replica runs when the MoE all-to-all spans the replicas (written to scratch slot 0)."""


@dataclass
class StepPlan:
    """Per DP replica, the items its ranks run this step (replica order = the ``dp`` rank)."""

    replicas: list[list[StepItem]] = field(default_factory=list)

    @classmethod
    def from_scheduled(cls, scheduled) -> "StepPlan":
        """From each replica's ``Scheduler.schedule()`` result (a list of ``Scheduled``)."""
        return cls([[StepItem(item.seq.tokens[item.start:item.start + item.count], item.start,
                              list(item.seq.block_table), item.sample) for item in items]
                    for items in scheduled])

    def for_replica(self, replica: int) -> list[StepItem]:
        return self.replicas[replica] if replica < len(self.replicas) else []

    def __bool__(self) -> bool:
        """Whether any replica has work (an empty plan is the idle heartbeat)."""
        return any(self.replicas)
