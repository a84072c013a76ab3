"""Bytes the eager runtime saves for backward in one rank's MoE blocks (plan/predict/activations.py for the rest).

Per MoE layer and micro-batch of ``T = mbs x seq`` tokens (``b`` sequences), ``S = T k`` the
(token, choice) rows this rank's router sends and ``R`` the rows its experts receive (``S``
without expert parallelism; under EP the measured routing's, moe_traffic.ep_splits), ``c`` the
compute dtype's bytes, ``F`` the expert ffn size over etp (= tp here), what runtime/model/moe.py and
runtime/parallel/expert.py save, tensor by tensor (checked with saved_tensors_hooks on tiny-moe):

* router (fp32, autocast off): its input ``4 T H`` (a view of the block's input of another shape,
  so a distinct saved tensor), the softmax scores ``4 T E``, the top-k indices ``8 T k``, the
  renormalisation's weights ``4 T k`` and their sum ``4 T``; the aux loss's per-sequence load ``4 b E``;
* grouping by expert: the gather index ``8 S`` (``order // k``) and the scatter index ``8 S``
  (``index_copy``), and under EP the regrouping index ``8 R`` of the received rows;
* the experts (GroupedExperts, per expert on its rows): the rows ``c R H``, the gate and up
  projections, the SiLU output and their product ``4 c R F``, the experts' output ``c R H``
  (kept by the regrouping ``index_copy``);
* the combine: the rows back ``c S H`` (EP: the all-to-all's output, kept by ``index_copy``;
  without EP that is the experts' output already counted, ``R = S``), its ``[T, k, H]`` view ``c S H``
  and the routing weights ``c T k``.

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
saved inputs (``moe_weight_step_frees``: activations.py's dense rule, plus per MoE block the router's
input, each expert's rows and down projection input, and Qwen3's q / k norms' fp32 normalised
outputs). Checked on tiny-moe (pp=2, v=2 interleaved; pp=2 zero-bubble; both with dp=2 x ep=2) and
the tiny Qwen3-MoE (zero-bubble): within 256 bytes of the measured peak in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.predict.activations import FP32, INDEX, layer_terms, residual_bytes, stage_terms, weight_step_parts

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec


def moe_block_terms(spec: "ModelSpec", layout: "Layout", T: int, received: int, ep_split: bool) -> dict[str, float]:
    """Saved bytes of one MoE block and micro-batch on one rank (module doc)."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    r = residual_bytes(layout)  # the block's own dtype: fp32, or bf16 where the parameters are held in bf16
    h, E, k = spec.hidden_size, spec.num_experts, spec.top_k
    f = spec.expert_ffn_size // layout.expert_tp
    S, R = T * k, received
    out = {
        "router": FP32 * T * h + FP32 * T * E + INDEX * T * k + FP32 * T * k + FP32 * T,
        "aux_load": FP32 * layout.mbs * E,
        "indices": 2 * INDEX * S + (INDEX * R if ep_split else 0),
        # the rows themselves; under autocast (fp32 block, bf16 compute) each of the two input projections
        # casts its own copy
        "expert_rows": r * R * h if c == r else 2 * c * R * h,
        "experts": 4 * c * R * f,
        "expert_out": r * R * h,  # the experts' output in the block's dtype (a cast under autocast)
        "combine": (c * S * h if ep_split else 0) + r * S * h + r * T * k,
    }
    if spec.router_scoring == "sigmoid":  # the top-k weights' normalisation: the scores' view and the row sums
        out["router"] += FP32 * T * E + FP32 * T
    if spec.num_shared_experts:  # a SwiGLU MLP on the block's input (the router's saved input), split over tp
        fs = spec.num_shared_experts * spec.expert_ffn_size / layout.tp
        out["shared"] = 4 * c * T * fs
    return out


