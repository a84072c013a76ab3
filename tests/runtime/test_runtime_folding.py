"""MoE parallel folding in the runtime against the single-device reference, in real gloo processes.

The expert mesh ETP x EP x EDP is laid over the same ranks as the attention mesh TP x CP x DP
(runtime/parallel/expert.py ``folded_groups``), so EP may take the tensor-parallel ranks. One spawned
group of 4 ranks, looping over the layouts through ``verify_worker`` (what ``modelcarve verify``
runs): logits, loss per step, every gradient at step 0, the largest gradient difference at later
steps, the global gradient norm, every parameter after 3 AdamW steps, and tokens per expert and
drops per layer and step (routing).

Tolerances are verify.TOLERANCES for fp32 (loss 1e-5 relative; gradients and parameters 1e-4
absolute, plus verify's AdamW allowance, tests/verify/test_verify_allowance.py, which bounds how far
AdamW can carry a gradient difference of reassociation size). Why reassociation is all that can
differ: a folded layout computes each (token, expert) product exactly once, on one rank, with the
same weights (an ETP rank on a slice of the ffn dimension, whose partial w2 outputs are summed:
a reordered fp32 sum), so outputs and gradients differ from the reference only in the order of
fp32 sums (relative ~1e-7 per sum at these sizes, far below 1e-4). Routing is compared exactly
(tolerance 0): the router runs on the same fp32 inputs.

Layouts (tiny-moe: Mixtral-style, 8 experts top-2; deepseek: MLA, a shared expert, sigmoid
group-limited routing):

* ``tp=2,dp=2,ep=4`` (etp 1 by default): EP over all four ranks, TP ranks route different halves
  of each sequence (the issue's must-show);
* the same with sequence parallelism and the capacity factor, aux loss and router-bias update on;
* ``dp=4,ep=2,etp=2``: expert TP without attention TP (an ETP group all-gathers its rows);
* ``tp=2,dp=2,ep=2,etp=1`` with ZeRO-1 (expert-dp 2: expert state partitioned over it) and with
  FSDP2 (local experts sharded over the expert-dp mesh);
* ``tp=2,pp=2,ep=2,etp=1``: folding inside each pipeline stage;
* ``tp=2,dp=2,ep=4`` on the DeepSeek-style model (replicated shared expert, partial gradients).

Plus the pre-launch check: folded layouts pass ``check_runtime``; a sequence the TP ranks cannot
split evenly is refused with one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

COMMON = "seq=16,mbs=1,param_dtype=fp32"
OPTIONS = dict(moe_capacity_factor=1.0, moe_aux_loss_coef=0.05, moe_bias_rate=0.01)

LAYOUTS = [
    ("tiny-moe", f"tp=2,dp=2,ep=4,gbs=4,{COMMON}", None),
    ("tiny-moe", f"tp=2,dp=2,ep=4,sp,gbs=4,{COMMON}", OPTIONS),
    ("tiny-moe", f"dp=4,ep=2,etp=2,gbs=8,{COMMON}", OPTIONS),
    ("tiny-moe", f"tp=2,dp=2,ep=2,etp=1,zero=1,gbs=4,{COMMON}", None),
    ("tiny-moe", f"tp=2,dp=2,ep=2,etp=1,fsdp,gbs=4,{COMMON}", None),
    ("tiny-moe", f"tp=2,pp=2,ep=2,etp=1,gbs=4,{COMMON}", None),
    ("deepseek", f"tp=2,dp=2,ep=4,gbs=4,{COMMON}", OPTIONS),
]


def _worker(dirs):
    import torch.distributed as dist

    from modelcarve.runtime.parallel.expert import expert_groups
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.spec.layout import Layout
    from modelcarve.verify.reference import verify_worker

    out = {"layouts": [], "groups": {}}
    for text in ("tp=2,dp=2,ep=4", "dp=4,ep=2,etp=2", "tp=2,dp=2,ep=2,etp=1"):
        layout = Layout.parse(text)
        g = expert_groups(build_mesh(layout), layout)
        out["groups"][text] = {k: g[k] for k in ("ep_rank", "etp_rank", "edp_rank", "ep_ranks", "edp_ranks")}
    dist.barrier()
    for model, layout, options in LAYOUTS:
        out["layouts"].append(verify_worker(dirs.get(model, model), layout, steps=3, moe=options))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from test_runtime_moe import DEEPSEEK

    path = tmp_path_factory.mktemp("deepseek")
    transformers.DeepseekV3Config(**DEEPSEEK).save_pretrained(path)
    return run_distributed(_worker, 4, {"deepseek": str(path)}, timeout=500)


def test_folded_layouts_match_reference(world4):
    failures = []
    for (model, layout, options), report in zip(LAYOUTS, world4[0]["layouts"]):
        kinds = {c["name"].split("/")[0] for c in report["checks"]}
        assert {"logits", "loss", "grad", "param", "routing", "grad_norm"} <= kinds, (layout, kinds)
        assert "ETP" in report["layout"] or "etp=2" in layout, report["layout"]  # it ran folded
        bad = [c for c in report["checks"] if not c["passed"]]
        if bad:
            failures.append((model, layout, bad[:5]))
        if options:  # the capacity factor dropped assignments, and the drops matched (routing checks)
            assert sum(row["dropped"] for step in report["moe"] for row in step.values()) > 0, layout
    assert not failures, failures


def test_expert_mesh_coordinates(world4):
    """ETP innermost, then EP, then EDP over the ranks of a stage (spec/layout.py)."""
    for rank, result in enumerate(world4):
        g = result["groups"]
        assert g["tp=2,dp=2,ep=4"]["ep_rank"] == rank and g["tp=2,dp=2,ep=4"]["ep_ranks"] == [0, 1, 2, 3]
        etp = g["dp=4,ep=2,etp=2"]
        assert (etp["etp_rank"], etp["ep_rank"], etp["ep_ranks"]) == (rank % 2, rank // 2, [rank % 2, rank % 2 + 2])
        edp = g["tp=2,dp=2,ep=2,etp=1"]
        assert (edp["ep_rank"], edp["edp_rank"], edp["edp_ranks"]) == (rank % 2, rank // 2, [rank % 2, rank % 2 + 2])


def test_check_runtime_runs_folded_layouts():
    from modelcarve.spec.support import check_training as check_runtime
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.layout import Layout

    spec = get_model("tiny-moe")
    for text in ("tp=2,dp=2,ep=4,seq=16", "tp=2,dp=4,ep=8,seq=16", "dp=4,ep=2,etp=2,seq=16"):
        layout = Layout.parse(text)
        assert layout.folded
        check_runtime(layout, spec, layout.world_size)
    with pytest.raises(LayoutError, match="not divisible by tp=2") as err:
        check_runtime(Layout.parse("tp=2,dp=2,ep=4,seq=15"), spec, 4)
    assert "\n" not in str(err.value)
