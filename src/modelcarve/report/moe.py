"""The MoE routing statistics as a table: one row per MoE layer, tokens per expert and per rank.

    console.print(moe_stats_table(stats, "experts, last step (tokens = routed assignments)"))

``stats`` is runtime/parallel/expert.py's ``moe_step_stats`` record (plain numbers per layer);
``run`` (rank 0, through report/run.py) and ``verify`` print it.
"""

from __future__ import annotations


def moe_stats_table(stats: dict, title: str):
    """A rich Table of ``moe_step_stats`` output: one row per MoE layer."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("layer", "tokens per expert", "max/mean expert", "tokens per rank", "max/mean rank", "dropped"):
        table.add_column(col, justify="left" if col in ("layer", "tokens per expert", "tokens per rank") else "right")
    for fqn, row in stats.items():
        table.add_row(fqn.removesuffix(".feed_forward"), _counts(row["tokens_per_expert"]),
                      f"{row['expert_imbalance']:.2f}", _counts(row["tokens_per_rank"]),
                      f"{row['rank_imbalance']:.2f}", str(row["dropped"]))
    return table


def _counts(values: list[int], limit: int = 16) -> str:
    """All counts when few; else min / median / max (a 256-expert row does not fit a terminal)."""
    if len(values) <= limit:
        return " ".join(map(str, values))
    ordered = sorted(values)
    return f"{len(values)} values: min {ordered[0]}, median {ordered[len(ordered) // 2]}, max {ordered[-1]}"
