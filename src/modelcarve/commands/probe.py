"""``modelcarve hardware --probe``: measure this machine as a cluster file the planner reads.

    modelcarve hardware --probe --emit probed.yaml          # 2 local ranks (gloo), their rates and links
    modelcarve hardware --probe --probe-ranks 4 --json
    modelcarve estimate --goal serve-latency --model ./ckpt --cluster probed.yaml --layout "tp=2"

``--probe-ranks`` processes (spawned here, gloo over loopback, ``OMP_NUM_THREADS`` threads each:
the way ``run`` and ``serve`` start their ranks) measure at the same time, each sample started by
all ranks at once (a barrier before each), so the figures are what each rank gets while the
others work too:

* GEMM FLOP/s per dtype (fp32, bf16): ``2 n^3`` over the median time of ``n`` rows through an
  ``n x n`` linear layer as the engine runs it (``n = 512``: the size of a prefill chunk's GEMMs on
  a ~100M model; fp32 weights in oneDNN's blocked layout, ``model_runner.PackedLinear``, which runs
  prefill ~2x faster than the BLAS ``torch.mm`` this probe timed before);
* weight-streaming rate: bytes over the median time of a GEMV as a one-row engine step runs it
  (one row through a 64 MiB fp32 weight held as the engine holds its linears, in oneDNN's blocked
  layout where it packs them: ~51 GB/s on one idle core here where BLAS's ``F.linear`` gemv read
  ~28 GB/s, which priced a decode step ~40% slower than the engine ran it), far larger than the
  caches: what a decode step's weight read achieves;
* memory copy bandwidth: ``2 x bytes / time`` of copying a 64 MiB tensor (read + write, as
  STREAM's copy counts it; reported, not used by the planner);
* gloo all-reduce, all-to-all and send/recv: latency (median time of an 8-byte message, divided
  by the ring's step count as ``plan/cost/comm.py``'s alpha-beta model counts steps: ``2(n-1)`` for
  all-reduce, ``n-1`` for all-to-all, 1 for a send) and bus bandwidth of a 16 MiB message
  (``plan/cost/comm.py``'s bytes per device over the time).

Then, in this process, the engine's own per-step host cost (``engine_overhead``): the engine
(runtime/engine/engine.py, one rank, fp32) decodes one greedy sequence on two tiny random llamas of
1 and 8 layers (``ENGINE_LAYERS``) (hidden 64, vocabulary 512: their arithmetic is microseconds);
the median decode step ``t(L)`` is affine in the layers, ``t(L) = step + L x layer``, so
``layer = (t(L2) - t(L1)) / (L2 - L1)`` and ``step = t(L1) - L1 x layer``: scheduling, block
tables, the plan, sampling and output bookkeeping (``step``) and one layer's kernel launches and
Python (``layer``). Measured at run time, so a faster engine gives smaller figures.

The server pays more per step than the bare engine: its uvicorn thread shares the GIL with the
engine thread, and every step hands its tokens to the event loop and updates the metrics. So the
same two tiny models are then *served* (``served_overhead``: ``modelcarve serve``, tp=1, real
uvicorn on 127.0.0.1, one streaming request at a time, through ``bench-serve``'s own client code,
httpx's async client: a user's client is part of what they see): the median
TPOT a client sees is the served decode step ``t(L)``, fitted the same way, and the median TTFT of
the 1-layer model less its step is ``request_overhead_s``: a request's own path (HTTP read,
admission, waking the engine thread, the first token's delivery and SSE write, the client's parse).
The server's ``/metrics`` TTFT histogram, read around each pass, gives ``http_s``: the client's mean
TTFT less the server's, the part of the path outside the server's clock (``--json`` only: the
benchmark's check of bench-serve against the server holds to it). The cluster file
takes the served figures (the bare engine's stay in ``--json`` beside them). The two models are
served at tp = ``--probe-ranks`` as well (torchrun, as ``serve`` starts them): each layer then adds
two all-reduces, so ``(layer(tp) - layer(1)) / 2`` is one all-reduce as the engine pays it between
layers, ranks computing in between and the server's threads running (through shared memory where
the ranks share the host, runtime/distributed/host_shm.py; through gloo it was ~25x a back-to-back
gloo all-reduce on a loaded 2-core machine: a rank that has lost its core holds the other up); the
link's ``peer_latency_s`` is that over a one-shot all-reduce's 2 steps. The step's fixed cost grows
too, by rank 0's plan broadcast (one gloo message) and the embedding's all-reduce and the logits'
gather: ``step(tp) - step(1) - 2 x all-reduce`` is a gloo message as the served engine pays it,
the link's ``latency_s`` (the gloo loop's figures stay in ``--json``).

The cluster file has one node of ``--probe-ranks`` devices. Its device says what was measured in a
form the planner uses as it is:

* ``peak_flops``: the achieved GEMM rates, ``hbm_bytes_per_s``: the achieved GEMV weight-streaming
  rate, with ``gemm_efficiency: 1.0``: they are achieved rates, so the serving planner applies none
  of its GPU-fitted efficiency models on top (plan/serve/rates.py ``achieved``);
* ``pipeline_action_s``: the pipeline schedule's host time per action, measured with the
  runtime's own GPipe schedule on a tiny llama (commands/probe_pipeline.py), which the pipeline
  timeline model adds after every action (plan/train/pipeline_costs.py);
* ``step_overhead_s`` and ``layer_overhead_s``: the served engine's per-step and per-layer host
  costs, which the serving planner adds to every engine step (plan/serve/rates.py ``engine_step_s``
  and ``layer_overhead_s``); ``request_overhead_s``: the request path, added once to TTFT
  (plan/serve/rates.py ``request_overhead_s``).

The link: ``latency_s`` is a gloo message as the served tp engine pays it and ``peer_latency_s`` its
TP all-reduce per one-shot step (above; without a served tp run, the gloo alpha: latency per ring
step of an 8-byte all-reduce, and no peer latency), and
``bytes_per_s`` is the measured all-reduce bus bandwidth (the beta) divided by
``plan.comm.INTRA_EFFICIENCY`` (the planner multiplies a link's nominal figure by it, so it
predicts what was measured). The per-collective figures (all-to-all, send/recv) are in ``--json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

GEMM_N = 512
GEMV_ROWS, GEMV_COLS = 4096, 4096
"""The GEMV's matrix: 4096 x 4096 fp32 = 64 MiB, far past any CPU cache."""
ENGINE_LAYERS = (1, 8)
ENGINE_DECODE_STEPS = 24
SERVED_REQUESTS, SERVED_PROMPT, SERVED_TOKENS = 8, 16, 24
QUICK_REQUESTS = 2
PROBE_VOCAB = 512
"""The tiny probe models' vocabulary (bench-serve's random prompts are drawn from it)."""
"""``--probe-quick``: measured requests per served model (one pass, one warm-up)."""
TOGETHER_REPS = 24
"""Samples of each rate the ranks time together (``_timed_together``)."""
COPY_BYTES = 64 * 2**20
SMALL_BYTES = 8
LARGE_BYTES = 16 * 2**20


