"""``hardware --probe``'s served measurements: the tiny probe models under ``modelcarve serve``.

``served_overhead`` serves commands/probe/machine.py's two tiny models (1 and 8 layers) at tp=1 and at tp =
``--probe-ranks`` (``_Served``: a real server in a spawned process, torchrun for tp > 1, as
``serve`` starts it) and times them through bench-serve's own client (one request at a time): the
served step's fixed and per-layer host costs, the request path, the HTTP share outside the
server's clock (its ``/metrics`` histogram read around each pass) and, from tp over tp=1, the TP
all-reduce and the gloo message as the served engine pays them. commands/probe/machine.py's module doc
says how each figure is fitted and where the cluster file takes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

ENGINE_LAYERS = (1, 8)
SERVED_REQUESTS, SERVED_PROMPT, SERVED_TOKENS = 8, 16, 24
QUICK_REQUESTS = 2
"""``--probe-quick``: measured requests per served model (one pass, one warm-up)."""
PROBE_VOCAB = 512
"""The tiny probe models' vocabulary (bench-serve's random prompts are drawn from it)."""


def _tiny_config(path, layers: int) -> str:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, vocab_size=PROBE_VOCAB,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  hidden_act="silu", torch_dtype="float32")
    out = os.path.join(path, f"tiny-{layers}.json")
    with open(out, "w") as f:
        json.dump(config, f)
    return out


def overhead_from_steps(t1: float, t2: float, l1: int, l2: int) -> dict:
    """``t(L) = step + L x layer`` through the two measured points (each term at least 1 us: a
    noisy pair must not give a negative cost)."""
    layer = max((t2 - t1) / (l2 - l1), 1e-6)
    step = max(t1 - l1 * layer, 1e-6)
    return dict(step_overhead_s=step, layer_overhead_s=layer, decode_step_s={str(l1): t1, str(l2): t2})


def _serve_tiny(config: str, port: int, threads: int, tp: int = 1, log: str = os.devnull) -> None:
    """A spawned process: ``modelcarve serve`` of ``config`` at ``tp`` (fp32), real uvicorn on
    127.0.0.1:``port``, started as ``commands/serve.py`` starts it: one rank in this process, more
    through torchrun (``serve.server`` on every rank; the first signal goes to rank 0, which drains).
    Its output goes to ``log`` (``_Served.ready`` quotes its end if the server dies); its exit code is
    the server's (torchrun's at tp > 1)."""
    import torch

    torch.set_num_threads(threads)
    quiet = os.open(os.devnull, os.O_WRONLY)  # its banner and drain notes would land in --json's stdout
    os.dup2(quiet, 1)
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    payload = dict(model=config, layout=f"tp={tp},param_dtype=fp32", port=port, served_model_name="probe",
                   kv_cache_bytes=4 << 20)
    if tp == 1:
        from modelcarve.serve.server import serve_worker

        serve_worker(**payload)
        return
    from modelcarve.commands.launching.torchrun import Torchrun, launch

    with tempfile.TemporaryDirectory() as tmp:
        payload["pidfile"] = pidfile = os.path.join(tmp, "rank0.pid")
        code = launch(Torchrun(nproc_per_node=tp), "modelcarve.serve.server", ["serve", json.dumps(payload)],
                      timeout_s=120, rank0_pidfile=pidfile, stop_within_s=30)
    if code:
        sys.exit(code)


class _Served:
    """``modelcarve serve`` of ``config`` (``tp`` ranks, fp32, real uvicorn on 127.0.0.1) in a spawned
    process, up from ``__enter__`` (health answered) until ``__exit__`` (SIGTERM: it drains, nothing in
    flight, and exits); ``times()`` measures it."""

    def __init__(self, config: str, threads: int, tp: int = 1):
        self.config, self.threads, self.tp = config, threads, tp
        self.proc, self.url, self.sent, self.log = None, None, 0, None

    def start(self) -> "_Served":
        """Spawn the server (it imports and loads on its own: several start side by side)."""
        import multiprocessing as mp

        from modelcarve.commands.launching.torchrun import free_port

        port = free_port()
        fd, self.log = tempfile.mkstemp(prefix="modelcarve-probe-serve-", suffix=".log")
        os.close(fd)
        self.proc = mp.get_context("spawn").Process(target=_serve_tiny,
                                                     args=(self.config, port, self.threads, self.tp, self.log))
        self.proc.start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def ready(self) -> "_Served":
        """Wait until the server answers /health (180 s at most); refuse in one line if it died."""
        import httpx

        from modelcarve.spec.errors import ModelcarveError

        deadline = time.monotonic() + 180
        while True:
            if not self.proc.is_alive():
                raise ModelcarveError(f"hardware --probe: serving the probe model (tp={self.tp}) failed (exit code "
                                      f"{self.proc.exitcode}){self._last_words()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ModelcarveError("hardware --probe: the probe model's server did not start within 180 s")
            time.sleep(0.2)

    def __enter__(self) -> "_Served":
        self.start()
        try:
            return self.ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()  # SIGTERM: the server drains (nothing in flight) and exits
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None
        if self.log is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log)
            self.log = None

    def _last_words(self) -> str:
        """``: <the server's last lines>`` (its ``modelcarve:`` errors and the launcher's report), or ``""``."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except (OSError, TypeError):
            return ""
        return (": " + " | ".join(lines[-6:]))[-1500:] if lines else ""

    def times(self, warm: int, requests: int = SERVED_REQUESTS) -> tuple[list[float], list[float], float | None]:
        """(TTFT, TPOT) seconds per request and the pass's HTTP share, as ``bench-serve``'s client sees
        them: its own request code (serve/bench.py ``run_bench``, httpx's async client, streaming),
        one request at a time, ``SERVED_PROMPT`` random prompt tokens (a seed of their own each pass:
        no prefix-cache hit), ``SERVED_TOKENS`` out; ``warm`` requests first, sent and dropped, then
        ``requests`` measured. The HTTP share is the client's mean TTFT less the server's over the
        same requests (its ``/metrics`` TTFT histogram, read before and after): the request's path
        outside the server's span (sending, the HTTP read before the server's clock starts, the
        first chunk's way back and the client's parse of it). Measured with bench-serve's client
        because a user's client is part of what they see: the earlier sync client read ~1-1.5 ms
        less a request than the async one (both against the same server)."""
        import asyncio

        import httpx

        from modelcarve.serve.bench import BenchConfig, run_bench
        from modelcarve.serve.metrics import histogram_mean, server_ttft_tpot_means
        from modelcarve.spec.errors import ModelcarveError

        def metrics() -> dict:
            return server_ttft_tpot_means(httpx.get(f"{self.url}/metrics", timeout=10).text)

        seen, marks = [], {}

        def done(result) -> None:  # between requests (one in flight): the warm-ups end here
            seen.append(result)
            if len(seen) == warm:
                marks["before"] = metrics()

        self.sent += 1
        cfg = BenchConfig(url=self.url, model="probe", num_prompts=warm + requests, input_len=SERVED_PROMPT,
                          output_len=SERVED_TOKENS, concurrency=1, vocab_size=PROBE_VOCAB, seed=1000 + self.sent)
        if not warm:
            marks["before"] = metrics()
        asyncio.run(run_bench(cfg, on_done=done))  # one client: the warm-ups open its connection
        after = metrics()
        results = [r for r in seen[warm:] if r.ok and len(r.token_times_s) >= 2]
        if not results:
            raise ModelcarveError("hardware --probe: the probe model's server streamed no tokens")
        ttft = [r.ttft_s for r in results]
        tpot = [(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1) for r in results]
        server = histogram_mean(marks["before"], after, "ttft")
        return ttft, tpot, None if server is None else statistics.mean(ttft) - server


