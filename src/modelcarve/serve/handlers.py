"""One completion or chat request from checked body to response: tokens in, engine outputs out, JSON or SSE.

``Generation`` holds what a route decided (the prompts' token ids, the sampling, echo, the
kind of response) and produces either the whole body (``collect``) or the server-sent events
(``events``), both from the same engine outputs so streaming and non-streaming return the same
text and tokens. Usage is counted from the engine's token ids: prompt tokens as given to the
engine, completion tokens as generated (a stop string's tokens included, as vLLM counts them).
With ``echo`` and ``logprobs`` the logprobs cover the prompt's tokens (the first null) then
the generated ones, with text offsets counted from the start of the echoed text (vLLM); a stream
sends the echo chunk, with the prompt's logprobs, once the prompt is computed. A client that disconnects, or a stream the server abandons, aborts every sub-request
(``finally``), which frees their KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from modelcarve.serve import protocol as P
from modelcarve.serve.bridge import EngineFailed
from modelcarve.serve.errors import APIError, error_body


@dataclass
class _State:
    """One prompt's progress."""

    prompt_ids: list[int]
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    """per generated token, [(id, logprob), ...] of the most likely (when asked)"""
    prompt_logprobs: list | None = None
    prompt_top_logprobs: list | None = None
    echoed: bool = False
    """the echo chunk was streamed"""
    finish_reason: str | None = None
    stop_reason: object = None
    first_token_s: float | None = None
    emitted: int = 0
    """characters of ``text`` already streamed"""


