"""Request bodies and response shapes of the OpenAI API as vLLM's OpenAI-compatible server has them.

Requests are pydantic models in strict mode (``"max_tokens": "5"`` is a wrong type, as for
OpenAI), and every check a request can fail before it reaches the engine raises ``APIError``
with the offending parameter. A field this server does not implement is refused (400, naming
it) rather than ignored, unless its value asks for nothing (``null``, ``false``, empty,
``tool_choice: "none"``, ``response_format: {"type": "text"}``): an agent client that sends
``tools`` or a JSON ``response_format`` must not get plain text back as if it had been honoured. Fields follow
vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``: the OpenAI ones plus the sampling
extras load generators send (``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``).

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


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def sampling_params(req: _Sampling, *, max_tokens: int | None, default_max_tokens: int, logprobs: bool) -> SamplingParams:
    """Check the sampling fields of ``req`` (400 with the parameter's name) and collect them."""
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
    if max_tokens <= 0:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
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
                          ignore_eos=bool(req.ignore_eos), min_tokens=min_tokens, logprobs=logprobs)


def completion_logprobs_flag(req: CompletionRequest) -> bool:
    if req.logprobs is None:
        return False
    if not 0 <= req.logprobs <= 1:
        raise _bad(f"logprobs={req.logprobs}: this engine returns the chosen token's log-probability only; "
                   "send logprobs 0 or 1", "logprobs")
    if req.echo:
        raise _bad("echo with logprobs is not supported (no prompt log-probabilities); drop one of them", "echo")
    return True


def chat_logprobs_flag(req: ChatCompletionRequest) -> bool:
    if req.top_logprobs not in (None, 0):
        raise _bad("top_logprobs > 0 is not supported (the chosen token's log-probability only)", "top_logprobs")
    return bool(req.logprobs)


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


def completion_logprobs(tokens: list[str], logprobs: list[float], offset0: int) -> dict:
    """OpenAI's legacy completion logprobs: the chosen tokens, their logprobs, text offsets."""
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return dict(text_offset=offsets, token_logprobs=list(logprobs), tokens=list(tokens),
                top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs)])


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return dict(content=[dict(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[])
                         for t, lp in zip(tokens, logprobs)])


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
