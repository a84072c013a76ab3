"""Continuous batching: which sequences run in the next step, and how many of their tokens.

One ``Scheduler`` per model replica, on rank 0, over that replica's ``BlockManager``. Each
``schedule()`` builds one step under a token budget (``max_num_batched_tokens``):

1. running sequences, oldest first: a decoding sequence takes 1 token, one still in prefill
   the rest of its prompt (or what the budget leaves: chunked prefill). When the blocks it needs
   are not free, the *newest* running sequence not yet given work this step is preempted (its
   blocks freed, back to the front of the queue; it is recomputed later from its prompt plus
   the tokens it already generated, so its output does not change) -- possibly itself.
2. then, if nothing was preempted, waiting sequences in arrival order while the budget, the
   ``max_num_seqs`` limit and the free blocks allow, each first taking over the cached blocks
   of its prompt's prefix (block_manager.py).

A sequence that asked for its prompt's log-probabilities takes nothing from the prefix cache until
they are all computed (a cached block has no logits; vLLM does the same).

A sequence whose scheduled tokens reach the end of what it knows (prompt + generated) gets a
new token sampled from the step's logits; a partial prefill chunk does not.

Pipeline parallelism (the engine keeps up to ``pp`` micro-batches in flight): ``schedule(busy,
max_seqs)`` leaves out the sequences of micro-batches still in flight (``busy``: their next token
or chunk depends on what is being computed) and never preempts one of them (their blocks are in
use), and takes at most ``max_seqs`` sequences, so the micro-batches in flight share the requests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from modelcarve.runtime.engine.block_manager import BlockManager

_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state (owned by rank 0)."""

    request_id: str
    prompt: list[int]
    params: object
    arrival_time: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    """per generated token, [(id, logprob), ...] of the most likely (when ``params.top_logprobs``)"""
    prompt_logprobs: list = field(default_factory=list)
    """per prompt position, the prompt token's logprob (None at position 0; when ``params.prompt_logprobs``)"""
    prompt_top_logprobs: list = field(default_factory=list)
    """per prompt position, [(id, logprob), ...] of the most likely (None at position 0)"""
    prompt_filled: int = 1     # prompt positions whose logprobs are known (position 0 has none)
    block_table: list[int] = field(default_factory=list)
    computed: int = 0          # tokens whose KV is in the cache
    registered: int = 0        # leading blocks registered for prefix caching
    cached_tokens: int = 0     # prompt tokens taken from the prefix cache
    replica: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: object = None
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""
    emitted_text: str = ""    # the text already returned (a prefix of ``text``)
    order: int = field(default_factory=lambda: next(_order))
    key: int = -1              # small integer id sent to the model ranks

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output if self.output else self.prompt

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_filled >= len(self.prompt)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class Scheduled:
    seq: Sequence
    start: int     # first position computed this step
    count: int     # tokens computed this step
    sample: bool   # the step yields this sequence's next token


class Scheduler:
    """Waiting queue and running set of one replica (see module doc)."""

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 512, max_num_seqs: int = 64):
        self.blocks = blocks
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.computed = seq.registered = 0
        self.waiting.insert(0, seq)
        self.preemptions += 1

    def schedule(self, busy=frozenset(), max_seqs: int | None = None) -> list[Scheduled]:
        """The next step's (or micro-batch's) work; ``busy``: sequences in flight, left out and never
        preempted; ``max_seqs``: at most this many sequences (pp > 1: a share of the requests)."""
        budget = self.budget
        cap = self.max_num_seqs if max_seqs is None else max_seqs
        out: list[Scheduled] = []
        given: set[int] = set()
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.order):
            if budget == 0 or len(out) >= cap:
                break
            if seq not in self.running or seq in busy:  # preempted earlier in this loop / in flight
                continue
            count = min(len(seq) - seq.computed, budget)
            while not self.blocks.grow(seq.block_table, seq.computed + count):
                victims = [s for s in self.running if id(s) not in given and s not in busy]
                victim = max(victims, key=lambda s: s.order)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            given.add(id(seq))
            out.append(Scheduled(seq, seq.computed, count, seq.computed + count == len(seq)))
            budget -= count
        while (self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs
               and len(out) < cap):
            seq = self.waiting[0]
            tokens = seq.tokens
            wants_rows = getattr(seq.params, "prompt_logprobs", False) and not seq.prompt_logprobs_done
            cached = self.blocks.match_prefix(tokens) if seq.computed == 0 and not wants_rows else []
            seq.block_table[:0] = cached
            seq.computed = len(cached) * self.blocks.block_size
            seq.registered = len(cached)
            if not seq.output:
                seq.cached_tokens = seq.computed
            count = min(len(seq) - seq.computed, budget)
            if not self.blocks.grow(seq.block_table, seq.computed + count):
                self.blocks.release(seq.block_table)
                seq.computed = seq.registered = 0
                break
            self.waiting.pop(0)
            self.blocks.count_query(len(tokens), len(cached))
            self.running.append(seq)
            out.append(Scheduled(seq, seq.computed, count, seq.computed + count == len(seq)))
            budget -= count
        return out

    def after_step(self, done: list[Scheduled]) -> None:
        """Record the computed tokens (and register full blocks for prefix caching)."""
        for item in done:
            seq = item.seq
            seq.computed = item.start + item.count
            seq.registered = self.blocks.register(seq.block_table, seq.tokens, seq.computed, seq.registered)
