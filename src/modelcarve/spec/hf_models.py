"""Config readers for the newer Hugging Face model families: gpt_oss, llama4, gemma3, deepseek_v2,
phi3, nemotron, bloom and opt (``config.json`` -> ``ModelSpec`` fields).

``spec/hf_config.py`` registers these readers beside its own; each takes the looked-up config
(``hf_config._Config``: ``req``, ``req_any``, ``get``, ``raw``, ``name``) and returns the fields
of a ``ModelSpec``. Keys transformers defaults are defaulted to transformers' own default
(transformers 5, ``configuration_<type>.py``); the parameter counts are checked against
transformers' models built on the meta device (tests/spec/test_spec_new_models.py).

What each family brings that the older ones lack (ModelSpec fields in brackets):

* gpt_oss: attention sinks [attention_sinks], sliding window on alternate layers, a router with
  a bias [router_bias], experts with biases, MXFP4-released experts [expert_checkpoint_dtype].
* llama4 (and llama4_text): MoE with one shared expert, dense and MoE layers interleaved
  (``interleave_moe_layer_step`` / ``moe_layers``), chunked attention on the rope layers
  [attention_chunk, chunked_layers], weightless L2 q/k norm. A multimodal config's language
  model is read from ``text_config`` (the vision tower is not counted).
* gemma3 (and gemma3_text): 5 local (sliding) layers per global one, four norms per layer
  [layer_norms], q/k norm, gated GELU-tanh MLP, tied embeddings; ``text_config`` as for llama4.
* deepseek_v2: MLA as deepseek_v3, softmax routing, MoE from ``first_k_dense_replace`` on (the
  runtime runs it, but not group-limited greedy routing: spec/support.py).
* phi3: llama's parameters with fused qkv and gate/up matrices (same counts), partial rotary.
* nemotron: squared-ReLU two-matrix MLP, LayerNorm1P (weight and bias), partial rotary 0.5.
* bloom: ALiBi positions, a LayerNorm after the embedding [embedding_norm], biases everywhere.
* opt: learned positions with 2 offset rows [position_offset], ReLU MLP, biases.

Rotary scaling of these families is recorded as given (type and scalar keys) without the
validation ``hf_config`` applies for the runtime: the runtime refuses these families before
launch (spec/support.py), except deepseek_v2, whose layers are deepseek_v3's.
"""

from __future__ import annotations

from typing import Any, Callable

from modelcarve.spec.errors import SpecError


