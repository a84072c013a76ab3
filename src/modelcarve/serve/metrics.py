"""The prometheus_client registry behind ``GET /metrics``: what the server and its engine are doing.

One ``CollectorRegistry`` per server (never the global default, so two servers in one process
do not clash). Names follow vLLM's metrics with a ``modelcarve_`` prefix:

    modelcarve_num_requests_running / _waiting         gauges, from the engine's stats
    modelcarve_kv_cache_blocks_used / _free / _total   gauges, paged KV blocks of rank 0's pool
    modelcarve_prefix_cache_hit_rate                   gauge, hits / queries (tokens), 0 before any query
    modelcarve_prefix_cache_queries_total / _hits_total counters (tokens)
    modelcarve_time_to_first_token_seconds             histogram, arrival at the server -> first token
    modelcarve_time_per_output_token_seconds           histogram, (e2e - ttft) / (tokens - 1), per request
    modelcarve_e2e_request_latency_seconds             histogram, arrival -> last token
    modelcarve_prompt_tokens_total / _generation_tokens_total   counters
    modelcarve_request_success_total{finished_reason}  counter (stop, length; abort: cancelled, not in the histograms)
    modelcarve_requests_rejected_total{reason}         counter (queue_full, draining, bad_request)

Every quantity vLLM also exports is exported a second time under vLLM's own name and type, so a
dashboard or autoscaler written for vLLM works unchanged (same ``model_name`` label):

    vllm:num_requests_running / vllm:num_requests_waiting            gauges
    vllm:kv_cache_usage_perc (and the older vllm:gpu_cache_usage_perc) gauge, used / total blocks, 0..1
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total    counters (tokens)
    vllm:num_preemptions_total                                         counter
    vllm:prompt_tokens_total / vllm:generation_tokens_total            counters
    vllm:request_success_total{finished_reason}                        counter
    vllm:time_to_first_token_seconds                                   histogram
    vllm:time_per_output_token_seconds                                 histogram (per request, as ours)
    vllm:e2e_request_latency_seconds                                   histogram
    vllm:request_prompt_tokens / vllm:request_generation_tokens       histograms, per finished request

Not exported (we do not measure them): vLLM's inter-token latency, queue / prefill / decode time
split and iteration token histograms.

The timings are measured on the HTTP side (``time.perf_counter`` when the request was read and
when its tokens were handed to the client), the same span a client sees minus the network, so
``bench-serve``'s figures can be set beside them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: fine near the tiny models' milliseconds, up to minutes for a loaded CPU server
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)

_VLLM = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_preemptions": "vllm:num_preemptions",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
}
"""Our metric -> vLLM's name for the same quantity (same type, same label)."""


class _Both:
    """Two children of two metrics that always move together (ours and vLLM's name)."""

    def __init__(self, *children):
        self.children = children

    def set(self, value):
        for c in self.children:
            c.set(value)

    def inc(self, amount=1):
        for c in self.children:
            c.inc(amount)

    def observe(self, value):
        for c in self.children:
            c.observe(value)


