"""Pipeline-parallel serving keeps micro-batches of different requests in flight across engine steps.

pp=2 on two real gloo ranks, a tiny llama (tests/hf_tiny.py), 16 requests of 3..24-token prompts
wanting 20 greedy tokens each:

* every output equals transformers' ``generate(do_sample=False)``, token for token, with a KV
  budget that holds them all and with one so small that the scheduler preempts (recompute);
* the micro-batches in flight never share a request (checked after every step);
* the engine's own step records show the pipeline across steps: rank 0 launches micro-batch k+1
  in a later ``step()`` than k and before k's logits are back (``flights``), and stage 0's
  forward of k+1 starts before the last stage's forward of k ends (``forwards`` of both ranks, one
  ``time.monotonic`` clock on one machine);
* an abort of a request whose micro-batch is in flight, ``max_tokens=0``, a stop token and an idle
  heartbeat keep working, and every KV block is free at the end.
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from hf_tiny import save_hf

NEW = 20
N = 16
LAYOUT = "pp=2,param_dtype=fp32"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp_inflight") / "llama"
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", path, seed=3)
    hf.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.config.vocab_size, (3 + (7 * i) % 22,), generator=gen).tolist() for i in range(N)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            refs.append(ids[0, len(p):].tolist())
    return str(path), prompts, refs


def _run(engine, prompts, params, extra=None):
    """Rank 0: all prompts at once (plus ``extra(engine, step)`` each step); final outputs by id."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    final, step = {}, 0
    while engine.has_unfinished():
        if extra:
            extra(engine, step)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        busy = [item.seq.request_id for entry in engine._inflight for items in entry[0] for item in items]
        assert len(busy) == len(set(busy)), f"a request in two micro-batches in flight: {busy}"
        step += 1
        assert step < 50 * NEW, "the engine does not finish"
    return final


def _worker(path, prompts):
    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.engine.sampler import SamplingParams

    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    out = {}
    # 1. plenty of KV: outputs, records, abort in flight, max_tokens=0, stop id, heartbeat
    engine = Engine(EngineConfig(model=path, layout=LAYOUT, kv_cache_bytes=1 << 21))
    if engine.is_driver:
        final = _run(engine, prompts, greedy)
        out["outputs"] = [final[f"p{i}"].token_ids for i in range(N)]
        out["stats"] = engine.stats().to_dict()
        out["records"] = engine.step_records()
        aborted = {}

        def abort_when_in_flight(eng, step):
            if "at" not in aborted and any(item.seq.request_id == "x" for e in eng._inflight
                                           for items in e[0] for item in items):
                eng.abort("x")
                aborted["at"] = len(eng.seqs["x"].output)

        engine.add_request("x", prompts[0], SamplingParams(max_tokens=10 * NEW, temperature=0, ignore_eos=True))
        engine.add_request("zero", prompts[1], SamplingParams(max_tokens=0, temperature=0))
        stop_tok = out["outputs"][2][5]
        engine.add_request("stop", prompts[2], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                              stop_token_ids=(stop_tok,)))
        final = _run(engine, prompts[3:5], greedy, abort_when_in_flight)
        out["abort"] = (final["x"].finish_reason, len(final["x"].token_ids), aborted.get("at"))
        out["zero"] = (final["zero"].finish_reason, final["zero"].token_ids)
        out["stop"] = (final["stop"].finish_reason, final["stop"].stop_reason, final["stop"].token_ids)
        out["after_abort"] = [final[f"p{i}"].token_ids for i in range(2)]
        engine._last_plan = 0.0  # the next idle step is due a heartbeat (an empty plan to the followers)
        assert engine.step() == [] and engine._last_plan > 0.0
        out["after_heartbeat"] = _run(engine, prompts[:1], greedy)["p0"].token_ids
        out["blocks_used"] = engine.stats().kv_blocks_used
        engine.shutdown()
    else:
        engine.follow()
        out["records"] = engine.step_records()
    torch.distributed.barrier()
    # 2. a KV budget of 20 blocks for 16 requests of up to 3 blocks each: preemption and recompute
    engine = Engine(EngineConfig(model=path, layout=LAYOUT, kv_cache_bytes=21 * 16 * 256))
    if engine.is_driver:
        final = _run(engine, prompts, greedy)
        out["tight"] = [final[f"p{i}"].token_ids for i in range(N)]
        out["tight_stats"] = engine.stats().to_dict()
        engine.shutdown()
    else:
        engine.follow()
    return out


def test_pp2_inflight_across_steps(case):
    path, prompts, refs = case
    rank0, rank1 = run_distributed(_worker, 2, path, prompts, timeout=600)

    assert rank0["outputs"] == refs
    stats = rank0["stats"]
    assert stats["max_in_flight"] == 2 and stats["generation_tokens"] == N * NEW, stats

    # rank 0's flights: micro-batch k+1 launched in a later step() and before k was retired
    flights = sorted(rank0["records"]["flights"], key=lambda f: f["mb"])
    across = [(a["mb"], b["mb"]) for a, b in zip(flights, flights[1:])
              if b["step"] > a["step"] and b["launched"] < a["retired"]]
    assert len(across) > len(flights) // 2, (len(across), len(flights))
    # the stages' own forwards: stage 0 starts k+1 before the last stage ends k, across steps
    first = {r["mb"]: r for r in rank0["records"]["forwards"]}
    last = {r["mb"]: r for r in rank1["records"]["forwards"]}
    assert {r["pp"] for r in first.values()} == {0} and {r["pp"] for r in last.values()} == {1}
    # (rank 1's records also hold the later abort/heartbeat part; rank 0's were taken before it)
    assert set(first) == {f["mb"] for f in flights} and set(first) <= set(last)
    overlap = [k for k in sorted(first) if k + 1 in first and first[k + 1]["step"] > first[k]["step"]
               and first[k + 1]["start"] < last[k]["end"]]
    assert overlap, "stage 0 never ran a micro-batch while the last stage was still on the previous one"

    reason, n, at = rank0["abort"]
    assert reason == "abort" and at is not None and n < 10 * NEW
    assert rank0["zero"] == ("length", [])
    assert rank0["stop"] == ("stop", refs[2][5], refs[2][:refs[2].index(refs[2][5]) + 1])
    assert rank0["after_abort"] == refs[3:5]
    assert rank0["after_heartbeat"] == refs[0]
    assert rank0["blocks_used"] == 0

    assert rank0["tight"] == refs
    assert rank0["tight_stats"]["preemptions"] > 0 and rank0["tight_stats"]["kv_blocks_used"] == 0
