"""Which decoder layers each pipeline stage and each pipeline rank holds: the one split.

The runtime builds it (runtime/parallel/pipeline_split.py cuts the reference model with it) and
every planner prices it (plan/train/model.py, plan/serve/memory.py, plan/predict/step_traffic.py,
runtime/dryrun/state_bytes.py's prediction), so a layout's stages hold, in the plan, exactly
what they hold when it runs. Pure Python, no torch.

Stages and ranks
----------------
``num_stages = pp * v`` (``v`` virtual stages per rank). Stage ``s`` lives on pipeline rank
``s % pp``: rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` (Megatron's interleaved virtual
pipeline, torch's ``ScheduleInterleaved1F1B``). Each stage holds a contiguous run of layers in
stage order. The token (and position) embedding sits on stage 0, so on rank 0; the final norm
and the LM head on the last stage, so on rank ``pp - 1``.

How many layers per stage
-------------------------
:func:`balance_layers` minimises the costliest stage when a decoder layer costs 1 and the
embedding and the LM head cost ``embed_cost`` and ``head_cost`` layers on top of the first and
last stage (both 1 by default: Megatron-LM's ``--account-for-embedding-in-pipeline-split`` /
``--account-for-loss-in-pipeline-split``); among the splits with that lowest maximum it takes
the most even layer counts, and on ties gives the extra layer to a later stage (under 1F1B the
early stages keep more micro-batches' activations alive). 126 layers on 16 stages:
[7] + [8] * 14 + [7]; 96 on 8: [12] * 8; 6 on 4: [1, 2, 2, 1]; 5 on 2: [2, 3].

Every middle stage holds at least one layer. The first and the last stage may hold none when
the embedding or the LM head fills them (a cost above 0): as Megatron-LM does under the same two
flags, where ``num_layers + 2`` slots split over ``pp x v`` stages. Megatron-Bridge's Llama 3.1
405B recipe sets both and runs 126 layers on pp=16 x v=8 = 128 virtual stages: the first holds
the embedding alone, the last the final norm and head alone, [0] + [1] * 126 + [0]. So at most
``num_layers + 2`` stages (:func:`max_stages`); with fewer stages than layers nothing changes.

The default split is cached per (num_layers, pp, v): the planners ask for it per candidate.
"""

from __future__ import annotations

from functools import lru_cache

from modelcarve.spec.errors import LayoutError

__all__ = [
    "balance_layers", "stage_counts", "stage_ranges", "rank_stage_ids", "rank_layer_ids", "rank_layers",
    "rank_holdings", "stage_kind", "EMBEDDING_RANK", "max_stages", "stage_count_problem", "split_costs",
    "megatron_layout", "parse_megatron_layout", "layout_holdings", "uneven_layout", "planned_layout",
]

EMBEDDING_RANK = 0
"""The pipeline rank holding the embedding (stage 0); the LM head is on rank ``pp - 1``."""


def _least_layers(num_layers: int, num_stages: int, embed_cost: float, head_cost: float) -> list[int]:
    """Fewest layers each stage may hold: one; with more stages than layers, none for an end
    stage its embedding or head fills (with as many layers as stages, every split stays as it was)."""
    least = [1] * num_stages
    if 1 < num_stages and num_layers < num_stages:
        least[0] = 0 if embed_cost > 0 else 1
        least[-1] = 0 if head_cost > 0 else 1
    return least


def max_stages(num_layers: int, *, embed_cost: float = 1.0, head_cost: float = 1.0) -> int:
    """Most pipeline stages (pp x virtual stages) ``num_layers`` layers can fill: every middle stage
    needs a layer; the first and last may hold only the embedding / the head (module doc)."""
    return num_layers + (1 if embed_cost > 0 else 0) + (1 if head_cost > 0 else 0)


def stage_count_problem(num_layers: int, num_stages: int) -> str | None:
    """Why ``num_stages`` pipeline stages cannot split ``num_layers`` layers (None when they can),
    with the fix: the one rule the layout check, the runtime's pre-launch check and the split share."""
    most = max_stages(num_layers)
    if num_stages <= most:
        return None
    return (f"pp x virtual_stages = {num_stages} stages but the model has {num_layers} layers: every stage "
            f"but the first and the last needs one (those two may hold only the embedding and the head); "
            f"lower pp x virtual_stages to at most {most}")


