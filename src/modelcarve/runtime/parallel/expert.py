"""Expert parallelism for the MoE blocks of the reference model: groups, all-to-all dispatch, options, stats.

Hand-written on ``torch.distributed.all_to_all_single``: PyTorch has no MoE token dispatcher,
and the expert weights stay plain local tensors so TP, the pipeline and FSDP/DDP see ordinary
parameters (their shards are declared through shards.py's ``record_shard``). Expert tensor
parallelism (expert TP = TP, spec/layout.py: each expert's ``w1/w3`` split by columns and ``w2``
by rows over ``tp``) is tensor.py's, applied before this module runs.

Groups (spec/layout.py): the EP group is carved from the ``dp x cp`` ranks with the same pp and
tp coordinates. With ``f = dp_i * cp + cp_i`` (0 .. dp*cp-1), the EP group holds the ranks with
the same ``f // ep`` (consecutive, as in Megatron-Core) and the EP rank is ``f % ep``; the
expert-data-parallel group (``dp * cp / ep`` ranks that hold the same experts) is the ranks
with the same ``f % ep``. EP rank r holds experts ``[r E/ep, (r+1) E/ep)``.

MoE parallel folding (``layout.folded``: etp differs from tp, e.g. ``tp=2,dp=2,ep=4`` with etp 1):
the experts get their own mesh ETP x EP x EDP over the ``tp x cp x dp`` ranks of each stage
(``folded_groups``), tensor.py leaves the MoE blocks whole and ``_apply_folded`` spreads them:
each TP rank routes only its slice of the sequence, so the EP all-to-all may span TP ranks, and
``FoldedDispatcher`` runs expert TP over the ETP group after it.

One MoE forward under EP (``AllToAllDispatcher``), after the local router has grouped this rank's
(token, choice) assignments by global expert id (moe.py):

1. exchange the counts: ``all_to_all_single`` of the [ep, E/ep] count matrix, so every rank
   knows how many rows each peer sends to each of its experts (the split sizes);
2. ``all_to_all_single`` of the rows (uneven splits), regroup them by local expert, run the
   local experts, undo the regrouping;
3. ``all_to_all_single`` back with the splits swapped; moe.py scatters the rows to their
   (token, choice) slots and sums with the routing weights, in the original token order.

Both all-to-alls are autograd functions whose backward is the reverse all-to-all.

Gradient normalisation (train.py's contract: each rank back-propagates its token-loss sum
divided by the global token count, and gradients are SUMMED over the ranks holding a copy): an
expert's local gradient already holds the contributions of the whole EP group's tokens (the
all-to-all backward brought them), so it is summed over the expert-data-parallel group only
(``record_grad_group``; ZeRO-1 partitions their AdamW state over that group too; with FSDP2
the local experts are ``fully_shard``-ed over an expert-dp mesh instead, see data_parallel.py).

Data-dependent options (``configure_moe``, from TrainConfig): both are per sequence (moe.py);
with cp > 1 the capacity decision all-gathers the routing of the sequence over the cp group
(zig-zag order, context.py) and the aux loss sums its expert loads there; the aux gradient is
averaged over the sequences train.py's loss averages over.

Metrics: ``moe_step_stats`` sums the step's router counts over the data-parallel ranks
(tokens per expert over the global batch, dropped assignments), gathers the rows each rank's
experts received (tokens per rank) and reports the imbalance max/mean of both (the straggler
factor); it also applies the aux-loss-free bias update and resets the counters.
``exclude_shape_inference`` keeps torch.distributed.pipelining's placeholder forward out of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from modelcarve.runtime.model.moe import MoE, in_backward
from modelcarve.runtime.distributed.primitives import gather_cat, gather_parts, rank_piece, slice_param
from modelcarve.runtime.distributed.shards import record_grad_group, record_shard
from modelcarve.spec import ranks
from modelcarve.spec.errors import LayoutError

# --- autograd all-to-all ----------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows of x go to the group's ranks in ``send_splits``; ``recv_splits`` arrive (backward: reverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, send_splits, recv_splits, group)


class AllToAllDispatcher:
    """Sends each assignment row to the EP rank holding its expert and brings the results back.

    Installed as ``MoE.dispatcher``; called as ``(x_sorted, counts, experts) -> y_sorted`` with
    ``x_sorted`` grouped by global expert id and ``counts`` [E] the rows per expert.
    """

    def __init__(self, group, ep: int, ep_rank: int, num_experts: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.num_local = num_experts // ep
        self.received = torch.zeros(self.num_local, dtype=torch.int64)
        """Rows each local expert received this step (summed over micro-batches)."""
        self.record: list | None = None
        """Set to a list to keep (local expert counts, received rows grouped by expert) per call (tests)."""

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        send = counts.to(torch.int64).view(self.ep, self.num_local).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[src, e] = rows src sends to my expert e
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = all_to_all(x_sorted, send_splits, recv_splits, self.group)  # grouped by src, then expert
        local_expert = torch.arange(self.num_local, device=recv.device).repeat(self.ep)
        local_expert = local_expert.repeat_interleave(recv.flatten())
        by_expert = torch.argsort(local_expert, stable=True).to(rows.device)  # meta rows: the dry run's host counts
        local_counts = recv.sum(0)
        if not in_backward():  # not again when activation recomputation re-runs the forward
            self.received += local_counts.to(self.received.device)
        grouped = rows[by_expert]
        if self.record is not None:
            self.record.append((local_counts.clone(), grouped.detach().clone()))
        out = self.run_experts(grouped, local_counts, experts)
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        return all_to_all(back, recv_splits, send_splits, self.group)

    def run_experts(self, grouped: torch.Tensor, local_counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """The local experts on the rows they received (grouped by local expert)."""
        return experts(grouped, local_counts.tolist())


class FoldedDispatcher(AllToAllDispatcher):
    """The EP all-to-all of a folded expert mesh, then expert TP over the ETP group (etp > 1).

    The ``etp`` ranks of an ETP group hold the same experts, each a slice of every expert's ffn
    (``w1/w3`` columns, ``w2`` rows), and different tokens: each all-gathers the rows its peers
    received (an all-to-all sending its own rows to every peer: the row counts differ), runs its
    slices on all of them, and sends each peer the partial outputs of that peer's rows, which the
    peer sums (a reduce-scatter). Autograd runs both all-to-alls in reverse in backward."""

    def __init__(self, group, ep: int, ep_rank: int, num_experts: int, etp_group, etp: int):
        super().__init__(group, ep, ep_rank, num_experts)
        self.etp_group, self.etp = etp_group, etp

    def run_experts(self, grouped: torch.Tensor, local_counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        if self.etp == 1:
            return experts(grouped, local_counts.tolist())
        n, etp = grouped.shape[0], self.etp
        peers = gather_parts(local_counts, self.etp_group)
        sizes = [int(c.sum()) for c in peers]
        rows = all_to_all(grouped.repeat(etp, 1), [n] * etp, sizes, self.etp_group)  # by peer, then expert
        local = torch.arange(self.num_local, device=grouped.device)
        expert_of = torch.cat([local.repeat_interleave(c.to(grouped.device)) for c in peers])
        by_expert = torch.argsort(expert_of, stable=True)
        out = experts(rows[by_expert], torch.stack(peers).sum(0).tolist())
        partial = torch.empty_like(out).index_copy(0, by_expert, out)
        back = all_to_all(partial, sizes, [n] * etp, self.etp_group)  # my rows' partial outputs from each peer
        return back.view(etp, n, back.shape[-1]).sum(0)  # not -1: n may be 0 (no rows reached my experts)


class _ScatterTokens(torch.autograd.Function):
    """Keep this TP rank's slice of the sequence of a TP-replicated [b, s, H] (backward: all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return rank_piece(x, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_cat(grad, 1, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """All-gather the TP ranks' sequence slices (backward: this rank's slice of the replicated
    gradient: every TP rank holds the whole gradient of a replicated activation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return gather_cat(x, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return rank_piece(grad, 1, ctx.group), None


# --- groups -----------------------------------------------------------------------------

def expert_groups(mesh, layout) -> dict:
    """This rank's EP and expert-data-parallel groups (created once per mesh, on every rank)."""
    # kept on the mesh object: every rank builds the same meshes in the same order, so every rank
    # creates the groups (a collective) at the same point
    cache = mesh.__dict__.setdefault("_mc_expert_groups", {})
    key = (layout.pp, layout.dp, layout.cp, layout.tp, layout.ep)
    if key in cache:
        return cache[key]
    dpcp = layout.dp * layout.cp
    if not layout.folded and dpcp % layout.ep:
        valid = [d for d in range(1, dpcp + 1) if dpcp % d == 0]
        raise LayoutError(f"ep={layout.ep} must divide dp x cp = {dpcp}; valid ep: {valid}")
    cache[key] = me = folded_groups(layout)
    return me


def folded_groups(layout) -> dict:
    """This rank's groups on the expert mesh ETP x EP x EDP (spec/ranks.py: the one rank order)
    over each pipeline stage's ``S = tp x cp x dp`` ranks, ETP innermost. Unfolded (``etp = tp``,
    EP carved out of ``dp x cp``) is the same mesh, its ETP group being the TP group: no separate
    ETP group is made then (``etp_group`` None)."""
    from modelcarve.runtime.distributed.mesh import device_mesh, new_group

    etp, ep, edp = layout.expert_tp, layout.ep, layout.expert_dp
    at = ranks.expert_coords(layout, dist.get_rank())
    me = {"ep": ep, "ep_rank": at["ep"], "etp": etp, "etp_rank": at["etp"], "edp": edp,
          "edp_rank": at["edp"], "etp_group": None}
    axes = ("etp", "ep", "edp") if layout.folded and etp > 1 else ("ep", "edp")
    # every rank creates every group, in the same order (new_group is collective)
    for axis in axes:
        seen = set()
        for r in range(layout.world_size):
            members = ranks.expert_group_along(layout, r, axis)
            if members in seen:
                continue
            seen.add(members)
            group = new_group(list(members))
            if dist.get_rank() in members:
                me[f"{axis}_group"] = group
                if axis != "etp":
                    me[f"{axis}_ranks"] = list(members)
    if layout.zero == 3 and ep > 1:  # FSDP2 shards the local experts over expert-dp
        full = device_mesh((layout.pp, edp, ep, etp), ("_pp", "edp", "_ep", "_etp"))
        me["edp_mesh"] = full["edp"]
    return me


# --- applying EP / expert TP to a chunk --------------------------------------------------


def moe_blocks(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, MoE) pairs of a model chunk, FQNs as in the unsplit model's state dict."""
    return [(name, mod) for name, mod in chunk.named_modules() if isinstance(mod, MoE)]


def apply_expert_parallel(chunk: nn.Module, mesh, layout) -> nn.Module:
    """Spread the experts of every MoE block of ``chunk`` over the EP group, in place, and declare
    their shards (dim 0 over EP) and gradient group (expert-dp) for verify/reference.py / data_parallel.py.
    parallelize.py calls it when ep > 1 (with ep = 1 the experts are ordinary replicated weights)."""
    blocks = moe_blocks(chunk)
    if layout.ep > 1 and chunk.spec.is_moe:
        # new_group is a world collective: a stage holding only dense layers creates the groups too
        expert_groups(mesh, layout)
    if not blocks:
        if layout.ep > 1 and chunk.spec.is_moe:
            return chunk  # a pipeline stage with only dense layers
        if layout.ep > 1:
            raise LayoutError(f"ep={layout.ep} but {chunk.spec.name} has no experts; use ep=1")
        return chunk
    spec = chunk.spec
    if layout.redundant_experts:
        raise LayoutError(
            f"redundant_experts={layout.redundant_experts}: the runtime has no EPLB (replicated experts and the "
            f"router's replica choice); plan and estimate price it, run and verify need redundant_experts=0"
        )
    if spec.num_experts % layout.ep:
        raise LayoutError(
            f"ep={layout.ep} does not divide {spec.num_experts} experts; valid ep: "
            f"{[d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]}"
        )
    groups = expert_groups(mesh, layout)
    if layout.folded:
        _apply_folded(chunk, blocks, mesh, layout, groups)
        return chunk
    if layout.ep > 1 and layout.zero == 3:
        chunk.__dict__["_mc_expert_mesh"] = groups["edp_mesh"]
    for fqn, moe in blocks:
        if layout.ep > 1:
            shard_experts_ep(moe, groups["ep_group"])
            for name in ("w1", "w3", "w2"):
                record_shard(chunk, f"{fqn}.experts.{name}", groups["ep_group"], 0)
        for name in ("w1", "w3", "w2"):
            record_grad_group(chunk, f"{fqn}.experts.{name}", groups["edp_group"])
    return chunk


def _apply_folded(chunk: nn.Module, blocks, mesh, layout, groups: dict) -> None:
    """Folded expert mesh on every MoE block of ``chunk`` (tensor.py left them whole): each TP
    rank routes its own slice of the sequence (with sp it holds only that slice already; without,
    it keeps its slice of the replicated input and all-gathers the outputs), the EP all-to-all
    spans the expert mesh's EP group, expert TP runs over its ETP group (``FoldedDispatcher``).
    Router and shared experts stay replicated over tp; each TP rank's gradient of them is a
    partial sum over its tokens (``record_partial_grad``). Expert weights: ETP slices (``w1/w3``
    dim 1, ``w2`` dim 2) then EP slices (dim 0), gradients summed over expert-dp."""
    from modelcarve.runtime.distributed.mesh import axis_group
    from modelcarve.runtime.distributed.shards import record_partial_grad

    tp_group = axis_group(mesh, "tp") if layout.tp > 1 else None
    if layout.zero == 3:
        chunk.__dict__["_mc_expert_mesh"] = groups["edp_mesh"]
    for fqn, moe in blocks:
        if groups["etp"] > 1:
            for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                slice_param(moe.experts, name, dim, groups["etp_rank"], groups["etp"])
                record_shard(chunk, f"{fqn}.experts.{name}", groups["etp_group"], dim)
        ep, rank = layout.ep, groups["ep_rank"]
        for name in ("w1", "w3", "w2"):
            slice_param(moe.experts, name, 0, rank, ep)
            record_shard(chunk, f"{fqn}.experts.{name}", groups["ep_group"], 0)
            record_grad_group(chunk, f"{fqn}.experts.{name}", groups["edp_group"])
        moe.experts.num_experts = moe.num_experts // ep
        moe.dispatcher = FoldedDispatcher(groups["ep_group"], ep, rank, moe.num_experts, groups["etp_group"],
                                          groups["etp"])
        if tp_group is None:
            continue
        for name, _ in moe.named_parameters():
            if not name.startswith("experts."):
                record_partial_grad(chunk, f"{fqn}.{name}", tp_group)
        if not layout.sp:  # the input is replicated over tp: route this rank's slice only
            moe.register_forward_pre_hook(lambda module, args, g=tp_group: (_ScatterTokens.apply(args[0], g),))
            moe.register_forward_hook(lambda module, args, out, g=tp_group: _GatherTokens.apply(out, g))


def shard_experts_ep(moe: nn.Module, group) -> None:
    """Keep this EP rank's experts of one MoE block and route through the all-to-all."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for name in ("w1", "w3", "w2"):
        slice_param(moe.experts, name, 0, rank, ep)
    moe.experts.num_experts = moe.num_experts // ep
    moe.dispatcher = AllToAllDispatcher(group, ep, rank, moe.num_experts)


def configure_moe(chunks: list[nn.Module], layout=None, mesh=None, *, capacity_factor: float | None = None,
                  aux_loss_coef: float = 0.0) -> None:
    """Set the MoE training options on every MoE block of ``chunks`` (the reference: layout=None).

    ``aux_loss_sequences`` follows train.py's loss normalisation: with pp == 1 each rank's
    micro-batch loss is divided by the global token count, so the aux gradient is averaged over
    the global batch's ``gbs`` sequences; the pipeline runner takes per-micro-batch means over
    its ``mbs x seq / cp`` tokens and divides by the micro-batch count and dp x cp afterwards, so
    there it is ``mbs / cp``. With cp > 1 the aux loss sums expert loads over the cp group."""
    cp_sum = cp_gather = None
    shards = 1 if layout is None else layout.cp
    if layout is not None and layout.folded and layout.tp > 1:  # each TP rank routes s / (cp tp) tokens
        from modelcarve.runtime.distributed.mesh import axis_group

        if capacity_factor and layout.cp > 1:
            raise LayoutError(f"a MoE capacity factor with folded experts (etp={layout.expert_tp}, tp={layout.tp}) "
                              f"and cp={layout.cp} is not supported; use cp=1, etp=tp or no capacity factor")
        shards = layout.cp * layout.tp
        cp_sum = _summer(axis_group(mesh, "cp_tp" if layout.cp > 1 else "tp")) if aux_loss_coef else None
        cp_gather = _contiguous_gather(axis_group(mesh, "tp")) if capacity_factor else None
    elif layout is not None and layout.cp > 1:
        from modelcarve.runtime.distributed.mesh import axis_group

        group = axis_group(mesh, "cp")
        cp_sum = _summer(group) if aux_loss_coef else None
        cp_gather = _zigzag_gather(group) if capacity_factor else None
    for chunk in chunks:
        for _, moe in moe_blocks(chunk):
            moe.capacity_factor = capacity_factor or None
            moe.aux_loss_coef = aux_loss_coef
            if layout is not None:
                moe.aux_loss_sequences = layout.global_batch if layout.pp == 1 else layout.mbs / layout.cp
                moe.sequence_shards, moe.sequence_sum, moe.sequence_gather = shards, cp_sum, cp_gather


def _summer(group):
    def sequence_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=group)
        return t

    return sequence_sum


def _contiguous_gather(group):
    """Routing [b, s/t, k] of this TP rank's contiguous slice -> (the whole sequences' routing, its positions)."""
    rank = dist.get_rank(group)

    def sequence_gather(local: torch.Tensor):
        full = gather_cat(local, 1, group)
        s = local.shape[1]
        return full, torch.arange(rank * s, (rank + 1) * s, device=local.device)

    return sequence_gather


def _zigzag_gather(group):
    """Routing [b, s/cp, k] of this cp rank -> (the whole sequences' [b, s, k], this rank's positions),
    for context.py's zig-zag split (chunks r and 2cp-1-r)."""
    from modelcarve.runtime.distributed.zigzag import zigzag_indices, zigzag_unshard

    cp, rank = dist.get_world_size(group), dist.get_rank(group)

    def sequence_gather(local: torch.Tensor):
        full = zigzag_unshard(gather_parts(local, group), dim=1)
        return full, zigzag_indices(full.shape[1], cp, rank, device=local.device)

    return sequence_gather


# --- metrics ------------------------------------------------------------------------------


def moe_step_stats(chunks: list[nn.Module], mesh=None, layout=None, *, bias_rate: float = 0.0,
                   reset: bool = True) -> dict:
    """Per MoE layer, for the step since the last call: ``tokens_per_expert`` (global batch),
    ``tokens_per_rank`` (rows the experts of each dp x cp rank of this pp/tp slice received),
    ``expert_imbalance`` and ``rank_imbalance`` (max / mean), ``dropped``.

    Collective over the whole world when ``mesh`` is given (every rank must call it); returns the
    stats of every layer on every rank. ``bias_rate > 0`` applies the aux-loss-free bias update
    with the global counts."""
    stats: dict = {}
    dpcp_group = None
    if mesh is not None:
        from modelcarve.runtime.distributed.mesh import axis_group

        folded_tp = layout is not None and layout.folded and layout.tp > 1  # TP ranks route different tokens
        dpcp_group = axis_group(mesh, "dp_cp_tp" if folded_tp else "dp_cp")
    for chunk in chunks:
        for fqn, moe in moe_blocks(chunk):
            counts = moe.tokens_per_expert.clone()
            dropped = moe.dropped_tokens.clone()
            if moe.dispatcher is not None:  # on the counts' device: NCCL reduces CUDA tensors only
                received = moe.dispatcher.received.sum().reshape(1).to(counts.device)
            else:
                received = counts.sum().reshape(1)
            if dpcp_group is not None:
                both = torch.cat((counts, dropped.reshape(1)))
                dist.all_reduce(both, group=dpcp_group)
                counts, dropped = both[:-1], both[-1]
                received = gather_cat(received, 0, dpcp_group)
            if bias_rate:
                moe.update_bias(counts, bias_rate)
            if reset:
                moe.reset_counts()
                if moe.dispatcher is not None:
                    moe.dispatcher.received.zero_()
            if counts.device.type == "meta":  # the full-scale dry run: the collectives, no values
                stats[fqn] = dict.fromkeys(("tokens_per_expert", "tokens_per_rank", "expert_imbalance",
                                            "rank_imbalance", "dropped"))
                continue
            stats[fqn] = {
                "tokens_per_expert": counts.tolist(),
                "tokens_per_rank": received.tolist(),
                "expert_imbalance": _imbalance(counts),
                "rank_imbalance": _imbalance(received),
                "dropped": int(dropped),
            }
    if mesh is not None and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stats)
        merged: dict = {}
        for part in everyone:
            for fqn, value in part.items():
                merged.setdefault(fqn, value)
        stats = dict(sorted(merged.items(), key=lambda kv: _layer_index(kv[0])))
    return stats


