"""Speed of the training planner over its full search space (a benchmark, not a test).

Usage::

    python benchmarks/plan_speed.py [--out benchmarks/results/plan_speed.json] [--repeat 3]

Plans the 1T-parameter GPT of Narayanan et al. 2021 on 3072 A100-80GB (global batch 3072,
seq 2048) and Kimi K2 on 1024 H200 (global batch 4096 sequences of 4096 tokens) and reports,
per case: candidates evaluated, the whole plan's wall-clock and CPU time (best of --repeat runs;
the first run of each case builds the per-model caches, as a fresh ``modelcarve plan`` does,
because every run starts from a fresh cost model), and layouts evaluated per CPU second.
Targets from issue #3: at least 50,000 layouts/s and under 2 s per plan.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from modelcarve.plan.train import goal as train_goal
from modelcarve.plan.search import search
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

CASES = [
    {"name": "gpt-1t on 3072 A100-80GB", "model": "gpt-1t", "cluster": "384x8xA100-80GB", "global_batch": 3072, "seq": 2048},
    {"name": "kimi-k2 on 1024 H200", "model": "kimi-k2", "cluster": "128x8xH200", "global_batch": 4096, "seq": 4096},
]


def run_case(case: dict, repeat: int) -> dict:
    model, cluster = get_model(case["model"]), parse_cluster(case["cluster"])
    best = None
    for _ in range(repeat):
        train_goal.GOAL._models.clear()  # a fresh plan: no cost-model cache survives between runs
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = search(model, cluster, "train", top=5, global_batch=case["global_batch"], seq=case["seq"])
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if best is None or cpu < best["cpu_s"]:
            best = {"wall_s": wall, "cpu_s": cpu, "result": result}
    result = best["result"]
    top = result["layouts"][0]
    return {
        "case": case["name"],
        "evaluated": result["evaluated"],
        "rejected": result["rejected"],
        "plan_wall_s": round(best["wall_s"], 3),
        "plan_cpu_s": round(best["cpu_s"], 3),
        "layouts_per_cpu_s": round(result["evaluated"] / best["cpu_s"]),
        "layouts_per_wall_s": round(result["evaluated"] / best["wall_s"]),
        "best": top["short"],
        "best_layout": top["layout"],
        "best_tokens_per_s": round(top["time"]["tokens_per_s"]),
        "best_mfu": round(top["time"]["mfu"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/plan_speed.json")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = [run_case(case, args.repeat) for case in CASES]
    report = {"python": platform.python_version(), "machine": platform.machine(), "cases": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        print(
            f"{row['case']}: {row['evaluated']} layouts in {row['plan_cpu_s']:.2f} s CPU "
            f"({row['plan_wall_s']:.2f} s wall), {row['layouts_per_cpu_s']:,} layouts/s; best {row['best']}"
        )


if __name__ == "__main__":
    main()
