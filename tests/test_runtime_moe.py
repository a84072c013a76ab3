"""Expert parallelism against the single-device reference, in real gloo processes.

One spawned group per world size, looping over cases inside it:

* block level (world 4, ep=4 and ep=2 x expert-dp 2): one MoE block, each rank feeding its
  share of a global batch; outputs, input gradients, router and expert gradients equal the
  reference block's on the whole batch; routing identical; the all-to-all delivers to each
  expert exactly the rows the reference router chose (count and content); with a capacity
  factor the dropped count equals the reference's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist import run_distributed  # noqa: E402

LOSS_RTOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-4, 1e-4


def _block_cases():
    import torch.distributed as dist

    from modelcarve.runtime.expert import expert_groups, shard_experts_ep
    from modelcarve.runtime.mesh import build_mesh
    from modelcarve.runtime.model import build_model
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec = get_model("tiny-moe")
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    b, s, h = 2, 12, spec.hidden_size
    x_all = torch.randn(world * b, s, h, generator=gen)
    g_all = torch.randn(world * b, s, h, generator=gen)
    results = {}
    for ep, capacity in ((world, None), (2, None), (2, 0.75)):
        layout = Layout(dp=world, ep=ep)
        mesh = build_mesh(layout)
        groups = expert_groups(mesh, layout)
        ref = build_model(spec, seed=3).layers["1"].feed_forward
        moe = build_model(spec, seed=3).layers["1"].feed_forward
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
        ref_keep = ref._capacity_mask(ref_idx) if capacity else torch.ones_like(ref_idx, dtype=torch.bool)
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
        }
    return results


@pytest.fixture(scope="module")
def block_results():
    return run_distributed(_block_cases, 4, timeout=240)


def test_block_matches_reference(block_results):
    for rank, res in enumerate(block_results):
        for case, r in res.items():
            assert all(v <= GRAD_TOL for v in r["errs"].values()), (rank, case, r["errs"])
            assert r["errs"]["out"] <= 1e-5, (rank, case)


def test_routing_and_all_to_all_counts(block_results):
    for rank, res in enumerate(block_results):
        for case, r in res.items():
            assert r["same_routing"], (rank, case)
            assert r["counts"], (rank, case)
            assert r["rows"] <= 1e-4, (rank, case, r["rows"])


def test_capacity_drops_match_reference(block_results):
    for res in block_results:
        got, expected = res[(2, 0.75)]["dropped"]
        assert expected > 0 and got == expected
        assert res[(2, None)]["dropped"] == (0, 0)
