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
