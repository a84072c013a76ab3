"""Ring attention: exact causal attention over a sequence split across a context-parallel group.

Hand-written (no DTensor, no ``torch.distributed.tensor.experimental.context_parallel``):
PyTorch's own context parallelism has no CPU sharding rule for SDPA, so it cannot run on
gloo. This file owns the math and the ring; ``context.py`` plugs it into the model.

Zig-zag layout
--------------
A sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``c = S / (2 cp)`` tokens; cp rank
``i`` holds chunks ``i`` and ``2cp-1-i`` in that order (its local sequence is ``2c`` long and
its positions increase). Under a causal mask every rank then does the same amount of work,
which the plain contiguous split does not (the last rank would attend to everything, the
first to one chunk). Lengths not divisible by ``2 * cp`` are refused with a ``LayoutError``,
as ``Layout.validate`` refuses them.

The ring
--------
Step ``t = 0 .. cp-1``: rank ``i`` holds the K/V of rank ``j = (i - t) mod cp`` and computes a
partial result for its queries against those keys; meanwhile it already sends that block to
rank ``i+1`` and receives the next one from ``i-1`` (point-to-point ``isend``/``irecv`` issued
through ``batch_isend_irecv``, so the transfer overlaps the compute). With the zig-zag order,
only three block shapes occur:

* ``j == i``: the local block, causal; the first query chunk never sees the second kv chunk,
  so it is three tiles (two causal diagonal ones and one full) and the masked quarter is skipped;
* ``j <  i``: every local query sees the first kv chunk (chunk ``j``) completely, the second
  kv chunk (``2cp-1-j``) not at all;
* ``j >  i``: only the second local query chunk (``2cp-1-i``) sees the kv block, completely.

Partial results are merged with the online-softmax rule: each block gives ``(out_b, lse_b)``
with ``lse_b = logsumexp`` of its scores per query row; the running ``(out, lse)`` becomes
``lse' = logaddexp(lse, lse_b)``, ``out' = out e^(lse-lse') + out_b e^(lse_b-lse')``.

Backward (exact, not approximated): with the final ``out`` and ``lse`` saved, each block's
softmax is recomputed as ``p = exp(s - lse)``; ``dV_b = p^T dO``, ``dS = p (dO V_b^T - D)``
with ``D = rowsum(dO * O)``, ``dQ += dS K_b * scale``, ``dK_b = dS^T Q * scale``. The dK/dV of
a block belong to the rank that owns it, so an fp32 accumulator travels the ring with the
K/V: after ``cp`` hops it is back home holding the sum over all query ranks. Both the next
K/V block and the accumulator of the block being worked on are in flight during the compute.

GQA/MQA: queries are viewed as ``[b, kv_heads, group, s, d]`` so K/V travel unexpanded and
dK/dV come out summed over each group. ``d_v`` may differ from ``d_qk`` (MLA). Math runs in
fp32 (fp64 for fp64 inputs) whatever the input dtype; the output is cast back.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from modelcarve.spec.errors import LayoutError

DEFAULT_TIMEOUT_S = 300.0
_TAG_KV, _TAG_DKV = 0, 1


# --- zig-zag sharding ---------------------------------------------------------------------
def check_divisible(seq_len: int, cp: int) -> None:
    """Refuse a sequence the zig-zag layout cannot split evenly (same rule as Layout.validate)."""
    if cp < 1:
        raise LayoutError(f"cp={cp} must be at least 1")
    if seq_len % (2 * cp):
        lower = seq_len // (2 * cp) * (2 * cp)
        upper = lower + 2 * cp
        hint = f"seq={lower} or seq={upper}" if lower else f"seq={upper}"
        raise LayoutError(
            f"seq={seq_len} is not a multiple of 2 x cp = {2 * cp} (zig-zag ring attention chunks); "
            f"use {hint}, or pad each sequence at the end (under the causal mask no real token sees a "
            f"later pad) and leave the pads out of the loss"
        )


def zigzag_indices(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Absolute positions [seq_len / cp] held by ``cp_rank``: chunk ``cp_rank`` then chunk ``2cp-1-cp_rank``."""
    check_divisible(seq_len, cp)
    if not 0 <= cp_rank < cp:
        raise LayoutError(f"cp rank {cp_rank} is outside 0..{cp - 1}")
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's zig-zag piece of ``x`` along ``dim`` (a copy, contiguous)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, cp_rank, device=x.device))


def zigzag_unshard(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: ``pieces[r]`` is rank r's piece; returns the full sequence."""
    cp = len(pieces)
    halves = [p.chunk(2, dim=dim) for p in pieces]
    ordered = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)


# --- the ring -----------------------------------------------------------------------------
class _Ring:
    """Send to the next rank of ``group``, receive from the previous one; ``group=None`` is one rank."""

    def __init__(self, group, timeout_s: float):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.timeout = timedelta(seconds=timeout_s)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor, tag: int) -> "_Transfer":
        send = send.contiguous()
        recv = torch.empty_like(send)
        # batch_isend_irecv (not bare isend/irecv) so that metrics.CommCounter sees the bytes
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ])
        return _Transfer(self, send, recv, works)


class _Transfer:
    def __init__(self, ring: _Ring, send: torch.Tensor, recv: torch.Tensor, works):
        self.ring, self.send, self.recv, self.works = ring, send, recv, works

    def wait(self) -> torch.Tensor:
        try:
            for work in self.works:
                work.wait(self.ring.timeout)
        except RuntimeError as err:
            r = self.ring
            raise RuntimeError(
                f"ring attention: cp rank {r.rank}'s exchange with global ranks {r.next} (send) and {r.prev} "
                f"(receive) did not complete within {r.timeout.total_seconds():.0f}s (a peer died, or the ranks "
                f"disagree on the number of attention calls): {err}"
            ) from err
        return self.recv


