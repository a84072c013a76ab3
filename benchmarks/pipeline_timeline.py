"""Measured pipeline bubble from the gathered timeline (runtime/measure/timeline.py) against the planner's
model (plan/predict/timeline.py priced by plan/train/pipeline_costs.py on this machine's probed
cluster) and its formula (plan/cost/schedule.py), at m = 2p, 4p, 8p on pp=2 gloo ranks.

    OMP_NUM_THREADS=1 python benchmarks/pipeline_timeline.py --out benchmarks/results/pipeline_timeline.json
    OMP_NUM_THREADS=1 python benchmarks/pipeline_timeline.py --cluster probed.yaml   # skip the probe

First ``modelcarve hardware --probe`` (unless ``--cluster`` is given) measures this machine: its
GEMM and memory rates price every stage's forward and backward (the last stage's head and loss
included), its link prices the sends, its ``pipeline_action_s`` is the host time per action.
Then per schedule and micro-batch count: one warm-up step, then ``--steps`` steps; each step's
records are gathered once to rank 0 and its bubble is ``plan.timeline.bubble`` (1 - summed compute
time / (ranks x the step's common wall, first compute start to last compute end)). Reported: the
median over steps, beside the priced model (``bubble_model``), the model with equal stages and no
costs (``bubble_model_uniform``, what the planner drew before) and the formula. The JSON records the
1-minute load average before and after and flags the run not quiet above 1.5 (a loaded machine
inflates the measured bubble). ``--png-dir`` draws each last step beside the priced model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from dist import run_distributed  # noqa: E402 - the shared multi-process harness (tests/dist.py)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)]


def measure(model_name, cases, seq, steps):
    from pipeline_schedules import pipeline_case

    from modelcarve.runtime.measure.timeline import gather_records, local_records
    from modelcarve.spec.catalog import get_model

    spec = get_model(model_name)
    rows = []
    for schedule, v, m in cases:
        runner, tokens, targets = pipeline_case(spec, schedule, v, m, seq)
        steps_recs = []
        for step in range(steps + 1):
            runner.step(tokens, targets)
            for chunk in runner.chunks:
                chunk.zero_grad(set_to_none=True)
            recs = gather_records(local_records(runner), runner)
            if step:
                steps_recs.append(recs)
        rows.append(dict(schedule=schedule, v=v, m=m, steps=steps_recs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--out", default="benchmarks/results/pipeline_timeline.json")
    parser.add_argument("--png-dir", default=None)
    parser.add_argument("--cluster", default=None, help="a probed cluster file (default: run hardware --probe first)")
    args = parser.parse_args()
    from modelcarve.plan.cost.schedule import bubble_fraction
    from modelcarve.plan.train.pipeline_costs import schedule_costs
    from modelcarve.plan.predict.timeline import bubble, model_records
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import load_cluster_file
    from modelcarve.spec.layout import Layout

    cluster_path = args.cluster
    if cluster_path is None:
        cluster_path = str(Path(tempfile.mkdtemp()) / "probed.yaml")
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        subprocess.run([sys.executable, "-m", "modelcarve.cli", "hardware", "--probe", "--emit", cluster_path],
                       env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    cluster = load_cluster_file(Path(cluster_path))
    spec = get_model(args.model)
    cases = [(s, v, m) for s, v in SCHEDULES for m in args.microbatches]
    load_before = os.getloadavg()
    rows = run_distributed(measure, 2, args.model, cases, args.seq, args.steps, timeout=1800, collective_s=300)[0]
    load_after = os.getloadavg()
    results = []
    for row in rows:
        got = [bubble(recs) for recs in row["steps"]]
        layout = Layout.parse(f"pp=2,schedule={row['schedule']},virtual_stages={row['v']},gbs={row['m']},mbs=1,"
                              f"seq={args.seq},param_dtype=fp32")
        costs = schedule_costs(spec, cluster, layout)
        priced = model_records(row["schedule"], 2, row["m"], row["v"], **costs)
        model = bubble(priced)
        measured = statistics.median(g["overall"] for g in got)
        res = dict(schedule=row["schedule"], virtual_stages=row["v"], microbatches=row["m"],
                   bubble_measured=round(measured, 4),
                   bubble_measured_per_step=[round(g["overall"], 4) for g in got],
                   bubble_per_rank_last=[round(b, 4) for b in got[-1]["per_rank"].values()],
                   bubble_model=round(model["overall"], 4),
                   bubble_model_per_rank=[round(b, 4) for b in model["per_rank"].values()],
                   model_minus_measured_points=round(100 * (model["overall"] - measured), 2),
                   bubble_model_uniform=round(bubble(model_records(row["schedule"], 2, row["m"], row["v"]))["overall"], 4),
                   bubble_formula=round(bubble_fraction(row["schedule"], 2, row["m"], row["v"]), 4),
                   step_wall_s=round(statistics.median(g["wall"] for g in got), 4),
                   step_wall_model_s=round(model["wall"], 4),
                   costs=dict(f_s=[round(x, 6) for x in costs["f"]], b_s=[round(x, 6) for x in costs["b"]],
                              i_share=costs["i_share"], send_s=round(costs["send_s"], 6), host_s=round(costs["host_s"], 6)))
        results.append(res)
        print(f"{row['schedule']:>17} v{row['v']} m{row['m']:>2}: bubble measured {res['bubble_measured']:.3f} "
              f"(steps {res['bubble_measured_per_step']}) model {res['bubble_model']:.3f} "
              f"({res['model_minus_measured_points']:+.1f} points; equal stages {res['bubble_model_uniform']:.3f}) "
              f"wall {res['step_wall_s']:.3f} s, model {res['step_wall_model_s']:.3f} s", flush=True)
        if args.png_dir:
            from modelcarve.report.timeline import plot_timeline

            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            plot_timeline([("measured", row["steps"][-1], "s", res["bubble_formula"]),
                           ("planner's model, priced", priced, "s", res["bubble_formula"])],
                          Path(args.png_dir) / f"{row['schedule']}-m{row['m']}.png", title=f"{args.model} pp=2 {row['schedule']} m={row['m']}")
    worst = max(abs(r["model_minus_measured_points"]) for r in results)
    quiet = max(load_before[0], load_after[0]) < 1.5
    print(f"worst |model - measured|: {worst:.1f} points; load {load_before[0]:.2f} -> {load_after[0]:.2f}"
          + ("" if quiet else " (NOT quiet: 1-minute load above 1.5)"))
    report = dict(model=args.model, pp=2, seq=args.seq, mbs=1, steps=args.steps, dtype="fp32",
                  machine=dict(cpus=os.cpu_count(), loadavg_before=load_before, loadavg_after=load_after, quiet=quiet),
                  cluster=Path(cluster_path).read_text(), worst_points=round(worst, 2), results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
