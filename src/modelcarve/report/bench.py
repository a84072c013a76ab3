"""What ``modelcarve bench-serve`` prints and draws: the latency table and the CDF / throughput figure.

Reads only the summary dict of ``serve/bench.py``'s ``summarise`` (plain data), so this module,
like the rest of report/, needs no torch and no HTTP client.
"""

from __future__ import annotations


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def bench_table(summary: dict):
    from rich.table import Table

    load = (f"Poisson {summary['rate']:g} req/s" if summary.get("rate") else
            f"{summary['concurrency']} in flight" if summary.get("concurrency") else "all at once")
    title = (f"bench-serve {summary.get('model') or ''} at {summary['url']}: {summary['completed']}/"
             f"{summary['num_prompts']} ok, {load}, {summary['duration_s']:.2f} s")
    table = Table(title=title)
    for col in ("metric", "mean", "p50", "p90", "p99"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)")):
        d = summary[key]
        table.add_row(label, _ms(d["mean"]), _ms(d["p50"]), _ms(d["p90"]), _ms(d["p99"]))
    table.add_section()
    table.add_row("requests/s", f"{summary['request_throughput']:.3f}", "", "", "")
    table.add_row("output tokens/s", f"{summary['output_throughput']:.1f}", "", "", "")
    sla = summary.get("sla") or {}
    if sla.get("goodput") is not None:
        bounds = ", ".join(f"{k.split('_')[0].upper()} <= {v:g} ms" for k, v in sla.items() if k.endswith("_ms") and v is not None)
        table.add_row(f"goodput ({bounds})", f"{sla['goodput']:.3f} req/s",
                      f"{sla['good_requests']}/{summary['num_prompts']}", "", "")
    return table


def bench_figure(summary: dict, path: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens/s over time, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in summary["requests"] if r["ok"]]
    series = {"TTFT": [r["ttft_s"] * 1e3 for r in ok], "TPOT": [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"]],
              "ITL": [x * 1e3 for r in ok for x in r["itl_s"]], "E2E": [r["e2e_s"] * 1e3 for r in ok]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in series.items():
        if values:
            xs = sorted(values)
            left.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})")
    left.set_xscale("log")
    left.set_xlabel("latency (ms)")
    left.set_ylabel("fraction of requests (ITL: of gaps)")
    left.set_title("latency CDFs")
    left.grid(True, alpha=0.3)
    left.legend()
    times = sorted(t for r in ok for t in r["token_times_s"])
    if times:
        width = max(summary["duration_s"] / 40, 1e-3)
        bins = int(summary["duration_s"] / width) + 1
        counts = [0] * bins
        for t in times:
            counts[min(int(t / width), bins - 1)] += 1
        right.plot([(i + 0.5) * width for i in range(bins)], [c / width for c in counts])
    right.set_xlabel("time since start (s)")
    right.set_ylabel("streamed tokens/s (token-carrying chunks)")
    right.set_title("throughput over time")
    right.grid(True, alpha=0.3)
    fig.suptitle(f"bench-serve {summary['url']}: {summary['completed']} requests, "
                 f"{summary['input_len']} in / {summary['output_len']} out tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
