"""Disaggregated prefill/decode serving: one phase of a layout alone, and the ``serve-disagg`` goal
that chooses a prefill pool, a decode pool and their ratio.

Usage::

    from modelcarve.plan.serve.disagg import phase_estimate, SERVE_DISAGG
    phase_estimate(model, cluster, Layout(tp=4), "decode", input_len=1024, output_len=1024, tpot_ms=20)
    from modelcarve.plan.search import search
    search(model, cluster, "serve-disagg", input_len=4096, output_len=512, ttft_ms=1000, tpot_ms=30)

The model (DistServe, Zhong et al. OSDI 2024; NVIDIA Dynamo / aiconfigurator's disaggregated mode):

* A **prefill unit** (``tp x pp x ep`` devices) only runs prompts: batched chunked prefill at
  ``prefill_token_s`` seconds per prompt token (serve_time's prefill model), so it serves
  ``R_p = 1 / (input_len x prefill_token_s)`` requests/s per attention group (x ep for the unit);
  a prompt's own prefill alone takes ``prefill_s``.
* A **decode unit** only decodes: no prefill interleaves, so TPOT is the decode round at the batch
  ``b`` (the largest that fits beside the weights and meets ``tpot_ms``) and the unit serves
  ``R_d = ep x b / (round_s x output_len)`` requests/s.
* The KV cache of each prompt (``input_len x layers x KV elements x KV bytes``) moves from the
  prefill unit to a decode unit before decoding starts: over NVLink when both units fit in one
  NVLink domain, otherwise over the prefill unit's NICs (each device its share of the node's
  NICs), not overlapped with the prefill (layer-by-layer streaming would hide part of it).
  TTFT = ``prefill_s`` + that transfer (+ the M/D/1 queue wait of plan/serve/queue.py at ``rate``).
* **Pools**: ``x`` prefill units and ``y`` decode units with ``x g_p + y g_d <= devices``. Without
  a request rate the goal maximises output tokens/s per device of the whole system,
  ``min(x R_p, y R_d) x output_len / (x g_p + y g_d)`` (for each x, y = x R_p / R_d, the balanced
  count, rounded down and up); with ``rate`` it takes the fewest units that sustain it (prefill units also
  within the TTFT bound with their queue wait) and scores tokens/s per device at that rate.

Both pools use the same weight and KV dtypes (one checkpoint, one KV format to hand over).
"""

from __future__ import annotations

import math

from modelcarve.plan.factors import divisors
from modelcarve.plan.cost.quant import QUALITY_SHORT, kv_bytes, quality_note
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.memory import max_sequences, served_expert_dtype, shard_facts
from modelcarve.plan.serve.options import serve_options
from modelcarve.plan.serve.queue import md1_wait_s
from modelcarve.plan.serve.time import _ensure_prefill, decode_tpot_s
from modelcarve.spec.errors import LayoutError, ModelcarveError
from modelcarve.spec.layout import Layout

FIT = "does not fit in memory"
TTFT = "TTFT above the bound"
TPOT = "TPOT above the bound"
POOLS = "the two pools do not fit in the cluster"
RATE = "cannot sustain the request rate"
PHASES = ("prefill", "decode")


def _unit_devices(layout: Layout) -> int:
    return layout.tp * layout.pp * layout.ep


def _ctx(model, cluster, layout: Layout, opts):
    ed = served_expert_dtype(model, layout.weight_dtype, opts.released_experts)
    f = shard_facts(model, tp=layout.tp, pp=layout.pp, ep=layout.ep, weight_dtype=layout.weight_dtype, kv_dtype=layout.kv_dtype,
                    expert_dtype=ed, redundant_experts=layout.redundant_experts)
    c = layout_costs(model, cluster, layout.tp, layout.pp, layout.ep, layout.ep, layout.weight_dtype, layout.kv_dtype,
                 opts.input_len, opts.output_len, opts.load_imbalance, f, expert_dtype=ed, redundant_experts=layout.redundant_experts)
    return f, c


def prefill_unit(model, cluster, layout: Layout, opts) -> dict | None:
    """A prefill unit's figures, or None when one prompt's KV does not fit beside the weights."""
    f, c = _ctx(model, cluster, layout, opts)
    if max_sequences(f, cluster.device.memory_bytes, opts.input_len, rule=opts.memory_rule) < 1:
        return None
    _ensure_prefill(c)
    group_rps = 1.0 / (opts.input_len * c.prefill_token_s)
    g = _unit_devices(layout)
    return {
        "phase": "prefill", "devices": g, "prefill_s": c.prefill_s, "requests_per_s": group_rps * layout.ep,
        "prompt_tokens_per_s_per_device": group_rps * opts.input_len / (layout.tp * layout.pp),
        "weights_gib": f.weights_bytes / 2**30,
    }


