"""Expert parallelism against the single-device reference, in real gloo processes.

One spawned group per world size (2 and 4), looping over cases inside it:

* block level (world 4, ep=4 and ep=2 x expert-dp 2): one MoE block, each rank feeding its
  share of a global batch; outputs, input gradients, router and expert gradients equal the
  reference block's on the whole batch; routing identical token by token; the all-to-all
  delivers to each expert exactly the rows the reference router chose (count and content); with
  a capacity factor the dropped count equals the reference's.
* whole model (``verify_worker``, the ``modelcarve verify`` worker): ep2, ep4, ep2 x dp2 (also
  with ZeRO-1 and FSDP2: experts' state / weights sharded over expert-dp), ep2 x tp2 (+sp),
  ep2 x pp2 (1f1b, interleaved, zero-bubble) on tiny-moe (Mixtral-style, 8 experts top-2) and
  ep2 x tp2 on a tiny DeepSeek-V3-style model (MLA, shared expert, group-limited sigmoid
  routing), and ep2 x dp2 FSDP on a DeepSeek-V3 checkpoint whose router bias leaves EP rank 1
  without tokens: logits, loss, gradients, global grad norm, parameters after 3 AdamW steps
  within fp32 tolerances (verify.TOLERANCES: loss 1e-5 relative, gradients and parameters
  1e-4), and tokens per expert and drops per layer and step exactly equal to the reference's;
  also with a capacity factor, the aux loss and the aux-loss-free bias update switched on
  (also with full recomputation, and with cp2 x ep2 and cp2 x pp2 x ep2, where a sequence is
  split over cp: capacity decided on the gathered routing, expert loads summed over cp).
* checkpoints (load_sharded): under ep2 each rank reads only its experts' slices of a Mixtral
  checkpoint; a DeepSeek-V3 checkpoint under ep2 x fsdp / x tp2 / x pp2 reassembles exactly,
  router bias included.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

LOSS_RTOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-4, 1e-4


def _block_cases():
    import torch.distributed as dist

    from modelcarve.runtime.parallel.expert import expert_groups, shard_experts_ep
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec = get_model("tiny-moe")
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    b, s, h = 2, 12, spec.hidden_size
    x_all = torch.randn(world * b, s, h, generator=gen)
    g_all = torch.randn(world * b, s, h, generator=gen)
    results = {}
    # "skewed": a router bias sends every token to experts 0 and 1 (EP rank 0): the other ranks
    # send and receive nothing for those experts and their experts run on empty batches
    for ep, capacity in ((world, None), (2, None), (2, 0.75), (2, "skewed")):
        layout = Layout(dp=world, ep=ep)
        mesh = build_mesh(layout)
        groups = expert_groups(mesh, layout)
        ref = build_model(spec, seed=3).layers["1"].feed_forward
        moe = build_model(spec, seed=3).layers["1"].feed_forward
        if capacity == "skewed":
            for block in (ref, moe):
                block.router.e_score_correction_bias[:2] = 100.0
        else:
            ref.capacity_factor = moe.capacity_factor = capacity
        x_ref = x_all.clone().requires_grad_()
        y_ref = ref(x_ref)
        y_ref.backward(g_all)
        ref_idx = ref.router(x_all.view(-1, h))[0].view(world * b, s, -1)

        shard_experts_ep(moe, groups["ep_group"])
        moe.dispatcher.record = []
        mine = slice(rank * b, (rank + 1) * b)
        x = x_all[mine].clone().requires_grad_()
        y = moe(x)
        y.backward(g_all[mine])
        errs = {}
        errs["out"] = (y - y_ref[mine]).abs().max().item()
        errs["x_grad"] = (x.grad - x_ref.grad[mine]).abs().max().item()
        router_grad = moe.router.weight.grad.clone()
        dist.all_reduce(router_grad)
        errs["router_grad"] = (router_grad - ref.router.weight.grad).abs().max().item()
        per = spec.num_experts // ep
        experts = slice(groups["ep_rank"] * per, (groups["ep_rank"] + 1) * per)
        for name in ("w1", "w3", "w2"):
            grad = getattr(moe.experts, name).grad.clone()
            dist.all_reduce(grad, group=groups["edp_group"])
            errs[name] = (grad - getattr(ref.experts, name).grad[experts]).abs().max().item()
        # routing: the local router chose what the reference chose for these tokens
        local_idx = moe.router(x_all[mine].reshape(-1, h))[0].view(b, s, -1)
        same_routing = torch.equal(local_idx, ref_idx[mine])
        # the all-to-all: rows received per local expert = what the reference sent there from the
        # EP group's tokens (kept ones only), and their sum is the sum of those tokens
        (counts, rows), = moe.dispatcher.record
        group_seqs = torch.cat([torch.arange(r * b, (r + 1) * b) for r in groups["ep_ranks"]])
        ref_keep = ref._capacity_mask(ref_idx) if ref.capacity_factor else torch.ones_like(ref_idx, dtype=torch.bool)
        expected_counts, expected_sums = [], []
        for e in range(experts.start, experts.stop):
            hit = (ref_idx[group_seqs] == e) & ref_keep[group_seqs]  # [seqs, s, k]
            expected_counts.append(int(hit.sum()))
            expected_sums.append((x_all[group_seqs] * hit.sum(-1, keepdim=True)).sum(dim=(0, 1)))
        got_sums = [chunk.sum(0) for chunk in torch.split(rows, counts.tolist())]
        dropped = moe.dropped_tokens.clone()
        dist.all_reduce(dropped)
        results[(ep, capacity)] = {
            "errs": errs,
            "same_routing": same_routing,
            "counts": counts.tolist() == expected_counts,
            "rows": max((a - e).abs().max().item() for a, e in zip(got_sums, expected_sums)),
            "dropped": (int(dropped), int(ref.dropped_tokens)),
            "received": (groups["ep_rank"], int(counts.sum())),
        }
    return results


# --- whole model through verify -----------------------------------------------------------

COMMON = "seq=16,mbs=1,param_dtype=fp32"
OPTIONS = dict(moe_capacity_factor=1.0, moe_aux_loss_coef=0.05, moe_bias_rate=0.01)
DEEPSEEK = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                max_position_embeddings=64)

# world size -> [(model, layout, MoE options)]; "deepseek" is the config written by the fixture
LAYOUTS = {
    2: [
        ("tiny-moe", f"dp=2,ep=2,gbs=4,{COMMON}", None),
        ("tiny-moe", f"dp=2,ep=2,gbs=4,{COMMON}", OPTIONS),
        ("tiny-moe", f"dp=2,gbs=4,{COMMON}", OPTIONS),
        ("tiny-moe", "dp=2,ep=2,gbs=4,seq=16,mbs=1,param_dtype=bf16", None),
        ("tiny-moe", f"dp=2,ep=2,recompute=full,gbs=4,{COMMON}", OPTIONS),
    ],
    4: [
        ("tiny-moe", f"dp=4,ep=4,gbs=8,{COMMON}", None),
        ("tiny-moe", f"dp=4,ep=2,gbs=8,{COMMON}", None),
        ("tiny-moe", f"dp=4,ep=2,fsdp,gbs=8,{COMMON}", None),
        ("tiny-moe", f"dp=4,ep=2,zero=1,gbs=8,{COMMON}", None),
        ("tiny-moe", f"dp=2,ep=2,tp=2,gbs=4,{COMMON}", None),
        ("tiny-moe", f"dp=2,ep=2,tp=2,sp,gbs=4,{COMMON}", OPTIONS),
        ("tiny-moe", f"dp=2,ep=2,pp=2,gbs=4,{COMMON}", None),
        ("tiny-moe", f"dp=2,ep=2,pp=2,gbs=4,{COMMON}", OPTIONS),
        ("tiny-moe", f"dp=2,ep=2,pp=2,schedule=interleaved-1f1b,virtual_stages=2,gbs=4,{COMMON}", None),
        ("tiny-moe", f"dp=2,ep=2,pp=2,schedule=zero-bubble,gbs=4,{COMMON}", None),
        ("deepseek", f"dp=2,ep=2,tp=2,gbs=4,{COMMON}", OPTIONS),
        ("deepseek-skewed", f"dp=4,ep=2,fsdp,gbs=8,{COMMON}", None),
        ("tiny-moe", f"cp=2,dp=2,ep=2,gbs=4,{COMMON}", OPTIONS),
        ("tiny-moe", f"cp=2,pp=2,ep=2,gbs=2,{COMMON}", OPTIONS),
    ],
}


def _group_worker(world, dirs):
    import torch.distributed as dist

    from modelcarve.verify.reference import verify_worker

    out = {"block": _block_cases() if world == 4 else None, "layouts": []}
    dist.barrier()
    for model, layout, options in LAYOUTS[world]:
        name = dirs.get(model, model)
        out["layouts"].append(verify_worker(name, layout, steps=3, moe=options))
        dist.barrier()
    if world == 2:
        out["sharded"] = [_sharded_load(dirs["mixtral"], f"dp=2,ep=2,{COMMON}")]
    else:
        out["sharded"] = [_sharded_load(dirs["deepseek-skewed"], f"{layout},{COMMON}")
                          for layout in ("dp=4,ep=2,fsdp", "dp=2,ep=2,tp=2", "dp=2,ep=2,pp=2,gbs=4")]
    return out


def _sharded_load(path, layout_text):
    import torch.distributed as dist

    from modelcarve.runtime.checkpoint.hf_load import CheckpointReader, load_model, load_sharded
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.spec.layout import Layout
    from modelcarve.verify.reference import gather_full

    layout = Layout.parse(layout_text)
    mesh = build_mesh(layout)
    meta, _ = load_model(path, device="meta")
    chunks = parallelize(meta, layout, mesh)
    reader = load_sharded(chunks, path)
    params = gather_full(chunks, "param")
    whole = CheckpointReader(path)
    total = sum(whole.read(name).numel() * 4 for name in whole.files)
    diff = None
    full, _ = load_model(path)
    if dist.get_rank() == 0:
        ref = dict(full.named_parameters())
        assert set(params) == set(ref), set(params) ^ set(ref)
        diff = max((params[k] - ref[k]).abs().max().item() for k in ref)
    # buffers a checkpoint holds (DeepSeek's router bias) are loaded too; counters start at zero
    ref_buffers = dict(full.named_buffers())
    buffers_ok = all(torch.equal(b, ref_buffers[n]) for c in chunks for n, b in c.named_buffers())
    experts = sum(p.numel() * 4 for c in chunks for n, p in c.named_parameters() if ".experts." in n)
    return dict(bytes=reader.bytes_read, total=total, diff=diff, expert_bytes=experts, buffers_ok=buffers_ok)


def write_moe_checkpoints(make_dir) -> dict[str, str]:
    """{"deepseek": config-only dir (random weights), "deepseek-skewed": a DeepSeek-V3 checkpoint
    whose router bias sends every token to experts 0 and 1 (EP rank 1's experts get nothing),
    "mixtral": a Mixtral checkpoint}; ``make_dir(name)`` makes each empty folder."""
    import transformers
    from test_moe_layer import save_tiny_moe

    dirs = {name: make_dir(name) for name in ("deepseek", "deepseek-skewed", "mixtral")}
    transformers.DeepseekV3Config(**DEEPSEEK).save_pretrained(dirs["deepseek"])
    hf = save_tiny_moe("deepseek_v3", dirs["deepseek-skewed"])
    with torch.no_grad():
        for name, bias in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.zero_()
                bias[:2] = 100.0
    hf.save_pretrained(dirs["deepseek-skewed"])
    save_tiny_moe("mixtral", dirs["mixtral"])
    return {name: str(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_moe_checkpoints(tmp_path_factory.mktemp)


def _group(world, model_dirs):
    return run_distributed(_group_worker, world, world, model_dirs, timeout=400)


@pytest.fixture(scope="module")
def world2(model_dirs):
    return _group(2, model_dirs)


@pytest.fixture(scope="module")
def world4(model_dirs):
    return _group(4, model_dirs)


def _check_layouts(world, results):
    failures = []
    for (model, layout, options), report in zip(LAYOUTS[world], results[0]["layouts"]):
        kinds = {c["name"].split("/")[0] for c in report["checks"]}
        assert {"loss", "grad", "param", "routing"} <= kinds, (layout, kinds)
        bad = [c for c in report["checks"] if not c["passed"]]
        if bad:
            failures.append((model, layout, options, bad[:5]))
        if options and "moe_capacity_factor" in options:  # it dropped assignments (matching: routing checks)
            assert sum(row["dropped"] for step in report["moe"] for row in step.values()) > 0, layout
        if model == "deepseek-skewed":  # all routed tokens on EP rank 0: the straggler factor is 2
            assert all(row["rank_imbalance"] == 2.0 for step in report["moe"] for row in step.values())
    assert not failures, failures


def test_layouts_world2_match_reference(world2):
    _check_layouts(2, world2)


def test_layouts_world4_match_reference(world4):
    _check_layouts(4, world4)


def test_block_level(world4):
    for rank, res in enumerate(r["block"] for r in world4):
        for case, r in res.items():
            assert all(v <= GRAD_TOL for v in r["errs"].values()), (rank, case, r["errs"])
            assert r["errs"]["out"] <= 1e-5, (rank, case)
            assert r["same_routing"] and r["counts"], (rank, case)  # routing, all-to-all counts
            assert r["rows"] <= 1e-4, (rank, case, r["rows"])  # and contents
        got, expected = res[(2, 0.75)]["dropped"]
        assert expected > 0 and got == expected  # capacity: the same drops as the reference
        assert res[(2, None)]["dropped"] == (0, 0)
        ep_rank, received = res[(2, "skewed")]["received"]
        assert (received == 0) == (ep_rank == 1), (rank, ep_rank, received)  # experts 0, 1 live on EP rank 0


def test_ep_rank_reads_only_its_experts(world2):
    """Mixtral checkpoint, ep2: each rank reads the checkpoint less the other rank's experts."""
    sharded = [r["sharded"][0] for r in world2]
    assert sharded[0]["diff"] == 0.0 and all(r["buffers_ok"] for r in sharded)
    total = sharded[0]["total"]
    for r in sharded:
        assert r["bytes"] <= total - r["expert_bytes"] + 1024, (r, total)
    assert sum(r["bytes"] for r in sharded) >= total


def test_sharded_deepseek_checkpoint_reassembles(world4):
    """DeepSeek-V3 checkpoint (MLA, shared experts, router bias) under ep2 x fsdp, ep2 x tp2,
    ep2 x pp2: the slices reassemble it exactly and no rank reads more than half of it."""
    for i in range(3):
        per_rank = [r["sharded"][i] for r in world4]
        assert per_rank[0]["diff"] == 0.0 and all(r["buffers_ok"] for r in per_rank), i
        total = per_rank[0]["total"]
        assert max(r["bytes"] for r in per_rank) < 0.6 * total, (i, [r["bytes"] for r in per_rank], total)


def test_cli_verify_prints_expert_table():
    """``modelcarve verify`` end to end (torchrun) with MoE options: passes, prints the expert table."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["verify", "--model", "tiny-moe", "--layout", f"dp=2,ep=2,gbs=4,{COMMON}",
            "--moe-capacity-factor", "1.0", "--moe-bias-rate", "0.01"]
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "routing" in out and "experts, last step" in out and "max/mean" in out and "PASS" in out
