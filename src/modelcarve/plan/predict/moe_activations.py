"""Bytes the eager runtime saves for backward in one rank's MoE blocks (plan/predict/activations.py for the rest).

Per MoE layer and micro-batch of ``T = mbs x seq`` tokens (``b`` sequences), ``S = T k`` the
(token, choice) rows this rank's router sends and ``R`` the rows its experts receive (``S``
without expert parallelism; under EP the measured routing's, moe_traffic.ep_splits), ``c`` the
compute dtype's bytes, ``F`` the expert ffn size over etp, what runtime/model/moe.py and
runtime/parallel/expert.py save, tensor by tensor (checked with saved_tensors_hooks on tiny-moe):

* router (fp32, autocast off): its input ``4 T H`` (a view of the block's input of another shape,
  so a distinct saved tensor), the softmax scores ``4 T E``, the top-k indices ``8 T k``, the
  renormalisation's weights ``4 T k`` and their sum ``4 T``; the aux loss's per-sequence load ``4 b E``;
* grouping by expert: the gather index ``8 S`` (``order // k``) and the scatter index ``8 S``
  (``index_copy``), and under EP the regrouping index ``8 R`` of the received rows;
* the experts (GroupedExperts, per expert on its rows): the rows ``c R H``, the gate and up
  projections, the SiLU output and their product ``4 c R F``, the experts' output ``R H`` (kept by
  an ``index_copy``, which autocast promotes to its widest input: without EP moe.py's, in the
  block's dtype; under EP the dispatcher's regrouping, in the compute dtype);
* the combine: under EP the rows back, cast to the block's dtype by moe.py's ``index_copy`` (without
  EP that is the experts' output already counted, ``R = S``), its ``[T, k, H]`` view and the routing
  weights, in the block's dtype;
* expert TP of a folded mesh (etp > 1, expert.py FoldedDispatcher): the experts run on the rows
  of the whole ETP group (``R``, moe_traffic.received_rows' pair with this rank's own ``n``), with
  their own regrouping index ``8 R``; the dispatcher's ``index_copy`` keeps the summed partial outputs
  of the ``n`` rows, ``c n H`` (tiny-moe tp=4,ep=2,etp=2: 100 bytes over in fp32 and bf16, the aux
  loads and masks as everywhere; bf16 was 7-12 KB over while the experts' output was priced in fp32).

The dense part of an MoE layer (norms, attention) is activations.py's ``layer_terms`` without its
MLP terms. Peak: the largest micro-batch (no pipeline: one micro-batch in flight; micro-batches
differ by their routing). fp32, and bf16 autocast over fp32 parameters (``c`` = 2: each expert's two
input projections cast their own bf16 copy of its rows, the experts' output is cast back to fp32,
the combine stays fp32) and bf16-held parameters (ZeRO-1/2 with bf16, spec/support.held_param_dtype:
the block is bf16 throughout but for the router); checked within 1.1% on tiny-moe.

Interleaved 1F1B and zero-bubble pipelines (``moe_scheduled_activation_bytes``): each forward action
of the rank's executed order holds its stage's micro-batch (its layers, MoE ones with their own
routing, and stage terms) until its backward, or zero-bubble's weight step W; on zero-bubble's last
stage the loss keeps each micro-batch's graph to the step's end and W frees only its weight nodes'
saved inputs (``moe_weight_step_frees``: activations.py's dense rule, MLA's latents included, plus
per MoE block the router's input, each expert's rows and down projection input, and Qwen3's q / k
norms' normalised outputs, in the compute dtype). Checked on tiny-moe (pp=2, v=2 interleaved; pp=2 zero-bubble; both
with dp=2 x ep=2) and the tiny Qwen3-MoE (zero-bubble; four layers: interleaved): within 256 bytes of
the measured peak in fp32; the tiny DeepSeek-V3 (MLA, dense first layer) up to 3.2% low in fp32 (MLA's
unfound 1,792 bytes a layer, activations.py), 2.3% in bf16.

Context parallelism: ``T = mbs x seq / cp`` (``rank_tokens``), the attention's ring terms
(activations.py ``layer_terms(ring=True)``), no aux-loss load (moe.py skips the unused aux loss
under cp): exact on tiny-moe cp=2 and cp=2 x ep=2 (fp32). Recomputation: ``moe_recompute_peak``
(activations.py's ``recompute_terms`` with each MoE layer's block terms in place of the MLP's, and
the micro-batch whose backward recomputes: 1F1B / GPipe run the backwards in order, each with the
later micro-batches in flight held); within 32 bytes a layer of the measured peak in fp32 (tiny-moe:
full and selective, dp x ep, tp x sp, pp=2 1F1B). Interleaved 1F1B and zero-bubble under
recomputation: activations.py's ``scheduled_recompute_peak`` walk over the executed order, each
(stage, micro-batch) with ``moe_recompute_parts`` (its layers, its own routing) and, on zero-bubble's
last stage, W freeing ``moe_weight_step_frees``; under ``full`` zero-bubble's W recomputes each layer
once per weight group (activations.py ``weight_step_walk``; an MoE block's groups ``moe_weight_groups``:
router, the stacked w1 / w3 / w2, shared experts). Over the measured peak by the aux loss's load (32
bytes on tiny-moe, 16 on the tiny Qwen3-MoE) per MoE layer held or recomputed copy alive, in fp32 and
bf16, every run (tiny-moe pp=2, v=2: full 147,936 / 135,136 against 147,904 / 135,104, selective
572,512 / 372,068 against 572,384 / 371,972; zero-bubble first stage 137,440 / 453,760 against
137,408 / 453,664; last stage selective 854,404 against 854,148, full 6,313,728 against 6,311,168:
80 copies; the Qwen3-MoE's full 3,227,568 against 3,226,816: 47 copies).
Ring attention (context parallelism) under recomputation: ``moe_recompute_parts`` with activations.py's
ring terms (``recompute_terms(ring=True)``): exact in fp32 and bf16 on tiny-moe and the tiny Qwen3-MoE,
cp=2 full / selective, with and without ep=2 (activations.py's module doc has the bytes; MLA's gap there).
A folded expert mesh (etp != tp): the MoE block on each TP rank's ``T / tp`` tokens (``rank_tokens``),
its shared experts whole (``shared_ffn``: not split over tp there), the rest as above, under recomputation
and cp alike: tiny-moe and the tiny Qwen3-MoE (tp=2,ep=2,etp=1; full, selective; sp; pp=2 1F1B; cp=2)
within 156 bytes of the measured peak in fp32 (tests/verify/test_verify_against_plan_folded.py), bf16
within 2% (tiny-moe full: 88,744 / 71,768 against 87,064 / 71,368); the tiny DeepSeek-V3 (shared experts)
292-304 bytes over (0.6%), was 1,756 under while its shared experts were priced split over tp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.predict.activations import (FP32, INDEX, layer_terms, layer_weight_frees, recompute_terms,
                                                 recompute_unchecked, residual_bytes, scheduled_recompute_peak,
                                                 stage_terms, weight_step_parts)
from modelcarve.spec.stages import stage_ranges

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec


def rank_tokens(layout: "Layout") -> tuple[int, int, int]:
    """(``T``: this rank's tokens of a micro-batch, ``s``: its sequence positions, ``T_moe``: the
    tokens its MoE blocks route): context parallelism gives each rank ``seq / cp`` positions (its
    zig-zag chunks); a folded expert mesh leaves the MoE blocks whole on each TP rank, which routes
    its ``1 / tp`` slice of them."""
    s = layout.seq // layout.cp
    T = layout.mbs * s
    return T, s, (T // layout.tp if layout.folded and layout.tp > 1 else T)


def shared_ffn(spec: "ModelSpec", layout: "Layout") -> float:
    """The shared experts' ffn width on one rank: split over tp like the dense MLP, or whole on every
    TP rank of a folded expert mesh (expert.py ``_apply_folded`` leaves the block unsplit; each TP
    rank runs them on its own ``1 / tp`` of the tokens)."""
    return spec.num_shared_experts * spec.expert_ffn_size / (1 if layout.folded and layout.tp > 1 else layout.tp)


def dense_layer_terms(spec: "ModelSpec", layout: "Layout") -> dict[str, float]:
    """activations.py's ``layer_terms`` of one micro-batch on this rank (ring attention's under cp)."""
    T, s, _ = rank_tokens(layout)
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    return layer_terms(spec, T, s, layout.tp, layout.sp, c, residual_bytes(layout), layout.cp > 1)


def expert_rows(received: int | tuple[int, int]) -> tuple[int, int]:
    """(rows the rank's EP dispatcher received, rows its experts run on) of one MoE block: the same
    number, or under expert TP of a folded mesh the pair moe_traffic.received_rows gives."""
    return (received, received) if isinstance(received, int) else received


def moe_block_terms(spec: "ModelSpec", layout: "Layout", T: int, received: int | tuple[int, int],
                    ep_split: bool) -> dict[str, float]:
    """Saved bytes of one MoE block and micro-batch on one rank (module doc)."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    r = residual_bytes(layout)  # the block's own dtype: fp32, or bf16 where the parameters are held in bf16
    h, E, k = spec.hidden_size, spec.num_experts, spec.top_k
    f = spec.expert_ffn_size // layout.expert_tp
    S, (n, R) = T * k, expert_rows(received)
    out = {
        "router": FP32 * T * h + FP32 * T * E + INDEX * T * k + FP32 * T * k + FP32 * T,
        # the aux loss's per-sequence load; under context parallelism the block skips the aux loss
        # unless its coefficient is set (moe.py: it would cost a collective), so nothing is saved
        "aux_load": FP32 * layout.mbs * E if layout.cp == 1 else 0,
        "indices": 2 * INDEX * S + (INDEX * n if ep_split else 0),
        # the rows themselves; under autocast (fp32 block, bf16 compute) each of the two input projections
        # casts its own copy
        "expert_rows": r * R * h if c == r else 2 * c * R * h,
        "experts": 4 * c * R * f,
        # the experts' output as an index_copy keeps its source (autocast promotes index_copy to its widest
        # input): without EP moe.py's, a cast to the block's dtype; under EP the dispatcher's regrouping
        # index_copy keeps it in the compute dtype
        "expert_out": (c if ep_split else r) * R * h,
        # the combine: under EP moe.py's index_copy keeps the all-to-all's output cast to the block's dtype;
        # the weighted sum keeps that index_copy's output and the routing weights
        "combine": (r * S * h if ep_split else 0) + r * S * h + r * T * k,
    }
    if not isinstance(received, int):  # expert TP (FoldedDispatcher): its own regrouping index of the ETP
        # group's rows, and the summed partial outputs of this rank's n rows (compute dtype), which the
        # EP dispatcher's index_copy keeps
        out["indices"] += INDEX * R
        out["expert_out"] += c * n * h
    if spec.router_scoring == "sigmoid":  # the top-k weights' normalisation: the scores' view and the row sums
        out["router"] += FP32 * T * E + FP32 * T
    if spec.num_shared_experts:  # a SwiGLU MLP on the block's input (the router's saved input), split over tp
        out["shared"] = 4 * c * T * shared_ffn(spec, layout)
    return out


def moe_held_bytes(spec: "ModelSpec", layout: "Layout", layers: int, n_moe: int, received: list[int] | None,
                   first: bool, last: bool) -> float:
    """Saved bytes of one micro-batch on one stage of ``layers`` layers, ``n_moe`` of them MoE
    (``received[i]``: the rows this rank's experts received in the stage's ``i``-th MoE layer; None
    without EP)."""
    T, s, T_moe = rank_tokens(layout)
    r = residual_bytes(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    dense = dense_layer_terms(spec, layout)
    attention = sum(v for key, v in dense.items() if not key.startswith("mlp"))
    fixed = (layers - n_moe) * sum(dense.values()) + n_moe * attention
    stage = sum(stage_terms(spec, T, s, layout.tp, layout.sp, c, first, last, r).values())
    ep_split = layout.ep > 1
    rows = received if received is not None else [T_moe * spec.top_k] * n_moe
    return fixed + stage + sum(sum(moe_block_terms(spec, layout, T_moe, R, ep_split).values()) for R in rows)


def moe_scheduled_activation_bytes(spec: "ModelSpec", layout: "Layout", order: list, stage_layers: dict[int, tuple[int, int]],
                                   received: dict | None) -> float | None:
    """Peak saved-for-backward bytes of one pipeline rank of an interleaved 1F1B or zero-bubble
    schedule, given its actions ``(kind, stage, micro-batch)`` in executed order (``stage_layers[s]``:
    (layers, MoE layers) of stage ``s``; ``received[(s, mb)]``: the rows per MoE layer, None without
    EP). Each forward holds its stage's micro-batch (``moe_held_bytes``) until its backward (B) or, under
    zero-bubble, its weight step (W), as activations.py's ``interleaved_activation_bytes`` and
    ``zero_bubble_activation_bytes`` count a dense stage. The last stage of a zero-bubble schedule keeps
    each micro-batch's loss, and with it part of its graph, to the step's end; its weight steps free
    ``moe_weight_step_frees``. Under recomputation activations.py's ``scheduled_recompute_peak`` with
    each (stage, micro-batch)'s ``moe_recompute_parts``."""
    if layout.param_dtype not in ("fp32", "bf16"):
        return None
    if layout.recompute != "none":
        if recompute_unchecked(spec, layout) is not None:
            return None
        ranges = stage_ranges(spec.num_layers, layout.pp, layout.virtual_stages)
        last_stage = layout.pp * layout.virtual_stages - 1

        def parts(s: int, mb: int) -> tuple[float, float | None, float | None, float, list]:
            rows = received[(s, mb)] if received is not None else None
            moe = [spec.is_moe_layer(i) for i in ranges[s]]
            held, extra, again = moe_recompute_parts(spec, layout, moe, rows, s == 0, s == last_stage)
            layers, n_moe = stage_layers[s]
            if layout.recompute != "full":  # the attention core has no weight: W recomputes nothing
                return held, extra if layers else None, max(again, default=None), \
                    moe_weight_step_frees(spec, layout, layers, n_moe, rows), []
            mlps = iter(moe_weight_groups(spec, layout, rows, sum(moe)))
            walk = [(a, layer_weight_frees(spec, layout, next(mlps) if m else None)) for a, m in zip(again, moe)]
            return held, extra if layers else None, max(again, default=None), \
                moe_weight_step_frees(spec, layout, 0, 0, []), walk

        return scheduled_recompute_peak(spec, layout, order, parts)
    last_stage = layout.pp * layout.virtual_stages - 1
    zb = layout.schedule == "zero-bubble"
    live, peak = 0.0, 0.0
    held: dict = {}
    for kind, stage, mb in order:
        layers, n_moe = stage_layers[stage]
        rows = received[(stage, mb)] if received is not None else None
        if kind == "F":
            held[(stage, mb)] = moe_held_bytes(spec, layout, layers, n_moe, rows, stage == 0, stage == last_stage)
            live += held[(stage, mb)]
            peak = max(peak, live)
        elif kind == "B" or (kind == "W" and stage != last_stage):
            live -= held.pop((stage, mb), 0.0)
        elif kind == "W":
            live -= moe_weight_step_frees(spec, layout, layers, n_moe, rows)
        elif kind == "I" and zb and stage == last_stage:
            live -= INDEX * layout.mbs * layout.seq + FP32
    return float(peak)


def moe_weight_step_frees(spec: "ModelSpec", layout: "Layout", layers: int, n_moe: int, received: list[int] | None) -> float:
    """Of one micro-batch's saved bytes on the last stage, those zero-bubble's weight step W frees
    (activations.py ``weight_step_frees``: the saved inputs of the nodes leading to a weight): the dense
    layers' and the MoE layers' attention as there; per MoE block the router's input, each expert's
    rows and its down projection's input ``c R F``, the shared experts' down projection's input."""
    _T, _s, T_moe = rank_tokens(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    h = spec.hidden_size
    attention, mlp, head = weight_step_parts(spec, layout)
    out = layers * attention + (layers - n_moe) * mlp
    f = spec.expert_ffn_size // layout.expert_tp
    for R in (received if received is not None else [T_moe * spec.top_k] * n_moe):
        terms = moe_block_terms(spec, layout, T_moe, R, layout.ep > 1)
        out += FP32 * T_moe * h + terms["expert_rows"] + c * expert_rows(R)[1] * f
        if spec.num_shared_experts:
            out += c * T_moe * shared_ffn(spec, layout)
    return out + head


def moe_weight_groups(spec: "ModelSpec", layout: "Layout", received: list[int] | None, n_moe: int) -> list[list[float]]:
    """activations.py ``layer_weight_frees``' ``mlp`` of each MoE layer (``moe_weight_step_frees``, split
    by weight group in parameter order): the router (its fp32 input), the experts' stacked w1, w3
    (their rows; under autocast each its cast), w2 (its input ``c R F``), the shared experts' w1, w3,
    w2 (their down projection's input; the router's input, which they save too, goes with their w3)."""
    _T, _s, T_moe = rank_tokens(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    h, f = spec.hidden_size, spec.expert_ffn_size // layout.expert_tp
    out = []
    for R in (received if received is not None else [T_moe * spec.top_k] * n_moe):
        rows = moe_block_terms(spec, layout, T_moe, R, layout.ep > 1)["expert_rows"]
        one = c == residual_bytes(layout)  # one tensor of rows, or autocast's two casts
        groups = [FP32 * T_moe * h] + ([0.0, rows] if one else [rows / 2, rows / 2]) + [c * expert_rows(R)[1] * f]
        if spec.num_shared_experts:
            groups += [0.0, groups[0], c * T_moe * shared_ffn(spec, layout)]
            groups[0] = 0.0
        out.append(groups)
    return out


def moe_rank_activation_bytes(spec: "ModelSpec", layout: "Layout", moe_ids: list[int], layers: int,
                              received: list[list[int]] | None, first: bool = True, last: bool = True,
                              in_flight: int = 1, ids: list[int] | None = None) -> float | None:
    """Peak saved-for-backward bytes of one rank of an MoE model holding ``layers`` layers, the MoE
    ones ``moe_ids`` (``received[mb][i]``: the rows the experts of this rank received in its ``i``-th
    MoE layer of micro-batch ``mb``; None without EP), ``first`` / ``last`` pipeline stage, with
    ``in_flight`` micro-batches held at the peak (a pipeline schedule's; the peak is the largest run
    of that many consecutive micro-batches, as 1F1B and GPipe hold them); None where not modelled.
    Under recomputation ``moe_recompute_peak`` (``ids``: the stage's layer ids in order, default
    the MoE ones last)."""
    if layout.param_dtype not in ("fp32", "bf16"):
        return None  # checked: fp32, bf16 autocast over fp32 parameters, bf16-held parameters
    T, s, T_moe = rank_tokens(layout)
    r = residual_bytes(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    dense = dense_layer_terms(spec, layout)
    stage = stage_terms(spec, T, s, layout.tp, layout.sp, c, first, last, r)
    ep_split = layout.ep > 1
    per_mb = received if received is not None else [[T_moe * spec.top_k] * len(moe_ids)] * layout.num_microbatches
    blocks = [[sum(moe_block_terms(spec, layout, T_moe, R, ep_split).values()) for R in mb] for mb in per_mb]
    if ids is None:
        ids = [-1] * (layers - len(moe_ids)) + list(moe_ids)
    if layout.recompute != "none":
        if recompute_unchecked(spec, layout) is not None:
            return None
        return moe_recompute_peak(spec, layout, ids, moe_ids, received, first, last, in_flight)
    attention = sum(v for key, v in dense.items() if not key.startswith("mlp"))
    fixed = (layers - len(moe_ids)) * sum(dense.values()) + len(moe_ids) * attention
    one = [fixed + sum(stage.values()) + sum(mb) for mb in blocks]
    k = max(1, min(in_flight, len(one)))
    return float(max(sum(one[i:i + k]) for i in range(len(one) - k + 1)))


def moe_recompute_peak(spec: "ModelSpec", layout: "Layout", ids: list[int], moe_ids: list[int], received: list | None,
                       first: bool, last: bool, in_flight: int) -> float:
    """Peak saved bytes of one rank of an MoE model under recomputation (activations.py's
    ``recompute_peak``, layer by layer: an MoE layer's block terms differ by its routing).
    ``received[mb][i]``: the rows micro-batch ``mb``'s ``i``-th MoE layer received (None: no EP);
    each micro-batch's terms are ``moe_recompute_parts``'.

    * ``full``: every layer keeps its input from its forward to its backward; the backward reaches
      the stage's layers last to first, re-running each one's forward (the MoE block's all-to-alls
      included) and holding what it re-saves (its attention's and its MoE block's terms, less the
      first norm's fp32 input where that is the block input itself) until its backward ends, when
      its input goes too. The peak: the last forward's end, or the recomputation of a layer ``i``
      of the micro-batch whose backward runs, with the stage's head terms and the inputs of the
      layers above ``i`` gone.
    * ``selective``: each layer keeps its terms but its attention core's (``qkv``, ``attn_out``),
      in their place the core's inputs; the backward of the stage's last layer frees its MoE block
      (or MLP), its ffn norm and its output projection's input before recomputing the core
      (activations.py ``recompute_terms``; the MoE block is not checkpointed)."""
    flags = [i in moe_ids for i in ids]
    one = [moe_recompute_parts(spec, layout, flags, rows, first, last)
           for rows in (received if received is not None else [None] * layout.num_microbatches)]
    k = max(1, min(in_flight, len(one)))
    peak = 0.0
    for i in range(len(one)):  # the backward of micro-batch i (1F1B, GPipe: in order) holds it and up to k - 1 later ones
        held = sum(p[0] for p in one[i:i + k])
        peak = max(peak, held, held + one[i][1])
    return float(peak)


def moe_recompute_parts(spec: "ModelSpec", layout: "Layout", moe: list[bool], received: list[int] | None,
                        first: bool, last: bool) -> tuple[float, float, list[float]]:
    """One micro-batch of a stage of layers ``ids`` under recomputation (``moe_recompute_peak``'s
    terms): (what its forward keeps to its backward; the backward's largest moment over that, the
    recomputation of a layer with the stage's head terms, and under ``full`` the inputs of the layers
    above, gone; what each layer's recomputation re-saves, in order).
    ``moe[j]``: whether the stage's ``j``-th layer is an MoE one."""
    T, s, T_moe = rank_tokens(layout)
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    r = residual_bytes(layout)
    kept, freed, recomputed = recompute_terms(spec, T, s, layout.tp, layout.sp, c, r, layout.recompute, layout.cp > 1)
    stage = stage_terms(spec, T, s, layout.tp, layout.sp, c, first, last, r)
    head = sum(v for k, v in stage.items() if k not in ("rope", "token_ids"))
    dense = dense_layer_terms(spec, layout)
    attention = sum(v for key, v in dense.items() if not key.startswith("mlp"))
    mlp = sum(v for key, v in dense.items() if key.startswith("mlp"))
    rows = iter(received if received is not None else [T_moe * spec.top_k] * sum(moe))
    # each layer's MoE block (the rows its experts received, in layer order), or its dense MLP
    own = [sum(moe_block_terms(spec, layout, T_moe, next(rows), layout.ep > 1).values()) if m else mlp for m in moe]
    if layout.recompute == "full":
        block_input = sum(kept.values())
        again = [attention + o + sum(recomputed.values()) - sum(dense.values()) for o in own]
        extra = max((-head - (len(moe) - 1 - j) * block_input + a for j, a in enumerate(again)), default=0.0)
        return len(moe) * block_input + sum(stage.values()), extra, again
    held = sum(stage.values()) + len(moe) * (sum(kept.values()) - mlp) + sum(own)
    gone = (own[-1] if moe else 0.0) + sum(freed.values()) - freed["mlp"] - freed["mlp_input"]
    return held, -head - gone + sum(recomputed.values()), [sum(recomputed.values())] * len(moe)
