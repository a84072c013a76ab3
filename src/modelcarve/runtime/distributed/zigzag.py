"""The zig-zag split of a sequence over the ranks of a context-parallel group, as pure tensor functions.

A sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``S / (2 cp)`` tokens; cp rank ``i``
holds chunks ``i`` and ``2cp-1-i`` in that order (so under a causal mask every rank does the same
work: ring_attention.py). It is a fact about where tokens live, which more than one parallelism
needs: context.py shards batches and positions by it, ring_attention.py computes over it, and
expert.py's capacity routing gathers a whole sequence's routing back from it. So it lives here,
below them all, and none of them imports another for it.
"""

from __future__ import annotations

import torch

from modelcarve.spec.errors import LayoutError


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
