"""Pipeline schedules on CPU: measured bubble (idle fraction) against the planner's model, and
one step's timeline per schedule (the data of a pipeline figure).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_schedules.py --out benchmarks/results/pipeline_schedules.json

For pp=2 ranks (one process and one thread each) of small-llama (~20M parameters, 8 layers, fp32)
and every schedule x micro-batch count, the runner (runtime/parallel/pipeline.py) runs ``--steps``
forward+backward steps after one warm-up step. Per rank and step: the step's wall time, the time
inside compute actions (F, B, I, W, timed by the runner), and so the idle fraction
``1 - busy / step``. The bubble reported is the mean over ranks and steps, set beside
``plan.schedule.bubble_fraction`` (Narayanan et al. 2021; ZB-H1 for zero-bubble). Idle time
also holds the per-step overhead (loss broadcast, the schedule's own bookkeeping, sends), so the
measured figure sits above the model when micro-batches are short. The machine may be shared:
the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from dist import run_distributed  # noqa: E402 - the shared multi-process harness (tests/dist.py)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)]


def spawn(fn, world, *args):
    """``fn(*args)`` on ``world`` gloo ranks, collective timeout 300 s; one result per rank."""
    return run_distributed(fn, world, *args, timeout=1800, collective_s=300)


def pipeline_case(spec, schedule: str, v: int, m: int, seq: int):
    """This rank's pp=2 runner for one (schedule, v, m) case of ``spec`` and its seeded batch."""
    import torch
    import torch.nn.functional as F

    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.pipeline import build_pipeline, split_model
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(f"pp=2,schedule={schedule},virtual_stages={v},gbs={m},mbs=1,seq={seq},param_dtype=fp32")
    mesh = build_mesh(layout)
    chunks = split_model(build_model(spec, seed=0), layout, mesh.get_local_rank("pp"))
    runner = build_pipeline(chunks, layout, mesh, lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (m, seq), generator=gen)
    targets = torch.randint(0, spec.vocab_size, (m, seq), generator=gen)
    return runner, tokens, targets


def measure(model_name, cases, seq, steps):
    """On every rank: for each (schedule, v, m), the timings of ``steps`` measured steps."""
    from modelcarve.spec.catalog import get_model

    spec = get_model(model_name)
    rows = []
    for schedule, v, m in cases:
        runner, tokens, targets = pipeline_case(spec, schedule, v, m, seq)
        step_s, busy_s = [], []
        for step in range(steps + 1):
            start = time.perf_counter()
            runner.step(tokens, targets)
            elapsed = time.perf_counter() - start
            for chunk in runner.chunks:
                chunk.zero_grad(set_to_none=True)
            if step:  # the first step is warm-up (shape inference, allocator)
                step_s.append(elapsed)
                busy_s.append(sum(a.end_s - a.start_s for a in runner.actions))
        timeline = runner.gather_actions()
        rows.append(dict(
            schedule=schedule, virtual_stages=v, microbatches=m, step_s=step_s, busy_s=busy_s,
            sent_bytes=runner.sent_bytes,
            timeline={r: [(a.stage, a.microbatch, a.kind, round(a.start_s, 5), round(a.end_s, 5)) for a in acts]
                      for r, acts in timeline.items()},
        ))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--out", default="benchmarks/results/pipeline_schedules.json")
    args = parser.parse_args()
    from modelcarve.plan.cost.schedule import bubble_fraction
    from modelcarve.spec.catalog import get_model

    cases = [(s, v, m) for s, v in SCHEDULES for m in args.microbatches]
    load_before = os.getloadavg()
    per_rank = spawn(measure, 2, args.model, cases, args.seq, args.steps)
    load_after = os.getloadavg()
    spec = get_model(args.model)
    results = []
    for i, (schedule, v, m) in enumerate(cases):
        ranks = [per_rank[r][i] for r in range(2)]
        idle = [1 - b / s for row in ranks for b, s in zip(row["busy_s"], row["step_s"])]
        step = sum(s for row in ranks for s in row["step_s"]) / sum(len(row["step_s"]) for row in ranks)
        measured, model = sum(idle) / len(idle), bubble_fraction(schedule, 2, m, v)
        results.append(dict(
            schedule=schedule, virtual_stages=v, microbatches=m,
            step_s=round(step, 4), tokens_per_s=round(m * args.seq / step, 1),
            bubble_measured=round(measured, 4), bubble_model=round(model, 4),
            sent_bytes_per_rank=[row["sent_bytes"] for row in ranks],
            sent_bytes_hand=(2 * v - 1) * m * args.seq * spec.hidden_size * 4,
            timeline=ranks[0]["timeline"] if m == 4 else None,
        ))
        print(f"{schedule:>17} v{v} m{m}: step {step:7.3f} s  {m * args.seq / step:8.1f} tok/s  "
              f"bubble measured {measured:.3f}  model {model:.3f}", flush=True)
    report = dict(
        model=args.model, params=spec.total_params, pp=2, seq=args.seq, mbs=1, steps=args.steps, dtype="fp32",
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), threads_per_rank=1,
                     loadavg_before=load_before, loadavg_after=load_after),
        note="timeline: one step per schedule at m=4, {pp_rank: [(stage, microbatch, kind, start_s, end_s)]}, "
             "times from each rank's own step start",
        results=results,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
