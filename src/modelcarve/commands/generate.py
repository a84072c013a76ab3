"""``modelcarve generate``: generate text with a layout on real processes (the engine in runtime/).

    modelcarve generate --model ./ckpt --layout "tp=2" --prompt "Once upon a time" --max-tokens 32
    modelcarve generate --model ./ckpt --layout layout.json --prompt-ids 1,2,3 --prompt-ids 4,5 --json

Everything that can be refused is refused before any rank starts (one line, exit 2): the layout
and dtypes (``spec/support.py``'s ``check_generation``), the checkpoint, prompt ids outside the vocabulary,
a text prompt for a model without a tokenizer, a prompt longer than the context, and with
``--kv-cache-bytes`` a prompt + ``--max-tokens`` the KV budget cannot hold (the planner's KV
arithmetic, plan/serve/memory.py, plus the int8 / fp8 scales). One rank runs in this process;
more start through torchrun (commands/launching/torchrun.py) on this module (``-m
modelcarve.commands.generate generate '<json>'``), rank 0 printing; a signal to this process
reaches every rank (and exits 128 + its number).

Output: a progress line on stderr while the weights load, the text as it is produced (one
prompt; with several each completion when it ends), then TTFT (arrival to first token), TPOT
(the planner's definition: time per output token after the first, (finish - first token) /
(tokens - 1), per request, averaged), output tokens/s (all requests' tokens over the wall time
from the first arrival to the last finish) and the peak KV blocks used. ``--json`` prints
``{"completions": [{"token_ids", "text", "finish_reason", ...}], "ttft_s", "tpot_s", ...}``,
completions in the order the prompts were given; token ids exclude the prompt. Prompt ids are
used as given; text is tokenised as transformers' tokenizer does by default.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from modelcarve.spec.errors import ModelcarveError


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens with a layout (KV-cache engine, continuous batching)")
    p.add_argument("--model", required=True, help="a checkpoint directory or a catalogue name (random weights)")
    p.add_argument("--layout", default="tp=1", help='"tp=2,pp=2,..." or a layout.json from `plan --goal serve-* --emit`')
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for several requests)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as token ids 1,2,3 (used as given)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (request i uses seed + i)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's end-of-sequence ids")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="override the layout's param_dtype")
    p.add_argument("--kv-cache-bytes", type=float, default=None,
                   help="KV cache per rank in bytes (default: half the free memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout per rank, seconds")
    p.add_argument("--json", action="store_true", help="print the completions and timings as JSON")
    p.set_defaults(func=_generate)


# --- checks before any rank starts -----------------------------------------------------------


def _prompt_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ModelcarveError(f"--prompt-ids {text!r}: give comma-separated integers, e.g. 1,2,3") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ModelcarveError(f"--prompt-ids: {bad[0]} is outside the vocabulary [0, {vocab}) of this model")
    if not ids:
        raise ModelcarveError("--prompt-ids is empty; give at least one token id")
    return ids


def _kv_tokens(spec, layout, kv_dtype: str, budget: float, block_size: int) -> int:
    from modelcarve.plan.serve.memory import shard_facts

    facts = shard_facts(spec, tp=layout.tp, pp=layout.pp, ep=layout.ep, kv_dtype=kv_dtype)
    per_token = facts.kv_bytes_per_token
    if kv_dtype in ("int8", "fp8"):  # plus one fp16 scale per stored vector (runtime/engine/kv_cache.py)
        vector = spec.head_dim if spec.attention_kind != "mla" else (spec.kv_lora_rank + spec.qk_rope_head_dim) / 2
        per_token *= 1 + 2 / vector
    return (int(budget // (block_size * per_token)) - 1) * block_size


def prepare(args) -> dict:
    """Every refusal known in advance; returns the workers' arguments."""
    from modelcarve.commands.launching import prelaunch
    from modelcarve.runtime.checkpoint.hf_load import check_checkpoint, is_checkpoint, model_spec
    from modelcarve.runtime.engine.engine import resolve_layout
    from modelcarve.spec.support import check_generation

    prelaunch.check_inputs(args)  # no weights -> refused, never generated from random weights
    if not args.prompt and not args.prompt_ids:
        raise ModelcarveError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    if args.max_tokens < 1:
        raise ModelcarveError(f"--max-tokens {args.max_tokens}: must be at least 1")
    text = args.layout
    if text.endswith(".json") and not os.path.isfile(text):
        raise ModelcarveError(f"--layout {text}: no such file (write one with `modelcarve plan --goal serve-latency --emit {text}`)")
    layout, weight, kv = resolve_layout(text, args.dtype)
    spec = model_spec(args.model)
    layout = check_generation(layout, spec, weight, kv, world_size=layout.world_size)
    if is_checkpoint(args.model):
        check_checkpoint(args.model, spec)
    prompts = []
    if args.prompt:
        from modelcarve.runtime.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(args.model) if os.path.isdir(args.model) else None
        if tok is None:
            raise ModelcarveError(f"{args.model} has no tokenizer (tokenizer.json / tokenizer_config.json); give the "
                                  f"prompt as token ids with --prompt-ids 1,2,3")
        prompts += [tok.encode(p) for p in args.prompt]
    prompts += [_prompt_ids(p, spec.vocab_size) for p in args.prompt_ids]
    for ids in prompts:
        if len(ids) >= spec.max_position:
            raise ModelcarveError(f"a prompt has {len(ids)} tokens but the model's context is {spec.max_position}; "
                                  f"shorten it")
        if args.kv_cache_bytes:
            room = _kv_tokens(spec, layout, kv, args.kv_cache_bytes, args.block_size)
            need = min(len(ids) + args.max_tokens, spec.max_position)
            if need > room:
                raise ModelcarveError(f"a prompt of {len(ids)} tokens plus --max-tokens {args.max_tokens} needs {need} "
                                      f"tokens of KV cache but --kv-cache-bytes {args.kv_cache_bytes:.0f} holds {room}; "
                                      f"raise --kv-cache-bytes or lower --max-tokens")
    from modelcarve.runtime.engine.tokenizer import has_tokenizer

    if args.stop and not (os.path.isdir(args.model) and has_tokenizer(args.model)):
        raise ModelcarveError("--stop strings need the checkpoint's tokenizer; this model has none")
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    stop=list(args.stop), ignore_eos=args.ignore_eos)
    if not 0 < args.top_p <= 1 or args.temperature < 0:
        raise ModelcarveError("--top-p must be in (0, 1] and --temperature >= 0")
    return dict(model=args.model, layout=layout.to_json(),
                weight_dtype=weight, kv_dtype=kv, prompts=prompts, sampling=sampling, seed=args.seed,
                kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size, quiet=bool(args.json),
                world_size=layout.world_size)


