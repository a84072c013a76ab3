"""The serving planner's predictions set beside published, measured serving results.

Usage::

    from modelcarve.plan.serve_calibration import calibrate
    rows = calibrate("data/serving_published.csv")     # one dict per published figure
    [(r["source"], r["model"], r["measured"], r["predicted"], r["error"]) for r in rows]

Each row of the CSV (its header comments cite every source) names a model, a device, the
layout the publisher ran (tp, pp, weight and KV dtype), the request shape and either

* ``output_tokens_per_s`` at unbounded concurrency (offline maximum throughput): predicted by
  the ``serve-throughput`` goal on that fixed layout with no latency bounds, so the planner
  chooses the batch (the largest that fits in memory, up to its ``max_batch``); or
* ``tpot_ms`` at a stated concurrency: predicted by ``serve-latency`` at that batch.

One constant is fitted to one row: ``serve_time.DECODE_HBM_EFFICIENCY`` (0.73) to the vLLM
A100 batch-1 latency (source ``vllm-a100``). Every other row is a check: the prediction uses the
constants the planner always uses (plan.efficiency, plan.comm, plan.serve_memory), with their
own sources.
"""

from __future__ import annotations

import csv
from pathlib import Path

from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout

TOLERANCE = 0.20
"""Relative error the issue asks of every calibration row."""
FIT_SOURCES = ("vllm-a100",)
"""Rows a constant was fitted to (not an independent check)."""


def load_published(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"calibration file {path} does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


def predict(row: dict) -> dict:
    """The planner's figure for one published row, with the batch and bound behind it."""
    from modelcarve.plan.serve_goal import SERVE_LATENCY, SERVE_THROUGHPUT

    model = get_model(row["model"])
    devices = int(row["devices"])
    cluster = parse_cluster(f"{devices}x{row['device']}")
    tp, pp = int(row["tp"]), int(row["pp"])
    layout = Layout(
        tp=tp, pp=pp, dp=devices // (tp * pp), weight_dtype=row["weight_dtype"], kv_dtype=row["kv_dtype"],
        seq=int(row["input_len"]) + int(row["output_len"]),
    )
    options = {"input_len": int(row["input_len"]), "output_len": int(row["output_len"])}
    concurrency = int(row["concurrency"])
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
            }
        )
    return rows
