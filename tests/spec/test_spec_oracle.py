"""Our parameter count against transformers' own, for every supported model_type.

The oracle nobody here wrote: transformers builds each model on the meta device (no weights,
no download) from a small random config and counts ``model.parameters()``.
"""

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from modelcarve.spec.hf_config import SUPPORTED_MODEL_TYPES, spec_from_hf_config


def _random_config(model_type: str, rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
    head_dim = rng.choice([8, 16])
    hidden = heads * head_dim * rng.choice([1, 2])
    layers = rng.randint(2, 6)
    base = dict(
        model_type=model_type,
        vocab_size=rng.randint(50, 300),
        hidden_size=hidden,
        intermediate_size=rng.choice([24, 40, 64]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=rng.choice([True, False]),
        max_position_embeddings=128,
    )
    if model_type in ("mistral", "qwen3", "qwen3_moe"):
        base["head_dim"] = rng.choice([8, 16, 32])
    if model_type == "llama":
        base["attention_bias"] = rng.choice([True, False])
        base["mlp_bias"] = rng.choice([True, False])
    if model_type == "qwen3":
        base["attention_bias"] = rng.choice([True, False])
    if model_type == "mixtral":
        base.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=2)
    if model_type == "qwen3_moe":
        base.update(
            num_experts=rng.choice([4, 8]),
            num_experts_per_tok=2,
            moe_intermediate_size=rng.choice([16, 32]),
            decoder_sparse_step=rng.choice([1, 2]),
            mlp_only_layers=rng.sample(range(layers), k=rng.randint(0, 1)),
        )
    if model_type == "deepseek_v3":
        base.update(
            n_routed_experts=8,
            n_shared_experts=rng.choice([1, 2]),
            num_experts_per_tok=2,
            moe_intermediate_size=rng.choice([16, 32]),
            first_k_dense_replace=rng.randint(0, 2),
            moe_layer_freq=1,
            n_group=rng.choice([1, 2]),
            topk_group=1,
            q_lora_rank=rng.choice([None, 16]),
            kv_lora_rank=rng.choice([8, 16]),
            qk_nope_head_dim=rng.choice([8, 16]),
            qk_rope_head_dim=8,
            v_head_dim=rng.choice([8, 16]),
            num_key_value_heads=heads,
        )
    if model_type == "gpt2":
        base = dict(
            model_type="gpt2",
            vocab_size=rng.randint(50, 300),
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=rng.choice([64, 128]),
            n_inner=rng.choice([None, 48]),
        )
    return base


def _transformers_count(raw: dict) -> int:
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), json.loads(config.to_json_string())


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_total_params_equal_transformers(model_type, seed):
    raw = _random_config(model_type, random.Random(f"{model_type}-{seed}"))
    expected, full = _transformers_count(raw)
    # From the full serialised config (what save_pretrained writes) and from the sparse
    # dict (our defaults must equal transformers' defaults).
    assert spec_from_hf_config(full).total_params == expected
    assert spec_from_hf_config(raw).total_params == expected


@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3", "llama-3.1-405b", "qwen3-235b-a22b", "mixtral-8x22b"])
def test_catalogued_real_models_equal_transformers(name):
    """The published config.json of each model, built by transformers on the meta device."""
    from modelcarve.spec.catalog import catalog_entry, get_model

    raw = dict(catalog_entry(name)["config"])
    if raw["model_type"] == "kimi_k2":  # Kimi K2 ships DeepseekV3ForCausalLM under its own model_type
        raw["model_type"] = "deepseek_v3"
    expected, _ = _transformers_count(raw)
    assert get_model(name).total_params == expected
