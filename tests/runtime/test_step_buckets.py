"""Step bucketing (paged_attention.bucket / StepShape): every forward runs at a shape from a fixed set,
and the padding never changes a request's tokens nor touches a request's KV blocks.

* ``bucket``: powers of two to 32, then also 1.5x each power of two; never below ``n``, at most
  2x it (1.5x above 32); negative sizes refused;
* a ``StepContext`` of a mixed step: padded sizes, padding tokens at position 0 writing the
  scratch slot 0 only, the real rows packed first;
* one engine (tiny llama, one process) over a varied mix (64 prompts of 1..64 tokens, 1..32 new
  tokens, some with logprobs, arriving at different steps, a budget that chunks prefills): every
  forward's (tokens, sequences, query rows, key length, LM-head rows) is in the bucket set, every
  padding slot is in block 0, the shapes are few, and tokens equal those of an unbucketed engine
  (logprobs to 1e-5).
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import save_hf

SET = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024}
BS = 16


def test_bucket_set():
    from modelcarve.runtime.engine.paged_attention import bucket

    assert bucket(0) == 0
    for n in range(1, 1025):
        b = bucket(n)
        assert b in SET and b >= n and b < 2 * n + 1 and (n <= 32 or b <= 1.5 * n), (n, b)
    with pytest.raises(ValueError, match="must be >= 0"):
        bucket(-1)


def test_step_context_padding():
    from modelcarve.runtime.engine.paged_attention import StepContext

    seqs = [(0, 21, [3, 4]), (40, 1, [5, 6, 7]), (5, 9, [8])]  # 31 tokens, 3 sequences, Q 21, 3 blocks
    ctx = StepContext(seqs, BS, buckets=True)
    assert (ctx.num_tokens, ctx.real_tokens, ctx.num_seqs, ctx.q_pos.shape[1], ctx.key_len) == (32, 31, 4, 32, 64)
    assert ctx.positions[31:].tolist() == [0] and ctx.slot_mapping[31:].tolist() == [0]
    plain = StepContext(seqs, BS)
    assert torch.equal(ctx.slot_mapping[:31], plain.slot_mapping)
    assert torch.equal(ctx.positions[:31], plain.positions)
    decode = StepContext([(40, 1, [5, 6, 7]), (17, 1, [9, 10])], BS, buckets=True)
    assert (decode.num_tokens, decode.num_seqs, decode.key_len) == (2, 2, 64)
    decode = StepContext([(40, 1, [5, 6, 7]), (17, 1, [9, 10]), (2, 1, [11])], BS, buckets=True)
    assert decode.num_seqs == 4 and decode.slot_mapping[3].item() == 0 and decode.positions[3].item() == 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("buckets") / "llama"
    save_hf("LlamaConfig", "LlamaForCausalLM", path, seed=7, max_position_embeddings=128)
    return str(path)


def _mix(engine, record: list | None = None):
    """A varied request mix, some arriving later; final (tokens, logprobs) by request id."""
    from modelcarve.runtime.engine.sampler import SamplingParams

    rng = random.Random(11)
    reqs = []
    for i in range(64):
        prompt = [rng.randrange(128) for _ in range(rng.randint(1, 64))]
        params = SamplingParams(max_tokens=rng.randint(1, 32), temperature=0, ignore_eos=True, logprobs=i % 3 == 0)
        reqs.append((rng.randrange(60), f"r{i}", prompt, params))
    final, step = {}, 0
    while len(final) < len(reqs):
        for at, rid, prompt, params in reqs:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = (out.token_ids, out.logprobs)
        step += 1
        assert step < 2000
    return final


def test_engine_shapes_in_the_bucket_set(ckpt, monkeypatch):
    from modelcarve.runtime.engine import paged_attention
    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.parallel import tensor

    def engine(buckets):
        return Engine(EngineConfig(model=ckpt, layout="tp=1,param_dtype=fp32", kv_cache_bytes=1 << 21,
                                   max_num_batched_tokens=48, max_num_seqs=12, step_buckets=buckets))

    plain = _mix(engine(False))

    shapes, heads, plain_shapes = [], [], set()
    real_init = paged_attention.StepContext.__init__
    real_vocab = tensor.full_vocab_logits

    def init(self, seqs, block_size, device="cpu", buckets=False):
        real_init(self, seqs, block_size, device, buckets)
        plain_shapes.add(paged_attention.StepShape.of([q for _, q, _ in seqs],
                                                      -(-max(s + q for s, q, _ in seqs) // block_size), False))
        shapes.append((self.num_tokens, self.num_seqs, self.q_pos.shape[1], self.key_len // block_size,
                       self.slot_mapping[self.real_tokens:].tolist(), self.num_seqs - len(seqs)))

    def vocab(logits, chunk):
        heads.append(logits.shape[1])
        return real_vocab(logits, chunk)

    monkeypatch.setattr(paged_attention.StepContext, "__init__", init)
    monkeypatch.setattr(tensor, "full_vocab_logits", vocab)
    bucketed = _mix(engine(True))

    assert shapes and heads
    for tokens, seqs, queries, blocks, padding_slots, _ in shapes:
        assert {tokens, seqs, queries, blocks} <= SET, (tokens, seqs, queries, blocks)
        assert all(0 <= s < BS for s in padding_slots), "a padding token wrote outside the scratch block 0"
    assert set(heads) <= SET | {0}, sorted(set(heads))
    assert any(s[4] for s in shapes) and any(s[5] for s in shapes), "the mix never needed padding"
    distinct = {s[:4] for s in shapes}
    assert len(distinct) <= len(plain_shapes) // 2, (len(distinct), len(plain_shapes))

    assert set(bucketed) == set(plain)
    for rid, (tokens, logprobs) in plain.items():
        assert bucketed[rid][0] == tokens, rid
        if logprobs is not None:
            assert bucketed[rid][1] == pytest.approx(logprobs, abs=1e-5), rid
