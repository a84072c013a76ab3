"""Element-wise work Megatron-Core runs outside its fused kernels for three model features, in HBM bytes.

Usage (plan/train/layer.py adds them to one layer's forward, backward and recomputation)::

    x = unfused_bytes(model, q_kv_elems=T * (heads + kv_heads) * head_dim, fc1_elems=T * top_k * 2 * ffn,
                      fc2_elems=T * top_k * hidden, fused_mlp=False, fp32_probs=False)
    x.fwd, x.bwd, x.moe_fwd   # bytes; moe_fwd: the part a recomputed MoE activation runs again

The planner prices a layer's element-wise work as fused kernels that read and write each tensor once
(``layer.py``: norms, residuals, rotary, the GLU activation). Megatron-Core's own code takes slower paths
for three features gpt-oss has (Megatron-LM at d98e8a6, the code the 2025-2026 Megatron-Bridge releases
run; counted per element from the code, 2-byte bf16 and 4-byte fp32 accesses):

* **YaRN rotary with an attention scale** (``rope_type`` yarn whose concentration factor is not 1,
  ``yarn_mscale``: 1.35 for gpt-oss; MLA's rotary is its own path): ``rope_utils.apply_rotary_pos_emb`` falls back to ``_apply_rotary_pos_emb_bshd``
  ("mscale=... is not supported by TE's fused RoPE. Using unfused implementation", PR #2038, 2025-11-22).
  Per element of q and k: ``t * cos``, the rotate-half's negation and concatenation, ``* sin``, the add and
  the final concatenation read and write 12 times forward and 9 backward (autograd of the same ops),
  against the fused kernel's 2 and 2: ``ROPE_EXTRA`` bytes more.
* **A clamped GLU** (gpt-oss's SwiGLU with ``activation_func_clamp_value`` 7): ``fused_bias_geglu.
  weighted_bias_quick_geglu_impl`` clamps both halves of the expert fc1 output and concatenates them before
  the fused kernel: two clamps and a ``torch.cat`` over the whole fc1 output forward (4 accesses per
  element), their backward (a masked copy of each half's gradient, reading the input too, and the
  concatenation of the two: 5): ``CLAMP_EXTRA``. A recomputed MoE activation (``mlp_act``) clamps again.
* **An expert output bias** (``mlp_bias`` on an MoE model): ``TEGroupedMLP._apply_bias`` adds each expert's
  fc2 bias, scaled by the token's routing probability, outside the GEMM, per expert, in the probabilities'
  dtype (core_v0.15.0 to d98e8a6; its packed successor casts to fp32 outright, "TODO: get rid of the
  .float()"). The probabilities are bf16 under the all-to-all dispatcher (the router runs in the input's
  dtype unless ``moe_router_dtype`` says fp32, which no gpt-oss recipe does): the bias times them (write 2),
  the output plus it (read 2 + 2, write 2), the concatenation of the experts (2 + 2): 12 bytes forward;
  backward the bias's and the probabilities' products and sums (2 x (2 + 2 + 2)): 12. DeepEP and HybridEP
  take fp32 probabilities ("only supports float32 probs", token_dispatcher.py): the product, the sum, the
  concatenation and the cast back are fp32, 28 bytes forward (4; 2 + 4 + 4; 4 + 4; 4 + 2) and 36 backward
  (the cast 2 + 4, the output gradient's cast 4 + 2, the two products and sums 2 x 12): ``BIAS_EXTRA``
  per element of the fc2 output.

The device-initiated fused grouped MLP (``TrainOptions.moe_fused_mlp``: Transformer Engine's op fuser /
CuTeDSL kernel, which runs the GLU and its bias gradient in its epilogues) takes none of the two MoE paths.
They are Megatron-Core's: layer.py charges them to runs held the Megatron way (``TrainOptions.param_policy``
'megatron', the default); torchtitan and this project's runtime run their own ops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcarve.spec.model import ModelSpec

ROPE_EXTRA = (2.0 * (12 - 2), 2.0 * (9 - 2))
"""(forward, backward) bytes per q / k element the unfused rotary adds over the fused kernel."""
CLAMP_EXTRA = (2.0 * 4, 2.0 * 5)
"""(forward, backward) bytes per element of the expert fc1 output the clamp-and-concatenate adds."""
BIAS_EXTRA = {"bf16": (12.0, 12.0), "fp32": (28.0, 36.0)}
"""(forward, backward) bytes per element of the expert fc2 output the bias path adds, by the routing
probabilities' dtype."""