def balance_layers(
    num_layers: int, num_stages: int, *, embed_cost: float = 1.0, head_cost: float = 1.0
) -> list[int]:
    """Layer count per stage minimising the costliest stage (see the module doc for the costs)."""
    if embed_cost < 0 or head_cost < 0:
        raise LayoutError(f"embed_cost={embed_cost} and head_cost={head_cost} must be >= 0")
    least = _least_layers(num_layers, max(num_stages, 1), embed_cost, head_cost)
    if num_stages < 1 or num_layers < sum(least):
        most = max_stages(num_layers, embed_cost=embed_cost, head_cost=head_cost)
        raise LayoutError(
            f"{num_layers} layers cannot fill {num_stages} pipeline stages (every stage but an end one its "
            f"embedding or head fills needs at least one layer); lower pp x virtual_stages to at most {most}"
        )
    extra = [0.0] * num_stages
    extra[0] += embed_cost
    extra[-1] += head_cost

    def capacity(limit: float) -> list[int]:
        # Most layers each stage can take without costing more than ``limit``.
        return [int(limit - e + 1e-9) for e in extra]

    candidates = sorted({n + e for n in range(0, num_layers + 1) for e in extra})
    for limit in candidates:
        caps = capacity(limit)
        if all(c >= m for c, m in zip(caps, least)) and sum(caps) >= num_layers:
            break
    # Among the splits within that limit, the most even layer counts: fill one layer at a time
    # into the stage with the fewest layers that still has room (latest stage on ties: under
    # 1F1B the early stages keep more micro-batches' activations alive).
    counts = list(least)
    for _ in range(num_layers - sum(least)):
        room = [i for i in range(num_stages) if counts[i] < caps[i]]
        counts[min(room, key=lambda i: (counts[i], -i))] += 1
    return counts


@lru_cache(maxsize=4096)
def stage_counts(num_layers: int, pp: int, v: int = 1, embed_cost: float = 1.0, head_cost: float = 1.0) -> tuple[int, ...]:
    """Layers of every stage (``pp * v`` of them, in stage order) under the default split (with
    other ``embed_cost`` / ``head_cost``: a planner's, see :func:`split_costs`)."""
    return tuple(balance_layers(num_layers, pp * v, embed_cost=embed_cost, head_cost=head_cost))


@lru_cache(maxsize=4096)
def stage_ranges(num_layers: int, pp: int, v: int = 1, embed_cost: float = 1.0, head_cost: float = 1.0) -> tuple[range, ...]:
    """The layer indices of every stage, in stage order, under the default split."""
    out, start = [], 0
    for count in stage_counts(num_layers, pp, v, embed_cost, head_cost):
        out.append(range(start, start + count))
        start += count
    return tuple(out)


