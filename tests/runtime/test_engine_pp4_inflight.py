"""pp=4 serving keeps several micro-batches of different requests in flight across engine steps.

Four real gloo ranks (one pipeline stage each), a tiny 4-layer llama the test saves itself
(tests/hf_tiny.py, ``save_pretrained`` of a random config; nothing downloaded), 16 requests of
3..24-token prompts wanting 16 greedy tokens each:

* every output equals transformers' ``generate(do_sample=False)``, token for token;
* the micro-batches in flight never share a request (checked after every step), and up to four
  are in flight at once (``stats().max_in_flight``);
* the engine's own step records show the pipeline: rank 0 launches micro-batch k+1 in a later
  ``step()`` than k and before k's logits are back (``flights``), stage 0 starts k+1 before the
  last stage ends k, and when the last stage ends k, often two or three later micro-batches have
  already entered stage 0 (``forwards`` of the four ranks, one ``time.monotonic`` clock on one
  machine: a pipeline four deep, not the two-deep one pp=2 shows);
* every KV block is free at the end and every rank process has exited (``run_distributed`` joins
  or kills them; checked below).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from dist import run_distributed
from hf_tiny import save_hf

NEW = 16
N = 16
PP = 4
LAYOUT = f"pp={PP},param_dtype=fp32"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp4_inflight") / "llama"
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", path, seed=4, num_hidden_layers=PP)
    hf.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, hf.config.vocab_size, (3 + (7 * i) % 22,), generator=gen).tolist() for i in range(N)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            refs.append(ids[0, len(p):].tolist())
    return str(path), prompts, refs


def _worker(path, prompts):
    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.engine.sampler import SamplingParams

    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    engine = Engine(EngineConfig(model=path, layout=LAYOUT, kv_cache_bytes=1 << 21))
    out = {}
    if engine.is_driver:
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, greedy)
        final, steps = {}, 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
            busy = [item.seq.request_id for entry in engine._inflight for items in entry[0] for item in items]
            assert len(busy) == len(set(busy)), f"a request in two micro-batches in flight: {busy}"
            steps += 1
            assert steps < 50 * NEW, "the engine does not finish"
        out["outputs"] = [final[f"p{i}"].token_ids for i in range(N)]
        out["stats"] = engine.stats().to_dict()
        out["records"] = engine.step_records()
        engine.shutdown()
    else:
        engine.follow()
        out["records"] = engine.step_records()
    return out


def _depths(first: dict, last: dict) -> list[int]:
    """Per micro-batch k, how many micro-batches were inside the pipeline when the last stage ended
    k: k itself and every later one stage 0 had already started (its forwards' start times)."""
    return [1 + sum(1 for j in first if j > k and first[j]["start"] < last[k]["end"]) for k in sorted(last)]


def test_pp4_inflight_across_steps(case):
    path, prompts, refs = case
    ranks = run_distributed(_worker, PP, path, prompts, timeout=600)
    assert not multiprocessing.active_children(), "a rank process outlived the test"
    rank0 = ranks[0]

    assert rank0["outputs"] == refs
    stats = rank0["stats"]
    assert stats["max_in_flight"] == PP and stats["generation_tokens"] == N * NEW, stats
    assert stats["kv_blocks_used"] == 0

    flights = sorted(rank0["records"]["flights"], key=lambda f: f["mb"])
    across = [(a["mb"], b["mb"]) for a, b in zip(flights, flights[1:])
              if b["step"] > a["step"] and b["launched"] < a["retired"]]
    assert len(across) > len(flights) // 2, (len(across), len(flights))

    stage = [{r["mb"]: r for r in rank["records"]["forwards"]} for rank in ranks]
    for pp, records in enumerate(stage):
        assert {r["pp"] for r in records.values()} == {pp}
        assert set(records) == {f["mb"] for f in flights}, f"stage {pp} did not run every micro-batch"
    # stage 0 starts k+1 (a later step) before the last stage ends k
    overlap = [k for k in sorted(stage[0]) if k + 1 in stage[0] and stage[0][k + 1]["step"] > stage[0][k]["step"]
               and stage[0][k + 1]["start"] < stage[-1][k]["end"]]
    assert len(overlap) > len(flights) // 4, (len(overlap), len(flights))
    # deeper than pp=2 can be: up to pp micro-batches inside the four stages at once
    depths = _depths(stage[0], stage[-1])
    assert max(depths) == PP and sum(d >= 3 for d in depths) > len(depths) // 4, depths