# --- the worker (every rank) ----------------------------------------------------------------


def worker(args: dict) -> dict | None:
    from modelcarve.runtime.engine.engine import Engine, EngineConfig
    from modelcarve.runtime.engine.sampler import SamplingParams

    quiet = args.get("quiet", False)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:  # stdout passes through torchrun as it comes; --json keeps stdout for the JSON
        out = sys.stderr if quiet else sys.stdout
        out.write(f"loading {args['model']} ({args['world_size']} rank(s))...\n")
        out.flush()
    layout = args["layout"]
    engine = Engine(EngineConfig(model=args["model"], layout=layout,
                                 kv_cache_bytes=args.get("kv_cache_bytes"), block_size=args.get("block_size", 16),
                                 weight_dtype=args["weight_dtype"], kv_dtype=args["kv_dtype"],
                                 timeout_s=args.get("timeout_s", 120.0)))
    if not engine.is_driver:
        engine.follow()
        return None
    try:
        prompts = args["prompts"]
        for i, ids in enumerate(prompts):
            seed = None if args.get("seed") is None else args["seed"] + i
            engine.add_request(str(i), ids, SamplingParams(seed=seed, **args["sampling"]))
        final, peak = {}, 0
        stream = len(prompts) == 1 and not quiet
        while len(final) < len(prompts):
            for out in engine.step():
                if stream and (out.new_text or engine.tokenizer is None):
                    sys.stdout.write(out.new_text if engine.tokenizer is not None
                                     else "".join(f" {t}" for t in out.new_token_ids))
                    sys.stdout.flush()
                if out.finished:
                    final[int(out.request_id)] = out
                    if not stream and not quiet:
                        sys.stdout.write(f"[{out.request_id}] {out.text or out.token_ids}\n")
            peak = max(peak, engine.stats().kv_blocks_used)
    finally:
        engine.shutdown()
    return _summary(engine, [final[i] for i in range(len(prompts))], peak)


