"""A Gantt chart of pipeline timelines (plain records of plan/predict/timeline.py's form), measured or modelled.

Usage::

    from modelcarve.report.timeline import plot_timeline
    plot_timeline([("measured, 1f1b pp=2 m=4", recs, "s", 0.31), ("planner", model, "units", 0.2)], "t.png")

One panel per timeline, one row per pipeline rank: forwards, backwards (B, or I and W) as bars
labelled with their micro-batch (interleaved: stage/micro-batch), sends and recvs as thin bars
under the rank's row. Each panel's title gives its measured bubble (plan.timeline.bubble) and,
when given, the predicted one (plan/cost/schedule.py).
"""

from __future__ import annotations

from pathlib import Path

from modelcarve.plan.predict.timeline import COMPUTE, bubble

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868", "send": "#8172b2", "recv": "#c44e52"}


def plot_timeline(panels: list[tuple], path: str | Path, title: str = "") -> Path:
    """``panels``: ``(name, records, unit, predicted_bubble or None)``; writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 1.1 * sum(_ranks(r) for _, r, _, _ in panels)),
                             squeeze=False)
    for ax, (name, records, unit, predicted) in zip(axes[:, 0], panels):
        got = bubble(records)
        stages = {r["stage"] for r in records}
        ranks = sorted({r["rank"] for r in records})
        multi = len(stages) > len(ranks)
        for r in records:
            y = ranks.index(r["rank"])
            if r["kind"] in COMPUTE:
                ax.barh(y, r["end"] - r["start"], left=r["start"], height=0.6, color=_COLOURS[r["kind"]], edgecolor="white", linewidth=0.5)
                label = f"{r['stage']}/{r['mb']}" if multi else str(r["mb"])
                ax.text((r["start"] + r["end"]) / 2, y, label, ha="center", va="center", fontsize=6, color="white")
            else:
                off = 0.36 if r["kind"] == "send" else 0.44
                ax.barh(y + off, max(r["end"] - r["start"], 1e-9), left=r["start"], height=0.07, color=_COLOURS[r["kind"]])
        ax.set_yticks(range(len(ranks)), [f"rank {k}" for k in ranks])
        ax.invert_yaxis()
        ax.set_xlabel(f"time ({unit})")
        pred = f", predicted {predicted:.3f}" if predicted is not None else ""
        ax.set_title(f"{name}: bubble {got['overall']:.3f}{pred}", fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in _COLOURS.items() if k != "I"]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
    if title:
        fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ranks(records: list[dict]) -> int:
    return len({r["rank"] for r in records})
