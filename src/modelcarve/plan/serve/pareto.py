"""The Pareto front of serving: output tokens/s per device against tokens/s per user (1 / TPOT).

Usage::

    from modelcarve.plan.serve.pareto import pareto_front
    front = pareto_front(model, cluster, input_len=4096, output_len=512, ttft_ms=2000)
    [(p["tokens_per_s_per_user"], p["tokens_per_s_per_device"], p["name"], p["batch"]) for p in front["front"]]

Every colocated serving layout the ``serve-throughput`` goal enumerates (tp x pp x dp x ep, each
allowed weight and KV dtype: the quality floor bf16/fp8 unless ``weight_dtypes`` widens it) is
costed at the batches ``1, 2, 4, ...`` up to the most that fit in memory (and that largest batch
itself), with serve_time's figures (a user's TPOT includes the other requests' prefills). A
point is on the front when no other point is at least as good on both axes and better on one
(aiconfigurator's output). ``ttft_ms`` drops points above the TTFT bound; ``tpot_ms`` is ignored
(the front is the set of trade-offs a TPOT bound chooses from). Sorted by tokens/s per user
ascending, the front's tokens/s per device is strictly decreasing.
"""

from __future__ import annotations

from modelcarve.plan.cost.quant import QUALITY_SHORT
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.goal import SERVE_THROUGHPUT
from modelcarve.plan.serve.memory import max_sequences, served_expert_dtype, shard_facts
from modelcarve.plan.serve.options import serve_options
from modelcarve.plan.serve.time import _rates


def _batches(fit: int) -> list[int]:
    out, b = [], 1
    while b < fit:
        out.append(b)
        b *= 2
    return out + [fit]


def front_of(points: list[dict]) -> list[dict]:
    """The non-dominated points (higher is better on both axes), sorted by tokens/s per user."""
    ordered = sorted(points, key=lambda p: (-p["tokens_per_s_per_user"], -p["tokens_per_s_per_device"]))
    front, best = [], float("-inf")
    for p in ordered:
        if p["tokens_per_s_per_device"] > best:
            front.append(p)
            best = p["tokens_per_s_per_device"]
    return front[::-1]


def pareto_front(model, cluster, **options) -> dict:
    """Every point costed and the front (see module doc)."""
    opts = serve_options(**options)
    ttft_bound = opts.ttft_s if opts.ttft_s is not None else float("inf")
    memory = cluster.device.memory_bytes
    points = []
    for layout in SERVE_THROUGHPUT.candidates(model, cluster, **options):
        ed = served_expert_dtype(model, layout.weight_dtype, opts.released_experts)
        f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                        expert_dtype=ed, redundant_experts=layout.redundant_experts)
        fit = min(max_sequences(f, memory, opts.context, rule=opts.memory_rule), opts.max_batch)
        if fit < 1:
            continue
        c = layout_costs(model, cluster, layout.tp, layout.pp, layout.ep, layout.dp, layout.weight_dtype, layout.kv_dtype,
                     opts.input_len, opts.output_len, opts.load_imbalance, f, expert_dtype=ed, redundant_experts=layout.redundant_experts)
        experts = f" (experts {ed})" if ed else ""
        for b in _batches(fit):
            _, tpot, ttft, group = _rates(c, b)
            if ttft > ttft_bound:
                break  # TTFT grows with the batch
            points.append({
                "name": f"{layout.short()} w{layout.weight_dtype}/kv{layout.kv_dtype}{experts}", "layout": layout.to_dict(),
                "batch": b, "tokens_per_s_per_device": group / (layout.tp * layout.pp), "tokens_per_s_per_user": 1.0 / tpot,
                "tpot_s": tpot, "ttft_s": ttft, "quality_short": QUALITY_SHORT.get(layout.weight_dtype, "?"),
            })
    return {"front": front_of(points), "points": len(points), "weight_dtypes": list(opts.weight_dtypes)}