def _timed(fn, *, min_s: float = 0.3, min_reps: int = 3, max_reps: int = 200, reps: int | None = None) -> float:
    """Median seconds of ``fn()`` after one warm-up call, over at least ``min_s`` seconds, or
    exactly ``reps`` calls (collectives: every rank must make the same number of calls)."""
    fn()
    times, start = [], time.perf_counter()
    while (len(times) < reps) if reps else (len(times) < min_reps or (time.perf_counter() - start < min_s
                                                                      and len(times) < max_reps)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed_together(fn, barrier, reps: int = TOGETHER_REPS) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls that every rank starts at once (``barrier``
    before each, outside the timing), after one warm-up: each sample is all ranks running ``fn``
    at the same time, as a layout's ranks run their steps. (Timed over free-running windows, the
    ranks' calls overlapped by chance: the GEMV rate read 14.3 and 20.2 GB/s in two runs on the
    same idle machine, whose served decode step stayed at 33 ms.)"""
    fn()
    times = []
    for _ in range(reps):
        barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _engine_linear(torch, dtype, n_in: int, n_out: int):
    """An ``n_in -> n_out`` linear held as the engine holds it: in oneDNN's blocked layout
    (``model_runner.PackedLinear``) where ``model_runner.packable_dtypes`` packs ``dtype`` on this
    CPU, else a plain ``nn.Linear`` (``F.linear``)."""
    from modelcarve.runtime.engine.model_runner import PackedLinear, packable_dtypes

    lin = torch.nn.Linear(n_in, n_out, bias=False).to(dtype)
    return PackedLinear(lin) if dtype in packable_dtypes() else lin


def _engine_gemm(torch, dtype):
    """A ``GEMM_N``-row step through a ``GEMM_N x GEMM_N`` linear as the engine runs it
    (``_engine_linear``: oneDNN's blocked layout ran fp32 ~2x BLAS sgemm's rate here)."""
    layer = _engine_linear(torch, dtype, GEMM_N, GEMM_N)
    x = torch.randn(GEMM_N, GEMM_N, dtype=dtype)

    def run():
        with torch.no_grad():
            layer(x)

    return run


def _rank(rank: int, world: int, port: int, out, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=120))
        res: dict = dict(rank=rank, gemm_flops={})
        dist.barrier()
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            res["gemm_flops"][name] = 2 * GEMM_N**3 / _timed_together(_engine_gemm(torch, dtype), dist.barrier)
        dist.barrier()
        # the engine's one-row step through the linear as the engine holds it (_engine_linear)
        gemv = _engine_linear(torch, torch.float32, GEMV_COLS, GEMV_ROWS)
        x = torch.randn(1, GEMV_COLS)

        def stream():
            with torch.no_grad():
                gemv(x)

        res["gemv_bytes_per_s"] = GEMV_ROWS * GEMV_COLS * 4 / _timed_together(stream, dist.barrier)
        del gemv, x
        dist.barrier()
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        res["copy_bytes_per_s"] = 2 * COPY_BYTES / _timed_together(lambda: dst.copy_(src), dist.barrier)
        del src, dst
        comm = {}
        for label, nbytes, reps in (("small", SMALL_BYTES, 50), ("large", LARGE_BYTES, 5)):
            n = max(nbytes // 4 // world * world, world)
            buf = torch.ones(n)
            out_buf = torch.empty_like(buf)
            peer = rank ^ 1
            dist.barrier()
            comm[f"all_reduce_{label}_s"] = _timed(lambda: dist.all_reduce(buf), reps=reps)
            dist.barrier()
            comm[f"all_to_all_{label}_s"] = _timed(lambda: dist.all_to_all_single(out_buf, buf), reps=reps)
            dist.barrier()
            if peer < world:
                def pingpong():  # rank 2k <-> 2k+1: even ranks send first
                    if rank % 2 == 0:
                        dist.send(buf, peer)
                        dist.recv(out_buf, peer)
                    else:
                        dist.recv(out_buf, peer)
                        dist.send(buf, peer)

                comm[f"send_recv_{label}_s"] = _timed(pingpong, reps=reps) / 2
            comm[f"{label}_bytes"] = n * 4
            dist.barrier()
        res["comm"] = comm
        from modelcarve.commands.probe_pipeline import action_gaps

        res["pipeline_gaps"] = action_gaps(world)
        out.put((rank, "ok", res))
    except BaseException as err:  # noqa: BLE001 - reported by the parent in one line
        out.put((rank, "error", f"{type(err).__name__}: {err}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(ranks: int = 2, threads: int | None = None, timeout_s: float = 300.0, quick: bool = False) -> dict:
    """Run the probe on ``ranks`` local processes; the medians over ranks of each figure
    (``quick``: the served models' shorter budget, ``served_overhead``)."""
    import multiprocessing as mp
    import queue

    from modelcarve.commands.launching.torchrun import free_port
    from modelcarve.spec.errors import ModelcarveError

    threads = threads or int(os.environ.get("OMP_NUM_THREADS", "1"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, out, threads), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < ranks:
            try:
                rank, status, value = out.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise ModelcarveError(f"hardware --probe: the ranks did not finish within {timeout_s:g} s") from None
            if status != "ok":
                raise ModelcarveError(f"hardware --probe: rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    probe = summarise(list(results.values()), ranks, threads)
    probe["engine"] = engine_overhead(threads)
    probe["served"] = served_overhead(threads, ranks, quick=quick)
    return probe


def _tiny_config(path, layers: int) -> str:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, vocab_size=PROBE_VOCAB,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  hidden_act="silu", torch_dtype="float32")
    out = os.path.join(path, f"tiny-{layers}.json")
    with open(out, "w") as f:
        json.dump(config, f)
    return out


def _decode_step_s(model: str) -> float:
    """Median seconds of one engine decode step (batch 1, greedy) of ``model`` on this process."""
    from modelcarve.runtime.engine.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=model, layout="tp=1,param_dtype=fp32", kv_cache_bytes=4 << 20, quiet=True))
    try:
        engine.add_request("probe", list(range(1, 17)),
                           SamplingParams(max_tokens=ENGINE_DECODE_STEPS + 4, temperature=0.0, ignore_eos=True))
        times = []
        engine.step()  # the prefill
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:] or times)
    finally:
        engine.shutdown()


