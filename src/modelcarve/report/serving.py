"""Serving plans as text: the ranked table (latency, throughput, memory, link crossings and the
quality cost of each dtype side by side), the reasons the winner wins, and the rejections.

Usage::

    from rich.console import Console
    from modelcarve.report.serving import print_serve_plan
    print_serve_plan(plan, goal_name="serve-latency", why=contrasts(...), console=Console())
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from modelcarve.report.tables import console as _default_console


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}" if seconds < 10 else f"{seconds:,.1f} s"


def serve_plan_table(layouts: list[dict], title: str) -> Table:
    """One row per layout: shape and dtypes with their quality cost, batch, TTFT, TPOT, tokens/s
    per device, memory per device, what bounds the decode step and which axis leaves a node."""
    table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False)
    for name, justify in (
        ("#", "right"), ("layout w/kv", "left"), ("quality", "left"), ("batch", "right"), ("TTFT ms", "right"),
        ("TPOT ms", "right"), ("tok/s/dev", "right"), ("GiB/dev", "right"), ("bound", "left"), ("crosses nodes", "left"),
    ):
        table.add_column(name, justify=justify)
    for rank, result in enumerate(layouts, 1):
        layout, serve, memory = result["layout"], result["serve"], result["memory"]
        crossing = ", ".join(
            f"{axis.upper()} +{result['comm'][axis]['s_per_round'] * 1e3:.2f}ms" for axis in result["crosses_nodes"]
        )
        table.add_row(
            str(rank),
            f"{result['name'].split(' ')[0]} {layout['weight_dtype']}/{layout['kv_dtype']}",
            result.get("quality_short", ""),
            str(serve["batch"]),
            _ms(serve["ttft_s"]),
            f"{serve['tpot_s'] * 1e3:,.2f}",
            f"{serve['tokens_per_s_per_device']:,.0f}",
            f"{memory['total_gib']:.0f}/{memory['budget_gib']:.0f}",
            {"communication": "comms", "overhead": "launches"}.get(serve["bound"], serve["bound"]),
            crossing or "-",
        )
    return table


def print_serve_plan(plan: dict, *, goal_name: str, why: list[dict] | None = None, console: Console | None = None) -> None:
    console = console or _default_console()  # wide enough when piped
    layouts = plan["layouts"]
    title = f"{goal_name}: {len(layouts)} best of {plan['evaluated']} candidates"
    if layouts:
        console.print(serve_plan_table(layouts, title))
        best = layouts[0]
        console.print(f"[bold]Winner[/bold] {best['name']}: TPOT {best['serve']['tpot_s'] * 1e3:.2f} ms, "
                      f"TTFT {_ms(best['serve']['ttft_s'])} ms, {best['serve']['tokens_per_s_per_device']:,.0f} tokens/s per device "
                      f"at {best['serve']['batch']} sequences per replica ({best['serve']['concurrency']} in the cluster)")
        queue = best.get("queue")
        if queue:
            console.print(f"  at {queue['rate_rps']:g} requests/s: {queue['utilisation']:.0%} of its capacity of "
                          f"{queue['capacity_total_rps']:.3g} requests/s; {queue['batch']} sequences in flight per replica "
                          f"(full batch {queue['full_batch']}); TTFT includes a {queue['wait_s'] * 1e3:.1f} ms queue wait "
                          f"({queue['queue_model']})")
        console.print(f"  quality: {best['quality']}")
        if best.get("quality_short") in ("small", "noticeable"):
            console.print("  (--weight-dtypes bf16,fp8 keeps the search to near-lossless weights)")
        for warning in best["warnings"]:
            if not warning.startswith("quality"):
                console.print(f"  note: {warning}")
    else:
        console.print(f"[bold red]{goal_name}: no layout qualifies[/bold red] ({plan['evaluated']} candidates)")
    if why:
        console.print("[bold]Why not another shape[/bold] (best of each, same dtypes):")
        for item in why:
            console.print(f"  {item['shape']}: {item['name']} - {item['verdict']}: {item['why']}")
    if plan.get("rejected"):
        console.print("[bold]Rejected[/bold]: " + "; ".join(f"{count} {reason}" for reason, count in plan["rejected"].items()))
        for alt in plan.get("alternatives", [])[:3]:
            console.print(f"  e.g. {alt.get('reject_reason')}")


def print_serve_estimate(result: dict, console: Console | None = None) -> None:
    """One layout's serving figures, or why it does not qualify."""
    console = console or _default_console()  # wide enough when piped
    if result.get("serve"):
        console.print(serve_plan_table([result], f"{result['goal']}: {result['name']}"))
        parts = result["serve"]["decode_parts_s"]
        console.print(
            "  decode step: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items() if v) +
            f"; prefill of one prompt {_ms(result['serve']['prefill_s'])} ms"
        )
        console.print(f"  quality: {result['quality']}")
        for warning in result["warnings"]:
            if not warning.startswith("quality"):
                console.print(f"  note: {warning}")
    if result.get("reject_reason"):
        console.print(f"[bold red]does not qualify[/bold red]: {result['reject_reason']}")
