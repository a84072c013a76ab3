"""The serving planner's predictions set beside published, measured serving results.

Usage::

    from modelcarve.plan.serve.calibration import calibrate
    rows = calibrate("data/serving_published.csv")     # one dict per published figure
    [(r["source"], r["model"], r["measured"], r["predicted"], r["error"]) for r in rows]

Each row of the CSV (its header comments cite every source) names a model, a device, the
layout the publisher ran (tp, pp, weight and KV dtype), the request shape and either

* ``output_tokens_per_s`` at unbounded concurrency (offline maximum throughput): predicted by
  the ``serve-throughput`` goal on that fixed layout with no latency bounds, so the planner
  chooses the batch (the largest that fits in memory, up to its ``max_batch``); or
* ``tpot_ms`` at a stated concurrency: predicted by ``serve-latency`` at that batch.

Each row has a ``role``: ``fit`` rows are the ones the three decode constants of
``serve_time`` (DECODE_HBM_EFFICIENCY, LAYER_OVERHEAD_S, ALLREDUCE_FLOOR_S) were fitted to
(``fit_decode_constants`` here; ``benchmarks/calibrate_serving.py --fit`` prints the fit);
``check`` rows are independent checks; ``excluded`` rows are shown but not used, for the reason in
their note. Every prediction uses the constants the planner always uses.
"""

from __future__ import annotations

import csv
from pathlib import Path

from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import get_device, parse_cluster
from modelcarve.spec.layout import Layout

TOLERANCE = 0.20
"""Relative error the issue asks of every calibration row."""
ROLES = ("fit", "fit-fp4", "check", "excluded")
PHASE_METRICS = {"prefill_tokens_per_s_per_device": "prefill", "decode_tokens_per_s_per_device": "decode"}