def engine_overhead(threads: int) -> dict:
    """The engine's per-step and per-layer host seconds (see module doc), from two tiny models."""
    import tempfile

    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        l1, l2 = ENGINE_LAYERS
        m1, m2 = _tiny_config(tmp, l1), _tiny_config(tmp, l2)
        # Interleaved, twice each, the lesser median of each kept: a neighbour's burst on a shared
        # machine lands in one run, not in both.
        t1 = t2 = float("inf")
        for _ in range(2):
            t1 = min(t1, _decode_step_s(m1))
            t2 = min(t2, _decode_step_s(m2))
    return overhead_from_steps(t1, t2, l1, l2)


def _serve_tiny(config: str, port: int, threads: int, tp: int = 1) -> None:
    """A spawned process: ``modelcarve serve`` of ``config`` at ``tp`` (fp32), real uvicorn on
    127.0.0.1:``port``, started as ``commands/serve.py`` starts it: one rank in this process, more
    through torchrun (``serve.server`` on every rank; the first signal goes to rank 0, which drains)."""
    import json
    import tempfile

    import torch

    torch.set_num_threads(threads)
    quiet = os.open(os.devnull, os.O_WRONLY)  # its banner and drain notes would land in --json's stdout
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    payload = dict(model=config, layout=f"tp={tp},param_dtype=fp32", port=port, served_model_name="probe",
                   kv_cache_bytes=4 << 20)
    if tp == 1:
        from modelcarve.serve.server import serve_worker

        serve_worker(**payload)
        return
    from modelcarve.commands.launching.torchrun import Torchrun, launch

    with tempfile.TemporaryDirectory() as tmp:
        payload["pidfile"] = pidfile = os.path.join(tmp, "rank0.pid")
        launch(Torchrun(nproc_per_node=tp), "modelcarve.serve.server", ["serve", json.dumps(payload)], timeout_s=120,
               rank0_pidfile=pidfile, stop_within_s=30)


