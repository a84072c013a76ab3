"""Tables and the figure of the newer serving answers: a disaggregated prefill/decode plan, one
phase's estimate, and the Pareto front of tokens/s per device against tokens/s per user.

Usage::

    from modelcarve.report.frontier import print_disagg_plan, print_pareto, plot_pareto
    print_pareto(pareto_front(model, cluster, ...))
    plot_pareto(front, "front.png", title="llama-3.1-70b on 8xH100")
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from modelcarve.report.tables import console as _default_console


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def print_disagg_plan(plan: dict, colocated: dict | None = None, console=None) -> None:
    console = console or _default_console()
    table = Table(title="serve-disagg: prefill pool + decode pool")
    for col in ("#", "prefill unit", "decode unit", "P:D devices", "tok/s/dev", "tok/s/user", "TTFT", "TPOT",
                "KV hand-off", "batch", "req/s", "quality"):
        table.add_column(col)
    for i, r in enumerate(plan["layouts"], 1):
        s = r["serve"]
        table.add_row(str(i), r["name"].split("] D[")[0][2:], r["name"].split("] D[")[1][:-1], s["ratio"].split(" ")[0],
                      f"{s['tokens_per_s_per_device']:,.0f}", f"{s['tokens_per_s_per_user']:.1f}", _ms(s["ttft_s"]),
                      _ms(s["tpot_s"]), f"{_ms(r['kv_transfer_s'])} {r['kv_link']}", str(s["batch"]),
                      f"{s['requests_per_s']:.2f}", r.get("quality_short", "?"))
    console.print(table)
    if colocated:
        console.print(f"colocated best (serve-throughput, same bounds): {colocated['name']} at "
                      f"{colocated['serve']['tokens_per_s_per_device']:,.0f} tok/s/dev, TPOT {_ms(colocated['serve']['tpot_s'])}")
    if plan["layouts"]:
        console.print(f"quality: {plan['layouts'][0]['quality']}")


def print_phase_estimate(result: dict, console=None) -> None:
    console = console or _default_console()
    unit = result["unit"]
    table = Table(title=f"{result['name']}: the {result['phase']} phase alone")
    table.add_column("figure")
    table.add_column("value")
    for key, value in unit.items():
        table.add_row(key.replace("_", " "), f"{value:,.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    if result["reject_reason"]:
        console.print(f"rejected: {result['reject_reason']}")
    console.print(f"quality: {result['quality']}")


def print_pareto(front: dict, console=None) -> None:
    console = console or _default_console()
    table = Table(title=f"Pareto front: tokens/s per device vs tokens/s per user ({front['points']} points costed, "
                        f"weights {','.join(front['weight_dtypes'])})")
    for col in ("tok/s/user", "tok/s/dev", "layout w/kv", "batch", "TPOT", "TTFT", "quality"):
        table.add_column(col)
    for p in front["front"]:
        table.add_row(f"{p['tokens_per_s_per_user']:.1f}", f"{p['tokens_per_s_per_device']:,.0f}", p["name"], str(p["batch"]),
                      _ms(p["tpot_s"]), _ms(p["ttft_s"]), p["quality_short"])
    console.print(table)


def plot_pareto(front: dict, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = front["front"]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot([p["tokens_per_s_per_user"] for p in pts], [p["tokens_per_s_per_device"] for p in pts], "o-")
    for p in pts[:: max(1, len(pts) // 8)]:
        ax.annotate(f"{p['name']} b{p['batch']}", (p["tokens_per_s_per_user"], p["tokens_per_s_per_device"]), fontsize=7)
    ax.set_xlabel("output tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(title or "serving Pareto front")
    ax.grid(True, alpha=0.3)
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
