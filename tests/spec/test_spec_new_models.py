"""Parameter counts of the newer model families (spec/hf_models.py) against transformers' own.

The oracle nobody here wrote: transformers builds each model on the meta device (no weights, no
download) from a small random config and counts ``model.parameters()``. Each config is read
twice: as the sparse dict given (our defaults must be transformers' defaults) and as the full
config transformers serialises (what ``save_pretrained`` writes). Counts must be equal exactly.
"""

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from modelcarve.spec.hf_config import spec_from_hf_config
from modelcarve.spec.hf_models import MODEL_TYPES

# Multimodal types are counted through their language model's own model_type.
_TEXT_TYPE = {"llama4": "llama4_text", "gemma3": "gemma3_text"}


def _random_config(model_type: str, rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
    head_dim = rng.choice([8, 16])
    hidden = heads * head_dim * rng.choice([1, 2])
    layers = rng.randint(2, 6)
    vocab = rng.randint(50, 300)
    base = dict(
        model_type=_TEXT_TYPE.get(model_type, model_type),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=rng.choice([24, 40, 64]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=rng.choice([True, False]),
        max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if model_type == "gpt_oss":
        base.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=2, head_dim=rng.choice([8, 16, 32]),
                    sliding_window=rng.choice([16, 32]), attention_bias=rng.choice([True, False]))
    if model_type == "llama4":
        base.update(num_local_experts=rng.choice([4, 8]), num_experts_per_tok=1, head_dim=rng.choice([8, 16]),
                    intermediate_size_mlp=rng.choice([32, 80]), interleave_moe_layer_step=rng.choice([1, 2]),
                    attention_chunk_size=rng.choice([16, 64]))
    if model_type == "gemma3":
        base.update(head_dim=rng.choice([8, 16, 32]), sliding_window=rng.choice([16, 32]),
                    attention_bias=rng.choice([True, False]))
    if model_type == "deepseek_v2":
        base.update(
            n_routed_experts=rng.choice([4, 8]), n_shared_experts=rng.choice([1, 2]), num_experts_per_tok=2,
            moe_intermediate_size=rng.choice([16, 32]), first_k_dense_replace=rng.randint(0, 2),
            q_lora_rank=rng.choice([None, 16]), kv_lora_rank=rng.choice([8, 16]), qk_nope_head_dim=rng.choice([8, 16]),
            qk_rope_head_dim=8, v_head_dim=rng.choice([8, 16]), num_key_value_heads=heads,
        )
    if model_type == "nemotron":
        base.update(head_dim=rng.choice([8, 16]), attention_bias=rng.choice([True, False]), mlp_bias=rng.choice([True, False]))
    if model_type == "bloom":
        base = dict(model_type="bloom", vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                    tie_word_embeddings=rng.choice([True, False]))
    if model_type == "opt":
        base = dict(model_type="opt", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, ffn_dim=rng.choice([24, 48]), max_position_embeddings=rng.choice([64, 128]),
                    word_embed_proj_dim=hidden, enable_bias=rng.choice([True, False]),
                    tie_word_embeddings=rng.choice([True, False]), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return base


def _transformers_count(raw: dict) -> tuple[int, dict]:
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), json.loads(config.to_json_string())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_total_params_equal_transformers(model_type, seed):
    raw = _random_config(model_type, random.Random(f"{model_type}-{seed}"))
    expected, full = _transformers_count(raw)
    assert spec_from_hf_config(full).total_params == expected
    assert spec_from_hf_config(raw).total_params == expected


def test_each_family_brings_its_layers():
    """The fields that make each family differ are read, not just the count (a count can agree by accident)."""
    rng = random.Random(0)
    oss = spec_from_hf_config(_random_config("gpt_oss", rng) | {"num_hidden_layers": 4})
    assert oss.attention_sinks and oss.router_bias and oss.sliding_layers == (0, 2) and oss.expert_checkpoint_dtype == "mxfp4"
    l4 = spec_from_hf_config(_random_config("llama4", rng) | {"num_hidden_layers": 8, "interleave_moe_layer_step": 2})
    assert l4.moe_layers == (1, 3, 5, 7) and l4.num_shared_experts == 1 and l4.chunked_layers == (0, 1, 2, 4, 5, 6)
    g3 = spec_from_hf_config(_random_config("gemma3", rng) | {"num_hidden_layers": 12})
    assert g3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and g3.layer_norms == 4 and g3.tied_embeddings
    nem = spec_from_hf_config(_random_config("nemotron", rng))
    assert (nem.ffn_kind, nem.activation, nem.norm_kind, nem.partial_rotary_factor) == ("gelu", "relu2", "layernorm", 0.5)
    bloom = spec_from_hf_config(_random_config("bloom", rng))
    assert bloom.position_kind == "alibi" and bloom.embedding_norm
    opt = spec_from_hf_config(_random_config("opt", rng))
    assert opt.position_kind == "learned" and opt.position_offset == 2


def test_multimodal_config_reads_the_language_model():
    """A llama4 / gemma3 config.json as released (text_config inside a multimodal config) counts the
    language model: transformers' multimodal model minus its vision tower and projector."""
    for model_type, text in (("llama4", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=32,
                                              head_dim=8)),
                             ("gemma3", dict(head_dim=8, sliding_window=16))):
        text_config = dict(vocab_size=120, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **text)
        vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      image_size=32, patch_size=16)
        if model_type == "llama4":
            vision |= dict(vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
        raw = dict(model_type=model_type, text_config=text_config, vision_config=vision)
        config = transformers.AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        language = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n and "projector" not in n)
        assert spec_from_hf_config(raw).total_params == language, model_type