# --- one block ----------------------------------------------------------------------------
def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q5 [b, hkv, g, sq, d] x k [b, hkv, sk, d] -> scores [b, hkv, g, sq, sk], causal-masked."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(1 + sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q5, k, v, scale, causal):
    s = _scores(q5, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Online-softmax merge of a block result into the running (out, lse), in place."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q5, k, v, dout, lse, delta, scale, causal):
    """Gradients of one block given the FINAL lse and delta = rowsum(dO * O) of its query rows."""
    p = torch.exp(_scores(q5, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(dim=2) * scale
    return dq, dk, dv


def _tiles(src: int, rank: int, c: int):
    """The (query rows, kv columns, causal) tiles a kv block from rank ``src`` contributes to.

    Local sequences are two chunks of ``c`` tokens (zig-zag). On the diagonal the first query
    chunk never sees the second kv chunk, so that quarter is skipped, not computed and masked."""
    first, second, every = slice(0, c), slice(c, None), slice(None)
    if src == rank:
        return [(first, first, True), (second, first, False), (second, second, True)]
    if src < rank:
        return [(every, first, False)]
    return [(second, every, False)]


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (so gradcheck sees exact math)."""
    return torch.promote_types(x.dtype, torch.float32)


# --- autograd -----------------------------------------------------------------------------
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float):
        with torch.autocast(q.device.type, enabled=False):  # our fp32 math, not autocast's bf16
            return _RingAttention._forward(ctx, q, k, v, ring, scale)

    @staticmethod
    def _forward(ctx, q, k, v, ring: _Ring, scale: float):
        b, hq, s, dqk = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        c = s // 2
        acc = _acc_dtype(q)
        q5 = q.to(acc).reshape(b, hkv, hq // hkv, s, dqk)
        kv = torch.cat([k, v], dim=-1)  # one message per hop; d_v may differ from d_qk
        out = torch.zeros(b, hkv, hq // hkv, s, dv, dtype=acc, device=q.device)
        lse = torch.full((b, hkv, hq // hkv, s), float("-inf"), dtype=acc, device=q.device)
        for step in range(ring.size):
            transfer = ring.start(kv, _TAG_KV) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            kf, vf = kv.to(acc).split([dqk, dv], dim=-1)
            for rows, cols, causal in _tiles(src, ring.rank, c):
                out_b, lse_b = _block_forward(q5[..., rows, :], kf[..., cols, :], vf[..., cols, :], scale, causal)
                _merge(out[..., rows, :], lse[..., rows], out_b, lse_b)
            if transfer is not None:
                kv = transfer.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.reshape(b, hq, s, dv).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        b, hq, s, dqk = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        c = s // 2
        acc = _acc_dtype(q)
        q5 = q.to(acc).reshape(b, hkv, hq // hkv, s, dqk)
        dout = grad_out.to(acc).reshape(b, hkv, hq // hkv, s, dv)
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(q5)
        kv = torch.cat([k, v], dim=-1)
        # The dK/dV accumulator of a block travels the ring with it (cp hops in all, so it ends
        # at the block's owner); the one for this step's block arrives while we compute.
        dkv_transfer = None
        for step in range(ring.size):
            transfer = ring.start(kv, _TAG_KV) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            kf, vf = kv.to(acc).split([dqk, dv], dim=-1)
            grad_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for rows, cols, causal in _tiles(src, ring.rank, c):
                dq_b, dk_b, dv_b = _block_backward(
                    q5[..., rows, :], kf[..., cols, :], vf[..., cols, :],
                    dout[..., rows, :], lse[..., rows], delta[..., rows], scale, causal,
                )
                dq[..., rows, :] += dq_b
                grad_kv[..., cols, :dqk] += dk_b
                grad_kv[..., cols, dqk:] += dv_b
            # step 0 is our own block's first contribution; later ones add to the arriving sum
            dkv = grad_kv if dkv_transfer is None else dkv_transfer.wait().add_(grad_kv)
            if ring.size > 1:
                dkv_transfer = ring.start(dkv, _TAG_DKV)
            if transfer is not None:
                kv = transfer.wait()
        if dkv_transfer is not None:
            dkv = dkv_transfer.wait()
        dk, dvv = dkv.split([dqk, dv], dim=-1)
        return dq.reshape(b, hq, s, dqk).to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    scale: float | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag piece of the sequence against the whole sequence.

    q [b, heads, s_local, d_qk], k [b, kv_heads, s_local, d_qk], v [b, kv_heads, s_local, d_v],
    each this cp rank's zig-zag piece (``zigzag_shard``); ``group`` the cp process group (None:
    one rank, plain causal attention). Returns [b, heads, s_local, d_v]. Every rank of the
    group must call it the same number of times, in the same order (forward and backward).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention wants [b, heads, s, d] tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"ring_attention: mismatched shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    ring = _Ring(group, timeout_s)
    if q.shape[2] % 2:
        raise LayoutError(
            f"ring attention got {q.shape[2]} local tokens, not two equal zig-zag chunks; the full sequence "
            f"must be a multiple of 2 x cp = {2 * ring.size} (shard it with zigzag_shard)"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, ring, scale)
