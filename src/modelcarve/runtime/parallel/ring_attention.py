"""Ring attention: exact causal attention over a sequence split across a context-parallel group.

Hand-written (no DTensor, no ``torch.distributed.tensor.experimental.context_parallel``):
PyTorch's own context parallelism has no CPU sharding rule for SDPA, so it cannot run on
gloo. This file owns the math and the ring; ``context.py`` plugs it into the model.

Zig-zag layout (runtime/distributed/zigzag.py)
----------------------------------
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
a block belong to the rank that owns it, so an fp32 accumulator follows the K/V round the
ring, from the first rank after the owner to the last, and then hops home (``cp - 1`` hops),
where the owner adds its own part. Both the next K/V block and the accumulator of the block
being worked on are in flight during the compute. Sent per rank and attention call: forward
``cp - 1`` K/V blocks; backward ``cp - 1`` K/V blocks and ``cp - 1`` fp32 dK/dV blocks.

Tiles are computed by one of two kernels with the same contract (out and log-sum-exp forward;
dQ, dK, dV backward from the final out and lse): ``math`` writes the formulas above out (any
device; the reference), ``flash`` calls torch's fused CPU flash-attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward; several times faster,
see benchmarks/ring_attention.py). ``auto`` picks flash on CPU, and on ``meta`` (the full-scale
dry run, runtime/dryrun/rank_programs.py: torch's meta kernel of the fused op gives the tile's
shapes in one op instead of the written-out math's dozen; tiles exchange nothing, so the ring's
messages are the same with either kernel).

GQA/MQA: K/V travel the ring with their kv heads only; each step expands the received block to
the query heads and folds dK/dV back by summing over each group. ``d_v`` may differ from
``d_qk`` (MLA). Tiles run in fp32 (fp64 for fp64 inputs) whatever the input dtype, also under
autocast; the output is cast back.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelcarve.spec.errors import LayoutError

DEFAULT_TIMEOUT_S = 300.0
_TAG_KV, _TAG_DKV = 0, 1


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
        # batch_isend_irecv: the send and the receive of a hop are posted together
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


# --- one tile: q [b, h, sq, d] against k [b, h, sk, d], v [b, h, sk, dv] --------------------
def _math_forward(q, k, v, scale, causal):
    """(out, lse) of one tile, written out (any device and dtype; the reference for the kernel)."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _math_backward(q, k, v, dout, out, lse, scale, causal):
    """(dq, dk, dv) of one tile given the FINAL out and lse of its query rows."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, torch.matmul(p.transpose(-1, -2), dout)


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # tiles on the diagonal are square: plain lower-triangular mask
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _same_head_dim(*tensors):
    """The CPU flash kernel wants one head size for q, k and v: zero-pad the smaller ones (MLA has
    d_v < d_qk). Zero columns change no score and give zero output columns, sliced off after."""
    size = max(t.shape[-1] for t in tensors)
    return [t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1])) for t in tensors]


def _flash_forward(q, k, v, scale, causal):
    """(out, lse) of one tile by torch's fused CPU flash-attention kernel (several times faster
    than the written-out math; same results to rounding, tests/runtime/test_ring_attention.py)."""
    dv = v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[..., :dv], lse


def _flash_backward(q, k, v, dout, out, lse, scale, causal):
    dqk, dv = q.shape[-1], v.shape[-1]
    q, k, v, dout, out = _same_head_dim(q, k, v, dout, out)
    dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]


KERNELS = {"math": (_math_forward, _math_backward), "flash": (_flash_forward, _flash_backward)}


def _kernel(name: str, x: torch.Tensor):
    if name == "auto":
        fused = x.device.type in ("cpu", "meta") and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        name = "flash" if fused else "math"
    if name not in KERNELS:
        raise ValueError(f"ring attention kernel {name!r} is not one of auto, {', '.join(KERNELS)}")
    return KERNELS[name]


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Online-softmax merge of a tile result into the running (out, lse), in place."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


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


def _autocast_off(x: torch.Tensor):
    """Autocast off for ``x``'s device; nothing on ``meta`` (no autocast there: the full-scale dry run)."""
    if x.device.type == "meta":
        import contextlib

        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


