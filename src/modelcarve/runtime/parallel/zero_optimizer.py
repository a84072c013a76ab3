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

Mixed precision (``param_dtype``: bf16, as Megatron's distributed optimiser): the model's
parameters are cast to bf16 once the fp32 master ranges are taken from them; the master ranges
are then the only full-precision weights (never refreshed from the parameters) and each step
copies the all-gathered fp32 result into the bf16 parameters. Gradients are accumulated in fp32
(``grad_dtype``): a post-accumulate-grad hook adds each parameter's bf16 micro-batch gradient
into the bucket's fp32 flat buffer (Megatron's ``main_grad``) and frees it; under a pipeline the
hook also applies torch's ``scale_grads`` 1/micro-batches, which then finds no ``.grad``.
Parameters named in ``unhooked`` (a pipeline's tied embedding copies, whose gradient
pipeline.py sums across stages) keep their ``.grad``, folded into the flat buffer at ``reduce``.
``master_params()`` gives the checkpoint code the fp32 weights of full local shapes
(all-gathered) to save and load in place of the bf16 parameters; ``after_load()`` takes a loaded
state back into the master ranges and the parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from modelcarve.runtime.distributed.primitives import gather_flat, reduce_scatter_tensor


def _reduce_owned(b, flat: torch.Tensor) -> None:
    """Sum bucket ``b``'s flat gradients over its shard group into this rank's owned range
    ``[lo, hi)`` (reduce-scatter), then over its replicas (HSDP-style all-reduce of that range)."""
    if b.n > 1:
        out = torch.empty(b.shard, dtype=b.dtype, device=b.device)
        reduce_scatter_tensor(out, flat, group=b.group)
        flat[b.lo : b.hi].copy_(out)
        del out
    if _size(b.replicate) > 1:
        owned = flat[b.lo : b.hi].contiguous()
        dist.all_reduce(owned, group=b.replicate)
        flat[b.lo : b.hi].copy_(owned)


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
        self.dtype, self.device = dtype, device  # the gradient buffer's dtype (fp32 under mixed precision)
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

    def __init__(self, chunks, groups, stage: int, param_dtype: torch.dtype | None = None,
                 grad_scale: float = 1.0, unhooked: frozenset = frozenset(), **adamw):
        """``groups``: ``[(chunk, fqn, param, group, replicate_group)]`` in parameter order;
        ``param_dtype``: the model's parameters are cast to it (mixed precision, module doc);
        ``grad_scale``: what the accumulation hook multiplies each gradient by."""
        self.stage = stage
        self.mixed = param_dtype is not None and param_dtype != torch.float32
        by_key: dict = {}
        for chunk, fqn, p, group, replicate in groups:
            dtype = torch.float32 if self.mixed else p.dtype
            key = (id(group), id(replicate), dtype, p.device)
            by_key.setdefault(key, (group, replicate, dtype, p.device, []))[4].append((chunk, fqn, p))
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
        self._view_masters: dict | None = None
        if self.mixed:
            self._to_low_precision(param_dtype, grad_scale, unhooked)

    @torch.no_grad()
    def _to_low_precision(self, dtype, grad_scale: float, unhooked) -> None:
        """Cast the parameters to ``dtype`` (the masters hold fp32) and hook fp32 accumulation."""
        seen = set()
        for b in self.buckets:
            for _, _, p, off in b.entries:
                if id(p) not in seen:
                    seen.add(id(p))
                    p.data = p.data.to(dtype)
                if id(p) not in unhooked:
                    p.register_post_accumulate_grad_hook(self._accumulate_hook(b, off, grad_scale))

    @staticmethod
    def _accumulate_hook(b, off: int, grad_scale: float):
        def hook(p):
            with torch.no_grad():
                if b.flat_grad is None:
                    b.flat_grad = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                piece = b.flat_grad[off : off + p.numel()]
                if grad_scale == 1.0:
                    piece.add_(p.grad.reshape(-1))
                else:
                    piece.add_(p.grad.reshape(-1), alpha=grad_scale)
                p.grad = None
        return hook

    def grad_of(self, p) -> torch.Tensor | None:
        """The fp32 accumulated gradient of ``p`` (a view of the flat buffer), mixed precision only."""
        if not self.mixed:
            return None
        for b in self.buckets:
            for _, _, q, off in b.entries:
                if q is p:
                    if b.flat_grad is None:
                        b.flat_grad = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                    return b.flat_grad[off : off + p.numel()].view(p.shape)
        return None

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
            if not self.mixed:
                return 0
            return sum(b.flat_grad.numel() * b.flat_grad.element_size() for b in self.buckets
                       if b.flat_grad is not None)
        return sum(b.master.grad.numel() * b.master.grad.element_size() for b in self.buckets
                   if b.master.grad is not None)

    # --- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self, scale: float | None = None) -> None:
        """Reduce-scatter every bucket's gradients (see the module doc); collective."""
        for b in self.buckets:
            if self.mixed:
                self._reduce_mixed(b, scale)
                continue
            flat = b.flatten_grads()
            _reduce_owned(b, flat)
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

    @torch.no_grad()
    def _reduce_mixed(self, b, scale: float | None) -> None:
        """Mixed precision: reduce the fp32 flat buffer the hooks accumulated into (module doc)."""
        if b.flat_grad is None:
            b.flat_grad = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
        flat = b.flat_grad
        for _, _, p, off in b.entries:  # unhooked parameters (tied copies) still hold .grad
            if p.grad is not None:
                flat[off : off + p.numel()].add_(p.grad.reshape(-1))
                p.grad = None
        _reduce_owned(b, flat)
        if scale is not None:
            flat[b.lo : b.hi].mul_(scale)
        if self.stage == 1:
            b.master.grad = flat[b.lo : b.hi].view(-1)
        else:
            b.master.grad = flat[b.lo : b.hi].clone()
            b.flat_grad = None

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
            if not self.mixed:  # fp32: the parameters are the weights (a load writes into them)
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
            if self.mixed and self.stage == 1 and b.flat_grad is not None:
                b.flat_grad.zero_()  # ZeRO-1 keeps its fp32 gradient buffer (Megatron's main_grad)
            else:
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
                p.grad = full[off : off + p.numel()].view_as(p).to(p.dtype)

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

    def master_params(self) -> dict:
        """Mixed precision: ``{id(param): its fp32 master weights of the parameter's local shape}``,
        all-gathered (collective), what a checkpoint saves and loads as the model's weights; the
        same tensors until the next step or ``after_load``. Empty with fp32 parameters."""
        if not self.mixed:
            return {}
        if self._view_masters is None:
            masters = {}
            for b in self.buckets:
                full = gather_flat(b.master, b.group)
                for _, _, p, off in b.entries:
                    masters[id(p)] = full[off : off + p.numel()].view(p.shape).clone()
                del full
            self._view_masters = masters
        return self._view_masters

    @torch.no_grad()
    def after_load(self) -> None:
        """A checkpoint was loaded into ``master_params()``: take it into the master ranges and
        the low-precision parameters (the moments are taken at the next step)."""
        masters, self._view_masters = self._view_masters, None
        if not masters:
            return
        for b in self.buckets:
            for p, ps, ms, k in b.owned():
                b.master[ms : ms + k].copy_(masters[id(p)].reshape(-1)[ps : ps + k])
            for _, _, p, _ in b.entries:
                p.detach().copy_(masters[id(p)])

    @torch.no_grad()
    def _adopt_view(self) -> None:
        view, self._view = self._view, None
        self._view_masters = None
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