@dataclass(frozen=True)
class Unfused:
    fwd: float = 0.0
    """Bytes a layer's forward adds."""
    bwd: float = 0.0
    """Bytes its backward adds."""
    moe_fwd: float = 0.0
    """Of ``fwd``, the MoE block's (clamp and bias): run again when the MoE block is recomputed."""
    act_fwd: float = 0.0
    """Of ``moe_fwd``, the activation's (the clamp): run again when the MoE activation is recomputed."""


NONE = Unfused()


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_mscale(model: "ModelSpec") -> float:
    """The factor Megatron-Core's YaRN rotary multiplies cos and sin by (yarn_rotary_pos_embedding.py
    ``_yarn_get_concentration_factor``): m(factor, mscale) / m(factor, mscale_all_dim) with m(s, k) =
    0.1 k ln(s) + 1, or m(factor, 1) when the config names neither (gpt-oss: 1.35 at factor 32;
    DeepSeek-V3's mscale = mscale_all_dim = 1: 1). 1 for any other rotary."""
    scaling = model.rope_parameters
    factor = float(scaling.get("factor", 1.0) or 1.0)
    if scaling.get("rope_type") != "yarn":
        return 1.0
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale is None or all_dim is None:
        return _yarn_mscale(factor)
    return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))


@functools.lru_cache(maxsize=64)
def features(model: "ModelSpec") -> tuple[bool, bool, bool]:
    """(unfused rotary, clamped GLU, expert bias): which of the module doc's paths ``model`` takes."""
    rope = model.position_kind == "rope" and model.attention_kind != "mla" and yarn_mscale(model) != 1.0
    return (rope, model.activation == "swiglu_clamped",
            bool(model.mlp_bias and model.num_experts))


def unfused_bytes(model: "ModelSpec", *, q_kv_elems: float, fc1_elems: float, fc2_elems: float,
                  fused_mlp: bool, fp32_probs: bool) -> Unfused:
    """Extra HBM bytes of one layer for one micro-batch on one device (module doc): ``q_kv_elems`` the q
    and k elements the rotary touches, ``fc1_elems`` / ``fc2_elems`` the routed experts' fc1 output (gate
    and up) and fc2 output elements (0 on a dense layer); ``fused_mlp``: the fused grouped MLP runs them;
    ``fp32_probs``: the dispatcher hands the experts fp32 routing probabilities (DeepEP / HybridEP)."""
    rope, clamp, bias = features(model)
    if not (rope or clamp or bias):
        return NONE
    fwd = bwd = moe = act = 0.0
    if rope:
        fwd += ROPE_EXTRA[0] * q_kv_elems
        bwd += ROPE_EXTRA[1] * q_kv_elems
    if fc1_elems and not fused_mlp:
        if clamp:
            act = CLAMP_EXTRA[0] * fc1_elems
            moe += act
            bwd += CLAMP_EXTRA[1] * fc1_elems
        if bias:
            f, b = BIAS_EXTRA["fp32" if fp32_probs else "bf16"]
            moe += f * fc2_elems
            bwd += b * fc2_elems
    if not (fwd or bwd or moe):
        return NONE
    return Unfused(fwd=fwd + moe, bwd=bwd, moe_fwd=moe, act_fwd=act)