class _Served:
    """``modelcarve serve`` of ``config`` (``tp`` ranks, fp32, real uvicorn on 127.0.0.1) in a spawned
    process, up from ``__enter__`` (health answered) until ``__exit__`` (SIGTERM: it drains, nothing in
    flight, and exits); ``times()`` measures it."""

    def __init__(self, config: str, threads: int, tp: int = 1):
        self.config, self.threads, self.tp = config, threads, tp
        self.proc, self.url, self.sent = None, None, 0

    def __enter__(self) -> "_Served":
        import multiprocessing as mp

        import httpx

        from modelcarve.commands.launching.torchrun import free_port
        from modelcarve.spec.errors import ModelcarveError

        port = free_port()
        self.proc = mp.get_context("spawn").Process(target=_serve_tiny, args=(self.config, port, self.threads, self.tp))
        self.proc.start()
        self.url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                if not self.proc.is_alive():
                    raise ModelcarveError(f"hardware --probe: serving the probe model failed (exit code {self.proc.exitcode})")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ModelcarveError("hardware --probe: the probe model's server did not start within 180 s")
                time.sleep(0.2)
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

    def times(self, warm: int, requests: int = SERVED_REQUESTS) -> tuple[list[float], list[float], float]:
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
        from modelcarve.serve.metrics import server_ttft_tpot_means
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
        (s0, c0), (s1, c1) = marks["before"]["ttft"], after["ttft"]
        http = statistics.mean(ttft) - (s1 - s0) / (c1 - c0) if c1 > c0 else float("nan")
        return ttft, tpot, http


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
    import contextlib
    import tempfile

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
        up = {(tp, k): servers.enter_context(_Served(model, threads, tp)) for tp in tps for k, model in enumerate(models)}
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
    shares = [h for k in range(len(models)) for h in pooled[1, k][2] if h == h]
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


