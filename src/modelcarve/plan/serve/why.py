"""Why the winner of a serving plan wins: the best layout of every other shape, and what it loses.

``family(layout, cluster)`` names a layout's shape (which axis carries the model, whether it
leaves a node); ``contrasts(model, cluster, goal_name, winner, **options)`` screens the goal's
candidates with the winner's dtypes, keeps the best of each other shape, evaluates it in full and
says in words why it ranks below (``modelcarve plan``'s "why" lines).
"""

from __future__ import annotations

from modelcarve.plan.serve.goal import SERVE_LATENCY, SERVE_THROUGHPUT
from modelcarve.spec.layout import Layout

_GOALS = {goal.name: goal for goal in (SERVE_LATENCY, SERVE_THROUGHPUT)}


def family(layout: Layout, cluster) -> str:
    """The shape of a layout in words: which axis carries the model, and whether it leaves a node."""
    per_node = cluster.devices_per_node
    if layout.tp > per_node:
        return "TP across nodes"
    if layout.pp > 1 and layout.tp * layout.pp * layout.dp > per_node and layout.tp * layout.dp < cluster.num_devices:
        shape = "PP across nodes"
    elif layout.pp > 1:
        shape = "PP inside a node"
    elif layout.tp > 1:
        shape = "TP inside a node"
    else:
        shape = "replicas only"
    return shape + (" + EP" if layout.ep > 1 else "")


def contrasts(model, cluster, goal_name: str, winner: dict, **options) -> list[dict]:
    """The best layout of every other shape (same weight and KV dtypes as the winner), and what
    it loses against the winner, in words: the "why" of a plan."""
    goal = _GOALS[goal_name]
    screen = goal.prepare(model, cluster, **options)
    wl = winner["layout"]
    best: dict[str, tuple[float, Layout, str | None]] = {}
    for layout in goal.candidates(model, cluster, **options):
        if layout.weight_dtype != wl["weight_dtype"] or layout.kv_dtype != wl["kv_dtype"]:
            continue
        score, _, reason = screen(layout)
        shape = family(layout, cluster)
        held = best.get(shape)
        if held is None or score > held[0]:
            best[shape] = (score, layout, reason)
    winner_shape = family(Layout.from_dict(wl), cluster)
    out = []
    metric = "tpot_s" if goal.latency else "tokens_per_s_per_device"
    for shape, (score, layout, reason) in sorted(best.items(), key=lambda kv: -kv[1][0]):
        if shape == winner_shape:
            continue
        result = goal.evaluate(model, cluster, layout, **options)
        serve = result.get("serve") or {}
        if result["fits"] and serve:
            if not goal.latency and "capacity_tokens_per_s_per_device" in serve:
                metric = "capacity_tokens_per_s_per_device"  # at a request rate: ranked by capacity
            mine, theirs = winner["serve"][metric], serve[metric]
            if goal.latency:
                verdict = f"TPOT {theirs * 1e3:.2f} ms vs {mine * 1e3:.2f} ms ({theirs / mine:.1f}x slower)"
            else:
                full = " at full load (capacity)" if metric.startswith("capacity") else ""
                verdict = f"{theirs:,.0f} vs {mine:,.0f} tokens/s per device{full} ({mine / max(theirs, 1e-9):.1f}x less)"
            why = "; ".join(w for w in result["warnings"] if not w.startswith("quality") and not w.startswith("one model copy"))
            if not why:
                why = (
                    f"decode is {serve['bound']}-bound at batch {serve['batch']}: each device reads "
                    f"{serve['weights_read_bytes'] / 1e9:.2f} GB of weights per step "
                    f"(winner: {winner['serve']['weights_read_bytes'] / 1e9:.2f} GB at batch {winner['serve']['batch']})"
                )
            if result.get("reject_reason"):
                why = result["reject_reason"]
        else:
            verdict = "does not qualify"
            why = result.get("reject_reason") or reason or "rejected"
        out.append({"shape": shape, "name": result["name"], "verdict": verdict, "why": why})
    return out
