"""Request bodies and response shapes of the OpenAI API as vLLM's OpenAI-compatible server has them.

Requests are pydantic models in strict mode (``"max_tokens": "5"`` is a wrong type, as for
OpenAI), and every check a request can fail before it reaches the engine raises ``APIError``
with the offending parameter. A field this server does not implement is refused (400, naming
it) rather than ignored, unless its value asks for nothing (``null``, ``false``, empty,
``tool_choice: "none"``, ``response_format: {"type": "text"}``): an agent client that sends
``tools`` or a JSON ``response_format`` must not get plain text back as if it had been honoured. Fields follow
vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``: the OpenAI ones plus the sampling
extras load generators send (``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``).

Log-probabilities as vLLM serves them: completions ``logprobs`` 0..20 (legacy format: ``tokens``,
``token_logprobs``, ``top_logprobs`` dicts of the chosen token and the N most likely,
``text_offset``), with ``echo`` also the prompt's (the first token's null) and ``max_tokens: 0``
allowed (the prompt and its logprobs only; what lm-eval-harness sends for loglikelihood tasks);
chat ``logprobs: true`` with ``top_logprobs`` 0..20 (``content[i].top_logprobs``: the N most likely
as {token, logprob, bytes}). A logprob of -inf is sent as -9999.0, as vLLM does.

Responses are plain dicts built here (``completion_response``, ``completion_chunk``, ...) with
vLLM's keys: ``id`` (``cmpl-``/``chatcmpl-``), ``object``, ``created``, ``model``, ``choices``
(``finish_reason`` and vLLM's ``stop_reason``), ``usage``. Each choice also carries the
generated ``token_ids`` (vLLM returns them on request; here always), so a client can compare
tokens exactly.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from modelcarve.serve.errors import APIError

_CONFIG = ConfigDict(strict=True, extra="ignore")
_REQUEST = ConfigDict(strict=True, extra="allow")  # extras are checked by ``refuse_unimplemented``

_WHY_NOT = {
    "tools": "tools (function calling) is not supported: this server generates plain text; drop tools",
    "functions": "functions (function calling) is not supported: this server generates plain text; drop functions",
    "tool_choice": "tool_choice is not supported (no function calling); drop it or send \"none\"",
    "function_call": "function_call is not supported (no function calling); drop it",
    "response_format": "response_format (structured output) is not supported: the output is not constrained; "
                       "drop it or send {\"type\": \"text\"}",
    "logit_bias": "logit_bias is not supported; drop it",
    "use_beam_search": "beam search is not supported; drop use_beam_search",
    "prompt_logprobs": "prompt_logprobs is not supported; drop it",
}
_HARMLESS = {"tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False)}


def refuse_unimplemented(req: BaseModel) -> None:
    """400 naming the first field of ``req`` this server does not implement and whose value asks for
    something (fields it does implement are declared on the request models)."""
    for name, value in (req.model_extra or {}).items():
        if value is None or value is False or value == [] or value == {} or value in _HARMLESS.get(name, ()):
            continue
        raise _bad(_WHY_NOT.get(name, f"{name} is not supported by this server; drop it"), name)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _REQUEST
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool | None = False
    """vLLM's: logprobs name tokens "token_id:<id>" (exact where several ids decode alike)"""


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: the most alternatives a request may ask per position."""


@dataclass(kw_only=True)
class SamplingParams:
    """What one request asks of the engine, checked; the engine adapter maps it to the engine's own."""

    max_tokens: int
    """tokens to generate at most (the prompt excluded)"""
    temperature: float = 1.0
    """0 is greedy"""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut"""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    """stop strings, matched on the detokenised text; the match is not returned (OpenAI)"""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    """return the log-probability of each chosen token"""
    top_logprobs: int = 0
    """and of this many most likely tokens at each position"""
    prompt_logprobs: bool = False
    """and the prompt tokens' (echo with logprobs)"""


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def sampling_params(req: _Sampling, *, max_tokens: int | None, default_max_tokens: int, logprobs: bool,
                    top_logprobs: int = 0, echo: bool = False) -> SamplingParams:
    """Check the sampling fields of ``req`` (400 with the parameter's name) and collect them;
    ``echo`` allows ``max_tokens`` 0 (the prompt only) and asks the prompt's logprobs with ``logprobs``."""
    refuse_unimplemented(req)
    if req.n not in (None, 1):
        raise _bad(f"n={req.n} is not supported: this server returns one choice per prompt; send n=1 "
                   "(or several requests)", "n")
    if getattr(req, "best_of", None) not in (None, 1):
        raise _bad("best_of > 1 is not supported; send best_of=1", "best_of")
    if getattr(req, "suffix", None):
        raise _bad("suffix is not supported", "suffix")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise _bad(f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}", "max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise _bad(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = req.top_k or 0
    if top_k < -1:
        raise _bad(f"top_k must be -1 or 0 (off) or a positive count, got {top_k}", "top_k")
    if req.min_p not in (None, 0.0):
        raise _bad("min_p is not supported; leave it 0", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise _bad(f"{name} is not supported; leave it 0", name)
    if req.repetition_penalty not in (None, 1.0):
        raise _bad("repetition_penalty is not supported; leave it 1", "repetition_penalty")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise _bad(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise _bad("stop strings must not be empty", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                          seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                          ignore_eos=bool(req.ignore_eos), min_tokens=min_tokens, logprobs=logprobs,
                          top_logprobs=top_logprobs if logprobs else 0, prompt_logprobs=bool(logprobs and echo))


def completion_logprobs_count(req: CompletionRequest) -> int | None:
    """The completion's ``logprobs`` (alternatives per position, 0..20), or None when not asked."""
    if req.logprobs is None:
        return None
    if not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise _bad(f"logprobs={req.logprobs}: must be in [0, {MAX_LOGPROBS}]", "logprobs")
    return req.logprobs


def chat_top_logprobs(req: ChatCompletionRequest) -> int:
    """The chat request's ``top_logprobs`` (0..20; needs ``logprobs: true``)."""
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise _bad(f"top_logprobs={top}: must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if top and not req.logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return top


def prompts_of(prompt) -> list[str | list[int]]:
    """The prompts of a completion request: one string, one list of ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _bad("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


# ---- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + completion_tokens,
                completion_tokens=completion_tokens)


def _lp(value: float | None) -> float | None:
    """A logprob for JSON: -inf as -9999.0 (vLLM, OpenAI)."""
    return None if value is None else max(float(value), -9999.0)


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offset0: int,
                        tops: list[list | None] | None = None) -> dict:
    """OpenAI's legacy completion logprobs: the tokens, their logprobs (None: the echoed prompt's
    first), per position a dict of the chosen token then the most likely ``tops[i]`` ([(token,
    logprob), ...]), and each token's offset in the text."""
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top_logprobs = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        if lp is None:
            top_logprobs.append(None)
            continue
        entry = {t: _lp(lp)}
        for s, v in (tops[i] or []) if tops else []:
            entry.setdefault(s, _lp(v))
        top_logprobs.append(entry)
    return dict(text_offset=offsets, token_logprobs=[_lp(lp) for lp in logprobs], tokens=list(tokens),
                top_logprobs=top_logprobs)


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list | None] | None = None) -> dict:
    """Chat logprobs: per token {token, logprob, bytes, top_logprobs: the most likely, same keys}."""
    def one(t: str, lp: float) -> dict:
        return dict(token=t, logprob=_lp(lp), bytes=list(t.encode()))

    return dict(content=[one(t, lp) | dict(top_logprobs=[one(s, v) for s, v in ((tops[i] or []) if tops else [])])
                         for i, (t, lp) in enumerate(zip(tokens, logprobs))])


FinishReason = Literal["stop", "length", "abort"]


def completion_choice(index: int, text: str, finish_reason: str | None, stop_reason=None, logprobs=None,
                      token_ids: list[int] | None = None) -> dict:
    return dict(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
                token_ids=token_ids)


def completion_body(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None) -> dict:
    return dict(id=rid, object="text_completion", created=created, model=model, choices=choices, usage=usage_)


def chat_choice(index: int, text: str, finish_reason: str | None, stop_reason=None, logprobs=None,
                token_ids: list[int] | None = None) -> dict:
    return dict(index=index, message=dict(role="assistant", content=text), logprobs=logprobs,
                finish_reason=finish_reason, stop_reason=stop_reason, token_ids=token_ids)


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None) -> dict:
    return dict(id=rid, object="chat.completion", created=created, model=model, choices=choices, usage=usage_)


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               stop_reason=None, logprobs=None, usage_: dict | None = None, token_ids=None) -> dict:
    choice = dict(index=0, delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return dict(id=rid, object="chat.completion.chunk", created=created, model=model, choices=[choice], usage=usage_)


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return dict(id=rid, object=obj, created=created, model=model, choices=[], usage=usage_)


def models_body(name: str, max_model_len: int, root: str) -> dict:
    return dict(object="list", data=[dict(id=name, object="model", created=now(), owned_by="modelcarve", root=root,
                                          parent=None, max_model_len=max_model_len)])
