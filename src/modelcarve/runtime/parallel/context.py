"""Context parallelism: split the sequence over the mesh's "cp" axis and attend with a ring.

Hand-written, applied to an unchanged model: ``apply_context_parallel`` swaps every
attention module's ``core_attention`` (model.py's ``CoreAttention``, causal SDPA) for
``RingCoreAttention``, which runs ``ring_attention.ring_attention`` over the cp process group
with the same softmax scale. Everything else in a decoder layer (norms, projections, MLP or
MoE, rotary embedding from the chunk's true positions) is per token and needs no change.
PyTorch's ``context_parallel`` is not used: it has no CPU sharding rule for SDPA and cannot
run on gloo.

Data: ``shard_batch`` gives each cp rank its zig-zag piece of every sequence (chunks ``i`` and
``2cp-1-i`` of ``2cp``) and those tokens' absolute positions, which the model's
``forward(tokens, positions)`` turns into rotary angles (or learned position rows). Sequence
lengths that are not a multiple of ``2 * cp`` are refused with a ``LayoutError`` (the same rule
``Layout.validate`` applies); pad at the end with ignored targets instead: under a causal mask
no real token sees a later pad token, so the real tokens' results are unchanged.

Loss and gradients (the normalisation train.py keeps)
-----------------------------------------------------
The loss is the mean token cross-entropy over the global batch, ``L = sum_t ce_t / T`` with
``T`` every target token of the step. A cp rank holds exactly ``1 / cp`` of the tokens of each
of its sequences, so ``L`` is the sum over dp x cp ranks (and micro-batches) of
``sum_{t local} ce_t / T``, or equivalently the mean over dp x cp of the local token means.
Parameters are replicated over cp, and ring attention's backward already routes every
``dL/dK, dL/dV`` to the rank owning those keys; hence each rank's parameter gradient is the
gradient of its own share of ``L``, and the full gradient is their SUM over dp x cp when the
local loss is divided by the global token count (their MEAN when it is the local token mean).
train.py/data_parallel.py reduce over the merged ``dp_cp`` group in exactly this way.

Usage (inside parallelize, after TP/EP, before DP)::

    chunk = apply_context_parallel(chunk, mesh, layout)
    tokens, targets, positions = shard_batch(tokens, targets, mesh, layout)
    logits = chunk(tokens, positions)          # this rank's zig-zag piece of the logits
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from modelcarve.runtime.distributed.primitives import gather_parts
from modelcarve.runtime.parallel.ring_attention import ring_attention
from modelcarve.runtime.distributed.zigzag import check_divisible, zigzag_indices, zigzag_unshard
from modelcarve.spec.errors import LayoutError, ModelcarveError
from modelcarve.spec.layout import Layout


class RingCoreAttention(nn.Module):
    """Drop-in for model.py's CoreAttention: causal attention over the whole cp-split sequence."""

    def __init__(self, group: dist.ProcessGroup, scale: float | None, timeout_s: float):
        super().__init__()
        self.group, self.scale, self.timeout_s = group, scale, timeout_s

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, scale=self.scale, timeout_s=self.timeout_s)

    def extra_repr(self) -> str:
        return f"cp={dist.get_world_size(self.group)}, scale={self.scale}"


def _cp_group(mesh) -> tuple[dist.ProcessGroup, int, int]:
    from modelcarve.runtime.distributed.mesh import axis_group, axis_rank, axis_size

    return axis_group(mesh, "cp"), axis_rank(mesh, "cp"), axis_size(mesh, "cp")


def apply_context_parallel(chunk: nn.Module, mesh, layout: Layout) -> nn.Module:
    """Swap every ``core_attention`` of ``chunk`` for ring attention over the "cp" axis (in place)."""
    if layout.cp == 1:
        return chunk
    from modelcarve.runtime.distributed.mesh import collective_timeout

    group, _, size = _cp_group(mesh)
    if size != layout.cp:
        raise LayoutError(f"layout has cp={layout.cp} but the mesh's cp axis has {size} ranks; build the mesh from this layout")
    swapped = 0
    for module in chunk.modules():
        core = getattr(module, "core_attention", None)
        if isinstance(core, nn.Module) and not isinstance(core, RingCoreAttention):
            scale = getattr(core, "scale", None)
            module.core_attention = RingCoreAttention(group, scale, collective_timeout().total_seconds())
            swapped += 1
    if swapped == 0 and any(True for _ in chunk.parameters()):
        raise ModelcarveError(
            "context parallelism found no attention module with a `core_attention` to replace in this model "
            "chunk; the model must call self.core_attention(q, k, v) (see runtime/model/transformer.py)"
        )
    return chunk


def shard_batch(tokens: torch.Tensor, targets: torch.Tensor | None, mesh, layout: Layout):
    """This cp rank's zig-zag piece of ``tokens``/``targets`` [b, s] and its absolute positions [s/cp].

    ``tokens`` may also be hidden states [b, s, H] (a later pipeline stage); the sequence dim is 1.
    With cp=1 the inputs come back unchanged with positions ``arange(s)``."""
    seq_len = tokens.shape[1]
    if targets is not None and targets.shape[:2] != tokens.shape[:2]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match tokens {tuple(tokens.shape)}")
    if layout.cp == 1:
        return tokens, targets, torch.arange(seq_len, device=tokens.device)
    _, rank, size = _cp_group(mesh)
    check_divisible(seq_len, size)
    positions = zigzag_indices(seq_len, size, rank, device=tokens.device)
    local_targets = None if targets is None else targets.index_select(1, positions)
    return tokens.index_select(1, positions), local_targets, positions


def unshard_sequence(x: torch.Tensor, mesh, layout: Layout, dim: int = 1) -> torch.Tensor:
    """Gather every cp rank's zig-zag piece of ``x`` along ``dim`` into the full sequence (no grad).

    For comparisons (logits in verify/reference.py), not for training."""
    if layout.cp == 1:
        return x
    group, _, _ = _cp_group(mesh)
    return zigzag_unshard(gather_parts(x.detach(), group), dim)


__all__ = [
    "RingCoreAttention",
    "apply_context_parallel",
    "check_divisible",
    "shard_batch",
    "unshard_sequence",
]
