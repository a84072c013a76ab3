"""Pipeline-parallel serving vs pp=1 on the same two ranks: decode throughput at 16 concurrent requests.

Usage::

    .venv/bin/python benchmarks/pp_serving.py [--rounds 2] [--requests 16] [--new 64]
    # writes benchmarks/results/pp_serving.json

A llama-shaped checkpoint (``CONFIG``: ~30M parameters, random std-0.02 weights, fp32) is saved
once; two gloo ranks (one torch thread each, this machine's cores) then build the engine for each
layout in turn -- ``pp=2`` (micro-batches of disjoint requests in flight across steps),
``tp=2`` and ``dp=2`` -- and rank 0 submits ``--requests`` prompts of 32 tokens at once, each
wanting ``--new`` greedy tokens (ignore_eos). Per layout and round:

* ``tokens_per_s``: generated tokens / wall time from submission to the last token;
* ``decode_tokens_per_s``: tokens generated after every request has its first token, over the
  time from then to the end (the decode phase alone);
* ``max_in_flight`` (pp=2: 2 when two micro-batches were in flight at once).

``--src OTHER/src --layouts pp=2 --out ...`` runs another checkout's engine (e.g. the one whose
pp=2 overlapped micro-batches only within a step) for comparison.

Rounds interleave the layouts. The 1-minute load average is recorded before each round; the
machine is shared with other work, so a round that starts at a load above ``MAX_LOAD`` (1.5) is
marked ``valid: false`` and the summary's medians use valid rounds only (none valid: no medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("PP_SERVING_SRC") or str(ROOT / "src"))  # --src: another checkout's

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-6)
LAYOUTS = ["pp=2", "tp=2", "dp=2"]
MAX_LOAD = 1.5
PROMPT = 32


def _rank(rank: int, port: int, path: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.engine.sampler import SamplingParams

    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (PROMPT,), generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    rows = []
    for rnd in range(args.rounds):
        for layout in args.layouts:
            dist.barrier()
            load = os.getloadavg()[0]
            engine = Engine(EngineConfig(model=path, layout=f"{layout},param_dtype=fp32", kv_cache_bytes=1 << 28,
                                         max_num_batched_tokens=2048, max_num_seqs=64))
            if engine.is_driver:
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    engine.add_request(f"r{i}", p, params)
                firsts, tokens, outs = {}, [], {}
                while engine.has_unfinished():
                    for out in engine.step():
                        now = time.perf_counter()
                        if out.new_token_ids:
                            firsts.setdefault(out.request_id, now)
                            tokens.append(now)
                        if out.finished:
                            outs[out.request_id] = out.token_ids
                end = time.perf_counter()
                all_first = max(firsts.values())
                decode = [t for t in tokens if t > all_first]
                stats = engine.stats().to_dict()
                engine.shutdown()
                rows.append(dict(round=rnd, layout=layout, load_1min=load, valid=load <= MAX_LOAD,
                                 wall_s=end - t0, tokens=len(tokens), tokens_per_s=len(tokens) / (end - t0),
                                 decode_tokens_per_s=len(decode) / (end - all_first) if decode else None,
                                 max_in_flight=stats.get("max_in_flight"), steps=stats["steps"],
                                 outputs_hash=hash(tuple(tuple(outs[f"r{i}"]) for i in range(len(prompts))))))
                print(json.dumps(rows[-1]), flush=True)
            else:
                engine.follow()
            dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS)
    ap.add_argument("--src", default=None, help="another checkout's src/ (e.g. the engine before this benchmark)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pp_serving.json"))
    args = ap.parse_args()
    if args.src:
        os.environ["PP_SERVING_SRC"] = str(Path(args.src).resolve())  # read by the spawned ranks on import
    import multiprocessing as mp

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="pp_serving_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().save_pretrained(tmp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, tmp, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows = queue.get(timeout=3600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    summary = {}
    for layout in args.layouts:
        valid = [r for r in rows if r["layout"] == layout and r["valid"]]
        summary[layout] = dict(
            valid_rounds=len(valid),
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in valid) if valid else None,
            decode_tokens_per_s=statistics.median(r["decode_tokens_per_s"] for r in valid) if valid else None)
    same = len({r["outputs_hash"] for r in rows}) == 1
    result = dict(src=os.environ.get("PP_SERVING_SRC") or str(ROOT / "src"), config=CONFIG, requests=args.requests, prompt_tokens=PROMPT, new_tokens=args.new,
                  threads_per_rank=1, ranks=2, cpu_count=os.cpu_count(), machine=platform.machine(),
                  load_before=load_before, load_after=os.getloadavg(), max_load=MAX_LOAD,
                  same_outputs_every_layout=same, rounds=rows, summary=summary)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
