"""Data parallelism over the ranks that hold the same weights (the merged ``dp x cp`` group):
plain all-reduce DP, ZeRO-1, FSDP2 (ZeRO-3) and HSDP.

* zero=0: hand-written SUM all-reduce of the gradients in buckets (grad_buckets.py): without a
  pipeline, overlapped with the backward pass (post-accumulate-grad hooks, reverse parameter
  order, 25 MiB buckets, async all-reduce, waited for in ``reduce_gradients``); with one, once
  after the last micro-batch. torch's DDP is not used (why: grad_buckets.py): our loss is
  already normalised by the global token count (see train.py), so the reduction is a sum.
* zero=1 / zero=2: Megatron's distributed optimiser (zero_optimizer.py): the gradients are
  reduce-scattered over the group (each rank owns a contiguous range of a flat buffer), AdamW
  steps the owned range, the updated parameters are all-gathered. ZeRO-2 also frees the
  gradients outside the owned range. Gradient clipping uses the norm over the owned ranges.
* zero=3: FSDP2 ``fully_shard`` on every transformer block and on the chunk (embedding, norm, LM
  head), over the ``dp_cp`` mesh; parameters, gradients and optimiser state are sharded, the
  gradient reduce-scatter sums (``set_gradient_divide_factor(1.0)``).
  HSDP (``dp_shard < dp``): the same with a 2-D (replicate, shard) mesh.
  The tensor-parallel shards are plain tensors (tensor.py), so FSDP2 shards them again.

A parameter whose gradient must be summed over another group than ``dp_cp`` (e.g. experts over
the expert-data-parallel group) is registered with shards.py's ``record_grad_group``.
The ZeRO optimiser is kept on the first chunk (``_mc_zero_optimizer``) once built, so the
gradient reduction and clipping find it.

Also here: the global gradient norm (correct over every axis) and clipping.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from modelcarve.runtime.parallel.grad_buckets import GradBuckets, plan_buckets
from modelcarve.runtime.distributed.mesh import axis_group, merged_mesh
from modelcarve.runtime.distributed.shards import grad_groups_of, partial_grads_of, shards_of, tied_copy_names
from modelcarve.runtime.parallel.zero_optimizer import ShardedAdamW
from modelcarve.spec.support import fsdp_reshards_after_forward, held_param_dtype


def _dp_mesh(mesh, layout):
    if layout.zero == 3 and layout.dp_shard and layout.dp_shard < layout.dp:
        return merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp)
    return merged_mesh(mesh, "dp_cp")


def apply_data_parallel(chunks: list[nn.Module], mesh, layout) -> None:
    replicas = layout.dp * layout.cp
    for chunk in chunks:
        chunk.__dict__["_mc_zero"] = layout.zero if replicas > 1 else 0
    if replicas > 1 and layout.zero == 0 and layout.pp == 1:
        microbatches = layout.global_batch // layout.dp // layout.mbs
        chunks[0].__dict__["_mc_grad_buckets"] = GradBuckets(_grad_groups(chunks, mesh), microbatches)
    if replicas == 1 or layout.zero != 3:
        return
    from torch.distributed.fsdp import fully_shard

    dp_mesh = _dp_mesh(mesh, layout)
    # zero-bubble: the layers stay unsharded from their first forward to the step's gradient reduction
    # (spec/support.py's fsdp_reshards_after_forward says why; the planner prices the same rule)
    reshard = fsdp_reshards_after_forward(layout.pp, layout.schedule)
    for chunk in chunks:
        expert_mesh = chunk.__dict__.get("_mc_expert_mesh")  # expert.py: EP-split experts shard over expert-dp only
        for block in chunk.layers.values():
            if expert_mesh is not None and hasattr(block.feed_forward, "experts"):
                fully_shard(block.feed_forward.experts, mesh=expert_mesh, reshard_after_forward=reshard)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(chunk, mesh=dp_mesh)
        for mod in chunk.modules():
            if hasattr(mod, "set_gradient_divide_factor"):
                mod.set_gradient_divide_factor(1.0)
                mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _grad_groups(chunks, mesh) -> list:
    """``[(param, group its gradient is summed over)]`` in parameter order (zero 0/1/2)."""
    default = axis_group(mesh, "dp_cp")
    out = []
    for chunk in chunks:
        overrides = grad_groups_of(chunk)
        out += [(p, overrides.get(fqn, default)) for fqn, p in chunk.named_parameters()]
    return out


def _partial_sums(chunks) -> None:
    zero_opt = chunks[0].__dict__.get("_mc_zero_optimizer")
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for fqn, groups in partial_grads_of(chunk).items():
            # mixed-precision ZeRO: the fp32 gradient the optimiser accumulated (zero_optimizer.py)
            grad = zero_opt.grad_of(params[fqn]) if zero_opt is not None else None
            grad = params[fqn].grad if grad is None else grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            for group in groups:
                dist.all_reduce(local, group=group)


def reduce_gradients(chunks: list[nn.Module], mesh, layout) -> None:
    """Finish the gradients after the last backward of a step: the data-parallel reduction
    (zero 0: wait for / issue the bucketed all-reduces; zero 1/2: the optimiser's
    reduce-scatter; FSDP2 reduced already), and the partial sums over tp (and other registered
    groups). Sums commute, so the order of the two does not matter; the all-reduces of zero 0
    finish first because their copy-back overwrites ``p.grad``."""
    replicas = layout.dp * layout.cp
    zero_opt = chunks[0].__dict__.get("_mc_zero_optimizer")
    if replicas > 1 and layout.zero == 0:
        buckets = chunks[0].__dict__.get("_mc_grad_buckets")
        if buckets is None:  # pipeline stages: once after the last micro-batch
            _reduce_once(_grad_groups(chunks, mesh))
        else:
            buckets.finish()
    _partial_sums(chunks)
    if replicas > 1 and layout.zero in (1, 2):
        if zero_opt is None:  # no optimiser built (gradients only): a plain all-reduce
            _reduce_once(_grad_groups(chunks, mesh))
        else:
            # ZeRO-2 (and mixed precision, whose fp32 gradients are no p.grad) frees p.grad, which
            # train.py's 1/(dp x cp) after a pipeline step scales
            scale = 1.0 / replicas if layout.pp > 1 and (layout.zero == 2 or zero_opt.mixed) else None
            zero_opt.reduce(scale=scale)


@torch.no_grad()
def _reduce_once(groups) -> None:
    """The bucketed SUM all-reduce, not overlapped (reverse parameter order, as grad_buckets)."""
    by_group: dict = {}
    for p, group in reversed(groups):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None and dist.get_world_size(group) > 1:
            by_group.setdefault(id(group), (group, []))[1].append(p)
    for group, params in by_group.values():
        for bucket in plan_buckets(params):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def build_optimizer(chunks: list[nn.Module], mesh, layout, **adamw):
    params = [p for chunk in chunks for p in chunk.parameters()]
    if layout.zero in (1, 2) and layout.dp * layout.cp > 1:
        replicate = None
        groups = []
        shard_group = None
        if layout.dp_shard and layout.dp_shard < layout.dp:  # shard inside each replica group only
            hsdp = merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp)
            replicate, shard_group = hsdp.get_group(0), hsdp.get_group(1)
        default = axis_group(mesh, "dp_cp")
        for chunk in chunks:
            overrides = grad_groups_of(chunk)
            for fqn, p in chunk.named_parameters():
                if fqn in overrides:  # EP experts: their own expert-data-parallel group
                    groups.append((chunk, fqn, p, overrides[fqn], None))
                else:
                    groups.append((chunk, fqn, p, shard_group or default, replicate))
        mixed = dict(param_dtype=torch.bfloat16, unhooked=_tied_params(chunks, layout),
                     grad_scale=1.0 / layout.num_microbatches if layout.pp > 1 else 1.0)
        low = held_param_dtype(layout) == "bf16"  # the one precision-policy rule (spec/support.py)
        opt = ShardedAdamW(chunks, groups, layout.zero, **(mixed if low else {}), **adamw)
        chunks[0].__dict__["_mc_zero_optimizer"] = opt
        return opt
    return torch.optim.AdamW(params, **adamw)


def _tied_params(chunks, layout) -> frozenset:
    """ids of the parameters whose gradient the pipeline sums across stages (the tied embedding
    and its copies): mixed-precision ZeRO leaves their ``.grad`` to pipeline.py."""
    if layout.pp == 1 or not chunks[0].spec.tied_embeddings:
        return frozenset()
    out = set()
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for fqn in [*tied_copy_names(chunk), "tok_embeddings.weight"]:
            if fqn in params:
                out.add(id(params[fqn]))
    return frozenset(out)


def _copies(chunk, fqn, param, world_per_stage) -> int:
    """How many ranks of one pipeline stage hold this exact local slice."""
    sharded = 1
    for group, _ in shards_of(chunk).get(fqn, []):
        sharded *= dist.get_world_size(group)
    if isinstance(param, DTensor):
        for placement, size in zip(param.placements, param.device_mesh.shape):
            if placement.is_shard():
                sharded *= size
    return max(1, world_per_stage // sharded)


def _sq_norm(g: torch.Tensor) -> torch.Tensor:
    """A tensor's squared L2 norm in float64, from its norm in its own dtype (as torch's
    ``clip_grad_norm_`` takes it per tensor): no float64 copy of the gradient is made."""
    return torch.linalg.vector_norm(g).double().pow(2)


def grad_norm(chunks: list[nn.Module], mesh, layout) -> torch.Tensor:
    """The L2 norm of the full model's gradient, identical on every rank: each rank sums the
    squares of its local slices weighted by 1/(ranks holding the same slice), one all-reduce
    over the world adds them. Under ZeRO-1/2 the reduced gradient is only in the optimiser's
    owned ranges: a piece of a parameter whose local slice ``copies`` ranks hold is owned by
    ``copies / n`` of them (one per reduce-scatter group of ``n``), so it is weighted ``n / copies``."""
    world_per_stage = dist.get_world_size() // layout.pp
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    zero_opt = chunks[0].__dict__.get("_mc_zero_optimizer")
    skip = set()
    if layout.pp > 1:  # a tied LM head's copy of the embedding (pipeline.py) is not counted twice
        skip = {(id(chunk), fqn) for chunk in chunks for fqn in tied_copy_names(chunk)}
    if zero_opt is not None:
        for chunk, fqn, p, n, piece in zero_opt.owned_grad_pieces():
            if (id(chunk), fqn) not in skip:
                total += _sq_norm(piece) * n / _copies(chunk, fqn, p, world_per_stage)
    else:
        for chunk in chunks:
            for fqn, p in chunk.named_parameters():
                if p.grad is None or (id(chunk), fqn) in skip:
                    continue
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                total += _sq_norm(g) / _copies(chunk, fqn, p, world_per_stage)
    dist.all_reduce(total)
    return total.sqrt()


def clip_gradients(chunks: list[nn.Module], max_norm: float, mesh, layout) -> float:
    """Scale all gradients so the global norm is at most ``max_norm`` (torch's formula);
    ZeRO-1/2: the owned ranges the optimiser steps."""
    norm = grad_norm(chunks, mesh, layout)
    if max_norm and max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        zero_opt = chunks[0].__dict__.get("_mc_zero_optimizer")
        if zero_opt is not None:
            grads = [b.master.grad for b in zero_opt.buckets if b.master.grad is not None]
        else:
            grads = [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]
        for g in grads:
            g = g.to_local() if isinstance(g, DTensor) else g
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return float("nan") if norm.device.type == "meta" else float(norm)  # meta: the dry run's shapes-only step
