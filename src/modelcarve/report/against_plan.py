"""The ``verify --against-plan`` table: quantity, axis, tier, rank, unit, predicted, measured, ok
(ok / OUTSIDE / NOT MODELLED, the last a failed check; "reported only" for the rows compared by design
without a verdict)."""

from __future__ import annotations


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def against_plan_table(report: dict):
    from rich.table import Table

    rows = report["against_plan"]
    bad = sum(r["ok"] is False for r in rows)
    unjudged = sum(r["ok"] is None and r.get("why") != "reported only" for r in rows)
    table = Table(title=f"{report['layout']}: one training step, measured against the planner "
                        f"({len(rows)} rows, {bad} outside, {unjudged} not modelled; bytes exact, activations within 10%)")
    for col in ("quantity", "axis", "tier", "rank", "unit", "predicted", "measured", "ok"):
        table.add_column(col, justify="left" if col in ("quantity", "axis", "tier", "unit") else "right")
    for r in rows:
        ok = {True: "[green]ok[/]", False: "[red]OUTSIDE[/]", None: "[dim]reported only[/]"}[r["ok"]]
        if r["ok"] is None and r.get("why") != "reported only":
            ok = "[red]NOT MODELLED[/]"  # no verdict possible: the check fails (exit 2), never passes
        table.add_row(r["quantity"], str(r["axis"]), r["tier"], str(r["rank"]), r["unit"], _fmt(r["predicted"]),
                      _fmt(r["measured"]), ok)
    return table