def overhead_from_steps(t1: float, t2: float, l1: int, l2: int) -> dict:
    """``t(L) = step + L x layer`` through the two measured points (each term at least 1 us: a
    noisy pair must not give a negative cost)."""
    layer = max((t2 - t1) / (l2 - l1), 1e-6)
    step = max(t1 - l1 * layer, 1e-6)
    return dict(step_overhead_s=step, layer_overhead_s=layer, decode_step_s={str(l1): t1, str(l2): t2})


def summarise(per_rank: list[dict], ranks: int, threads: int) -> dict:
    from modelcarve.commands.probe_pipeline import action_s

    med = statistics.median
    gemm = {d: med(r["gemm_flops"][d] for r in per_rank) for d in per_rank[0]["gemm_flops"]}
    comm = {k: med(r["comm"][k] for r in per_rank if k in r["comm"]) for k in per_rank[0]["comm"]}
    n = ranks
    steps = dict(all_reduce=2 * (n - 1), all_to_all=n - 1, send_recv=1)
    bus = dict(all_reduce=2 * (n - 1) / n, all_to_all=(n - 1) / n, send_recv=1.0)
    links = {}
    for op in steps:
        if f"{op}_small_s" not in comm:
            continue
        links[op] = dict(latency_s=comm[f"{op}_small_s"] / max(steps[op], 1),
                         bus_bytes_per_s=bus[op] * int(comm["large_bytes"]) / comm[f"{op}_large_s"],
                         small_s=comm[f"{op}_small_s"], large_s=comm[f"{op}_large_s"])
    return dict(ranks=ranks, threads_per_rank=threads, host=platform.node(), cpu=platform.processor() or platform.machine(),
                gemm_flops=gemm, gemm_n=GEMM_N, copy_bytes_per_s=med(r["copy_bytes_per_s"] for r in per_rank),
                gemv_bytes_per_s=med(r.get("gemv_bytes_per_s", r["copy_bytes_per_s"]) for r in per_rank),
                copy_bytes=COPY_BYTES, links=links, large_bytes=int(comm["large_bytes"]), small_bytes=int(comm["small_bytes"]),
                pipeline_action_s=action_s([r.get("pipeline_gaps", []) for r in per_rank]))


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def cluster_dict(probe: dict) -> dict:
    """The cluster file (spec/hardware.py's format) for what was measured."""
    from modelcarve.plan.cost.comm import INTRA_EFFICIENCY

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    source = (f"measured by modelcarve hardware --probe on {probe['host']} at {when}: {probe['ranks']} ranks x "
              f"{probe['threads_per_rank']} thread(s)")
    ar = probe["links"]["all_reduce"]
    latency, said, peer = float(ar["latency_s"]), "gloo all-reduce latency per ring step", {}
    served_tp = (probe.get("served") or {}).get("tp")
    if served_tp:
        # a gloo message as the served engine pays it (its plan broadcast), and its TP all-reduce
        # between layers (shared memory, runtime/distributed/host_shm.py) over a one-shot's 2 steps
        n = served_tp["tp"]
        latency = float(served_tp["engine_message_s"])
        peer = dict(peer_latency_s=float(served_tp["engine_all_reduce_s"] / 2))
        said = (f"latency of a gloo message as the served tp={n} engine pays it (its plan broadcast); peer latency: "
                f"the served tp={n} engine's all-reduce between layers over a one-shot's 2 steps")
    link = dict(name="gloo-loopback", bytes_per_s=float(ar["bus_bytes_per_s"] / INTRA_EFFICIENCY), latency_s=latency,
                **peer, source=source + f"; all-reduce bus bandwidth / {INTRA_EFFICIENCY}; {said}")
    flops = {k: float(v) for k, v in probe["gemm_flops"].items()}
    flops.setdefault("tf32", flops["fp32"])
    device = dict(name="cpu-probed", memory_bytes=_mem_total() // probe["ranks"], peak_flops=flops,
                  hbm_bytes_per_s=float(probe["gemv_bytes_per_s"]), devices_per_node=probe["ranks"],
                  nics_per_node=1, gemm_efficiency=1.0, source=source)
    if probe.get("pipeline_action_s"):
        device.update(pipeline_action_s=float(probe["pipeline_action_s"]))
    host = probe.get("served") or probe.get("engine")  # what the server pays, else the bare engine
    if host:
        device.update(step_overhead_s=float(host["step_overhead_s"]), layer_overhead_s=float(host["layer_overhead_s"]))
        if "request_overhead_s" in host:
            device.update(request_overhead_s=float(host["request_overhead_s"]))
    return dict(nodes=1, devices_per_node=probe["ranks"], device=device, intra_link=link, inter_link=dict(link),
                nics_per_node=1)


