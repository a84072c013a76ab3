"""``modelcarve bench-serve``: load an OpenAI-compatible server over HTTP and report its latencies.

    modelcarve bench-serve --url http://127.0.0.1:8000 --num-prompts 200 --input-len 128 --output-len 64 --rate 4
    modelcarve bench-serve --url http://127.0.0.1:8000 --num-prompts 64 --input-len 32 --output-len 16 \\
        --concurrency 8 --ttft-ms 500 --tpot-ms 50 --json --plot latency.png

Throughput (requests/s, output tokens/s), TTFT / TPOT / ITL / E2E at mean, p50, p90, p99, and
goodput under the SLA given by ``--ttft-ms`` / ``--tpot-ms`` (serve/bench.py defines each); a
rich table (or JSON with ``--json``), a matplotlib figure with ``--plot``, a progress bar on
stderr while it runs. Exit 1 when any request failed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from modelcarve.spec.errors import ModelcarveError


def register(sub) -> None:
    p = sub.add_parser("bench-serve", help="load an OpenAI-compatible server (Poisson rate or fixed concurrency); TTFT/TPOT/ITL/E2E")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request (ignore_eos)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (inf: all at once)")
    load.add_argument("--concurrency", type=int, default=None, help="requests kept in flight")
    p.add_argument("--ttft-ms", type=float, default=None, help="SLA on time to first token, for goodput")
    p.add_argument("--tpot-ms", type=float, default=None, help="SLA on time per output token, for goodput")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='prompts instead of random ids: {"prompt": "text"} or {"prompt_token_ids": [...]} per line, '
                        'optional "output_len"')
    p.add_argument("--vocab-size", type=int, default=100, help="random prompt ids are drawn below this (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", action="store_true", help="print the summary (and every request) as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="latency CDFs and tokens/s over time")
    p.set_defaults(func=_bench)


def _check(args) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ModelcarveError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rate is not None and args.rate <= 0:
        raise ModelcarveError(f"--rate must be > 0 requests/s (or inf), got {args.rate}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ModelcarveError(f"--concurrency must be at least 1, got {args.concurrency}")
    if not args.url.startswith(("http://", "https://")):
        raise ModelcarveError(f"--url {args.url!r} must start with http:// or https://")


def _bench(args) -> int:
    from modelcarve.serve.bench import BenchConfig, run_bench, summarise

    _check(args)
    cfg = BenchConfig(url=args.url.rstrip("/"), model=args.model, num_prompts=args.num_prompts,
                      input_len=args.input_len, output_len=args.output_len, rate=args.rate,
                      concurrency=args.concurrency, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms,
                      prompts_file=args.prompts, vocab_size=args.vocab_size, seed=args.seed, api_key=args.api_key,
                      timeout_s=args.timeout)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err_console = Console(stderr=True)
    progress = Progress(TextColumn("requests"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=err_console, transient=True, disable=not err_console.is_terminal)
    task = progress.add_task("bench", total=cfg.num_prompts, info="")
    failed = [0]

    def done(result) -> None:
        failed[0] += not result.ok
        progress.update(task, advance=1, info=f"{failed[0]} failed" if failed[0] else "")

    try:
        with progress:
            results, duration = asyncio.run(run_bench(cfg, on_done=done))
    except ValueError as err:
        raise ModelcarveError(str(err)) from None
    except Exception as err:  # the server is not there, or is not OpenAI-compatible
        raise ModelcarveError(f"cannot benchmark {cfg.url}: {type(err).__name__}: {err}; is the server running?") from None
    summary = summarise(results, duration, cfg)
    summary["model"] = cfg.model or summary.get("model")
    if args.plot:
        from modelcarve.report.bench import bench_figure

        bench_figure(summary, args.plot)
        sys.stderr.write(f"modelcarve: wrote {args.plot}\n")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        from modelcarve.report.bench import bench_table
        from modelcarve.report.tables import console

        console().print(bench_table(summary))
        if summary["failed"]:
            sys.stderr.write(f"modelcarve: {summary['failed']} request(s) failed, e.g. {summary['errors'][0]}\n")
    return 1 if summary["failed"] else 0
