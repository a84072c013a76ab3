"""The full-scale planner prices FSDP (zero=3) under every pipelined schedule as torch's pipelining
runs it (issue 26): ``PipelineStage.backward_maybe_with_nosync`` turns FSDP's gradient sync and its
reshard after backward off before every backward and ``perform_reduce_grad`` reduce-scatters once,
after the stage's last backward (spec/support.py ``fsdp_holds_gradients``). So under gpipe, 1f1b and
interleaved-1f1b too the stage's gradients stay unsharded to the step's end, a layer stays gathered
from each backward to its next forward (which reshards it), the root unit (embedding / final norm /
head) from its first forward; a layer is gathered ``m + 1`` times a step (``fsdp_layer_gathers``:
each forward, and the action after each forward), each unit reduce-scattered once.

Hand-derived on small-llama (8 layers, h=384, 6 heads of 64, 2 KV heads, SwiGLU 1152, vocabulary
8192, untied) on one node of 4 H100, pp=2 x dp=2, gbs=8, mbs=1 (m = 4 micro-batches), seq=256,
bf16 parameters (2 B), fp32 gradients (4 B):

* one layer's TP-split parameters 1,720,320 (attention 393,216 + MLP 1,327,104) + its norms 768;
  a stage's 4 layers: L = 4 x 1,721,088 = 6,884,352; the last stage's root unit: final norm 384 +
  head 8192 x 384 = 3,146,112 (P = 10,030,464 with the layers); the first stage's: the embedding
  3,145,728 (10,030,080); interleaved (v = 2) gives each rank two chunks of 2 layers: the same sums;
* memory held (gathered in 2 B + unsharded gradient in 4 B): 6 x 10,030,464 = 60,182,784 bytes on
  the last stage, 6 x 10,030,080 = 60,180,480 on the first; the window alone (2 x 2 B + 4 B a
  layer's 1,720,320) was 13,762,560: 46,420,224 more on the last stage;
* DP bytes the last stage's device sends a step (over 2 ranks a collective sends half its size):
  the layers all-gathered m + 1 = 5 times, 5 x 2L / 2 = 5L = 34,421,760; the root once, 2 x
  3,146,112 / 2 = 3,146,112; every gradient reduce-scattered once, 4P / 2 = 2P = 20,060,928:
  57,628,800 (was 4 x 4P = 160,487,424 priced per micro-batch); zero-bubble gathers the layers once:
  L + 3,146,112 + 2P = 3P = 30,091,392.
"""

from __future__ import annotations

import pytest

from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.support import fsdp_holds_gradients, fsdp_layer_gathers

PIPELINED = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)]


def _estimate(schedule: str, v: int = 1, zero: int = 3, pp: int = 2) -> tuple[TrainCostModel, Layout, dict]:
    cost = TrainCostModel(get_model("small-llama"), parse_cluster("1x4xH100"), TrainOptions(global_batch=8, seq=256))
    layout = Layout.parse(f"pp={pp},dp={4 // pp},zero={zero},gbs=8,mbs=1,seq=256,schedule={schedule},virtual_stages={v}")
    return cost, layout, cost.estimate(layout)


def test_the_rules():
    assert not fsdp_holds_gradients(1)
    for schedule in ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"):
        assert fsdp_holds_gradients(2)
        assert fsdp_layer_gathers(1, schedule, 4) == 8  # no pipeline: every forward and backward
    for schedule in ("1f1b", "gpipe", "interleaved-1f1b"):
        assert fsdp_layer_gathers(2, schedule, 4) == 5
    assert fsdp_layer_gathers(2, "zero-bubble", 4) == 1


@pytest.mark.parametrize("schedule,v", PIPELINED)
def test_held_gradients_and_step_traffic_by_hand(schedule, v):
    cost, lay, r = _estimate(schedule, v)
    assert r["memory"]["breakdown"]["zero3_gather_buffers"] == 60_182_784
    assert cost.rank_state_parts(cost.key(lay), 0)["zero3_gather_buffers"] == 60_180_480
    assert cost.rank_state_parts(cost.key(lay), 1)["zero3_gather_buffers"] == 60_182_784
    assert r["comm"]["bytes_per_step_by_axis"]["dp"] == 57_628_800
    _, _, z1 = _estimate(schedule, v, zero=1)  # the sharded states are the only other difference
    extra = r["memory"]["peak_bytes"] - z1["memory"]["peak_bytes"]
    parts = ("weights", "gradients", "optimizer_states", "zero3_gather_buffers")
    assert extra == pytest.approx(sum(r["memory"]["breakdown"][k] - z1["memory"]["breakdown"][k] for k in parts))
    score, category, _ = cost.screen(cost.key(lay))
    assert category is None and score == r["time"]["tokens_per_s"]


def test_zero_bubble_gathers_less_and_holds_the_same():
    _, _, zb = _estimate("zero-bubble")
    _, _, one = _estimate("1f1b")
    assert zb["memory"]["breakdown"]["zero3_gather_buffers"] == one["memory"]["breakdown"]["zero3_gather_buffers"]
    assert zb["comm"]["bytes_per_step_by_axis"]["dp"] == 30_091_392
    assert zb["comm"]["total_s_by_axis"]["dp"] < one["comm"]["total_s_by_axis"]["dp"]


def test_no_pipeline_keeps_the_window_and_per_micro_batch_traffic():
    # pp = 1, dp = 4: the trainer's own backward reduce-scatters and reshards every micro-batch
    cost, lay, r = _estimate("1f1b", pp=1)
    # 2 x 2 B + 4 B of one layer's 1,720,320
    assert r["memory"]["breakdown"]["zero3_gather_buffers"] == 13_762_560
