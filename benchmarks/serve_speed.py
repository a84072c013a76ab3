"""Speed of the serving planner: layouts screened per second and the wall time of whole plans.

Usage::

    .venv/bin/python benchmarks/serve_speed.py      # prints and writes benchmarks/results/serve_speed.json

"Screened" is one call of the goal's cheap scorer on one candidate (layout x weight dtype x KV
dtype), the work the one search does for every candidate; for serve-throughput it includes the
batch search (a binary search over the batch, ~10 decode-step evaluations). Caches are cleared
before each measurement so the figures include the per-layout setup.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from modelcarve.plan import serve_memory, serve_time
from modelcarve.plan.goals import get_goal
from modelcarve.plan.search import search
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("qwen3-32b", "2x8xH100", {"input_len": 2048, "output_len": 256}),
    ("llama-3.1-405b", "16x8xH100", {"input_len": 2048, "output_len": 256}),
    ("kimi-k2", "8x8xH200", {"input_len": 8192, "output_len": 1024}),
    ("deepseek-v3", "64x8xH200", {"input_len": 4096, "output_len": 1024}),
]
BOUNDS = {"serve-latency": {}, "serve-throughput": {"ttft_ms": 2000, "tpot_ms": 50}}


def _clear() -> None:
    serve_memory._FACTS.clear()
    serve_time._CTX.clear()


def measure(model_name: str, cluster_name: str, shape: dict, goal_name: str) -> dict:
    model, cluster = get_model(model_name), parse_cluster(cluster_name)
    goal = get_goal(goal_name)
    options = dict(shape, **BOUNDS[goal_name])
    candidates = list(goal.candidates(model, cluster, **options))
    _clear()
    screen = goal.prepare(model, cluster, **options)
    started = time.perf_counter()
    for candidate in candidates:
        screen(candidate)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    repeats = max(1, 20000 // len(candidates))
    for _ in range(repeats):
        for candidate in candidates:
            screen(candidate)
    warm = (time.perf_counter() - started) / repeats
    _clear()
    started = time.perf_counter()
    plan = search(model, cluster, goal_name, top=5, **options)
    plan_s = time.perf_counter() - started
    return {
        "model": model_name,
        "cluster": cluster_name,
        "goal": goal_name,
        "candidates": len(candidates),
        "screened_per_s_cold": len(candidates) / cold,
        "screened_per_s_warm": len(candidates) / warm,
        "plan_s": plan_s,
        "winner": plan["layouts"][0]["name"] if plan["layouts"] else None,
    }


def main() -> int:
    results = [measure(m, c, s, g) for m, c, s in CASES for g in BOUNDS]
    report = {"python": sys.version.split()[0], "machine": platform.machine(), "results": results}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_speed.json").write_text(json.dumps(report, indent=2))
    for r in results:
        print(
            f"{r['goal']:17s} {r['model']:15s} {r['cluster']:10s} {r['candidates']:5d} candidates  "
            f"{r['screened_per_s_cold']:9,.0f}/s cold  {r['screened_per_s_warm']:9,.0f}/s warm  plan {r['plan_s']:.3f} s  -> {r['winner']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
