"""The check the verify --against-plan test files share: a report whose every row is judged."""

from __future__ import annotations

import pytest


def assert_every_row_judged(layout: str, report: dict) -> None:
    """Every row of ``report["against_plan"]`` judged (none "not modelled" but the reported-only
    ones) and within its bound: bytes and states equal to the byte, activations within 10%; and the
    layout still matches the single-device reference."""
    rows = report["against_plan"]
    unjudged = [r for r in rows if r["ok"] is None and r["why"] != "reported only"]
    assert not unjudged, (layout, unjudged)
    for r in rows:
        if r["ok"] is None:
            continue
        assert r["ok"] is True, (layout, r)
        if r["quantity"].startswith(("payload:", "wire:")) or r["quantity"] in ("params", "grads", "optimizer"):
            assert r["predicted"] == pytest.approx(r["measured"], rel=1e-9, abs=0), (layout, r)
        if r["quantity"] == "activations":
            assert abs(r["predicted"] - r["measured"]) <= 0.10 * r["measured"], (layout, r)
    assert all(c["passed"] for c in report["checks"]), (layout, [c for c in report["checks"] if not c["passed"]])


def against_plan_worker(jobs, per_node=None) -> list:
    """On every rank of one gloo world (tests/dist.py): ``verify --against-plan`` of each ``(model,
    layout)`` of ``jobs`` in turn, two steps each, a barrier between; traffic accounted as ``per_node``
    ranks per node (None: all on one node). One report per job."""
    import torch.distributed as dist

    from modelcarve.runtime.distributed import collectives
    from modelcarve.verify.reference import verify_worker

    collectives.configure(per_node)
    out = []
    for model, layout in jobs:
        out.append(verify_worker(model, layout, steps=2, against_plan=True))
        dist.barrier()
    return out
