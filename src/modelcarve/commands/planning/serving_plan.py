"""The serving side of ``modelcarve plan`` and ``modelcarve estimate`` (goals serve-latency and
serve-throughput): the request-shape and bound flags, and what is printed.

Usage::

    modelcarve plan --goal serve-latency --model qwen3-32b --cluster 2x8xH100 --input-len 2048 --output-len 256
    modelcarve plan --goal serve-throughput --model kimi-k2 --cluster 2x8xH200 --ttft-ms 2000 --tpot-ms 50 --json
    modelcarve estimate --goal serve-latency --model qwen3-32b --cluster 2xH100 --layout "tp=2,weight_dtype=fp8"

``commands/plan.py`` owns the commands; it calls ``add_serve_arguments`` on its parsers and hands
serving goals to ``run_serve_plan`` / ``run_serve_estimate``.
"""

from __future__ import annotations

import argparse
import json
import sys

from modelcarve.commands.planning.published import attach_published, print_published
from modelcarve.commands.planning.serve_goals import SERVE_GOALS, engine_dtypes, fill_replicas, is_serve_goal  # noqa: F401 (re-exported)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving goals (serve-latency, serve-throughput)")
    group.add_argument("--input-len", type=int, default=None, metavar="TOKENS", help="prompt tokens per request (default 2048)")
    group.add_argument("--output-len", type=int, default=None, metavar="TOKENS", help="generated tokens per request (default 256)")
    group.add_argument("--ttft-ms", type=float, default=None, metavar="MS", help="bound on time to first token")
    group.add_argument("--tpot-ms", type=float, default=None, metavar="MS", help="bound on time per output token")
    group.add_argument("--batch", type=int, default=None, metavar="N",
                       help="sequences in flight per replica (latency default 1; throughput: chosen)")
    group.add_argument("--weight-dtypes", default=None, metavar="LIST",
                       help="weight dtypes to consider (default: the quality floor bf16,fp8; widen with e.g. "
                            "bf16,fp8,int8,int4,fp4,mxfp4; each dtype's quality cost is shown)")
    group.add_argument("--kv-dtypes", default=None, metavar="LIST", help="KV-cache dtypes to consider (default bf16,fp8; fp4 = NVFP4 KV)")
    group.add_argument("--max-batch", type=int, default=None, metavar="N", help="largest batch per replica to consider (default 1024)")
    group.add_argument("--phase", choices=["prefill", "decode"], default=None,
                       help="estimate: cost one phase alone, as a disaggregated prefill or decode unit")
    group.add_argument("--redundant-experts", type=int, default=None, metavar="R",
                       help="MoE: also search expert-parallel layouts with R redundant expert replicas (EPLB: vLLM's "
                            "num_redundant_experts, SGLang's --ep-num-redundant-experts), so ep need only divide experts + R")
    group.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S",
                       help="request rate over the cluster: layouts must sustain it, TPOT is that of the batch it keeps in flight "
                            "(Little's law), TTFT adds the queue wait (M/D/1, plan/serve/queue.py); serve-disagg sizes its pools for it")
    group.add_argument("--kv-memory", choices=["device", "free"], default=None,
                       help="how the engine sizes its KV cache: device = --memory-fraction of the whole device holds weights and KV "
                            "(vLLM's --gpu-memory-utilization, the default), free = that fraction of what the weights leave "
                            "(TensorRT-LLM's free_gpu_memory_fraction; the default under --engine/--emit-launch trtllm)")
    group.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                       help="the fraction --kv-memory applies (default 0.9, both engines' default)")
    group.add_argument("--pareto", action="store_true",
                       help="plan: print the Pareto front of tok/s/device vs tok/s/user (with --plot PNG: draw it)")


def serve_options_from_args(args: argparse.Namespace) -> dict:
    """The serving options the flags state, over the defaults of the engine the plan is for
    (``--engine`` / ``--framework`` / ``--emit-launch``: its KV-cache memory rule,
    ``plan.serve.memory.ENGINE_MEMORY_RULES``); what the user states wins."""
    keys = ("input_len", "output_len", "ttft_ms", "tpot_ms", "batch", "weight_dtypes", "kv_dtypes", "max_batch", "load_imbalance",
            "rate", "redundant_experts", "kv_memory", "memory_fraction")
    stated = {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}
    engine = getattr(args, "engine", None) or getattr(args, "framework", None) or getattr(args, "emit_launch", None)
    from modelcarve.plan.serve.memory import ENGINE_KV_MEMORY, ENGINE_MEMORY_RULES
    from modelcarve.spec.errors import ModelcarveError

    rule = ENGINE_MEMORY_RULES.get(engine)
    rule_of = ENGINE_KV_MEMORY.get(engine)
    if rule_of and stated.get("kv_memory", rule_of) != rule_of:
        raise ModelcarveError(f"--kv-memory {stated['kv_memory']} is not how {engine} sizes its KV cache ({rule_of}: "
                              f"{'a share of the whole device' if rule_of == 'device' else 'a share of what the weights leave'}); "
                              f"drop --kv-memory, or set --memory-fraction")
    return {**(rule.options() if rule else {}), **stated}


