"""``modelcarve bench-serve``'s load and statistics: streamed completions over HTTP, timed per token.

Only the OpenAI HTTP API is used (``POST /v1/completions`` with ``stream``, ``ignore_eos`` and
``stream_options.include_usage``, as vLLM's own benchmark sends them), so any OpenAI-compatible
server can be measured, vLLM included. Arrivals are open-loop Poisson at ``rate`` requests/s
(exponential gaps from a seeded generator) or a fixed ``concurrency`` in flight; prompts are
random token ids of ``input_len`` (ids below ``vocab_size``) or read from a JSONL file.

Definitions (per request, client clock ``time.perf_counter``):
    TTFT  send -> the first streamed chunk carrying a token
    ITL   gaps between successive token-carrying chunks
    TPOT  (E2E - TTFT) / (output tokens - 1), requests with more than one token
    E2E   send -> the end of the stream
Output tokens are the server's ``usage.completion_tokens`` (the chunks counted if it sends none).
Goodput is requests/s that met both ``ttft_ms`` and ``tpot_ms``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """One request as the client saw it."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    """token-carrying chunk times, seconds since the benchmark started"""
    start_s: float = 0.0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(kw_only=True)
class BenchConfig:
    url: str
    model: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    rate: float | None = None
    concurrency: int | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    prompts_file: str | None = None
    vocab_size: int = 100
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0


def make_prompts(cfg: BenchConfig) -> list[tuple[object, int, int]]:
    """(prompt as text or ids, its length in tokens or -1 if text, max_tokens) per request."""
    rng = random.Random(cfg.seed)
    if cfg.prompts_file:
        rows = []
        with open(cfg.prompts_file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{cfg.prompts_file}:{n}: not JSON ({err.msg})") from None
                prompt = row.get("prompt", row.get("prompt_token_ids", row.get("prompt_ids")))
                if prompt is None:
                    raise ValueError(f"{cfg.prompts_file}:{n}: needs 'prompt' (text) or 'prompt_token_ids'")
                out = int(row.get("output_len", row.get("max_tokens", cfg.output_len)))
                rows.append((prompt, len(prompt) if isinstance(prompt, list) else -1, out))
        if not rows:
            raise ValueError(f"{cfg.prompts_file} has no prompts")
        return [rows[i % len(rows)] for i in range(cfg.num_prompts)]
    return [([rng.randrange(cfg.vocab_size) for _ in range(cfg.input_len)], cfg.input_len, cfg.output_len)
            for _ in range(cfg.num_prompts)]


async def _one(client, cfg: BenchConfig, model: str, prompt, prompt_len: int, max_tokens: int, t0: float) -> RequestResult:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                min_tokens=max_tokens, stream=True, stream_options=dict(include_usage=True))
    res = RequestResult(ok=False, prompt_len=prompt_len)
    start = time.perf_counter()
    res.start_s = start - t0
    chunks, last, usage = 0, None, None
    try:
        async with client.stream("POST", f"{cfg.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    res.error = str(payload["error"].get("message", payload["error"]))[:200]
                    return res
                usage = payload.get("usage") or usage
                choices = payload.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("token_ids")):
                    continue
                now = time.perf_counter()
                chunks += 1
                res.token_times_s.append(now - t0)
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
            res.e2e_s = time.perf_counter() - start
            res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
            res.ok = done and res.ttft_s is not None
            if not res.ok:
                res.error = "the stream ended without [DONE]" if not done else "no token was streamed"
    except Exception as err:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(err).__name__}: {err}"[:200]
    return res


async def _model_name(client, url: str) -> str:
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_bench(cfg: BenchConfig, on_done=None) -> tuple[list[RequestResult], float]:
    """Send every request; ``on_done(result)`` after each. Returns the results and the duration (s)."""
    import httpx

    prompts = make_prompts(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), headers=headers, limits=limits) as client:
        model = cfg.model = cfg.model or await _model_name(client, cfg.url)  # the summary names what it measured
        t0 = time.perf_counter()

        async def task(item):
            result = await _one(client, cfg, model, *item, t0)
            if on_done:
                on_done(result)
            return result

        if cfg.concurrency:
            queue = list(reversed(prompts))
            results: list[RequestResult] = []

            async def worker():
                while queue:
                    results.append(await task(queue.pop()))

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(prompts)))))
        else:
            rng = random.Random(cfg.seed + 1)
            tasks = []
            for item in prompts:
                tasks.append(asyncio.create_task(task(item)))
                if cfg.rate and cfg.rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(cfg.rate))
            results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    ms = [v * 1e3 for v in values]
    return dict(mean=sum(ms) / len(ms) if ms else None, p50=percentile(ms, 50), p90=percentile(ms, 90),
                p99=percentile(ms, 99), n=len(ms))


def summarise(results: list[RequestResult], duration_s: float, cfg: BenchConfig) -> dict:
    """Throughput, latency percentiles (milliseconds) and goodput, as JSON-ready data."""
    ok = [r for r in results if r.ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    good = None
    if cfg.ttft_ms is not None or cfg.tpot_ms is not None:
        good = sum(1 for r in ok if (cfg.ttft_ms is None or r.ttft_s * 1e3 <= cfg.ttft_ms)
                   and (cfg.tpot_ms is None or r.tpot_s is None or r.tpot_s * 1e3 <= cfg.tpot_ms))
    errors = [r.error for r in results if not r.ok]
    return dict(
        url=cfg.url, model=cfg.model, num_prompts=len(results), completed=len(ok), failed=len(results) - len(ok),
        errors=errors[:5], input_len=cfg.input_len, output_len=cfg.output_len,
        rate=cfg.rate, concurrency=cfg.concurrency, duration_s=duration_s,
        request_throughput=len(ok) / duration_s if duration_s else 0.0,
        output_throughput=out_tokens / duration_s if duration_s else 0.0,
        total_input_tokens=sum(max(r.prompt_len, 0) for r in ok), total_output_tokens=out_tokens,
        ttft_ms=_dist([r.ttft_s for r in ok]), tpot_ms=_dist(tpots),
        itl_ms=_dist([x for r in ok for x in r.itl_s]), e2e_ms=_dist([r.e2e_s for r in ok]),
        sla=dict(ttft_ms=cfg.ttft_ms, tpot_ms=cfg.tpot_ms, good_requests=good,
                 goodput=(good / duration_s if duration_s else 0.0) if good is not None else None),
        requests=[dict(asdict(r), tpot_s=r.tpot_s) for r in results],
    )
