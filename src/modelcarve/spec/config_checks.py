"""Types and accepted ranges of the ``config.json`` keys modelcarve reads, checked before any is used.

``spec_from_hf_config`` calls ``check_config(raw, name)`` first, so a wrong-typed or out-of-range
value is refused as one SpecError naming the key and the accepted range, instead of surfacing as
a TypeError in the reader, a model silently changed (``decoder_sparse_step: NaN`` made an MoE
model dense) or a failure inside the ranks (an odd ``head_dim`` cannot be rotated). Keys not
listed here are not read by modelcarve and are left alone. ``null`` means "use the default", as
transformers reads it.
"""

from __future__ import annotations

import math
import reprlib

from modelcarve.spec.errors import SpecError

_DIM = 2**24
"""Largest width accepted (hidden, ffn, vocab, head dims): 16M, far above any published model."""

# key -> (kind, low, high): kind int / float (int or float accepted) / bool / str / posfloat.
# Ranges are inclusive; for floats "low" is exclusive when the kind is "open" (strictly above).
_INT = {
    "vocab_size": (1, 2**27), "hidden_size": (1, _DIM), "intermediate_size": (1, _DIM),
    "num_hidden_layers": (1, 2**16), "num_attention_heads": (1, 2**16), "num_key_value_heads": (1, 2**16),
    "head_dim": (2, 2**16), "max_position_embeddings": (1, 2**31),
    "original_max_position_embeddings": (1, 2**31),
    "n_embd": (1, _DIM), "n_head": (1, 2**16), "n_layer": (1, 2**16), "n_positions": (1, 2**31), "n_inner": (1, _DIM),
    "num_local_experts": (0, 2**20), "num_experts": (0, 2**20), "n_routed_experts": (0, 2**20),
    "num_experts_per_tok": (0, 2**20), "moe_intermediate_size": (1, _DIM), "decoder_sparse_step": (1, 2**16),
    "first_k_dense_replace": (0, 2**16), "moe_layer_freq": (1, 2**16), "n_shared_experts": (0, 2**16),
    "n_group": (1, 2**20), "topk_group": (1, 2**20),
    "q_lora_rank": (0, _DIM), "kv_lora_rank": (1, _DIM), "qk_nope_head_dim": (0, 2**16),
    "qk_rope_head_dim": (2, 2**16), "v_head_dim": (1, 2**16),
    "sliding_window": (1, 2**31), "max_window_layers": (0, 2**16),
}
_FLOAT = {  # key -> (low exclusive, high inclusive)
    "rms_norm_eps": (0.0, 0.1), "layer_norm_epsilon": (0.0, 0.1), "rope_theta": (0.0, 1e12),
    "routed_scaling_factor": (0.0, 1e6), "partial_rotary_factor": (0.0, 1.0),
}
_BOOL = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window",
         "rope_interleave", "scale_attn_weights", "scale_attn_by_inverse_layer_idx")
_STR = ("model_type", "hidden_act", "activation_function")
_ROPE_FLOAT = {  # rope_scaling / rope_parameters keys -> (low exclusive, high inclusive)
    "factor": (0.0, 1e6), "low_freq_factor": (0.0, 1e6), "high_freq_factor": (0.0, 1e6),
    "attention_factor": (0.0, 1e6), "beta_fast": (0.0, 1e6), "beta_slow": (0.0, 1e6), "mscale": (-1e6, 1e6),
    "mscale_all_dim": (-1e6, 1e6), "rope_theta": (0.0, 1e12), "partial_rotary_factor": (0.0, 1.0),
}