def load_published(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"calibration file {path} does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


ENGINE_OF_SOURCE = {"trtllm": "trtllm", "trtllm-fp4": "trtllm", "vllm-a100": "vllm", "vllm-h100": "vllm"}
"""The engine each source's runs used, whose KV-cache memory rule prices them
(``memory.ENGINE_MEMORY_RULES``); a source not named here (gpt-fast at batch 1, SGLang's disaggregated
units) is priced with the default rule."""


def predict(row: dict) -> dict:
    """The planner's figure for one published row, with the batch and bound behind it."""
    from modelcarve.plan.serve.goal import SERVE_LATENCY, SERVE_THROUGHPUT
    from modelcarve.plan.serve.memory import ENGINE_MEMORY_RULES

    model = get_model(row["model"])
    devices = int(row["devices"])
    per_node = get_device(row["device"]).devices_per_node
    shape = f"{devices // per_node}x{per_node}" if devices > per_node and devices % per_node == 0 else f"{devices}"
    cluster = parse_cluster(f"{shape}x{row['device']}")  # more devices than a node: whole nodes
    tp, pp = int(row["tp"]), int(row["pp"])
    layout = Layout(
        tp=tp, pp=pp, dp=devices // (tp * pp), weight_dtype=row["weight_dtype"], kv_dtype=row["kv_dtype"],
        seq=int(row["input_len"]) + int(row["output_len"]),
    )
    options = {"input_len": int(row["input_len"]), "output_len": int(row["output_len"])}
    rule = ENGINE_MEMORY_RULES.get(ENGINE_OF_SOURCE.get(row["source"], ""))
    if rule is not None:
        options.update(rule.options())
    concurrency = int(row["concurrency"])
    if row["metric"] in PHASE_METRICS:
        # One disaggregated unit running one phase (plan/serve/disagg.py), per device.
        from modelcarve.plan.serve.disagg import phase_estimate

        ep = int(row.get("ep") or 1)
        unit_layout = Layout(tp=tp, pp=pp, dp=ep, ep=ep, redundant_experts=int(row.get("redundant_experts") or 0),
                             weight_dtype=row["weight_dtype"], kv_dtype=row["kv_dtype"])
        phase = PHASE_METRICS[row["metric"]]
        result = phase_estimate(model, cluster, unit_layout, phase, **options)
        unit = result["unit"]
        value = unit.get("prompt_tokens_per_s_per_device" if phase == "prefill" else "tokens_per_s_per_device", float("nan"))
        return {"predicted": value, "batch": unit.get("batch"), "bound": phase, "tpot_ms": unit.get("tpot_s", float("nan")) * 1e3,
                "layout": unit_layout.short()}
    if row["metric"] == "tpot_ms":
        result = SERVE_LATENCY.evaluate(model, cluster, layout, batch=max(1, concurrency), **options)
        value = result["serve"]["tpot_s"] * 1e3 if result["fits"] else float("nan")
    elif row["metric"] == "output_tokens_per_s":
        if concurrency:
            options["batch"] = concurrency
        result = SERVE_THROUGHPUT.evaluate(model, cluster, layout, **options)
        # The published figure is for the whole tp x pp group, all its requests.
        value = result["serve"]["tokens_per_s_cluster"] if result["fits"] else float("nan")
    else:
        raise SpecError(f"unknown calibration metric {row['metric']!r}; use output_tokens_per_s or tpot_ms")
    serve = result.get("serve") or {}
    return {
        "predicted": value,
        "batch": serve.get("batch"),
        "bound": serve.get("bound"),
        "tpot_ms": serve.get("tpot_s", float("nan")) * 1e3,
        "layout": layout.short(),
    }


def calibrate(path: str | Path) -> list[dict]:
    """Every published row with the planner's prediction and the relative error."""
    rows = []
    for row in load_published(path):
        measured = float(row["value"])
        pred = predict(row)
        rows.append(
            {
                "source": row["source"],
                "model": row["model"],
                "device": row["device"],
                "devices": int(row["devices"]),
                "layout": pred["layout"],
                "weight_dtype": row["weight_dtype"],
                "kv_dtype": row["kv_dtype"],
                "input_len": int(row["input_len"]),
                "output_len": int(row["output_len"]),
                "concurrency": int(row["concurrency"]),
                "metric": row["metric"],
                "measured": measured,
                "predicted": pred["predicted"],
                "error": pred["predicted"] / measured - 1.0,
                "batch": pred["batch"],
                "bound": pred["bound"],
                "note": row.get("note", ""),
                "role": row.get("role") or "check",
            }
        )
    return rows


def fit_decode_constants(path: str | Path, *, grid: int = 41) -> dict:
    """Least-squares (in log error) fit of DECODE_HBM_EFFICIENCY, LAYER_OVERHEAD_S and
    ALLREDUCE_FLOOR_S to the ``fit`` rows, all batch-1 decode latencies (tpot_ms).

    At batch 1 a decode step is ``read / (hbm x eff) + layers x overhead + all-reduces x
    max(floor, algorithmic all-reduce) + logits gather``; the pieces that do not depend on the
    three constants are taken from the planner itself, then a grid over the constants is searched."""
    from modelcarve.plan.serve import rates as fitted
    from modelcarve.plan.serve import time as st

    saved = (fitted.DECODE_HBM_EFFICIENCY, fitted.LAYER_OVERHEAD_S, fitted.ALLREDUCE_FLOOR_S)
    pieces = []
    try:
        fitted.DECODE_HBM_EFFICIENCY, fitted.LAYER_OVERHEAD_S, fitted.ALLREDUCE_FLOOR_S = 1.0, 0.0, 0.0
        _clear_caches()
        for row in load_published(path):
            if (row.get("role") or "check") != "fit":
                continue
            if row["metric"] != "tpot_ms" or int(row["concurrency"]) != 1 or int(row["pp"]) != 1:
                raise SpecError(f"fit rows must be batch-1 tpot_ms rows without pp; got {row}")
            model = get_model(row["model"])
            tp = int(row["tp"])
            cluster = parse_cluster(f"{int(row['devices'])}x{row['device']}")
            t = st.serve_time(model, cluster, tp=tp, weight_dtype=row["weight_dtype"], kv_dtype=row["kv_dtype"],
                              batch=1, input_len=int(row["input_len"]), output_len=int(row["output_len"]))
            parts = t.decode_parts
            count = 2 * model.num_layers if tp > 1 else 0
            gather = 0.0
            per_ar = 0.0
            if tp > 1:
                from modelcarve.plan.cost import comm

                tier = comm.group_tier(cluster, tp, 1)
                gather = comm.all_gather_s(model.vocab_size * 2, tp, tier)
                per_ar = (parts["tp"] - gather) / count
            pieces.append((parts["memory"], model.num_layers, count, per_ar, gather, float(row["value"]) / 1e3))
    finally:
        fitted.DECODE_HBM_EFFICIENCY, fitted.LAYER_OVERHEAD_S, fitted.ALLREDUCE_FLOOR_S = saved
        _clear_caches()
    import math

    best = None
    for i in range(grid):
        eff = 0.55 + 0.40 * i / (grid - 1)
        for j in range(grid):
            overhead = 80e-6 * j / (grid - 1)
            for k in range(grid):
                floor = 60e-6 * k / (grid - 1)
                err = 0.0
                for mem, layers, count, per_ar, gather, measured in pieces:
                    pred = mem / eff + layers * overhead + count * max(floor, per_ar) + gather
                    err += math.log(pred / measured) ** 2
                if best is None or err < best[0]:
                    best = (err, eff, overhead, floor)
    err, eff, overhead, floor = best
    return {"DECODE_HBM_EFFICIENCY": eff, "LAYER_OVERHEAD_S": overhead, "ALLREDUCE_FLOOR_S": floor,
            "rms_log_error": math.sqrt(err / len(pieces)), "rows": len(pieces)}


def fit_fp4_fraction(path: str | Path, *, lo: float = 0.40, hi: float = 1.00, steps: int = 61) -> dict:
    """Least-squares (in log error) fit of serve_rates.FP4_GEMM_FRACTION to the ``fit-fp4`` rows, on a grid."""
    import math

    from modelcarve.plan.serve import rates as fitted

    rows = [r for r in load_published(path) if (r.get("role") or "check") == "fit-fp4"]
    saved = fitted.FP4_GEMM_FRACTION
    best = None
    try:
        for i in range(steps):
            fitted.FP4_GEMM_FRACTION = lo + (hi - lo) * i / (steps - 1)
            _clear_caches()
            err = sum(math.log(predict(r)["predicted"] / float(r["value"])) ** 2 for r in rows)
            if best is None or err < best[0]:
                best = (err, fitted.FP4_GEMM_FRACTION)
    finally:
        fitted.FP4_GEMM_FRACTION = saved
        _clear_caches()
    return {"FP4_GEMM_FRACTION": best[1], "rms_log_error": math.sqrt(best[0] / len(rows)), "rows": len(rows)}


def _clear_caches() -> None:
    from modelcarve.plan.serve import time as serve_time

    serve_time.clear_caches()
