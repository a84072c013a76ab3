"""verify --against-plan on the two MoE expert meshes the per-op model used to refuse (issue 26), on
real gloo ranks (one 4-rank world, tiny models): every row judged, bytes equal to the byte.

* A folded expert mesh with expert TP of its own (``etp > 1``, runtime/parallel/expert.py
  ``FoldedDispatcher``): after the EP exchange each rank all-gathers its ETP peers' ``[E/ep]`` int64
  local counts, sends every peer a copy of the rows it received and gets back the partial outputs of
  its rows from each; both all-to-alls reversed in backward (plan/predict/moe_traffic.py
  ``etp_messages``). Its experts run on the whole ETP group's rows (moe_activations.expert_rows).
* (``etp`` != ``tp`` without expert parallelism: the runtime has no expert mesh under ep = 1 and
  refuses it, spec/support.py ``runtime_problems``: test_verify_against_plan.py.)

Measured on tiny-moe ``tp=4,ep=2,etp=2`` (fp32, two micro-batches; rank 3's experts get no rows in
one call), rows named by the expert mesh (collectives.axis_of): the EP dispatch all-to-all 70,144 /
74,240 / 61,952 / 57,856 bytes on ranks 0-3, the ETP row all-to-alls 151,552 / 159,744 / 110,592 /
102,400, the ETP count all-gather 512 bytes (64 a call, 8 calls), the output all-gather over tp 65,536,
predicted the same. ``dp=4,ep=2,etp=2`` (ETP groups 0-1 and 2-3, EP groups 0-2 and 1-3): EP 148,224 /
145,152 / 114,432 / 117,504, ETP 326,656 / 320,512 / 197,632 / 203,776 bytes, 256 bytes of counts.
(Before, the ETP group was named ``ep`` and the EP group ``edp`` by the dp x cp sub-group heuristic,
and both ``tp_sub`` under tp=4.) Activations: the known 100 bytes over on
tiny-moe tp=4 (four MoE layers' aux loads over, the masks under), 128 under dp=4, in fp32 and bf16.

Still refused (exit 2 through the CLI: tests/verify/test_verify_against_plan.py): gpt2's LayerNorm
layer over tp under zero-bubble, checked here in-world too.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py, hf_tiny.py
from dist import run_distributed  # noqa: E402
from test_verify_against_plan_moe import Q3, checkpoint  # noqa: E402,F401  (the tiny Qwen3-MoE fixture)
from verify_checks import against_plan_worker, assert_every_row_judged  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
BF16 = "seq=16,mbs=1,param_dtype=bf16"
ETP = [
    ("tiny-moe", f"tp=4,ep=2,etp=2,gbs=2,{FP32}"),
    ("tiny-moe", f"dp=4,ep=2,etp=2,gbs=4,{FP32}"),
    ("tiny-moe", f"tp=4,sp,ep=2,etp=2,gbs=2,recompute=selective,{FP32}"),
    ("tiny-moe", f"tp=4,ep=2,etp=2,gbs=2,recompute=full,{FP32}"),
    ("tiny-moe", f"dp=4,ep=2,etp=2,zero=1,gbs=4,{FP32}"),
    ("tiny-moe", f"dp=2,cp=2,ep=2,etp=2,gbs=2,{FP32}"),
    ("tiny-moe", f"tp=4,ep=2,etp=2,gbs=2,{BF16}"),
    (Q3, f"dp=4,ep=2,etp=2,gbs=8,recompute=full,{FP32}"),
]
UNMODELLED = [("gpt2", f"pp=2,tp=2,gbs=4,schedule=zero-bubble,{FP32}", "LayerNorm over tp under the zero-bubble schedule")]
# the measured bytes, rank by rank: (case, quantity, axis) -> [rank 0 .. 3]
BYTES = {
    (0, "payload:all_to_all", "ep"): [70_144, 74_240, 61_952, 57_856],
    (0, "payload:all_to_all", "etp"): [151_552, 159_744, 110_592, 102_400],
    (0, "payload:all_gather", "etp"): [512] * 4,
    (0, "payload:all_gather", "tp"): [65_536] * 4,
    (1, "payload:all_to_all", "ep"): [148_224, 145_152, 114_432, 117_504],
    (1, "payload:all_to_all", "etp"): [326_656, 320_512, 197_632, 203_776],
    (1, "payload:all_gather", "etp"): [256] * 4,
}


@pytest.fixture(scope="module")
def reports(checkpoint, tmp_path_factory):
    from hf_tiny import save_biased

    root = tmp_path_factory.mktemp("etp")
    save_biased(root)
    paths = dict(checkpoint) | {"gpt2": str(root / "gpt2")}
    jobs = [(paths.get(m, m), layout) for m, layout, *_ in ETP + UNMODELLED]
    return run_distributed(against_plan_worker, 4, jobs, timeout=900)[0]


def test_every_row_judged_and_exact(reports):
    for (model, layout), report in zip(ETP, reports):
        assert_every_row_judged(f"{model}: {layout}", report)
        assert report["passed"] and all(c["passed"] for c in report["checks"]), layout
        for r in report["against_plan"]:
            if r["quantity"] in ("params", "grads", "optimizer", "comm_buffers"):
                assert r["predicted"] == r["measured"], (layout, r)
            if r["quantity"] == "activations" and model == "tiny-moe":  # the aux loads over, tp's masks under
                assert 0 <= r["predicted"] - r["measured"] <= 32 * 4 + 28, (layout, r)


def test_expert_tp_bytes_by_rank(reports):
    for (case, quantity, axis), want in BYTES.items():
        got = {r["rank"]: (r["measured"], r["predicted"]) for r in reports[case]["against_plan"]
               if r["quantity"] == quantity and r["axis"] == axis}
        assert got == {rank: (b, b) for rank, b in enumerate(want)}, (ETP[case], quantity, axis)


def test_still_refused_is_not_a_pass(reports):
    from modelcarve.verify.against_plan import passed, unjudged

    for (_model, layout, reason), report in zip(UNMODELLED, reports[len(ETP):]):
        rows = report["against_plan"]
        assert not passed(rows) and any(reason in why for why in unjudged(rows)), (layout, unjudged(rows))
        assert report["passed"] is False


def test_etp_messages_by_hand():
    """tp=4,ep=2,etp=2 on 8 experts (4 per EP rank), H = 64, fp32, one call. Routing (rows per global
    expert each rank's router sends): rank 0 [1,0,0,1 | 2,0,1,1], rank 1 [0,2,0,0 | 1,1,0,0], rank 2
    [1,1,1,1 | 0,0,0,0], rank 3 [0,0,0,0 | 1,1,1,1]. EP groups (0, 2), (1, 3); ETP groups (0, 1), (2, 3).
    Rank 0 holds experts 0-3 and receives 2 rows from itself and 4 from rank 2: n = 6; rank 1 receives
    2 + 0: n = 2. Rank 0's ETP traffic: counts 2 x 4 x 8 = 64 bytes; rows 2 x 6 out (6 to rank 1) and
    6 + 2 partial outputs back (2 from rank 1), reversed in backward, 256 bytes a row."""
    from modelcarve.plan.predict.moe_traffic import etp_messages, received_rows
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(f"tp=4,ep=2,etp=2,gbs=1,{FP32}")
    routing = {0: [[1, 0, 0, 1, 2, 0, 1, 1]], 1: [[0, 2, 0, 0, 1, 1, 0, 0]],
               2: [[1, 1, 1, 1, 0, 0, 0, 0]], 3: [[0, 0, 0, 0, 1, 1, 1, 1]]}
    assert received_rows(layout, 0, routing, 0) == (6, 8)
    msgs = etp_messages(get_model("tiny-moe"), layout, 0, routing, [1])
    assert [(m.op, m.group, m.payload, m.wire()) for m in msgs] == [
        ("all_gather", (0, 1), 64, 32.0),
        ("all_to_all", (0, 1), 12 * 256, 6 * 256), ("all_to_all", (0, 1), 8 * 256, 2 * 256),
        ("all_to_all", (0, 1), 12 * 256, 6 * 256), ("all_to_all", (0, 1), 8 * 256, 2 * 256)]