@dataclass(kw_only=True)
class Generation:
    """A checked request: ``chat`` or completion, the prompts, how to answer."""

    bridge: object
    metrics: object
    tokenizer: object | None
    model_name: str
    chat: bool
    prompts: list[list[int]]
    params: object
    """the engine's SamplingParams"""
    logprobs: bool = False
    top_logprobs: int = 0
    tokens_as_ids: bool = False
    """name the logprobs' tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)"""
    echo_texts: list[str] | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    arrival: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.rid = P.new_id("chatcmpl" if self.chat else "cmpl")
        self.created = P.now()
        self.states = [_State(ids, f"{self.rid}-{i}") for i, ids in enumerate(self.prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set()

    # ---- engine side -------------------------------------------------------------------------

    def start(self) -> None:
        self.bridge.check_open(len(self.states))
        try:
            for i, st in enumerate(self.states):
                self.bridge.admit(st.rid, st.prompt_ids, self.params, self.queue, index=i)
                self._open.add(st.rid)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Abort what is still generating (the client left, or the stream was abandoned)."""
        for st in self.states:
            if st.rid in self._open:
                self.bridge.abort(st.rid)
                self.metrics.aborted()
        self._open.clear()

    async def _next(self):
        index, out = await self.queue.get()
        if isinstance(out, EngineFailed):
            raise APIError(500, f"the engine failed while generating: {out}")
        st = self.states[index]
        now = time.perf_counter()
        if out.new_token_ids and st.first_token_s is None:
            st.first_token_s = now - self.arrival
        st.token_ids = list(out.token_ids)
        if out.new_logprobs:
            st.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            st.top_logprobs.extend(out.new_top_logprobs)
        if out.prompt_logprobs is not None:
            st.prompt_logprobs, st.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
        st.text = out.text or ""
        if out.finished:
            st.finish_reason = out.finish_reason
            st.stop_reason = out.stop_reason
            self._open.discard(st.rid)
            e2e = now - self.arrival
            self.bridge.finished(st.rid, e2e)
            self.metrics.finished(reason=st.finish_reason or "stop", prompt_tokens=len(st.prompt_ids),
                                  generated=len(st.token_ids), ttft_s=st.first_token_s, e2e_s=e2e)
        return index, out, self._delta(st, out.finished)

    def _delta(self, st: _State, finished: bool) -> str:
        """Text to stream now: all of it at the end; before, not a tail that may begin a stop string
        (the engine cuts a matched stop string off the text, which must not have been sent)."""
        safe = len(st.text)
        if not finished:
            for stop in getattr(self.params, "stop", ()) or ():
                for k in range(min(len(stop) - 1, len(st.text)), 0, -1):
                    if st.text.endswith(stop[:k]):
                        safe = min(safe, len(st.text) - k)
                        break
        if safe <= st.emitted:
            return ""
        delta = st.text[st.emitted:safe]
        st.emitted = safe
        return delta

    # ---- shaping -----------------------------------------------------------------------------

    def _token_strings(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None or self.tokens_as_ids:
            return [f"token_id:{i}" for i in ids]
        return [self.tokenizer.decode([i]) for i in ids]

    def _logprobs_of(self, index: int, ids: list[int], lps: list[float], offset: int, tops: list | None = None):
        if not self.logprobs:
            return None
        tokens = self._token_strings(ids)
        named = None
        if self.top_logprobs and tops:
            named = [None if top is None else list(zip(self._token_strings([i for i, _ in top]), [v for _, v in top]))
                     for top in tops]
        return P.chat_logprobs(tokens, lps, named) if self.chat else P.completion_logprobs(tokens, lps, offset, named)

    @property
    def _echo_logprobs(self) -> bool:
        return self.logprobs and not self.chat and self.echo_texts is not None

    def _prompt_part(self, st: _State) -> tuple[list[int], list, list]:
        """The echoed prompt's ids, logprobs (the first None) and top logprobs (echo with logprobs)."""
        n = len(st.prompt_ids)
        return (list(st.prompt_ids), list(st.prompt_logprobs or [None] * n),
                list(st.prompt_top_logprobs or [None] * n))

    def _tops(self, st: _State, count: int) -> list:
        return list(st.top_logprobs) if len(st.top_logprobs) == count else [None] * count

    def usage(self) -> dict:
        return P.usage(sum(len(s.prompt_ids) for s in self.states), sum(len(s.token_ids) for s in self.states))

    def _echo(self, index: int) -> str:
        return self.echo_texts[index] if self.echo_texts else ""

    # ---- whole response ----------------------------------------------------------------------

    async def collect(self, is_disconnected) -> dict:
        """Wait for every prompt to finish (aborting if the client leaves) and build the body."""
        try:
            while self._open:
                try:
                    await asyncio.wait_for(self._next(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await is_disconnected():
                        raise asyncio.CancelledError from None
        finally:
            self.cancel()
        choices = []
        for i, st in enumerate(self.states):
            text = self._echo(i) + st.text
            if self._echo_logprobs:
                ids, lp, tops = self._prompt_part(st)
                lps = self._logprobs_of(i, ids + st.token_ids, lp + st.logprobs, 0,
                                        tops + self._tops(st, len(st.token_ids)))
            else:
                lps = self._logprobs_of(i, st.token_ids, st.logprobs, len(self._echo(i)),
                                        self._tops(st, len(st.token_ids)))
            make = P.chat_choice if self.chat else P.completion_choice
            choices.append(make(i, text, st.finish_reason, st.stop_reason, lps, st.token_ids))
        body = P.chat_body if self.chat else P.completion_body
        return body(self.rid, self.created, self.model_name, choices, self.usage())

    # ---- server-sent events ------------------------------------------------------------------

    def _sse(self, payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _running_usage(self) -> dict | None:
        return self.usage() if self.continuous_usage else None

    async def events(self):
        """The SSE stream: role chunk (chat), text deltas, finish chunks, the usage chunk, ``[DONE]``."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:
                yield self._sse(P.chat_chunk(self.rid, self.created, self.model_name, dict(role="assistant", content=""),
                                             usage_=self._running_usage()))
            else:
                for i in range(len(self.states)):
                    if self._echo(i) and not self._echo_logprobs:  # else: once the prompt's logprobs are known
                        yield self._sse(P.completion_body(self.rid, self.created, self.model_name,
                                                          [P.completion_choice(i, self._echo(i), None, token_ids=[])],
                                                          self._running_usage()))
            offsets = [len(self._echo(i)) for i in range(len(self.states))]
            while self._open:
                try:
                    index, out, new_text = await self._next()
                except APIError as err:
                    yield self._sse(error_body(err.status, err.message))
                    break
                st = self.states[index]
                if self._echo_logprobs and not st.echoed and (st.prompt_logprobs is not None or out.finished):
                    st.echoed = True
                    ids, lp, tops = self._prompt_part(st)
                    plps = self._logprobs_of(index, ids, lp, 0, tops)
                    offsets[index] = sum(len(t) for t in plps["tokens"])
                    yield self._sse(P.completion_body(self.rid, self.created, self.model_name,
                                                      [P.completion_choice(index, self._echo(index), None, None, plps,
                                                                           [])], self._running_usage()))
                if not out.new_token_ids and not out.finished and not new_text:
                    continue
                lps = self._logprobs_of(index, list(out.new_token_ids), list(out.new_logprobs or []), offsets[index],
                                        out.new_top_logprobs)
                # the offsets count the tokens' own strings, as the whole response does
                offsets[index] += sum(len(t) for t in lps["tokens"]) if lps and not self.chat else len(new_text)
                finish = st.finish_reason if out.finished else None
                stop = st.stop_reason if out.finished else None
                ids = list(out.new_token_ids)
                if self.chat:
                    delta = dict(content=new_text) if (new_text or not out.finished) else {}
                    yield self._sse(P.chat_chunk(self.rid, self.created, self.model_name, delta, finish, stop, lps,
                                                 self._running_usage(), token_ids=ids))
                else:
                    choice = P.completion_choice(index, new_text, finish, stop, lps, ids)
                    yield self._sse(P.completion_body(self.rid, self.created, self.model_name, [choice],
                                                      self._running_usage()))
            if self.include_usage:
                yield self._sse(P.usage_chunk(self.rid, self.created, self.model_name, obj, self.usage()))
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()
