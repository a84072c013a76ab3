"""Tiny random Hugging Face checkpoints for oracle tests, with weights scaled up.

With transformers' default init (std 0.02) a tiny model's logits hardly depend on the positions,
so a wrong rope or window would still match; ``save_hf`` draws every matrix with std ``std``
(default 0.2) and perturbs norms and biases, then saves with ``save_pretrained``.

    from hf_tiny import save_hf
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, rope_scaling={...})
"""

from __future__ import annotations

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def save_hf(config_cls: str, model_cls: str, path, *, std: float = 0.2, seed: int = 0, base: dict | None = None,
            **overrides):
    """Build ``model_cls(config_cls(**TINY | overrides))`` with std-``std`` weights, save it to
    ``path`` (safetensors + config.json) and return the model in eval mode."""
    import transformers

    config = getattr(transformers, config_cls)(**((TINY if base is None else base) | overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise * std)
            else:  # norms (around 1) and biases: perturbed so that every tensor matters
                p.add_(noise * 0.05)
    model.save_pretrained(path)
    return model


GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96, bos_token_id=0, eos_token_id=0)
"""A tiny gpt2: learned positions, LayerNorm, GELU MLP, biases everywhere."""


def save_biased(root) -> None:
    """The two tiny checkpoints with biases the against-plan tests share: ``root/gpt2`` (``GPT2``) and
    ``root/llama`` (attention and MLP biases, untied embeddings)."""
    save_hf("GPT2Config", "GPT2LMHeadModel", root / "gpt2", base=GPT2)
    save_hf("LlamaConfig", "LlamaForCausalLM", root / "llama", attention_bias=True, mlp_bias=True,
            tie_word_embeddings=False)


def logits_diff(ours, hf, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()
