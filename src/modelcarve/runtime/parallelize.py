"""The one place the parallelisms are applied, in this order:

    pipeline split (pipeline.py)  ->  TP / SP (tensor.py)  ->  EP (expert.py)
      ->  CP (context.py)  ->  activation recomputation (below)
      ->  DP / ZeRO-1 / FSDP2 / HSDP (data_parallel.py)

Recomputation (``layout.recompute``): ``full`` re-runs each transformer block's forward in the
backward pass, ``selective`` only the attention core (``core_attention``: the s^2 part), with
``torch.utils.checkpoint`` (non-reentrant). It is applied by replacing the module's ``forward``
on the instance, so FQNs do not change, and before FSDP2, whose hooks then wrap the
recomputed forward (the parameters are gathered again before the block's backward).

``parallelize(model, layout, mesh)`` takes the unchanged reference model (runtime/model.py) and
returns this rank's model chunks (one, or ``virtual_stages`` for an interleaved pipeline).
``check_runtime(layout, spec, world_size)`` refuses, before any process starts, a layout the
runtime cannot execute, with the fix in the message.

Each parallelism module applies one parallelism and imports none of the others; what one
changes in a parameter that another (or verify.py, the train step, the checkpoint code) must
know is recorded in shards.py. This is the only module that brings them together.
"""

from __future__ import annotations

from torch import nn

from modelcarve.runtime.coverage import check_model_coverage
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout
from modelcarve.spec.model import ModelSpec


def check_runtime(layout: Layout, spec: ModelSpec, world_size: int | None = None) -> None:
    """Raise LayoutError if this runtime cannot execute ``layout`` on ``spec`` (and ``world_size``)."""
    check_model_coverage(spec)  # a model whose layers the reference lacks (runtime/coverage.py)
    layout.validate(spec, world_size=world_size)
    problems = []
    if layout.zero == 2:
        problems.append("zero=2 is not implemented by the runtime; use zero=1 (sharded optimiser) or fsdp (zero=3)")
    if layout.folded and layout.tp > 1 and not layout.sp and (layout.seq // layout.cp) % layout.tp:
        # (MoE parallel folding: each TP rank routes its own slice of the sequence, expert.py)
        problems.append(f"folded experts (etp={layout.expert_tp}, tp={layout.tp}): each TP rank routes seq/cp / tp "
                        f"tokens, but seq/cp = {layout.seq // layout.cp} is not divisible by tp={layout.tp}; "
                        f"choose seq a multiple of {layout.cp * layout.tp}")
    if layout.param_dtype not in ("fp32", "bf16"):
        problems.append(f"param_dtype={layout.param_dtype} is not implemented by the runtime; use bf16 or fp32")
    for name in ("grad_dtype", "optim_dtype"):
        if getattr(layout, name) != "fp32":
            problems.append(f"{name}={getattr(layout, name)} is not implemented by the runtime (fp32 master state); "
                            f"use {name}=fp32")
    # (a vocabulary tp does not divide is padded: tensor.padded_vocab_size)
    if layout.sp and layout.tp > 1 and spec.position_kind == "learned":
        problems.append("sequence parallelism with learned positions (gpt2) is not supported; drop sp")
    if spec.position_kind == "learned" and layout.seq > spec.max_position:
        problems.append(f"seq={layout.seq} exceeds the {spec.max_position} learned positions of {spec.name}; "
                        f"use seq <= {spec.max_position}")
    # (sequence parallelism's seq/cp divisible by tp is Layout.validate's)
    if layout.cp > 1 and spec.sliding_layers and spec.sliding_window < layout.seq:
        problems.append(f"cp={layout.cp}: ring attention has no sliding window ({spec.sliding_window} tokens < "
                        f"seq {layout.seq}); use cp=1 or seq <= {spec.sliding_window}")
    if layout.cp > 1 and spec.rope_parameters.get("rope_type") == "dynamic" and layout.seq > spec.max_position:
        problems.append(f"cp={layout.cp}: dynamic rope past max_position {spec.max_position} needs the whole "
                        f"sequence's length on every rank; use cp=1 or seq <= {spec.max_position}")
    if layout.pp > 1:  # schedule / micro-batch / stage-count rules of torch's schedules
        from modelcarve.runtime.pipeline_split import pipeline_problems

        problems += pipeline_problems(layout, spec.num_layers)
    if problems:
        raise LayoutError("; ".join(problems))


def parallelize(model: nn.Module, layout: Layout, mesh) -> list[nn.Module]:
    """Apply every parallelism of ``layout`` to ``model`` (consumed) on this rank; returns its chunks."""
    from modelcarve.runtime.data_parallel import apply_data_parallel
    from modelcarve.runtime.mesh import axis_rank
    from modelcarve.runtime.tensor import apply_tensor_parallel

    check_runtime(layout, model.spec)
    create_groups(mesh, layout, model.spec)
    if layout.pp > 1:
        from modelcarve.runtime.pipeline import split_model

        chunks = list(split_model(model, layout, axis_rank(mesh, "pp")))
    else:
        chunks = [model]
    for chunk in chunks:
        apply_tensor_parallel(chunk, mesh, layout)
    if layout.ep > 1:
        from modelcarve.runtime.expert import apply_expert_parallel

        for chunk in chunks:
            apply_expert_parallel(chunk, mesh, layout)
    if layout.cp > 1:
        from modelcarve.runtime.context import apply_context_parallel

        for chunk in chunks:
            apply_context_parallel(chunk, mesh, layout)
    for chunk in chunks:
        apply_recompute(chunk, layout.recompute)
    apply_data_parallel(chunks, mesh, layout)
    return chunks


def create_groups(mesh, layout: Layout, spec: ModelSpec) -> None:
    """Create every process group the parallelisms will ask for, now, in one order, on every rank.

    ``new_group`` (and a ``DeviceMesh``) is a collective over the whole world: a group first
    asked for lazily by a rank whose stage needs it (a pipeline stage holding only dense
    layers skips the expert groups) would leave the other ranks waiting, or pair mismatched
    groups. Later calls find these in their caches."""
    from modelcarve.runtime.mesh import merged_mesh

    if layout.dp * layout.cp > 1:
        merged_mesh(mesh, "dp_cp")
        if layout.dp_shard and layout.dp_shard < layout.dp:
            merged_mesh(mesh, "dp_cp", hsdp_shard=layout.dp_shard * layout.cp)
    if layout.ep > 1 and spec.is_moe:
        from modelcarve.runtime.expert import expert_groups

        expert_groups(mesh, layout)
        if layout.folded and layout.tp > 1:  # expert.py: stats over every rank of a stage, aux loss over cp x tp
            merged_mesh(mesh, "dp_cp_tp")
            if layout.cp > 1:
                merged_mesh(mesh, "cp_tp")


def _checkpoint_forward(module: nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


def apply_recompute(chunk: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for block in chunk.layers.values():
        if mode == "full":
            _checkpoint_forward(block)
        elif mode == "selective":
            _checkpoint_forward(block.attention.core_attention)
        else:
            raise LayoutError(f"recompute={mode!r} is not one of: none, selective, full")
