"""Multi-token prediction (``TrainOptions.mtp_layers``) and the split that places it
(``TrainOptions.split_embedding``, spec/stages.py ``split_costs``), against hand-derived figures
and Megatron-Bridge's own DeepSeek-V3 pipeline layouts.

An MTP depth, as Megatron-Core runs it on the last pipeline stage: one more decoder layer of the
model's last kind (MoE for DeepSeek-V3), its input projection (2h -> h, column-parallel) with three
norms, and one more pass of the shared LM head and its loss, whose logits are held beside the main
ones until their backward.
"""

from __future__ import annotations

import dataclasses

import pytest

from modelcarve.plan.cost.efficiency import gemm_time_s
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.plan.train.profile import LOSS_BYTES_PER_LOGIT
from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.stages import rank_holdings, split_costs, stage_counts

DSV3 = get_model("deepseek-v3")
CLUSTER = parse_cluster("32x8xH100")


def _bridge_layout(pp: int, vp: int) -> list[int]:
    """Decoder layers per virtual stage of Megatron-Bridge's DeepSeek-V3 layout_map
    (src/megatron/bridge/recipes/deepseek/deepseek_v3.py ``set_deepseek_v3_pipeline_model_parallel_layout``
    at v0.3.1 / v0.4.2, the same table in v0.2.1's recipe), one MTP depth: the first stage holds the
    embedding beside a full stage's layers, the last ``["mtp", "loss"]`` beside fewer."""
    table = {
        (4, 1): [16, 16, 16, 13],
        (8, 1): [8] * 7 + [5],
        (4, 2): [8] * 7 + [5],
        (16, 1): [4] * 15 + [1],
        (8, 2): [4] * 15 + [1],
        (4, 4): [4] * 15 + [1],
    }
    return table[(pp, vp)]


@pytest.mark.parametrize("pp,vp", [(4, 1), (8, 1), (4, 2), (16, 1), (8, 2), (4, 4)])
def test_split_costs_give_megatron_bridges_deepseek_layouts(pp, vp):
    """The embedding counting no layer and the loss one, each MTP depth two: exactly the recipe's
    layouts (61 layers), on every (pp, vp) its table names."""
    assert split_costs(False, 1) == (0.0, 3.0)
    assert list(stage_counts(61, pp, vp, *split_costs(False, 1))) == _bridge_layout(pp, vp)


def test_split_costs_default_is_the_runtimes_split():
    assert split_costs() == (1.0, 1.0)
    assert stage_counts(61, 16, 1, *split_costs()) == stage_counts(61, 16, 1)


def test_mtp_layer_sits_on_the_last_rank():
    """The split makes room for the depth on the last stage (``split_costs``), then the depth's
    decoder layer joins the last rank (an MoE layer: DeepSeek-V3's last layer is MoE)."""
    moe = frozenset(DSV3.moe_layers)
    base = TrainCostModel(DSV3, CLUSTER, TrainOptions(global_batch=1024, seq=4096, split_embedding=False))
    mtp = TrainCostModel(DSV3, CLUSTER, TrainOptions(global_batch=1024, seq=4096, split_embedding=False, mtp_layers=1))
    assert base.holdings(16, 1) == rank_holdings(61, 16, 1, moe, 0.0, 1.0)
    split = rank_holdings(61, 16, 1, moe, 0.0, 3.0)
    assert [n for n, _ in split] == [4] * 15 + [1]  # the recipe's layout
    assert mtp.holdings(16, 1) == split[:-1] + ((2, 2),)
    assert mtp.holdings(16, 1)[0] == (4, 1)  # three dense first layers and one MoE layer beside the embedding


def test_mtp_head_time_and_logits_by_hand():
    """Per micro-batch of T tokens at tp=2: the head's forward twice (main + one depth) plus the
    depth's input projection, T x 2h -> h/tp; the loss twice; the logits held twice (Megatron-Core's
    unfused loss, 6 B a logit) plus the depth's bf16 2h-wide input."""
    tp, T = 2, 4096.0
    h, V = DSV3.hidden_size, DSV3.vocab_size
    opts = TrainOptions(global_batch=1024, seq=4096)
    base = TrainCostModel(DSV3, CLUSTER, opts)
    one = TrainCostModel(DSV3, CLUSTER, dataclasses.replace(opts, mtp_layers=1))
    base._dtype = one._dtype = "bf16"
    b = base._head(T, tp, ("b",))
    m = one._head(T, tp, ("m",))
    dev = CLUSTER.device
    head = gemm_time_s(dev, T, V / tp, h, 1.0, "bf16")
    proj = gemm_time_s(dev, T, h / tp, 2 * h, 1.0, "bf16")
    assert b[0] == pytest.approx(head, rel=1e-12)
    assert m[0] == pytest.approx(2 * head + proj, rel=1e-12)
    assert m[1] == pytest.approx(2 * b[1], rel=1e-12)
    assert m[2] == pytest.approx(3 * m[0] + m[1], rel=1e-12)
    assert b[3] == pytest.approx(LOSS_BYTES_PER_LOGIT["materialized"] * T * V / tp, rel=1e-12)
    assert m[3] == pytest.approx(2 * b[3] + 2.0 * T * 2 * h, rel=1e-12)


