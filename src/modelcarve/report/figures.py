"""Matplotlib figures of plans (Agg backend; matplotlib is imported only when a figure is drawn).

Usage::

    from modelcarve.report.figures import plot_plan
    plot_plan(search_result, "plan.png", title="gpt3-175b on 128x8xA100-80GB")

``plot_plan`` draws, for the top layouts of a training plan, the memory breakdown of each
layout's worst device (stacked bars against the capacity line) and the bytes each device sends
per step on each link tier (inside the node, across nodes).
"""

from __future__ import annotations

from pathlib import Path

GIB = 2**30


def plot_plan(result: dict, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [r for r in result["layouts"] if r.get("goal") == "train"]
    if not layouts:
        raise ValueError("plot_plan draws training plans; this result has no training layouts")
    # rank + short form + what short() leaves out: two layouts may differ only in mbs/recompute
    names = [f"#{i} {r['short']}\nmbs={r['layout']['mbs']} rc={r['layout']['recompute']}" for i, r in enumerate(layouts, 1)]
    parts = list(layouts[0]["memory"]["breakdown"])
    fig, (mem_ax, link_ax) = plt.subplots(1, 2, figsize=(8.5 + 1.4 * len(layouts), 5))
    bottom = [0.0] * len(layouts)
    for part in parts:
        values = [r["memory"]["breakdown"].get(part, 0) / GIB for r in layouts]
        if not any(values):
            continue
        mem_ax.bar(range(len(names)), values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    capacity = layouts[0]["memory"]["capacity_bytes"] / GIB
    mem_ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity:.0f} GiB")
    mem_ax.set_xticks(range(len(names)), names)
    mem_ax.set_ylabel("GiB on the worst device")
    mem_ax.set_title("memory")
    # outside the axes: inside, it covered the last layouts' bars
    mem_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    width = 0.4
    xs = range(len(layouts))
    for offset, link, label in ((-width / 2, "intra", "inside a node"), (width / 2, "inter", "across nodes")):
        values = [r["comm"]["bytes_per_step_by_link"][link] / GIB for r in layouts]
        link_ax.bar([x + offset for x in xs], values, width=width, label=label)
    link_ax.set_xticks(list(xs), names)
    link_ax.set_ylabel("GiB sent per device per step")
    link_ax.set_title("traffic per link tier")
    link_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    for ax in (mem_ax, link_ax):
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
