"""Prompt and generated tokens' log-probabilities (echo + logprobs, top-k alternatives) equal
transformers' ``log_softmax(model(ids).logits.float())`` on the same checkpoint, on every layout.

Tiny fp32 checkpoints (tests/hf_tiny.py: llama with tied embeddings, gpt2 with a vocabulary of
263 that tp=2 pads, qwen3_moe for ep); three prompts of 5 / 17 / 30 tokens, each asked with
``prompt_logprobs`` and ``top_logprobs=5``, once with ``max_tokens=0`` (the prompt only, finish
"length") and once with ``max_tokens=3`` (greedy), beside one request that asks nothing (it must
generate what it generates alone). ``max_num_batched_tokens=8`` cuts the prompts into chunks, so
a chunk's last row predicts the first token of the next chunk. The same prompts twice also check
that a request asking for prompt logprobs takes nothing from the prefix cache.

Tolerance 1e-5 (fp32; both sides compute the same arithmetic up to summation order): every prompt
token's logprob (the first is None), every generated token's, and the top-5 (ids in order, their
logprobs) at every position. Layouts: one device here; tp=2, pp=2, dp=2 and dp=2,ep=2 in one
2-rank gloo world (tests/dist.py).
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from hf_tiny import save_hf

FP32 = "param_dtype=fp32"
K = 5
TOL = 1e-5
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        base=dict(vocab_size=263, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=24, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprob_ckpts")
    out = {}
    for name, (cfg, cls, extra) in MODELS.items():
        extra = dict(extra)
        base = extra.pop("base", None)
        hf = save_hf(cfg, cls, root / name, base=base, **extra)
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 30)]
        out[name] = (str(root / name), prompts, hf)
    return out


def _params():
    from modelcarve.runtime.engine.sampler import SamplingParams

    echo0 = SamplingParams(max_tokens=0, temperature=0, logprobs=True, top_logprobs=K, prompt_logprobs=True)
    echo3 = SamplingParams(max_tokens=3, temperature=0, logprobs=True, top_logprobs=K, prompt_logprobs=True,
                           ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    return echo0, echo3, plain


def run_requests(path: str, layout: str, prompts) -> list | None:
    """Every rank: an engine for ``layout``; rank 0 runs each prompt with echo0 and echo3 (and the
    first twice more: plain, then echo3 again, after its blocks are in the prefix cache)."""
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=path, layout=layout, kv_cache_bytes=1 << 21, max_num_batched_tokens=8))
    if not engine.is_driver:
        engine.follow()
        return None
    echo0, echo3, plain = _params()
    reqs = [(p, echo0) for p in prompts] + [(p, echo3) for p in prompts] + [(prompts[2], plain)]
    outs = engine.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    again = engine.generate([prompts[2]], [echo3])  # its prompt's blocks are cached by now
    engine.shutdown()
    keep = ("token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "finish_reason",
            "num_cached_tokens")
    return [{k: getattr(o, k) for k in keep} for o in outs + again] + [engine.stats().to_dict()]


def _worker(cases):
    import torch.distributed as dist

    results = {}
    for name, layout, path, prompts in cases:
        results[(name, layout)] = run_requests(path, layout, prompts)
        dist.barrier()
    return results


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check(outs, prompts, hf) -> float:
    """Assert every logprob and top-5 against transformers; returns the largest |difference|."""
    worst = 0.0
    n = len(prompts)
    reqs = [(p, 0) for p in prompts] + [(p, 3) for p in prompts]
    plain = outs[2 * n]
    for (prompt, new), out in zip(reqs + [(prompts[2], 3)], outs[:2 * n] + [outs[2 * n + 1]]):
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == new
        ids = prompt + out["token_ids"]
        ref = _reference(hf, ids)
        lps = out["prompt_logprobs"] + out["logprobs"]
        tops = out["prompt_top_logprobs"] + out["top_logprobs"]
        assert len(lps) == len(ids) == len(tops) and lps[0] is None and tops[0] is None
        for pos in range(1, len(ids)):
            row = ref[pos - 1]
            worst = max(worst, abs(lps[pos] - row[ids[pos]].item()))
            want = torch.topk(row, K)
            got_ids = [i for i, _ in tops[pos]]
            assert got_ids == want.indices.tolist(), (pos, got_ids, want.indices.tolist())
            worst = max(worst, max(abs(v - w) for (_, v), w in zip(tops[pos], want.values.tolist())))
        if new:  # greedy: the generated tokens are transformers' argmax
            assert out["token_ids"] == [ref[len(prompt) - 1 + j].argmax().item() for j in range(new)]
    assert plain["prompt_logprobs"] is None and plain["logprobs"] is None
    assert plain["token_ids"] == outs[2 * n - 1]["token_ids"]
    assert outs[2 * n + 1]["num_cached_tokens"] == 0  # echo never takes cached blocks
    assert worst <= TOL, worst
    return worst


def test_single_device_equals_transformers(ckpts):
    worst = 0.0
    for name, (path, prompts, hf) in ckpts.items():
        outs = run_requests(path, f"tp=1,{FP32}", prompts)
        worst = max(worst, check(outs, prompts, hf))
    print(f"max |logprob - transformers| one device: {worst:.3g}")


def test_max_tokens_at_least_zero():
    from modelcarve.runtime.engine.sampler import SamplingParams

    for bad in (dict(max_tokens=-1), dict(max_tokens=1, top_logprobs=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(max_tokens=0)


def test_two_ranks_equal_transformers(ckpts):
    cases = []
    for name, (path, prompts, _) in ckpts.items():
        layouts = [f"tp=2,{FP32}", f"pp=2,{FP32}", f"dp=2,{FP32}"]
        if name == "qwen3_moe":
            layouts.append(f"dp=2,ep=2,{FP32}")
        cases += [(name, lay, path, prompts) for lay in layouts]
    results = run_distributed(_worker, 2, cases, timeout=900)[0]
    worst = 0.0
    for name, layout, _, prompts in cases:
        *outs, stats = results[(name, layout)]
        worst = max(worst, check(outs, prompts, ckpts[name][2]))
        # only the packed rows come back: a chosen logprob and 5 (id, logprob) pairs, not V logits
        # (18 sampling rows of V logits at most; 127 prompt rows of 1 + 2 x 5 floats)
        assert stats["logit_bytes"] <= 4 * (18 * ckpts[name][2].config.vocab_size + 11 * 127), (name, layout, stats)
    print(f"max |logprob - transformers| on two ranks: {worst:.3g}")


def test_four_ranks_equal_transformers(ckpts):
    """tp=2 x pp=2 (the packed rows come from the last stage's tp-rank 0), and tp=2 x ep=2 for MoE."""
    cases = [(name, f"tp=2,pp=2,{FP32}", path, prompts) for name, (path, prompts, _) in ckpts.items()]
    path, prompts, _ = ckpts["qwen3_moe"]
    cases.append(("qwen3_moe", f"tp=2,dp=2,ep=2,{FP32}", path, prompts))
    results = run_distributed(_worker, 4, cases, timeout=900)[0]
    worst = 0.0
    for name, layout, _, prompts in cases:
        *outs, _stats = results[(name, layout)]
        worst = max(worst, check(outs, prompts, ckpts[name][2]))
    print(f"max |logprob - transformers| on four ranks: {worst:.3g}")
