"""verify --against-plan on mixture-of-experts models: every row judged, bytes and memory equal
to the byte, activations within 10% (fp32), on real gloo ranks (one world per rank count).

Models: a tiny Qwen3-MoE checkpoint made here (4 experts, top-2, qk-norm; tests/hf_tiny.py) and the
catalog's tiny-moe (Mixtral-style, 8 experts, top-2). The prediction is plan/predict/moe_traffic.py:
the EP all-to-alls (the int64 count matrix, the dispatched and combined rows forward and again in
backward) are predicted GIVEN the routing verify/against_plan.py recorded (each rank's rows per
expert, per dispatcher call): equal to the byte, wire included (each rank's own split stays home).
Beside them ``payload:all_to_all_apriori`` (uniform routing x the planner's 1.25 load imbalance)
is reported, never judged. Expert gradients are summed over the expert-data-parallel group and
ZeRO-1/2 keep one bucket per reduction group (dp x cp, expert-dp), each padded to its group.

Activations (plan/predict/moe_activations.py: the router's tensors, the grouping indices, the
experts over the rows this rank's experts received, the combine) hold within 10%: in fp32 the measured
difference is 32 bytes per MoE layer (the aux loss's load, counted but shared) plus activations.py's
28 bytes of boolean masks under tp, far below it; in bf16 (autocast, and bf16-held parameters) within
1.1%.

Pipelines: GPipe and 1F1B (the micro-batches in flight), interleaved 1F1B and zero-bubble (the
executed actions, each dispatcher call mapped to its (stage, micro-batch) through them).

FSDP2 and HSDP: each decoder layer a unit over the dp shard group, under EP each MoE layer's routed
experts a unit of their own over expert-dp (runtime/parallel/data_parallel.py).

Context parallelism (each rank routes its ``seq / cp`` zig-zag tokens; EP carved from the dp x cp
ranks; the aux loss, unused, skipped), HSDP-style ZeRO-1/2 (``dp_shard``: the dense bucket over its
shard group, its owned range all-reduced over the replicas; the expert bucket over expert-dp) and
recomputation (full: every block's forward again in the backward, the EP all-to-alls included;
selective: the attention core; the MoE block's terms held or re-saved per its routing).

Recomputation under interleaved 1F1B and zero-bubble (activations.py's scheduled_recompute_peak walk,
each micro-batch with its own routing, moe_activations.moe_recompute_parts): over the measured peak by
the aux loss's load per MoE layer held (32 bytes on tiny-moe, 16 on the Qwen3-MoE); zero-bubble's last
stage under full by the same load per recomputed copy alive at its peak (W recomputes each layer once
per weight group: activations.py weight_step_walk), every run alike (memory_report counts each
recomputed copy until its storage dies).

A folded expert mesh (etp=1 != tp) under recomputation and context parallelism: the cases of
tests/verify/test_verify_against_plan_folded.py.

A folded expert mesh with expert TP of its own (etp > 1: its ETP all-gather and all-to-alls) is judged
in tests/verify/test_verify_against_plan_etp.py (dp=4,ep=2,etp=2 among its cases, byte by byte).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py, hf_tiny.py
from dist import run_distributed  # noqa: E402
from verify_checks import against_plan_worker  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
Q3 = "qwen3_moe"  # replaced by the checkpoint's path in the worker
CASES_2 = [
    (Q3, f"dp=2,ep=2,gbs=4,{FP32}"),  # edp = 1: the experts' gradients are reduced nowhere
    (Q3, f"dp=2,gbs=4,{FP32}"),  # no EP: experts replicated, reduced with the rest over dp
    (Q3, f"dp=2,ep=2,zero=1,gbs=8,{FP32}"),  # two ZeRO buckets: dense over dp, experts alone (edp = 1)
    (Q3, f"tp=2,gbs=2,{FP32}"),  # expert TP = TP: F split, the router's gradient summed over tp
    ("tiny-moe", f"dp=2,ep=2,zero=2,gbs=4,{FP32}"),
    ("tiny-moe", f"tp=2,sp,gbs=2,{FP32}"),
    # bf16: autocast over fp32 parameters (the MoE block's combine stays fp32, so its forward tp
    # reduction carries fp32), and bf16-held parameters with fp32 masters (ZeRO-1)
    ("tiny-moe", "dp=2,ep=2,gbs=4,seq=16,mbs=1,param_dtype=bf16"),
    ("tiny-moe", "tp=2,sp,gbs=2,seq=16,mbs=1,param_dtype=bf16"),
    ("tiny-moe", "dp=2,ep=2,zero=1,gbs=4,seq=16,mbs=1,param_dtype=bf16"),
    # folded expert mesh (etp=1 != tp=2): EP over the TP ranks, the MoE blocks whole on each, each TP
    # rank routing its slice of the sequence (without sp the block all-gathers its output and input grad)
    (Q3, f"tp=2,ep=2,etp=1,gbs=2,{FP32}"),
    ("tiny-moe", f"tp=2,sp,ep=2,etp=1,gbs=2,{FP32}"),
    ("tiny-moe", "tp=2,ep=2,etp=1,gbs=2,seq=16,mbs=1,param_dtype=bf16"),
    # pipelines: each stage its own layers (spec/stages.py), sends, the loss broadcast; the activations
    # of the micro-batches in flight (1F1B: pp - stage of them; GPipe: all), each with its own routing
    ("tiny-moe", f"pp=2,gbs=4,schedule=1f1b,{FP32}"),
    ("tiny-moe", f"pp=2,gbs=8,schedule=gpipe,{FP32}"),
    # multi-chunk schedules: the activations follow the executed actions (each forward its stage's
    # micro-batch, with the routing of its own dispatcher calls); zero-bubble's last stage keeps the
    # loss graphs, W freeing only its weight nodes' inputs
    ("tiny-moe", f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,gbs=4,{FP32}"),
    ("tiny-moe", f"pp=2,schedule=zero-bubble,gbs=4,{FP32}"),
    (Q3, f"pp=2,schedule=zero-bubble,gbs=4,{FP32}"),  # q / k norms on the last stage
    # FSDP2: every decoder layer a unit over dp (the routed experts in it without EP); under EP the
    # experts a unit of their own over expert-dp (here one rank: never gathered)
    (Q3, f"dp=2,fsdp,gbs=4,{FP32}"),
    ("tiny-moe", f"dp=2,ep=2,fsdp,gbs=4,{FP32}"),
    # context parallelism: each rank routes its seq / cp zig-zag tokens, EP carved from the cp ranks,
    # ring attention's sends in every layer
    ("tiny-moe", f"cp=2,ep=2,gbs=2,{FP32}"),
    # recomputation: full re-runs each block's forward, the EP count exchange, dispatch and combine
    # included; the layers keep their inputs, the recomputed one its attention and MoE block terms
    ("tiny-moe", f"tp=2,sp,gbs=2,recompute=full,{FP32}"),  # the attention's tp messages again
]
BF16 = "seq=16,mbs=1,param_dtype=bf16"
Q3_4L = "qwen3_moe_4_layers"  # the same checkpoint with four layers: pp=2 x virtual_stages=2
CASES_2 += [
    # the tiny Qwen3-MoE in bf16 (autocast; ZeRO-2 holds bf16 parameters); cp's ring attention saves
    # q / k rotated in the rotary tables' dtype (fp32 under autocast) and its fp32 accumulator output
    (Q3, f"dp=2,ep=2,gbs=4,{BF16}"),
    (Q3, f"tp=2,sp,gbs=2,{BF16}"),
    (Q3, f"dp=2,ep=2,zero=2,gbs=4,{BF16}"),
    (Q3, f"cp=2,ep=2,gbs=2,{BF16}"),
    (Q3, f"pp=2,schedule=zero-bubble,gbs=4,{BF16}"),
    (Q3, f"tp=2,ep=2,etp=1,gbs=2,{BF16}"),
    (Q3, f"dp=2,fsdp,gbs=4,{BF16}"),
    (Q3, f"cp=2,gbs=2,{FP32}"),
    (Q3, f"pp=2,gbs=8,schedule=gpipe,{FP32}"),
    (Q3_4L, f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,gbs=4,{FP32}"),
    # Qwen3-MoE's q / k norms under recomputation (activations.py recompute_terms: outside the core)
    (Q3, f"dp=2,ep=2,gbs=4,recompute=full,{FP32}"),
    # recomputation under multi-chunk schedules: the executed order walked, each micro-batch's own routing
    ("tiny-moe", f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,gbs=4,recompute=full,{FP32}"),
    ("tiny-moe", f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,gbs=4,recompute=selective,{FP32}"),
    ("tiny-moe", f"pp=2,schedule=zero-bubble,gbs=4,recompute=full,{FP32}"),
    ("tiny-moe", f"pp=2,schedule=zero-bubble,gbs=4,recompute=selective,{FP32}"),
    (Q3, f"pp=2,schedule=zero-bubble,gbs=4,recompute=full,{FP32}"),
    (Q3_4L, f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,gbs=4,recompute=selective,{FP32}"),
    ("tiny-moe", f"pp=2,schedule=zero-bubble,gbs=4,recompute=selective,{BF16}"),
]
# ring attention of MoE layers under recomputation: the recomputed forward's third pass of K/V sends,
# ring attention's saved tensors in the recomputed (full) or kept (selective) attention
CASES_2 += [
    ("tiny-moe", f"cp=2,ep=2,gbs=2,recompute=full,{FP32}"),
    ("tiny-moe", f"cp=2,gbs=2,recompute=selective,{FP32}"),
    (Q3, f"cp=2,gbs=2,recompute=full,{FP32}"),
    (Q3, f"cp=2,ep=2,gbs=2,recompute=selective,{FP32}"),
    (Q3, f"cp=2,gbs=2,recompute=selective,{BF16}"),
]
# 4 ranks accounted as 2 per node: the tp group inside a node, dp / ep / edp across
CASES_4 = [
    (Q3, f"tp=2,dp=2,ep=2,gbs=4,{FP32}"),
    (Q3, f"tp=2,sp,dp=2,ep=2,zero=2,gbs=4,{FP32}"),
    ("tiny-moe", f"dp=4,ep=2,gbs=4,{FP32}"),  # edp = 2: expert gradients all-reduced over it
    ("tiny-moe", f"dp=4,ep=2,zero=1,gbs=8,{FP32}"),
    ("tiny-moe", f"pp=2,dp=2,ep=2,gbs=8,schedule=1f1b,{FP32}"),
    ("tiny-moe", f"pp=2,tp=2,sp,gbs=4,schedule=1f1b,{FP32}"),  # each tp rank sends its sequence shard on
    ("tiny-moe", f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,dp=2,ep=2,gbs=8,{FP32}"),
    (Q3, f"pp=2,schedule=zero-bubble,dp=2,ep=2,gbs=8,{FP32}"),
    ("tiny-moe", f"dp=4,ep=2,fsdp,gbs=4,{FP32}"),  # the experts' unit gathered / reduce-scattered over edp = 2
    ("tiny-moe", f"dp=4,dp_shard=2,fsdp,gbs=4,{FP32}"),  # HSDP: each unit's shard all-reduced over the replicas
    ("tiny-moe", f"dp=4,dp_shard=2,ep=2,fsdp,gbs=4,{FP32}"),
    ("tiny-moe", f"cp=2,tp=2,gbs=2,{FP32}"),
    # HSDP-style ZeRO-1/2: the dense bucket reduce-scattered / all-gathered in its dp_shard x cp
    # shard group and its owned range all-reduced over the replicas; the expert bucket over expert-dp
    ("tiny-moe", f"dp=4,dp_shard=2,ep=2,zero=2,gbs=4,{FP32}"),
    # 1F1B: the backward of each micro-batch recomputes its layers with the later ones in flight held
    ("tiny-moe", f"pp=2,dp=2,ep=2,recompute=full,schedule=1f1b,gbs=4,{FP32}"),
    ("tiny-moe", f"tp=2,dp=2,ep=2,recompute=selective,zero=2,gbs=4,{FP32}"),
    (Q3, f"dp=4,dp_shard=2,fsdp,gbs=4,{FP32}"),  # HSDP
    (Q3, f"dp=4,dp_shard=2,ep=2,fsdp,gbs=4,{BF16}"),
    (Q3, f"pp=2,tp=2,sp,gbs=4,schedule=1f1b,{FP32}"),
    (Q3_4L, f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,dp=2,ep=2,gbs=8,{FP32}"),
    ("tiny-moe", f"pp=2,virtual_stages=2,schedule=interleaved-1f1b,dp=2,ep=2,gbs=8,recompute=full,{FP32}"),
    # zero-bubble's W recomputes each MoE layer of the last stage once per weight group (10 on tiny-moe):
    # each recomputation's count exchange, dispatch and combine again (moe_traffic.ep_messages' forwards)
    ("tiny-moe", f"pp=2,schedule=zero-bubble,dp=2,ep=2,gbs=8,recompute=full,{FP32}"),
]


def _jobs(cases, checkpoint):
    """(model, layout) jobs for verify_checks.against_plan_worker: Q3 / Q3_4L are the tiny Qwen3-MoE
    checkpoints (``checkpoint``: {Q3: path, Q3_4L: path})."""
    return [(checkpoint.get(model, model), layout) for model, layout, *_ in cases]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_tiny import save_hf

    out = {}
    for name, layers in ((Q3, 2), (Q3_4L, 4)):
        path = tmp_path_factory.mktemp("qwen3moe") / "ckpt"
        save_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", path, num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers,
                moe_intermediate_size=48, head_dim=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def reports2(checkpoint):
    return run_distributed(against_plan_worker, 2, _jobs(CASES_2, checkpoint), timeout=600)[0]


@pytest.fixture(scope="module")
def reports4(checkpoint):
    return run_distributed(against_plan_worker, 4, _jobs(CASES_4, checkpoint), 2, timeout=600)[0]


def _check_judged(cases, reports):
    from modelcarve.verify.against_plan import REPORTED_ONLY, unjudged

    for (model, layout), report in zip(cases, reports):
        rows = report["against_plan"]
        assert {r["rank"] for r in rows} == set(range(report["world_size"]))
        assert not unjudged(rows) and report["passed"], (model, layout, unjudged(rows))
        assert all(r["why"] == REPORTED_ONLY for r in rows if r["ok"] is None), (model, layout)
        exact = [r for r in rows if r["quantity"].startswith(("payload:", "wire:")) and r["why"] is None]
        exact += [r for r in rows if r["quantity"] in ("params", "grads", "optimizer", "comm_buffers")]
        for r in exact:
            assert r["ok"] is True and r["predicted"] == pytest.approx(r["measured"], rel=1e-9, abs=0), (layout, r)
        for r in rows:
            if r["quantity"] == "activations":
                assert abs(r["predicted"] - r["measured"]) <= 0.10 * r["measured"], (layout, r)
        assert all(c["passed"] for c in report["checks"]), (model, layout)  # still matches the reference


def test_moe_layouts_judged_on_two_ranks(reports2):
    _check_judged(CASES_2, reports2[: len(CASES_2)])


def test_moe_layouts_judged_on_four_ranks(reports4):
    _check_judged(CASES_4, reports4)
    rows = [r for rep in reports4 for r in rep["against_plan"]]
    tiers = {(r["quantity"], r["axis"], r["tier"]) for r in rows if r["quantity"].startswith("payload:")}
    assert ("payload:all_to_all", "dp", "inter") in tiers  # the EP group spans the two nodes
    assert ("payload:all_reduce", "tp", "intra") in tiers


def test_ep_bytes_follow_the_routing(reports2):
    """dp=2,ep=2: the two ranks route differently, so their all-to-all payloads differ, each
    predicted exactly from the recorded counts; the a-priori estimate is reported beside them."""
    rows = reports2[0]["against_plan"]
    a2a = {r["rank"]: r for r in rows if r["quantity"] == "payload:all_to_all"}
    assert a2a[0]["ok"] and a2a[1]["ok"]
    prior = [r for r in rows if r["quantity"] == "payload:all_to_all_apriori"]
    assert len(prior) == 2 and all(r["ok"] is None and r["predicted"] > 0 for r in prior)


def test_activations_modelled_close(reports2, reports4):
    """The eager MoE terms are exact up to 32 bytes per MoE layer (+28 bytes of masks under tp), one
    micro-batch in flight (fp32, no pipeline; under one the terms of each micro-batch in flight add a
    few bytes more, 0.02-0.03%, held by the 10% check above)."""
    cases = [(c, r) for c, r in zip(CASES_2 + CASES_4, reports2[: len(CASES_2)] + reports4) if "fp32" in c[1]]
    # cp=2 x tp=2 measures 12 bytes more than predicted (0.007%): held by the 10% check only
    for report in [r for (_m, layout), r in cases if "pp=" not in layout and "cp=2,tp=2" not in layout]:
        for r in report["against_plan"]:
            if r["quantity"] == "activations":
                assert 0 <= r["predicted"] - r["measured"] <= 32 * 4 + 28, (report["layout"], r)


def test_scheduled_recomputation_close(reports2, reports4):
    """Interleaved 1F1B and zero-bubble under recomputation: the prediction is over the measured peak
    by at most the aux loss's load of the MoE layers held (32 bytes each on tiny-moe; at most 8 held
    here), in fp32 and bf16. Zero-bubble's last stage under full: by the load of each recomputed copy
    alive at the peak, the last micro-batch's W (4 micro-batches; I, I, W, I, W, I, W, W): tiny-moe's 2
    layers of 10 weight groups each, 3 x 2 x 10 left by the earlier Ws + 10 + the 10 of the last group
    (w2) = 80 copies; the Qwen3-MoE's one layer of 12 groups, 3 x 12 + 11 (its w3, before the expert
    rows go) = 47 copies of 16 bytes. Measured the same every run (it moved by up to 16 KiB when
    memory_report keyed a freed copy by its address)."""
    cases = list(zip(CASES_2 + CASES_4, reports2[: len(CASES_2)] + reports4))
    scheduled = [(c, r) for c, r in cases if "recompute=" in c[1] and ("interleaved" in c[1] or "zero-bubble" in c[1])]
    assert len(scheduled) == 9
    copies = {"tiny-moe": 80 * 32, Q3: 47 * 16}
    for (model, layout), report in scheduled:
        zb_full = "zero-bubble" in layout and "recompute=full" in layout
        for r in report["against_plan"]:
            if r["quantity"] != "activations":
                continue
            if zb_full and r["rank"] >= report["world_size"] // 2:  # pp=2 outermost: the last stage's ranks
                assert r["predicted"] - r["measured"] == copies[model], (layout, r)
            else:
                assert 0 <= r["predicted"] - r["measured"] <= 8 * 32, (layout, r)


def test_ep_messages_by_hand():
    """2 ranks, 4 experts (2 per EP rank), H = 64, fp32, one dispatcher call: rank 0's router sends
    [3, 1 | 2, 2] rows, rank 1's [1, 0 | 5, 2]. Rank 0 dispatches 4 rows to itself and 4 to rank 1
    and receives 4 + 1 rows: forward 8 + 5 rows out, backward 5 + 8, each 256 bytes; its own
    splits (4 rows each way) stay home; the counts: 32 bytes, 16 of them to rank 1."""
    import dataclasses

    from modelcarve.plan.predict.moe_traffic import LOAD_IMBALANCE, ep_messages
    from modelcarve.plan.train.model import TrainOptions
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec = dataclasses.replace(get_model("tiny-moe"), num_experts=4)
    layout = Layout.parse(f"dp=2,ep=2,gbs=2,{FP32}")
    routing = {0: [[3, 1, 2, 2]], 1: [[1, 0, 5, 2]]}
    msgs = ep_messages(spec, layout, 0, routing, 1)
    assert sum(m.payload * m.calls for m in msgs) == 32 + 2 * (8 + 5) * 256
    assert sum(m.wire() for m in msgs) == 16 + 2 * (4 + 1) * 256
    msgs = ep_messages(spec, layout, 1, routing, 1)  # rank 1: 8 rows out (1 away), receives 4 + 7
    assert sum(m.payload * m.calls for m in msgs) == 32 + 2 * (8 + 11) * 256
    assert sum(m.wire() for m in msgs) == 16 + 2 * (1 + 4) * 256
    assert LOAD_IMBALANCE == TrainOptions().load_imbalance


def test_ep_without_routing_is_not_modelled():
    from modelcarve.plan.predict.moe_traffic import forecast_rank
    from modelcarve.plan.predict.step_traffic import NotModelled, predict_rank
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec, layout = get_model("tiny-moe"), Layout.parse(f"dp=2,ep=2,gbs=4,{FP32}")
    with pytest.raises(NotModelled, match="routing"):
        forecast_rank(spec, layout, 0)
    with pytest.raises(NotModelled):  # the dense model alone never takes an MoE model
        predict_rank(spec, layout, 0)
    assert forecast_rank(spec, Layout.parse(f"dp=2,gbs=4,{FP32}"), 0).memory["activations"] > 0
