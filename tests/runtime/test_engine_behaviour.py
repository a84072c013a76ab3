"""The engine's scheduling and sampling on one device: preemption, prefix caching, sampling
options, log-probabilities against transformers, the tokenizer, and the KV arithmetic against
the planner's.

Oracles: transformers' own logits (logprobs), transformers' tokenizer (encode / decode, chat
template), the planner's KV bytes per token (plan/serve/memory.py, written independently from
the model's spec), and the engine's own solo runs for properties that must not depend on
batching (preemption, prefix caching, seeds).
"""

from __future__ import annotations

import pytest
import torch

from engine_cases import drive, greedy
from hf_tiny import save_hf

NEW = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", path, tie_word_embeddings=True)
    return str(path), hf


def _engine(path, **kw):
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    kw.setdefault("kv_cache_bytes", 1 << 21)
    return Engine(EngineConfig(model=path, layout=kw.pop("layout", "param_dtype=fp32"), **kw))


def _prompts(n, lo, hi, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _params(i):
    """Requests 0, 2, 4, 6 greedy; 1, 3, 5, 7 sampled with their own seed."""
    from modelcarve.runtime.engine.sampler import SamplingParams

    if i % 2 == 0:
        return greedy()
    return SamplingParams(max_tokens=NEW, temperature=0.8, top_k=40, top_p=0.9, seed=100 + i, ignore_eos=True)


def test_preemption_keeps_every_output(llama):
    """A KV budget for two requests, eight at once: all finish, each with the tokens it gives alone."""
    path, _ = llama
    prompts = _prompts(8, 8, 23)
    solo = [_engine(path).generate([p], _params(i))[0].token_ids for i, p in enumerate(prompts)]
    per_token = _engine(path).runner.bytes_per_token
    blocks = 2 * -(-(22 + NEW) // 16) + 1  # two of the longest requests, plus the scratch block
    engine = _engine(path, kv_cache_bytes=blocks * 16 * per_token)
    assert engine.num_blocks == blocks
    outs = engine.generate(prompts, [_params(i) for i in range(8)])
    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0


def test_prefix_caching_same_tokens(llama):
    """Requests sharing a 40-token prefix: the same tokens with and without the prefix cache, and
    the cache serves the two full blocks (32 tokens) of the prefix to each later request."""
    path, _ = llama
    prefix = _prompts(1, 40, 41, seed=3)[0]
    prompts = [prefix + s for s in _prompts(3, 4, 9, seed=4)]
    results = {}
    for on in (True, False):
        engine = _engine(path, prefix_caching=on)
        first = engine.generate(prompts[:1], greedy())[0]
        rest = engine.generate(prompts[1:], greedy())
        results[on] = [first.token_ids] + [o.token_ids for o in rest]
        hits = [o.num_cached_tokens for o in rest]
        assert hits == ([32, 32] if on else [0, 0])
        assert engine.stats().prefix_cache_hits == (64 if on else 0)
    assert results[True] == results[False]


def test_sampling_options(llama):
    from modelcarve.runtime.engine.sampler import SamplingParams

    path, _ = llama
    engine = _engine(path)
    p = _prompts(1, 10, 11, seed=5)[0]
    base = engine.generate([p], greedy())[0].token_ids
    top1 = engine.generate([p], SamplingParams(max_tokens=NEW, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == base
    seeded = SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True)
    a = engine.generate([p], seeded)[0].token_ids
    b = engine.generate([p, _prompts(1, 5, 6)[0]], [seeded, greedy()])[0].token_ids  # batched: same draws
    assert a == b and a != base
    stop_id = base[5]
    first = base.index(stop_id)
    out = engine.generate([p], SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    out = engine.generate([p], SamplingParams(max_tokens=NEW, temperature=0, stop_token_ids=[stop_id],
                                              min_tokens=first + 2))[0]
    assert len(out.token_ids) >= first + 2 and stop_id not in out.token_ids[:first + 2]
    short = engine.generate([p], SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.token_ids == base[:3] and short.finish_reason == "length"


def test_logprobs_equal_transformers(llama):
    """Our logprobs of the greedy tokens vs log_softmax of transformers' logits: the logits agree
    to 1e-5 (tests/runtime/test_runtime_checkpoint.py), so the log-softmax to 2e-5."""
    from modelcarve.runtime.engine.sampler import SamplingParams

    path, hf = llama
    p = _prompts(1, 12, 13, seed=6)[0]
    out = _engine(path).generate([p], SamplingParams(max_tokens=8, temperature=0, logprobs=True, ignore_eos=True))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1]
    ref = torch.log_softmax(logits, -1)[torch.arange(8), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=2e-5)


def test_kv_bytes_equal_planner(llama):
    """Bytes per token and block count at start-up = the planner's KV arithmetic (fp32, bf16), and
    int8 / fp8 = the planner's 1 byte per element plus one fp16 scale per head vector."""
    from modelcarve.plan.serve.memory import shard_facts

    path, _ = llama
    for kv in ("fp32", "bf16", "int8", "fp8"):
        engine = _engine(path, layout=f"param_dtype=fp32,kv_dtype={kv}", kv_cache_bytes=1 << 20)
        planned = shard_facts(engine.spec, tp=1, kv_dtype=kv).kv_bytes_per_token
        scales = 1 + 2 / engine.spec.head_dim if kv in ("int8", "fp8") else 1
        assert engine.runner.bytes_per_token == pytest.approx(planned * scales, rel=1e-12)
        assert engine.num_blocks == (1 << 20) // (16 * engine.runner.bytes_per_token)
        assert engine.runner.cache.nbytes() == engine.num_blocks * 16 * engine.runner.bytes_per_token


def test_tokenizer_text_and_stop_strings(tmp_path):
    """A BPE trained here and saved beside the checkpoint: encode/decode as transformers' tokenizer,
    incremental text == decode(all ids), a stop string cuts the text before it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from modelcarve.runtime.engine.sampler import SamplingParams

    text = open(__file__).read() * 3
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, vocab_size=tok.get_vocab_size(), bos_token_id=1,
            eos_token_id=2)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(tmp_path)
    ref = AutoTokenizer.from_pretrained(tmp_path)
    engine = _engine(str(tmp_path))
    prompt = "def test_tokenizer(self):"
    ids = engine.tokenizer.encode(prompt)
    assert ids == ref(prompt)["input_ids"]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ref.decode(chat) == "user: hi\nassistant:"
    out = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert out.text == ref.decode(out.token_ids, skip_special_tokens=True) and len(out.text) > 6
    stop = out.text[4:6]
    cut = out.text.find(stop)
    stopped = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop and stopped.text == out.text[:cut]
    assert stopped.token_ids == out.token_ids[:len(stopped.token_ids)]


def test_refusals(llama):
    from modelcarve.runtime.engine.sampler import SamplingParams
    from modelcarve.spec.errors import ModelcarveError

    path, _ = llama
    engine = _engine(path, kv_cache_bytes=3 * 16 * 512)  # 2 usable blocks = 32 tokens
    with pytest.raises(ModelcarveError, match="context is 64"):
        engine.add_request("a", [1] * 64, greedy())
    with pytest.raises(ModelcarveError, match="budget holds 32"):
        engine.add_request("b", [1] * 20, SamplingParams(max_tokens=20))
    with pytest.raises(ModelcarveError, match="vocabulary|must be in"):
        engine.add_request("c", [500], greedy())
    with pytest.raises(ModelcarveError, match="tokenizer"):
        engine.add_request("d", [1], SamplingParams(stop=["x"]))
    engine.add_request("e", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    engine.abort("e")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("e", "abort")]
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
