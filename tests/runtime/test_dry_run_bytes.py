"""runtime/dryrun/state_bytes.py: the byte rules against torch (FSDP2's shards, AdamW's state), and the
planner's top training layouts at full world size.

The full-scale checks build DeepSeek-V3 (2048 ranks) and Llama-3.1-405B (16384 ranks) on the
meta device under the fake process group. Both layouts are ZeRO-1 with bf16 parameters: the
runtime holds bf16 weights with the fp32 master in the (distributed) optimiser
(zero_optimizer.py's mixed precision), as the planner counts them (issue 26), and the layers
agree (issue 25: both sides take spec/stages.py's split, the embedding and head counted as a
layer each). So on EVERY distinct rank weights and gradients equal the planner's exactly and the
optimiser state is within the bucket padding (``tolerance_bytes``).
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

from modelcarve.runtime.dryrun.state_bytes import dry_run_bytes, fsdp_local, tolerance_bytes
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.stages import rank_layers

ROOT = Path(__file__).resolve().parents[2]
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
    from modelcarve.runtime.checkpoint.hf_load import model_spec

    rows = full_scale["rows"]
    assert full_scale["world_size"] in (2048, 16384)
    assert sum(r["ranks"] for r in rows) == full_scale["world_size"]
    spec = model_spec(full_scale["model"])
    fields = (DSV3 if spec.name == DSV3[0] else L405)[2]
    # every rank holds the layers spec/stages.py gives its pipeline rank (the planner's split)
    assert [r["layers"] for r in sorted(rows, key=lambda r: r["pp_rank"])] == [
        rank_layers(spec.num_layers, fields["pp"])[r["pp_rank"]] for r in sorted(rows, key=lambda r: r["pp_rank"])]
    tol = tolerance_bytes(Layout(**fields))
    for r in rows:
        assert r["measured"]["gradients"] == r["predicted"]["gradients"], r
        # ZeRO-1 optimiser state (fp32 master + two moments of the owned range) within the
        # bucket padding (tolerance_bytes: under n elements x 12 bytes a bucket)
        assert abs(r["measured"]["optimizer_states"] - r["predicted"]["optimizer_states"]) <= tol, r

@pytest.mark.parametrize("text", ["fsdp,dp=4,gbs=8,seq=64", "dp=4,gbs=8,seq=64", "pp=2,dp=2,fsdp,gbs=8,seq=64",
                                  "zero=1,dp=1,tp=2,gbs=8,seq=64"])
def test_layouts_the_runtime_holds_in_fp32_equal_the_planner(text):
    """A bf16 layout the runtime keeps in fp32 parameters (zero=0, FSDP2, ZeRO over one replica:
    spec/support.held_param_dtype) is compared with the planner's rules for fp32 parameters that
    are their own master: 4 bytes of weights, 4 of gradients and 8 of Adam moments a parameter,
    where Megatron's bf16 weights with an fp32 master (2 + 4 + 12) made every such dry run DIFFER."""
    layout = Layout.parse(text)
    report = dry_run_bytes("tiny-llama", layout, parse_cluster("4xH100"))
    assert report["ok"], [r for r in report["rows"] if not r["ok"]][:1]
    for r in report["rows"]:
        assert r["predicted"]["optimizer_states"] == pytest.approx(2 * r["predicted"]["weights"], rel=1e-12)
        assert r["predicted"]["gradients"] == pytest.approx(r["predicted"]["weights"], rel=1e-12)


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
