"""verify --against-plan on a folded expert mesh (etp=1 != tp=2: runtime/parallel/expert.py
``_apply_folded``) under recomputation and under context parallelism: every row judged, bytes
equal to the byte, activations exact in fp32 up to the MoE model's known bytes, on real gloo ranks.

What the runtime does there, and plan/predict/moe_traffic.py / moe_activations.py price:

* each TP rank routes its ``1 / tp`` slice of the tokens (without sp ``_ScatterTokens`` keeps it, a
  slice with no message, and ``_GatherTokens`` all-gathers the block's output over tp; their
  backwards swap the two); the EP all-to-alls span the TP ranks;
* ``recompute=full``: the checkpointed block's forward runs again in the backward up to its last
  saved tensor (the combine's product with the routing weights), so each dispatcher call's count
  exchange, dispatch and combine run twice, the output all-gather after it does NOT run again
  (measured: 65,536 bytes of all-gather on tiny-moe with and without recomputation), and the
  attention's tp all-reduces run again (step_traffic.tp_messages); ``selective`` recomputes no
  collective; the activations are moe_activations.moe_recompute_peak's with the folded block's
  ``T / tp`` tokens;
* ``cp=2``: each rank routes ``seq / (cp tp)`` tokens of its zig-zag chunks, the EP group carved from
  the cp x tp ranks (ep=4: all of them), ring attention's sends in every layer.

Rank 0 and rank 1 hold different activations (tiny-moe tp=2,ep=2,etp=1,selective: 346,752 and 297,408
bytes) because the rows their experts receive differ: rank 0 holds experts 0-3, which the randomly
initialised router sends 152 of the step's 256 (token, choice) rows, rank 1 104; the peak micro-batch's
24 more rows x 2,056 bytes a row (index 8, rows 256, the experts' four 96-wide tensors 1,536, output
256) are the 49,344 bytes between them, predicted from the recorded routing. No runtime asymmetry: the
49,992 bytes once quoted for "rank 1" are rank 1 of the tiny DeepSeek-V3 under full recomputation, a
different model. Its shared experts run whole on each TP rank of a folded mesh (on ``T / tp`` tokens):
moe_activations.shared_ffn (they were priced split over tp, 2,048 bytes low a layer).

A folded mesh with expert TP of its own (etp > 1: FoldedDispatcher's count all-gather and row
all-to-alls over the ETP group) is judged in test_verify_against_plan_etp.py (moe_traffic.etp_messages),
whose tp=4,ep=2,etp=2 also runs a rank whose experts receive no rows (the dispatcher's
``view(etp, 0, -1)`` raised there).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py
from dist import run_distributed  # noqa: E402
from test_verify_against_plan_moe import Q3, checkpoint  # noqa: E402,F401  (the tiny Qwen3-MoE fixture)
from verify_checks import against_plan_worker, assert_every_row_judged  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
BF16 = "seq=16,mbs=1,param_dtype=bf16"
CASES_2 = [
    ("tiny-moe", f"tp=2,ep=2,etp=1,gbs=2,recompute=full,{FP32}"),
    ("tiny-moe", f"tp=2,ep=2,etp=1,gbs=2,recompute=selective,{FP32}"),
    ("tiny-moe", f"tp=2,sp,ep=2,etp=1,gbs=2,recompute=full,{FP32}"),
    (Q3, f"tp=2,ep=2,etp=1,gbs=4,recompute=full,{FP32}"),  # two micro-batches, q / k norms
    (Q3, f"tp=2,ep=2,etp=1,gbs=2,recompute=selective,{FP32}"),
    ("tiny-moe", f"tp=2,ep=2,etp=1,gbs=2,recompute=full,{BF16}"),  # 1.9% / 0.6% over (bf16's MoE terms)
]
CASES_4 = [
    ("tiny-moe", f"pp=2,tp=2,ep=2,etp=1,gbs=4,schedule=1f1b,recompute=full,{FP32}"),
    ("tiny-moe", f"pp=2,tp=2,ep=2,etp=1,gbs=4,schedule=1f1b,recompute=selective,{FP32}"),
    ("tiny-moe", f"tp=2,dp=2,ep=4,etp=1,gbs=4,recompute=full,{FP32}"),  # the EP group spans dp x tp
    ("tiny-moe", f"cp=2,tp=2,ep=2,etp=1,gbs=2,{FP32}"),
    ("tiny-moe", f"cp=2,tp=2,ep=4,etp=1,gbs=2,recompute=full,{FP32}"),  # ring attention's third K/V pass
    (Q3, f"cp=2,tp=2,sp,ep=2,etp=1,gbs=2,recompute=selective,{FP32}"),
    ("tiny-moe", f"cp=2,tp=2,ep=2,etp=1,gbs=2,{BF16}"),
]
# fp32: the prediction's distance to the measured peak, bytes (measured, every rank alike): the aux loss's
# per-sequence load counted in each MoE layer held (32 B) and tp's boolean masks (28 B) over; ring
# attention under tp (cp=2 x tp=2) 12 B under, 8 B under full recomputation, as for dense tp x cp
FP32_GAP = 32 * 4 + 28


def _jobs(cases, checkpoint):
    return [(checkpoint.get(model, model), layout) for model, layout, *_ in cases]


@pytest.fixture(scope="module")
def reports2(checkpoint):
    return run_distributed(against_plan_worker, 2, _jobs(CASES_2, checkpoint), timeout=600)[0]


@pytest.fixture(scope="module")
def reports4(checkpoint):
    return run_distributed(against_plan_worker, 4, _jobs(CASES_4, checkpoint), 2, timeout=600)[0]


def _check(cases, reports):
    for (model, layout), report in zip(cases, reports):
        assert_every_row_judged(layout, report)
        rows = report["against_plan"]
        assert {r["rank"] for r in rows} == set(range(report["world_size"]))
        assert all(r["predicted"] is not None for r in rows), layout
        assert any(r["quantity"] == "payload:all_to_all" and r["measured"] for r in rows), layout
        for r in rows:
            if r["quantity"] in ("params", "grads", "optimizer", "comm_buffers"):
                assert r["predicted"] == r["measured"], (layout, r)
            if r["quantity"] == "activations" and "fp32" in layout:
                assert abs(r["predicted"] - r["measured"]) <= FP32_GAP, (layout, r)


def test_folded_under_recomputation_on_two_ranks(reports2):
    _check(CASES_2, reports2)


def test_folded_pipelined_and_context_parallel_on_four_ranks(reports4):
    _check(CASES_4, reports4)


def test_full_recomputation_repeats_the_dispatch_not_the_output_gather(reports2):
    """tiny-moe tp=2,ep=2,etp=1: under full the all-to-alls grow by the forward's share (count exchange,
    dispatch, combine again), the output all-gather is the same as under selective (the recomputation
    stops at the combine, before ``_GatherTokens``), the attention's tp all-reduces grow."""
    def payload(report, op, rank=0):
        return next(r["measured"] for r in report["against_plan"] if r["quantity"] == f"payload:{op}" and r["rank"] == rank)

    full, selective = reports2[0], reports2[1]
    assert payload(full, "all_gather") == payload(selective, "all_gather") > 0
    assert payload(full, "all_to_all") > payload(selective, "all_to_all")
    assert payload(full, "all_reduce") > payload(selective, "all_reduce")


def test_folded_recomputation_exits_0_through_the_cli():
    """`verify --against-plan --json` through torchrun: exit 0, every row judged."""
    import json
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"), os.environ.get("PYTHONPATH", "")]))
    layout = f"tp=2,ep=2,etp=1,gbs=2,recompute=full,{FP32}"
    done = subprocess.run([sys.executable, "-m", "modelcarve.cli", "verify", "--model", "tiny-moe", "--layout", layout,
                           "--steps", "1", "--against-plan", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["passed"]
    assert_every_row_judged(layout, report)
