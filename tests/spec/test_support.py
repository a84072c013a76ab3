"""One support check (spec/support.py): the planner's "modelcarve run runs / refuses" mark, the
runtime's own gate (``parallelize`` on every rank) and the ``run`` command's pre-launch refusal
agree on every layout of a matrix, runnable and refused alike."""

from __future__ import annotations

import pytest

from modelcarve.plan.search import search
from modelcarve.plan.train.goal import GOAL as TRAIN
from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.support import check_training, training_problems

CLUSTER = parse_cluster("8xH100")

MATRIX = [
    # (model, layout): runnable ones and each kind of refusal
    ("tiny-llama", "tp=2,dp=4,gbs=8,seq=64"),
    ("tiny-llama", "tp=2,sp,pp=2,dp=2,gbs=8,seq=64,schedule=1f1b"),
    ("tiny-llama", "pp=4,dp=2,gbs=8,seq=64,schedule=interleaved-1f1b,virtual_stages=2"),  # 8 stages, 4 layers
    ("tiny-llama", "pp=4,dp=2,gbs=4,seq=64,schedule=1f1b"),  # 2 micro-batches < pp
    ("tiny-llama", "dp=8,zero=1,gbs=8,seq=64,param_dtype=fp8"),  # FP8 GEMMs: planned, not run
    ("tiny-llama", "dp=8,zero=3,gbs=8,seq=64"),
    ("tiny-llama", "dp=8,gbs=8,seq=64,recompute=ops"),  # torchtitan's op-level SAC: planned, not run
    ("tiny-llama", "dp=8,gbs=8,seq=64,recompute=selective"),
    ("tiny-llama", "cp=2,tp=2,dp=2,gbs=8,seq=64"),
    ("tiny-moe", "dp=4,ep=4,tp=2,gbs=8,seq=64"),
    ("tiny-moe", "tp=2,dp=4,ep=8,etp=1,gbs=8,seq=63"),  # folded: seq not divisible by tp
    ("tiny-moe", "tp=2,dp=4,ep=8,etp=1,gbs=8,seq=64"),
    ("gpt-oss-20b", "tp=8,gbs=8,seq=64"),  # a family the reference model lacks
]


def _planner_mark(model, layout: Layout) -> dict:
    """The planner's mark, or its own refusal of a layout Layout.validate rejects (never ranked)."""
    try:
        return TRAIN.evaluate(model, CLUSTER, layout, global_batch=layout.global_batch, seq=layout.seq)["runtime"]
    except LayoutError as err:
        return {"runs": False, "why": str(err)}


def _parallelize_refuses(layout: Layout, spec) -> str | None:
    """The runtime's own gate: parallelize checks before it touches the (absent) mesh."""
    pytest.importorskip("torch")
    from modelcarve.runtime.parallel.parallelize import parallelize

    class _Model:  # parallelize reads the spec first; an accepted layout then fails on the mesh
        pass

    model = _Model()
    model.spec = spec
    try:
        parallelize(model, layout, mesh=None)
    except LayoutError as err:
        return str(err)
    except (AttributeError, TypeError):
        return None  # got past the check to the missing mesh
    raise AssertionError("parallelize ran without a mesh")


@pytest.mark.parametrize("name,text", MATRIX)
def test_planner_mark_equals_the_runtime_gate(name, text):
    model, layout = get_model(name), Layout.parse(text)
    mark = _planner_mark(model, layout)
    refusal = _parallelize_refuses(layout, model)
    assert mark["runs"] == (refusal is None), (text, mark, refusal)
    if refusal is not None:
        assert mark["why"] == refusal  # the same words: one implementation
    problems = training_problems(layout, model, world_size=layout.world_size)
    assert (not problems) == mark["runs"]


def test_the_matrix_has_both_kinds():
    marks = [_planner_mark(get_model(n), Layout.parse(t))["runs"] for n, t in MATRIX]
    assert 3 <= sum(marks) <= len(marks) - 3  # the check above compared runnable and refused layouts


def test_run_command_refuses_what_the_plan_marks(capsys):
    from modelcarve.cli import main

    code = main(["run", "--model", "tiny-llama", "--layout", "pp=4,dp=2,gbs=4,seq=64,schedule=1f1b", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    mark = _planner_mark(get_model("tiny-llama"), Layout.parse("pp=4,dp=2,gbs=4,seq=64,schedule=1f1b"))
    assert not mark["runs"] and mark["why"] in err


def test_every_row_of_a_plan_carries_the_mark():
    model = get_model("tiny-moe")
    result = search(model, CLUSTER, "train", top=5, global_batch=8, seq=64)
    assert result["layouts"]
    for row in result["layouts"]:
        layout = Layout.from_dict(row["layout"])
        try:
            check_training(layout, model)
            runs = True
        except LayoutError:
            runs = False
        assert row["runtime"]["runs"] == runs, row["short"]