def test_mtp_parameters_on_the_last_stage_by_hand():
    """The last rank holds one more MoE layer (its dense part over TP, its experts over EP) and the
    depth's projection 2h x h / tp with three norms of h."""
    tp, ep = 2, 8
    opts = TrainOptions(global_batch=1024, seq=4096, split_embedding=False)
    base = TrainCostModel(DSV3, CLUSTER, opts)
    one = TrainCostModel(DSV3, CLUSTER, dataclasses.replace(opts, mtp_layers=1))
    # same split for both (split_costs differs: compare the last rank with its own layers counted)
    b_last = [r for r in base.stage_params(tp, 16, ep) if r[0] == "last"][0]
    m_last = [r for r in one.stage_params(tp, 16, ep) if r[0] == "last"][0]
    nb, nm = b_last[7], m_last[7]
    h = DSV3.hidden_size
    per_dense = (base.moe_split / tp + base.moe_rep)
    per_exp = base.moe_experts / (ep * tp)  # expert TP defaults to tp
    extra = 2.0 * h * h / tp + 3.0 * base.final_norm
    # layers: the MTP split moves (nm - 1) - nb MoE layers, the depth adds one
    assert m_last[3] - b_last[3] == pytest.approx((nm - nb) * per_dense + extra, rel=1e-12)
    assert m_last[4] - b_last[4] == pytest.approx((nm - nb) * per_exp, rel=1e-12)


def test_mtp_forward_time_by_hand_and_the_recipes_split_absorbs_it():
    """Without a pipeline the only stage's forward grows by exactly one MoE layer's forward and the
    head's extra pass plus the depth's projection (``_head``). On pp=4 with the recipe's split
    ([16, 16, 16, 13] and the depth on the last rank) the last rank (14 MoE layers, two head passes)
    stays below a middle one (16 MoE layers), so the step does not change: the layout that Megatron-
    Bridge chose for DeepSeek-V3 hides MTP's cost, as it was meant to."""
    cluster = parse_cluster("32x8xB200")
    opts = TrainOptions(global_batch=2048, seq=4096, split_embedding=False)
    base = TrainCostModel(DSV3, cluster, opts)
    one = TrainCostModel(DSV3, cluster, dataclasses.replace(opts, mtp_layers=1))
    args = (1, 1, 1, 256, 8, 1, False, "none", 4096)
    pb, pm = base.profile(*args, dtype="bf16", etp=1, v=1), one.profile(*args, dtype="bf16", etp=1, v=1)
    hb, hm = base._heads[(4096.0, 1, "bf16")], one._heads[(4096.0, 1, "bf16")]
    assert pm["stages"]["only"]["fwd_s"] - pb["stages"]["only"]["fwd_s"] == pytest.approx(
        pm["moe"]["fwd_s"] + hm[0] - hb[0], rel=1e-9)
    assert hm[0] > hb[0] > 0.0
    layout = Layout(tp=1, pp=4, dp=64, ep=8, mbs=1, gbs=2048, seq=4096, zero=1, recompute="full",
                    param_dtype="bf16", grad_dtype="bf16")
    assert one.holdings(4, 1)[-1] == (14, 14)
    p4 = one.profile(1, 1, 4, 64, 8, 1, False, "full", 4096, dtype="bf16", etp=1, v=1)
    assert p4["stages"]["last"]["fwd_s"] < p4["stages"]["middle"]["fwd_s"]
    assert one.estimate(layout)["time"]["step_s"] == pytest.approx(base.estimate(layout)["time"]["step_s"], rel=1e-12)


def test_mtp_layers_out_of_range_is_one_line():
    with pytest.raises(LayoutError, match="mtp_layers=-1"):
        TrainCostModel(DSV3, CLUSTER, TrainOptions(mtp_layers=-1))
