"""What one pipeline step's timeline costs, from the training cost model: the inputs of
plan/predict/timeline.py's ``model_records`` (commands join the two: plan/predict knows no plan/train).

    from modelcarve.plan.train.pipeline_costs import schedule_costs
    costs = schedule_costs(model, cluster, layout)          # seconds, per stage
    records = model_records(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages, **costs)

* ``f`` / ``b``: every stage's forward and backward of one micro-batch, the training cost model's
  (plan/train/profile.py): its layers' GEMMs and attention at the device's rates, the LM head and
  loss on the last stage (which is why the last stage is the slow one on a small model: the head
  of an 8k vocabulary costs ~1.8 decoder layers of a 384-wide model), the embedding's lookup on
  the first free. Layers per stage are spec/stages.py's split (the runtime's), so an interleaved
  schedule's chunks each get their own layers.
* ``i_share``: of a stage's backward, the part a zero-bubble schedule runs as I (the input
  gradient) before W (the weight gradient): half (equal GEMMs), except on the first stage, whose
  input (token ids) needs no gradient: torch's schedule runs the whole backward there as W
  (measured: I 0.03 ms, W 24 ms on small-llama).
* ``send_s``: one activation (or its gradient) to the neighbour stage, comm.p2p_s on the tier the
  pipeline spans (the profile's ``p2p_s``).
* ``host_s``: the host time a rank spends after each action before the next can start (posting the
  action's sends and receives, the schedule's bookkeeping): the device's ``pipeline_action_s``,
  which ``hardware --probe`` measures by running the runtime's own pipeline on a tiny model; 0 for
  catalogue GPUs, where the host enqueues ahead of the stream and this time hides under kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.spec.stages import layout_holdings

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec


def schedule_costs(model: "ModelSpec", cluster: "ClusterSpec", layout: "Layout", options=None) -> dict:
    """``model_records`` keyword arguments for ``layout`` on ``cluster`` (see the module doc)."""
    from modelcarve.plan.train.model import TrainCostModel, TrainOptions

    p, v = layout.pp, layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1
    if p < 2:
        raise ValueError(f"layout {layout.short()} has no pipeline (pp={p})")
    cost = TrainCostModel(model, cluster, options or TrainOptions(global_batch=layout.global_batch, seq=layout.seq))
    dtype = "fp8cs" if layout.param_dtype == "fp8" and layout.fp8_scaling == "current" else layout.param_dtype
    prof = cost.profile(layout.tp, layout.cp, p, layout.dp, layout.ep, layout.mbs, layout.sp, layout.recompute,
                        layout.seq, dtype=dtype, etp=layout.expert_tp if layout.ep > 1 else 0, v=v)
    dense, moe = prof["dense"], prof["moe"]
    last = prof["stages"]["last"]
    head_f = last["fwd_s"] - dense["fwd_s"] * (last["layers"] - last["moe_layers"]) - moe["fwd_s"] * last["moe_layers"]
    head_b = last["bwd_s"] - dense["bwd_s"] * (last["layers"] - last["moe_layers"]) - moe["bwd_s"] * last["moe_layers"]
    moe_ids = frozenset(model.moe_layers)
    f, b, start = [], [], 0
    stages = p * v
    mtp = cost.options.mtp_layers
    # the split the cost model prices (TrainCostModel.holdings checks a stated one)
    counts = layout_holdings(cost.layout_string(p, v), model.num_layers, p, v, moe_ids)[1]
    for s, count in enumerate(counts):
        n_moe = sum(1 for i in range(start, start + count) if i in moe_ids)
        start += count
        if s == stages - 1 and mtp:  # the MTP depths' decoder layers (TrainCostModel.holdings)
            count, n_moe = count + mtp, n_moe + (mtp if (model.num_layers - 1) in moe_ids else 0)
        fs = dense["fwd_s"] * (count - n_moe) + moe["fwd_s"] * n_moe
        bs = dense["bwd_s"] * (count - n_moe) + moe["bwd_s"] * n_moe
        if s == stages - 1:
            fs, bs = fs + head_f, bs + head_b
        f.append(fs)
        b.append(bs)
    return dict(f=f, b=b, i_share=[0.0] + [0.5] * (stages - 1), send_s=prof["p2p_s"],
                host_s=getattr(cluster.device, 'pipeline_action_s', 0.0))