def test_unsupported_variants_are_one_line_errors():
    from modelcarve.spec.errors import SpecError

    with pytest.raises(SpecError, match="word_embed_proj_dim"):
        spec_from_hf_config(dict(model_type="opt", hidden_size=64, word_embed_proj_dim=32))
    with pytest.raises(SpecError, match="relu2"):
        spec_from_hf_config(dict(model_type="nemotron", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                 vocab_size=10, intermediate_size=8, hidden_act="gelu"))


CATALOGUED = ["gpt-oss-120b", "gpt-oss-20b", "llama-4-scout", "llama-4-maverick", "qwen3-30b-a3b", "gemma-3-27b",
              "deepseek-v2-lite", "nemotron-4-340b", "bloom-176b"]


@pytest.mark.parametrize("name", CATALOGUED)
def test_catalogued_real_models_equal_transformers(name):
    """Each catalogued config.json, built by transformers on the meta device (the language model of a
    multimodal config), has exactly our count; and that count is the published one to its stated digits."""
    from modelcarve.spec.catalog import catalog_entry, get_model

    raw = dict(catalog_entry(name)["config"])
    if "text_config" in raw:
        raw = dict(raw["text_config"], model_type=_TEXT_TYPE[raw["model_type"]])
    raw.pop("quantization_config", None)  # build the bf16 layout; MXFP4 is a storage format
    expected, _ = _transformers_count(raw)
    spec = get_model(name)
    assert spec.total_params == expected
    published = catalog_entry(name)["published"]["total_params"]
    if "," in published:  # an exact count (BLOOM)
        assert spec.total_params == int(published.replace(",", ""))
    elif "." in published:  # "116.8B": the count rounds to it, within half its last digit
        digits = published.rstrip("B")
        half = 0.5 * 10 ** -len(digits.split(".")[1]) * 1e9
        assert abs(spec.total_params - float(digits) * 1e9) <= half, (name, published)
    # (whole-number names, "340B", "27B", "109B" with its vision tower, are rounded names, not counts)


def test_runtime_refuses_models_whose_layers_it_lacks():
    """Planned but not run: the coverage check names the missing layers; supported families pass."""
    from modelcarve.spec.support import missing_layers
    from modelcarve.spec.catalog import get_model

    assert missing_layers(get_model("llama-3.1-8b")) == [] and missing_layers(get_model("deepseek-v3")) == []
    assert missing_layers(get_model("mixtral-8x7b")) == []
    oss = missing_layers(get_model("gpt-oss-20b"))
    assert oss[0].startswith("the gpt_oss family") and "attention sinks" in oss and "a router bias" in oss
    assert "ALiBi positions" in missing_layers(get_model("bloom-176b"))
    for name in CATALOGUED:
        if get_model(name).family not in ("qwen3_moe", "deepseek_v2"):
            assert missing_layers(get_model(name)), name
    assert missing_layers(get_model("deepseek-v2-lite")) == []  # deepseek_v3's layers (test below)
    grouped = spec_from_hf_config(_random_config("deepseek_v2", random.Random(1)) | {"n_group": 2, "topk_group": 1,
                                                                                    "topk_method": "group_limited_greedy"})
    assert any("group-limited" in m for m in missing_layers(grouped))
    # a supported family asking for a layer the reference lacks is refused too
    assert missing_layers(get_model("llama-3.1-8b").replace(partial_rotary_factor=0.5)) == ["partial rotary (0.5 of each head)"]


def test_run_refuses_before_launch(tmp_path):
    """`modelcarve run` on a model the runtime cannot build: exit 2, one line, no torchrun started."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.run(
        [sys.executable, "-m", "modelcarve.cli", "run", "--model", "gpt-oss-20b", "--layout", "tp=1,dp=1,mbs=1,gbs=1,seq=16",
         "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(src)),
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "can be planned but not run" in lines[0] and "attention sinks" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra", [{}, {"q_lora_rank": 24, "routed_scaling_factor": 2.0},
                                   {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}])
def test_deepseek_v2_reference_model_matches_transformers(tmp_path, extra):
    """DeepSeek-V2 runs in the reference model (its layers are deepseek_v3's: MLA, shared experts, softmax
    routing): logits equal transformers' DeepseekV2ForCausalLM on the same tiny checkpoint. Tolerance: fp32
    logits of magnitude ~7 through 3 layers; 1e-4 is ~100x the differences of summation order observed (5e-6)."""
    from hf_tiny import logits_diff, save_hf

    from modelcarve.runtime.checkpoint.hf_load import load_model

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
                num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=256,
                tie_word_embeddings=False, pad_token_id=0)
    hf = save_hf("DeepseekV2Config", "DeepseekV2ForCausalLM", tmp_path, base=base, **extra)
    ours, spec = load_model(str(tmp_path))
    assert spec.family == "deepseek_v2"
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    assert logits_diff(ours.eval(), hf, ids) < 1e-4
