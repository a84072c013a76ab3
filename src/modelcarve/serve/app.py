"""The FastAPI routes of the OpenAI-compatible server: completions, chat, models, health, metrics.

    POST /v1/completions        prompt: a string, a list of ids, or a list of either; SSE with "stream"
    POST /v1/chat/completions   messages through the checkpoint's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while serving (weights loaded on every rank), 503 while draining
    GET  /metrics               prometheus text (serve/metrics.py)

Each route checks what it can before the engine sees the request: the API key (401), the model
name (404), the body (400: malformed JSON, wrong types, ``max_tokens`` <= 0 (0 is allowed with
``echo``), unsupported fields, token ids outside the vocabulary, ``logprobs`` / ``top_logprobs``
above 20, prompt + ``max_tokens`` longer than the context, with both
lengths), the queue (429 + ``Retry-After``) and the drain (503); errors have OpenAI's shape
(serve/errors.py). The pipelines themselves are serve/handlers.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from modelcarve.serve import errors, protocol as P
from modelcarve.serve.errors import APIError
from modelcarve.serve.handlers import Generation

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass(kw_only=True)
class ServedModel:
    """What the routes need to know about the model behind the engine."""

    name: str
    """the name clients send as ``model`` (``--served-model-name``, default the --model argument)"""
    root: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None
    make_params: object
    """protocol.SamplingParams -> the engine's SamplingParams"""


class _ArrivalStamp:
    """Pure ASGI middleware: the time a request reached the app, before its body is read and parsed
    (``request.state.arrival``); the TTFT / E2E histograms start there."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


def create_app(bridge, metrics, served: ServedModel, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="modelcarve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_ArrivalStamp)
    errors.install(app)
    app.state.bridge, app.state.metrics, app.state.served = bridge, metrics, served

    def authorise(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                           "with the server's --api-key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r} "
                           "(GET /v1/models)", param="model")

    def check_ids(ids: list[int], param: str = "prompt") -> list[int]:
        bad = [i for i in ids if not 0 <= i < served.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})", param=param)
        if not ids:
            raise APIError(400, "the prompt has no tokens", param=param)
        return ids

    def check_length(ids: list[int], max_tokens: int, param: str) -> None:
        total = len(ids) + max_tokens
        if total > served.max_model_len:
            raise APIError(400, f"this model's maximum context length is {served.max_model_len} tokens, but the "
                           f"request needs {total}: {len(ids)} prompt tokens + {max_tokens} max_tokens; shorten "
                           "the prompt or lower max_tokens", param=param)

    def need_tokenizer(what: str):
        if served.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer and this checkpoint has none (no tokenizer.json); "
                           "send the prompt as a list of token ids", param="prompt")
        return served.tokenizer

    def respond(gen: Generation, stream: bool, request: Request):
        gen.arrival = getattr(request.state, "arrival", gen.arrival)
        gen.start()
        if stream:
            return StreamingResponse(gen.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return gen.collect(request.is_disconnected)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        authorise(request)
        check_model(body.model)
        bridge.check_open()
        P.refuse_unimplemented(body)
        top = P.completion_logprobs_count(body)
        logprobs = top is not None
        prompts, echo = [], []
        for prompt in P.prompts_of(body.prompt):
            if isinstance(prompt, str):
                ids = check_ids(need_tokenizer("a text prompt").encode(prompt))
                echo.append(prompt)
            else:
                ids = check_ids(list(prompt))
                echo.append(served.tokenizer.decode(ids) if served.tokenizer is not None else "")
            prompts.append(ids)
        sp = P.sampling_params(body, max_tokens=body.max_tokens, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
                               logprobs=logprobs, top_logprobs=top or 0, echo=bool(body.echo))
        for ids in prompts:
            check_length(ids, sp.max_tokens, "prompt")
        if sp.stop and served.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer and this checkpoint has none; use stop_token_ids",
                           param="stop")
        opts = body.stream_options or P.StreamOptions()
        gen = Generation(bridge=bridge, metrics=metrics, tokenizer=served.tokenizer, model_name=served.name, chat=False,
                         prompts=prompts, params=served.make_params(sp), logprobs=logprobs, top_logprobs=top or 0,
                         tokens_as_ids=bool(body.return_tokens_as_token_ids), echo_texts=echo if body.echo else None, include_usage=bool(body.stream and opts.include_usage),
                         continuous_usage=bool(body.stream and opts.continuous_usage_stats))
        result = respond(gen, bool(body.stream), request)
        return result if body.stream else JSONResponse(await result)

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatCompletionRequest, request: Request):
        authorise(request)
        check_model(body.model)
        bridge.check_open()
        P.refuse_unimplemented(body)
        tok = need_tokenizer("chat")
        top = P.chat_top_logprobs(body)
        logprobs = bool(body.logprobs)
        messages = [dict(role=m.role, content=_content_text(m.content)) for m in body.messages]
        if not getattr(tok, "has_chat_template", False):
            raise APIError(400, "this checkpoint has no chat template (chat_template in tokenizer_config.json or "
                           "chat_template.jinja); use /v1/completions with a plain prompt", param="messages")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=bool(body.add_generation_prompt))
        except Exception as err:  # noqa: BLE001 - a template that raises on these messages: the checkpoint's
            raise APIError(400, f"the chat template failed on these messages: {' '.join(str(err).split())[:300]}",
                           param="messages") from None
        ids = check_ids(list(ids), "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = P.sampling_params(body, max_tokens=max_tokens, default_max_tokens=max(served.max_model_len - len(ids), 1),
                               logprobs=logprobs, top_logprobs=top)
        check_length(ids, sp.max_tokens, "messages")
        opts = body.stream_options or P.StreamOptions()
        gen = Generation(bridge=bridge, metrics=metrics, tokenizer=tok, model_name=served.name, chat=True,
                         prompts=[ids], params=served.make_params(sp), logprobs=logprobs, top_logprobs=top,
                         tokens_as_ids=bool(body.return_tokens_as_token_ids), include_usage=bool(body.stream and opts.include_usage),
                         continuous_usage=bool(body.stream and opts.continuous_usage_stats))
        result = respond(gen, bool(body.stream), request)
        return result if body.stream else JSONResponse(await result)

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return P.models_body(served.name, served.max_model_len, served.root)

    @app.get("/health")
    async def health():
        if bridge.broken:
            return JSONResponse(errors.error_body(503, f"the engine failed: {bridge.broken}"), status_code=503)
        if bridge.draining:
            return JSONResponse(errors.error_body(503, "draining"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        try:
            metrics.engine_stats(bridge.stats())
        except Exception:  # noqa: BLE001 - a failed engine still shows its last figures
            pass
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _content_text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported (text only)",
                           param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)
