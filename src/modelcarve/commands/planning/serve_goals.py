"""Which goals are serving goals, and the dtypes a serving layout string means.

    is_serve_goal("serve-latency")                      # True
    engine_dtypes("tp=2,param_dtype=fp32", layout)      # weight and KV dtypes fp32, as the server runs it
    fill_replicas(Layout(tp=2), cluster)                # dp=4 on 8 devices: the rest are replicas

Shared by ``commands/plan.py``, ``commands/planning/serving_plan.py`` and ``commands/planning/launch_emit.py``
(one module below them all, so none of them imports another for these).
"""

from __future__ import annotations

SERVE_GOALS = ("serve-latency", "serve-throughput", "serve-disagg")


def is_serve_goal(name: str | None) -> bool:
    return bool(name) and name in SERVE_GOALS


def engine_dtypes(text: str, layout):
    """``layout`` with the weight and KV dtypes the engine will run for the layout ``text``: one not
    stated defaults to ``param_dtype`` (as ``runtime.engine.resolve_layout`` resolves it for
    ``generate`` and ``serve``; the spec's own default, bf16, is the training/planning one), so that
    ``estimate --goal serve-*`` costs the dtypes the server runs. A JSON layout states its fields."""
    import json as _json
    from pathlib import Path

    text = str(text).strip()
    if text.startswith("{") or text.endswith(".json"):
        raw = _json.loads(text if text.startswith("{") else Path(text).read_text())
        stated = set(raw["layout"] if isinstance(raw.get("layout"), dict) else raw)
    else:
        stated = {part.partition("=")[0].strip().lower().replace("-", "_") for part in text.split(",")}
    changes = {}
    if "weight_dtype" not in stated:
        changes["weight_dtype"] = layout.param_dtype
    if "kv_dtype" not in stated:
        changes["kv_dtype"] = layout.param_dtype
    return layout.replace(**changes) if changes else layout


def fill_replicas(layout, cluster):
    """A serving layout names its model-parallel group (tp x pp x cp); with dp=1 the cluster's other
    devices are replicas of it: ``layout`` with that dp (unchanged when dp is given or the group does
    not divide the cluster)."""
    group = layout.tp * layout.pp * layout.cp
    if layout.dp == 1 and group < cluster.num_devices and cluster.num_devices % group == 0:
        return layout.replace(dp=cluster.num_devices // group)
    return layout
