"""The one place the parallelisms are applied, in this order:

    pipeline split (pipeline.py)  ->  TP / SP (tensor.py)  ->  EP (expert.py)
      ->  CP (context.py)  ->  activation recomputation (recompute.py)
      ->  DP / ZeRO-1 / FSDP2 / HSDP (data_parallel.py)

Every process group the parallelisms use is made first, on every rank, in one order
(``create_groups``), and the mesh is then sealed.

``parallelize(model, layout, mesh)`` takes the unchanged reference model (runtime/model/transformer.py) and
returns this rank's model chunks (one, or ``virtual_stages`` for an interleaved pipeline).
Every refusal (a layout the runtime cannot execute, with the fix in the message) is
spec/support.py's ``check_training``: the CLI calls it before any process starts, the planner to
mark the layouts ``run`` would refuse, and ``parallelize`` again on every rank.

Each parallelism module applies one parallelism and imports none of the others; what one
changes in a parameter that another (or verify/reference.py, the train step, the checkpoint code) must
know is recorded in shards.py. This is the only module that brings them together: what the
training step (train.py) and verify/reference.py need of them at run time (the vocabulary-parallel loss,
the pipeline runner, the cp piece of a batch, the MoE options and statistics, the gradient
reduction, clipping and the optimiser) they take from ``StepHooks`` below, not from the
parallelism modules themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from modelcarve.spec.layout import Layout
from modelcarve.spec.model import ModelSpec
from modelcarve.runtime.parallel.recompute import apply_recompute
from modelcarve.spec.support import check_training


def parallelize(model: nn.Module, layout: Layout, mesh) -> list[nn.Module]:
    """Apply every parallelism of ``layout`` to ``model`` (consumed) on this rank; returns its chunks."""
    from modelcarve.runtime.parallel.data_parallel import apply_data_parallel
    from modelcarve.runtime.distributed.mesh import axis_rank
    from modelcarve.runtime.parallel.tensor import apply_tensor_parallel

    check_training(layout, model.spec)
    create_groups(mesh, layout, model.spec)
    if layout.pp > 1:
        from modelcarve.runtime.parallel.pipeline import split_model

        chunks = list(split_model(model, layout, axis_rank(mesh, "pp")))
    else:
        chunks = [model]
    for chunk in chunks:
        apply_tensor_parallel(chunk, mesh, layout)
    if layout.ep > 1:
        from modelcarve.runtime.parallel.expert import apply_expert_parallel

        for chunk in chunks:
            apply_expert_parallel(chunk, mesh, layout)
    if layout.cp > 1:
        from modelcarve.runtime.parallel.context import apply_context_parallel

        for chunk in chunks:
            apply_context_parallel(chunk, mesh, layout)
    for chunk in chunks:
        apply_recompute(chunk, layout.recompute)  # recompute.py
    apply_data_parallel(chunks, mesh, layout)
    return chunks


def create_groups(mesh, layout: Layout, spec: ModelSpec) -> None:
    """Create every process group the parallelisms will ask for, now, in one order, on every rank;
    then seal the mesh (runtime/distributed/mesh.py): a group asked for later raises at once.

    ``new_group`` (and a ``DeviceMesh``) is a collective over the whole world: a group first
    asked for lazily by a rank whose stage needs it (a pipeline stage holding only dense
    layers skips the expert groups) would leave the other ranks waiting, or pair mismatched
    groups. Later calls find these in their caches."""
    from modelcarve.runtime.distributed.mesh import merged_mesh, seal_groups

    if layout.dp * layout.cp > 1 or spec.is_moe:  # MoE statistics sum over dp x cp even when it is 1
        merged_mesh(mesh, "dp_cp")
        if layout.dp_shard and layout.dp_shard < layout.dp:
            merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp)
    if layout.tp > 1 and spec.attention_kind == "gqa" and spec.num_kv_heads % layout.tp and layout.tp % spec.num_kv_heads == 0:
        from modelcarve.runtime.parallel.tensor import kv_replica_groups

        kv_replica_groups(mesh, layout.tp, spec.num_kv_heads)  # kv heads replicated over tp
    if layout.pp * layout.virtual_stages > 1:
        from modelcarve.runtime.parallel.pipeline import create_tied_group

        create_tied_group(mesh, layout, spec)
    if layout.ep > 1 and spec.is_moe:
        from modelcarve.runtime.parallel.expert import expert_groups

        expert_groups(mesh, layout)
        if layout.folded and layout.tp > 1:  # expert.py: stats over every rank of a stage, aux loss over cp x tp
            merged_mesh(mesh, "dp_cp_tp")
            if layout.cp > 1:
                merged_mesh(mesh, "cp_tp")
    seal_groups(mesh)


# --- what a training step asks of the parallelisms ----------------------------------------


@dataclass(frozen=True)
class StepHooks:
    """The parallelisms' part of one training or evaluation step on this rank's ``chunks``.

    train.py's Trainer and verify/reference.py call these, so they import no parallelism module; each
    method hands over to the one module that owns the idea. ``layout``/``mesh`` None is the
    single-device reference (only the MoE methods take it)."""

    chunks: list
    layout: Any = None
    mesh: Any = None

    def loss_fn(self, num_tokens: int):
        """``loss_fn(logits, targets) -> sum(CE) / num_tokens``: vocabulary-parallel (tensor.py)
        when the last chunk's LM head is split over tp, else torch's cross-entropy."""
        import torch.nn.functional as F

        chunk = self.chunks[-1]
        group = getattr(chunk, "tp_group", None) if getattr(chunk, "vocab_parallel", False) else None
        if group is not None:
            from modelcarve.runtime.parallel.tensor import vocab_parallel_cross_entropy

            vocab = chunk.spec.vocab_size

            def loss_fn(logits, targets):
                return vocab_parallel_cross_entropy(logits, targets, group, vocab).sum() / num_tokens
        else:
            def loss_fn(logits, targets):
                return F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), reduction="sum") / num_tokens
        return loss_fn

    def pipeline(self, loss_fn):
        """The pipeline runner over this rank's stages (pipeline.py), MoE counts kept clean of
        torch's shape-inference forward (expert.py)."""
        from modelcarve.runtime.parallel.pipeline import build_pipeline

        runner = build_pipeline(self.chunks, self.layout, self.mesh, loss_fn)
        if self.chunks[0].spec.is_moe:
            from modelcarve.runtime.parallel.expert import exclude_shape_inference

            exclude_shape_inference(runner)
        return runner

    def shard_batch(self, tokens, targets):
        """``(tokens, targets, positions)`` of this cp rank (context.py); positions None at cp=1."""
        if self.layout is None or self.layout.cp == 1:
            return tokens, targets, None
        from modelcarve.runtime.parallel.context import shard_batch

        return shard_batch(tokens, targets, self.mesh, self.layout)

    def unshard_sequence(self, x, dim: int = 1):
        """Every cp rank's piece of ``x`` along ``dim`` reassembled (context.py; no grad)."""
        from modelcarve.runtime.parallel.context import unshard_sequence

        return unshard_sequence(x, self.mesh, self.layout, dim=dim)

    def configure_moe(self, *, capacity_factor: float | None, aux_loss_coef: float) -> None:
        from modelcarve.runtime.parallel.expert import configure_moe

        configure_moe(self.chunks, self.layout, self.mesh, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef)

    def moe_stats(self, *, bias_rate: float = 0.0) -> dict:
        """Per MoE layer since the last call (expert.py; collective when layout is set)."""
        from modelcarve.runtime.parallel.expert import moe_step_stats

        return moe_step_stats(self.chunks, self.mesh, self.layout, bias_rate=bias_rate)

    def reset_moe_counts(self) -> None:
        from modelcarve.runtime.parallel.expert import reset_moe_counts

        reset_moe_counts(self.chunks)

    def optimizer(self, **adamw):
        """AdamW over the chunks, sharded as the layout's ZeRO stage says (data_parallel.py)."""
        from modelcarve.runtime.parallel.data_parallel import build_optimizer

        return build_optimizer(self.chunks, self.mesh, self.layout, **adamw)

    def reduce_gradients(self) -> None:
        """Sum the gradients over every axis that holds partial sums (data_parallel.py)."""
        from modelcarve.runtime.parallel.data_parallel import reduce_gradients

        reduce_gradients(self.chunks, self.mesh, self.layout)

    def clip_gradients(self, max_norm: float) -> float:
        """Clip to the global gradient norm over every shard; returns that norm (data_parallel.py)."""
        from modelcarve.runtime.parallel.data_parallel import clip_gradients

        return clip_gradients(self.chunks, max_norm, self.mesh, self.layout)