class ServerMetrics:
    """Counters the routes and the engine bridge update; ``render`` is the ``/metrics`` body."""

    def __init__(self, model_name: str):
        self.registry = reg = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=reg)
        self.model = model_name

        def both(kind, name, doc, **kw):
            """Ours and, where vLLM has the quantity, vLLM's name for it, updated together."""
            ours = kind(f"modelcarve_{name}", doc, **kw, **labels).labels(model_name)
            if name not in _VLLM:
                return ours
            return _Both(ours, kind(_VLLM[name], doc, **kw, **labels).labels(model_name))

        def gauge(name, doc):
            return both(Gauge, name, doc)

        def counter(name, doc):
            return both(Counter, name, doc)

        def hist(name, doc):
            return both(Histogram, name, doc, buckets=_TIME_BUCKETS)

        self.running = gauge("num_requests_running", "requests being generated (scheduled in the engine)")
        self.waiting = gauge("num_requests_waiting", "requests admitted but not yet scheduled")
        self.blocks_used = gauge("kv_cache_blocks_used", "paged KV-cache blocks held by requests (rank 0's pool)")
        self.blocks_free = gauge("kv_cache_blocks_free", "paged KV-cache blocks free")
        self.blocks_total = gauge("kv_cache_blocks_total", "paged KV-cache blocks in the pool")
        self.hit_rate = gauge("prefix_cache_hit_rate", "prefix-cache hits / queries, in tokens, since start")
        self.prefix_queries = counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "requests preempted (recomputed later) for lack of blocks")
        self.ttft = hist("time_to_first_token_seconds", "request read -> first token handed to the client")
        self.tpot = hist("time_per_output_token_seconds", "(e2e - ttft) / (generated tokens - 1), per request")
        self.e2e = hist("e2e_request_latency_seconds", "request read -> last token handed to the client")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated for finished requests")
        self._success = Counter("modelcarve_request_success", "finished requests by reason",
                                labelnames=["model_name", "finished_reason"], registry=reg)
        self._vllm_success = Counter("vllm:request_success", "finished requests by reason",
                                     labelnames=["model_name", "finished_reason"], registry=reg)
        self.kv_usage = _Both(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, used / total blocks (1 = 100%)",
                                    **labels).labels(model_name),
                              Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name; 1 = 100%)",
                                    **labels).labels(model_name))
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "prompt tokens per finished request",
                                        buckets=_TOKEN_BUCKETS, **labels).labels(model_name)
        self.request_generation = Histogram("vllm:request_generation_tokens", "generated tokens per finished request",
                                            buckets=_TOKEN_BUCKETS, **labels).labels(model_name)
        self._rejected = Counter("modelcarve_requests_rejected", "requests refused before the engine, by reason",
                                 labelnames=["model_name", "reason"], registry=reg)
        self._seen = dict(queries=0, hits=0, preemptions=0)

    def finished(self, *, reason: str, prompt_tokens: int, generated: int, ttft_s: float | None, e2e_s: float) -> None:
        self._success.labels(self.model, reason).inc()
        self._vllm_success.labels(self.model, reason).inc()
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generated)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if generated > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generated - 1))
        self.e2e.observe(e2e_s)

    def aborted(self) -> None:
        """A request cancelled before it finished (its client went away): counted, not timed."""
        self._success.labels(self.model, "abort").inc()
        self._vllm_success.labels(self.model, "abort").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model, reason).inc()

    def engine_stats(self, stats: dict) -> None:
        """Copy the engine's gauges; its cumulative counts become counter increments."""
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.blocks_used.set(stats.get("kv_blocks_used", 0))
        self.blocks_free.set(stats.get("kv_blocks_free", 0))
        self.blocks_total.set(stats.get("kv_blocks_total", 0))
        total = stats.get("kv_blocks_total", 0)
        self.kv_usage.set(stats.get("kv_blocks_used", 0) / total if total else 0.0)
        for key, metric, seen in (("prefix_cache_queries", self.prefix_queries, "queries"),
                                  ("prefix_cache_hits", self.prefix_hits, "hits"),
                                  ("preemptions", self.preemptions, "preemptions")):
            value = int(stats.get(key, 0))
            if value > self._seen[seen]:
                metric.inc(value - self._seen[seen])
                self._seen[seen] = value
        queries = self._seen["queries"]
        self.hit_rate.set(self._seen["hits"] / queries if queries else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def server_ttft_tpot_means(text: str) -> dict:
    """``{"ttft": (sum, count), "tpot": (sum, count)}`` of the server's TTFT and TPOT histograms in a
    ``/metrics`` body (0s where absent): a client differences two reads around its requests for the
    server's mean over them (``hardware --probe``, benchmarks/serve_predicted_vs_measured.py)."""
    import re

    out = {}
    for key, name in (("ttft", "time_to_first_token_seconds"), ("tpot", "time_per_output_token_seconds")):
        got = [re.search(rf"^modelcarve_{name}_{part}\{{[^}}]*\}} (\S+)$", text, re.M) for part in ("sum", "count")]
        out[key] = tuple(float(g.group(1)) if g else 0.0 for g in got)
    return out


def histogram_mean(before: dict, after: dict, key: str) -> float | None:
    """The server's mean of histogram ``key`` ("ttft" or "tpot") over the observations between two
    ``server_ttft_tpot_means`` reads; None when none was made between them."""
    (s0, c0), (s1, c1) = before[key], after[key]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None
