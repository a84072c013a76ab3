"""The pipeline schedule's host time per action, measured with the runtime's own pipeline: the
``pipeline_action_s`` of a probed cluster file (``hardware --probe``).

On the probe's ranks (gloo, as ``run`` starts them): pp=2 (times ``dp`` for more ranks), GPipe,
``MICROBATCHES`` micro-batches of a tiny llama (the catalogue's ``tiny-llama``, hidden 64: its
arithmetic takes microseconds), one warm-up step then ``STEPS`` steps, each rank's action records
(runtime/measure/timeline.py). Under GPipe the first stage's forwards depend only on its own
previous forward, and the last stage's backwards only on its own forwards, all done before
them; so the gap between two consecutive forwards on the first rank, or two consecutive
backwards on the last, is host time alone: the finished action's sends posted, the schedule's
bookkeeping, the next action's receives and setup. ``pipeline_action_s`` is the median of those
gaps; plan/train/pipeline_costs.py adds it after every action of the planner's timeline.
"""

from __future__ import annotations

import statistics

MICROBATCHES = 8
STEPS = 5
SEQ = 16


def action_gaps(world: int) -> list[float]:
    """On every probe rank (inside its process group): the host gaps this rank measured, seconds;
    [] on ranks that measure none (middle ranks) or when ``world`` is odd (no pp=2 layout)."""
    if world % 2:
        return []
    import torch
    import torch.nn.functional as F

    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.measure.timeline import local_records
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.pipeline import build_pipeline, split_model
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    dp = world // 2
    spec = get_model("tiny-llama")
    layout = Layout.parse(f"pp=2,dp={dp},schedule=gpipe,gbs={MICROBATCHES * dp},mbs=1,seq={SEQ},param_dtype=fp32")
    mesh = build_mesh(layout)
    pp_rank = mesh.get_local_rank("pp")
    chunks = split_model(build_model(spec, seed=0), layout, pp_rank)
    runner = build_pipeline(chunks, layout, mesh, lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (MICROBATCHES, SEQ), generator=gen)
    targets = torch.randint(0, spec.vocab_size, (MICROBATCHES, SEQ), generator=gen)
    kind = "F" if pp_rank == 0 else "B"
    gaps: list[float] = []
    for step in range(STEPS + 1):
        runner.step(tokens, targets)
        for chunk in runner.chunks:
            chunk.zero_grad(set_to_none=True)
        if step:
            recs = sorted((r for r in local_records(runner)["records"] if r["kind"] == kind), key=lambda r: r["start"])
            gaps += [b["start"] - a["end"] for a, b in zip(recs, recs[1:])]
    return gaps


def action_s(per_rank_gaps: list[list[float]]) -> float | None:
    """The median host gap over every rank's measurements; None when none were measured."""
    gaps = [g for rank in per_rank_gaps for g in rank]
    return statistics.median(gaps) if gaps else None
