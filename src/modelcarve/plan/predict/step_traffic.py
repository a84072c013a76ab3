"""The planner's per-step prediction of one rank's collectives (op x group) and memory by category.

Usage::

    from modelcarve.plan.predict.step_traffic import predict_rank
    pred = predict_rank(spec, layout, rank=0)  # stage_layers: the runtime split (spec/stages.py)
    pred.messages        # [Message(op, group, dtype, payload, calls), ...]
    pred.memory          # {"params", "grads", "optimizer", "activations", "comm_buffers"}

What the runtime issues per training step (one optimiser step over ``m`` micro-batches), from
the same formulas the planner's time model uses (plan/cost/comm.py for wire bytes,
plan/cost/activations.py for saved activations), dtype-aware: a value carried in ``d`` bytes counts
``d`` bytes (fp32 layouts carry 4, bf16 layouts 2 where the runtime computes in bf16).

* data parallel (``zero=0``): one all-reduce of every local gradient over the dp x cp group
  (bucketed or not, the payload is the sum of the gradients: compare bytes, not calls);
  ZeRO-1/2: reduce-scatter of the gradients (once per step, not per micro-batch) + all-gather
  of the parameters over dp, of the flat buffer padded to a multiple of dp (Megatron's
  distributed optimiser, runtime/parallel/zero_optimizer.py); ZeRO-2 holds only its 1/dp
  range of the reduced gradients (measured from the optimiser's flat buffer); FSDP (``fsdp``, one shard group):
  per micro-batch each decoder layer's parameters all-gathered in forward and again in
  backward, the root (embeddings, final norm, head) once, and every unit's gradient
  reduce-scattered; under a pipeline see ``fsdp_units`` (zero-bubble: the runtime keeps the layers
  unsharded from their first forward to the step's reduction, so every unit is gathered and
  reduce-scattered once a step: tiny-llama pp=2 x dp=2, m = 4, 361,472 / 361,728 bytes each on the
  first / last stage, measured and predicted; also under full and selective recomputation, over cp and
  with HSDP);
* tensor parallel, per micro-batch: without ``sp`` two all-reduces per layer in forward (the
  row-parallel outputs, compute dtype) and two in backward (gradients, carried in the compute
  dtype by runtime/parallel/tensor.py) of the ``mbs x seq x h`` hidden, plus the vocab-parallel
  embedding's forward all-reduce (fp32: the embedding output) and the column-parallel head's
  input-gradient all-reduce (compute dtype); with ``sp`` each of those becomes an all-gather +
  reduce-scatter pair (the forward all-gathers move the fp32 norm outputs), and the replicated norm weights' gradients are
  all-reduced once per step; the vocab-parallel cross entropy all-reduces three ``mbs x seq``
  fp32 vectors (max, sum of exponentials, target logit); under ``recompute=full`` each layer's
  recomputation repeats its forward messages up to the block's last saved tensor (torch's early
  stop): the attention output's all-reduce (sp: reduce-scatter and both norm outputs' all-gathers),
  not the MLP's output one; ``selective`` recomputes no collective. Under the zero-bubble schedule a
  layer of any stage but the first is recomputed in the input step I and again once per weight group
  of the weight step W (one per weight tensor, its own graph task: ``layer_recomputations``, ``weight_groups``), each time
  with those messages (tiny-llama pp=2,tp=2 last stage: 10 recomputations a layer, 475,904 bytes of
  tp all-reduce measured and predicted; MoE's EP all-to-alls likewise, moe_traffic.ep_messages);
* pipeline (the fp32 residual stream): every stage but the last sends each micro-batch's output forward, every stage but
  the first sends its input gradient back, each to its neighbour stage's rank: a rank of an
  interleaved schedule sends for each of its ``virtual_stages`` chunks (``pipeline_sends``; torch's
  shape metadata messages are not predicted); under ``sp`` a stage's output is sequence-sharded, so each
  tp rank sends its ``1 / tp`` of the tokens;
* context parallel (ring attention over zig-zag chunks, ``mbs x seq / cp`` tokens a rank): per
  layer and micro-batch ``cp - 1`` K/V blocks sent forward, ``cp - 1`` again in backward and
  ``cp - 1`` fp32 dK/dV accumulators, all to the next rank of the cp ring (``ring_sends``; under
  recomputation the checkpointed forward runs the ring again: a third pass of K/V blocks); the
  gradients, the loss and ZeRO/FSDP state go over the dp x cp group (``group_along(..., "dp_cp")``);
* tied embeddings: under tp the vocab-parallel head reuses the embedding's shard (no message of
  its own); over pp the last stage holds a copy of the embedding (its tp shard) and the first and
  last stage of each pipeline all-reduce the two fp32 gradients once per step;
* biases, LayerNorm and learned positions (gpt2; llama with ``attention_bias`` / ``mlp_bias``): the
  column-parallel biases (wq / wk / wv, w1 / w3) split with their output columns, the row-parallel ones
  (wo, w2) whole on every TP rank (runtime/parallel/tensor.py adds them after the reduction), LayerNorm's
  bias beside its weight, the position table (``max_position x h``) whole on every TP rank of the first
  stage (FSDP2's root unit); all of them in the gradients' dp / ZeRO / FSDP traffic. Under ``sp`` the
  row-parallel biases' gradients are partial sums (each rank adds the bias to its sequence shard),
  all-reduced over tp once per step, one message each as the norms' (tiny llama with both biases, tp=2+sp:
  1,024 bytes of its 2,696-byte tp all-reduce, measured and predicted); without sp, and for the
  position table, no tp message;
* memory: fp32 parameters, gradients and AdamW moments (+ one fp32 step counter per tensor),
  sharded by FSDP / partitioned by ZeRO; activations from plan/predict/activations.py (what our
  eager runtime saves) and, beside them, plan/cost/activations.py's production-stack estimate;
  comm_buffers the largest single message;
* scalars: the loss averaged over dp (fp32) or broadcast from the last stage, and the global
  gradient norm all-reduced over every rank in fp64.

Groups are global rank tuples in the runtime's rank arithmetic (``rank = ((pp_i dp + dp_i) cp
+ cp_i) tp + tp_i``); the caller names their axis and tier with runtime/distributed/collectives.py's
``axis_of`` (the layout axes the group varies over, e.g. the norm's all-reduce on ``pp=2,tp=2``
is ``pp_tp``, never ``world``), as the comm log names the runtime's. ``NotModelled`` is raised for what
this model does not cover (MoE: moe_traffic.py; under zero-bubble with full recomputation LayerNorm /
learned positions over tp, any recompute mode (gpt2: the last stage's activations, ``_extras_unchecked``; gpt2 at
tp = 1 and over cp, and output / MLP biases over tp / cp exact, ``weight_groups``), biases in MoE models
(``check_moe_biases``) or with MLA's biases; ALiBi and an offset position
table (OPT: the runtime refuses both, spec/support.py); activations
under a recompute mode other than full / selective: activations.py's ``recompute_unchecked``): the verify
table marks those quantities as unpredicted instead of guessing. Ring attention under recomputation (GQA,
MLA, MoE layers) sends its K/V blocks a third time in the recomputed forward (``ring_sends``): exact on
tiny-llama, tiny-moe (also x ep=2), the tiny Qwen3-MoE and the tiny DeepSeek-V3 (dense and MoE), full and
selective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelcarve.plan.cost import comm
from modelcarve.plan.cost.activations import layer_activation_bytes
from modelcarve.plan.predict.activations import (interleaved_activation_bytes, rank_activation_bytes, residual_bytes,
                                                 zero_bubble_activation_bytes)
from modelcarve.plan.cost.schedule import in_flight_microbatches
from modelcarve.spec.ranks import coords, group_along, rank_of
from modelcarve.spec.stages import rank_layers, rank_stage_ids, stage_counts
from modelcarve.spec.support import fsdp_holds_gradients, fsdp_layer_gathers, held_param_dtype

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec

DTYPE_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "float32": 4, "bfloat16": 2, "float64": 8}
MASTER_BYTES = 4
LOW_BYTES = 2  # bf16 parameters of mixed-precision ZeRO-1/2 (spec/support.held_param_dtype)
"""The runtime keeps fp32 parameters, gradients and AdamW moments whatever the compute dtype."""


class NotModelled(ValueError):
    """The layout or model uses a feature this per-op model does not predict."""


@dataclass(frozen=True)
class Message:
    op: str
    group: tuple
    dtype: str
    payload: int
    calls: int = 1

    def wire(self) -> float:
        """Bytes this rank sends for the ``calls`` messages (plan/cost/comm.py's ring formulas)."""
        n = len(self.group)
        total = self.payload * self.calls
        if self.op == "all_reduce":
            return comm.ring_all_reduce_bytes(total, n)
        if self.op == "all_gather":
            return comm.all_gather_bytes(total, n)
        if self.op in ("reduce_scatter", "broadcast"):
            return comm.reduce_scatter_bytes(total, n)
        if self.op == "all_to_all":
            return comm.all_to_all_bytes(total, n)
        return float(total)  # send


@dataclass
class RankPrediction:
    messages: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


# --- parameters a rank holds ----------------------------------------------------------------
def _check_supported(spec: "ModelSpec", layout: "Layout") -> None:
    problems = []
    if spec.is_moe:
        problems.append("MoE layers")
    if spec.attention_kind not in ("gqa", "mla"):
        problems.append(f"{spec.attention_kind} attention")
    if spec.position_kind not in ("rope", "learned"):
        problems.append(f"{spec.position_kind} positions")
    if spec.position_offset:
        problems.append("an offset learned-position table")
    if spec.attention_kind == "mla" and (spec.qkv_bias or spec.o_bias):
        problems.append("MLA with attention biases")
    if layout.pp > 1 and layout.schedule == "zero-bubble" and _extras_unchecked(spec, layout):
        problems.append(f"{_extras_unchecked(spec, layout)} under the zero-bubble schedule")
    if layout.ep > 1:
        problems.append("expert parallelism")
    if problems:
        raise NotModelled("not modelled per op: " + ", ".join(problems))


def _extras_unchecked(spec: "ModelSpec", layout: "Layout") -> str:
    """The layers beyond llama's this model has that the zero-bubble schedule is not checked with, or
    ''. Checked (tiny gpt2, tiny llama with ``attention_bias`` / ``mlp_bias``, pp=2, fp32): exact without
    recomputation and under ``selective``; under ``full`` the messages exact with ``weight_groups``' count
    (biased llama over tp, tp + sp and cp; gpt2 over cp and tp) and the activations exact with
    activations.py's LayerNorm / GELU weight frees (gpt2 835,712 bytes on the last stage, over cp 417,856;
    biased llama over cp 702,336; over tp 1.9% over as tiny-llama's own). Refused: gpt2 over tp, in every
    recompute mode: its last stage holds less than the walk's held graph (tp=2, m = 4: 103,824 measured,
    122,244 predicted without recomputation; 85,008 / 115,716 selective; 161,536 / 451,200 full; not found)."""
    if layout.tp == 1:
        return ""
    extras = [what for present, what in ((spec.position_kind == "learned", "learned positions"),
                                         (spec.norm_kind == "layernorm", "LayerNorm")) if present]
    return ", ".join(extras) + " over tp" if extras else ""


def check_moe_biases(spec: "ModelSpec") -> None:
    """An MoE model's output / MLP biases and LayerNorms are not modelled (moe_traffic.py counts an MoE
    layer from ``layer_tensors`` less the dense MLP's matrices; its shared experts would carry MLP
    biases, its routed experts none): raised from ``layer_tensors``, which every MoE prediction reads."""
    if spec.is_moe and (spec.o_bias or spec.mlp_bias or spec.norm_kind == "layernorm" or spec.position_kind == "learned"):
        raise NotModelled("not modelled per op: MoE layers with output / MLP biases, LayerNorm or learned positions")


def mla_replicated(spec: "ModelSpec") -> list[int]:
    """Element counts of the MLA tensors every TP rank holds whole (runtime/parallel/tensor.py's
    ``replicated_partial``): the q down projection and its norm (with a q latent), the kv down
    projection (latent + the shared rope key) and its norm."""
    h, rq, rkv = spec.hidden_size, spec.q_lora_rank or 0, spec.kv_lora_rank
    out = [rq * h, rq] if rq else []
    return out + [(rkv + spec.qk_rope_head_dim) * h, rkv]


def _attention_tensors(spec: "ModelSpec", tp: int) -> list[int]:
    h, hd, nh = spec.hidden_size, spec.head_dim, spec.num_heads
    if spec.attention_kind == "mla":  # q (or its up projection) and kv_b column-split, wo row-split
        q_in = spec.q_lora_rank or h
        return [nh * spec.qk_head_dim * q_in // tp, *mla_replicated(spec),
                nh * (spec.qk_head_dim - spec.qk_rope_head_dim + spec.attn_v_head_dim) * spec.kv_lora_rank // tp,
                h * nh * spec.attn_v_head_dim // tp]
    kvl = max(spec.num_kv_heads / tp, 1.0)
    out = [h * nh * hd // tp, int(h * hd * kvl), int(h * hd * kvl), nh * hd * h // tp]
    if spec.qkv_bias:  # Qwen2's q / k / v biases, split with their projections' output columns
        out += [nh * hd // tp, int(hd * kvl), int(hd * kvl)]
    return out


def layer_tensors(spec: "ModelSpec", tp: int) -> list[int]:
    """Element counts of one dense decoder layer's parameter tensors on a TP rank (biases with their
    projections: split with a column-parallel one, whole with the row-parallel wo / w2)."""
    h, hd = spec.hidden_size, spec.head_dim
    check_moe_biases(spec)
    tensors = _attention_tensors(spec, tp)
    if spec.o_bias:  # wo's bias: row-parallel, whole on every TP rank, added once after the reduction
        tensors.append(h)
    f = spec.ffn_size // tp
    tensors += [h * f, h * f, f * h] if spec.ffn_kind == "swiglu" else [h * f, f * h]
    if spec.mlp_bias:  # w1 (/ w3) biases split with their output columns, w2's whole (row-parallel)
        tensors += ([f, f] if spec.ffn_kind == "swiglu" else [f]) + [h]
    tensors += [h] * (spec.layer_norms * norm_tensors(spec))  # replicated norm weights (and LayerNorm biases)
    if spec.qk_norm:  # Qwen3's per-head RMSNorm of q and k: one head_dim weight each, replicated
        tensors += [hd, hd]
    return tensors


def weight_groups(spec: "ModelSpec") -> int:
    """How many of torch's weight groups of one dense decoder layer recompute its checkpointed region
    in the zero-bubble weight step W (``layer_recomputations``). torch.distributed.pipelining's
    ``get_param_groups`` keys a parameter's group on the first node of the input-to-output graph its
    gradient path reaches, merging parameters that reach the same one: a Linear's bias shares its
    weight's ``addmm`` (every bias at tp = 1, the column-parallel ones under tp), LayerNorm's bias its
    weight's ``native_layer_norm``; a row-parallel bias under tp (runtime/parallel/tensor.py adds it
    after the reduction) reaches its ``add`` alone and makes a group of its own, but ``add`` saves no
    tensor, so its ``autograd.grad`` unpacks nothing and the checkpoint does not recompute. So one
    recomputation per weight tensor: the layer's tensors less its biases (tiny biased llama pp=2 over
    tp=2 and cp=2, and gpt2 over tp=2 and cp=2: 9 and 8 a layer, measured)."""
    swiglu = spec.ffn_kind == "swiglu"
    biases = (3 * int(spec.qkv_bias) + int(spec.o_bias) + (3 if swiglu else 2) * int(spec.mlp_bias)
              + spec.layer_norms * (norm_tensors(spec) - 1))
    return len(layer_tensors(spec, 1)) - biases


def norm_tensors(spec: "ModelSpec") -> int:
    """Parameter tensors of one norm: RMSNorm's weight, LayerNorm's weight and bias."""
    return 2 if spec.norm_kind == "layernorm" else 1


VOCAB_GRANULE = 128
"""runtime/parallel/tensor.py's ``VOCAB_GRANULE``: a vocabulary tp does not divide is padded to the
next multiple of ``tp x 128`` (``padded_vocab_size``); the plan cannot import the runtime, so the
rule is restated here and held equal by tests/test_verify_against_plan.py."""


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary the runtime shards: ``vocab`` if ``tp`` divides it, else the next multiple of
    ``tp x VOCAB_GRANULE``."""
    if vocab % tp == 0:
        return vocab
    return -(-vocab // (tp * VOCAB_GRANULE)) * tp * VOCAB_GRANULE


def root_tensors(spec: "ModelSpec", tp: int, first: bool, last: bool) -> list[int]:
    """Embedding and a learned position table (first stage), final norm and LM head (last stage) on a
    TP rank. A tied head
    reuses the embedding's (vocab-parallel) shard on a stage that holds both; a last stage
    without the embedding holds its own copy of it (runtime/parallel/pipeline_split.py), column-
    sharded like an untied head."""
    h, v = spec.hidden_size, padded_vocab(spec.vocab_size, tp) // tp
    out = [v * h] if first else []
    if first and spec.position_kind == "learned":  # the position table: whole on every TP rank (not vocab-split)
        out.append(spec.max_position * h)
    if last:
        out += [h] * norm_tensors(spec) + ([] if spec.tied_embeddings and first else [v * h])
    return out


def tied_group(spec: "ModelSpec", layout: "Layout", rank: int) -> tuple | None:
    """The first- and last-stage ranks of this rank's pipeline that sum the tied embedding's two
    gradients after every step (runtime/parallel/pipeline.py ``_sync_tied_grads``), or None."""
    if not spec.tied_embeddings or layout.pp == 1:
        return None
    c = coords(layout, rank)
    if c["pp"] not in (0, layout.pp - 1):
        return None
    return tuple(sorted({rank_of(layout, **(c | {"pp": 0})), rank_of(layout, **(c | {"pp": layout.pp - 1}))}))


# --- the prediction -------------------------------------------------------------------------
def predict_rank(spec: "ModelSpec", layout: "Layout", rank: int, *, stage_layers: int | None = None,
                 order: list | None = None) -> RankPrediction:
    """Messages and memory of one rank for one training step (see the module doc); ``order``: the
    rank's executed pipeline actions ``(kind, stage, micro-batch)``, for the zero-bubble schedule's
    activations (``zero_bubble_activation_bytes``)."""
    _check_supported(spec, layout)
    c = coords(layout, rank)
    stage, tp = c["pp"], layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    nl = stage_layers if stage_layers is not None else rank_layers(spec.num_layers, layout.pp, layout.virtual_stages)[stage]
    m = layout.num_microbatches
    act = DTYPE_SIZE[layout.param_dtype]
    tokens = layout.mbs * layout.seq // layout.cp  # this rank's share of a micro-batch (zig-zag chunks)
    hidden = tokens * spec.hidden_size  # elements of one micro-batch's hidden state on this rank
    layer, root = layer_tensors(spec, tp), root_tensors(spec, tp, first, last)
    local = nl * sum(layer) + sum(root)
    n_tensors = nl * len(layer) + len(root)
    msgs: list[Message] = []
    # the gradients (and ZeRO / FSDP state) go over dp x cp: runtime/parallel/data_parallel.py's dp_cp mesh
    dp_group, tp_group, pp_group = (group_along(layout, rank, a) for a in ("dp_cp", "tp", "pp"))

    if tp > 1:
        redo = m * sum(n * layer_recomputations(layout, s, weight_groups(spec)) for s, n in rank_stage_layers(spec, layout, stage, nl))
        msgs += tp_messages(spec, layout, tp_group, nl, first, last, m, hidden, act, tokens, rank, redo=redo)
    if layout.cp > 1:  # zero-bubble's W re-runs the ring's forward once per weight group too (full)
        redo = (m * sum(n * layer_recomputations(layout, s, weight_groups(spec)) for s, n in rank_stage_layers(spec, layout, stage, nl))
                if layout.recompute == "full" else None)
        msgs += ring_sends(spec, layout, rank, nl, m, tokens, redo=redo)
    if layout.pp > 1:
        msgs += pipeline_sends(layout, rank, hidden * 4 // (tp if layout.sp else 1))  # sp: the rank's sequence shard
        msgs.append(Message("broadcast", pp_group, "fp32", 4))  # the loss, from the last stage
        tied = tied_group(spec, layout, rank)
        if tied is not None:  # the embedding's and the head copy's gradients summed, fp32, once per step
            msgs.append(Message("all_reduce", tied, "fp32", spec.hidden_size * (padded_vocab(spec.vocab_size, tp) // tp) * MASTER_BYTES))
    params = grads = local * MASTER_BYTES
    optimizer = 2 * local * MASTER_BYTES + 4 * n_tensors
    low = held_param_dtype(layout) == "bf16"  # the runtime's precision policy (spec/support.py)
    if layout.dp * layout.cp > 1:
        # HSDP (dp_shard < dp): ZeRO state sharded over a shard group of n ranks inside dp x cp, the
        # reduced gradients then summed over the replicas (runtime/distributed/mesh.py merged_mesh:
        # (replicate, shard) with shard innermost)
        n, dp_group, replicas = shard_groups(layout, rank, dp_group)
        if layout.zero == 3:
            unit_l = sum(layer) * MASTER_BYTES
            for unit_r, layers, gather_l, gather_r, reduces in fsdp_units(spec, layout, rank, nl):
                msgs += [Message("all_gather", dp_group, "fp32", unit_l, gather_l * layers),
                         Message("all_gather", dp_group, "fp32", unit_r, gather_r),
                         Message("reduce_scatter", dp_group, "fp32", unit_l, reduces * layers),
                         Message("reduce_scatter", dp_group, "fp32", unit_r, reduces)]
                if replicas:  # FSDP2's HSDP: each reduce-scattered shard all-reduced over the replicas
                    msgs += [Message("all_reduce", replicas, "fp32", unit_l // n, reduces * layers),
                             Message("all_reduce", replicas, "fp32", unit_r // n, reduces)]
            params = grads = local * MASTER_BYTES // n
            optimizer = 2 * local * MASTER_BYTES // n + 4 * n_tensors
        elif layout.zero in (1, 2):
            # runtime/parallel/zero_optimizer.py: one flat fp32 buffer of the local parameters, padded
            # to a multiple of n, reduce-scattered ONCE per step (after the last micro-batch's backward,
            # whatever m) and all-gathered after the step; the rank keeps its 1/n range, its two
            # moments and one step counter. ZeRO-2 frees every p.grad and holds only that range.
            # Its owned range is an fp32 master copy beside the two moments (3 x 4 bytes per element).
            # Under bf16 (held_param_dtype) the parameters are bf16 (2 bytes) and the master range
            # is the only fp32 weight; the gradients are accumulated in the fp32 flat buffer (no
            # p.grad), which ZeRO-1 keeps whole (padded) and ZeRO-2 reduces to its range.
            flat = -(-local // n) * n * MASTER_BYTES
            msgs += [Message("reduce_scatter", dp_group, "fp32", flat), Message("all_gather", dp_group, "fp32", flat)]
            if replicas:  # zero_optimizer._reduce_owned: the owned range summed over the replicas
                msgs.append(Message("all_reduce", replicas, "fp32", flat // n))
            optimizer = 3 * flat // n + 4
            if low:
                params = local * LOW_BYTES
                grads = flat
            if layout.zero == 2:
                grads = flat // n
        else:
            msgs.append(Message("all_reduce", dp_group, "fp32", local * MASTER_BYTES))
        msgs.append(Message("all_reduce", group_along(layout, rank, "dp_cp"), "fp32", 4))  # the loss, over dp x cp (every stage)
    msgs.append(Message("all_reduce", group_along(layout, rank, "world"), "fp64", 8))  # the gradient norm
    if layout.pp > 1 and layout.schedule == "zero-bubble":
        acts = zero_bubble_activation_bytes(spec, layout, order) if order else None
    elif layout.pp > 1 and layout.virtual_stages > 1:
        acts = interleaved_activation_bytes(spec, layout, stage, order)
    else:
        acts = rank_activation_bytes(spec, layout, nl, first, last, in_flight=_in_flight(layout, stage))
    fused = activation_bytes(spec, layout, nl, first, last, in_flight=_in_flight(layout, stage))
    memory = dict(params=params, grads=grads, optimizer=optimizer, activations=acts, activations_fused=fused,
                  comm_buffers=max((mm.payload for mm in msgs if len(set(mm.group)) > 1), default=0))
    return RankPrediction(messages=[mm for mm in msgs if mm.calls and mm.payload], memory=memory)


def fsdp_units(spec: "ModelSpec", layout: "Layout", rank: int, nl: int) -> list[tuple[int, int, int, int, int]]:
    """Per FSDP2-wrapped model chunk of this rank: (root unit bytes — embedding / final norm / head
    the chunk holds —, its decoder layers, all-gathers per layer, all-gathers of the root unit,
    reduce-scatters of each unit) in one step.

    Without a pipeline the trainer runs each micro-batch's forward and backward in turn, FSDP2
    reshards every layer after its forward and its backward and reduce-scatters every backward:
    2m gathers per layer, m of the root (FSDP2 keeps the root unsharded from forward to backward),
    m reduce-scatters. Under torch.distributed.pipelining the stage asks FSDP2 to keep the
    parameters unsharded after every backward but the last and to reduce-scatter only after the
    last (spec/support.py ``fsdp_holds_gradients``); layers still reshard after each forward and the
    root stays unsharded from its first forward to the last backward. So a layer is gathered by each
    action of the chunk's order that finds it sharded, ``m + 1`` (spec/support.py
    ``fsdp_layer_gathers``), the root once, and every unit is reduce-scattered once per step. Under
    zero-bubble the runtime does not reshard the layers after forward (runtime/parallel/data_parallel.py:
    torch's input step I lists the stage's parameters before its backward unshards them, so a
    resharded layer's weights would miss the weight step W): every unit gathered once a step."""
    m = layout.num_microbatches
    gathers = fsdp_layer_gathers(layout.pp, layout.schedule, m)
    if not fsdp_holds_gradients(layout.pp):
        root = sum(root_tensors(spec, layout.tp, True, True)) * MASTER_BYTES
        return [(root, nl, gathers, m, m)]
    p, v = layout.pp, layout.virtual_stages
    last_stage = p * v - 1
    counts = stage_counts(spec.num_layers, p, v)
    return [(sum(root_tensors(spec, layout.tp, stage == 0, stage == last_stage)) * MASTER_BYTES, counts[stage],
             gathers, 1, 1) for stage in rank_stage_ids(p, v, coords(layout, rank)["pp"])]


def shard_groups(layout: "Layout", rank: int, dp_cp: tuple) -> tuple[int, tuple, tuple | None]:
    """(shard size, this rank's shard group, its replica group or None) of the ZeRO / FSDP state
    over the ``dp x cp`` group ``dp_cp``: the whole group, or with HSDP (``dp_shard < dp``) blocks of
    ``dp_shard x cp`` consecutive members, replicated across the blocks."""
    n = len(dp_cp)
    if not layout.dp_shard or layout.dp_shard >= layout.dp:
        return n, dp_cp, None
    size = layout.dp_shard * layout.cp
    i = dp_cp.index(rank)
    return size, dp_cp[(i // size) * size:(i // size + 1) * size], dp_cp[i % size::size]


def pipeline_sends(layout: "Layout", rank: int, payload: int) -> list[Message]:
    """The activations and input gradients this rank's chunks send per step (fp32 residual stream,
    ``payload`` bytes each): every one of its stages (spec/stages.py: ``pp_rank + i pp``) but the
    last sends each micro-batch's output to the next stage's rank, every one but stage 0 its input
    gradient back to the previous stage's rank, under every schedule (gpipe, 1f1b,
    interleaved-1f1b, zero-bubble: torch.distributed.pipelining posts one send per chunk, micro-
    batch and direction; its shape-metadata messages are not predicted)."""
    c, pp, m = coords(layout, rank), layout.pp, layout.num_microbatches
    last_stage = pp * layout.virtual_stages - 1
    calls: dict = {}
    for s in rank_stage_ids(pp, layout.virtual_stages, c["pp"]):
        for peer_stage in ([s + 1] if s < last_stage else []) + ([s - 1] if s > 0 else []):
            peer = rank_of(layout, **(c | {"pp": peer_stage % pp}))
            calls[peer] = calls.get(peer, 0) + m
    return [Message("send", (rank, peer), "fp32", payload, n) for peer, n in calls.items()]


def ring_sends(spec: "ModelSpec", layout: "Layout", rank: int, nl: int, m: int, tokens: int,
               redo: int | None = None) -> list[Message]:
    """Ring attention's point-to-point traffic of one step (runtime/parallel/ring_attention.py): per
    layer and micro-batch this rank sends ``cp - 1`` K/V blocks in forward, ``cp - 1`` again in
    backward and ``cp - 1`` fp32 dK/dV accumulators, every one to the next rank of its cp ring. A
    block is this rank's ``tokens`` keys and values with the kv heads of its TP rank only (not
    expanded to the query heads), in the residual stream's dtype (the rotary embedding's fp32
    tables make K fp32 under autocast; bf16 where the runtime holds bf16 parameters:
    ``residual_bytes``); the dK/dV accumulators in fp32 (the ring's tile arithmetic). ``redo``: the
    layers' recomputed forwards in the step, each sending the K/V blocks once more (default ``nl x m``
    under recomputation: a third pass; zero-bubble's W adds one per weight group under ``full``,
    ``layer_recomputations``: tiny-llama pp=2 x cp=2 last stage, 13 blocks a layer and micro-batch)."""
    c = coords(layout, rank)
    peer = rank_of(layout, **(c | {"cp": (c["cp"] + 1) % layout.cp}))
    kv_heads = max(spec.num_kv_heads // layout.tp, 1)
    block = 2 * tokens * kv_heads * spec.head_dim  # K and V elements
    if spec.attention_kind == "mla":  # every head's K (nope + rope) and V (v_head_dim) travel
        block = tokens * (spec.num_heads // layout.tp) * (spec.qk_head_dim + spec.attn_v_head_dim)
    hops = nl * m * (layout.cp - 1)
    kv = residual_bytes(layout)
    if redo is None:  # recomputation re-runs the ring's forward passes
        redo = nl * m if layout.recompute != "none" else 0
    return [Message("send", (rank, peer), "bf16" if kv == 2 else "fp32", block * kv, 2 * hops + redo * (layout.cp - 1)),
            Message("send", (rank, peer), "fp32", block * 4, hops)]


def layer_recomputations(layout: "Layout", stage: int, n_params: int) -> int:
    """How often one layer's checkpointed forward runs again in one micro-batch's backward on pipeline
    stage ``stage`` (``n_params``: the layer's weight groups that recompute, ``weight_groups``): none without
    ``recompute=full`` (``selective``'s core holds no collective), once in its backward, and under the
    zero-bubble schedule on every stage but the first (whose W is its full backward) once in the input
    step I and once more for each weight group of W (a weight, with its bias: torch's
    ``stage_backward_weight`` runs one ``autograd.grad`` per group, a new graph task, so the checkpoint
    recomputes the region anew for it; activations.py ``weight_step_walk``)."""
    if layout.recompute != "full":
        return 0
    if layout.pp > 1 and layout.schedule == "zero-bubble" and stage != 0:
        return 1 + n_params
    return 1


def rank_stage_layers(spec: "ModelSpec", layout: "Layout", pp_rank: int, nl: int) -> list[tuple[int, int]]:
    """``(stage, layers)`` of each pipeline stage pipeline rank ``pp_rank`` holds (``nl``: the runtime's
    count when it holds one stage)."""
    stages = rank_stage_ids(layout.pp, layout.virtual_stages, pp_rank)
    if len(stages) == 1:
        return [(stages[0], nl)]
    counts = stage_counts(spec.num_layers, layout.pp, layout.virtual_stages)
    return [(s, counts[s]) for s in stages]


def tp_messages(spec: "ModelSpec", layout: "Layout", group: tuple, nl: int, first: bool, last: bool, m: int,
                hidden: int, act: int, tokens: int | None = None, rank: int | None = None,
                mlp_layers: int | None = None, redo: int | None = None) -> list[Message]:
    """Tensor-parallel messages of one step on one rank (see the module doc); ``mlp_layers``: the
    layers whose MLP is split over tp (default all ``nl``; a folded expert mesh leaves its MoE
    blocks whole, moe_traffic.py); ``redo``: the layers' recomputed forwards in the step under
    ``recompute=full`` (default ``nl x m``; zero-bubble's W adds one per weight group,
    ``layer_recomputations``)."""
    dt, region = layout.param_dtype, hidden * act
    f32 = hidden * 4
    blocks = nl + (nl if mlp_layers is None else mlp_layers)  # tp-split attention and MLP blocks
    # per micro-batch: forward, each layer's row-parallel outputs (compute dtype) and the
    # embedding's output (fp32); under sp also the gathered norm outputs and the head's input
    # (fp32); backward, every gradient in the compute dtype (runtime/parallel/tensor.py carries them so)
    if layout.sp:
        out = [Message("all_gather", group, "fp32", f32, (blocks + int(last)) * m),
               Message("all_gather", group, dt, region, (blocks + int(first)) * m),
               Message("reduce_scatter", group, dt, region, (2 * blocks + int(last)) * m),
               Message("reduce_scatter", group, "fp32", f32, int(first) * m)]
    else:
        out = [Message("all_reduce", group, dt, region, (2 * blocks + int(last)) * m),
               Message("all_reduce", group, "fp32", f32, int(first) * m)]
    if layout.recompute == "full":
        # each block's forward runs again in the backward, up to the last tensor it saves (torch's
        # early stop: the MLP's down-projection input), so its forward collectives repeat but the
        # MLP's output one: the attention output's all-reduce (sp: reduce-scatter) and, under sp,
        # the two norm outputs' all-gathers
        redo = nl * m if redo is None else redo
        if layout.sp:  # per recomputed layer: each tp-split block's norm output gathered, the attention's reduce-scatter
            out += [Message("all_gather", group, "fp32", f32, redo * blocks // nl if nl else 0),
                    Message("reduce_scatter", group, dt, region, redo)]
        else:
            out.append(Message("all_reduce", group, dt, region, redo))
    if layout.sp:  # the replicated norm weights' (LayerNorm: and biases') gradients, once per step, one each
        norms = (nl * spec.layer_norms + int(last)) * norm_tensors(spec)
        # and the row-parallel biases (wo, w2): added to the sequence shard, so each rank's gradient is a partial sum
        biases = nl * int(spec.o_bias) + (nl if mlp_layers is None else mlp_layers) * int(spec.mlp_bias)
        out.append(Message("all_reduce", group, "fp32", spec.hidden_size * MASTER_BYTES, norms + biases))
    if spec.qk_norm:  # q_norm / k_norm are replicated over tp, sp or not: their gradients, once per step
        out.append(Message("all_reduce", group, "fp32", spec.head_dim * MASTER_BYTES, 2 * nl))
    kv, t = spec.num_kv_heads, len(group)
    if spec.attention_kind == "mla":  # the replicated down projections and norms: partial sums, once per step
        out += [Message("all_reduce", group, "fp32", n * MASTER_BYTES, nl) for n in mla_replicated(spec)]
    elif kv < t:
        # fewer kv heads than TP ranks: each kv head's wk / wv are replicated over the t / kv ranks
        # that use it (runtime/parallel/tensor.py kv_replica_groups), their gradients summed there
        r = t // kv
        me = group.index(rank) if rank is not None else 0
        replicas = tuple(group[(me // r) * r:(me // r + 1) * r])
        out.append(Message("all_reduce", replicas, "fp32", spec.hidden_size * spec.head_dim * MASTER_BYTES, 2 * nl))
        if spec.qkv_bias:  # and Qwen2's k / v biases with them
            out.append(Message("all_reduce", replicas, "fp32", spec.head_dim * MASTER_BYTES, 2 * nl))
    if last:  # vocab-parallel cross entropy: max, sum of exponentials, target logit
        rows = tokens if tokens is not None else layout.mbs * layout.seq
        out.append(Message("all_reduce", group, "fp32", rows * 4, 3 * m))
    return out


def _in_flight(layout: "Layout", stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak (plan/cost/schedule.py's rule: all
    of them under GPipe, ``min(m, pp - stage)`` under 1F1B, one without a pipeline)."""
    return int(in_flight_microbatches(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages, stage))


def activation_bytes(spec: "ModelSpec", layout: "Layout", nl: int, first: bool, last: bool, in_flight: int = 1) -> float:
    """The training planner's own estimate (a fused production stack, not our eager runtime;
    reported beside the measured peak, not judged): plan/cost/activations.py's per-layer terms at the
    layout's compute dtype (``bytes_per_value``), times the layers and micro-batches in flight."""
    tokens = layout.mbs * layout.seq
    one = layer_activation_bytes(spec, tokens=tokens, seq_ctx=layout.seq, tp=layout.tp, sp=layout.sp,
                                 recompute=layout.recompute, attention="materialized", dropout=False,
                                 bytes_per_value=DTYPE_SIZE[layout.param_dtype])
    return float(one * nl * in_flight)
