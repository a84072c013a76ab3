"""Rich tables of plans and estimates (every number with its unit).

Usage::

    from modelcarve.report.tables import console, plan_tables, estimate_table
    for table in plan_tables(search_result, model, cluster):
        console().print(table)

Training results (goal "train") get their full columns; other goals' results are shown by
their layout, fit and score fields, so a new goal renders before it has its own table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

GIB = 2**30


def console():
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out = Console(width=180)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _bytes(n: float) -> str:
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _layout_cell(result: dict) -> str:
    lay = result["layout"]
    sched = lay["schedule"] if lay["pp"] > 1 else ""
    extras = [f"mbs={lay['mbs']}", f"rc={lay['recompute']}"] + ([sched] if sched else [])
    return f"{result.get('short', '')} " + " ".join(extras)


def plan_tables(result: dict, model, cluster) -> list["Table"]:
    """The ranked layouts, then the alternatives with why each lost or was rejected."""
    from rich.table import Table

    layouts = result["layouts"]
    train = bool(layouts) and layouts[0].get("goal") == "train"
    title = f"{model.name} on {cluster.name}: best of {result['evaluated']:,} layouts"
    table = Table(title=title)
    if train:
        for col in ("#", "layout", "memory / capacity", "step", "tokens/s", "TFLOP/s/dev", "MFU", "bubble",
                    "exposed NVLink", "exposed NIC", "modelcarve run"):
            table.add_column(col, justify="left" if col in ("layout", "modelcarve run") else "right")
        refused: dict[str, list[str]] = {}
        for i, r in enumerate(layouts, 1):
            mem, t, c = r["memory"], r["time"], r["comm"]
            runs = r.get("runtime", {}).get("runs", True)
            if not runs:
                refused.setdefault(r["runtime"]["why"], []).append(f"#{i}")
            table.add_row(
                str(i), _layout_cell(r), f"{_gib(mem['peak_bytes'])} / {_gib(mem['capacity_bytes'])}",
                _seconds(t["step_s"]), f"{t['tokens_per_s']:,.0f}", f"{t['tflops_per_device']:.1f}",
                f"{t['mfu']:.1%}", f"{r['bubble_fraction']:.1%}",
                _seconds(c["exposed_s_by_link"]["intra"]), _seconds(c["exposed_s_by_link"]["inter"]),
                "runs" if runs else "refuses (below)",
            )
        if refused:
            table.caption = "modelcarve run refuses (other frameworks may run them): " + " | ".join(
                f"{', '.join(rows)}: {why}" for why, rows in refused.items())
    else:
        table.add_column("#", justify="right")
        table.add_column("layout")
        table.add_column("fits")
        table.add_column("summary")
        for i, r in enumerate(layouts, 1):
            summary = ", ".join(f"{k}={v:.4g}" for k, v in r.get("time", {}).items() if isinstance(v, (int, float)))
            table.add_row(str(i), r.get("short") or str(r.get("layout")), str(r.get("fits")), summary)
    tables = [table]
    if result.get("alternatives"):
        alt = Table(title="why not the others")
        alt.add_column("kind")
        alt.add_column("best of its kind")
        alt.add_column("why")
        for r in result["alternatives"]:
            kind = r.get("family") or r.get("reject_category") or ""
            # with mbs / recompute / schedule: two kinds' best can share a short name (DP64-Z3 twice)
            name = _layout_cell(r) if isinstance(r.get("layout"), dict) and "mbs" in r["layout"] else r.get("short", "")
            alt.add_row(kind, name, r.get("why") or r.get("reject_reason") or "")
        tables.append(alt)
    if result.get("rejected"):
        rej = Table(title="rejected")
        rej.add_column("reason")
        rej.add_column("layouts", justify="right")
        for reason, count in sorted(result["rejected"].items(), key=lambda kv: -kv[1]):
            rej.add_row(reason, f"{count:,}")
        tables.append(rej)
    return tables


def estimate_table(result: dict, model, cluster) -> list["Table"]:
    """Memory breakdown, time and traffic of one training estimate."""
    from rich.table import Table

    if result.get("goal") != "train":
        generic = Table(title=f"{model.name} on {cluster.name}", show_header=False)
        for key, value in result.items():
            generic.add_row(key, str(value))
        return [generic]
    mem, t, c = result["memory"], result["time"], result["comm"]
    title = f"{result['short']} — {model.name} on {cluster.name}"
    memory = Table(title=f"{title}: memory of the {mem['worst_stage']} stage")
    memory.add_column("part")
    memory.add_column("bytes", justify="right")
    sources = mem.get("sources") or {}
    if sources:
        memory.add_column("rule (source)", overflow="fold", max_width=90)
    for part, nbytes in mem["breakdown"].items():
        memory.add_row(part.replace("_", " "), _bytes(nbytes), *([sources.get(part, "")] if sources else []))
    if mem.get("offloaded_to_host_bytes"):
        memory.add_row("activations offloaded to host (not on the device)", _bytes(mem["offloaded_to_host_bytes"]))
    verdict = "fits" if result["fits"] else "does NOT fit"
    memory.add_row("[b]peak / capacity[/]", f"[b]{_gib(mem['peak_bytes'])} / {_gib(mem['capacity_bytes'])} ({verdict})[/]")
    runtime = result.get("runtime")
    if runtime is not None:
        memory.caption = ("modelcarve run executes this layout" if runtime["runs"]
                          else f"modelcarve run refuses this layout: {runtime['why']}")
    time = Table(title="time per step")
    time.add_column("quantity")
    time.add_column("value", justify="right")
    rows = [
        ("step", _seconds(t["step_s"])),
        ("tokens/s", f"{t['tokens_per_s']:,.0f}"),
        ("TFLOP/s per device (Eq. 3, with recomputation)", f"{t['tflops_per_device']:.1f}"),
        ("MFU (no recomputation)", f"{t['mfu']:.1%}"),
        ("micro-batches per step", str(t["microbatches"])),
        ("compute", _seconds(t["compute_s"])),
        ("pipeline bubble", f"{_seconds(t['bubble_s'])} ({result['bubble_fraction']:.1%})"),
        ("optimizer step", _seconds(t["optimizer_s"])),
    ]
    for name, value in rows:
        time.add_row(name, value)
    traffic = Table(title="communication per step, per device")
    traffic.add_column("axis")
    traffic.add_column("link")
    traffic.add_column("bytes sent", justify="right")
    traffic.add_column("exposed", justify="right")
    for axis, nbytes in c["bytes_per_step_by_axis"].items():
        if nbytes or c["exposed_s_by_axis"][axis]:
            link = "NIC" if c["link_by_axis"][axis] == "inter" else "NVLink/intra"
            traffic.add_row(axis, link, _bytes(nbytes), _seconds(c["exposed_s_by_axis"][axis]))
    by_link = c["bytes_per_step_by_link"]
    traffic.add_row("[b]total[/]", "", f"intra {_bytes(by_link['intra'])}, inter {_bytes(by_link['inter'])}",
                    _seconds(c["exposed_s"]))
    return [memory, time, traffic]
