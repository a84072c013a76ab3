"""ZeRO-1 / ZeRO-2 as Megatron's distributed optimiser: reduce-scatter the gradients, step AdamW on
this rank's shard only, all-gather the updated parameters.

Layout of the state: the parameters of this rank's chunks are grouped by the group their
gradient is summed over (the ``dp x cp`` group, or what shards.py's ``record_grad_group`` says:
EP experts over their expert-data-parallel group) and dtype. Each such bucket is one flat
buffer of its parameters' *local* tensors (TP/EP shards are already local: they are simply
flattened as they are), in parameter order, padded with zeros to a multiple of the group size
``n``; rank ``r`` of the group owns the contiguous range ``[r s, (r+1) s)``, ``s = padded / n``.
The rank keeps an fp32 master copy of its range (a 1-D tensor, refreshed from the parameters
at each step, so a checkpoint load into the parameters is seen) and one ``torch.optim.AdamW``
over all its ranges: AdamW is elementwise (plus one step counter per tensor), so stepping the
flat range is the per-parameter AdamW of the single-device reference, element for element.

Per step and bucket, over the bucket's group (``n`` ranks, ``S`` padded bytes):

* ``reduce``: copy the local gradients into the flat buffer, ``reduce_scatter_tensor`` (SUM):
  payload ``S``, wire ``(n-1)/n S`` per rank. HSDP-style ZeRO (``dp_shard < dp``): the
  reduce-scatter runs in each shard group and the owned range is then all-reduced over the
  replicate group (payload ``S / n_shard``).
* ``step``: AdamW on the owned range, then ``all_gather_into_tensor`` of the updated range over
  the (shard) group: payload ``S``, wire ``(n-1)/n S``; the result is copied into the parameters.

So DP traffic is one gradient reduction's worth (``2 (n-1)/n S`` in all, equal to one ring
all-reduce), not the old all-reduce + ``ZeroRedundancyOptimizer`` broadcast (2x).

ZeRO-1 keeps the whole flat gradient buffer: after ``reduce`` each ``p.grad`` is a view of it
(the owned range holds the reduced sum, the rest this rank's own unreduced contribution), so
scaling ``p.grad`` (train.py's 1/(dp x cp) after a pipeline step) scales the owned range too.
ZeRO-2 frees every ``p.grad`` after the reduce-scatter and keeps only the owned range (4 P / n
bytes); because train.py's post-pipeline scaling then finds no gradient, the 1/(dp x cp) of a
pipeline step is applied here (``reduce(scale=...)``). The backward itself still accumulates
full local gradients (freed at the reduce): the peak gradient memory is not reduced, only what
is held from the reduction to the step.

``full_gradients()`` (verify only: extra traffic) all-gathers the reduced owned ranges so that
every ``p.grad`` holds the full reduced gradient. ``checkpoint_view()`` gives the checkpoint code
a per-parameter AdamW state of full local shapes (all-gathered); what a load writes into it is
taken back into the owned ranges at the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelcarve.runtime.distributed.primitives import gather_flat, reduce_scatter_tensor


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _Bucket:
    """The parameters reduced over one group, flattened; this rank's owned range of them."""

    def __init__(self, entries, group, replicate, dtype, device):
        self.entries = entries  # [(chunk, fqn, param, offset)]
        self.group, self.replicate = group, replicate
        self.n = _size(group)
        total = sum(p.numel() for _, _, p, _ in entries)
        self.padded = -(-total // self.n) * self.n
        self.shard = self.padded // self.n
        self.rank = 0 if group is None or self.n == 1 else dist.get_rank(group)
        self.lo, self.hi = self.rank * self.shard, (self.rank + 1) * self.shard
        self.dtype, self.device = dtype, device
        self.master = torch.zeros(self.shard, dtype=torch.float32, device=device)
        self.flat_grad: torch.Tensor | None = None

    def owned(self):
        """(param, start in param, start in owned range, length) of each piece this rank owns."""
        for _, _, p, off in self.entries:
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                yield p, a - off, a - self.lo, b - a

    @torch.no_grad()
    def refresh_master(self) -> None:
        for p, ps, ms, k in self.owned():
            self.master[ms : ms + k].copy_(p.detach().reshape(-1)[ps : ps + k])

    @torch.no_grad()
    def flatten_grads(self) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for _, _, p, off in self.entries:
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
        return flat


class ShardedAdamW:
    """AdamW sharded over the data-parallel ranks (ZeRO ``stage`` 1 or 2); see the module doc."""

    def __init__(self, chunks, groups, stage: int, **adamw):
        """``groups``: ``[(chunk, fqn, param, group, replicate_group)]`` in parameter order."""
        self.stage = stage
        by_key: dict = {}
        for chunk, fqn, p, group, replicate in groups:
            key = (id(group), id(replicate), p.dtype, p.device)
            by_key.setdefault(key, (group, replicate, p.dtype, p.device, []))[4].append((chunk, fqn, p))
        self.buckets = []
        for group, replicate, dtype, device, items in by_key.values():
            entries, off = [], 0
            for chunk, fqn, p in items:
                entries.append((chunk, fqn, p, off))
                off += p.numel()
            self.buckets.append(_Bucket(entries, group, replicate, dtype, device))
        for b in self.buckets:
            b.refresh_master()
        self.optim = torch.optim.AdamW([b.master for b in self.buckets], **adamw)
        self._view = None

    # --- what train.py / the checkpoint code / the memory report read ----------------------

    @property
    def param_groups(self) -> list:
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        return self.optim.state

    def held_grad_bytes(self) -> int:
        """Gradient bytes held only here (ZeRO-2's owned ranges; ZeRO-1's alias ``p.grad``)."""
        if self.stage == 1:
            return 0
        return sum(b.master.grad.numel() * b.master.grad.element_size() for b in self.buckets
                   if b.master.grad is not None)

    # --- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self, scale: float | None = None) -> None:
        """Reduce-scatter every bucket's gradients (see the module doc); collective."""
        for b in self.buckets:
            flat = b.flatten_grads()
            if b.n > 1:
                out = torch.empty(b.shard, dtype=b.dtype, device=b.device)
                reduce_scatter_tensor(out, flat, group=b.group)
                flat[b.lo : b.hi].copy_(out)
                del out
            if _size(b.replicate) > 1:
                owned = flat[b.lo : b.hi].contiguous()
                dist.all_reduce(owned, group=b.replicate)
                flat[b.lo : b.hi].copy_(owned)
            if self.stage == 1:
                b.flat_grad = flat
                for _, _, p, off in b.entries:
                    p.grad = flat[off : off + p.numel()].view_as(p)
                b.master.grad = flat[b.lo : b.hi].view(-1) if b.dtype == torch.float32 else None
                if b.master.grad is None:  # pragma: no cover - fp32 gradients only (spec/support.py)
                    b.master.grad = flat[b.lo : b.hi].float()
            else:
                b.master.grad = flat[b.lo : b.hi].to(torch.float32, copy=True)
                if scale is not None:
                    b.master.grad.mul_(scale)
                for _, _, p, _ in b.entries:
                    p.grad = None
                del flat

    def owned_grad_pieces(self):
        """(chunk, fqn, param, group size, owned gradient piece) of every piece this rank owns."""
        for b in self.buckets:
            if b.master.grad is None:
                continue
            by_param = {id(p): (chunk, fqn) for chunk, fqn, p, _ in b.entries}
            for p, _, ms, k in b.owned():
                chunk, fqn = by_param[id(p)]
                yield chunk, fqn, p, b.n, b.master.grad[ms : ms + k]

    @torch.no_grad()
    def step(self) -> None:
        self._adopt_view()
        for b in self.buckets:
            b.refresh_master()
            if b.master.grad is None:
                b.master.grad = torch.zeros_like(b.master)
        self.optim.step()
        for b in self.buckets:
            full = gather_flat(b.master, b.group)  # fp32, b.padded elements
            for _, _, p, off in b.entries:
                p.detach().copy_(full[off : off + p.numel()].view_as(p))
            del full

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.flat_grad = None
            b.master.grad = None
            for _, _, p, _ in b.entries:
                p.grad = None

    # --- verify and checkpoints (extra traffic, off the training path) --------------------

    @torch.no_grad()
    def full_gradients(self) -> None:
        """Every ``p.grad`` made the full reduced gradient (all-gather of the owned ranges)."""
        for b in self.buckets:
            if b.master.grad is None:
                continue
            full = gather_flat(b.master.grad, b.group)  # fp32 (master.grad always is), b.padded elements
            for _, _, p, off in b.entries:
                p.grad = full[off : off + p.numel()].view_as(p).to(b.dtype)

    def checkpoint_view(self) -> torch.optim.Optimizer:
        """A plain AdamW over the model's parameters whose state (if any) is the full local
        state, all-gathered (collective); the next ``step`` takes its owned ranges back. The same
        view is returned until then (the checkpoint code asks for it more than once per load)."""
        if self._view is not None:
            return self._view
        params = [p for b in self.buckets for _, _, p, _ in b.entries]
        keep = ("lr", "betas", "eps", "weight_decay")
        view = torch.optim.AdamW(params, **{k: v for k, v in self.optim.defaults.items() if k in keep})
        view.param_groups[0]["lr"] = self.optim.param_groups[0]["lr"]
        for b in self.buckets:
            state = self.optim.state.get(b.master)
            if not state:
                continue
            moments = {k: gather_flat(state[k], b.group) for k in ("exp_avg", "exp_avg_sq")}
            for _, _, p, off in b.entries:
                view.state[p] = dict(step=state["step"].clone(),
                                     **{k: m[off : off + p.numel()].view_as(p).clone() for k, m in moments.items()})
        self._view = view
        return view

    @torch.no_grad()
    def _adopt_view(self) -> None:
        view, self._view = self._view, None
        if view is None:
            return
        for b in self.buckets:
            pieces = [(view.state.get(p), ps, ms, k) for p, ps, ms, k in b.owned()]
            if not pieces or any(not s for s, *_ in pieces):
                continue
            state = self.optim.state[b.master]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(b.master),
                             exp_avg_sq=torch.zeros_like(b.master))
            state["step"] = pieces[0][0]["step"].clone().float()
            for s, ps, ms, k in pieces:
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key][ms : ms + k].copy_(s[key].reshape(-1)[ps : ps + k])