# --- autograd -----------------------------------------------------------------------------
def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads -> query heads (query head j reads kv head j // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient w.r.t. expanded kv heads -> per kv head (sum over each group)."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, kernel: str):
        with _autocast_off(q):  # our fp32 math, not autocast's bf16
            return _RingAttention._forward(ctx, q, k, v, ring, scale, kernel)

    @staticmethod
    def _forward(ctx, q, k, v, ring: _Ring, scale: float, kernel: str):
        b, hq, s, dqk = q.shape
        groups, dv, c = hq // k.shape[1], v.shape[-1], s // 2
        acc = _acc_dtype(q)
        tile_forward, _ = _kernel(kernel, q)
        qa = q.to(acc)
        kv = torch.cat([k, v], dim=-1)  # one message per hop; d_v may differ from d_qk
        out = torch.zeros(b, hq, s, dv, dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
        for step in range(ring.size):
            transfer = ring.start(kv, _TAG_KV) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            kf, vf = _expand(kv.to(acc), groups).split([dqk, dv], dim=-1)
            for rows, cols, causal in _tiles(src, ring.rank, c):
                out_b, lse_b = tile_forward(qa[..., rows, :], kf[..., cols, :], vf[..., cols, :], scale, causal)
                _merge(out[..., rows, :], lse[..., rows], out_b, lse_b)
            if transfer is not None:
                kv = transfer.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with _autocast_off(grad_out):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        s, dqk = q.shape[2:]
        groups, dv, c = q.shape[1] // k.shape[1], v.shape[-1], s // 2
        acc = _acc_dtype(q)
        _, tile_backward = _kernel(ctx.kernel, q)
        qa, dout = q.to(acc), grad_out.to(acc)
        dq = torch.zeros_like(qa)
        kv = torch.cat([k, v], dim=-1)
        # The dK/dV accumulator of a block follows it round the ring from its first non-owner to
        # its last, then hops home (cp - 1 hops); the owner adds its own part at the end. The
        # accumulator for this step's block arrives while we compute.
        own = dkv_transfer = None
        for step in range(ring.size):
            transfer = ring.start(kv, _TAG_KV) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            kf, vf = _expand(kv.to(acc), groups).split([dqk, dv], dim=-1)
            grad_kv = torch.zeros(kf.shape[:-1] + (dqk + dv,), dtype=acc, device=kv.device)
            for rows, cols, causal in _tiles(src, ring.rank, c):
                dq_b, dk_b, dv_b = tile_backward(
                    qa[..., rows, :], kf[..., cols, :], vf[..., cols, :],
                    dout[..., rows, :], out[..., rows, :], lse[..., rows], scale, causal,
                )
                dq[..., rows, :] += dq_b
                grad_kv[..., cols, :dqk] += dk_b
                grad_kv[..., cols, dqk:] += dv_b
            grad_kv = _fold(grad_kv, groups)
            if step == 0:
                own = grad_kv
            else:
                dkv = grad_kv if dkv_transfer is None else dkv_transfer.wait().add_(grad_kv)
                dkv_transfer = ring.start(dkv, _TAG_DKV)
            if transfer is not None:
                kv = transfer.wait()
        dkv = own if dkv_transfer is None else dkv_transfer.wait().add_(own)
        dk, dvv = dkv.split([dqk, dv], dim=-1)
        return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    scale: float | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag piece of the sequence against the whole sequence.

    q [b, heads, s_local, d_qk], k [b, kv_heads, s_local, d_qk], v [b, kv_heads, s_local, d_v],
    each this cp rank's zig-zag piece (``zigzag_shard``); ``group`` the cp process group (None:
    one rank, plain causal attention). Returns [b, heads, s_local, d_v]. Every rank of the
    group must call it the same number of times, in the same order (forward and backward).
    ``kernel``: how each tile is computed: "math" (written out, any device), "flash" (torch's
    fused CPU kernel), "auto" (flash on CPU, else math).
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
    _kernel(kernel, q)  # an unknown name fails here, not inside autograd
    return _RingAttention.apply(q, k, v, ring, scale, kernel)
