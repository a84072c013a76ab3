"""Speed of the serving planner (a benchmark, not a test).

Usage::

    .venv/bin/python benchmarks/serve_speed.py [--repeat 3]     # writes benchmarks/results/serve_speed.json

For each case, a whole ``search`` (candidates enumerated, every one screened, the best evaluated
in full with their JSON) from cold caches, as a fresh ``modelcarve plan`` runs; best of
``--repeat`` runs by CPU time (``layouts_per_cpu_s``; the wall-clock rate is recorded too, but
the machine these figures come from is shared, so its load average is recorded as well). A
candidate is one layout (tp x pp x dp x ep) with one weight dtype and one KV dtype; for
serve-throughput its screening includes choosing the batch (serve_batch._largest_batch: a Newton
search over bands of batches, typically 1-3 decode-step evaluations per layout;
``batch_evaluations`` counts them over a whole search). Targets from issue #4: at least 50,000
layouts/s and under 2 s per plan.

``evaluated`` (and ``layouts_per_cpu_s``) counts every candidate the search screened, as before.
Once its top is full, the throughput screen prunes a candidate it proves would be accepted below
the top (``serve_prune.group_ceiling``: a ceiling on its tokens/s, and batch 1 meeting the bounds)
without choosing its batch; ``pruned`` counts those, and ``scored_per_cpu_s`` is the rate of the
candidates that were not pruned (``evaluated - pruned``: every rejected one and every one that
got a score), the same CPU time over the work not skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from modelcarve.plan.serve import batch as serve_batch, prune as serve_prune, time as serve_time
from modelcarve.plan.goals import get_goal
from modelcarve.plan.search import search
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("qwen3-32b", "2x8xH100", {"input_len": 2048, "output_len": 256}),
    ("llama-3.1-405b", "16x8xH100", {"input_len": 2048, "output_len": 256}),
    ("kimi-k2", "128x8xH200", {"input_len": 8192, "output_len": 1024}),
    ("deepseek-v3", "128x8xH200", {"input_len": 4096, "output_len": 1024}),
]
BOUNDS = {"serve-latency": {}, "serve-throughput": {"ttft_ms": 2000, "tpot_ms": 50}}


def _clear() -> None:
    serve_time.clear_caches()
    serve_prune._MESH_FLOORS.clear()


def run_case(model_name: str, cluster_name: str, shape: dict, goal: str, repeat: int) -> dict:
    model, cluster = get_model(model_name), parse_cluster(cluster_name)
    options = dict(shape, **BOUNDS[goal])
    best = None
    for _ in range(repeat):
        _clear()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = search(model, cluster, goal, top=5, **options)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if best is None or cpu < best[1]:
            best = (wall, cpu, result)
    wall, cpu, result = best
    winner = result["layouts"][0] if result["layouts"] else None
    # How many decode-step evaluations the batch search made (one per band of batches it tried;
    # see serve_batch._largest_batch): counted in a separate, untimed run (the counter would slow
    # the timed one).
    calls = [0]
    original, original_step = serve_batch._step_slope, serve_prune._stage_step

    def counting(c, batch):
        calls[0] += 1
        return original(c, batch)

    def counting_step(c, batch, detail=False):  # the pruning check's batch-1 step
        calls[0] += not detail
        return original_step(c, batch, detail)

    # And how many candidates the screen pruned (search.py's ``screen.above``), in the same run.
    pruned = [0]
    goal_obj = get_goal(goal)
    prepare = goal_obj.prepare

    def counting_prepare(*args, **kwargs):
        screen = prepare(*args, **kwargs)
        if not hasattr(screen, "above"):
            return screen

        def above(candidate, floor):
            answer = screen.above(candidate, floor)
            pruned[0] += answer is None
            return answer

        wrapped = lambda candidate: screen(candidate)  # noqa: E731
        wrapped.above = above
        return wrapped

    serve_batch._step_slope, serve_prune._stage_step = counting, counting_step
    goal_obj.prepare = counting_prepare
    try:
        _clear()
        again = search(model, cluster, goal, top=5, **options)
    finally:
        serve_batch._step_slope, serve_prune._stage_step = original, original_step
        del goal_obj.prepare
    assert again["layouts"] == result["layouts"] and again["rejected"] == result["rejected"]
    return {
        "goal": goal,
        "model": model_name,
        "cluster": cluster_name,
        "options": options,
        "evaluated": result["evaluated"],
        "plan_wall_s": round(wall, 4),
        "plan_cpu_s": round(cpu, 4),
        "layouts_per_cpu_s": round(result["evaluated"] / cpu),
        "layouts_per_wall_s": round(result["evaluated"] / wall),
        "pruned": pruned[0],
        "scored_per_cpu_s": round((result["evaluated"] - pruned[0]) / cpu),
        "batch_evaluations": calls[0],
        "batch_evaluations_per_cpu_s": round(calls[0] / cpu),
        "winner": winner["name"] if winner else None,
        "winner_serve": winner["serve"] if winner else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = [run_case(m, c, s, g, args.repeat) for m, c, s in CASES for g in BOUNDS]
    report = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_speed.json").write_text(json.dumps(report, indent=2))
    print(f"load average {load_before[0]:.1f} on {os.cpu_count()} CPUs")
    for r in results:
        print(
            f"{r['goal']:17s} {r['model']:15s} {r['cluster']:11s} {r['evaluated']:5d} layouts  "
            f"{r['layouts_per_cpu_s']:8,d}/CPU-s  {r['layouts_per_wall_s']:8,d}/wall-s  plan {r['plan_wall_s']:.3f} s  "
            + (f"({r['batch_evaluations'] / r['evaluated']:.1f} decode steps/layout, {r['pruned']} pruned, "
               f"{r['scored_per_cpu_s']:,d} scored/CPU-s)  " if r["batch_evaluations"] else "")
            + f"-> {r['winner']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
