"""runtime/dry_run_bytes.py: the byte rules against torch (ZeroRedundancyOptimizer's partition,
FSDP2's shards, AdamW's state), and the planner's top training layouts at full world size.

The full-scale checks build DeepSeek-V3 (2048 ranks) and Llama-3.1-405B (16384 ranks) on the
meta device under the fake process group (~35 s and ~55 s here). Their per-rank figures do NOT
all equal the planner's today, for three stated reasons (docs in /work/notes/report-dryrun.md):
the runtime keeps fp32 weights where the planner counts a bf16 copy plus an fp32 master in the
optimiser; torch's ZeRO-1 partitions whole tensors (uneven) where the planner divides evenly;
the planner gives every stage ceil(layers / pp) layers where pipeline_split balances with the
embedding and head counted. What must agree, and is asserted exactly: every rank of a stage
with the planner's layer count has the planner's gradient bytes (fp32, 4 bytes a parameter on
both sides), and the total optimiser bytes of a stage's ZeRO group equal the planner's
per-rank figure times the group (a partition loses no element). The full equality is a strict
xfail: it starts failing (XPASS) the day both sides agree, so the test is then tightened.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from modelcarve.runtime.dry_run_bytes import dry_run_bytes, fsdp_local, zero1_partition
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
# the planner's own winners: `plan --goal train --emit` (commands in the module doc of the report)
DSV3 = ("deepseek-v3", "256x8xH100", dict(cp=4, dp=16, ep=8, pp=32, tp=1, zero=1, mbs=1, gbs=15360, seq=4096,
                                           schedule="zero-bubble", grad_dtype="fp32", optim_dtype="fp32"))
L405 = ("llama-3.1-405b", "2048x8xH100", dict(cp=8, dp=32, ep=1, pp=16, tp=4, sp=True, zero=1, mbs=1, gbs=2048,
                                               seq=8192, schedule="zero-bubble", grad_dtype="fp32", optim_dtype="fp32"))


@pytest.fixture
def fake_world():
    def start(rank, world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_zero1_partition_is_torchs(fake_world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    fake_world(0, 4)
    shapes = [(7, 3), (50,), (4, 4), (2,), (9, 2), (1,), (30,), (5, 5)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
    torch_sizes = [sum(p.numel() for g in groups for p in g["params"]) for groups in opt._partition_parameters()]
    assert zero1_partition([p.numel() for p in params], 4) == torch_sizes


def test_fsdp_local_is_fsdp2s(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    for rank in range(4):
        fake_world(rank, 4)
        with torch.device("meta"):
            m = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Linear(10, 3))  # dim 0 of 10, 3, 3: uneven
        fully_shard(m, mesh=init_device_mesh("cpu", (4,)))
        for p in m.parameters():
            assert isinstance(p, DTensor)
            assert p.to_local().numel() == fsdp_local(tuple(p.shape), rank, 4), (rank, tuple(p.shape))
        dist.destroy_process_group()


def test_adamw_state_is_two_fp32_copies_per_element():
    params = [torch.nn.Parameter(torch.zeros(s, device="meta")) for s in ((6, 4), (3,))]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()
    for p in params:
        state = opt.state[p]
        device_bytes = sum(t.numel() * t.element_size() for t in state.values() if t.device == p.device and t.dim())
        assert device_bytes == 2 * 4 * p.numel()


@pytest.fixture(scope="module", params=[DSV3, L405], ids=["deepseek-v3-256x8", "llama-405b-2048x8"])
def full_scale(request):
    model, cluster, fields = request.param
    return dry_run_bytes(model, Layout(**fields), parse_cluster(cluster))


def test_full_scale_gradients_and_zero_totals(full_scale):
    from modelcarve.runtime.checkpoint import model_spec

    rows = full_scale["rows"]
    assert full_scale["world_size"] in (2048, 16384)
    assert sum(r["ranks"] for r in rows) == full_scale["world_size"]
    spec = model_spec(full_scale["model"])
    fields = (DSV3 if spec.name == DSV3[0] else L405)[2]
    nls = -(-spec.num_layers // fields["pp"])
    matched = 0
    for r in rows:
        if r["layers"] == nls and r["stage_kind"] == "middle" and (not spec.is_moe or r["pp_rank"] > 2):
            assert r["measured"]["gradients"] == r["predicted"]["gradients"], r
            matched += r["ranks"]
    assert matched > full_scale["world_size"] // 2
    # ZeRO-1 loses no state (dense models): each tp rank's dp x cp group partitions that rank's
    # parameters, so a stage's optimiser bytes over its tp x cp x dp ranks are 8 bytes (two fp32
    # moments) x parameters x tp, i.e. 2 x (4-byte gradient bytes of one rank) x tp
    if not spec.is_moe:
        by_stage: dict = {}
        for r in rows:
            s = by_stage.setdefault(r["pp_rank"], [0.0, 0.0])
            s[0] += r["measured"]["optimizer_states"] * r["ranks"]
            s[1] = r["measured"]["gradients"]
        assert len(by_stage) == fields["pp"]
        for opt_total, grads in by_stage.values():
            assert opt_total == 2.0 * grads * fields["tp"]

@pytest.mark.xfail(strict=True, reason="fp32 runtime weights, whole-tensor ZeRO-1 and ceil(layers/pp) stages differ "
                   "from the planner (see the module doc)")
def test_full_scale_equals_planner(full_scale):
    assert full_scale["ok"], [r for r in full_scale["rows"] if not r["ok"]][:2]


def test_cli_dry_run_json_and_exit_code(tmp_path):
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"tp": 2, "dp": 2, "pp": 2, "zero": 1, "gbs": 8, "seq": 64}))
    out = subprocess.run([sys.executable, "-m", "modelcarve.cli", "run", "--dry-run", "--model", "tiny-llama",
                          "--layout", str(layout), "--cluster", "8xH100", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode in (0, 1), out.stderr
    report = json.loads(out.stdout)
    assert report["world_size"] == 8
    assert {"predicted", "measured"} <= set(report["rows"][0])
    assert out.returncode == (0 if report["ok"] else 1)
    bad = subprocess.run([sys.executable, "-m", "modelcarve.cli", "run", "--dry-run", "--model", "tiny-llama",
                          "--layout", str(layout)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--cluster" in bad.stderr and "Traceback" not in bad.stderr
