"""Measured pipeline bubble from the gathered timeline (runtime/measure/timeline.py) against the planner's
formula (plan/cost/schedule.py) and model (plan/predict/timeline.py), at m = 2p, 4p, 8p on pp=2 gloo ranks.

    OMP_NUM_THREADS=1 python benchmarks/pipeline_timeline.py --out benchmarks/results/pipeline_timeline.json

Per schedule and micro-batch count: one warm-up step, then ``--steps`` steps; each step's records
are gathered once to rank 0 and its bubble is ``plan.timeline.bubble`` (1 - summed compute time /
(ranks x the step's common wall, first compute start to last compute end)). Reported: the median
over steps, beside the formula. The JSON records the load average before and after (the machine
may be shared; a loaded machine inflates the measured bubble). ``--png-dir`` draws each last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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
    args = parser.parse_args()
    from modelcarve.plan.cost.schedule import bubble_fraction
    from modelcarve.plan.predict.timeline import bubble, model_records

    cases = [(s, v, m) for s, v in SCHEDULES for m in args.microbatches]
    load_before = os.getloadavg()
    rows = run_distributed(measure, 2, args.model, cases, args.seq, args.steps, timeout=1800, collective_s=300)[0]
    load_after = os.getloadavg()
    results = []
    for row in rows:
        got = [bubble(recs) for recs in row["steps"]]
        model = bubble(model_records(row["schedule"], 2, row["m"], row["v"]))["overall"]
        res = dict(schedule=row["schedule"], virtual_stages=row["v"], microbatches=row["m"],
                   bubble_measured=round(statistics.median(g["overall"] for g in got), 4),
                   bubble_measured_per_step=[round(g["overall"], 4) for g in got],
                   bubble_per_rank_last=[round(b, 4) for b in got[-1]["per_rank"].values()],
                   bubble_formula=round(bubble_fraction(row["schedule"], 2, row["m"], row["v"]), 4),
                   bubble_model=round(model, 4), step_wall_s=round(statistics.median(g["wall"] for g in got), 4))
        results.append(res)
        print(f"{row['schedule']:>17} v{row['v']} m{row['m']:>2}: bubble measured {res['bubble_measured']:.3f} "
              f"(steps {res['bubble_measured_per_step']}) formula {res['bubble_formula']:.3f} model {res['bubble_model']:.3f}",
              flush=True)
        if args.png_dir:
            from modelcarve.report.timeline import plot_timeline

            Path(args.png_dir).mkdir(parents=True, exist_ok=True)
            plot_timeline([("measured", row["steps"][-1], "s", res["bubble_formula"]),
                           ("planner's model", model_records(row["schedule"], 2, row["m"], row["v"]), "units", res["bubble_formula"])],
                          Path(args.png_dir) / f"{row['schedule']}-m{row['m']}.png", title=f"{args.model} pp=2 {row['schedule']} m={row['m']}")
    report = dict(model=args.model, pp=2, seq=args.seq, mbs=1, steps=args.steps, dtype="fp32",
                  machine=dict(cpus=os.cpu_count(), loadavg_before=load_before, loadavg_after=load_after),
                  results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
