"""Rope scaling and sliding windows: our reference logits equal transformers' (fp32, max abs diff
<= 1e-5) on tiny checkpoints with std-0.2 weights, at positions past
``original_max_position_embeddings`` / ``max_position_embeddings`` and with prompts longer than
the window; and a model that ignores the scaling or the window differs by far more (so the
comparison can fail)."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import logits_diff, save_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SEQ = 160  # past max_position_embeddings (64) and original_max_position_embeddings (32)

ROPE = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "linear": dict(rope_type="linear", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0,
                        mscale_all_dim=0.8, beta_fast=16, beta_slow=2),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
}


def _ids(seq: int, vocab: int = 128, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _ours(path, **spec_changes):
    from modelcarve.runtime.checkpoint.hf_load import load_full
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.spec.catalog import get_model

    spec = get_model(str(path))
    if spec_changes:
        spec = spec.replace(**spec_changes)
    model = build_model(spec)
    load_full(model, path)
    return model.eval(), spec


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_rope_scaling_equals_transformers(kind, tmp_path):
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, rope_theta=10000.0, rope_parameters=dict(ROPE[kind]))
    ours, spec = _ours(tmp_path)
    assert spec.rope_parameters["rope_type"] == ROPE[kind]["rope_type"]
    ids = _ids(SEQ)
    assert logits_diff(ours, hf, ids) <= TOL
    plain, _ = _ours(tmp_path, rope_scaling=())
    assert logits_diff(plain, hf, ids) > 1e-2, "plain rope should not match scaled rope"


def test_rope_scaling_legacy_key_and_short_prompt(tmp_path):
    """transformers 4's ``rope_scaling`` key with ``type`` reads the same; dynamic below
    max_position is plain rope."""
    import json

    from modelcarve.spec.hf_config import spec_from_hf_config

    hf = save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, rope_parameters=dict(ROPE["dynamic"]))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_scaling"] = {"type": "dynamic", "factor": 3.0}
    raw.pop("rope_parameters", None)
    assert spec_from_hf_config(raw).rope_parameters == dict(rope_type="dynamic", factor=3.0)
    ours, _ = _ours(tmp_path)
    assert logits_diff(ours, hf, _ids(40)) <= TOL


def test_deepseek_yarn_mla(tmp_path):
    """MLA with yarn: the cos/sin attention factor and the softmax mscale^2 of DeepSeek-V3."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=0,
                first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                     mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1, rope_theta=10000.0))
    hf = save_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", tmp_path, base=base)
    ours, spec = _ours(tmp_path)
    assert spec.attention_kind == "mla"
    assert logits_diff(ours, hf, _ids(96)) <= TOL


WINDOWS = {
    # family: (config, model, overrides, layers that slide)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), (0, 1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
              (1,)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                   head_dim=16), (0,)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=8, num_local_experts=4,
                                                            num_experts_per_tok=2), (0, 1)),
}


@pytest.mark.parametrize("family", sorted(WINDOWS))
def test_sliding_window_equals_transformers(family, tmp_path):
    cfg, cls, extra, layers = WINDOWS[family]
    hf = save_hf(cfg, cls, tmp_path, **extra)
    ours, spec = _ours(tmp_path)
    assert spec.sliding_layers == layers and spec.sliding_window == extra["sliding_window"]
    ids = _ids(40)  # five windows long
    assert logits_diff(ours, hf, ids) <= TOL
    full, _ = _ours(tmp_path, sliding_window=None, sliding_layers=())
    assert logits_diff(full, hf, ids) > 1e-2, "ignoring the window should not match"


def test_window_defaults_follow_transformers():
    from modelcarve.spec.hf_config import spec_from_hf_config

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=30, num_attention_heads=2)
    mistral = spec_from_hf_config(base | dict(model_type="mistral"))
    assert mistral.sliding_window == 4096 and mistral.sliding_layers == tuple(range(30))  # MistralConfig default
    assert spec_from_hf_config(base | dict(model_type="mistral", sliding_window=None)).sliding_window is None
    assert spec_from_hf_config(base | dict(model_type="qwen2", sliding_window=16)).sliding_window is None
    qwen = spec_from_hf_config(base | dict(model_type="qwen2", use_sliding_window=True))
    assert qwen.sliding_window == 4096 and qwen.sliding_layers == (28, 29)  # max_window_layers default 28


def test_attention_mask_is_the_one_rule():
    from modelcarve.runtime.model.transformer import attention_mask

    q = torch.tensor([5, 6])  # e.g. two decode positions against a cache holding 0..6
    k = torch.arange(7)
    mask = attention_mask(q, k, 3)
    assert mask.tolist() == [[False, False, False, True, True, True, False],
                             [False, False, False, False, True, True, True]]
    assert attention_mask(q, k, None)[0].tolist() == [True] * 6 + [False]


def test_unsupported_rope_is_a_clear_error():
    from modelcarve.spec.errors import SpecError
    from modelcarve.spec.hf_config import spec_from_hf_config

    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(SpecError, match="longrope"):
        spec_from_hf_config(base | dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(SpecError, match="low_freq_factor"):
        spec_from_hf_config(base | dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


def test_ring_attention_refuses_a_window_before_any_rank_starts():
    from modelcarve.spec.support import check_training as check_runtime
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.hf_config import spec_from_hf_config
    from modelcarve.spec.layout import Layout

    spec = spec_from_hf_config(dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, sliding_window=8))
    with pytest.raises(LayoutError, match="sliding window"):
        check_runtime(Layout.parse("cp=2,seq=32,param_dtype=fp32"), spec, world_size=2)
    check_runtime(Layout.parse("cp=2,seq=8,param_dtype=fp32"), spec, world_size=2)  # window >= seq: plain causal
