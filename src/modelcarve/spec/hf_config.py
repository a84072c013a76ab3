"""Read a Hugging Face ``config.json`` (a dict, a file, or a checkpoint directory) into a ModelSpec.

Supported ``model_type``: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3 (and
kimi_k2, which is DeepSeek-V3's architecture under another name) and gpt2; spec/hf_models.py adds
gpt_oss, llama4, gemma3, deepseek_v2, phi3, nemotron, bloom and opt (``MODEL_TYPES``: all of them). Keys that
transformers' own config classes give a default for are defaulted the same way here; keys
without a default are required and their absence is a one-line SpecError naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import modelcarve.spec.hf_models as hf_models
from modelcarve.spec.errors import SpecError
from modelcarve.spec.model import ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "gpt2")
_ALIASES = {"kimi_k2": "deepseek_v3"} | hf_models.ALIASES
MODEL_TYPES = SUPPORTED_MODEL_TYPES + hf_models.MODEL_TYPES
"""Every model_type read (SUPPORTED_MODEL_TYPES: those the runtime's reference model also runs)."""


class _Config:
    """Looks keys up in a config dict, naming the model and key when one is missing."""

    def __init__(self, raw: dict, name: str):
        self.raw, self.name = raw, name

    def req(self, key: str) -> Any:
        if self.raw.get(key) is None:
            raise SpecError(
                f"{self.name}: config.json of model_type {self.raw.get('model_type')!r} lacks required key {key!r}"
            )
        return self.raw[key]

    def req_any(self, *keys: str) -> Any:
        """The first of ``keys`` present (transformers renamed some keys between versions)."""
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        raise SpecError(
            f"{self.name}: config.json of model_type {self.raw.get('model_type')!r} lacks required key "
            + " (or ".join(repr(k) for k in keys) + ")" * (len(keys) - 1)
        )

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value


def _ffn_kind(cfg: _Config, key: str = "hidden_act") -> str:
    act = cfg.get(key, "silu")
    if act in ("silu", "swish"):
        return "swiglu"
    if str(act).startswith("gelu"):
        return "gelu"
    raise SpecError(f"{cfg.name}: activation {act!r} is not supported; modelcarve models SwiGLU (silu) and GELU MLPs")


# rope types the runtime computes (runtime/model/rope.py) and the keys each reads, as transformers does
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
}


