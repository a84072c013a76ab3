"""The small communication and sharding steps every parallelism shares, written once.

Below every parallelism (as Megatron-Core's ``tensor_parallel/mappings.py`` or picotron's
``process_group_manager`` helpers): tensor.py, expert.py, context.py, zero_optimizer.py and
verify/reference.py call these instead of each writing its own.

* ``gather_parts(x, group)``: every rank's ``x`` (same shape on all), in group-rank order: one
  ``all_gather`` of ``x.contiguous()`` into fresh tensors. ``gather_cat(x, dim, group)``: those
  parts concatenated along ``dim``. Neither is an autograd function: the result carries no
  gradient back to ``x`` (the parallelisms wrap them in their own ``autograd.Function`` where the
  backward path needs a collective); a caller that wants a detached input says so (``x.detach()``).
* ``all_reduce_sum(x, group)``: the sum over ``group``, in place. It and ``gather_cat`` go through
  shared memory (host_shm.py) for a group the generation engine attached there, else the backend.
* ``gather_flat(t, group)``: a 1-D ``t`` of every rank concatenated, ``all_gather_into_tensor``
  into one new buffer (ZeRO's owned ranges); with no group or one rank, a copy.
* ``rank_piece(x, dim, group)``: this rank's ``torch.chunk`` of ``x`` along ``dim``, contiguous
  (a view's storage is not kept alive).
* ``slice_param(module, name, dim, index, parts)``: replace a parameter by piece ``index`` of
  ``parts`` along ``dim`` (``torch.chunk``), detached and cloned into its own storage, keeping
  its ``requires_grad``.
* ``reduce_scatter_tensor`` / ``all_gather_into_tensor``: torch's single-tensor collectives under
  their newer names (``reduce_scatter_single`` / ``all_gather_single``) where this torch has them,
  so no deprecation warning is raised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from modelcarve.runtime.distributed import host_shm

reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_parts(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``x`` in ``group`` (same shape and dtype on all), in group-rank order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def gather_cat(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` in ``group`` concatenated along ``dim``, in group-rank order (no autograd);
    through shared memory where the group is attached there (host_shm.py) and ``x`` fits."""
    host = host_shm.lookup(group)
    if host is not None and host.fits(x):
        return host.gather_cat(x.contiguous(), dim)
    return torch.cat(gather_parts(x, group), dim=dim)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` (made contiguous) summed over ``group`` in place, returned; through shared memory
    where the group is attached there (host_shm.py) and ``x`` fits, else gloo / NCCL."""
    x = x.contiguous()
    host = host_shm.lookup(group)
    if host is not None and host.fits(x):
        return host.all_reduce_(x)
    dist.all_reduce(x, group=group)
    return x


def gather_flat(t: torch.Tensor, group) -> torch.Tensor:
    """A 1-D ``t`` of every rank in ``group`` as one new 1-D buffer of ``n x t.numel()`` elements
    (rank order); ``group`` None or of one rank: a copy of ``t``."""
    n = 1 if group is None else dist.get_world_size(group)
    full = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    if n > 1:
        all_gather_into_tensor(full, t.contiguous(), group=group)
    else:
        full.copy_(t)
    return full


def rank_piece(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's ``torch.chunk`` of ``x`` along ``dim`` over ``group``'s ranks, contiguous."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=dim)[rank].contiguous()


def slice_param(module: nn.Module, name: str, dim: int, index: int, parts: int) -> None:
    """``module.<name>`` becomes a new parameter: piece ``index`` of ``parts`` along ``dim``
    (``torch.chunk``), detached and cloned (the full tensor can be freed), same ``requires_grad``."""
    old = getattr(module, name)
    piece = old.detach().chunk(parts, dim=dim)[index].clone()
    setattr(module, name, nn.Parameter(piece, requires_grad=old.requires_grad))


__all__ = [
    "all_gather_into_tensor",
    "gather_cat",
    "gather_flat",
    "gather_parts",
    "rank_piece",
    "reduce_scatter_tensor",
    "slice_param",
]