def _rope(cfg, default_theta: float = 10000.0) -> dict:
    """rope_theta, rope_scaling (scalar keys only) and partial_rotary_factor, from ``rope_parameters``
    (transformers 5) or ``rope_scaling`` / top-level keys (transformers 4)."""
    rope = cfg.raw.get("rope_parameters") or cfg.raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise SpecError(f"{cfg.name}: rope_scaling must be a JSON object, got {rope!r}")
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # gemma3: per layer type
        rope = rope["full_attention"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(cfg.raw.get("rope_theta") or rope.get("rope_theta") or default_theta)
    partial = float(cfg.raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    scaling = ()
    if kind != "default":
        scalars = {k: v for k, v in rope.items() if isinstance(v, (int, float, str, bool)) and k not in
                   ("rope_theta", "partial_rotary_factor", "type")}
        scaling = tuple(sorted((scalars | {"rope_type": kind}).items()))
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)


def _windowed(types: list | None, window, kind: str = "sliding_attention") -> dict:
    if window is None or not types:
        return {}
    return dict(sliding_window=int(window), sliding_layers=tuple(i for i, t in enumerate(types) if t == kind))


def _decoder(cfg, family: str, *, theta: float = 10000.0) -> dict:
    hidden, heads = cfg.req("hidden_size"), cfg.req("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    return dict(
        family=family,
        vocab_size=cfg.req("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.req("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=cfg.get("head_dim", hidden // heads),
        ffn_size=cfg.req("intermediate_size"),
        norm_kind="rmsnorm",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=cfg.get("max_position_embeddings", 4096),
    ) | _rope(cfg, theta)


def _text(cfg):
    """The language model's config of a multimodal config (``text_config``), or the config itself."""
    inner = cfg.raw.get("text_config")
    if isinstance(inner, dict):
        return type(cfg)(inner | {"model_type": cfg.raw.get("model_type")}, cfg.name)
    return cfg


def _gpt_oss(cfg) -> dict:
    layers = cfg.get("num_hidden_layers", 36)
    experts = cfg.get("num_local_experts", 128)
    types = cfg.get("layer_types", ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])
    spec = _decoder(cfg, "gpt_oss", theta=150000.0)
    bias = bool(cfg.get("attention_bias", True))
    return spec | dict(
        num_kv_heads=cfg.get("num_key_value_heads", 8),
        head_dim=cfg.get("head_dim", 64),
        ffn_kind="swiglu",
        activation="swiglu_clamped",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,  # expert gate_up / down biases
        attention_sinks=True,
        router_bias=True,
        num_experts=experts,
        top_k=cfg.get("num_experts_per_tok", 4),
        expert_ffn_size=spec["ffn_size"],
        moe_layers=tuple(range(layers)),
        router_scoring="softmax",
        norm_topk_prob=True,  # softmax over the top-k logits
        expert_checkpoint_dtype="mxfp4",
    ) | _windowed(types, cfg.get("sliding_window", 128))


def _llama4(cfg) -> dict:
    cfg = _text(cfg)
    layers = cfg.req("num_hidden_layers")
    step = cfg.get("interleave_moe_layer_step", 1)
    moe = cfg.get("moe_layers", list(range(step - 1, layers, step)))
    interval = cfg.get("no_rope_layer_interval", 4)
    rope_layers = cfg.get("no_rope_layers", [int((i + 1) % interval != 0) for i in range(layers)])
    chunk = cfg.raw.get("attention_chunk_size", 8192) if "attention_chunk_size" in cfg.raw else 8192
    spec = _decoder(cfg, "llama4", theta=500000.0)
    bias = bool(cfg.get("attention_bias", False))
    return spec | dict(
        num_kv_heads=cfg.get("num_key_value_heads", spec["num_heads"]),
        head_dim=cfg.get("head_dim", spec["hidden_size"] // spec["num_heads"]),
        ffn_kind="swiglu",
        activation=cfg.get("hidden_act", "silu"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        ffn_size=cfg.get("intermediate_size_mlp", 16384),
        qkv_bias=bias,
        o_bias=bias,
        num_experts=cfg.get("num_local_experts", 16),
        top_k=cfg.get("num_experts_per_tok", 1),
        num_shared_experts=1,
        expert_ffn_size=cfg.req("intermediate_size"),
        moe_layers=tuple(moe),
        router_scoring="sigmoid",
        norm_topk_prob=False,
        attention_chunk=chunk,
        chunked_layers=tuple(i for i, r in enumerate(rope_layers) if r) if chunk else (),
    )


def _gemma3(cfg) -> dict:
    cfg = _text(cfg)
    layers = cfg.req("num_hidden_layers")
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    types = cfg.get("layer_types", ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)])
    spec = _decoder(cfg, "gemma3", theta=1000000.0)
    bias = bool(cfg.get("attention_bias", False))
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    return spec | dict(
        num_kv_heads=cfg.get("num_key_value_heads", 4),
        head_dim=cfg.get("head_dim", 256),
        ffn_kind="swiglu",  # gated: down(gelu_tanh(gate x) * up x)
        activation=act,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        layer_norms=4,
    ) | _windowed(types, cfg.get("sliding_window", 4096))


def _deepseek_v2(cfg) -> dict:
    spec = _decoder(cfg, "deepseek_v2")
    experts = cfg.get("n_routed_experts", 64)
    first_dense = cfg.get("first_k_dense_replace", 0)
    bias = bool(cfg.get("attention_bias", False))
    nope, rope_dim = cfg.get("qk_nope_head_dim", 128), cfg.get("qk_rope_head_dim", 64)
    q_rank = cfg.raw.get("q_lora_rank", 1536) if "q_lora_rank" in cfg.raw else 1536
    limited = cfg.get("topk_method", "greedy") == "group_limited_greedy" and (cfg.get("n_group", 1) or 1) > 1
    return spec | dict(
        head_dim=nope + rope_dim,
        ffn_kind="swiglu",
        activation=cfg.get("hidden_act", "silu"),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        attention_kind="mla",
        rope_interleave=True,
        q_lora_rank=q_rank or None,
        kv_lora_rank=cfg.get("kv_lora_rank", 512),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg.get("v_head_dim", 128),
        num_experts=experts,
        top_k=cfg.req("num_experts_per_tok") if experts else 0,
        num_shared_experts=cfg.get("n_shared_experts", 2) if experts else 0,
        expert_ffn_size=cfg.get("moe_intermediate_size", 1407) if experts else 0,
        moe_layers=tuple(i for i in range(spec["num_layers"]) if experts and i >= first_dense),
        router_scoring="softmax",
        # transformers' DeepSeek-V2 never renormalises the top-k weights (norm_topk_prob is unread), and
        # limits groups only with topk_method group_limited_greedy (group score: its best expert).
        norm_topk_prob=False,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_expert_groups=cfg.get("n_group", 1) if limited else 1,
        topk_groups=cfg.get("topk_group", 1) if limited else 1,
    )


def _phi3(cfg) -> dict:
    spec = _decoder(cfg, "phi3")
    return spec | dict(
        ffn_kind="swiglu",
        activation=cfg.get("hidden_act", "silu"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
    ) | _windowed(["sliding_attention"] * spec["num_layers"], cfg.raw.get("sliding_window"))


def _nemotron(cfg) -> dict:
    spec = _decoder(cfg, "nemotron")
    act = cfg.get("hidden_act", "relu2")
    if act != "relu2":
        raise SpecError(f"{cfg.name}: nemotron with hidden_act {act!r} is not supported; its MLP is squared ReLU (relu2)")
    return spec | dict(
        ffn_kind="gelu",  # two matrices: down(relu(up x)^2)
        activation="relu2",
        norm_kind="layernorm",  # LayerNorm1P: weight and bias
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        partial_rotary_factor=float(cfg.raw.get("partial_rotary_factor") or
                                    (cfg.raw.get("rope_parameters") or {}).get("partial_rotary_factor") or 0.5),
    )


def _bloom(cfg) -> dict:
    hidden = cfg.get("hidden_size", cfg.get("n_embed", cfg.get("n_embd", 64)))
    heads = cfg.get("n_head", cfg.get("num_attention_heads", 8))
    if hidden % heads:
        raise SpecError(f"{cfg.name}: hidden_size {hidden} is not a multiple of n_head {heads}")
    return dict(
        family="bloom",
        vocab_size=cfg.get("vocab_size", 250880),
        hidden_size=hidden,
        num_layers=cfg.get("n_layer", cfg.get("num_hidden_layers", 2)),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_kind="gelu",
        activation="gelu_bloom",  # the tanh approximation
        ffn_size=4 * hidden,
        norm_kind="layernorm",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        position_kind="alibi",
        max_position=cfg.get("seq_length", 2048),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        embedding_norm=True,
    )


def _opt(cfg) -> dict:
    hidden, heads = cfg.get("hidden_size", 768), cfg.get("num_attention_heads", 12)
    if cfg.get("word_embed_proj_dim", hidden) != hidden:
        raise SpecError(f"{cfg.name}: OPT with word_embed_proj_dim != hidden_size (project_in/out, OPT-350m) is not supported")
    if not cfg.get("do_layer_norm_before", True) or not cfg.get("layer_norm_elementwise_affine", True):
        raise SpecError(f"{cfg.name}: OPT with post-layer norm (do_layer_norm_before=false, OPT-350m) or norms without "
                        "weights is not supported")
    bias = bool(cfg.get("enable_bias", True))
    act = cfg.get("activation_function", "relu")
    return dict(
        family="opt",
        vocab_size=cfg.get("vocab_size", 50272),
        hidden_size=hidden,
        num_layers=cfg.get("num_hidden_layers", 12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_kind="gelu",  # two matrices: fc2(act(fc1 x))
        activation=act,
        ffn_size=cfg.get("ffn_dim", 3072),
        norm_kind="layernorm",
        norm_eps=1e-5,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        position_kind="learned",
        max_position=cfg.get("max_position_embeddings", 2048),
        position_offset=2,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
    )


READERS: dict[str, Callable[[Any], dict]] = {
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "gemma3": _gemma3,
    "deepseek_v2": _deepseek_v2,
    "phi3": _phi3,
    "nemotron": _nemotron,
    "bloom": _bloom,
    "opt": _opt,
}
ALIASES = {"llama4_text": "llama4", "gemma3_text": "gemma3"}
MODEL_TYPES = tuple(READERS)
