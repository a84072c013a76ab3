"""Shared pieces of the engine tests: tiny checkpoints of every family, transformers' greedy
references, and a driver that submits prompts at different steps.

The checkpoints (tests/hf_tiny.py, weights std 0.2 so the tokens depend on the prompt, the
positions and the cache) cover: llama with tied embeddings and llama3 rope scaling past its
original 16 positions; qwen3 with ONE kv head (tp=2 replicates it); mistral with a sliding
window of 8 (< every prompt but the first); qwen3_moe (a dense second layer); mixtral;
deepseek_v3 (MLA, dense first layer, sigmoid group-limited routing); gpt2 (learned positions,
vocabulary 263, which tp=2 pads).
"""

from __future__ import annotations

import torch

from hf_tiny import save_hf

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 30)
SUBMIT_AT = (0, 2, 5)
"""Engine step at which each prompt is added (continuous batching: they join mid-flight)."""

CKPTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=24, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=48, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        base=dict(vocab_size=263, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))),
}
MOE = ("qwen3_moe", "mixtral", "deepseek_v3")


def build_all(root) -> dict:
    """{name: (path, prompts, transformers' greedy continuations)} for every family."""
    out = {}
    for name, (cfg, cls, extra) in CKPTS.items():
        path = root / name
        extra = dict(extra)
        base = extra.pop("base", None)
        hf = save_hf(cfg, cls, path, base=base, **extra)
        vocab = hf.config.vocab_size
        gen = torch.Generator().manual_seed(len(name))
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        refs = []
        # ignore_eos on our side: transformers must neither stop at nor ban (min_new_tokens) the EOS id
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            for p in prompts:
                ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)
                refs.append(ids[0, len(p):].tolist())
        out[name] = (str(path), prompts, refs)
    return out


def drive(engine, prompts, params, submit_at=SUBMIT_AT) -> list[list[int]]:
    """Rank 0: add prompt i at step ``submit_at[i]``, step until all finish; generated ids in order."""
    done: dict[int, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(submit_at):
            if at == step:
                engine.add_request(f"p{i}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.token_ids
        step += 1
        assert step < 10 * (NEW_TOKENS + max(submit_at) + 10), "the engine does not finish"
    return [done[i] for i in range(len(prompts))]


def greedy():
    from modelcarve.runtime.engine.sampler import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def run_layouts(ckpts: dict, layouts: list[tuple[str, str]], kv_cache_bytes: int = 1 << 21) -> dict:
    """On every rank: build an engine per (model, layout), rank 0 drives, the others follow.
    Returns (rank 0) {(model, layout): (outputs, stats dict (with ``fused_blocks``: rank 0's layers
    run as engine/fused.py ``FusedBlock``; ``shm`` / ``shm_calls``: why its TP group's collectives
    did not go through shared memory (None: they did) and how many did), KV bytes per token)}."""
    import torch.distributed as dist

    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.engine.fused import FusedBlock

    results = {}
    for name, layout in layouts:
        path, prompts, _ = ckpts[name]
        engine = Engine(EngineConfig(model=path, layout=layout, kv_cache_bytes=kv_cache_bytes))
        if engine.is_driver:
            outs = drive(engine, prompts, greedy())
            engine.shutdown()
            stats = engine.stats().to_dict()
            stats["fused_blocks"] = sum(isinstance(b, FusedBlock) for b in engine.runner.blocks)
            stats["shm"], stats["shm_calls"] = engine.runner.shm, engine.runner.shm_calls
            results[(name, layout)] = (outs, stats, engine.runner.bytes_per_token)
        else:
            engine.follow()
        dist.barrier()
    return results
