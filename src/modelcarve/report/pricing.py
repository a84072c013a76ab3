"""The cost table of ``plan`` / ``estimate`` with price flags: dollars per served token or per
training run, beside a hosted API's price (plan/pricing.py computes them)."""

from __future__ import annotations


def cost_table(rows: list[dict], *, serving: bool):
    from rich.table import Table

    table = Table(title="cost at these prices" + (" (idle capacity paid)" if serving else ""))
    if serving:
        cols = ["layout", "$/hour", "utilisation", "$/M output tok", "$/M tok in+out", "$/request"]
        if any("api" in r for r in rows):
            cols += ["API $/request", "self-hosting cheaper above"]
        for c in cols:
            table.add_column(c, justify="left" if c == "layout" else "right")
        for r in rows:
            cells = [r["name"], f"{r['usd_per_hour']:,.2f}", f"{r['utilisation']:.0%}", f"{r['usd_per_m_output_tokens']:,.3f}",
                     f"{r['usd_per_m_tokens']:,.3f}", f"{r['usd_per_request']:.5f}"]
            if "api" in r:
                api = r["api"]
                where = (f"{api['break_even_rps']:,.2f} req/s ({api['break_even_utilisation']:.0%})"
                         if api["self_hosting_can_win"] else f"never: needs {api['break_even_rps']:,.1f} req/s, "
                                                              f"capacity {r['capacity_rps']:,.1f}")
                cells += [f"{api['usd_per_request']:.5f}", where]
            elif len(cols) > 6:
                cells += ["", ""]
            table.add_row(*cells)
    else:
        for c in ("layout", "hours", "device-hours", "$ for the run", "$/M tokens"):
            table.add_column(c, justify="left" if c == "layout" else "right")
        for r in rows:
            table.add_row(r["name"], f"{r['hours']:,.1f}", f"{r['device_hours']:,.0f}", f"{r['usd']:,.0f}",
                          f"{r['usd_per_m_tokens']:,.4f}")
    return table


def selfhost_table(rows: list[dict], device: str):
    """``selfhost``: one row per (model, weight dtype) on the fewest devices that hold it."""
    from rich.table import Table

    table = Table(title=f"self-hosting on {device}: each weight dtype on the fewest devices that hold the model")
    cols = ["model", "weights", "devices", "layout", "TTFT ms", "TPOT ms", "tok/s/dev", "$/M output tok", "quality cost"]
    api = any(r.get("cost", {}).get("api") for r in rows)
    if api:
        cols += ["API $/M output tok (input charged too)", "self-hosting cheaper above"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("model", "weights", "layout", "quality cost",
                                                     "self-hosting cheaper above") else "right")
    for r in rows:
        if not r.get("cost"):
            table.add_row(r["model"], r["weight_dtype"], "-", r.get("why", ""), *[""] * (len(cols) - 4))
            continue
        c = r["cost"]
        cells = [r["model"], r["weight_dtype"], str(r["devices"]), r["layout"], f"{r['ttft_s'] * 1e3:,.0f}",
                 f"{r['tpot_s'] * 1e3:,.1f}", f"{r['tokens_per_s_per_device']:,.0f}", f"{c['usd_per_m_output_tokens']:,.3f}",
                 r["quality"]]
        if api:
            a = c.get("api")
            if a:
                per_m = a["usd_per_request"] / c["usd_per_request"] * c["usd_per_m_output_tokens"]
                where = (f"{a['break_even_rps']:,.2f} req/s ({a['break_even_utilisation']:.0%})" if a["self_hosting_can_win"]
                         else f"never (capacity {c['capacity_rps']:,.1f} req/s)")
                cells += [f"{per_m:,.3f}", where]
            else:
                cells += ["", ""]
        table.add_row(*cells)
    return table


def plot_priced_front(points: list[dict], price: dict, path, title: str = ""):
    """$ per million output tokens against tokens/s per user along the serving Pareto front."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [p["tokens_per_s_per_user"] for p in points]
    ys = [p["usd_per_m_output_tokens"] for p in points]
    ax.plot(xs, ys, "o-")
    for p in points[:: max(1, len(points) // 6)]:
        ax.annotate(f"{p['name']} b{p['batch']}", (p["tokens_per_s_per_user"], p["usd_per_m_output_tokens"]),
                    fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s per user (1 / TPOT)")
    ax.set_ylabel("$ per million output tokens (log)")
    ax.set_title(title + f" at ${price['usd_per_device_hour']:.2f}/device-hour, {price['utilisation']:.0%} utilised")
    ax.grid(True, alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(Path(path), dpi=120)
    plt.close(fig)
    return Path(path)
