"""Bytes our reference runtime (eager PyTorch, runtime/model/transformer.py) saves for backward, per rank.

plan/cost/activations.py sizes what a fused production stack keeps (Megatron / Transformer Engine:
fused SwiGLU, fused norms, GQA keys not expanded). modelcarve's own runtime is eager PyTorch and
saves more; to check the planner against it (``verify --against-plan``) this module counts the
tensors it really saves, term by term, per micro-batch of ``T = mbs x seq / cp`` tokens on one rank
(``t`` = tp, ``rep`` = t under sequence parallelism else 1, ``c`` the compute dtype's bytes,
residual stream, norms, logits and the loss in fp32; where the runtime holds bf16 parameters,
spec/support.held_param_dtype, the embedding's output and so the residual stream are bf16: each
norm's output is saved in bf16 and the projections read that one tensor, no autocast copies):

* each RMSNorm: its input and its normalised output ``2 x 4 T h / rep`` and the fp32 inverse
  RMS ``4 T / rep``;
* attention: the projections' input (fp32: one tensor for q, k, v; bf16: autocast's three
  casts), q and the keys and values expanded to every query head (``repeat_kv``) ``3 c T nh hd
  / t``, the fused attention's output ``c T nh hd / t`` and its fp32 log-sum-exp ``4 T nh / t``
  (``F.scaled_dot_product_attention`` runs a flash / memory-efficient kernel, which saves no
  ``s x s`` scores: on CPU ``ScaledDotProductFlashAttentionForCpuBackward`` keeps q, k, v, out
  and the log-sum-exp, at any seq), the output projection's input ``c T nh hd / t`` (a
  contiguous copy of the output, transposed back);
* SwiGLU MLP: its input (one fp32 tensor, or two bf16 casts), gate, up and SiLU outputs
  ``3 c T f / t`` and the down projection's input ``c T f / t``;
* per stage: rotary cos / sin ``2 x 4 s hd``; first stage the token ids (int64); last stage the
  final norm, the head's input, the fp32 logits ``4 T V / t``, the targets (int64) and the loss;
* gpt2: each LayerNorm its input, mean and inverse std per row, ``r T h / rep + 2 r T / rep`` in the
  residual stream's dtype ``r`` (its output is the projections' input); the GELU MLP the
  activation's input and the down projection's input ``2 c T f / t`` (its input: one autocast copy);
  no rotary tables, but the learned position lookup's int64 positions ``8 s`` once per step on the
  first stage (``position_bytes``); biases (gpt2, llama's ``attention_bias`` / ``mlp_bias``) add
  nothing. Exact on a tiny gpt2 in fp32 (dp, zero1, fsdp, cp, pp 1F1B; full and selective
  recomputation) and under bf16 autocast (tp: the 28 bytes of masks), and on a tiny biased llama
  (bf16-held parameters 1,024 bytes over: the rotary tables, as without biases).

Peak over a step: the stage's layers x the micro-batches in flight (1 without a pipeline).
Interleaved 1F1B (``virtual_stages`` v > 1, torch's ``ScheduleInterleaved1F1B``): pipeline rank
``r`` of ``p`` peaks just before its first backward, after ``N = min(m v, 2 (p - r - 1) + (v - 1) p
+ 1)`` forwards (plan/cost/schedule.py's count), issued in Megatron's order: ``p`` micro-batches
of chunk 0, ``p`` of chunk 1, ... so forward ``k`` runs chunk ``(k // p) % v``, i.e. stage ``r +
chunk p`` (spec/stages.py), and each counts that stage's own layers and stage terms (checked on
tiny-llama, pp=2, v=2: rank 0 holds 3 micro-batches of stage 0 and 2 of stage 2, rank 1 2 of
stage 1 and 1 of the last). MoE layers go to moe_activations.py; the zero-bubble schedule (its
input-gradient step keeps part of each micro-batch's graph for the deferred weight gradients) is
``zero_bubble_activation_bytes``, given the executed order.

Context parallelism (``ring``): ring attention (runtime/parallel/ring_attention.py, autocast off
inside) saves q and k as it gets them, rotated, so in the rotary tables' dtype (the residual
stream's: fp32 under autocast), v unexpanded in the compute dtype (MLA: a view of the whole kv up
projection), its fp32 accumulator output and fp32 log-sum-exp; the same in fp32, exact on tiny-llama
and the tiny Qwen3-MoE in bf16, MLA 0.57% over in bf16 (the rotary tables the ring path does not keep).

Recomputation (runtime/parallel/recompute.py, non-reentrant ``torch.utils.checkpoint``; measured
as runtime/measure/memory_report.py describes): a checkpointed region keeps only its inputs from its
forward to its backward, and re-saves its tensors when the backward reaches it, holding them until
its backward ends (``recompute_terms``):

* ``full`` (each block): a layer keeps its input, the residual stream ``resid T h / rep``
  (the rotary ``(cos, sin)`` it is also given are the stage's ``rope`` term, one pair a
  micro-batch); the recomputed layer re-saves ``layer_terms``, less the first norm's fp32 input
  where that is the block's input itself (an fp32 residual stream: ``x.float()`` is ``x``);
* ``selective`` (the attention core): a layer keeps ``layer_terms`` but for the core's saved
  tensors (``qkv``, ``attn_out``) its inputs: q and k after rotary in the rotary tables' dtype
  (the residual stream's: ``resid T (nh + kv) hd / t``) and v unexpanded ``c T kv hd / t``; the
  recomputed core re-saves ``qkv`` and ``attn_out``, less the views it keeps (q where ``c ==
  resid``; k and v too without GQA expansion).

Peak (``recompute_peak``), of the ``n`` micro-batches in flight each holding ``F1 = layers x kept
+ stage terms``: the larger of the end of the last forward, ``n F1``, and the first backward's
recomputation of its stage's last layer, ``n F1 - head - freed + recomputed``, where ``head`` is
the last stage's loss terms (final norm, head input, logits, targets: freed before the first layer's
backward), ``freed`` what the layer's own backward has freed before the region's (``full``: nothing;
``selective``: its MLP, MLP input, second norm and output projection's input) and ``recomputed`` the
region's re-saved tensors. Checked tensor by tensor on one tiny-llama block, seq 16, fp32: ``full``
keeps 4,096 + 2,048 (input, cos/sin) and peaks in the backward at 4,096 + 2,048 + 128 (token ids) +
78,208 - 4,096 = 80,384 bytes; ``selective`` peaks at the end of the forward, 8,448 under no
recomputation (q, k, v 8,192 kept instead of q / expanded k, v / out / lse 16,640).
Qwen3's q/k norms are ``layer_terms`` outside the core: ``full`` re-saves them with the block,
``selective`` keeps them (checked on the tiny Qwen3, dp / tp / pp 1f1b, fp32 and bf16: exact but for
the 28 bytes of tp masks). MLA: ``full`` as above; ``selective`` keeps the core's inputs, q and k (each
a ``cat`` of the nope part and the rotated rope part: the residual stream's dtype) and v (a view of the
kv up projection, its value head, compute dtype), and re-saves ``attn_core`` (the math path's copies:
no view shared); exact in fp32 and bf16 (autocast) on the tiny DeepSeek-V3, dp / tp / pp 1f1b.
Interleaved 1F1B under recomputation (``scheduled_recompute_peak``): the rank's executed actions
walked, each forward of stage ``s`` keeping ``layers(s) x kept + stage terms`` to its backward, each
backward peaking as above on top of everything else held (1F1B / GPipe are the one-stage case:
the walk gives ``recompute_peak``'s bytes). Exact on tiny-llama, pp=2, v=2 (tests/verify/
test_verify_against_plan.py): ``full`` 105,344 / 92,544 bytes on ranks 0 / 1 at m = 4 and 8,
``selective`` 359,552 / 244,292 in fp32 (m = 4), 272,512 / 190,020 with bf16 parameters (m = 8).
Zero-bubble under recomputation (the same walk over the executed F / I / W; what is held is
runtime/measure/memory_report.py's module doc, the allocator's view): torch's input step I
(``retain_graph``) recomputes one region at a time and each recomputed copy is freed once autograd
unpacks it, so I peaks at the largest region's re-saved tensors on top of everything held and then
frees only the last stage's loss targets; its W runs one ``autograd.grad`` per weight group (a new
graph task each), so under ``full`` each group recomputes its layer's region again and the copies its
node does not unpack stay while the graph does (``weight_step_walk``, ``layer_weight_frees``: 9 groups a
tiny-llama layer, 45,440 of its 74,112 re-saved bytes saved by no weight node); ``selective``'s core
has no weight, so W recomputes nothing. W then frees the micro-batch (the last stage: only its weight
nodes' inputs outside the regions, the loss's graph held to the step's end, ``weight_step_frees``);
the first stage skips I and runs its full backward at W. Exact on tiny-llama pp=2, every run: first
stage 94,848 full, 283,392 selective; last stage 6,871,552 full (m = 8; it was measured at
1,079,428-1,096,324 and modelled at 1,104,516 when an I copy was counted to W), 562,820 selective.
MoE layers: moe_activations.py's ``parts`` in the same walk.
Ring attention (context parallel) under recomputation: ``recompute_terms(ring=True)``, the ring's saved
tensors (``layer_terms``) re-saved by ``full``, its inputs kept and its core re-saved by ``selective``; exact
in fp32 on tiny-llama, tiny-moe (cp=2 full x ep=2 96,520 / 73,920, selective 240,164) and the tiny Qwen3-MoE
(full 55,392; selective x ep=2 138,068 / 116,172; bf16 selective 94,180); MLA selective exact on the dense
tiny DeepSeek-V3 (53,412), 288 B over with its MoE layer (0.4%); MLA full over by 1,024 B (dense, 3.9%)
and 1,312 B (MoE x ep=2, 3.3-3.6%), not found (256 of them are the rotary tables the ring path does not keep).
Not checked, so ``None``: recompute modes other than full / selective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.predict.timeline import action_order
from modelcarve.spec.stages import stage_counts
from modelcarve.spec.support import held_param_dtype

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec

FP32 = 4
INDEX = 8  # int64 token ids and targets


def _norm(T: float, h: int, rep: int, resid: int = FP32, layernorm: bool = False) -> float:
    """RMSNorm saves its fp32 input, the fp32 inverse RMS and its normalised output cast back to
    the residual stream's dtype (``resid`` bytes) for the weight's product. LayerNorm (gpt2) saves
    its input and the mean and inverse standard deviation of each row, all in the residual stream's
    dtype (fp32 under autocast; with bf16-held parameters torch's CPU kernel keeps bf16 statistics);
    its output, in that dtype too, is the next projections' saved input."""
    if layernorm:
        return resid * T * h / rep + 2 * resid * T / rep
    return (FP32 + resid) * T * h / rep + FP32 * T / rep


def residual_bytes(layout: "Layout") -> int:
    """Bytes of the residual stream: bf16 where the runtime holds bf16 parameters (the embedding's
    output is then bf16, spec/support.held_param_dtype), else fp32 (autocast leaves it fp32)."""
    return 2 if held_param_dtype(layout) == "bf16" else FP32


def layer_terms(spec: "ModelSpec", T: float, seq: int, tp: int, sp: bool, c: int,
                resid: int = FP32, ring: bool = False) -> dict[str, float]:
    """Saved bytes of one dense decoder layer and one micro-batch on one TP rank (``resid``: the
    residual stream's bytes, ``residual_bytes``; a bf16 stream feeds the projections with no
    autocast copies; ``ring``: context parallel, whose ring attention saves the keys and values
    with their kv heads only, not expanded to the query heads)."""
    h, hd, f = spec.hidden_size, spec.head_dim, spec.ffn_size
    rep = tp if sp else 1
    heads = spec.num_heads / tp
    ln, swiglu = spec.norm_kind == "layernorm", spec.ffn_kind == "swiglu"
    # the projections read the norm's output: one tensor when it is in the compute dtype, else one
    # autocast copy per projection (q, k, v; w1, w3 or gpt2's one w1)
    casts_attn, casts_mlp = (1, 1) if c == FP32 or resid == c else (3, 2 if swiglu else 1)
    kv = max(spec.num_kv_heads // tp, 1) if ring else heads
    if spec.attention_kind == "mla" and casts_attn == 3:
        casts_attn = 2  # autocast casts the input once for each down projection (q and kv), not three times
    terms = {
        "norms": 2 * _norm(T, h, rep, resid, ln),
        "attn_input": casts_attn * c * T * h,
        "qkv": c * T * (heads + 2 * kv) * hd,
        "attn_out": c * T * heads * hd + FP32 * T * heads,  # fused SDPA: output + log-sum-exp, no scores
        "proj_input": c * T * heads * spec.attn_v_head_dim,
        "mlp_input": casts_mlp * c * T * h,
        # SwiGLU: gate, up, SiLU outputs and the down projection's input; a two-matrix MLP (gpt2's
        # GELU): the activation's input and the down projection's input. A bias adds nothing: ``addmm``
        # keeps the input and the weight, the row-parallel ``out + bias`` nothing
        "mlp": (4 if swiglu else 2) * c * T * f / tp,
    }
    if spec.attention_kind == "mla":
        del terms["qkv"], terms["attn_out"]
        terms.update(mla_terms(spec, T, seq, tp, c, resid))
        if ring:  # ring attention's saved q, k (rope part appended), v, output and log-sum-exp (ring_terms)
            dqk, nope, dv = spec.qk_head_dim, spec.qk_head_dim - spec.qk_rope_head_dim, spec.attn_v_head_dim
            terms["attn_core"] = (resid * T * heads * 2 * dqk + c * T * heads * (nope + dv)
                                  + FP32 * T * heads * dv + FP32 * T * heads)
    elif ring:
        # ring attention (runtime/parallel/ring_attention.py, autocast off inside) saves q and k as it
        # gets them, rotated: in the rotary tables' dtype, the residual stream's (fp32 under autocast);
        # v unexpanded in the compute dtype; its fp32 accumulator output and fp32 log-sum-exp
        terms["qkv"] = resid * T * (heads + kv) * hd + c * T * kv * hd
        terms["attn_out"] = FP32 * T * heads * hd + FP32 * T * heads
    if spec.qk_norm:
        # Qwen3's per-head RMSNorm of q and of k (before rotary, kv heads not yet expanded):
        # each saves its fp32 input, the fp32 inverse RMS per head and row, its output in the compute dtype
        kvl = max(spec.num_kv_heads // tp, 1)
        terms["qk_norm"] = (FP32 + c) * T * (heads + kvl) * hd + FP32 * T * (heads + kvl)
    return terms


def mla_terms(spec: "ModelSpec", T: float, seq: int, tp: int, c: int, resid: int = FP32) -> dict[str, float]:
    """Saved bytes of MLA attention (runtime/model/transformer.py ``MLAttention``) for one layer and
    micro-batch on one TP rank (fp32 and bf16, checked tensor by tensor with saved_tensors_hooks; exact
    in fp32 and bf16 autocast on the tiny DeepSeek-V3, 128 bytes a layer over with bf16-held parameters, outside the attention): the q
    latent's RMSNorm (its input, inverse RMS, output) and the q up projection's input (with a q
    latent); the kv down projection's whole output (the norm's input is a view of it, the rope key
    beside the latent), the kv norm's inverse RMS and output and the kv up projection's input; the
    attention core on the math path (``F.scaled_dot_product_attention`` has no fused CPU kernel
    for a value head narrower than the query head): q and k (rope part appended), the ``s x s``
    softmax per head, and v as a view of the whole kv up projection output. The output
    projection's input is ``proj_input`` (``layer_terms``)."""
    n, rq, rkv, dv = spec.num_heads / tp, spec.q_lora_rank or 0, spec.kv_lora_rank, spec.attn_v_head_dim
    out = {}
    # each latent norm's output keeps its input's dtype: the projection's output, in the compute dtype
    if rq:
        out["q_latent"] = (FP32 + c) * T * rq + FP32 * T + c * T * rq
    # the kv norm's fp32 input: in fp32 the latent's view of the kv down projection output (counted at the
    # bytes it views, not the rope key beside it), in bf16 its fp32 upcast, a copy of the latent alone
    out["kv_latent"] = FP32 * T * rkv + FP32 * T + 2 * c * T * rkv
    # the math path, fp32 (bf16 inputs upcast): q and k^T scaled, the s x s softmax and its reshaped view
    # (two distinct views, each counted), v made contiguous (a copy of the view: value head only)
    out["attn_core"] = 2 * FP32 * T * n * spec.qk_head_dim + 2 * FP32 * n * T * seq + FP32 * T * n * dv
    return out


def stage_terms(spec: "ModelSpec", T: float, seq: int, tp: int, sp: bool, c: int, first: bool, last: bool,
                resid: int = FP32) -> dict[str, float]:
    """Once per stage and micro-batch: rotary tables, token ids, final norm, head input, logits, loss."""
    rep = tp if sp else 1
    out = {}
    if spec.position_kind == "rope":
        out["rope"] = 2 * FP32 * seq * (spec.qk_rope_head_dim if spec.attention_kind == "mla" else spec.head_dim)
    if first:
        out["token_ids"] = INDEX * T
    if last:
        out["final_norm"] = _norm(T, spec.hidden_size, rep, resid, spec.norm_kind == "layernorm")
        out["head_input"] = c * T * spec.hidden_size
        vocab = spec.vocab_size if spec.vocab_size % tp == 0 else -(-spec.vocab_size // (tp * 128)) * tp * 128
        out["logits"] = FP32 * T * vocab / tp  # the padded shard (runtime/parallel/tensor.py)
        out["targets"] = INDEX * T + FP32
    return out


def position_bytes(spec: "ModelSpec", layout: "Layout", first: bool) -> float:
    """The learned position table's lookup (gpt2) keeps its int64 positions, one row of the rank's
    ``seq / cp``, once per step on the first stage whatever the micro-batches in flight: the trainer
    makes them for each micro-batch with one in flight, torch's pipeline schedule hands every
    micro-batch the step's one tensor (a replicated keyword argument, runtime/parallel/pipeline.py).
    The position rows' add to the token embedding saves nothing."""
    return float(INDEX * (layout.seq // layout.cp)) if first and spec.position_kind == "learned" else 0.0


RECOMPUTE_CHECKED = ("none", "full", "selective")
"""``recompute`` modes ``rank_activation_bytes`` predicts (the runtime's, spec/support.py)."""


def recompute_unchecked(spec: "ModelSpec", layout: "Layout") -> str | None:
    """Why recomputation's saved bytes are not predicted for this layout (module doc), or None."""
    if layout.recompute == "none":
        return None
    if layout.recompute not in RECOMPUTE_CHECKED:
        return f"recompute={layout.recompute}"
    return None


def _block_input_shared(spec: "ModelSpec", T: float, h: int, rep: int, resid: int) -> float:
    """Bytes of the first norm's saved input that are the checkpointed block's input itself (no new
    tensor when recomputed): RMSNorm's fp32 input where the residual stream is fp32 (``x.float()`` is
    ``x``), LayerNorm's input always (it normalises ``x`` as it comes)."""
    if spec.norm_kind == "layernorm":
        return resid * T * h / rep
    return FP32 * T * h / rep if resid == FP32 else 0


def recompute_terms(spec: "ModelSpec", T: float, seq: int, tp: int, sp: bool, c: int, resid: int,
                    mode: str, ring: bool = False) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """One layer and micro-batch under ``mode`` (``full`` / ``selective``; module doc): the bytes it
    keeps from its forward to its backward, those its own backward frees before the checkpointed
    region's backward, and those the region's recomputation re-saves (the views it keeps already
    taken out)."""
    h, hd = spec.hidden_size, spec.head_dim
    rep = tp if sp else 1
    heads, kv = spec.num_heads / tp, max(spec.num_kv_heads // tp, 1)
    saved = layer_terms(spec, T, seq, tp, sp, c, resid, ring)
    if mode == "full":
        shared = _block_input_shared(spec, T, h, rep, resid)
        return {"block_input": resid * T * h / rep}, {}, dict(saved, block_input_shared=-shared)
    freed = {"mlp": saved["mlp"], "mlp_input": saved["mlp_input"], "ffn_norm": _norm(T, h, rep, resid, spec.norm_kind == "layernorm"),
             "proj_input": saved["proj_input"]}
    if spec.attention_kind == "mla":
        # the core's inputs: q and k (``cat`` of the nope part, compute dtype, and the rotated rope part, the
        # rotary tables' dtype: promoted to the residual stream's) and v, a view of the kv up projection (its
        # value head); the math path re-saves copies of all three (mla_terms), none a view the region keeps
        kept = {k: v for k, v in saved.items() if k != "attn_core"}
        kept["core_inputs"] = resid * T * heads * 2 * spec.qk_head_dim + c * T * heads * spec.attn_v_head_dim
        return kept, freed, {"attn_core": saved["attn_core"]}
    kept = {k: v for k, v in saved.items() if k not in ("qkv", "attn_out")}
    kept["core_inputs"] = resid * T * (heads + kv) * hd + c * T * kv * hd
    shared = (c * T * heads * hd if c == resid else 0) + (2 * c * T * kv * hd if kv == heads and c == resid else 0)
    return kept, freed, {"qkv": saved["qkv"], "attn_out": saved["attn_out"], "core_inputs_shared": -shared}


def recompute_peak(spec: "ModelSpec", layout: "Layout", layers: int, first: bool, last: bool, in_flight: int) -> float:
    """Peak saved bytes of one rank under recomputation (module doc): the end of the last forward or
    the recomputation of the stage's last layer in the first backward, whichever is larger."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq = layout.seq // layout.cp
    T, r = layout.mbs * seq, residual_bytes(layout)
    kept, freed, recomputed = recompute_terms(spec, T, seq, layout.tp, layout.sp, c, r, layout.recompute, layout.cp > 1)
    stage = stage_terms(spec, T, seq, layout.tp, layout.sp, c, first, last, r)
    held = in_flight * (layers * sum(kept.values()) + sum(stage.values())) + position_bytes(spec, layout, first)
    head = sum(v for k, v in stage.items() if k not in ("rope", "token_ids"))
    backward = held - head - sum(freed.values()) + sum(recomputed.values())
    return float(max(held, backward))


def rank_activation_bytes(spec: "ModelSpec", layout: "Layout", layers: int, first: bool, last: bool,
                          in_flight: int = 1) -> float | None:
    """Peak saved-for-backward bytes of one rank (None where this model does not apply)."""
    if spec.is_moe or spec.attention_kind not in ("gqa", "mla"):
        return None
    if layout.recompute != "none":
        if recompute_unchecked(spec, layout) is not None:
            return None
        return recompute_peak(spec, layout, layers, first, last, in_flight)
    if layout.pp > 1 and layout.schedule == "zero-bubble":
        return None
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq, ring = layout.seq // layout.cp, layout.cp > 1  # a rank's zig-zag chunks (cp)
    T = layout.mbs * seq
    r = residual_bytes(layout)
    one = layers * sum(layer_terms(spec, T, seq, layout.tp, layout.sp, c, r, ring).values())
    one += sum(stage_terms(spec, T, seq, layout.tp, layout.sp, c, first, last, r).values())
    return float(one * in_flight + position_bytes(spec, layout, first))


def interleaved_activation_bytes(spec: "ModelSpec", layout: "Layout", pp_rank: int,
                                 order: list | None = None) -> float | None:
    """Peak saved-for-backward bytes of pipeline rank ``pp_rank`` under interleaved 1F1B (see the
    module doc: the first ``N`` forwards, each of its own stage), None where this model does not apply.
    Under recomputation ``scheduled_recompute_peak`` over ``order``, the rank's executed actions
    (default: plan/predict/timeline.py's ``action_order``)."""
    if rank_activation_bytes(spec, layout, 1, False, False) is None:
        return None
    if layout.recompute != "none":
        if order is None:
            order = action_order(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages, pp_rank)
        return scheduled_recompute_peak(spec, layout, order)
    p, v, m = layout.pp, layout.virtual_stages, layout.num_microbatches
    held = stage_held_bytes(spec, layout)
    n = min(m * v, 2 * (p - pp_rank - 1) + (v - 1) * p + 1)
    return sum(held(pp_rank + ((k // p) % v) * p) for k in range(n)) + position_bytes(spec, layout, pp_rank == 0)


def scheduled_recompute_peak(spec: "ModelSpec", layout: "Layout", order: list, parts=None) -> float:
    """Peak saved bytes of one pipeline rank under recomputation, given its actions ``(kind, stage,
    micro-batch)`` in executed order (module doc): each forward F of stage ``s`` keeps its micro-batch's
    ``layers(s) x kept + stage terms`` until its backward B; each B first frees the loss terms (the last
    stage's ``head``) and what the layer's own backward frees before the checkpointed region, then
    re-saves the region's tensors (the stage's last layer: the largest moment of that backward), on top
    of everything else held. Zero-bubble: I (``retain_graph``) frees nothing but the last stage's loss
    targets; it recomputes one region at a time, each recomputed copy gone once autograd unpacked it
    (the largest region on top of everything held); W walks ``weight_step_walk`` (``full``: each weight
    group recomputes its region again), then frees the micro-batch with the walk's residue (the last
    stage: only its weight nodes' inputs outside the regions, the loss's graph with the residue held to
    the step's end); the first stage's W is its full backward. ``recompute_peak`` is the 1F1B / GPipe
    case of this walk. ``parts(s, mb)``: (kept; the backward's peak over what is held, or None for a
    stage without layers; I's recomputation over what is held; freed by the last stage's W outside the
    regions; ``weight_step_walk``'s layers) of one micro-batch; default the dense model's
    (moe_activations.py passes its own: each MoE layer with its routing)."""
    last_stage = layout.pp * layout.virtual_stages - 1
    targets = INDEX * layout.mbs * layout.seq // layout.cp + FP32
    parts = parts or dense_recompute_parts(spec, layout)
    live, peak = 0.0, 0.0
    for kind, s, mb in order:
        held, extra, again, w_frees, walk = parts(s, mb)
        if kind == "F":
            live += held
            peak = max(peak, live)
        elif kind == "B" or (kind == "W" and s == 0):  # zero-bubble's first stage: I skipped, W the full backward
            if extra is not None:
                peak = max(peak, live + extra)
            live -= held
        elif kind == "I" and s != 0:
            if again is not None:
                peak = max(peak, live + again)
            live -= targets if s == last_stage else 0.0
        elif kind == "W":
            live, peak, residue = weight_step_walk(live, peak, walk)
            live -= w_frees if s == last_stage else held + residue
    return float(peak + position_bytes(spec, layout, any(s == 0 for _, s, _ in order)))


def weight_step_walk(live: float, peak: float, walk: list) -> tuple[float, float, float]:
    """Zero-bubble's W of one micro-batch under ``full`` recomputation (runtime/measure/memory_report.py's
    module doc): torch's ``stage_backward_weight`` runs one ``autograd.grad`` per weight group (one
    parameter, in the stage's parameter order), each its own graph task, so the checkpoint recomputes
    the group's region anew for it, every slot still held re-saved. Of a layer (``walk``: ``(again,
    frees)`` per layer in order, ``again`` one recomputation's bytes, ``frees[j]`` what group ``j``'s
    node frees, per copy, by its slots' release: the tensors no later group's node saves) group ``j``
    re-saves ``again - sum(frees) + sum(frees[j:])`` and frees ``j + 1`` copies of ``frees[j]``; the
    copies of the tensors no weight node saves stay while the graph lives. Returns (live, peak, what
    the walk left held)."""
    start = live
    for again, frees in walk:
        rest = again - sum(frees)
        for j, f in enumerate(frees):
            live += rest + sum(frees[j:])
            peak = max(peak, live)
            live -= (j + 1) * f
    return live, peak, live - start


def layer_weight_frees(spec: "ModelSpec", layout: "Layout", mlp: list[float] | None = None) -> list[float]:
    """``weight_step_walk``'s ``frees`` of one layer, per weight group in parameter order (attention norm,
    projections, q / k norms or MLA's latents, ffn norm, then the MLP's w1, w3, w2 or ``mlp``): the bytes
    whose last saving weight node is that group's, per recomputed copy (``weight_step_parts``, split).
    LayerNorm's own node saves its input, mean and inverse std (the first's input is the block input,
    re-saved as no copy); a two-matrix MLP (gpt2's GELU) has two groups, w1's input and w2's. A row-parallel
    bias's group under tp saves nothing and recomputes nothing: no entry (step_traffic.weight_groups).
    Checked on GQA layers with and without q / k norms in fp32, with biases and on gpt2's layer (tp = 1
    and cp = 2: exact); MLA's and autocast's splits are not."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq = layout.seq // layout.cp
    T, r, rep, t = layout.mbs * seq, residual_bytes(layout), layout.tp if layout.sp else 1, layout.tp
    terms = layer_terms(spec, T, seq, t, layout.sp, c, r, layout.cp > 1)
    cast = c != r  # autocast: each projection saves its own cast
    if spec.norm_kind == "layernorm":  # its own node saves input, mean and inverse std; the first's input is the block's
        ffn_norm = _norm(T, spec.hidden_size, rep, r, True)
        norm = ffn_norm - _block_input_shared(spec, T, spec.hidden_size, rep, r)
    else:  # RMSNorm's weight product saves the normalised output
        norm = ffn_norm = r * T * spec.hidden_size / rep
    ai = terms["attn_input"]
    if spec.attention_kind == "mla":
        qr, kvr = spec.q_lora_rank or 0, spec.kv_lora_rank
        q = [ai / 2 if cast else 0.0, c * T * qr, c * T * qr] if qr else [ai / 2 if cast else 0.0]
        attention = q + [ai / 2 if cast else ai, c * T * kvr, c * T * kvr, terms["proj_input"]]
    else:
        attention = [ai / 3, ai / 3, ai / 3] if cast else [0.0, 0.0, ai]
        attention.append(terms["proj_input"])
        if spec.qk_norm:
            attention += [c * T * spec.num_heads / t * spec.head_dim, c * T * max(spec.num_kv_heads // t, 1) * spec.head_dim]
    if mlp is None:  # SwiGLU's w1, w3 (one input, or a cast each), w2; a two-matrix MLP's w1 and w2
        mi = terms["mlp_input"]
        mlp = ([mi / 2, mi / 2] if cast else [0.0, mi]) if spec.ffn_kind == "swiglu" else [mi]
        mlp.append(c * T * spec.ffn_size / t)
    return [norm] + attention + [ffn_norm] + mlp


def dense_recompute_parts(spec: "ModelSpec", layout: "Layout"):
    """``scheduled_recompute_peak``'s ``parts`` of a dense model: ``(stage, mb) -> (kept, backward
    peak over the rest held, I's recomputation over it, freed by the last stage's W outside the regions,
    ``weight_step_walk``'s layers)``."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq = layout.seq // layout.cp
    T, r = layout.mbs * seq, residual_bytes(layout)
    kept, freed, recomputed = recompute_terms(spec, T, seq, layout.tp, layout.sp, c, r, layout.recompute, layout.cp > 1)
    last_stage = layout.pp * layout.virtual_stages - 1
    counts = stage_counts(spec.num_layers, layout.pp, layout.virtual_stages)
    per_layer, again = sum(kept.values()), sum(recomputed.values())
    full = layout.recompute == "full"
    frees = layer_weight_frees(spec, layout) if full else []

    def parts(s: int, _mb: int) -> tuple[float, float | None, float | None, float, list]:
        terms = stage_terms(spec, T, seq, layout.tp, layout.sp, c, s == 0, s == last_stage, r)
        head = sum(v for k, v in terms.items() if k not in ("rope", "token_ids"))
        outside = weight_step_frees(spec, layout, 0 if full else counts[s], True)
        return (counts[s] * per_layer + sum(terms.values()), -head - sum(freed.values()) + again if counts[s] else None,
                again if counts[s] else None, outside, [(again, frees)] * counts[s] if full else [])

    return parts


def stage_held_bytes(spec: "ModelSpec", layout: "Layout"):
    """``stage -> bytes`` one micro-batch saves on pipeline stage ``stage`` (of ``pp x virtual_stages``):
    its own layers (spec/stages.py's split) and stage terms (embedding's, head's)."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq, ring = layout.seq // layout.cp, layout.cp > 1
    T, last_stage = layout.mbs * seq, layout.pp * layout.virtual_stages - 1
    r = residual_bytes(layout)
    layer = sum(layer_terms(spec, T, seq, layout.tp, layout.sp, c, r, ring).values())
    counts = stage_counts(spec.num_layers, layout.pp, layout.virtual_stages)

    def held(stage: int) -> float:
        terms = stage_terms(spec, T, seq, layout.tp, layout.sp, c, stage == 0, stage == last_stage, r)
        return counts[stage] * layer + sum(terms.values())

    return held


def weight_step_frees(spec: "ModelSpec", layout: "Layout", layers: int, last: bool) -> float:
    """Of one micro-batch's saved bytes on a stage of ``layers`` layers, those the deferred weight
    step W frees by itself: W runs only the autograd nodes whose inputs lead to a weight (each
    projection's matmul, each norm's product with its weight) with ``retain_graph=False``, so it
    frees their saved tensors and nothing else: per layer the projections' inputs (``attn_input``,
    ``proj_input``, ``mlp_input``, the down projection's input ``c T f / t``) and the two norms'
    normalised outputs; on the last stage also the final norm's and the head's input. (The loss's own
    saved tensors, the targets and the total weight, go with the input step I: measured per action on
    tiny-llama, I -132 bytes, W -65,536, the rest held to the step's end.)"""
    attention, mlp, head = weight_step_parts(spec, layout)
    return layers * (attention + mlp) + (head if last else 0.0)


def weight_step_parts(spec: "ModelSpec", layout: "Layout") -> tuple[float, float, float]:
    """``weight_step_frees`` by part, per micro-batch: (a layer's attention side: the projections'
    inputs and the two norms' outputs, Qwen3's q / k norms' outputs in the compute dtype; a dense MLP's input and
    down projection input; the last stage's final norm output and head input)."""
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq = layout.seq // layout.cp
    T, r, rep = layout.mbs * seq, residual_bytes(layout), layout.tp if layout.sp else 1
    terms = layer_terms(spec, T, seq, layout.tp, layout.sp, c, r, layout.cp > 1)
    h = spec.hidden_size
    # each norm's weight node: RMSNorm's product with its normalised output, LayerNorm's own node (its
    # input, mean and inverse std: ``_norm``)
    norm = _norm(T, h, rep, r, True) if spec.norm_kind == "layernorm" else r * T * h / rep
    attention = terms["attn_input"] + terms["proj_input"] + 2 * norm
    if spec.qk_norm:  # each q / k norm's normalised output, cast back to the compute dtype, saved for its weight's gradient
        attention += c * T * (spec.num_heads / layout.tp + max(spec.num_kv_heads // layout.tp, 1)) * spec.head_dim
    if spec.attention_kind == "mla":
        # each latent norm's normalised output (the latent's dtype, the down projection's: c), saved by its
        # product with the weight, and the up projection's input (c), both whole on every TP rank
        attention += 2 * c * T * ((spec.q_lora_rank or 0) + spec.kv_lora_rank)
    mlp = terms["mlp_input"] + c * T * spec.ffn_size / layout.tp
    head = norm + stage_terms(spec, T, seq, layout.tp, layout.sp, c, False, True, r)["head_input"]
    return attention, mlp, head


def zero_bubble_activation_bytes(spec: "ModelSpec", layout: "Layout", order: list) -> float | None:
    """Peak saved-for-backward bytes of one pipeline rank under the zero-bubble schedule, given the
    actions ``(kind, stage, micro-batch)`` it executed, in order (torch's ``ScheduleInterleavedZeroBubble``
    builds its order with its own algorithm; the runtime records it, runtime/parallel/pipeline.py).
    torch splits each backward into I (input gradients), which keeps the micro-batch's autograd graph
    for the deferred W (weight gradients), and W, which frees it: a micro-batch's activations of a
    stage are held from its F to its W (or its full B). Each stage counts its own layers and stage terms
    (as ``interleaved_activation_bytes``); the peak is the largest sum held at once.
    The last stage differs: torch's schedule keeps each micro-batch's loss until the step ends, and
    with it the micro-batch's whole graph; W frees only the saved tensors of the nodes it runs
    (``weight_step_frees``), I frees the loss's targets and total weight, the rest (norms' inputs and
    inverse RMS, q / k / v, attention's output and log-sum-exp, the MLP's gate / up / SiLU outputs,
    the logits) stays to the step's end.
    Checked on tiny-llama, pp=2, fp32 (tests/verify/test_verify_against_plan.py): exact on both
    ranks (the last stage's remainder is 121,664 bytes a micro-batch); Qwen3 (W also frees its q / k
    norms' fp32 outputs) exact in fp32; MLA (W also frees each latent norm's normalised output and
    each up projection's input) 1.7% low in fp32 on the tiny DeepSeek-V3, 0.7% in bf16. Under
    recomputation ``scheduled_recompute_peak``."""
    if rank_activation_bytes(spec, layout.replace(schedule="1f1b", virtual_stages=1), 1, False, False) is None:
        return None
    if layout.recompute != "none":
        return scheduled_recompute_peak(spec, layout, order)
    last_stage = layout.pp * layout.virtual_stages - 1
    counts = stage_counts(spec.num_layers, layout.pp, layout.virtual_stages)
    held = stage_held_bytes(spec, layout)
    c = 2 if layout.param_dtype in ("bf16", "fp16") else FP32
    seq = layout.seq // layout.cp
    targets = stage_terms(spec, layout.mbs * seq, seq, layout.tp, layout.sp, c, last_stage == 0, True,
                          residual_bytes(layout))["targets"]

    live, peak = 0.0, 0.0
    for kind, stage, _mb in order:
        if kind == "F":
            live += held(stage)
            peak = max(peak, live)
        elif kind == "B" or (kind == "W" and stage != last_stage):
            live -= held(stage)
        elif kind == "W":
            live -= weight_step_frees(spec, layout, counts[stage], True)
        elif kind == "I" and stage == last_stage:
            live -= targets
    return peak + position_bytes(spec, layout, any(s == 0 for _, s, _ in order))
