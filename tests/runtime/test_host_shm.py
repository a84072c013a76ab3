"""runtime/distributed/host_shm.py against gloo's own collectives, on real gloo ranks.

One 3-rank world: a 2-rank subgroup and the whole world are attached; every sum and gather is
compared with ``dist.all_reduce`` / ``dist.all_gather`` of the same tensors (fp32 sums of small
integers are exact whatever the order; bf16 and random fp32 are compared with the sum formed in
group-rank order, which is what every member computes); many calls in a row exercise both
parities; a tensor over the slot, one that needs grad, and an unattached group take gloo. The
opt-out variable and a member that never arrives (a clear error after the timeout, not a hang)
are checked in their own 2-rank worlds.
"""

from __future__ import annotations

import pytest

from dist import DistError, run_distributed


def _world():
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.distributed import host_shm
    from modelcarve.runtime.distributed.primitives import all_reduce_sum, gather_cat

    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    out = {}
    assert host_shm.attach(None, 30.0) is None
    if rank < 2:
        assert host_shm.attach(pair, 30.0) is None
    host = host_shm.lookup(None)
    assert host is not None and host.size == world

    # exact sums, many calls in a row (both parities reused), shapes changing between calls
    for i in range(40):
        n = 1 + (i * 37) % 700
        x = torch.arange(n, dtype=torch.float32) * (rank + 1) + i
        want = x.clone()
        dist.all_reduce(want)
        got = all_reduce_sum(x.clone(), None)
        assert torch.equal(got, want), i
    # random fp32 and bf16: the sum in group-rank order, identical bits on every rank
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64, generator=g).to(dtype)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        ordered = parts[0].clone()
        for p in parts[1:]:
            ordered += p
        got = all_reduce_sum(x.clone(), None)
        assert torch.equal(got, ordered), dtype
        same = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(same, got)
        assert all(torch.equal(s, got) for s in same)
        # gather along a middle dim, as the LM head's logits are gathered over the vocabulary
        cat = gather_cat(x, 1, None)
        assert torch.equal(cat, torch.cat(parts, dim=1)), dtype
    calls = host.seq
    # over the slot, needing grad: gloo (the counter does not move), same results
    big = torch.ones(host_shm.SLOT_BYTES // 4 + 1)
    assert float(all_reduce_sum(big, None)[0]) == world
    leaf = torch.ones(4, requires_grad=True)
    assert not host.fits(leaf)
    assert host.seq == calls
    # the 2-rank subgroup: its own segment and counter, interleaved with the world's
    if rank < 2:
        sub = host_shm.lookup(pair)
        assert sub is not None and sub is not host and sub.size == 2
        for i in range(10):
            x = torch.full((8,), float(rank + i))
            assert torch.equal(all_reduce_sum(x, pair), torch.full((8,), float(2 * i + 1)))
        out["pair_calls"] = sub.seq
    dist.barrier()
    out["calls"] = host.seq
    host_shm.detach_all()
    assert host_shm.lookup(None) is None
    y = torch.ones(2)
    assert torch.equal(all_reduce_sum(y, None), torch.full((2,), float(world)))  # gloo again
    import glob

    out["left_in_dev_shm"] = [p for p in glob.glob("/dev/shm/modelcarve-*")]
    return out


def test_shm_collectives_equal_gloo():
    results = run_distributed(_world, 3, timeout=300)
    assert results[0]["calls"] == results[2]["calls"] == 40 + 2 * 2
    assert results[0]["pair_calls"] == results[1]["pair_calls"] == 10
    assert results[0]["left_in_dev_shm"] == []  # unlinked once every member mapped it


def _declined():
    import torch.distributed as dist

    from modelcarve.runtime.distributed import host_shm

    reason = host_shm.attach(None, 30.0)
    assert host_shm.lookup(None) is None
    dist.barrier()
    return reason


def test_opt_out_keeps_gloo():
    reasons = run_distributed(_declined, 2, timeout=120, env={"MODELCARVE_SHM_COLLECTIVES": "0"})
    assert reasons == ["MODELCARVE_SHM_COLLECTIVES=0"] * 2


def _absent_peer():
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.distributed import host_shm

    assert host_shm.attach(None, 1.0) is None
    if dist.get_rank() == 0:
        host_shm.lookup(None).all_reduce_(torch.ones(4))  # rank 1 never joins
    return None


def test_absent_member_raises_not_hangs():
    with pytest.raises(DistError) as err:
        run_distributed(_absent_peer, 2, timeout=120)
    assert "group rank 1 did not arrive within 1 s" in str(err.value)
