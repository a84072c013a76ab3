"""One pipeline split (issue 25): spec/stages.py is the split the runtime builds and every planner prices.

* the runtime's chunks (runtime/parallel/pipeline_split.split_model on a reference model built on
  the meta device from a ModelSpec) hold, rank by rank, exactly the layers, MoE layers and
  parameters the training planner (plan/train/model.py ``stage_params``, ``rank_state_parts``),
  the serving planner (plan/serve/memory.py) and the per-op prediction
  (plan/predict/step_traffic.py) count, over a matrix of (layers, pp, virtual stages) with
  uneven splits, embedding/head-heavy ends and an MoE model with dense first layers;
* hand-derived figures of the rule (the embedding and the LM head cost one layer each on the
  first and last stage, Megatron's --account-for-embedding/loss-in-pipeline-split).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from modelcarve.plan.predict.step_traffic import predict_rank
from modelcarve.plan.serve.memory import _stage_kinds
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.runtime.model.transformer import Transformer
from modelcarve.runtime.parallel.pipeline_split import balance_layers, split_model, stage_layer_ranges
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.stages import (max_stages, rank_holdings, rank_layers, stage_count_problem, stage_counts,
                                    stage_kind)

CLUSTER = parse_cluster("8xH100")
# (num_layers, pp, virtual stages): even, uneven, one layer per stage, embedding/head-heavy ends
MATRIX = [(4, 2, 1), (5, 2, 1), (6, 4, 1), (7, 3, 1), (9, 4, 1), (10, 4, 1), (13, 5, 1), (8, 8, 1),
          (8, 2, 2), (10, 2, 2), (12, 3, 2), (12, 2, 3), (16, 4, 2), (17, 4, 2), (9, 3, 3), (16, 8, 2),
          # more stages than layers: the first / last stage holds only the embedding / the head
          (4, 2, 3), (6, 4, 2), (5, 3, 2), (3, 4, 1)]


def _dense(num_layers: int):
    return dataclasses.replace(get_model("tiny-llama"), num_layers=num_layers)


def _moe(num_layers: int, first_dense: int):
    """A tiny MoE with ``first_dense`` dense first layers (DeepSeek-V3's first_k_dense style)."""
    return dataclasses.replace(get_model("tiny-moe"), num_layers=num_layers,
                               moe_layers=tuple(range(first_dense, num_layers)))


def _layout(pp: int, v: int) -> Layout:
    sched = "interleaved-1f1b" if v > 1 else "1f1b"
    return Layout(pp=pp, virtual_stages=v, schedule=sched, gbs=pp, mbs=1, seq=64,
                  param_dtype="fp32", grad_dtype="fp32", optim_dtype="fp32")


def _runtime_ranks(spec, pp: int, v: int) -> list[dict]:
    """Per pipeline rank what split_model's chunks hold: layers, MoE layers, parameters."""
    with torch.device("meta"):
        model = Transformer(spec)
    out = []
    for r in range(pp):
        chunks = split_model(model, _layout(pp, v), r)
        blocks = [b for c in chunks for b in c.layers.values()]
        params = {id(p): p.numel() for c in chunks for p in c.parameters()}
        out.append({"layers": len(blocks), "moe": sum(1 for b in blocks if b.is_moe), "params": sum(params.values()),
                    "first": any(c.tok_embeddings is not None for c in chunks),
                    "last": any(c.output is not None for c in chunks)})
    return out


@pytest.mark.parametrize("spec_kind", ["dense", "moe"])
@pytest.mark.parametrize("num_layers,pp,v", MATRIX, ids=[f"L{L}-pp{p}-v{v}" for L, p, v in MATRIX])
def test_planner_prices_the_runtime_split(spec_kind, num_layers, pp, v):
    spec = _dense(num_layers) if spec_kind == "dense" else _moe(num_layers, first_dense=min(3, num_layers - 1))
    runtime = _runtime_ranks(spec, pp, v)
    # the shared function is the runtime's split, rank by rank (dense and MoE layers apart)
    assert [(r["layers"], r["moe"]) for r in runtime] == list(rank_holdings(num_layers, pp, v, spec._moe_set))
    assert [len(r) for r in stage_layer_ranges(num_layers, _layout(pp, v))] == list(stage_counts(num_layers, pp, v))
    # the embedding on rank 0, the head on rank pp - 1 (whatever v)
    assert [r["first"] for r in runtime] == [i == 0 for i in range(pp)]
    assert [r["last"] for r in runtime] == [i == pp - 1 for i in range(pp)]

    # the training planner: each stage kind is a real rank, holding what that rank holds
    cost = TrainCostModel(spec, CLUSTER, TrainOptions(global_batch=pp, seq=64))
    rows = cost.stage_params(1, pp, 1, 1, v)
    for kind, index, n_moe, pd, pe, _layer, _lin, nls in rows:
        held = runtime[index]
        assert kind == stage_kind(index, pp)
        assert (nls, n_moe) == (held["layers"], held["moe"]), (kind, index)
        assert pd + pe == pytest.approx(held["params"], rel=1e-12), (kind, index)
    if pp > 2:  # the middle kind is the fullest middle rank (the earliest of the fullest)
        middle = max(range(1, pp - 1), key=lambda i: (runtime[i]["params"], -i))
        assert [row[1] for row in rows if row[0] == "middle"] == [middle]
    # every rank's model states, one by one (what run --dry-run compares)
    cand = cost.key(_layout(pp, v))
    for index, held in enumerate(runtime):
        assert cost.rank_state_parts(cand, index)["weights"] == pytest.approx(4 * held["params"], rel=1e-12)

    # the serving planner (v = 1: serving has no virtual stages)
    if v == 1:
        kinds = {(r["layers"], r["moe"], r["first"], r["last"]) for r in runtime}
        assert set(_stage_kinds(spec, pp)) == kinds

    # the per-op prediction (dense, non-interleaved: what it models)
    if spec_kind == "dense" and v == 1:
        for index, held in enumerate(runtime):
            assert predict_rank(spec, _layout(pp, v), index).memory["params"] == 4 * held["params"]


def test_deepseek_v3_dense_first_layers_on_the_first_rank():
    spec = get_model("deepseek-v3")
    assert spec.num_layers == 61 and spec.moe_layers[0] == 3  # first_k_dense_replace = 3
    # cost 61 + 2 over 16 stages: at most 4 each, ends 3 (+1); the extra layer to later stages
    assert stage_counts(61, 16) == (3, 3) + (4,) * 13 + (3,)
    held = rank_holdings(61, 16, 1, spec._moe_set)
    assert held[0] == (3, 0) and held[1] == (3, 3) and held[2] == (4, 4) and held[-1] == (3, 3)
    rows = TrainCostModel(spec, parse_cluster("256x8xH100"), TrainOptions(global_batch=4096, seq=4096)).stage_params(1, 16, 8)
    assert [(row[0], row[1], row[7], row[2]) for row in rows] == [("first", 0, 3, 0), ("middle", 2, 4, 4), ("last", 15, 3, 3)]


def test_hand_derived_splits():
    # 126 + 2 = 128 cost units on 16 stages: at most 8; the ends hold 7 layers + embedding / head
    assert list(stage_counts(126, 16)) == [7] + [8] * 14 + [7]
    # 96 + 2 on 8: the lowest maximum is 13 (ends 12 + 1), the most even fill is 12 everywhere
    assert list(stage_counts(96, 8)) == [12] * 8
    # 6 + 2 on 4: at most 2 each, the ends 1 + 1
    assert list(stage_counts(6, 4)) == [1, 2, 2, 1]
    assert balance_layers(5, 2) == [2, 3]  # a tie: the extra layer to the later stage
    # interleaved: 96 layers, pp=8, v=2: 16 stages of 6 (98 / 16 -> at most 7, fill evenly to 6)
    assert rank_layers(96, 8, 2) == (12,) * 8
    # 10 layers, pp=2, v=2: stages [2, 3, 3, 2]; rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert stage_counts(10, 2, 2) == (2, 3, 3, 2) and rank_layers(10, 2, 2) == (5, 5)
    # Llama-3.1-405B, pp=8, v=8: 64 stages, 128 / 64 -> at most 2, ends 1: ranks 0 and 7 hold 15, the rest 16
    assert rank_layers(126, 8, 8) == (15,) + (16,) * 6 + (15,)
    # 128 layers (GPT-1T) on pp=32: v = 1, 2, 4 all give 4 layers a rank
    assert rank_layers(128, 32, 1) == rank_layers(128, 32, 2) == rank_layers(128, 32, 4) == (4,) * 32


def test_planner_layer_counts_of_a_published_uneven_layout():
    """Llama-3.1-405B pp=16 (126 layers): the planner's first and last stages hold 7 layers, the middle 8
    (it gave every stage ceil(126 / 16) = 8 before)."""
    spec = get_model("llama-3.1-405b")
    cost = TrainCostModel(spec, parse_cluster("2048x8xH100"), TrainOptions(global_batch=2048, seq=8192))
    prof = cost.estimate(Layout.parse("tp=8,pp=16,dp=128,sp,mbs=1,gbs=2048,seq=8192"))
    assert prof["memory"]["worst_stage"] in ("first", "middle", "last")
    rows = cost.stage_params(8, 16, 1)
    assert [(row[0], row[7]) for row in rows] == [("first", 7), ("middle", 8), ("last", 7)]


def test_more_stages_than_layers_leaves_the_ends_to_the_embedding_and_head():
    # Megatron-LM's --account-for-embedding/loss-in-pipeline-split: num_layers + 2 slots over pp x v
    # stages. Megatron-Bridge's Llama 3.1 405B recipe runs 126 layers on pp=16 x v=8 = 128 stages.
    assert stage_counts(126, 16, 8) == (0,) + (1,) * 126 + (0,)
    assert rank_layers(126, 16, 8) == (7,) + (8,) * 14 + (7,)
    assert stage_counts(4, 2, 3) == (0, 1, 1, 1, 1, 0) and rank_layers(4, 2, 3) == (2, 2)
    assert stage_counts(126, 127) == (0,) + (1,) * 126  # one spare stage: the later end keeps a layer
    assert max_stages(126) == 128 and stage_count_problem(126, 128) is None
    assert "at most 128" in stage_count_problem(126, 129)
    # with at least as many layers as stages the rule and the split are what they were: every stage a layer
    assert min(stage_counts(8, 8)) == 1 and stage_counts(6, 4) == (1, 2, 2, 1)


def test_llama_405b_on_128_virtual_stages_is_planned():
    """The Megatron-Bridge 26.02.01 Llama 3.1 405B MXFP8 run on 256 GB200 (TP4 PP16 VP8): refused
    before ("each stage needs at least one layer"), now validated and priced, its first and last
    pipeline ranks holding 7 layers (the embedding / the head take one stage's place)."""
    spec = get_model("llama-3.1-405b")
    cluster = parse_cluster("64x4xGB200")
    layout = Layout(tp=4, sp=True, pp=16, virtual_stages=8, schedule="interleaved-1f1b", dp=4, mbs=1, gbs=1536,
                    seq=8192, recompute="full")
    layout.validate(spec, cluster)
    cost = TrainCostModel(spec, cluster, TrainOptions(global_batch=1536, seq=8192))
    est = cost.estimate(layout)
    assert est["fits"], est["memory"]["peak_bytes"] / 2**30
    rows = cost.stage_params(4, 16, 1, 1, 8)
    layers = {kind: nls for kind, _index, _moe, _pd, _pe, _layer, _lin, nls in rows}
    assert layers["first"] == 7 and layers["last"] == 7 and layers["middle"] == 8