def decode_unit(model, cluster, layout: Layout, opts) -> dict | None:
    """A decode unit at the largest batch that fits and meets the TPOT bound (batch 1 if none does;
    ``tpot_ok`` says), or None when one sequence does not fit."""
    f, c = _ctx(model, cluster, layout, opts)
    fit = min(max_sequences(f, cluster.device.memory_bytes, opts.context, rule=opts.memory_rule), opts.max_batch)
    if fit < 1:
        return None
    bound = opts.tpot_s if opts.tpot_s is not None else float("inf")
    batch = opts.batch or None
    if batch is None:
        # The decode round grows with the batch: the largest batch within the bound, by bisection.
        lo, hi = 1, fit
        if decode_tpot_s(c, hi) <= bound:
            lo = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if decode_tpot_s(c, mid) <= bound:
                    lo = mid
                else:
                    hi = mid
        batch = lo
    elif batch > fit:
        return None
    tpot = decode_tpot_s(c, batch)
    g = _unit_devices(layout)
    group_tps = batch / tpot
    return {
        "phase": "decode", "devices": g, "batch": batch, "tpot_s": tpot, "tpot_ok": tpot <= bound,
        "requests_per_s": group_tps * layout.ep / opts.output_len,
        "tokens_per_s_per_device": group_tps / (layout.tp * layout.pp), "tokens_per_s_per_user": 1.0 / tpot,
        "max_sequences": fit, "weights_gib": f.weights_bytes / 2**30,
    }


def kv_transfer_s(model, cluster, layout: Layout, input_len: int, decode_devices: int) -> tuple[float, str]:
    """Seconds to move one prompt's KV cache from a prefill unit to a decode unit, and the link."""
    total = input_len * model.num_layers * model.kv_cache_elems_per_token_per_layer * kv_bytes(layout.kv_dtype)
    g = _unit_devices(layout)
    if g + decode_devices <= cluster.fast_domain:
        link = cluster.intra_link
        return link.latency_s + total / (g * link.bytes_per_s), link.name
    link = cluster.inter_link
    per_device = link.bytes_per_s * cluster.nics_per_node / cluster.devices_per_node
    return link.latency_s + total / (g * per_device), link.name


def phase_estimate(model, cluster, layout: Layout, phase: str, **options) -> dict:
    """``estimate --goal serve-* --phase prefill|decode``: one unit of ``layout`` running that phase alone."""
    if phase not in PHASES:
        raise ModelcarveError(f"--phase {phase!r} unknown; choose prefill or decode")
    opts = serve_options(**options)
    try:
        layout.validate(model)
    except LayoutError as err:
        raise ModelcarveError(str(err)) from None
    if _unit_devices(layout) > cluster.num_devices:
        raise ModelcarveError(f"{_name(layout)} needs {_unit_devices(layout)} devices; {cluster.name} has {cluster.num_devices}")
    unit = (prefill_unit if phase == "prefill" else decode_unit)(model, cluster, layout.replace(dp=layout.ep), opts)
    result = {"goal": f"serve-{phase}", "phase": phase, "layout": layout.to_dict(), "name": _name(layout),
              "fits": unit is not None, "unit": unit or {}, "quality": quality_note(layout.weight_dtype, layout.kv_dtype),
              "reject_reason": None, "warnings": []}
    if unit is None:
        result["reject_reason"] = f"{_name(layout)}: {FIT} for the {phase} phase"
    elif phase == "decode" and not unit["tpot_ok"]:
        result["reject_reason"] = f"{_name(layout)}: TPOT {unit['tpot_s'] * 1e3:.1f} ms at batch 1 exceeds the bound"
    elif phase == "prefill" and opts.ttft_s is not None and unit["prefill_s"] > opts.ttft_s:
        result["reject_reason"] = f"{_name(layout)}: prefill {unit['prefill_s'] * 1e3:.0f} ms exceeds the TTFT bound"
    return result


def _name(layout: Layout) -> str:
    return f"{layout.short()} w{layout.weight_dtype}/kv{layout.kv_dtype}"


def _meshes(model, n: int, domain: int) -> list[tuple[int, int]]:
    """(tp, ep) of a unit: tp inside the NVLink domain, ep over whole experts (MoE: DP attention + EP)."""
    from modelcarve.plan.serve.goal import _tp_values

    out = []
    for tp in _tp_values(model, min(n, domain)):
        eps = [1]
        if model.is_moe:
            eps += [e for e in divisors(model.num_experts) if e > 1 and tp * e <= n]
        out += [(tp, ep) for ep in eps]
    return out