def served_overhead(threads: int, tp_ranks: int = 2, quick: bool = False) -> dict:
    """The server's per-step, per-layer and per-request host seconds, from serving the tiny models
    (see module doc): the decode step as served ``t(L)`` = the median TPOT, affine in the layers as
    ``engine_overhead``'s; ``request_overhead_s`` = TTFT(L1) - t(L1): a tiny model's prefill step
    costs what its decode step does (host work; its arithmetic is microseconds), so the rest of its
    TTFT is the request's own path (HTTP read, admission, waking the engine thread, the first
    token's delivery and SSE write, the client's read).

    With ``tp_ranks`` >= 2 the same two models are served at tp = ``tp_ranks`` too: each layer then
    adds two all-reduces of one token's hidden state (attention and MLP outputs), so
    ``engine_all_reduce_s = (layer(tp) - layer(1)) / 2``: an all-reduce as the engine pays it between
    layers (ranks computing in between, the server's threads running), which a back-to-back gloo
    loop does not see.

    ``quick`` (``hardware --probe --probe-quick``, for smoke tests): one pass of ``QUICK_REQUESTS``
    requests after one warm-up per server instead of two passes of ``SERVED_REQUESTS``; the same
    servers and fits, from fewer samples."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        l1, l2 = ENGINE_LAYERS
        models = (_tiny_config(tmp, l1), _tiny_config(tmp, l2))
        tps = (1, tp_ranks) if tp_ranks >= 2 else (1,)
        # Every server started once and kept up (idle ones cost nothing but tp's heartbeat step a
        # second); two passes over them, interleaved, the requests of both pooled and their median
        # kept. (Not the lesser of the two passes' medians, as before: that is biased low where the
        # spread is the machine's own, not a neighbour's -- the served tp=2 step's all-reduces vary
        # 0.9-2.0 ms a call here from one minute to the next -- and tp=2 was priced under what the
        # server then ran.)
        # started side by side (each spawns and imports on its own), then each waited for; every one is
        # stopped on the way out, whichever fails
        up = {(tp, k): _Served(model, threads, tp) for tp in tps for k, model in enumerate(models)}
        for server in up.values():
            servers.push(server)
            server.start()
        for server in up.values():
            server.ready()
        pooled = {key: ([], [], []) for key in up}
        for attempt in range(1 if quick else 2):
            for key, server in up.items():
                ttft, tpot, http = server.times(warm=2 if attempt == 0 and not quick else 1,
                                                requests=QUICK_REQUESTS if quick else SERVED_REQUESTS)
                pooled[key][0].extend(ttft)
                pooled[key][1].extend(tpot)
                pooled[key][2].append(http)
        best = {key: (statistics.median(ttft), statistics.median(tpot)) for key, (ttft, tpot, _) in pooled.items()}
    (f1, t1), (f2, t2) = best[1, 0], best[1, 1]
    fit = overhead_from_steps(t1, t2, l1, l2)
    # the HTTP share of every tp=1 pass (both models: the path outside the server does not depend on it)
    shares = [h for k in range(len(models)) for h in pooled[1, k][2] if h is not None]
    fit.update(request_overhead_s=max(f1 - t1, 1e-6), ttft_s={str(l1): f1, str(l2): f2},
               http_s=statistics.mean(shares) if shares else None, http_passes_s=shares)
    if tp_ranks >= 2:
        tp_fit = overhead_from_steps(best[tp_ranks, 0][1], best[tp_ranks, 1][1], l1, l2)
        all_reduce = max((tp_fit["layer_overhead_s"] - fit["layer_overhead_s"]) / 2, 1e-6)
        fit["tp"] = dict(tp_fit, tp=tp_ranks, ttft_s={str(l1): best[tp_ranks, 0][0], str(l2): best[tp_ranks, 1][0]},
                         engine_all_reduce_s=all_reduce, engine_message_s=engine_message_s(fit, tp_fit, all_reduce))
    return fit


def engine_message_s(fit: dict, tp_fit: dict, all_reduce_s: float) -> float:
    """One gloo message as the served tp engine pays it: a tp step's fixed cost over tp=1's is rank
    0's plan broadcast (one message at tp=2: ``ModelRunner.broadcast``) plus the step's two TP
    collectives outside the layers (the vocabulary-parallel embedding's all-reduce, the logits'
    gather), which cost an ``all_reduce_s`` each: ``step(tp) - step(1) - 2 all_reduce`` (at least
    1 us)."""
    return max(tp_fit["step_overhead_s"] - fit["step_overhead_s"] - 2 * all_reduce_s, 1e-6)
