"""The engine's step plan: what rank 0 tells every rank to compute in one engine step (typed).

vLLM v1's ``SchedulerOutput`` in our terms: the scheduler (scheduler.py) picks, per DP replica,
the sequences that run and how many of their tokens (``Scheduled``); ``StepPlan.from_scheduled``
turns that into plain data a follower rank can act on without the scheduler's state: per
replica, per sequence, the token ids computed this step, the first position, the block table,
whether the step samples the sequence's next token, and -- for a request that asked for its
prompt's log-probabilities (``echo`` with ``logprobs``) -- how many of the chunk's rows return
their next token's log-probability and top alternatives (``logprob_rows``, ``next_token``,
``top_logprobs``). Rank 0 broadcasts it
(``ModelRunner.broadcast``, pickled; ``None`` is the end of the followers' loop and an empty
plan the idle heartbeat), and every rank's ``ModelRunner.execute`` runs its replica's share.
With pipeline parallelism (pp > 1) one plan is one micro-batch (per replica) and several are in
flight at once: rank 0 sends each plan point to point (``ModelRunner.send_plan``) instead of a
broadcast, so a stage busy with an earlier plan never holds the next one up.

What comes back for the logprob rows is packed here too (``top_and_chosen`` / ``unpack_tops``: a
row's target logprob and top-k as ``1 + 2k`` floats), shared by the runner and the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


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
    logprob_rows: int = 0
    """How many leading rows of the chunk send back the log-probability of the token that follows
    them (prompt logprobs): row ``j`` predicts ``token_ids[j + 1]``, the last row ``next_token``."""
    next_token: int = -1
    """The token after the chunk (the target of its last row when that row is a logprob row)."""
    top_logprobs: int = 0
    """With ``logprob_rows``: also the ids and log-probabilities of each row's most likely tokens."""


DUMMY_ITEM = StepItem([0], 0, [0], False)
"""What an idle replica runs when the MoE all-to-all spans the replicas (written to scratch slot 0)."""


@dataclass
class StepPlan:
    """Per DP replica, the items its ranks run this step (replica order = the ``dp`` rank)."""

    replicas: list[list[StepItem]] = field(default_factory=list)
    index: int = -1
    """Rank 0's running number of the plans it sent (the micro-batch id in the step records)."""
    step: int = -1
    """The engine ``step()`` call that launched it (pp > 1: plans of several steps are in flight)."""

    @classmethod
    def from_scheduled(cls, scheduled, index: int = -1, step: int = -1) -> "StepPlan":
        """From each replica's ``Scheduler.schedule()`` result (a list of ``Scheduled``)."""
        return cls([[_item(item) for item in items] for items in scheduled], index, step)

    def for_replica(self, replica: int) -> list[StepItem]:
        return self.replicas[replica] if replica < len(self.replicas) else []

    def __bool__(self) -> bool:
        """Whether any replica has work (an empty plan is the idle heartbeat)."""
        return any(self.replicas)


def prompt_logprob_rows(seq, start: int, count: int) -> int:
    """How many rows of the chunk ``[start, start + count)`` of ``seq`` want prompt logprobs: those
    predicting a prompt token (rows ``start .. len(prompt) - 2``) while the sequence still lacks some
    (``seq.prompt_logprobs_done``; a sequence recomputed after a preemption does not ask twice)."""
    params = seq.params
    if not getattr(params, "prompt_logprobs", False) or seq.prompt_logprobs_done:
        return 0
    return max(0, min(start + count, len(seq.prompt) - 1) - start)


def _item(item) -> StepItem:
    seq, start, count = item.seq, item.start, item.count
    tokens = seq.tokens
    rows = prompt_logprob_rows(seq, start, count)
    if not rows:
        return StepItem(tokens[start:start + count], start, list(seq.block_table), item.sample)
    after = tokens[start + count] if start + count < len(tokens) else -1
    return StepItem(tokens[start:start + count], start, list(seq.block_table), item.sample, rows, after,
                    int(getattr(seq.params, "top_logprobs", 0) or 0))


def top_and_chosen(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 1 + 2k] fp32 from log-probability rows [n, V]: each row's logprob at ``targets``, then the
    k largest logprobs, then their ids (as fp32: exact below 2**24 ids). What the model runner sends
    back per prompt row instead of the whole row."""
    chosen = logprobs.gather(1, targets[:, None].to(logprobs.device))
    if k <= 0:
        return chosen.float()
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values, top.indices.to(logprobs.dtype)], dim=1).float()


def unpack_tops(packed: torch.Tensor, k: int) -> tuple[list[float], list[list | None]]:
    """``top_and_chosen``'s rows back to (chosen logprobs, [(id, logprob), ...] per row or None)."""
    chosen = packed[:, 0].tolist()
    if k <= 0:
        return chosen, [None] * len(chosen)
    values, ids = packed[:, 1:1 + k].tolist(), packed[:, 1 + k:1 + 2 * k].long().tolist()
    return chosen, [list(zip(i, v)) for i, v in zip(ids, values)]
