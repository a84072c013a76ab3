"""Which models the runtime's reference model can build: a model whose layers it lacks is refused
before any process starts, in one line naming each missing layer.

The planner reads more model families than the runtime runs (spec/hf_models.py: gpt_oss, llama4,
gemma3, phi3, nemotron, bloom, opt are refused; deepseek_v2 runs, its layers being deepseek_v3's, unless
it routes group-limited greedy). ``check_model_coverage(spec)`` is called by
``parallelize.check_runtime``, which ``modelcarve run`` and ``verify`` call before launching
torchrun; it looks at the layers a ModelSpec asks for, not only its family name, so a config of a
supported family that asks for an unsupported layer (partial rotary, a fifth norm) is refused too.
"""

from __future__ import annotations

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.hf_config import SUPPORTED_MODEL_TYPES
from modelcarve.spec.model import ModelSpec

RUNTIME_FAMILIES = SUPPORTED_MODEL_TYPES + ("kimi_k2", "deepseek_v2")
"""Families whose layers and checkpoint names the reference model has (runtime/model/transformer.py, checkpoint.py)."""

_FAMILY_LAYERS = {
    "gpt_oss": "attention sinks, biased experts with a clamped SwiGLU, MXFP4 expert checkpoints",
    "llama4": "chunked attention with NoPE layers, weightless L2 q/k norm, fused expert tensors",
    "gemma3": "four norms per layer, (1 + w) RMSNorm, gated GELU-tanh MLP, per-layer-type rope",
    "phi3": "fused qkv_proj / gate_up_proj checkpoint tensors",
    "nemotron": "squared-ReLU MLP, LayerNorm1P, partial rotary",
    "bloom": "ALiBi attention and fused query_key_value tensors",
    "opt": "learned positions with an offset, fc1/fc2 ReLU MLP naming",
}


def missing_layers(spec: ModelSpec) -> list[str]:
    """The layers ``spec`` needs that the reference model does not have (empty: it can run)."""
    missing = []
    if spec.family not in RUNTIME_FAMILIES:
        missing.append(f"the {spec.family} family ({_FAMILY_LAYERS.get(spec.family, 'its layers')})")
    checks = [
        (spec.attention_sinks, "attention sinks"),
        (spec.router_bias, "a router bias"),
        (spec.layer_norms != 2, f"{spec.layer_norms} norms per layer"),
        (spec.embedding_norm, "a norm after the embedding"),
        (spec.position_offset != 0, "an offset learned-position table"),
        (spec.position_kind == "alibi", "ALiBi positions"),
        (spec.partial_rotary_factor != 1.0, f"partial rotary ({spec.partial_rotary_factor:g} of each head)"),
        (bool(spec.chunked_layers), "chunked attention"),
        (spec.activation == "relu2", "a squared-ReLU MLP"),
        (spec.family == "deepseek_v2" and spec.num_expert_groups > 1,
         "DeepSeek-V2's group-limited greedy routing (groups scored by their best expert)"),
    ]
    return missing + [what for present, what in checks if present]


def check_model_coverage(spec: ModelSpec) -> None:
    """Raise LayoutError, one line, when the reference model cannot build ``spec``."""
    missing = missing_layers(spec)
    if missing:
        raise LayoutError(
            f"model {spec.name!r} ({spec.family}) can be planned but not run: the runtime's reference model lacks "
            + "; ".join(missing)
            + f". Use `modelcarve plan`/`estimate` for it, or run a model of: {', '.join(RUNTIME_FAMILIES)}"
        )