def _summary(engine, outs, peak: int) -> dict:
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    wall = max(o.finish_time for o in outs) - min(o.arrival_time for o in outs)
    stats = engine.stats()
    return {
        "completions": [{"token_ids": o.token_ids, "text": o.text if engine.tokenizer is not None else None,
                         "finish_reason": o.finish_reason, "prompt_tokens": o.num_prompt_tokens,
                         "ttft_s": o.first_token_time - o.arrival_time} for o in outs],
        "ttft_s": sum(ttft) / len(ttft),
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "tpot_definition": "(finish - first token) / (tokens - 1), mean over requests (the planner's)",
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall if wall > 0 else None,
        "kv_blocks_used": peak, "kv_blocks_total": stats.kv_blocks_total, "kv_block_size": stats.block_size,
        "kv_bytes_per_token": stats.kv_bytes_per_token, "preemptions": stats.preemptions,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits, "plan_bytes": stats.plan_bytes,
        "layout": engine.layout.short(), "weight_dtype": engine.weight_dtype, "kv_dtype": engine.kv_dtype,
    }


def _print(summary: dict, streamed: bool) -> None:
    if streamed:
        print()
    tpot = summary["tpot_s"]
    print(f"TTFT {summary['ttft_s'] * 1e3:.1f} ms | TPOT {tpot * 1e3:.2f} ms (after the first token) | "
          f"{summary['tokens_per_s']:.1f} tok/s | KV blocks used {summary['kv_blocks_used']} of "
          f"{summary['kv_blocks_total']} ({summary['kv_block_size']} tokens, {summary['kv_bytes_per_token']} B/token "
          f"per rank) | {summary['layout']} weights {summary['weight_dtype']} KV {summary['kv_dtype']}"
          if tpot is not None else f"TTFT {summary['ttft_s'] * 1e3:.1f} ms | one token per request")


def _report_worker(args: dict) -> None:
    report = args.pop("report", None)
    summary = worker(args)
    if summary is not None and report:
        with open(report, "w") as f:
            json.dump(summary, f)


def _generate(args) -> int:
    payload = prepare(args)
    world = payload["world_size"]
    if world == 1:
        summary = worker(dict(payload, timeout_s=args.timeout))
    else:
        from modelcarve.commands.launching.torchrun import Torchrun, launch

        with tempfile.TemporaryDirectory() as tmp:
            payload["report"] = os.path.join(tmp, "generate.json")
            payload["timeout_s"] = args.timeout
            code = launch(Torchrun(nproc_per_node=world), "modelcarve.commands.generate", ["generate", json.dumps(payload)],
                          timeout_s=args.timeout, relay=("modelcarve:", "loading"))
            if code or not os.path.exists(payload["report"]):
                return code if code > 128 else 1
            summary = json.load(open(payload["report"]))
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary, streamed=len(payload["prompts"]) == 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    from modelcarve.runtime.train.launch import main as launch_main

    return launch_main(argv, {"generate": _report_worker}, prog="modelcarve.commands.generate")


if __name__ == "__main__":
    sys.exit(main())
