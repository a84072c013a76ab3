"""The full-scale planner prices FSDP (zero=3) under the zero-bubble schedule as the runtime runs it
(issue 26): the layers stay gathered from their first forward to the step's reduction
(spec/support.py ``fsdp_reshards_after_forward``), so the stage's layers are held unsharded for the
step and every unit is all-gathered and reduce-scattered once a step, not once per micro-batch.

Hand-derived on small-llama (8 layers, h=384, 6 heads of 64, 2 KV heads, SwiGLU 1152, vocabulary
8192, untied) on one node of 4 H100, pp=2 x dp=2, gbs=8, mbs=1 (4 micro-batches), seq=256,
bf16 parameters (2 B), fp32 gradients (4 B) and Adam state:

* one layer's TP-split parameters: attention 384*384 (q) + 2*384*128 (k, v) + 384*384 (o) =
  393,216, MLP 3*384*1152 = 1,327,104: 1,720,320; its two RMSNorm weights 2*384 = 768;
* the runtime's split gives each stage 4 layers; the last stage adds the final norm (384) and the
  head (8192*384 = 3,145,728): 4*(1,720,320 + 768) + 384 + 3,145,728 = 10,030,464 parameters;
* without the pipeline's hold (the two-layer window alone): one layer gathered + the next prefetched
  (2 B each) + its unsharded gradient (4 B): 8 B x 1,720,320 = 13,762,560 bytes;
* zero-bubble: the stage's 4 layers, 4*(1,720,320 + 768) = 6,884,352 parameters, held gathered
  (2 B) and their unsharded gradients accumulated (4 B: torch's pipeline stage reduce-scatters once,
  after the last backward), and so is the root unit (the last stage's final norm and head,
  3,146,112; the first stage's embedding, 3,145,728: FSDP2's root, never resharded): 6 B x
  10,030,464 = 60,182,784 bytes on the last stage, 6 B x 10,030,080 = 60,180,480 on the first
  (46,420,224 more than the window on the last); 1F1B holds the same (tests/plan/test_fsdp_pipeline.py);
* DP bytes a device sends a step (all-gather / reduce-scatter over 2 ranks: half the gathered size,
  of the last stage's 10,030,464 parameters P): zero-bubble once a step: (2P + 4P)/2 = 3P =
  30,091,392; 1F1B 57,628,800 (tests/plan/test_fsdp_pipeline.py); the window's per-micro-batch
  pricing (2 all-gathers of 2P and a reduce-scatter of 4P per micro-batch, 4 micro-batches) would
  be 160,487,424.
"""

from __future__ import annotations

import pytest

from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.support import fsdp_reshards_after_forward


def _estimate(schedule: str, zero: int = 3) -> tuple[TrainCostModel, Layout, dict]:
    cost = TrainCostModel(get_model("small-llama"), parse_cluster("1x4xH100"), TrainOptions(global_batch=8, seq=256))
    layout = Layout.parse(f"pp=2,dp=2,zero={zero},gbs=8,mbs=1,seq=256,schedule={schedule}")
    return cost, layout, cost.estimate(layout)


def test_the_reshard_rule_is_zero_bubble_with_a_pipeline():
    assert not fsdp_reshards_after_forward(2, "zero-bubble")
    assert fsdp_reshards_after_forward(1, "zero-bubble")  # no pipeline: torch's schedules are not used
    for schedule in ("1f1b", "gpipe", "interleaved-1f1b"):
        assert fsdp_reshards_after_forward(2, schedule)


def test_gathered_layers_memory_and_step_gather_bytes_by_hand():
    cost, zb, r_zb = _estimate("zero-bubble")
    _, _, r_z1 = _estimate("zero-bubble", 1)
    assert r_zb["memory"]["breakdown"]["zero3_gather_buffers"] == 60_182_784
    # what the dry run's planner side reads, per stage: the embedding (first) or final norm + head (last)
    assert cost.rank_state_parts(cost.key(zb), 0)["zero3_gather_buffers"] == 60_180_480
    assert cost.rank_state_parts(cost.key(zb), 1)["zero3_gather_buffers"] == 60_182_784
    assert r_zb["comm"]["bytes_per_step_by_axis"]["dp"] == 30_091_392
    assert r_zb["comm"]["bytes_per_step_by_axis"]["dp"] == r_z1["comm"]["bytes_per_step_by_axis"]["dp"]
    # the layers gathered once a step, not once after each forward: less DP time than 1F1B's
    _, _, r_1f1b = _estimate("1f1b")
    assert r_zb["comm"]["total_s_by_axis"]["dp"] < r_1f1b["comm"]["total_s_by_axis"]["dp"]


def test_screen_agrees_with_estimate_and_other_zero_stages_unchanged():
    cost, zb, r_zb = _estimate("zero-bubble")
    score, category, _ = cost.screen(cost.key(zb))
    assert category is None and score == r_zb["time"]["tokens_per_s"]
    for zero in (0, 1, 2):  # whole parameters already: the schedule changes no state term
        _, _, a = _estimate("1f1b", zero)
        _, _, b = _estimate("zero-bubble", zero)
        assert a["memory"]["breakdown"]["zero3_gather_buffers"] == b["memory"]["breakdown"]["zero3_gather_buffers"] == 0
        assert a["comm"]["bytes_per_step_by_axis"]["dp"] == b["comm"]["bytes_per_step_by_axis"]["dp"]


@pytest.mark.parametrize("schedule,words", [("zero-bubble", "weight step W"), ("1f1b", "perform_reduce_grad")])
def test_the_memory_table_names_the_rule(schedule, words):
    from modelcarve.plan.train.report import memory_sources

    cost, _, result = _estimate(schedule)
    assert words in memory_sources(result, cost.options)["zero3_gather_buffers"]
