"""The per-op forecast of one rank of a mixture-of-experts model (expert parallelism included).

``forecast_rank`` is step_traffic's ``predict_rank`` for any model: an MoE model goes to
``predict_moe_rank`` (step_traffic still raises NotModelled for one, so nothing silently takes
the dense formulas for it), every other to step_traffic. For an MoE model the attention, the
norms, the embedding and head, tensor parallelism and the scalars are step_traffic's own formulas,
the MoE blocks are this module's. What the runtime does (runtime/model/moe.py,
runtime/parallel/expert.py, data_parallel.py, zero_optimizer.py), with ``E`` experts, ``k`` the
top-k, ``F`` the expert ffn size, ``H`` the hidden size, ``ep`` / ``etp`` (= tp, or 1 on a folded mesh) / ``edp``
the expert mesh (spec/ranks.py), on one rank:

* parameters of an MoE layer: the router ``[E, H]`` (replicated over tp, its gradient a partial
  sum all-reduced over tp once per step, fp32), the local experts ``w1, w3 [E/ep, F/etp, H]`` and
  ``w2 [E/ep, H, F/etp]``, shared experts (a SwiGLU of ``num_shared x F``, split over tp like the
  dense MLP), the attention and norms of a dense layer;
* gradients: the experts' (ep > 1) summed over the expert-data-parallel group (``record_grad_group``),
  everything else over dp x cp; ZeRO-1/2 make one flat bucket per such group (zero_optimizer.py:
  padded to a multiple of its group's size, reduce-scattered and all-gathered only when that group
  has more than one rank, an fp32 master range, two moments and one step counter per bucket);
* the EP all-to-alls (``AllToAllDispatcher``), per MoE layer and micro-batch: the int64 count
  matrix ``[ep, E/ep]`` (``8 E`` bytes, ``(ep-1)/ep`` of it to others), the dispatched rows
  (``send_splits``: the rows this rank's tokens route to each EP rank's experts), the combined
  rows back (``recv_splits``: the rows this rank's experts received), and in backward the same
  two reversed; each ``H`` wide in the dtype of the tensor carried. The rows depend on the
  routing, so the prediction is given it: ``routing[global rank]`` = the ``[E]`` rows per global
  expert that rank's router sent, one list per dispatcher call (the runtime's call order: micro-
  batch, then layer; under a multi-chunk schedule the executed forwards', ``forward_calls``),
  recorded by verify/against_plan.py. Beside it, ``all_to_all_apriori``:
  the same bytes at uniform routing (``T k / ep`` rows to each EP rank) times the planner's load-
  imbalance factor (``LOAD_IMBALANCE``, plan/train/model.py's ``TrainOptions.load_imbalance``), reported only;
* activations: plan/predict/moe_activations.py (the rows each MoE layer's experts received, from the routing);
* under bf16 autocast the block's combined output is fp32, so its forward tp reduction carries fp32;
* a folded expert mesh (etp != tp, expert.py ``_apply_folded``): the MoE blocks are not split over
  tp (their two row/column reductions per micro-batch go, ``tp_messages(mlp_layers=...)``), every
  non-expert MoE parameter (router, shared experts) is a partial sum over tp, each TP rank routes
  ``T / tp`` tokens, and without sp the block all-gathers its output and its input's gradient
  (``_GatherTokens`` forward, ``_ScatterTokens`` backward; taking the rank's slice sends nothing).
  Under ``recompute=full`` the recomputed block stops at its last saved tensor, the combine, before
  the output all-gather: the EP exchanges run again (below), the all-gather does not. Under cp each
  TP rank routes its ``1 / tp`` of the rank's zig-zag tokens, the EP group carved from the cp x tp
  ranks.
* expert TP of a folded mesh (etp > 1, ``etp_messages``): the experts' ``w1/w3`` columns and ``w2`` rows
  split over the ETP group (spec/ranks.py: ETP innermost, then EP, then EDP over the stage's
  ``tp x cp x dp`` ranks); per dispatcher call, after the EP exchange, FoldedDispatcher all-gathers
  the ETP peers' ``[E/ep]`` int64 local counts, sends each peer a copy of the ``n`` rows this rank
  received and gets back the partial outputs of its rows from each (``etp x n`` and ``sum(sizes)``
  rows, ``sizes`` the peers' ``n``, read off the recorded routing), both reversed in backward;
  its experts run on the whole ETP group's rows (moe_activations.expert_rows);
* ``etp`` != ``tp`` without expert parallelism is refused: the runtime builds an expert mesh only
  under EP (``folded`` needs ep > 1) and refuses it (spec/support.py ``runtime_problems``), while
  the full-scale planner prices Megatron's fold (the experts split etp-way only).

Pipelines: each rank its stages' layers (spec/stages.py ``rank_layer_ids``, dense first layers
where they fall), step_traffic's sends (every chunk's under an interleaved schedule), loss broadcast
and tied-embedding sum, and the activations of the micro-batches in flight (GPipe / 1F1B); under an
interleaved 1F1B or zero-bubble schedule the activations follow the rank's executed actions
(``order``, recorded by the runtime; else timeline.action_order), each forward holding its own
stage's micro-batch (moe_activations.moe_scheduled_activation_bytes). The recorded routing is one
list per dispatcher call in execution order, so a call's (stage, micro-batch) is read off that order
too (``forward_calls``). FSDP2 / HSDP: ``fsdp_messages`` (the experts their own unit over expert-dp
under EP). Context parallelism: each rank routes its ``mbs x seq / cp`` zig-zag tokens (the EP group
is carved from the dp x cp ranks, so the all-to-alls may run over cp), ring attention's sends in every
layer (step_traffic.ring_sends), the gradients over dp x cp; the aux loss, unused (coefficient 0), is
skipped by the block under cp (moe.py), so it saves nothing. ZeRO-1/2 with dp_shard (HSDP-style,
data_parallel.build_optimizer): the dense bucket is padded to and reduce-scattered / all-gathered in
its ``dp_shard x cp`` shard group, its owned range then all-reduced over the replicas
(step_traffic.shard_groups); EP's expert bucket stays over expert-dp, unreplicated. Recomputation:
``recompute=full`` re-runs each block's forward in the backward up to its last saved tensor, past
the combine, so each EP dispatcher call's count exchange, dispatch and combine run twice (the tp
messages: step_traffic.tp_messages' rule), and under the zero-bubble schedule on every stage but the
first once more per weight group of W (step_traffic.layer_recomputations: 2 + 10 runs a call on
tiny-moe's last stage, pp=2 x dp=2 x ep=2: 2,096,128 / 1,324,032 bytes of all-to-all measured and
predicted on ranks 2 / 3); ``selective`` recomputes no collective; the activations:
moe_activations.moe_recompute_peak (interleaved 1F1B and zero-bubble: the executed order walked,
activations.py's ``scheduled_recompute_peak`` with each micro-batch's own routing). (Ring attention
under recomputation is modelled: step_traffic.ring_sends' third pass, activations.py's ring terms.)
The folded mesh (etp=1, tp=2) under recomputation and cp is these same rules (checked on gloo ranks,
tests/verify/test_verify_against_plan_folded.py: tiny-moe and the tiny Qwen3-MoE, full and selective,
tp and tp x sp, pp=2 1F1B, tp x dp x ep=4, cp=2 x tp=2 with ep 2 and 4: bytes to the byte, fp32
activations within 156 bytes; tiny-moe tp=2,ep=2,etp=1 full: 216,064 / 179,200 bytes of all-to-all on
ranks 0 / 1, 116,120 / 91,464 bytes of activations measured against 116,136 / 91,480 predicted).
Expert TP on a folded mesh is checked on gloo ranks (tests/verify/test_verify_against_plan_etp.py:
tiny-moe tp=4,ep=2,etp=2 with and without sp, full and selective recomputation, bf16; dp=4,ep=2,etp=2
under ZeRO-1; cp=2 x dp=2; the tiny Qwen3-MoE): every byte equal, activations as elsewhere (+100 bytes
on tiny-moe tp=4 in fp32 and bf16: the aux loads over, the masks under). Not covered (``NotModelled``,
and refused by the runtime): ``etp`` != ``tp`` under ep = 1.
DeepSeek-V3's sigmoid, group-limited router is priced with the softmax router's saved tensors
(its own differ by a few hundred bytes a layer: 0.4-1.5% of a rank's activations on the tiny
deepseek_v3 checkpoint, tests/verify/test_verify_against_plan_mla.py); the bytes do not depend on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelcarve.plan.predict import step_traffic as st
from modelcarve.plan.predict.moe_activations import moe_rank_activation_bytes, moe_scheduled_activation_bytes, rank_tokens
from modelcarve.plan.predict.timeline import action_order
from modelcarve.spec.ranks import coords, expert_coords, expert_group_along, group_along
from modelcarve.spec.stages import rank_layer_ids, rank_stage_ids, stage_ranges
from modelcarve.spec.support import held_param_dtype

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec

LOAD_IMBALANCE = 1.25
"""The training planner's busiest-rank / mean token factor (plan/train/model.py ``TrainOptions.
load_imbalance``; restated: plan/predict may not import plan/train; a test holds them equal)."""
COUNT_BYTES = 8  # the int64 count matrix


@dataclass(frozen=True)
class SplitMessage(st.Message):
    """An all-to-all of uneven splits: ``sent`` of each call's ``payload`` bytes leave the rank
    (the comm log's wire: payload minus this rank's own split)."""

    sent: int = 0

    def wire(self) -> float:
        return float(self.sent * self.calls)


def forecast_rank(spec: "ModelSpec", layout: "Layout", rank: int, *, stage_layers: int | None = None,
                  routing: dict | None = None, order: list | None = None) -> st.RankPrediction:
    """``step_traffic.predict_rank``, or ``predict_moe_rank`` for an MoE model (``routing``: the
    measured dispatcher counts, needed under expert parallelism; ``order``: the pipeline schedule's
    executed actions, which the zero-bubble schedule's activations need)."""
    if spec.is_moe:
        return predict_moe_rank(spec, layout, rank, stage_layers=stage_layers, routing=routing, order=order)
    return st.predict_rank(spec, layout, rank, stage_layers=stage_layers, order=order)


def check_moe_supported(spec: "ModelSpec", layout: "Layout") -> None:
    """step_traffic's checks on the model's dense equivalent, then what this module leaves out."""
    st._check_supported(dense_equivalent(spec), layout.replace(ep=1, etp=0))
    if layout.ep == 1 and layout.expert_tp != layout.tp:
        raise st.NotModelled(f"not modelled per op: etp={layout.expert_tp} != tp={layout.tp} without expert "
                             "parallelism (the training runtime does not run it: spec/support.runtime_problems)")


def dense_equivalent(spec: "ModelSpec") -> "ModelSpec":
    """The spec with its MoE fields cleared (for step_traffic's dense checks)."""
    return dataclasses.replace(spec, num_experts=0, top_k=0, num_shared_experts=0, expert_ffn_size=0, moe_layers=())


def moe_layer_tensors(spec: "ModelSpec", layout: "Layout") -> tuple[list[int], list[int]]:
    """(tensors reduced over dp x cp, expert tensors) of one MoE layer on a rank: a dense layer's
    attention and norms (step_traffic.layer_tensors without its MLP), the router, shared experts;
    the local routed experts."""
    tp, h = layout.tp, spec.hidden_size
    dense = list(st.layer_tensors(spec, tp))
    f = spec.ffn_size // tp
    for size in ([h * f, h * f, f * h] if spec.ffn_kind == "swiglu" else [h * f, f * h]):
        dense.remove(size)  # the dense MLP's matrices, wherever layer_tensors lists them
    dense.append(spec.num_experts * h)  # router
    if spec.num_shared_experts:
        fs = spec.num_shared_experts * spec.expert_ffn_size // (1 if layout.folded else tp)  # folded: whole
        dense += [h * fs, h * fs, fs * h]
    fe = spec.expert_ffn_size // layout.expert_tp
    n = spec.num_experts // layout.ep
    return dense, [n * fe * h, n * fe * h, n * h * fe]


def _zero_state(local: int, n: int, zero: int, low: bool) -> tuple[list, int, int, int]:
    """One ZeRO-1/2 bucket of ``local`` elements over ``n`` ranks: (whether it communicates,
    optimizer bytes, params bytes, grads bytes) as step_traffic's dense rule."""
    flat = -(-local // n) * n * st.MASTER_BYTES
    optimizer = 3 * flat // n + 4
    params = local * (st.LOW_BYTES if low else st.MASTER_BYTES)
    grads = flat if low else local * st.MASTER_BYTES
    if zero == 2:
        grads = flat // n
    return [flat] if n > 1 else [], optimizer, params, grads


def predict_moe_rank(spec: "ModelSpec", layout: "Layout", rank: int, *, stage_layers: int | None = None,
                     routing: dict | None = None, order: list | None = None) -> st.RankPrediction:
    """Messages and memory of one rank of an MoE model for one training step (module doc)."""
    check_moe_supported(spec, layout)
    if layout.ep > 1 and routing is None:
        raise st.NotModelled("not modelled per op: expert parallelism without the measured routing "
                             "(predict_rank(..., routing=...): the all-to-all rows depend on it)")
    tp, m = layout.tp, layout.num_microbatches
    stage = coords(layout, rank)["pp"]
    first, last = stage == 0, stage == layout.pp - 1
    ids = rank_layer_ids(spec.num_layers, layout.pp, layout.virtual_stages)[stage]  # spec/stages.py: the runtime's split
    if stage_layers is not None and stage_layers != len(ids):
        raise st.NotModelled(f"not modelled per op: the runtime holds {stage_layers} layers on pipeline rank {stage}, "
                             f"spec/stages.py {len(ids)}")
    nl = len(ids)
    moe_ids = [i for i in ids if spec.is_moe_layer(i)]
    n_moe, n_dense = len(moe_ids), nl - len(moe_ids)
    act = st.DTYPE_SIZE[layout.param_dtype]
    tokens = layout.mbs * layout.seq // layout.cp  # this rank's zig-zag chunks of a micro-batch
    hidden = tokens * spec.hidden_size
    dense_layer, root = st.layer_tensors(spec, tp), st.root_tensors(spec, tp, first, last)
    moe_dense, experts = moe_layer_tensors(spec, layout)
    shared_local = n_dense * sum(dense_layer) + n_moe * sum(moe_dense) + sum(root)
    expert_local = n_moe * sum(experts)
    n_tensors = n_dense * len(dense_layer) + n_moe * (len(moe_dense) + len(experts)) + len(root)

    dp_group, tp_group = group_along(layout, rank, "dp_cp"), group_along(layout, rank, "tp")
    ep_split = layout.ep > 1
    edp_group = expert_group_along(layout, rank, "edp") if ep_split else dp_group
    msgs: list = []
    folded = layout.folded and tp > 1
    # each layer's recomputed forwards (zero-bubble's W: one per weight group; ring attention's K/V too)
    ranges = stage_ranges(spec.num_layers, layout.pp, layout.virtual_stages)
    n_params = {False: st.weight_groups(spec), True: len(moe_dense) + len(experts)}
    stages = rank_stage_ids(layout.pp, layout.virtual_stages, stage)
    redo = {(s, i): st.layer_recomputations(layout, s, n_params[spec.is_moe_layer(i)]) for s in stages for i in ranges[s]}
    scheduled = layout.pp > 1 and (layout.virtual_stages > 1 or layout.schedule == "zero-bubble")
    if scheduled:
        order = order if order is not None else action_order(layout.schedule, layout.pp, m, layout.virtual_stages, stage)
    if tp > 1:
        msgs += st.tp_messages(spec, layout, tp_group, nl, first, last, m, hidden, act, tokens,
                               mlp_layers=n_dense if folded else None, redo=m * sum(redo.values()))
        # the router is replicated over tp: its gradient is a partial sum, all-reduced once per step
        msgs.append(st.Message("all_reduce", tp_group, "fp32", spec.num_experts * spec.hidden_size * st.MASTER_BYTES, n_moe))
    if folded:
        # the MoE blocks stay whole on every TP rank, which routes only its slice of the sequence
        # (expert.py _apply_folded): their shared experts' gradients are partial sums over tp too, and
        # without sp the block all-gathers its output (forward) and its input's gradient (backward)
        if spec.num_shared_experts:
            fs, h = spec.num_shared_experts * spec.expert_ffn_size, spec.hidden_size
            msgs += [st.Message("all_reduce", tp_group, "fp32", n * st.MASTER_BYTES, n_moe) for n in (h * fs, h * fs, fs * h)]
        if not layout.sp:
            r = 2 if held_param_dtype(layout) == "bf16" else st.MASTER_BYTES
            msgs.append(st.Message("all_gather", tp_group, "bf16" if r == 2 else "fp32", hidden * r, 2 * n_moe * m))
    if tp > 1 and not folded and act < st.MASTER_BYTES:
        # the MoE block combines its experts' outputs in fp32 (moe.py), so under autocast its forward
        # output reaches the tp reduction in fp32: each such message carries 4 bytes a value, not 2
        op = "reduce_scatter" if layout.sp else "all_reduce"
        msgs.append(st.Message(op, tp_group, "fp32", hidden * (st.MASTER_BYTES - act), n_moe * m))
    if layout.cp > 1:  # ring attention in every layer, MoE or not (step_traffic's)
        msgs += st.ring_sends(spec, layout, rank, nl, m, tokens,
                              redo=m * sum(redo.values()) if layout.recompute == "full" else None)
    if ep_split:  # each dispatcher call's forward runs once and again in each recomputation of its layer
        if scheduled:
            layer_of = {}
            for (s, _mb), ids_ in forward_calls(spec, layout, order).items():
                for c, i in zip(ids_, [i for i in ranges[s] if spec.is_moe_layer(i)]):
                    layer_of[c] = (s, i)
            forwards = [1 + redo[layer_of[c]] for c in range(len(layer_of))]
        else:
            forwards = [1 + redo[(stage, i)] for _mb in range(m) for i in moe_ids]
        msgs += ep_messages(spec, layout, rank, routing, n_moe * m, forwards)
        if layout.folded and layout.expert_tp > 1:
            msgs += etp_messages(spec, layout, rank, routing, forwards)
    if layout.pp > 1:  # step_traffic's: the stage's sends, the loss broadcast, the tied embedding's sum
        msgs += st.pipeline_sends(layout, rank, hidden * 4 // (tp if layout.sp else 1))  # sp: the sequence shard
        msgs.append(st.Message("broadcast", group_along(layout, rank, "pp"), "fp32", 4))
        tied = st.tied_group(spec, layout, rank)
        if tied is not None:
            msgs.append(st.Message("all_reduce", tied, "fp32",
                                   spec.hidden_size * (st.padded_vocab(spec.vocab_size, tp) // tp) * st.MASTER_BYTES))

    low = held_param_dtype(layout) == "bf16"
    params = grads = (shared_local + expert_local) * st.MASTER_BYTES
    optimizer = 2 * (shared_local + expert_local) * st.MASTER_BYTES + 4 * n_tensors
    buckets = [(shared_local, dp_group)] + ([(expert_local, edp_group)] if ep_split else [])
    if not ep_split:
        buckets = [(shared_local + expert_local, dp_group)]
    if layout.dp * layout.cp > 1:
        if layout.zero == 3:
            msgs_f, params, grads, optimizer = fsdp_messages(spec, layout, rank, dp_group, edp_group if ep_split else None,
                                                             shared_local, expert_local, n_tensors)
            msgs += msgs_f
        elif layout.zero in (1, 2):
            # data_parallel.build_optimizer: the dense bucket over the dp x cp group or, HSDP-style
            # (dp_shard < dp), over its shard group, its owned range then all-reduced over the replicas
            # (step_traffic.shard_groups); EP's expert bucket over expert-dp, never replicated
            params = grads = optimizer = 0
            n, shard, replicas = st.shard_groups(layout, rank, dp_group)
            for i, (local, group) in enumerate(buckets):
                if i == 0:
                    group, size = shard, n
                else:
                    size, replicas = len(group), None
                flats, o, p, g = _zero_state(local, size, layout.zero, low)
                for flat in flats:
                    msgs += [st.Message("reduce_scatter", group, "fp32", flat), st.Message("all_gather", group, "fp32", flat)]
                if replicas:
                    msgs.append(st.Message("all_reduce", replicas, "fp32", -(-local // size) * st.MASTER_BYTES))
                optimizer, params, grads = optimizer + o, params + p, grads + g
        else:
            msgs += [st.Message("all_reduce", group, "fp32", local * st.MASTER_BYTES) for local, group in buckets
                     if len(group) > 1]
        msgs.append(st.Message("all_reduce", dp_group, "fp32", 4))  # the loss, averaged over dp x cp
    msgs.append(st.Message("all_reduce", group_along(layout, rank, "world"), "fp64", 8))  # the gradient norm
    if scheduled:
        calls = forward_calls(spec, layout, order)
        received = None
        if ep_split:
            received = {key: [received_rows(layout, rank, routing, call) for call in ids] for key, ids in calls.items()}
        held = {s: (len(ranges[s]), sum(spec.is_moe_layer(i) for i in ranges[s])) for s in {s for _k, s, _mb in order}}
        acts = moe_scheduled_activation_bytes(spec, layout, order, held, received)
    else:
        received = None
        if ep_split:
            received = [[received_rows(layout, rank, routing, mb * n_moe + i) for i in range(n_moe)] for mb in range(m)]
        acts = moe_rank_activation_bytes(spec, layout, moe_ids, nl, received, first, last, st._in_flight(layout, stage),
                                         ids=ids)
    fused = st.activation_bytes(spec, layout, nl, first, last, in_flight=st._in_flight(layout, stage))
    memory = dict(params=params, grads=grads, optimizer=optimizer, activations=acts, activations_fused=fused,
                  comm_buffers=max((mm.payload for mm in msgs if len(set(mm.group)) > 1), default=0))
    if ep_split:
        memory["all_to_all_apriori"] = apriori_all_to_all_bytes(spec, layout, n_moe * m, sum(forwards))
    return st.RankPrediction(messages=[mm for mm in msgs if mm.calls and mm.payload], memory=memory)


def fsdp_messages(spec: "ModelSpec", layout: "Layout", rank: int, dp_group: tuple, edp_group: tuple | None,
                  shared_local: int, expert_local: int, n_tensors: int) -> tuple[list, int, int, int]:
    """FSDP2 / HSDP of an MoE model (runtime/parallel/data_parallel.py): (messages, params, grads,
    optimizer bytes). Every decoder layer is a unit over the dp x cp shard group (a MoE layer's
    attention, norms, router, shared experts, and its routed experts too without EP); under EP each
    MoE layer's routed experts are a unit of their own over the expert-dp group (all-gathered and
    reduce-scattered as often as their layer: each micro-batch's forward and backward runs them once),
    none where expert-dp has one rank. The root unit, the counts per unit and HSDP's replica
    all-reduces are step_traffic's (``fsdp_units``, ``shard_groups``)."""
    n, shard, replicas = st.shard_groups(layout, rank, dp_group)
    ranges = stage_ranges(spec.num_layers, layout.pp, layout.virtual_stages)
    stages = rank_stage_ids(layout.pp, layout.virtual_stages, coords(layout, rank)["pp"])
    moe_dense, experts = moe_layer_tensors(spec, layout)
    dense_layer = st.layer_tensors(spec, layout.tp)
    e_unit = sum(experts) * st.MASTER_BYTES
    nl = sum(len(ranges[s]) for s in stages)
    msgs: list = []
    for stage, (unit_r, layers, gather_l, gather_r, reduces) in zip(stages, st.fsdp_units(spec, layout, rank, nl)):
        assert layers == len(ranges[stage])
        for i in ranges[stage]:
            moe = spec.is_moe_layer(i)
            unit = sum(moe_dense if moe else dense_layer) + (sum(experts) if moe and edp_group is None else 0)
            unit *= st.MASTER_BYTES
            msgs += [st.Message("all_gather", shard, "fp32", unit, gather_l),
                     st.Message("reduce_scatter", shard, "fp32", unit, reduces)]
            if replicas:
                msgs.append(st.Message("all_reduce", replicas, "fp32", unit // n, reduces))
            if moe and edp_group is not None and len(edp_group) > 1:
                msgs += [st.Message("all_gather", edp_group, "fp32", e_unit, gather_l),
                         st.Message("reduce_scatter", edp_group, "fp32", e_unit, reduces)]
        msgs += [st.Message("all_gather", shard, "fp32", unit_r, gather_r),
                 st.Message("reduce_scatter", shard, "fp32", unit_r, reduces)]
        if replicas:
            msgs.append(st.Message("all_reduce", replicas, "fp32", unit_r // n, reduces))
    if edp_group is None:
        local = (shared_local + expert_local) * st.MASTER_BYTES // n
    else:
        local = shared_local * st.MASTER_BYTES // n + expert_local * st.MASTER_BYTES // len(edp_group)
    return msgs, local, local, 2 * local + 4 * n_tensors


def forward_calls(spec: "ModelSpec", layout: "Layout", order: list) -> dict[tuple[int, int], list[int]]:
    """``{(stage, micro-batch): the dispatcher call indices of its MoE layers}``: the recorded routing
    is one list per call in execution order, each forward action ``("F", stage, mb)`` of the executed
    ``order`` calling its stage's MoE layers in turn."""
    ranges = stage_ranges(spec.num_layers, layout.pp, layout.virtual_stages)
    out, call = {}, 0
    for kind, stage, mb in order:
        if kind == "F":
            n = sum(spec.is_moe_layer(i) for i in ranges[stage])
            out[(stage, mb)] = list(range(call, call + n))
            call += n
    return out


def dispatch_bytes(layout: "Layout") -> tuple[int, int]:
    """Bytes of one element of (the dispatched rows, the combined rows): the MoE block's input
    (the residual stream's norm output: fp32, or bf16 where parameters are held in bf16) and the
    experts' output (the compute dtype under autocast)."""
    c = st.DTYPE_SIZE[layout.param_dtype]
    resid = 2 if held_param_dtype(layout) == "bf16" else 4
    return resid, c


def ep_splits(layout: "Layout", rank: int, routing: dict, call: int) -> tuple[list[int], list[int], int]:
    """(send_splits, recv_splits, this rank's EP index) of dispatcher call ``call``: row ``j`` of
    this rank's ``[ep, E/ep]`` count matrix goes to EP rank ``j``; EP rank ``j`` sends this rank the
    counts of its own experts from its matrix."""
    members = expert_group_along(layout, rank, "ep")
    me = members.index(rank)
    counts = routing[rank][call]
    local = len(counts) // layout.ep
    send = [sum(counts[j * local:(j + 1) * local]) for j in range(layout.ep)]
    recv = [sum(routing[peer][call][me * local:(me + 1) * local]) for peer in members]
    return send, recv, me


def received_rows(layout: "Layout", rank: int, routing: dict, call: int) -> int | tuple[int, int]:
    """The rows this rank's EP dispatcher received in ``call``; under expert TP of a folded mesh
    (etp > 1) the pair (those rows, the rows its expert slices run on: every ETP peer's,
    ``etp_sizes``), as moe_activations.expert_rows reads it."""
    n = sum(ep_splits(layout, rank, routing, call)[1])
    if layout.folded and layout.expert_tp > 1:
        return n, sum(etp_sizes(layout, rank, routing, call))
    return n


def etp_sizes(layout: "Layout", rank: int, routing: dict, call: int) -> list[int]:
    """The rows each rank of ``rank``'s ETP group received from its EP dispatcher in ``call``, in
    ETP order (FoldedDispatcher's ``sizes``: its peers' gathered counts summed)."""
    return [sum(ep_splits(layout, peer, routing, call)[1]) for peer in expert_group_along(layout, rank, "etp")]


def etp_messages(spec: "ModelSpec", layout: "Layout", rank: int, routing: dict, forwards: list[int]) -> list:
    """Expert TP over the ETP group of a folded mesh (expert.py ``FoldedDispatcher.run_experts``, etp > 1),
    per dispatcher call with ``n`` rows received here and ``sizes`` the ETP peers' (``etp_sizes``):
    in each forward run the all-gather of the ``[E/ep]`` int64 local counts (``8 E / ep`` bytes from
    each of the ``etp`` ranks; outside autograd, so in recomputations too), the rows to every peer
    (``etp x n`` rows of the dispatched dtype, all but this rank's copy sent) and the partial outputs
    back (``sum(sizes)`` rows of the experts' dtype, all but this rank's own ``n``); in backward both
    reversed, the partial outputs' gradient first."""
    group = expert_group_along(layout, rank, "etp")
    etp, h = layout.expert_tp, spec.hidden_size
    me = group.index(rank)
    xd, yd = dispatch_bytes(layout)
    names = {2: "bf16", 4: "fp32"}
    local = spec.num_experts // layout.ep
    out: list = [st.Message("all_gather", group, "int64", etp * local * COUNT_BYTES, sum(forwards))]
    for call, runs in enumerate(forwards):
        sizes = etp_sizes(layout, rank, routing, call)
        n, got = sizes[me], sum(sizes)
        for rows, own, size in ((etp * n, n, xd), (got, n, yd)) * runs + ((etp * n, n, yd), (got, n, xd)):
            out.append(SplitMessage("all_to_all", group, names[size], rows * h * size, 1, (rows - own) * h * size))
    return [mm for mm in out if mm.payload]


def ep_messages(spec: "ModelSpec", layout: "Layout", rank: int, routing: dict, calls: int,
                forwards: list[int] | None = None) -> list:
    """The EP all-to-alls of one step given the measured routing (module doc): per call the count
    exchange, dispatch and combine in each of its ``forwards[call]`` forward runs (default 1, 2 under
    ``recompute=full``; zero-bubble's W adds one per weight group, step_traffic.layer_recomputations),
    and both reversed once in backward."""
    group = expert_group_along(layout, rank, "ep")
    if len(routing[rank]) != calls:
        raise st.NotModelled(f"not modelled per op: {len(routing[rank])} recorded dispatches, {calls} expected")
    xd, yd = dispatch_bytes(layout)
    names = {2: "bf16", 4: "fp32"}
    h = spec.hidden_size
    count = spec.num_experts * COUNT_BYTES
    # recompute=full re-runs each MoE block's forward in the backward up to its last saved tensor (the
    # combine's product with the routing weights, or the shared experts after it): the count
    # exchange, the dispatch and the combine again, on the same rows
    forwards = forwards or [2 if layout.recompute == "full" else 1] * calls
    out: list = [st.Message("all_to_all", group, "int64", count, sum(forwards))]
    for call in range(calls):
        send, recv, me = ep_splits(layout, rank, routing, call)
        s, r = sum(send), sum(recv)
        for rows, own, size in ((s, send[me], xd), (r, recv[me], yd)) * forwards[call] + (  # forward: dispatch, combine
                               (s, send[me], yd), (r, recv[me], xd)):  # backward: combine's, dispatch's
            out.append(SplitMessage("all_to_all", group, names[size], rows * h * size, 1, (rows - own) * h * size))
    return [mm for mm in out if mm.payload]


def apriori_all_to_all_bytes(spec: "ModelSpec", layout: "Layout", calls: int, runs: int | None = None) -> float:
    """All-to-all payload of a step at uniform routing times ``LOAD_IMBALANCE`` (reported only):
    per call ``T k`` rows dispatched and combined, forward and backward (and the forward again
    under recompute=full), plus the counts (each forward); under expert TP of a folded mesh the ETP
    group's rows too (``etp`` copies of the rows out, their partial outputs back)."""
    xd, yd = dispatch_bytes(layout)
    rows = rank_tokens(layout)[2] * spec.top_k * LOAD_IMBALANCE
    runs = runs if runs is not None else calls * (2 if layout.recompute == "full" else 1)  # the calls' forward runs
    copies = 1 + (layout.expert_tp if layout.folded and layout.expert_tp > 1 else 0)
    return (calls + runs) * copies * rows * spec.hidden_size * (xd + yd) + runs * spec.num_experts * COUNT_BYTES
