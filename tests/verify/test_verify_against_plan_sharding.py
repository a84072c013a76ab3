"""verify --against-plan on the sharded data-parallel layouts the per-op model used to refuse: HSDP
(FSDP2 and ZeRO-1 sharded inside replica groups) and FSDP2 together with tp or with a pipeline
(1F1B, GPipe, interleaved), on 4 real gloo ranks accounted 2 per node; every row judged, bytes
equal to the byte.

What plan/predict/step_traffic.py predicts for them (``shard_groups``, ``fsdp_units``):

* HSDP: the dp x cp group is cut into shard blocks of ``dp_shard x cp`` consecutive ranks; FSDP2
  gathers and reduce-scatters inside the block, then all-reduces each reduced shard over the
  replicas (one rank of each block); ZeRO-1/2 reduce-scatter and all-gather their flat buffer in
  the block and all-reduce the owned range over the replicas;
* FSDP2 under torch.distributed.pipelining: the stage keeps the parameters unsharded after every
  backward but the last and reduce-scatters once per step; layers reshard after each forward; the
  root unit (embedding / final norm / head) stays unsharded from the first forward to the last
  backward. A layer is all-gathered by each action of the rank's schedule order that finds it
  sharded: ``m + 1`` times under GPipe (all forwards, then the first backward), also ``m + 1`` under
  1F1B on both stages here, the root once.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py
from dist import run_distributed  # noqa: E402
from verify_checks import against_plan_worker, assert_every_row_judged  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
CASES = [
    f"dp=4,hsdp=2,gbs=4,{FP32}",
    f"dp=4,zero=1,dp_shard=2,gbs=4,{FP32}",
    f"tp=2,dp=2,fsdp,gbs=4,{FP32}",
    f"pp=2,dp=2,fsdp,gbs=4,schedule=1f1b,{FP32}",
    f"pp=2,dp=2,fsdp,gbs=8,schedule=gpipe,{FP32}",
    f"pp=2,dp=2,fsdp,gbs=8,schedule=interleaved,virtual_stages=2,{FP32}",
]
GPIPE = f"pp=2,dp=2,fsdp,gbs=8,schedule=gpipe,{FP32}"


@pytest.fixture(scope="module")
def reports():
    return run_distributed(against_plan_worker, 4, [("tiny-llama", c) for c in CASES], 2, timeout=900)[0]


def test_every_row_judged_and_bytes_exact(reports):
    for layout, report in zip(CASES, reports):
        assert {r["rank"] for r in report["against_plan"]} == {0, 1, 2, 3}
        assert_every_row_judged(layout, report)


def test_hsdp_reduces_over_the_replicas(reports):
    # dp=4, hsdp=2: shard blocks {0,1} {2,3} (2 per node: intra), replicas {0,2} {1,3} (inter)
    rows = {(r["quantity"], r["axis"], r["tier"], r["rank"]): r for r in reports[0]["against_plan"]}
    # (the axes are named after the runtime's HSDP mesh dims, on both sides)
    # tiny-llama's units (fp32): 4 layers of 147,968 bytes, the root (embedding, norm, head) 131,328;
    # m = 1 micro-batch: layers gathered in forward and backward, the root once; each unit reduce-
    # scattered once and its half all-reduced over the replica pair, across nodes
    layers, root = 4 * 147_968, 131_328
    assert rows[("payload:reduce_scatter", "dp_cp_shard", "intra", 0)]["measured"] == layers + root
    assert rows[("payload:all_gather", "dp_cp_shard", "intra", 0)]["measured"] == 2 * layers + root
    assert rows[("payload:all_reduce", "dp_cp_replicate", "inter", 0)]["measured"] == (layers + root) // 2
    assert not [k for k in rows if k[0] == "payload:all_gather" and k[2] == "inter"]  # nothing gathered across replicas


def test_fsdp_gathers_under_gpipe_by_hand(reports):
    # tiny-llama: a decoder layer holds 36,992 fp32 values (wq 64x64, wk / wv 64x32, wo 64x64,
    # w1 / w3 / w2 64x128, two norms of 64) = 147,968 bytes; the embedding 256 x 64 = 65,536 bytes.
    # GPipe, m = 4 micro-batches: each of stage 0's 2 layers is gathered by the 4 forwards and the
    # first backward (5 times), the embedding (the root unit) once; every unit reduce-scattered once.
    rows = {(r["quantity"], r["axis"], r["rank"]): r for r in reports[CASES.index(GPIPE)]["against_plan"]}
    assert rows[("payload:all_gather", "dp", 0)]["measured"] == 147_968 * 2 * 5 + 65_536
    assert rows[("payload:reduce_scatter", "dp", 0)]["measured"] == 147_968 * 2 + 65_536
