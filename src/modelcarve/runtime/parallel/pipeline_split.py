"""Pipeline split: which decoder layers, embeddings and head each pipeline stage holds.

Pure module surgery on the reference ``Transformer`` (runtime/model/transformer.py); no collectives, so it
also runs without a process group. ``pipeline.py`` turns the chunks into
``torch.distributed.pipelining`` stages and runs the schedules.

Stages and ranks
----------------
``num_stages = pp * virtual_stages``. Stage ``s`` lives on pipeline rank ``s % pp``: with
``virtual_stages = v`` rank ``r`` holds the ``v`` chunks for stages ``r, r + pp, r + 2 pp, ...``
(the interleaved placement of Megatron's virtual pipeline and of torch's
``ScheduleInterleaved1F1B``). Each stage holds a contiguous run of layers; the token (and, for
gpt2, position) embedding sits on stage 0, the final norm and the LM head on the last stage.
Every chunk is a ``Transformer`` whose absent parts are ``None`` and whose ``layers`` keeps
only its own keys, so parameter FQNs equal the unsplit model's (``layers.5.attention.wq.weight``
stays that name on whichever stage holds layer 5).

How many layers per stage
-------------------------
Explicit: ``layers_per_stage=[3, 5, 4, 4]`` (one count per stage, in stage order, each >= 1
but the first and the last, which may hold only the embedding and the head, summing to the layer
count). Default: spec/stages.py's :func:`balance_layers` (re-exported
here), the one split every planner prices too: the embedding and the LM head cost one layer
each on the first and last stage (Megatron-LM's ``--account-for-embedding-in-pipeline-split``
/ ``--account-for-loss-in-pipeline-split``). 6 layers on 4 stages: [1, 2, 2, 1]; 126 layers on
16 stages: [7] + [8] * 14 + [7]; with more stages than layers the first and the last stage may
hold only the embedding and the head (4 layers on 6 stages: [0, 1, 1, 1, 1, 0]).

Tied embeddings
---------------
With ``spec.tied_embeddings`` the LM head reuses the token-embedding matrix. When the first and
the last stage are different chunks, the last chunk gets its own ``output`` Linear holding a
copy of the embedding weight (as Megatron-LM does) and records it (shards.py's
``record_tied_copy``: ``{"output.weight": "tok_embeddings.weight"}``). The pipeline runner
(``pipeline.py``) then sums the two gradients over a group made of the first- and last-stage
ranks after every step, so both copies receive the full gradient and stay equal under any
optimiser. Gradient-norm code must count the copy once: skip the parameters named by
shards.py's ``tied_copy_names``. Checkpoint loaders fill ``output.weight`` of such a chunk from
``tok_embeddings.weight`` (the checkpoint has only one of them).

Memory: chunks share their modules with the input model (no parameter is copied, except the
tied head above); drop your reference to the whole model afterwards so the layers of other
stages can be freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from modelcarve.runtime.distributed.shards import record_tied_copy
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout
from modelcarve.spec.stages import balance_layers, rank_stage_ids, stage_counts

__all__ = [
    "balance_layers", "check_layers_per_stage", "num_stages", "split_model",
    "stage_ids", "stage_layer_ranges",
]


def num_stages(layout: Layout) -> int:
    return layout.pp * layout.virtual_stages


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``, in order: ``pp_rank + i * pp``."""
    return rank_stage_ids(layout.pp, layout.virtual_stages, pp_rank)


def check_layers_per_stage(layers_per_stage: Sequence[int], num_layers: int, stages: int) -> list[int]:
    counts = [int(c) for c in layers_per_stage]
    if len(counts) != stages:
        raise LayoutError(
            f"layers_per_stage has {len(counts)} entries but the layout has pp x virtual_stages = {stages} "
            f"stages; give one count per stage"
        )
    middle = counts[1:-1]
    if min(counts) < 0 or (middle and min(middle) < 1) or sum(counts) != num_layers:
        raise LayoutError(
            f"layers_per_stage={counts} must be counts >= 1 (0 allowed for the first and the last stage, which "
            f"hold the embedding and the head) summing to the model's {num_layers} layers (they sum to {sum(counts)})"
        )
    return counts


def stage_layer_ranges(
    num_layers: int,
    layout: Layout,
    *,
    layers_per_stage: Sequence[int] | None = None,
    embed_cost: float = 1.0,
    head_cost: float = 1.0,
) -> list[range]:
    """For every stage (in stage order) the range of layer indices it holds."""
    stages = num_stages(layout)
    if layers_per_stage is not None:
        counts = check_layers_per_stage(layers_per_stage, num_layers, stages)
    elif embed_cost == 1.0 and head_cost == 1.0:
        counts = stage_counts(num_layers, layout.pp, layout.virtual_stages)  # the split the planners price
    else:
        counts = balance_layers(num_layers, stages, embed_cost=embed_cost, head_cost=head_cost)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def split_model(
    model: nn.Module,
    layout: Layout,
    pp_rank: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
    embed_cost: float = 1.0,
    head_cost: float = 1.0,
) -> list[nn.Module]:
    """The chunks pipeline rank ``pp_rank`` holds, one per virtual stage, in stage order.

    Each chunk is a ``Transformer`` sharing modules with ``model`` and carrying
    ``stage_index``, ``num_stages`` and ``layer_ids``; with pp x virtual_stages == 1 the
    model itself is returned (as the single chunk, with those attributes set).
    """
    layer_keys = list(model.layers.keys())
    ranges = stage_layer_ranges(
        len(layer_keys), layout, layers_per_stage=layers_per_stage, embed_cost=embed_cost, head_cost=head_cost
    )
    stages = len(ranges)
    chunks = []
    for stage in stage_ids(layout, pp_rank):
        keys = [layer_keys[i] for i in ranges[stage]]
        chunk = model if stages == 1 else _make_chunk(model, keys, first=stage == 0, last=stage == stages - 1)
        chunk.stage_index = stage
        chunk.num_stages = stages
        chunk.layer_ids = [int(k) for k in keys]
        chunks.append(chunk)
    return chunks


def _make_chunk(model: nn.Module, keys: list[str], *, first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` holding only ``keys`` of its layers and the ends it owns."""
    # A fresh Module (own hook and child dicts: FSDP2/TP hooks on one chunk must not reach the
    # others) sharing the children and the plain attributes (spec, rope_dim) of ``model``.
    chunk = type(model).__new__(type(model))
    nn.Module.__init__(chunk)
    for key, value in model.__dict__.items():
        if not key.startswith("_") and key != "training":
            chunk.__dict__[key] = value
    chunk.train(model.training)
    for name, param in model._parameters.items():
        chunk.register_parameter(name, param)
    for name, buf in model._buffers.items():
        chunk.register_buffer(name, buf, persistent=name not in model._non_persistent_buffers_set)
    chunk._modules.update(model._modules)
    chunk.layers = nn.ModuleDict({key: model.layers[key] for key in keys})
    if not first:
        chunk.tok_embeddings = None
        if getattr(model, "pos_embeddings", None) is not None:
            chunk.pos_embeddings = None
    if not last:
        chunk.norm = None
        chunk.output = None
    elif not first and _is_tied(model):
        weight = model.tok_embeddings.weight
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
        head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        chunk.output = head
        record_tied_copy(chunk, "output.weight", "tok_embeddings.weight")
    return chunk


def _is_tied(model: nn.Module) -> bool:
    output, emb = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    return output is not None and emb is not None and output.weight is emb.weight
