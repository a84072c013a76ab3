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
  a ~100M model; weights packed as the engine packs them, ``model_runner.PackedLinear`` (its native
  kernel, runtime/engine/native.py, where built, else oneDNN's blocked layout), which runs
  prefill ~2x faster than the BLAS ``torch.mm`` this probe timed before);
* weight-streaming rate: bytes over the median time of a GEMV as a one-row engine step runs it
  (one row through a 64 MiB fp32 weight held as the engine holds its linears, packed as
  ``PackedLinear`` packs it: with oneDNN's blocked layout ~51 GB/s on one idle core here where
  BLAS's ``F.linear`` gemv read ~28 GB/s, which priced a decode step ~40% slower than the engine
  ran it), far larger than the caches: what a decode step's weight read achieves;
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
  runtime's own GPipe schedule on a tiny llama (commands/probe/pipeline.py), which the pipeline
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

from modelcarve.commands.probe.served import ENGINE_LAYERS, _tiny_config, overhead_from_steps, served_overhead

GEMM_N = 512
GEMV_ROWS, GEMV_COLS = 4096, 4096
"""The GEMV's matrix: 4096 x 4096 fp32 = 64 MiB, far past any CPU cache."""
ENGINE_DECODE_STEPS = 24
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
    """An ``n_in -> n_out`` linear held as the engine holds it: packed (native kernel or oneDNN's layout)
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
        from modelcarve.commands.probe.pipeline import action_gaps

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


def summarise(per_rank: list[dict], ranks: int, threads: int) -> dict:
    from modelcarve.commands.probe.pipeline import action_s

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
    from modelcarve.commands.launching.prelaunch import meminfo_bytes

    total = meminfo_bytes("MemTotal")
    return total if total is not None else 16 * 2**30


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
