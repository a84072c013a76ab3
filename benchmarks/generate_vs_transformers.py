"""Our generation engine against transformers' ``generate`` on one CPU process, same weights, same run.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/generate_vs_transformers.py \\
        --out benchmarks/results/generate_vs_transformers.json

Model: a llama-shaped random checkpoint of ~110M parameters (hidden 768, 12 layers, 12 heads,
4 kv heads, ffn 2048, vocabulary 32000, tied embeddings), fp32, saved once with
``save_pretrained`` and loaded by both sides. One process, ``--threads`` torch threads.

* batch 1: one prompt of ``--prompt`` tokens, ``--new`` greedy tokens (EOS ignored on both
  sides); tokens/s = new tokens / wall time of the whole call (prefill included), and TPOT =
  (wall - time to first token) / (new - 1) for ours (the planner's definition).
* mixed 16: 16 prompts of 16..128 tokens each wanting 16..128 new tokens (seeded). Ours: all
  submitted at once, continuous batching, each request stopping at its own length.
  transformers: one left-padded static batch running to the longest output (the usual way to
  batch ``generate``); useful tokens/s = sum of the requested outputs / wall time for both.
* The two sides alternate (ours, transformers, ours, ...) for ``--rounds`` rounds, and the
  medians are compared, so a shared machine's load hits both alike; ``paired_ratios`` are the
  per-round ratios (transformers' wall / ours of the same round) and ``load_1min_per_round`` the
  1-minute load average at the start of each round.
* Memory-bandwidth bound of a batch-1 decode step: weight bytes / copy bandwidth, where the
  bandwidth is measured here by ``dst.copy_(src)`` on 256 MiB fp32 tensors, counting read +
  write bytes (the STREAM "copy" convention). The JSON gives our batch-1 TPOT over that bound.

Figures depend on the machine and its load; the JSON records the load averages before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-6)


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def ours_run(engine, prompts, lengths):
    from modelcarve.runtime.engine.sampler import SamplingParams

    t0 = time.perf_counter()
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    wall = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == list(lengths)
    first = min(o.first_token_time for o in outs) - t0
    return wall, first, [o.token_ids for o in outs]


def left_padded(prompts):
    """(ids, attention mask, longest) of a batch of token-id prompts, left-padded with 0 as
    decoder-only batching in transformers' ``generate`` needs."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    return ids, mask, longest


def hf_run(hf, prompts, lengths):
    ids, mask, longest = left_padded(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    return wall, [out[i, longest:longest + n].tolist() for i, n in enumerate(lengths)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/generate_vs_transformers.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mixed", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    from transformers import LlamaConfig, LlamaForCausalLM

    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    tmp = tempfile.mkdtemp(prefix="gen_bench_")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp)
    params = sum(p.numel() for p in hf.parameters())
    engine = Engine(EngineConfig(model=tmp, layout="param_dtype=fp32", kv_cache_bytes=1 << 30,
                                 max_num_batched_tokens=2048, max_num_seqs=64))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.chunk.parameters())
    gen = torch.Generator().manual_seed(1)
    single = [torch.randint(0, CONFIG["vocab_size"], (args.prompt,), generator=gen).tolist()]
    mixed = [torch.randint(0, CONFIG["vocab_size"], (int(torch.randint(16, 129, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in range(args.mixed)]
    mixed_new = [int(torch.randint(16, 129, (1,), generator=gen)) for _ in range(args.mixed)]
    ours_runs, hf_runs = {"b1": [], "mixed": []}, {"b1": [], "mixed": []}
    agree = {}
    ours_run(engine, single, [4])  # warm-up both
    hf_run(hf, single, [4])
    round_loads = []
    for _ in range(args.rounds):
        round_loads.append(os.getloadavg()[0])
        for key, prompts, lengths in (("b1", single, [args.new]), ("mixed", mixed, mixed_new)):
            wall, first, toks = ours_run(engine, prompts, lengths)
            ours_runs[key].append((wall, first))
            hwall, htoks = hf_run(hf, prompts, lengths)
            hf_runs[key].append(hwall)
            agree[key] = sum(a == b for a, b in zip(toks, htoks)) / len(toks)
    bw = copy_bandwidth()
    b1_wall = statistics.median(w for w, _ in ours_runs["b1"])
    b1_first = statistics.median(f for _, f in ours_runs["b1"])
    tpot = (b1_wall - b1_first) / (args.new - 1)
    bound = weight_bytes / bw
    useful = sum(mixed_new)
    result = {
        "model": {"params": params, "weight_bytes": weight_bytes, **CONFIG},
        "threads": args.threads, "rounds": args.rounds, "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
        "batch1": {"prompt": args.prompt, "new": args.new,
                   "ours_tok_s": args.new / b1_wall, "hf_tok_s": args.new / statistics.median(hf_runs["b1"]),
                   "ours_walls": [w for w, _ in ours_runs["b1"]], "hf_walls": hf_runs["b1"],
                   "ours_tpot_s": tpot, "bandwidth_bound_s": bound, "tpot_over_bound": tpot / bound,
                   "same_tokens_as_hf": agree["b1"]},
        "mixed": {"requests": args.mixed, "prompt_lens": [len(p) for p in mixed], "new_tokens": mixed_new,
                  "useful_tokens": useful,
                  "ours_tok_s": useful / statistics.median(w for w, _ in ours_runs["mixed"]),
                  "hf_static_tok_s": useful / statistics.median(hf_runs["mixed"]),
                  "ours_walls": [w for w, _ in ours_runs["mixed"]], "hf_walls": hf_runs["mixed"],
                  "same_tokens_as_hf": agree["mixed"]},
        "copy_bandwidth_bytes_s": bw,
    }
    result["batch1"]["ratio"] = result["batch1"]["ours_tok_s"] / result["batch1"]["hf_tok_s"]
    result["mixed"]["ratio"] = result["mixed"]["ours_tok_s"] / result["mixed"]["hf_static_tok_s"]
    result["load_1min_per_round"] = round_loads
    for key, out in (("b1", "batch1"), ("mixed", "mixed")):  # same-round pairs: a load change hits both sides
        pairs = [h / w for (w, _), h in zip(ours_runs[key], hf_runs[key])]
        result[out]["paired_ratios"] = pairs
        result[out]["paired_ratio_median"] = statistics.median(pairs)
    shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("batch1", "mixed")}, indent=1))


if __name__ == "__main__":
    main()