def choose_pools(p: dict, d: dict, n: int, output_len: int, rate: float | None = None,
                 wait_ok=lambda x: True) -> tuple[int, int] | None:
    """(prefill units, decode units) within ``n`` devices: the best output tokens/s per device, or
    with ``rate`` the fewest units that sustain it (see module doc); None if none fits."""
    gp, gd, rp, rd = p["devices"], d["devices"], p["requests_per_s"], d["requests_per_s"]
    if rate is not None:
        x = math.floor(rate / rp) + 1
        while x * gp <= n and not wait_ok(x):
            x += 1
        y = math.floor(rate / rd) + 1
        return (x, y) if x * gp + y * gd <= n else None
    best = None
    for x in range(1, (n - gd) // gp + 1):
        room = (n - x * gp) // gd
        for y in {max(1, min(room, math.floor(x * rp / rd))), max(1, min(room, math.ceil(x * rp / rd)))}:
            rate_sys = min(x * rp, y * rd)
            key = (rate_sys * output_len / (x * gp + y * gd), rate_sys)
            if best is None or key > best[0]:
                best = (key, (x, y))
    return best[1] if best else None


class _DisaggGoal:
    name = "serve-disagg"
    description = "disaggregated prefill/decode: choose a prefill pool, a decode pool and their ratio"

    def candidates(self, model, cluster, **options):
        opts = serve_options(**options)
        n = cluster.num_devices
        meshes = _meshes(model, n, cluster.fast_domain)
        for wd in opts.weight_dtypes:
            for kd in opts.kv_dtypes:
                for tp_p, ep_p in meshes:
                    for tp_d, ep_d in meshes:
                        if tp_p * ep_p + tp_d * ep_d <= n:
                            yield (Layout(tp=tp_p, ep=ep_p, dp=ep_p, weight_dtype=wd, kv_dtype=kd),
                                   Layout(tp=tp_d, ep=ep_d, dp=ep_d, weight_dtype=wd, kv_dtype=kd))

    def score(self, result: dict) -> float:
        serve = result.get("serve")
        return serve["tokens_per_s_per_device"] if serve else float("-inf")

    def evaluate(self, model, cluster, candidate, **options) -> dict:
        opts = serve_options(**options)
        rate = options.get("rate")
        rate = float(rate) if rate is not None else None
        p_layout, d_layout = candidate
        ed = served_expert_dtype(model, p_layout.weight_dtype, opts.released_experts)
        experts = f" (experts {ed})" if ed else ""
        name = f"P[{_name(p_layout)}] D[{_name(d_layout)}]{experts}"
        result = {"goal": self.name, "name": name, "prefill_layout": p_layout.to_dict(), "decode_layout": d_layout.to_dict(),
                  "expert_dtype": ed,
                  "layout": d_layout.to_dict(), "fits": False, "serve": {}, "warnings": [], "reject_reason": None,
                  "quality": quality_note(p_layout.weight_dtype, p_layout.kv_dtype),
                  "quality_short": QUALITY_SHORT.get(p_layout.weight_dtype, "?")}
        try:
            p_layout.validate(model)
            d_layout.validate(model)
        except LayoutError as err:
            return result | {"reject_reason": str(err), "reject_category": "invalid layout"}
        p = prefill_unit(model, cluster, p_layout, opts)
        d = decode_unit(model, cluster, d_layout, opts)
        if p is None or d is None:
            return result | {"reject_reason": f"{name}: the {'prefill' if p is None else 'decode'} unit {FIT}",
                             "reject_category": FIT}
        transfer, link = kv_transfer_s(model, cluster, p_layout, opts.input_len, d["devices"])
        ttft_bound = opts.ttft_s if opts.ttft_s is not None else float("inf")
        base_ttft = p["prefill_s"] + transfer

        def wait_ok(x: int) -> bool:
            return base_ttft + md1_wait_s(rate / x, p["requests_per_s"]) <= ttft_bound

        pools = choose_pools(p, d, cluster.num_devices, opts.output_len, rate, wait_ok)
        result |= {"prefill": p, "decode": d, "kv_transfer_s": transfer, "kv_link": link}
        if pools is None:
            return result | {"reject_reason": f"{name}: {RATE if rate else POOLS} on {cluster.num_devices} devices",
                             "reject_category": RATE if rate else POOLS}
        x, y = pools
        devices = x * p["devices"] + y * d["devices"]
        capacity = min(x * p["requests_per_s"], y * d["requests_per_s"])
        served = rate if rate is not None else capacity
        wait = md1_wait_s(rate / x, p["requests_per_s"]) if rate is not None else 0.0
        ttft = base_ttft + wait
        result["serve"] = {
            "prefill_units": x, "decode_units": y, "ratio": f"{x * p['devices']}:{y * d['devices']} devices (P:D)",
            "devices": devices, "requests_per_s": served, "capacity_rps": capacity,
            "tokens_per_s": served * opts.output_len, "tokens_per_s_per_device": served * opts.output_len / devices,
            "tokens_per_s_per_user": 1.0 / d["tpot_s"], "tpot_s": d["tpot_s"], "ttft_s": ttft, "queue_wait_s": wait,
            "batch": d["batch"],
        }
        result["fits"] = True
        if ttft > ttft_bound:
            result |= {"reject_reason": f"{name}: TTFT {ttft * 1e3:.0f} ms (prefill {p['prefill_s'] * 1e3:.0f} + KV "
                                        f"transfer {transfer * 1e3:.1f} over {link} + queue {wait * 1e3:.0f}) exceeds "
                                        f"{ttft_bound * 1e3:.0f} ms", "reject_category": TTFT}
        elif not d["tpot_ok"]:
            result |= {"reject_reason": f"{name}: TPOT {d['tpot_s'] * 1e3:.1f} ms at batch 1 exceeds {opts.tpot_s * 1e3:.0f} ms",
                       "reject_category": TPOT}
        return result


SERVE_DISAGG = _DisaggGoal()