def run_serve_plan(args: argparse.Namespace, model, cluster, *, top: int = 5) -> int:
    from modelcarve.plan.search import nothing_qualifies, search
    from modelcarve.plan.serve.why import contrasts

    options = serve_options_from_args(args)
    if getattr(args, "pareto", False) or args.goal == "serve-disagg":
        from modelcarve.commands.planning.frontier import run_frontier_plan

        return run_frontier_plan(args, model, cluster, options, top=top)
    from modelcarve.commands.planning.launch_emit import launch_winner, ranked_search

    plan, ranking = ranked_search(args, model, cluster, args.goal, top, options)
    if plan["layouts"]:
        launch_winner(args, model, cluster, plan, ranking)
    from modelcarve.commands.planning.pricing import attach_costs, print_costs

    costs = attach_costs(args, cluster, plan["layouts"], serving=True)
    attach_published(plan, model, cluster, "serve")
    why = contrasts(model, cluster, args.goal, plan["layouts"][0], **options) if plan["layouts"] else []
    if getattr(args, "json", False):
        print(json.dumps(dict(plan, why=why), indent=2, default=str))
    elif not plan["layouts"]:
        raise nothing_qualifies(plan, f"no layout of {model.name} qualifies for {args.goal} on {cluster.name}")
    else:
        from modelcarve.report.serving import print_serve_plan
        from modelcarve.report.tables import console as make_console

        console = make_console()  # readable width when piped, not rich's 80 columns
        console.print(f"{model.name} on {cluster.describe()}")
        print_serve_plan(plan, goal_name=args.goal, why=why, console=console)
        print_costs(costs, serving=True)
        print_published(console, plan, model, "serve", warned=False)
        console.print(f"{plan['evaluated']:,} layouts evaluated in {plan['elapsed_s']:.3f} s")
    emit = getattr(args, "emit", None)
    if emit and plan["layouts"]:
        from modelcarve.spec.layout import Layout

        with open(emit, "w") as handle:
            handle.write(Layout.from_dict(plan["layouts"][0]["layout"]).to_json() + "\n")
    if getattr(args, "plot", None) and plan["layouts"]:
        # a serving plan's figure is its frontier: tokens/s per device against tokens/s per user
        from modelcarve.plan.serve.pareto import pareto_front
        from modelcarve.report.frontier import plot_pareto

        plot_pareto(pareto_front(model, cluster, **options), args.plot,
                    title=f"{model.name} on {cluster.name}: {args.goal} (winner {plan['layouts'][0].get('name', '')})")
        sys.stderr.write(f"modelcarve: wrote {args.plot}\n")
    if getattr(args, "emit_launch", None) and plan["layouts"]:
        from modelcarve.commands.planning.launch_emit import emit_launch

        layout, batch, label = args._launch
        emit_launch(args, model, cluster, layout, max_batch=batch, label=label, priced=options)  # its memory fraction too
    return 0 if plan["layouts"] else 1


def run_serve_estimate(args: argparse.Namespace, model, cluster, layout) -> int:
    from modelcarve.plan.goals import get_goal

    if isinstance(getattr(args, "layout", None), str):
        layout = engine_dtypes(args.layout, layout)
    if getattr(args, "phase", None) or args.goal == "serve-disagg":
        from modelcarve.commands.planning.frontier import run_frontier_estimate

        return run_frontier_estimate(args, model, cluster, layout, serve_options_from_args(args))
    options = serve_options_from_args(args)
    if isinstance(getattr(args, "layout", None), str) and "weight_dtype" not in options and engine_dtypes(args.layout, layout.replace(weight_dtype="")).weight_dtype == "":
        # The layout names its weight dtype: the user asked for it, so every matrix is sized in it
        # (otherwise experts a checkpoint ships narrower are sized as released: plan/serve/options.py).
        options["weight_dtypes"] = layout.weight_dtype
    note = None
    filled = fill_replicas(layout, cluster)
    if filled is not layout:
        layout = filled
        note = f"note: dp={layout.dp} replicas fill the {cluster.num_devices} devices of {cluster.name}"
    result = get_goal(args.goal).evaluate(model, cluster, layout, **options)
    if getattr(args, "rate", None) is not None:
        from modelcarve.commands.planning.frontier import attach_queue

        attach_queue(args, result)
    if note and not getattr(args, "json", False):
        print(note)
    from modelcarve.commands.planning.pricing import attach_costs, print_costs

    costs = attach_costs(args, cluster, [result], serving=True) if result["fits"] else []
    attach_published(result, model, cluster, "serve")
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, default=str))
    else:
        from modelcarve.report.serving import print_serve_estimate
        from modelcarve.report.tables import console as make_console

        console = make_console()
        print_serve_estimate(result, console)
        print_costs(costs, serving=True)
        print_published(console, result, model, "serve")  # a warning is among the estimate's, printed above
    return 0 if result["fits"] and not result["reject_reason"] else 1