def reset_moe_counts(chunks: list[nn.Module]) -> None:
    """Forget the counts since the last stats (e.g. of an evaluation forward); local, no collective."""
    for chunk in chunks:
        for _, moe in moe_blocks(chunk):
            moe.reset_counts()
            if moe.dispatcher is not None:
                moe.dispatcher.received.zero_()


def exclude_shape_inference(runner) -> None:
    """Keep torch.distributed.pipelining's first-step shape inference (one forward of each stage
    on placeholder inputs) out of the MoE counts, which feed the router bias update.

    Wraps the stages' ``_forward_metadata_inference`` (a torch-internal name; if torch renames it
    nothing breaks, the first step's counts just include that forward again)."""
    for stage in getattr(runner, "stages", []):
        infer = getattr(stage, "_forward_metadata_inference", None)
        if infer is None:
            continue
        blocks = [moe for _, moe in moe_blocks(stage.submod)]

        def wrapped(*args, __infer=infer, __blocks=blocks, **kwargs):
            saved = [(moe.tokens_per_expert.clone(), moe.dropped_tokens.clone(),
                      moe.dispatcher.received.clone() if moe.dispatcher is not None else None) for moe in __blocks]
            try:
                return __infer(*args, **kwargs)
            finally:
                for moe, (tokens, dropped, received) in zip(__blocks, saved):
                    moe.tokens_per_expert.copy_(tokens)
                    moe.dropped_tokens.copy_(dropped)
                    if received is not None:
                        moe.dispatcher.received.copy_(received)

        stage._forward_metadata_inference = wrapped


def _imbalance(values: torch.Tensor) -> float:
    values = values.to(torch.float64)
    mean = values.mean()
    return float(values.max() / mean) if mean > 0 else 1.0


def _layer_index(fqn: str) -> int:
    parts = fqn.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
