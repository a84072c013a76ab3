"""Every dense layout against the single-device reference (tests/dist.py: real gloo processes).

One spawned group per world size runs every layout of that size (starting ranks costs seconds).
Each case is ``modelcarve verify``'s own worker: logits, loss, per-parameter gradients and
parameters after 3 AdamW steps, each within its tolerance (verify.TOLERANCES; fp32: loss 1e-5
relative, gradients and parameters 1e-4 absolute). Other engineers append rows to LAYOUTS.
"""

import pytest

from dist import run_distributed

COMMON = "seq=16,mbs=1,param_dtype=fp32"

# world size -> [(model, layout)]; the pipeline / MoE / CP engineers add their rows here.
LAYOUTS = {
    2: [
        ("tiny-llama", f"dp=2,gbs=4,{COMMON}"),
        ("tiny-llama", f"dp=2,zero=1,gbs=4,{COMMON}"),
        ("tiny-llama", f"dp=2,fsdp,gbs=4,{COMMON}"),
        ("tiny-llama", f"tp=2,gbs=2,{COMMON}"),
        ("tiny-llama", f"tp=2,sp,gbs=2,{COMMON}"),
        ("tiny-llama", "tp=2,sp,gbs=2,seq=16,mbs=1,param_dtype=bf16"),
        ("tiny-llama", "dp=2,fsdp,gbs=4,seq=16,mbs=1,param_dtype=bf16"),
    ],
    4: [
        ("tiny-llama", f"dp=4,hsdp=2,gbs=8,{COMMON}"),
        ("tiny-llama", f"tp=2,dp=2,gbs=4,{COMMON}"),
        ("tiny-llama", f"tp=2,sp,dp=2,zero=1,gbs=4,{COMMON}"),
    ],
}


def _run_cases(cases):
    import torch.distributed as dist

    from modelcarve.runtime.mesh import destroy, init_distributed
    from modelcarve.verify import verify_worker

    out = []
    for model, layout in cases:
        report = verify_worker(model, layout, steps=3)
        out.append(report)
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def reports(request):
    world = request.param
    results = run_distributed(_run_cases, world, LAYOUTS[world], timeout=400)
    return world, results[0]


def test_layouts_match_reference(reports):
    world, rank0 = reports
    failures = []
    for (model, layout), report in zip(LAYOUTS[world], rank0):
        bad = [c for c in report["checks"] if not c["passed"]]
        kinds = {c["name"].split("/")[0] for c in report["checks"]}
        assert {"loss", "grad", "param"} <= kinds, (layout, kinds)
        if bad:
            failures.append((layout, bad[:5]))
    assert not failures, failures
