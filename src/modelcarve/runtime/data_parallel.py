"""Data parallelism over the ranks that hold the same weights (the merged ``dp x cp`` group):
plain all-reduce DP, ZeRO-1, FSDP2 (ZeRO-3) and HSDP.

* zero=0: hand-written. After the last micro-batch's backward, all gradients are flattened into
  one bucket and all-reduced (SUM) once. torch's DDP is not used: it hooks every backward,
  which a pipeline runner or a gradient-accumulation loop would have to switch off, and it
  averages, while our loss is already normalised by the global token count (see train.py), so
  the correct reduction is a sum.
* zero=1: the same gradient all-reduce, then ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (PyTorch's ZeRO-1): each rank keeps the AdamW state of a partition of the parameters, steps
  it, and broadcasts the updated parameters.
* zero=3: FSDP2 ``fully_shard`` on every transformer block and on the chunk (embedding, norm, LM
  head), over the ``dp_cp`` mesh; parameters, gradients and optimiser state are sharded, the
  gradient reduce-scatter sums (``set_gradient_divide_factor(1.0)``).
  HSDP (``dp_shard < dp``): the same with a 2-D (replicate, shard) mesh.
  The tensor-parallel shards are plain tensors (tensor.py), so FSDP2 shards them again.
* zero=2 is refused by parallelize.check_runtime.

A parameter whose gradient must be summed over another group than ``dp_cp`` (e.g. experts over
the expert-data-parallel group) is registered with shards.py's ``record_grad_group``.

Also here: the global gradient norm (correct over every axis) and clipping.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from modelcarve.runtime.mesh import axis_group, axis_size, merged_mesh
from modelcarve.runtime.shards import grad_groups_of, partial_grads_of, shards_of, tied_copy_names


def _dp_mesh(mesh, layout):
    if layout.zero == 3 and layout.dp_shard and layout.dp_shard < layout.dp:
        return merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp)
    return merged_mesh(mesh, "dp_cp")


def apply_data_parallel(chunks: list[nn.Module], mesh, layout) -> None:
    replicas = layout.dp * layout.cp
    for chunk in chunks:
        chunk.__dict__["_mc_zero"] = layout.zero if replicas > 1 else 0
    if replicas == 1 or layout.zero != 3:
        return
    from torch.distributed.fsdp import fully_shard

    dp_mesh = _dp_mesh(mesh, layout)
    for chunk in chunks:
        expert_mesh = chunk.__dict__.get("_mc_expert_mesh")  # expert.py: EP-split experts shard over expert-dp only
        for block in chunk.layers.values():
            if expert_mesh is not None and hasattr(block.feed_forward, "experts"):
                fully_shard(block.feed_forward.experts, mesh=expert_mesh)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(chunk, mesh=dp_mesh)
        for mod in chunk.modules():
            if hasattr(mod, "set_gradient_divide_factor"):
                mod.set_gradient_divide_factor(1.0)
                mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def reduce_gradients(chunks: list[nn.Module], mesh, layout) -> None:
    """Finish the gradients after the last backward of a step: partial sums over tp (and other
    registered groups), then the data-parallel all-reduce (zero 0/1; FSDP2 reduced already)."""
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for fqn, groups in partial_grads_of(chunk).items():
            grad = params[fqn].grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            for group in groups:
                dist.all_reduce(local, group=group)
    if layout.dp * layout.cp == 1 or layout.zero == 3:
        return
    default = axis_group(mesh, "dp_cp")
    buckets: dict = {}
    for chunk in chunks:
        overrides = grad_groups_of(chunk)
        for fqn, p in chunk.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            group = overrides.get(fqn, default)
            buckets.setdefault(id(group), (group, []))[1].append(p.grad)
    for group, grads in buckets.values():
        if group is None or dist.get_world_size(group) == 1:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def build_optimizer(chunks: list[nn.Module], mesh, layout, **adamw) -> torch.optim.Optimizer:
    params = [p for chunk in chunks for p in chunk.parameters()]
    if layout.zero == 1 and layout.dp * layout.cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = axis_group(mesh, "dp_cp")
        if layout.dp_shard and layout.dp_shard < layout.dp:  # shard inside each replica group only
            group = merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp).get_group(1)
        # parameters reduced over another group (EP experts: expert-dp) partition their state over it
        by_group: dict = {}
        for chunk in chunks:
            overrides = grad_groups_of(chunk)
            for fqn, p in chunk.named_parameters():
                g = overrides.get(fqn, group)
                by_group.setdefault(id(g), (g, []))[1].append(p)
        optims = [ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, process_group=g, **adamw)
                  for g, ps in by_group.values()]
        return optims[0] if len(optims) == 1 else _Optimizers(optims)
    return torch.optim.AdamW(params, **adamw)


class _Optimizers:
    """Several optimisers stepped as one (ZeRO-1 with one partition group per gradient group)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for opt in self.optimizers for k, v in getattr(opt, "optim", opt).state.items()}


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


def grad_norm(chunks: list[nn.Module], mesh, layout) -> torch.Tensor:
    """The L2 norm of the full model's gradient, identical on every rank: each rank sums the
    squares of its local slices weighted by 1/(ranks holding the same slice), one all-reduce
    over the world adds them."""
    world_per_stage = dist.get_world_size() // layout.pp
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    for chunk in chunks:
        copies = set()
        if layout.pp > 1:  # a tied LM head's copy of the embedding (pipeline.py) is not counted twice
            copies = set(tied_copy_names(chunk))
        for fqn, p in chunk.named_parameters():
            if p.grad is None or fqn in copies:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += g.double().pow(2).sum() / _copies(chunk, fqn, p, world_per_stage)
    dist.all_reduce(total)
    return total.sqrt()


def clip_gradients(chunks: list[nn.Module], max_norm: float, mesh, layout) -> float:
    """Scale all gradients so the global norm is at most ``max_norm`` (torch's formula)."""
    norm = grad_norm(chunks, mesh, layout)
    if max_norm and max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return float(norm)
