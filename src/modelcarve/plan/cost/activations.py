"""Activation bytes one transformer layer keeps for its backward pass, per micro-batch, per device.

Usage::

    from modelcarve.plan.cost.activations import layer_activation_terms
    terms = layer_activation_terms(model, tokens=2048, seq_ctx=2048, tp=8, sp=True, recompute="selective")
    sum(terms.values())         # bytes

Starting point: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4: a GPT layer with 16-bit activations and dropout stores
``s b h (34 + 5 a s / h)`` bytes: attention ``11 sbh + 5 a s^2 b`` (QKV input 2, Q and K 4, V 2,
softmax output 2as^2b, dropout mask as^2b, dropout output 2as^2b, projection input 2, dropout
mask 1), MLP ``19 sbh`` (input 2, GeLU input 8, GeLU output 8, dropout mask 1), two layer-norm
inputs ``4 sbh``. Tensor parallelism divides everything but the ``10 sbh`` of the norm/dropout
regions by ``t``; sequence parallelism divides those too; selective recomputation drops the
``5 a s^2 b`` attention core; full recomputation keeps only the layer input ``2 sbh``.

Extensions, term by term (same bookkeeping: every tensor a backward reads is counted once):

* GQA: K and V have ``num_kv_heads`` heads, replicated when ``tp > num_kv_heads``.
* SwiGLU: the gate and up projections' outputs (``2 x 2 sbf``) and the product fed to the down
  projection (``2 sbf``): ``6 sbf / t`` in place of GeLU's ``4 sbf / t``.
* MoE: router logits in fp32 (``4 sbE``), the token copies sent to the experts (``2 sbkh``,
  times the load-imbalance factor on the busiest device), each expert's SwiGLU intermediates over
  its tokens (``6 sbk f_e / t``), and the shared experts as a dense MLP. Where the router's
  weights multiply the experts' outputs at the combine (``probs_on_combine``: Megatron-Core
  before 0.13, whose unpermute took the probabilities; torchtitan's ``score_before_experts``
  keeps the same extra copy, the unscaled routed tokens its score gradient reads), the combine
  also keeps the routed tokens it weighs: ``2 sbkh`` more. Megatron-Core 0.13 and later
  (MR !2668 "Memory efficient token permutation", 2025-04) multiply them into the expert
  activation instead (``weighted_bias_swiglu_impl``: the activation's backward reads the fc1
  output it keeps anyway), so the combine keeps nothing: the default.
* MLA: the compressed q and kv latents and their norm outputs (``4 sb (r_q + r_kv) + 2 sb d_rope``,
  replicated over TP as the down projections are), then per-head Q, K, V as in MHA.
* Flash attention stores no ``s^2`` term, only the output (the projection input) and the fp32
  log-sum-exp per row; without dropout (modern recipes) the dropout masks vanish.
* Context parallelism: the caller passes ``tokens = b s / cp`` and ``seq_ctx = s``.
* MoE parallel folding: with expert TP ``etp`` (not ``tp``) a device holds ``1/etp`` of each
  local expert and the tokens of its ``etp`` group: ``T k etp / t`` routed tokens per device.
* FP8 (``gemm_input_bytes`` 1, MXFP8 1 + 1/32): Transformer Engine saves the quantised copy of
  a linear layer's input that the weight-gradient GEMM reads, not the bf16 one: the norm
  outputs feeding QKV and the MLP, the attention output feeding the projection, and the
  activation output feeding the down projection (and the experts' dispatched tokens) shrink to
  1 byte per element; everything else stays bf16/fp32.

Recomputation by op (torchtitan's op-level selective AC, Megatron's ``--recompute-modules``),
``recompute`` naming the modules whose saved tensors are dropped and recomputed in backward:

* ``core_attn`` (= ``selective``): the attention core (softmax / flash statistics).
* ``layernorm``: the two norm outputs (``attn_input``, ``mlp_input``): kept are their inputs.
* ``mlp_act``: the activation function's output: SwiGLU keeps the gate and up projections
  (``4 sbf / t``), GeLU its input (``2 sbf / t``); the down projection's input is recomputed.
* ``mla_up_proj`` (MLA only, Megatron-Core's ``--recompute-modules mla_up_proj``): the per-head
  Q, K and V the up projections make from the latents are not kept for the attention core's
  backward but recomputed from the (kept) latents: the ``qkv`` term goes.
* ``mlp``: the whole MLP / MoE block (router, dispatched tokens, expert intermediates; its
  input is kept).
* ``ops`` (torchtitan ``activation_checkpoint.mode = "selective"``, ``selective_ac_option =
  "op"``): per block, the outputs of matmuls are saved except every second one (q, v, the
  up/gate-first and the down projection saved; k, o and the second MLP input projection
  recomputed), the attention kernel's output and statistics are saved, every element-wise op
  (norms, rotary, activation) is recomputed; the block input is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import recompute_modules

if TYPE_CHECKING:
    from modelcarve.spec.model import ModelSpec

ACT_BYTES = 2.0
"""Bytes per stored activation element under bf16/fp16 compute (the default of every function
here; ``bytes_per_value`` sets the compute dtype's size: 4 for an fp32 layout)."""


def kv_heads_per_rank(model: "ModelSpec", tp: int) -> float:
    """KV heads a TP rank holds (GQA heads are replicated when tp exceeds them; MLA has nh)."""
    if model.attention_kind == "mla":
        return model.num_heads / tp
    return max(model.num_kv_heads / tp, 1.0)


def layer_activation_terms(
    model: "ModelSpec",
    *,
    tokens: float,
    seq_ctx: float,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    moe: bool = False,
    attention: str = "materialized",
    dropout: bool = True,
    expert_tokens_factor: float = 1.0,
    expert_tp: int = 0,
    gemm_input_bytes: float | None = None,
    bytes_per_value: float = ACT_BYTES,
    probs_on_combine: bool = False,
) -> dict[str, float]:
    """Bytes per component for one layer and one micro-batch of ``tokens`` tokens on one device.

    ``tokens`` = micro-batch size x local sequence (seq / cp); ``seq_ctx`` = keys each query sees;
    ``expert_tokens_factor`` scales the routed-expert terms (load imbalance on the busiest rank);
    ``expert_tp`` the expert tensor-parallel degree (0: ``tp``); ``gemm_input_bytes`` the bytes
    per saved linear-layer input (1 under FP8, see the module doc; default ``bytes_per_value``);
    ``bytes_per_value`` the bytes of one stored activation in the compute dtype (2 for bf16,
    4 for fp32; the fp32 router logits and flash statistics stay 4); ``probs_on_combine`` the
    combine weighs the experts' outputs and keeps them (module doc: older Megatron-Core)."""
    h = model.hidden_size
    T = float(tokens)
    rep = tp if sp else 1  # divisor of the norm/dropout regions
    a = float(bytes_per_value)
    if gemm_input_bytes is None:
        gemm_input_bytes = a
    if recompute == "full":
        return {"layer_input": a * T * h / rep}
    if recompute == "ops":
        return _op_level_terms(model, T, tp, rep, moe, expert_tokens_factor, expert_tp or tp, a)
    mods = frozenset() if recompute == "none" else recompute_modules(recompute)
    q = gemm_input_bytes
    heads = model.num_heads / tp
    dqk, dv = model.qk_head_dim, model.attn_v_head_dim
    kvl = kv_heads_per_rank(model, tp)
    mask = 1.0 if dropout else 0.0
    terms: dict[str, float] = {}
    terms["norm_inputs"] = 2 * a * T * h / rep
    if "layernorm" not in mods:
        terms["attn_input"] = q * T * h / rep
    if model.attention_kind == "mla":
        rq = model.q_lora_rank or 0
        terms["mla_latents"] = 2 * a * T * (rq + model.kv_lora_rank) + a * T * model.qk_rope_head_dim
    if "mla_up_proj" in mods:
        if model.attention_kind != "mla":
            raise LayoutError(f"recompute module mla_up_proj needs MLA attention (DeepSeek-V2/V3, Kimi K2); "
                              f"{model.name} has {model.attention_kind} attention: drop mla_up_proj from recompute")
    else:
        terms["qkv"] = a * T * (heads * dqk + kvl * dqk + kvl * dv)
    if "core_attn" not in mods:
        if attention == "flash":
            terms["attn_core"] = 4.0 * T * heads  # fp32 log-sum-exp per query row and head
        else:
            # softmax output (a bytes) + dropout mask (1) + dropout output (a) per score
            terms["attn_core"] = (a + (1.0 + a) * mask) * T * heads * seq_ctx
    terms["proj_input"] = q * T * heads * dv
    terms["dropout_masks"] = 2 * mask * T * h / rep
    if "layernorm" not in mods:
        terms["mlp_input"] = q * T * h / rep
    elif "mlp" in mods:
        terms["mlp_input"] = a * T * h / rep  # the checkpointed block's input is kept
    if "mlp" in mods:
        return terms
    act = "mlp_act" in mods
    if moe:
        k, fe, E = model.top_k, model.expert_ffn_size, model.num_experts
        etp = expert_tp or tp
        routed = T * k * expert_tokens_factor * etp / tp  # tokens this device's expert shards see
        terms["router"] = 4.0 * T * E / rep
        terms["expert_tokens"] = q * routed * h  # the fc1 input (quantised under FP8)
        if probs_on_combine:
            terms["combine_input"] = a * routed * h  # the experts' outputs the weighted combine reads
        terms["expert_ffn"] = _ffn_terms(model, routed, fe, etp, act, q, a)
        if model.num_shared_experts:
            terms["shared_ffn"] = _ffn_terms(model, T, model.num_shared_experts * fe, tp, act, q, a)
    else:
        terms["ffn"] = _ffn_terms(model, T, model.ffn_size, tp, act, q, a)
    return terms


def _ffn_terms(model: "ModelSpec", tokens: float, ffn: int, tp: int, act_recomputed: bool = False,
               down_input_bytes: float = ACT_BYTES, a: float = ACT_BYTES) -> float:
    """MLP intermediates: SwiGLU gate + up outputs (2 + 2) and the product fed to the down
    projection; GeLU its input (2) and output; the down projection's input at
    ``down_input_bytes`` and dropped when the activation is recomputed; ``a`` bytes per value."""
    kept = (2.0 if model.ffn_kind == "swiglu" else 1.0) * a
    down = 0.0 if act_recomputed else down_input_bytes
    return (kept + down) * tokens * ffn / tp


def _op_level_terms(model: "ModelSpec", T: float, tp: int, rep: int, moe: bool, factor: float, etp: int,
                    a: float = ACT_BYTES) -> dict[str, float]:
    """Saved tensors under torchtitan's op-level SAC (module doc): the block input, q and v,
    the attention output and its fp32 statistics, the first MLP projection and the down
    projection's output (each MLP / expert over its tokens)."""
    h = model.hidden_size
    heads = model.num_heads / tp
    kvl = kv_heads_per_rank(model, tp)
    terms = {
        "layer_input": a * T * h / rep,
        "q_v": a * T * (heads * model.qk_head_dim + kvl * model.attn_v_head_dim),
        "attn_out": a * T * heads * model.attn_v_head_dim + 4.0 * T * heads,
    }
    if moe:
        k, fe = model.top_k, model.expert_ffn_size
        routed = T * k * factor * etp / tp
        terms["router"] = 4.0 * T * model.num_experts / rep
        terms["expert_ffn"] = a * routed * (fe / etp) + a * routed * h
        if model.num_shared_experts:
            terms["shared_ffn"] = a * T * model.num_shared_experts * fe / tp + a * T * h / rep
    else:
        terms["ffn"] = a * T * model.ffn_size / tp + a * T * h / rep
    return terms


def layer_activation_bytes(model: "ModelSpec", **kwargs) -> float:
    """Total of :func:`layer_activation_terms`."""
    return float(sum(layer_activation_terms(model, **kwargs).values()))