def run_probe(args) -> int:
    from modelcarve.spec.errors import ModelcarveError
    from modelcarve.spec.hardware import cluster_from_dict

    ranks = getattr(args, "probe_ranks", 2) or 2
    if ranks < 1:
        raise ModelcarveError(f"--probe-ranks must be at least 1, got {ranks}")
    if ranks < 2:
        raise ModelcarveError("--probe-ranks 1 cannot measure links; use 2 or more")
    probe = measure(ranks, quick=bool(getattr(args, "probe_quick", False)))
    cluster = cluster_dict(probe)
    cluster_from_dict(cluster, "probed cluster")  # what is written must read back
    if args.emit:
        import yaml

        with open(args.emit, "w") as f:
            f.write(f"# {cluster['device']['source']}\n# modelcarve estimate ... --cluster {args.emit}\n")
            yaml.safe_dump(cluster, f, sort_keys=False)
    if args.json:
        print(json.dumps(dict(probe=probe, cluster=cluster), indent=2))
        return 0
    from rich.table import Table

    from modelcarve.report.tables import console

    t = Table(title=f"hardware --probe: {probe['ranks']} ranks x {probe['threads_per_rank']} thread(s) on {probe['host']}")
    for col in ("measured", "value"):
        t.add_column(col, justify="left" if col == "measured" else "right")
    for d, v in probe["gemm_flops"].items():
        t.add_row(f"GEMM {d} ({probe['gemm_n']}^3), per rank", f"{v / 1e9:,.1f} GFLOP/s")
    t.add_row("memory copy (read+write), per rank", f"{probe['copy_bytes_per_s'] / 1e9:,.2f} GB/s")
    t.add_row("GEMV weight streaming, per rank", f"{probe['gemv_bytes_per_s'] / 1e9:,.2f} GB/s")
    if "engine" in probe:
        t.add_row("engine step, fixed host cost", f"{probe['engine']['step_overhead_s'] * 1e3:,.2f} ms")
        t.add_row("engine step, host cost per layer", f"{probe['engine']['layer_overhead_s'] * 1e3:,.3f} ms")
    if "tp" in probe.get("served", {}):
        t.add_row(f"served tp={probe['served']['tp']['tp']} all-reduce between layers",
                  f"{probe['served']['tp']['engine_all_reduce_s'] * 1e6:,.1f} us")
        t.add_row(f"served tp={probe['served']['tp']['tp']} gloo message (plan broadcast)",
                  f"{probe['served']['tp']['engine_message_s'] * 1e6:,.1f} us")
    if "served" in probe:
        t.add_row("served step, fixed host cost", f"{probe['served']['step_overhead_s'] * 1e3:,.2f} ms")
        t.add_row("served step, host cost per layer", f"{probe['served']['layer_overhead_s'] * 1e3:,.3f} ms")
        t.add_row("served request path (HTTP, admission, delivery)", f"{probe['served']['request_overhead_s'] * 1e3:,.2f} ms")
        if probe["served"].get("http_s") is not None:
            t.add_row("served HTTP share (client TTFT - server's histogram TTFT)", f"{probe['served']['http_s'] * 1e3:,.2f} ms")
    for op, v in probe["links"].items():
        t.add_row(f"gloo {op.replace('_', '-')}: latency per step", f"{v['latency_s'] * 1e6:,.1f} us")
        t.add_row(f"gloo {op.replace('_', '-')}: bus bandwidth ({probe['large_bytes'] >> 20} MiB)",
                  f"{v['bus_bytes_per_s'] / 1e9:,.2f} GB/s")
    console().print(t)
    if args.emit:
        console().print(f"wrote {args.emit} (use it as --cluster {args.emit})")
    return 0
