"""Single-process tests of the MoE block (runtime/model/moe.py).

Oracles: transformers' own MoE blocks (mixtral, qwen3_moe, deepseek_v3) on the same weights,
outputs and gradients in fp32; Mixtral's ``load_balancing_loss_func`` for the aux loss; a
per-token loop for the capacity rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from modelcarve.runtime.model.transformer import build_model
from modelcarve.runtime.model.moe import MoE
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hf_config import spec_from_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _hf_block(model_type: str, **overrides):
    """(HF MoE block, its config) for a tiny random config of ``model_type``."""
    if model_type == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, **overrides,
        )
    elif model_type == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, **overrides,
        )
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block

        fields = dict(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4,
            n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        )
        cfg = DeepseekV3Config(**(fields | overrides))
    torch.manual_seed(0)
    block = Block(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return block, cfg


def _ours_from_hf(block, cfg) -> MoE:
    spec = spec_from_hf_config(cfg.to_dict())
    moe = MoE(spec)
    f = spec.expert_ffn_size
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        gate_up = block.experts.gate_up_proj
        moe.experts.w1.copy_(gate_up[:, :f])
        moe.experts.w3.copy_(gate_up[:, f:])
        moe.experts.w2.copy_(block.experts.down_proj)
        if hasattr(block.gate, "e_score_correction_bias"):
            moe.router.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
        if moe.shared_experts is not None:
            moe.shared_experts.w1.weight.copy_(block.shared_experts.gate_proj.weight)
            moe.shared_experts.w3.weight.copy_(block.shared_experts.up_proj.weight)
            moe.shared_experts.w2.weight.copy_(block.shared_experts.down_proj.weight)
    return moe


def _compare(block, moe, x):
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = block(x_hf), moe(x_ours)
    torch.testing.assert_close(y_ours, y_hf, atol=TOL, rtol=0)
    g = torch.randn_like(y_hf)
    y_hf.backward(g)
    y_ours.backward(g)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=TOL, rtol=0)
    torch.testing.assert_close(moe.router.weight.grad, block.gate.weight.grad, atol=1e-4, rtol=0)
    gate_up = torch.cat((moe.experts.w1.grad, moe.experts.w3.grad), dim=1)
    torch.testing.assert_close(gate_up, block.experts.gate_up_proj.grad, atol=TOL, rtol=0)
    torch.testing.assert_close(moe.experts.w2.grad, block.experts.down_proj.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("mixtral", {}),
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("qwen3_moe", {"norm_topk_prob": True}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    ],
)
def test_block_matches_transformers(model_type, overrides):
    block, cfg = _hf_block(model_type, **overrides)
    if model_type == "deepseek_v3":  # a non-zero balancing bias must steer the choice, not the weights
        block.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.3)
    moe = _ours_from_hf(block, cfg)
    x = torch.randn(3, 10, cfg.hidden_size)
    _compare(block, moe, x)
    assert int(moe.tokens_per_expert.sum()) == 3 * 10 * cfg.num_experts_per_tok
    assert int(moe.dropped_tokens) == 0


def test_group_limited_routing_stays_in_groups():
    block, cfg = _hf_block("deepseek_v3")
    moe = _ours_from_hf(block, cfg)
    flat = torch.randn(64, cfg.hidden_size)
    indices, weights, _ = moe.router(flat)
    groups = indices // (cfg.n_routed_experts // cfg.n_group)
    assert all(len(set(row.tolist())) <= cfg.topk_group for row in groups)
    # normalised then scaled: each token's weights sum to routed_scaling_factor
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), cfg.routed_scaling_factor))


def test_aux_loss_matches_mixtral_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    spec = get_model("tiny-moe")
    moe = build_model(spec, seed=1).layers["0"].feed_forward
    x = torch.randn(1, 40, spec.hidden_size)
    moe(x)
    _, _, scores = moe.router(x.view(-1, spec.hidden_size))
    expected = load_balancing_loss_func((scores.log(),), spec.num_experts, spec.top_k)
    torch.testing.assert_close(moe.aux_loss, expected, atol=1e-6, rtol=0)
    # several sequences: the mean of the per-sequence losses
    xs = torch.randn(3, 20, spec.hidden_size)
    moe(xs)
    per_seq = []
    for row in xs:
        _, _, sc = moe.router(row)
        per_seq.append(load_balancing_loss_func((sc.log(),), spec.num_experts, spec.top_k))
    torch.testing.assert_close(moe.aux_loss, torch.stack(per_seq).mean(), atol=1e-6, rtol=0)


def test_aux_loss_gradient_is_injected():
    spec = get_model("tiny-moe")
    torch.manual_seed(0)
    x = torch.randn(2, 12, spec.hidden_size)
    coef = 0.1
    plain = build_model(spec, seed=2).layers["0"].feed_forward
    out = plain(x)
    aux_mean = plain._aux_loss(*_scores_and_indices(plain, x)) / x.shape[0]
    (out.sum() + coef * aux_mean).backward()
    injected = build_model(spec, seed=2).layers["0"].feed_forward
    injected.aux_loss_coef = coef
    out2 = injected(x)
    torch.testing.assert_close(out2, out)  # the output is unchanged
    out2.sum().backward()
    assert plain.router.weight.grad.abs().max() > 0
    torch.testing.assert_close(injected.router.weight.grad, plain.router.weight.grad, atol=1e-6, rtol=0)


def _scores_and_indices(moe, x):
    b, s, h = x.shape
    indices, _, scores = moe.router(x.reshape(-1, h))
    return scores.view(b, s, -1), indices.view(b, s, -1)


def test_capacity_factor_drops_by_priority():
    spec = get_model("tiny-moe")
    moe = build_model(spec, seed=3).layers["1"].feed_forward
    x = torch.randn(2, 24, spec.hidden_size)
    indices = moe.router(x.view(-1, spec.hidden_size))[0].view(2, 24, spec.top_k)
    factor = 0.75
    moe.capacity_factor = factor
    keep = moe._capacity_mask(indices)
    capacity = math.ceil(factor * 24 * spec.top_k / spec.num_experts)
    expected = torch.zeros(keep.shape, dtype=torch.bool)
    for b in range(2):  # first choices in token order, then second choices
        used = [0] * spec.num_experts
        for k in range(spec.top_k):
            for t in range(24):
                e = int(indices[b, t, k])
                expected[b, t, k] = used[e] < capacity
                used[e] += 1
    assert torch.equal(keep, expected)
    moe.reset_counts()
    out = moe(x)
    dropped = int((~expected).sum())
    assert dropped > 0 and int(moe.dropped_tokens) == dropped
    assert int(moe.tokens_per_expert.sum()) == 2 * 24 * spec.top_k - dropped
    assert int(moe.tokens_per_expert.max()) <= 2 * capacity
    # a dropped assignment contributes nothing: compare with the block computed by hand
    flat = x.view(-1, spec.hidden_size)
    _, weights, _ = moe.router(flat)
    ref = torch.zeros_like(flat)
    w = moe.experts
    for t in range(flat.shape[0]):
        for k in range(spec.top_k):
            if expected.view(-1, spec.top_k)[t, k]:
                e = int(indices.view(-1, spec.top_k)[t, k])
                h = torch.nn.functional.silu(w.w1[e] @ flat[t]) * (w.w3[e] @ flat[t])
                ref[t] += weights[t, k] * (w.w2[e] @ h)
    torch.testing.assert_close(out.view(-1, spec.hidden_size), ref, atol=1e-6, rtol=0)


def test_bias_update_and_dtype():
    spec = get_model("tiny-moe")
    model = build_model(spec, seed=0, dtype=torch.bfloat16)
    moe = model.layers["0"].feed_forward
    assert moe.router.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w1.dtype == torch.bfloat16
    load = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])
    moe.update_bias(load, rate=1e-3)
    bias = moe.router.e_score_correction_bias
    assert bias[0] == -1e-3 and bias[1] == 1e-3 and torch.all(bias[2:] == 0)
    # a large enough bias moves every token's choice onto the favoured experts
    moe.router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0]))
    moe.reset_counts()
    model(torch.randint(0, spec.vocab_size, (2, 8)))
    assert moe.tokens_per_expert[:6].sum() == 0 and moe.tokens_per_expert.sum() == 2 * 8 * spec.top_k


# --- Hugging Face checkpoints: whole-model logits -----------------------------------------

_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
CHECKPOINTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=24, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8)),
}


def save_tiny_moe(family: str, path, seed: int = 0):
    """A tiny random MoE checkpoint written by transformers' save_pretrained; returns the HF model."""
    cfg_cls, model_cls, extra = CHECKPOINTS[family]
    config = getattr(transformers, cfg_cls)(**_TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF ones the norms and zeroes the biases: randomise so every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_checkpoint_logits_equal_transformers(family, tmp_path):
    from modelcarve.runtime.checkpoint.hf_load import load_model

    hf = save_tiny_moe(family, tmp_path)
    ours, spec = load_model(str(tmp_path))
    assert spec.family == family and spec.is_moe
    # qwen3_moe (mlp_only_layers) and deepseek (first_k_dense_replace) keep one dense layer
    assert spec.num_moe_layers == (3 if family == "mixtral" else 2)
    if family == "deepseek_v3":  # the balancing bias is loaded with the weights
        loaded = ours.layers["1"].feed_forward.router.e_score_correction_bias
        assert torch.equal(loaded, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = torch.randint(0, _TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() <= 1e-5


def test_bad_ep_is_refused_before_launch():
    from modelcarve.spec.support import check_training as check_runtime
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.layout import Layout

    spec = get_model("tiny-moe")
    check_runtime(Layout.parse("dp=2,ep=2,fsdp,seq=16"), spec, world_size=2)
    with pytest.raises(LayoutError, match="divide 8 experts"):
        check_runtime(Layout.parse("dp=3,ep=3,seq=16"), spec, world_size=3)


def test_router_is_fp32_under_autocast():
    spec = get_model("tiny-moe")
    router = build_model(spec, seed=0).layers["0"].feed_forward.router
    x = torch.randn(16, spec.hidden_size)
    want = torch.nn.functional.linear(x, router.weight).softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        indices, weights, scores = router(x)
    assert scores.dtype == torch.float32 and weights.dtype == torch.float32
    torch.testing.assert_close(scores, want, atol=1e-6, rtol=0)


def test_recomputed_forward_is_counted_once():
    from torch.utils.checkpoint import checkpoint

    spec = get_model("tiny-moe")
    moe = build_model(spec, seed=0).layers["0"].feed_forward
    moe.capacity_factor = 0.75
    x = torch.randn(2, 12, spec.hidden_size, requires_grad=True)
    moe(x).sum().backward()
    plain = (moe.tokens_per_expert.clone(), int(moe.dropped_tokens))
    grad = x.grad.clone()
    moe.reset_counts()
    x.grad = None
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the forward runs again in backward
    assert torch.equal(moe.tokens_per_expert, plain[0]) and int(moe.dropped_tokens) == plain[1] > 0
    torch.testing.assert_close(x.grad, grad)


def test_cli_refuses_bad_ep_before_launch(capsys):
    from modelcarve.cli import main

    code = main(["verify", "--model", "tiny-moe", "--layout", "dp=2,ep=4,seq=16", "--moe-capacity-factor", "1"])
    assert code == 2 and "ep=4 must divide dp x cp = 2" in capsys.readouterr().err