def _rope_scaling(cfg: _Config) -> tuple:
    """config.json's ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5), resolved to the
    sorted (key, value) pairs of ModelSpec.rope_scaling; () for plain rope."""
    rope = cfg.raw.get("rope_scaling") or cfg.raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise SpecError(f"{cfg.name}: rope_scaling must be a JSON object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise SpecError(f"{cfg.name}: partial_rotary_factor != 1 is not supported (rope on the whole head only)")
    if kind == "default":
        return ()
    if kind not in _ROPE_KEYS:
        raise SpecError(f"{cfg.name}: rope type {kind!r} is not supported; supported: default, {', '.join(_ROPE_KEYS)}")
    out = {key: rope[key] for key in _ROPE_KEYS[kind] if rope.get(key) is not None}
    if "original_max_position_embeddings" in _ROPE_KEYS[kind]:
        # transformers: a top-level original_max_position_embeddings wins, then the dict's, then max_position
        out["original_max_position_embeddings"] = int(cfg.raw.get("original_max_position_embeddings")
                                                      or rope.get("original_max_position_embeddings")
                                                      or cfg.get("max_position_embeddings", 4096))
    if kind != "yarn" and "factor" not in out:
        raise SpecError(f"{cfg.name}: rope type {kind!r} needs a 'factor' in rope_scaling")
    if kind == "llama3" and not {"low_freq_factor", "high_freq_factor"} <= set(out):
        raise SpecError(f"{cfg.name}: rope type 'llama3' needs low_freq_factor and high_freq_factor in rope_scaling")
    return tuple(sorted((out | {"rope_type": kind}).items()))


def _sliding(cfg: _Config, family: str, num_layers: int) -> dict:
    """sliding_window / sliding_layers with transformers' semantics per family: mistral (default 4096)
    and mixtral window every layer; qwen2/qwen3 only with use_sliding_window, on the layers whose
    ``layer_types`` entry is sliding_attention (default: layers >= max_window_layers); qwen3_moe all."""
    if family == "mistral":
        window = cfg.raw.get("sliding_window", 4096)
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        window = cfg.raw.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    else:
        window = cfg.raw.get("sliding_window")
    if window is None:
        return {}
    layers = range(num_layers)
    if family in ("qwen2", "qwen3"):
        types = cfg.raw.get("layer_types")
        if types is not None:
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            layers = [i for i in layers if i >= cfg.get("max_window_layers", 28)]
    return dict(sliding_window=window, sliding_layers=tuple(layers))


def _common_llama(cfg: _Config, family: str) -> dict:
    hidden, heads = cfg.req("hidden_size"), cfg.req("num_attention_heads")
    rope = cfg.get("rope_parameters", None) or {}
    return dict(
        family=family,
        vocab_size=cfg.req("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.req("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim", hidden // heads),
        ffn_kind=_ffn_kind(cfg),
        activation=cfg.get("hidden_act", "silu"),
        ffn_size=cfg.req("intermediate_size"),
        norm_kind="rmsnorm",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        position_kind="rope",
        max_position=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg),
    ) | _sliding(cfg, family, cfg.req("num_hidden_layers"))


def _llama(cfg: _Config) -> dict:
    spec = _common_llama(cfg, "llama")
    bias = bool(cfg.get("attention_bias", False))
    return spec | dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _mistral(cfg: _Config) -> dict:
    return _common_llama(cfg, "mistral")


def _qwen2(cfg: _Config) -> dict:
    return _common_llama(cfg, "qwen2") | dict(qkv_bias=True)


def _qwen3(cfg: _Config) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return _common_llama(cfg, "qwen3") | dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _mixtral(cfg: _Config) -> dict:
    spec = _common_llama(cfg, "mixtral")
    return spec | dict(
        num_experts=cfg.req("num_local_experts"),
        top_k=cfg.req("num_experts_per_tok"),
        expert_ffn_size=spec["ffn_size"],
        moe_layers=tuple(range(spec["num_layers"])),
        router_scoring="softmax",
        norm_topk_prob=True,
    )


def _qwen3_moe(cfg: _Config) -> dict:
    spec = _qwen3(cfg) | dict(family="qwen3_moe", sliding_window=None, sliding_layers=())
    spec |= _sliding(cfg, "qwen3_moe", spec["num_layers"])
    experts = cfg.req_any("num_experts", "num_local_experts")
    step = cfg.get("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers", []))
    moe = tuple(
        i for i in range(spec["num_layers"]) if i not in dense_only and experts > 0 and (i + 1) % step == 0
    )
    return spec | dict(
        num_experts=experts,
        top_k=cfg.req("num_experts_per_tok"),
        expert_ffn_size=cfg.req("moe_intermediate_size"),
        moe_layers=moe,
        router_scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _deepseek_v3(cfg: _Config) -> dict:
    spec = _common_llama(cfg, "deepseek_v3")
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", 0))
    first_dense, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
    moe = tuple(i for i in range(spec["num_layers"]) if experts and i >= first_dense and i % freq == 0)
    bias = bool(cfg.get("attention_bias", False))
    nope, rope_dim = cfg.req("qk_nope_head_dim"), cfg.req("qk_rope_head_dim")
    return spec | dict(
        head_dim=nope + rope_dim,
        qkv_bias=bias,
        o_bias=bias,
        attention_kind="mla",
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        q_lora_rank=cfg.get("q_lora_rank", None) or None,
        kv_lora_rank=cfg.req("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg.req("v_head_dim"),
        num_experts=experts,
        top_k=cfg.req("num_experts_per_tok") if experts else 0,
        num_shared_experts=cfg.get("n_shared_experts", 0),
        expert_ffn_size=cfg.req("moe_intermediate_size") if experts else 0,
        moe_layers=moe,
        router_scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_expert_groups=cfg.get("n_group", 1),
        topk_groups=cfg.get("topk_group", 1),
    )


def _gpt2(cfg: _Config) -> dict:
    hidden, heads = cfg.req("n_embd"), cfg.req("n_head")
    if cfg.get("scale_attn_by_inverse_layer_idx", False) or not cfg.get("scale_attn_weights", True):
        raise SpecError(f"{cfg.name}: gpt2 attention scaling other than 1/sqrt(head_dim) (scale_attn_weights, "
                        "scale_attn_by_inverse_layer_idx) is not supported")
    return dict(
        family="gpt2",
        vocab_size=cfg.req("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.req("n_layer"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_kind=_ffn_kind(cfg, "activation_function") if "activation_function" in cfg.raw else "gelu",
        activation=cfg.get("activation_function", "gelu_new"),
        ffn_size=cfg.get("n_inner", 4 * hidden),
        norm_kind="layernorm",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        position_kind="learned",
        max_position=cfg.req("n_positions"),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
    )


_READERS: dict[str, Callable[[_Config], dict]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "gpt2": _gpt2,
} | hf_models.READERS


def spec_from_hf_config(raw: dict, name: str = "config.json", source: str = "", extra: dict | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config dict."""
    if not isinstance(raw, dict):
        raise SpecError(f"{name}: a config must be a JSON object, got {type(raw).__name__}")
    from modelcarve.spec.config_checks import check_config

    check_config(raw, name)
    model_type = raw.get("model_type")
    if model_type is None:
        raise SpecError(f"{name}: config.json has no 'model_type'; supported: {', '.join(MODEL_TYPES)}")
    reader = _READERS.get(_ALIASES.get(model_type, model_type))
    if reader is None:
        raise SpecError(
            f"{name}: model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
        )
    cfg = _Config(raw, name)
    try:
        fields = reader(cfg)
        return ModelSpec(name=name, source=source, extra=dict(extra or {}), **fields)
    except (TypeError, ValueError) as err:
        if isinstance(err, SpecError):
            raise
        raise SpecError(f"{name}: malformed config.json value ({err})") from None


def _looks_like_hub_id(text: str) -> bool:
    """``org/name`` as the Hugging Face hub spells repositories (not a relative or absolute path)."""
    parts = text.split("/")
    return (len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and not text.endswith(".json")
            and all(c.isalnum() or c in "-_." for c in text.replace("/", "")))


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read ``config.json`` from a file or a checkpoint directory."""
    import modelcarve.spec.files as files

    path = files.user_path(path, "model")
    file = path / "config.json" if files.is_dir(path) else path
    if not files.is_file(file):
        text = str(path)
        if not files.exists(path) and _looks_like_hub_id(text):
            raise SpecError(f"{text!r} looks like a Hugging Face hub id, and modelcarve reads no hub: download it first "
                            f"(e.g. `huggingface-cli download {text} config.json --local-dir DIR`; the weights too to "
                            f"run it) and give DIR, or use a catalogue name (`modelcarve models`)")
        raise SpecError(f"{path}: no such config file (give a config.json or a directory holding one)")
    raw = files.read_json(file, "config file")
    return spec_from_hf_config(raw, name=str(path), source=str(file))