def rank_stage_ids(pp: int, v: int, pp_rank: int) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``, in order: ``pp_rank + i * pp``."""
    if not 0 <= pp_rank < pp:
        raise LayoutError(f"pp_rank={pp_rank} is outside 0..{pp - 1} for pp={pp}")
    return [pp_rank + i * pp for i in range(v)]


@lru_cache(maxsize=4096)
def rank_layer_ids(num_layers: int, pp: int, v: int = 1, embed_cost: float = 1.0,
                   head_cost: float = 1.0) -> tuple[tuple[int, ...], ...]:
    """For every pipeline rank the layer indices it holds over all its virtual stages."""
    ranges = stage_ranges(num_layers, pp, v, embed_cost, head_cost)
    return tuple(tuple(i for s in rank_stage_ids(pp, v, r) for i in ranges[s]) for r in range(pp))


@lru_cache(maxsize=4096)
def rank_layers(num_layers: int, pp: int, v: int = 1) -> tuple[int, ...]:
    """Layers held by every pipeline rank, summing its virtual stages."""
    return tuple(len(ids) for ids in rank_layer_ids(num_layers, pp, v))


def rank_holdings(num_layers: int, pp: int, v: int, moe_layers: frozenset, embed_cost: float = 1.0,
                  head_cost: float = 1.0) -> tuple[tuple[int, int], ...]:
    """For every pipeline rank (layers, MoE layers among them); ``moe_layers`` the MoE layer indices
    (dense first layers, e.g. DeepSeek-V3's ``first_k_dense``, count on the rank that holds them)."""
    return _holdings(num_layers, pp, v, frozenset(moe_layers), embed_cost, head_cost)


@lru_cache(maxsize=4096)
def _holdings(num_layers: int, pp: int, v: int, moe_layers: frozenset, embed_cost: float = 1.0,
              head_cost: float = 1.0) -> tuple[tuple[int, int], ...]:
    return tuple((len(ids), sum(1 for i in ids if i in moe_layers))
                 for ids in rank_layer_ids(num_layers, pp, v, embed_cost, head_cost))


def split_costs(split_embedding: bool = True, mtp_layers: int = 0) -> tuple[float, float]:
    """``(embed_cost, head_cost)`` of the split a training run uses: the embedding one layer when
    ``split_embedding`` (Megatron-LM's ``--account-for-embedding-in-pipeline-split``), none otherwise;
    the loss one layer (``--account-for-loss-in-pipeline-split``) and each multi-token-prediction
    depth two more (its decoder layer, and its pass of the shared LM head and loss). The costs of
    Megatron-Bridge's DeepSeek-V3 layouts (``set_deepseek_v3_pipeline_model_parallel_layout`` at
    v0.3.1 / v0.4.2, one MTP depth): ``split_costs(False, 1) = (0, 3)`` gives exactly its
    [16, 16, 16, 13] on pp=4, [8] * 7 + [5] on pp=8 and [4] * 15 + [1] on 16 stages, the last
    stage's MTP depth and loss filling three layers' room (tests/spec/test_stages.py). The runtime
    runs neither (it always splits with the defaults)."""
    return (1.0 if split_embedding else 0.0), 1.0 + 2.0 * mtp_layers


def stage_kind(pp_rank: int, pp: int) -> str:
    """``only`` (no pipeline), ``first`` (the embedding's rank), ``last`` (the head's) or ``middle``."""
    if pp == 1:
        return "only"
    return "first" if pp_rank == EMBEDDING_RANK else "last" if pp_rank == pp - 1 else "middle"


def megatron_layout(num_layers: int, pp: int, v: int = 1, embed_cost: float = 1.0, head_cost: float = 1.0,
                    mtp_layers: int = 0) -> str:
    """The split as Megatron-Core's ``--pipeline-model-parallel-layout`` string: one ``|``-separated
    entry per stage in stage order (``stage = vpp_rank x pp + pp_rank``, as
    megatron/core/transformer/pipeline_parallel_layer_layout.py indexes it), ``E`` the embedding, ``t``
    a decoder layer (``t*k`` for k of them), ``m`` an MTP depth, ``L`` the loss: what a launch passes
    so that Megatron builds the stages the planner priced (its own rules need the layer count to
    divide evenly; a layout string does not)."""
    return _layout_string(stage_counts(num_layers, pp, v, embed_cost, head_cost), mtp_layers)


def _layout_string(counts, mtp_layers: int) -> str:
    """Megatron-Core's layout string of decoder layers ``counts`` per stage (stage order), the embedding
    on the first stage, the MTP depths and the loss on the last."""
    out = []
    for s, n in enumerate(counts):
        body = ("E" if s == 0 else "") + ("t" if n == 1 else f"t*{n}" if n else "")
        out.append(body + ("m" * mtp_layers + "L" if s == len(counts) - 1 else ""))
    return "|".join(out)


def planned_layout(num_layers: int, pp: int, v: int, *, layout: str = "", first: int = 0, last: int = 0,
                   split_embedding: bool = True, mtp_layers: int = 0) -> str:
    """The layout string of the split a training run prices, the one rule the training planner and the
    Megatron launch share: ``layout`` as stated (``--pipeline-model-parallel-layout``), else Megatron's
    uneven split when ``first`` / ``last`` are given (:func:`uneven_layout`), else the balanced split of
    :func:`split_costs`."""
    if layout:
        return layout
    if first or last:
        return uneven_layout(num_layers, pp, v, first, last, mtp_layers)
    return megatron_layout(num_layers, pp, v, *split_costs(split_embedding, mtp_layers), mtp_layers=mtp_layers)


def parse_megatron_layout(text: str, pp: int) -> tuple[tuple[int, ...], int]:
    """(decoder layers per stage, MTP depths) of a Megatron-Core layout string (``E``, ``t``, ``m``,
    ``L``, ``|`` and ``x*k`` / ``(...)*k`` repetition, as PipelineParallelLayerLayout.parse_str_to_list
    reads it); ``LayoutError`` in one line for anything else, or when the stages do not divide over ``pp``
    ranks, the embedding is not first, or MTP and the loss are not last."""
    import re

    src = text.replace(" ", "").replace(",", "")
    for _ in range(32):  # unroll (...)*k, innermost first
        m = re.search(r"\(([^()]*)\)\*(\d+)", src)
        if m is None:
            break
        src = src[:m.start()] + m.group(1) * int(m.group(2)) + src[m.end():]
    src = re.sub(r"([EtmL])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), src)
    if not src or set(src) - set("EtmL|"):
        raise LayoutError(f"pipeline layout {text!r}: use E (embedding), t (a decoder layer), m (an MTP depth), "
                          f"L (the loss), | between stages and x*k or (...)*k for repeats, e.g. Et*4|t*4|t*3mL")
    stages = src.split("|")
    if len(stages) % pp:
        raise LayoutError(f"pipeline layout {text!r} has {len(stages)} stages, not a multiple of pp={pp}")
    body = "".join(stages)
    if body.count("E") != 1 or not stages[0].startswith("E") or body.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"pipeline layout {text!r}: the embedding E must open the first stage and the loss L "
                          f"close the last, once each")
    mtp = stages[-1].count("m")
    if body.count("m") != mtp or not stages[-1].endswith("m" * mtp + "L"):
        raise LayoutError(f"pipeline layout {text!r}: MTP depths m belong just before the loss L on the last stage")
    return tuple(st.count("t") for st in stages), mtp


@lru_cache(maxsize=256)
def layout_holdings(text: str, num_layers: int, pp: int, v: int, moe_layers: frozenset) -> tuple:
    """``(rank holdings, stage counts, MTP depths)`` of a Megatron-Core layout string for a model of
    ``num_layers`` on ``pp`` ranks x ``v`` virtual stages: each rank's (layers, MoE layers) over its
    stages (stage ``s`` on rank ``s % pp``), as :func:`rank_holdings` gives them for the balanced
    split. ``LayoutError`` in one line when the string names another stage or layer count."""
    counts, mtp = parse_megatron_layout(text, pp)
    if len(counts) != pp * v:
        raise LayoutError(f"pipeline layout {text!r} has {len(counts)} stages; this layout has pp x v = {pp} x {v} = "
                          f"{pp * v}")
    if sum(counts) != num_layers:
        raise LayoutError(f"pipeline layout {text!r} names {sum(counts)} decoder layers; the model has {num_layers}")
    starts = [sum(counts[:s]) for s in range(len(counts))]
    held = []
    for r in range(pp):
        ids = [i for s in rank_stage_ids(pp, v, r) for i in range(starts[s], starts[s] + counts[s])]
        held.append((len(ids), sum(1 for i in ids if i in moe_layers)))
    return tuple(held), counts, mtp


def uneven_layout(num_layers: int, pp: int, v: int, first: int = 0, last: int = 0, mtp_layers: int = 0) -> str:
    """Megatron-LM's uneven split as a layout string: ``--decoder-first-pipeline-num-layers first`` on
    pipeline rank 0 and ``--decoder-last-pipeline-num-layers last`` on rank ``pp - 1`` (0: that end not
    given), the other ranks the rest evenly, each rank's layers evenly over its ``v`` virtual stages, as
    megatron/core/transformer/transformer_config.py (core_v0.15.3) splits them; ``LayoutError`` in one
    line where Megatron raises (a count that does not divide, an end with no layers, pp < 2)."""
    if pp < 2:
        raise LayoutError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size >= 2")
    ranks = [0] * pp
    rest, middle = num_layers, pp
    for rank, count, flag in ((0, first, "first"), (pp - 1, last, "last")):
        if count:
            if count % v:
                raise LayoutError(f"--decoder-{flag}-pipeline-num-layers {count} must divide by the {v} virtual stages")
            ranks[rank], rest, middle = count, rest - count, middle - 1
    if rest < 0 or (middle and rest % middle) or (middle and (rest // middle) % v) or (not middle and rest):
        raise LayoutError(f"{num_layers} layers less the first / last stages' {first} / {last} leave {rest} for "
                          f"{middle} middle ranks: Megatron needs them to divide evenly (and by the {v} virtual stages)")
    for r in range(pp):
        if not ((r == 0 and first) or (r == pp - 1 and last)):
            ranks[r] = rest // middle if middle else 0
    return _layout_string([ranks[s % pp] // v for s in range(pp * v)], mtp_layers)
