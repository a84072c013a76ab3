"""Predicted vs measured TTFT and TPOT: the planner on this machine's probed cluster against the server.

    python benchmarks/serve_predicted_vs_measured.py            # ~100M llama, single / tp2 / pp2, two rates each
    python benchmarks/serve_predicted_vs_measured.py --quick    # a ~3M model, one short run per layout and rate

For a random-weight llama-shaped checkpoint (hidden 768, 12 layers, 12 heads, 2048 FFN, vocab
16000 tied: 97M parameters; fp32, since this CPU's bf16 GEMMs run ~30x slower than fp32):

1. ``modelcarve hardware --probe --emit probed.yaml`` measures this machine (2 gloo ranks);
2. for each layout, ``modelcarve serve`` runs it (real uvicorn on 127.0.0.1) and
   ``modelcarve bench-serve --rate R --json`` sends Poisson load at two rates;
3. ``modelcarve estimate --goal serve-latency --cluster probed.yaml --layout L --input-len I
   --output-len O --rate R --json`` predicts TTFT (with queueing, plan/serve/queue.py, where the
   estimate has ``--rate``; without it the unloaded TTFT) and TPOT for the same workload.

Measured figures are bench-serve's medians (p50, client clock: TTFT = send -> first token, TPOT =
(e2e - TTFT) / (tokens - 1) per request); ratios are predicted / measured p50, for both goals
(``serve-latency`` and ``serve-throughput``: at a rate both cost the batch the rate sustains). Each row
records the 1-minute load average when it finished; a row, and the run, is ``not quiet`` above
``QUIET_LOAD`` (1.5): its timings are the neighbours' as much as the server's.

Each row also sets bench-serve's TTFT beside the server's own ``/metrics`` histograms (the same
requests: sum and count deltas around the run, so means): the server's span (request read -> first
token handed to the client, its queueing included) lies inside the client's, and the client adds
only the HTTP path: ``0 <= client - server``. The probe measures that share with bench-serve's own
client on its tiny served models (``hardware --probe --json``: ``served.http_s``), so the upper
bound is the probe's share with the 25% every prediction here is held to (``HTTP_ALLOWANCE``).
Recorded, not asserted.
Results go to ``benchmarks/results/serve_predicted_vs_measured.json`` (``--quick``:
``serve_predicted_vs_measured_quick.json``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
CLI = [sys.executable, "-m", "modelcarve.cli"]
QUIET_LOAD = 1.5
"""A 1-minute load average above this marks a row (and the run) not quiet."""
GOALS = ("serve-latency", "serve-throughput")
HTTP_ALLOWANCE = 1.25
"""The HTTP share (client - server mean TTFT) is held within 25% of the probe's (the issue's tolerance
for every predicted figure): the same client code and server, a smaller model."""


def build_model(path: Path, quick: bool) -> str:
    import torch
    import transformers

    dims = (dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=4000) if quick else
            dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, vocab_size=16000))
    config = transformers.LlamaConfig(**dims, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, layout: str, kv_bytes: int):
    import httpx

    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--model", model, "--layout", layout, "--port", str(port),
                             "--served-model-name", "bench", "--kv-cache-bytes", str(kv_bytes), "--timeout", "1800"],
                            env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve {layout} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"serve {layout} not ready")


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


_SEEDS = itertools.count(1)


def bench(url: str, rate: float, n: int, input_len: int, output_len: int, vocab: int) -> dict:
    """One ``bench-serve`` run. Each run draws its prompts with a seed of its own: bench-serve's
    prompts come from a seeded generator, so runs with one seed send the same prompts, and the
    server's prefix cache then answers a later run's prompts from the KV blocks of an earlier one
    (the heavier-rate rows measured TTFT ~40% below the prefill's time that way); the planner
    prices prompts that are not cached."""
    out = subprocess.run([*CLI, "bench-serve", "--url", url, "--model", "bench", "--num-prompts", str(n),
                          "--input-len", str(input_len), "--output-len", str(output_len), "--rate", str(rate),
                          "--vocab-size", str(vocab), "--seed", str(next(_SEEDS)), "--json"],
                         env=ENV, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bench-serve failed: {out.stderr[-2000:]}")
    summary = json.loads(out.stdout)
    summary.pop("requests", None)
    return summary


def cluster_for(probed: str, world: int, path: Path) -> str:
    """The probed cluster cut to the layout's ranks, so ``estimate`` adds no replicas the server lacks."""
    import yaml

    raw = yaml.safe_load(probed)
    raw["devices_per_node"] = world
    raw["device"]["devices_per_node"] = world
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def metrics(url: str) -> dict:
    import httpx

    from modelcarve.serve.metrics import server_ttft_tpot_means

    return server_ttft_tpot_means(httpx.get(f"{url}/metrics", timeout=10).text)


def estimate(model: str, cluster: str, layout: str, rate: float, input_len: int, output_len: int,
             goal: str = "serve-latency") -> dict:
    base = [*CLI, "estimate", "--goal", goal, "--model", model, "--cluster", cluster, "--layout", layout,
            "--input-len", str(input_len), "--output-len", str(output_len), "--json"]
    out = subprocess.run(base + ["--rate", str(rate)], env=ENV, cwd=REPO, capture_output=True, text=True)
    queued = True
    if out.returncode and "--rate" in out.stderr:
        out = subprocess.run(base, env=ENV, cwd=REPO, capture_output=True, text=True)
        queued = False
    try:
        result = json.loads(out.stdout)
    except json.JSONDecodeError:
        return dict(error=(out.stderr or out.stdout)[-500:])
    serve_t = result.get("serve") or {}
    queue = result.get("queue") or {}
    return dict(goal=goal, ttft_s=queue.get("ttft_s", serve_t.get("ttft_s")), tpot_s=serve_t.get("tpot_s"),
                prefill_s=serve_t.get("prefill_s"), batch=serve_t.get("batch"), queue_wait_s=queue.get("wait_s"),
                weight_dtype=(result.get("layout") or {}).get("weight_dtype"), parts=serve_t.get("decode_parts_s"),
                unloaded_ttft_s=serve_t.get("ttft_s"), queueing_modelled=queued and bool(queue),
                utilisation=queue.get("utilisation"), fits=result.get("fits"), reject=result.get("reject_reason"))


def server_check(measured: dict, before: dict, after: dict, probe_http_s: float | None) -> dict:
    """bench-serve's mean TTFT against the server's histogram mean over the same requests (see module doc):
    the difference is the HTTP share, held to ``[0, HTTP_ALLOWANCE x the probe's]``."""
    from modelcarve.serve.metrics import histogram_mean

    server = histogram_mean(before, after, "ttft")
    if server is None:
        return dict(error="no TTFT observations in the server's histogram")
    client = measured["ttft_ms"]["mean"] / 1e3
    bound = HTTP_ALLOWANCE * probe_http_s if probe_http_s is not None else None
    return dict(client_ttft_mean_s=client, server_ttft_mean_s=server, http_s=client - server,
                probe_http_s=probe_http_s, bound_s=[0.0, bound],
                within=None if bound is None else 0.0 <= client - server <= bound,
                server_tpot_mean_s=histogram_mean(before, after, "tpot"),
                client_tpot_mean_s=measured["tpot_ms"]["mean"] / 1e3, requests=after["ttft"][1] - before["ttft"][1])


def _run(args, n, input_len, output_len, fractions, rows, meta) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model, meta["params"] = build_model(Path(tmp) / "model", args.quick)
        cluster = str(Path(tmp) / "probed.yaml")
        got = subprocess.run([*CLI, "hardware", "--probe", "--emit", cluster, "--json"], env=ENV, cwd=REPO, check=True,
                             stdout=subprocess.PIPE, text=True)
        served = json.loads(got.stdout)["probe"].get("served") or {}
        probed = meta["probed"] = Path(cluster).read_text()
        meta["probe_http_s"], meta["probe_http_passes_s"] = served.get("http_s"), served.get("http_passes_s")
        vocab = 4000 if args.quick else 16000
        for short in args.layouts.split(","):
            # only param_dtype stated: the engine and `estimate --goal serve-*` both default the weight
            # and KV dtypes to it (commands/serve_cli.engine_dtypes), so the two sides agree on their own
            layout = f"{short},param_dtype=fp32"
            proc, url = serve(model, layout, 256 << 20)
            try:
                rates = [float(r) for r in args.rates.split(",")] if args.rates else None
                # one request first: the server's first forward pays one-off costs (allocator, lazy
                # initialisation) that neither the capacity estimate nor the measured rows should see
                bench(url, 1000.0, 1, input_len, output_len, vocab)
                if rates is None:  # a light and a heavier load for this layout (--load: 15% and 50% of one-at-a-time capacity)
                    probe = bench(url, 1000.0, 2, input_len, output_len, vocab)
                    e2e = probe["e2e_ms"]["mean"] / 1e3
                    rates = [round(f / e2e, 3) for f in fractions]
                for rate in rates:
                    before = metrics(url)
                    measured = bench(url, rate, n, input_len, output_len, vocab)
                    after = metrics(url)
                    load = os.getloadavg()[0]
                    world = 2 if short != "tp=1" else 1
                    per_layout = cluster_for(probed, world, Path(tmp) / f"cluster-{world}.yaml")
                    row = dict(layout=short, rate_rps=rate, load_average_1m=load, quiet=load <= QUIET_LOAD,
                               measured_ttft_p50_s=measured["ttft_ms"]["p50"] / 1e3,
                               measured_tpot_p50_s=measured["tpot_ms"]["p50"] / 1e3, measured=measured)
                    row["server_check"] = server_check(measured, before, after, meta.get("probe_http_s"))
                    for goal in GOALS:
                        predicted = estimate(model, per_layout, layout, rate, input_len, output_len, goal)
                        row[goal] = predicted
                        if predicted.get("ttft_s") and predicted.get("tpot_s"):
                            predicted["ttft_ratio"] = predicted["ttft_s"] / row["measured_ttft_p50_s"]
                            predicted["tpot_ratio"] = predicted["tpot_s"] / row["measured_tpot_p50_s"]
                            predicted["within_25pct"] = all(abs(predicted[k] - 1) <= 0.25 for k in ("ttft_ratio", "tpot_ratio"))
                    rows.append(row)
                    lat = row["serve-latency"]
                    print(f"{short:6} {rate:7.3f} req/s  p50 TTFT measured {row['measured_ttft_p50_s'] * 1e3:8.1f} ms  "
                          f"predicted {(lat.get('ttft_s') or 0) * 1e3:8.1f} ms   p50 TPOT measured "
                          f"{row['measured_tpot_p50_s'] * 1e3:7.1f} ms  predicted {(lat.get('tpot_s') or 0) * 1e3:7.1f} ms"
                          f"  load {load:.1f}{'' if row['quiet'] else ' (not quiet)'}", flush=True)
            finally:
                stop(proc)


def main() -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM runs the finally blocks: servers stopped
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layouts", default="tp=1,tp=2,pp=2")
    ap.add_argument("--rates", default=None, help="two request rates, e.g. 0.5,2 (default: from the single-device TPOT)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per rate (default 12; quick 6)")
    ap.add_argument("--load", default="0.15,0.5", help="the two rates as fractions of one-at-a-time capacity")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serve_predicted_vs_measured.json "
                                                "(--quick: ..._quick.json, so a smoke run never replaces the full one)")
    args = ap.parse_args()
    if args.out is None:
        name = "serve_predicted_vs_measured_quick.json" if args.quick else "serve_predicted_vs_measured.json"
        args.out = str(REPO / "benchmarks/results" / name)
    n, input_len, output_len = (6, 32, 8) if args.quick else (12, 64, 16)
    n = args.num_prompts or n
    fractions = [float(f) for f in args.load.split(",")]
    rows, meta, complete = [], {}, False
    try:
        _run(args, n, input_len, output_len, fractions, rows, meta)
        complete = True
    finally:  # an interrupted run (timeout, Ctrl-C) still writes the rows it measured
        loads = [r["load_average_1m"] for r in rows] + [os.getloadavg()[0]]
        quiet = max(loads) <= QUIET_LOAD
        result = dict(model_params=meta.get("params"), quick=args.quick, complete=complete, num_prompts=n,
                      input_len=input_len, output_len=output_len, probed_cluster=meta.get("probed"),
                      quiet=quiet, quiet_load=QUIET_LOAD, max_load_average_1m=max(loads),
                      status="quiet" if quiet else f"not quiet: 1-minute load up to {max(loads):.1f} (> {QUIET_LOAD})",
                      rows=rows, machine_load=os.getloadavg(),
                      table=[dict(layout=r["layout"], rate_rps=r["rate_rps"], load_1m=round(r["load_average_1m"], 2),
                                  ttft_p50_ms=round(r["measured_ttft_p50_s"] * 1e3, 2),
                                  tpot_p50_ms=round(r["measured_tpot_p50_s"] * 1e3, 2),
                                  **{f"{g.split('-')[1]}_{k}": (round(r[g][k] * (1e3 if k.endswith("_s") else 1), 3)
                                                                if r[g].get(k) is not None else None)
                                     for g in GOALS for k in ("ttft_s", "tpot_s", "ttft_ratio", "tpot_ratio")})
                             for r in rows],
                      note="measured = bench-serve client p50; predicted = modelcarve estimate on the probed cluster "
                           "(ratios predicted / measured p50; table: ms)")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
