"""Choosing the next token from a step's logits: greedy, temperature, top-k, top-p, seeds, logprobs.

``sample(logits [n, V] fp32, params, generators, masks)`` returns (token ids, logprobs, top
logprobs). The
logits are those of the true vocabulary (the model runner cuts tensor parallelism's padded
columns off before they get here, so a padded id can never be drawn).

* ``temperature == 0``: greedy, ``argmax`` (ties: the lowest id, as torch.argmax and
  transformers' greedy search).
* otherwise ``logits / temperature``, then ``top_k`` (keep the k largest; 0 or -1: off), then
  ``top_p`` (keep the smallest set of largest-probability tokens whose mass reaches p; the top
  token always stays), then one draw of ``torch.multinomial`` from the request's own
  ``torch.Generator`` (seeded by ``seed``; one draw per generated token, so a request gives the
  same tokens alone, in a batch, or after being preempted and recomputed).
* ``min_tokens``: until that many tokens are generated, end-of-sequence and stop ids get -inf.
* logprobs: ``log_softmax`` of the unmodified logits (temperature 1, no truncation) at the
  chosen token, as vLLM returns by default; with ``top_logprobs = k`` also the k most likely ids
  and their logprobs (``torch.topk`` order), as [(id, logprob), ...].
* ``prompt_logprobs``: the engine also returns every prompt token's logprob (and top
  alternatives), computed by the model runner on the last pipeline stage (``step_plan.top_and_chosen``);
  ``max_tokens = 0`` computes the prompt and generates nothing (finish "length"; ``echo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modelcarve.runtime.engine.step_plan import top_and_chosen, unpack_tops


@dataclass
class SamplingParams:
    """Per-request sampling settings (see the module doc and runtime/engine/engine.py's)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple = ()
    stop: tuple = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    """with ``logprobs`` (or ``prompt_logprobs``): also this many most likely tokens per position"""
    prompt_logprobs: bool = False
    """return the prompt tokens' logprobs too (the first one is None)"""

    def __post_init__(self):
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 0 (0: the prompt only, as echo asks)")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs={self.top_logprobs}: must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int] | None]) -> tuple[list[int], list[float | None], list[list | None]]:
    """One token per row of ``logits`` [n, V] (see module doc); ``banned[i]``: ids masked for row i
    (min_tokens). Returns (tokens, logprobs, top logprobs) per row (None where not asked)."""
    logits = logits.float()
    for i, ids in enumerate(banned):
        if ids:
            logits[i, ids] = float("-inf")
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        tokens[i] = torch.multinomial(row.softmax(-1), 1, generator=generators[i])[0]
    chosen = tokens.tolist()
    logprobs: list[float | None] = [None] * len(params)
    tops: list[list | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        rows = torch.log_softmax(logits[want], dim=-1)
        k = max(params[i].top_logprobs for i in want)
        packed = top_and_chosen(rows, torch.tensor([chosen[i] for i in want]), k)
        lps, top = unpack_tops(packed, k)
        for j, i in enumerate(want):
            logprobs[i] = lps[j]
            n = params[i].top_logprobs
            tops[i] = top[j][:n] if n and top[j] is not None else None
    return chosen, logprobs, tops


@dataclass
class StopChecker:
    """Whether a sequence is done after a new token (ids first, then stop strings, then length)."""

    eos_ids: tuple = field(default_factory=tuple)

    def check(self, output: list[int], text: str | None, params: SamplingParams, text_before: int,
              limit: int) -> tuple[str | None, object, int | None]:
        """(finish reason, stop reason, where to cut ``text``) for the sequence's last token."""
        last = output[-1]
        if len(output) >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_ids:
                return "stop", last, None
            if last in params.stop_token_ids:
                return "stop", last, None
            if params.stop and text is not None:
                start = max(0, text_before - max(len(s) for s in params.stop))
                hits = [(text.find(s, start), s) for s in params.stop if text.find(s, start) >= 0]
                if hits:
                    where, s = min(hits)
                    return "stop", s, where
        if len(output) >= limit:
            return "length", None, None
        return None, None, None
