"""Ring attention (runtime/parallel/ring_attention.py) against full causal attention.

Single-process tests check the block math and the hand-written backward (gradcheck in fp64,
group=None is one rank) and the zig-zag layout; one spawned gloo group per world size (2
and 4) checks outputs and q/k/v gradients of every rank's piece against unsharded causal
attention for MHA, GQA, MQA and d_v != d_qk, in fp32 and fp64, with both tile kernels (math
and flash); the refusal of lengths that do not divide by 2 x cp (and that padding at the end
is exact instead); the bytes each rank sends and receives per call; and (cp=2) a clear error
within the timeout when a peer never joins.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from modelcarve.runtime.parallel.ring_attention import ring_attention
from modelcarve.runtime.distributed.zigzag import check_divisible, zigzag_indices, zigzag_shard, zigzag_unshard
from modelcarve.spec.errors import LayoutError


from dist import run_distributed


def _reference(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# (batch, q heads, kv heads, seq, d_qk, d_v)
CASES = [
    (2, 4, 2, 16, 8, 8),  # GQA
    (1, 4, 1, 24, 8, 8),  # MQA
    (2, 2, 2, 8, 4, 6),  # MHA, d_v != d_qk (MLA-like); for cp=4 the chunks are one token
    (1, 6, 3, 48, 16, 16),  # GQA, longer
]


# --- single process -----------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("hq,hkv,dv", [(4, 2, 8), (4, 1, 8), (3, 3, 5), (2, 2, 11)])
def test_single_rank_matches_sdpa_and_gradcheck(hq, hkv, dv, kernel):
    torch.manual_seed(0)
    q = torch.randn(2, hq, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, 6, dv, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ring_attention(q, k, v, kernel=kernel), _reference(q, k, v), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, c: ring_attention(a, b, c, kernel=kernel), (q, k, v))


def test_unknown_kernel_is_refused():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="kernel 'fast' is not one of auto, math, flash"):
        ring_attention(q, q, q, kernel="fast")


def test_zigzag_layout():
    # cp=2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(16, 4, 3).tolist() == [6, 7, 8, 9]
    x = torch.arange(3 * 24).view(3, 24)
    for cp in (1, 2, 3, 4):
        pieces = [zigzag_shard(x, 1, cp, r) for r in range(cp)]
        assert all(p.shape == (3, 24 // cp) for p in pieces)
        assert torch.equal(zigzag_unshard(pieces, 1), x)
        # every rank holds the same causal work: sum of positions is equal across ranks
        assert len({int(zigzag_indices(24, cp, r).sum()) for r in range(cp)}) == 1


def test_indivisible_lengths_are_refused():
    with pytest.raises(LayoutError, match=r"seq=18 is not a multiple of 2 x cp = 4.*use seq=16 or seq=20"):
        check_divisible(18, 2)
    with pytest.raises(LayoutError, match="2 x cp = 8"):
        zigzag_shard(torch.zeros(1, 12), 1, 4, 0)
    with pytest.raises(LayoutError, match="not two equal zig-zag chunks"):
        q = torch.zeros(1, 2, 5, 4)
        ring_attention(q, q, q)


# --- real gloo ranks ----------------------------------------------------------------------
def _ring_worker() -> dict:
    import torch.distributed as dist

    from modelcarve.runtime.distributed.mesh import new_group

    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = new_group(list(range(world_size)))  # the whole world is the cp group
    results = {}
    for case in CASES:
        b, hq, hkv, s, d, dv = case
        for dtype, kernel in ((torch.float32, "flash"), (torch.float32, "math"), (torch.float64, "flash"), (torch.float64, "math")):
            gen = torch.Generator().manual_seed(hash(case) % 1000)
            q = torch.randn(b, hq, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
            k = torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
            v = torch.randn(b, hkv, s, dv, generator=gen, dtype=torch.float64, requires_grad=True)
            dout = torch.randn(b, hq, s, dv, generator=gen, dtype=torch.float64)
            out = _reference(q, k, v)
            out.backward(dout)

            def piece(t):
                return zigzag_shard(t.detach(), 2, world_size, rank).to(dtype)

            ql, kl, vl = (piece(t).requires_grad_() for t in (q, k, v))
            # two calls in a row, as two layers would make them
            out_l = ring_attention(ql, kl, vl, group, kernel=kernel)
            out_l2 = ring_attention(ql, kl, vl, group, kernel=kernel)
            (out_l * piece(dout)).sum().backward()
            errors = {
                "out": (out_l.double() - piece(out).double()).abs().max().item(),
                "repeat": (out_l2 - out_l).abs().max().item(),
                "dq": (ql.grad.double() - piece(q.grad).double()).abs().max().item(),
                "dk": (kl.grad.double() - piece(k.grad).double()).abs().max().item(),
                "dv": (vl.grad.double() - piece(v.grad).double()).abs().max().item(),
            }
            results[(case, f"{dtype} {kernel}")] = errors
    # traffic of one forward + backward (fp32): (cp-1) K/V blocks forward, (cp-1) K/V blocks and
    # (cp-1) dK/dV blocks backward; CommCounter counts each message once, at its sender
    from modelcarve.runtime.measure.metrics import CommCounter

    x = torch.randn(2, 4, 8, 16, requires_grad=True)
    kv = torch.randn(2, 2, 8, 16, requires_grad=True)
    with CommCounter() as comm:
        ring_attention(x, kv, kv, group).sum().backward()
    block = 2 * 2 * 8 * (16 + 16) * 4
    results["bytes"] = (comm.bytes["send"], block * 3 * (world_size - 1))
    # the way around the refusal: pad at the end; causal, so no real token sees a pad
    gen = torch.Generator().manual_seed(7)
    real, padded = 4 * world_size - 1, 4 * world_size
    q, k, v = (torch.randn(1, 4, real, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    pad = [F.pad(t, (0, 0, 0, padded - real)) for t in (q, k, v)]
    local = ring_attention(*(zigzag_shard(t, 2, world_size, rank) for t in pad), group)
    pieces = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(pieces, local, group=group)
    results["padded"] = (zigzag_unshard(pieces, 2)[:, :, :real] - _reference(q, k, v)).abs().max().item()
    try:
        zigzag_shard(torch.zeros(1, 2 * world_size + 2), 1, world_size, rank)
        results["refusal"] = None
    except LayoutError as err:
        results["refusal"] = str(err)
    if world_size == 2:  # a peer that never joins the ring: a clear error within the timeout, no hang
        if rank == 0:
            try:
                x = torch.zeros(1, 2, 4, 4)
                ring_attention(x, x, x, group, timeout_s=2)
            except RuntimeError as err:
                results["timeout"] = str(err)
        else:
            time.sleep(3)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_matches_full_causal_attention(world_size):
    per_rank = run_distributed(_ring_worker, world_size, timeout=240)
    for rank, results in enumerate(per_rank):
        assert results["refusal"] is not None and f"2 x cp = {2 * world_size}" in results["refusal"]
        assert results["padded"] <= 1e-12, results["padded"]
        assert results["bytes"][0] == results["bytes"][1], results["bytes"]
        if world_size == 2 and rank == 0:
            assert "did not complete within 2s" in results.get("timeout", ""), results.get("timeout")
        for key, errors in results.items():
            if key in ("refusal", "timeout", "padded", "bytes"):
                continue
            case, dtype = key
            tol = 1e-12 if dtype.startswith("torch.float64") else 1e-5
            assert errors["repeat"] == 0, (rank, case, dtype, errors)
            for name in ("out", "dq", "dk", "dv"):
                assert errors[name] <= tol, (world_size, rank, case, dtype, name, errors)


def test_autocast_does_not_lower_the_math():
    """Under bf16 autocast the ring still computes in fp32 (its output equals the fp32 result)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8).to(torch.bfloat16) for _ in range(3))
    expect = ring_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ring_attention(q, k, v)
    assert torch.equal(got, expect)