def moe_held_bytes(spec: "ModelSpec", layout: "Layout", layers: int, n_moe: int, received: list[int] | None,
                   first: bool, last: bool) -> float:
    """Saved bytes of one micro-batch on one stage of ``layers`` layers, ``n_moe`` of them MoE
    (``received[i]``: the rows this rank's experts received in the stage's ``i``-th MoE layer; None
    without EP)."""
    T, r = layout.mbs * layout.seq, residual_bytes(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    dense = layer_terms(spec, T, layout.seq, layout.tp, layout.sp, c, r)
    attention = sum(v for key, v in dense.items() if not key.startswith("mlp"))
    fixed = (layers - n_moe) * sum(dense.values()) + n_moe * attention
    stage = sum(stage_terms(spec, T, layout.seq, layout.tp, layout.sp, c, first, last, r).values())
    ep_split = layout.ep > 1
    T_moe = T // layout.tp if layout.folded and layout.tp > 1 else T  # folded: each TP rank routes its slice
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
    each micro-batch's loss, and with it part of its graph, to the step's end: not broken down for an
    MoE layer (None)."""
    if layout.param_dtype not in ("fp32", "bf16"):
        return None
    last_stage = layout.pp * layout.virtual_stages - 1
    zb = layout.schedule == "zero-bubble"
    if zb and (spec.attention_kind != "gqa") and any(stage == last_stage for _k, stage, _mb in order):
        return None  # as activations.py: the last stage's graph not broken down for these layers
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
    T = layout.mbs * layout.seq
    c = 2 if layout.param_dtype == "bf16" else FP32
    h = spec.hidden_size
    attention, mlp, head = weight_step_parts(spec, layout)
    out = layers * attention + (layers - n_moe) * mlp
    f = spec.expert_ffn_size // layout.expert_tp
    T_moe = T // layout.tp if layout.folded and layout.tp > 1 else T
    for R in (received if received is not None else [T_moe * spec.top_k] * n_moe):
        terms = moe_block_terms(spec, layout, T_moe, R, layout.ep > 1)
        out += FP32 * T_moe * h + terms["expert_rows"] + c * R * f
        if spec.num_shared_experts:
            out += c * T_moe * spec.num_shared_experts * spec.expert_ffn_size / layout.tp
    return out + head


def moe_rank_activation_bytes(spec: "ModelSpec", layout: "Layout", moe_ids: list[int], layers: int,
                              received: list[list[int]] | None, first: bool = True, last: bool = True,
                              in_flight: int = 1) -> float | None:
    """Peak saved-for-backward bytes of one rank of an MoE model holding ``layers`` layers, the MoE
    ones ``moe_ids`` (``received[mb][i]``: the rows the experts of this rank received in its ``i``-th
    MoE layer of micro-batch ``mb``; None without EP), ``first`` / ``last`` pipeline stage, with
    ``in_flight`` micro-batches held at the peak (a pipeline schedule's; the peak is the largest run
    of that many consecutive micro-batches, as 1F1B and GPipe hold them); None where not modelled."""
    if layout.param_dtype not in ("fp32", "bf16"):
        return None  # checked: fp32, bf16 autocast over fp32 parameters, bf16-held parameters
    T, r = layout.mbs * layout.seq, residual_bytes(layout)
    c = 2 if layout.param_dtype == "bf16" else FP32
    dense = layer_terms(spec, T, layout.seq, layout.tp, layout.sp, c, r)
    attention = sum(v for key, v in dense.items() if not key.startswith("mlp"))
    fixed = (layers - len(moe_ids)) * sum(dense.values()) + len(moe_ids) * attention
    stage = sum(stage_terms(spec, T, layout.seq, layout.tp, layout.sp, c, first, last, r).values())
    ep_split = layout.ep > 1
    # a folded expert mesh leaves the MoE blocks whole on each TP rank, which routes its slice of the sequence
    T_moe = T // layout.tp if layout.folded and layout.tp > 1 else T
    per_mb = received if received is not None else [[T_moe * spec.top_k] * len(moe_ids)] * layout.num_microbatches
    one = [fixed + stage + sum(sum(moe_block_terms(spec, layout, T_moe, R, ep_split).values()) for R in mb)
           for mb in per_mb]
    k = max(1, min(in_flight, len(one)))
    return float(max(sum(one[i:i + k]) for i in range(len(one) - k + 1)))
