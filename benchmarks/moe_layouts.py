"""Expert-parallel layouts against the single-device reference: the worst difference of each kind
and the measured expert load, written as JSON.

    OMP_NUM_THREADS=1 python benchmarks/moe_layouts.py --out benchmarks/results/moe_layouts.json

Runs exactly the cases of tests/runtime/test_runtime_moe.py (its LAYOUTS and block-level cases, same
worker, real gloo processes): for each layout, the max abs difference of the first step's
logits, gradients and the parameters after 3 AdamW steps, the max relative difference of the
losses and the per-expert token counts, and over the 3 steps the largest expert imbalance
(max/mean tokens per expert), straggler factor (max/mean rows received per rank) and the
dropped assignments. These are correctness figures, not timings: they do not depend on load.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _dirs() -> dict:
    from test_runtime_moe import write_moe_checkpoints

    return write_moe_checkpoints(lambda name: tempfile.mkdtemp(prefix=f"{name}-"))


def _worst(report: dict) -> dict:
    worst: dict = {}
    for c in report["checks"]:
        kind = c["name"].split("/")[0]
        value = c["max_abs"] if c["metric"] == "abs" else c["max_rel"]
        worst[kind] = max(worst.get(kind, 0.0), value)
    return worst


def main() -> None:
    from dist import run_distributed
    from test_runtime_moe import LAYOUTS, _group_worker

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/moe_layouts.json"))
    args = parser.parse_args()
    dirs = _dirs()
    rows, block = [], {}
    for world in sorted(LAYOUTS):
        results = run_distributed(_group_worker, world, world, dirs, timeout=900)
        for (model, layout, options), report in zip(LAYOUTS[world], results[0]["layouts"]):
            steps = report["moe"]
            rows.append(dict(
                model=model, layout=layout, world_size=world, moe_options=options or {}, passed=report["passed"],
                worst=_worst(report),
                expert_imbalance_max=max(r["expert_imbalance"] for s in steps for r in s.values()),
                rank_imbalance_max=max(r["rank_imbalance"] for s in steps for r in s.values()),
                dropped_total=sum(r["dropped"] for s in steps for r in s.values()),
            ))
            print(f"{'PASS' if report['passed'] else 'FAIL'} world {world} {model} {layout} {options or ''}: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in rows[-1]["worst"].items()))
        if world == 4:
            for (ep, capacity), r in results[0]["block"].items():
                block[f"ep={ep},{capacity}"] = dict(errors=r["errs"], same_routing=r["same_routing"],
                                                    counts_match=r["counts"], rows_sum_diff=r["rows"],
                                                    dropped_parallel_vs_reference=r["dropped"])
    Path(args.out).write_text(json.dumps(dict(layouts=rows, block_level_rank0=block), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