def _kind(value, list_word: str = "array", dict_word: str = "object") -> str:
    """The value's type as the file's own language says it (JSON by default; cluster_file says YAML's)."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: list_word, dict: dict_word}.get(
        type(value), type(value).__name__)


def _show(value) -> str:
    if value is None:
        return ""
    text = reprlib.repr(value)  # bounded: a YAML alias bomb must not expand here
    return text if len(text) <= 40 else text[:37] + "..."


def check_int(name: str, where: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: {name} must be an integer in {low}..{high:,}, got {_kind(value)} {_show(value)}")
    if not low <= value <= high:
        raise SpecError(f"{where}: {name}={_show(value)} is outside the accepted range {low}..{high:,}")
    return value


def check_float(name: str, where: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: {name} must be a number in ({low:g}, {high:g}], got {_kind(value)} {_show(value)}")
    if not math.isfinite(value) or not low < value <= high:
        raise SpecError(f"{where}: {name}={_show(value)} is outside the accepted range ({low:g}, {high:g}]")
    return float(value)


def _check_rope(key: str, rope, where: str) -> None:
    if not isinstance(rope, dict):
        raise SpecError(f"{where}: {key} must be an object (e.g. {{\"rope_type\": \"linear\", \"factor\": 2.0}}) "
                        f"or null, got {_kind(rope)} {_show(rope)}")
    for name, value in rope.items():
        if value is None:
            continue
        if name in ("rope_type", "type") and not isinstance(value, str):
            raise SpecError(f"{where}: {key}.{name} must be a string (default, linear, dynamic, yarn, llama3), "
                            f"got {_kind(value)} {_show(value)}")
        if name in _ROPE_FLOAT:
            check_float(f"{key}.{name}", where, value, *_ROPE_FLOAT[name])
        if name == "original_max_position_embeddings":
            check_int(f"{key}.{name}", where, value, 1, 2**31)
        if name == "truncate" and not isinstance(value, bool):
            raise SpecError(f"{where}: {key}.truncate must be true or false, got {_kind(value)} {_show(value)}")


def check_config(raw: dict, where: str) -> None:
    """Refuse, naming the key and its accepted range, any value modelcarve reads that is malformed."""
    for key in _STR:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise SpecError(f"{where}: {key} must be a string, got {_kind(raw[key])} {_show(raw[key])}")
    for key, (low, high) in _INT.items():
        if raw.get(key) is not None:
            check_int(key, where, raw[key], low, high)
    for key, (low, high) in _FLOAT.items():
        if raw.get(key) is not None:
            check_float(key, where, raw[key], low, high)
    for key in _BOOL:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise SpecError(f"{where}: {key} must be true or false, got {_kind(raw[key])} {_show(raw[key])}")
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None:
            _check_rope(key, raw[key], where)
    layers = raw.get("num_hidden_layers") or raw.get("n_layer") or 2**16
    if raw.get("mlp_only_layers") is not None:
        value = raw["mlp_only_layers"]
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise SpecError(f"{where}: mlp_only_layers must be an array of layer indices, got {_show(value)}")
        bad = [i for i in value if not 0 <= i < layers]
        if bad:
            raise SpecError(f"{where}: mlp_only_layers {bad[:5]} outside the layers 0..{layers - 1}")
    if raw.get("layer_types") is not None:
        value = raw["layer_types"]
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise SpecError(f"{where}: layer_types must be an array of strings (full_attention, "
                            f"sliding_attention), got {_show(value)}")
        if len(value) != layers:
            raise SpecError(f"{where}: layer_types has {len(value)} entries for {layers} layers; give one per layer")
    _check_shapes(raw, where)


def _check_shapes(raw: dict, where: str) -> None:
    """Relations between keys that the runtime would otherwise find inside the ranks."""
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if raw.get("model_type") == "gpt2":
        hidden, heads = raw.get("n_embd"), raw.get("n_head")
        if hidden and heads and hidden % heads:
            raise SpecError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
        return
    head_dim = raw.get("head_dim")
    if head_dim is None and hidden and heads:
        if hidden % heads:
            raise SpecError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                            f"give head_dim explicitly or a divisible head count")
        head_dim = hidden // heads
    rotary = raw.get("qk_rope_head_dim") if raw.get("model_type") in ("deepseek_v3", "kimi_k2") else head_dim
    if rotary and rotary % 2:
        key = "qk_rope_head_dim" if rotary is raw.get("qk_rope_head_dim") else "head_dim"
        raise SpecError(f"{where}: {key}={rotary} is odd; rotary embeddings rotate pairs of dimensions, so it "
                        f"must be even")
    experts = raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts") or 0
    if experts and raw.get("num_experts_per_tok") == 0:  # 0 is how a dense config of an MoE family says it
        raise SpecError(f"{where}: num_experts_per_tok=0 with {experts} routed experts; an MoE layer sends each "
                        f"token to at least 1 expert (or set the expert count to 0 for a dense model)")
    kv = raw.get("num_key_value_heads")
    if kv and heads and heads % kv:
        raise SpecError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
