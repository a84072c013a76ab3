"""``modelcarve plan`` and ``modelcarve estimate``: rank layouts for a goal, or cost one layout.

Usage::

    modelcarve estimate --model gpt3-175b --cluster 128x8xA100-80GB --goal train \\
        --layout "tp=8,pp=8,dp=16,mbs=1,gbs=1536,seq=2048,recompute=selective" --json
    modelcarve plan --model gpt3-175b --cluster 128x8xA100-80GB --goal train \\
        --global-batch 1536 --seq 2048 --top 5 --emit layout.json --plot plan.png

The goal (``--goal``) names an entry of ``plan.goals.GOALS``; each goal reads the options it
knows from the ones gathered here and ignores the rest. JSON field names are a contract other
tools read: estimate prints the goal's estimate (for train: ``fits``, ``memory``, ``time``,
``comm``, ``bubble_fraction``, ``warnings``); plan prints ``{"layouts", "rejected",
"evaluated", "alternatives", "elapsed_s"}``.
"""

from __future__ import annotations

import json

from modelcarve.spec.errors import ModelcarveError

from modelcarve.commands.emit import ENGINES  # --emit-launch / --engine: one mapping table each
from modelcarve.commands.planning.launch_emit import check_launch, emit_launch, launch_winner, ranked_search
from modelcarve.commands.planning.published import attach_published, print_published
from modelcarve.plan.train.options import CUDA_GRAPHS, MOE_EXPERT_KERNELS
from modelcarve.plan.train.profile import LOSS_KINDS  # the one list of losses the planner prices


def register(sub) -> None:
    estimate = sub.add_parser("estimate", help="memory, step time and link traffic of one layout")
    _common(estimate)
    estimate.add_argument("--layout", required=True, help='e.g. "tp=8,pp=8,dp=16,mbs=1,gbs=1536,seq=2048" or layout.json')
    estimate.add_argument("--offload-layers", type=int, metavar="N", default=None,
                          help="training: layers whose saved activations go to host memory and back (Megatron-Core "
                               "--cpu-offloading-num-layers; pp=1 only)")
    estimate.add_argument("--timeline", metavar="PNG", help="draw the planner's pipeline schedule of this layout per rank")
    estimate.add_argument("--max-batch-launch", dest="launch_batch", type=int, default=None, metavar="N",
                          help="--emit-launch of a serving layout: the engine's max concurrent sequences (default: --batch)")
    estimate.add_argument("--framework", choices=ENGINES + ("deepspeed", "megatron-bridge"), default=None,
                          help="read --layout in this framework's words: its values (torchtitan's recompute=selective is "
                               "op-level SAC, Megatron's the attention core) or its own flags, e.g. \"--tensor-model-"
                               "parallel-size 8 --sequence-parallel ...\" (docs/engines/); deepspeed: a ds_config.json "
                               "path or its JSON, then ,tp=/pp=/seq=/recompute= for what the config does not hold; "
                               "megatron-bridge: a recipe's overrides, e.g. \"model.tensor_model_parallel_size=8 "
                               "train.micro_batch_size=1 mixed_precision=bf16_with_mxfp8_mixed\"")
    estimate.set_defaults(func=_estimate)

    plan = sub.add_parser("plan", help="rank every valid layout for a goal, and say why the others lose")
    _common(plan)
    plan.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    plan.add_argument("--emit", metavar="PATH", help="write the best layout as the JSON the runtime reads")
    plan.add_argument("--plot", metavar="PNG", help="draw memory breakdown and per-link traffic of the top layouts")
    plan.add_argument("--grad-dtype", choices=["fp32", "bf16"], default=None,
                      help="training: the dtype every searched layout holds and reduces its gradients in (default "
                           "fp32; bf16 is Megatron's --grad-reduce-in-bf16, set by every Megatron-Bridge performance "
                           "recipe): the framework's setting, not one the search picks")
    plan.add_argument("--engine", "--framework", dest="engine", choices=ENGINES + tuple(BRIDGED), default=None,
                      help="rank only the layouts this engine or framework can express, in its meanings "
                           "(torchtitan has op-level SAC, not Megatron's selective recompute; "
                           "commands/emit/engines/<engine>.json); megatron-bridge: Megatron-LM's layouts, FP8 ones "
                           "priced as its presets hold them (fp8_param_gather), launched with --emit-launch megatron")
    plan.set_defaults(func=_plan)


def _common(p) -> None:
    p.add_argument("--model", required=True, help="catalogue name or config.json path")
    p.add_argument("--cluster", required=True, help="e.g. 2x8xH200 or cluster.yaml")
    p.add_argument("--goal", default="train", help="what to optimise: train (default), serve-latency, serve-throughput, serve-disagg")
    p.add_argument("--global-batch", type=int, help="training: sequences per optimiser step")
    p.add_argument("--seq", type=int, help="training: sequence length in tokens")
    p.add_argument("--attention", choices=["flash", "materialized"], help="training: attention kernel (default flash)")
    p.add_argument("--dropout", action="store_true", default=None, help="training: dropout layers present")
    p.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false", default=None,
                   help="training: gradient reduction runs after the backward, not during it")
    p.add_argument("--no-overlap-p2p", dest="overlap_p2p", action="store_false", default=None,
                   help="training: pipeline sends of the interleaved schedule stay on the critical path")
    p.add_argument("--load-imbalance", type=float, help="MoE: busiest expert rank's tokens / mean (default 1.25)")
    p.add_argument("--precision", choices=["bf16", "fp8", "fp8-cs", "mxfp8"],
                   help="training: GEMM precision the search tries (default bf16; fp8 = TE delayed scaling, "
                        "fp8-cs = current scaling, mxfp8 = Blackwell MX blocks)")
    p.add_argument("--loss", choices=LOSS_KINDS,
                   help="training: cross entropy (default materialized: Megatron-Core's unfused loss, one fp32 "
                        "copy of the whole logits; fused: --cross-entropy-loss-fusion with TE's kernel; chunked: "
                        "logits never whole, torchtitan's ChunkedLossWrapper; torch: torch's cross entropy as torchtitan runs it, DTensor's "
                        "loss_parallel under TP)")
    p.add_argument("--fp8-param-gather", dest="fp8_param_gather", action="store_true", default=None,
                   help="training, FP8: linear weights held as FP8 tensors with no bf16 copy (Megatron's "
                        "--fp8-param-gather; Megatron-Bridge's FP8 presets set it)")
    p.add_argument("--moe-probs-on-combine", dest="moe_probs_on_combine", action="store_true", default=None,
                   help="training, MoE: the combine weighs and keeps the experts' outputs (Megatron-Core before 0.13; "
                        "default: 0.13+, which weighs the expert activation and keeps nothing more)")
    p.add_argument("--moe-a2a-overlap", dest="moe_a2a_overlap", action="store_true", default=None,
                   help="training, MoE: the expert-parallel all-to-all overlapped with another micro-batch's compute "
                        "(Megatron's --overlap-moe-expert-parallel-comm; Megatron-Bridge's moe_a2a_overlap presets)")
    p.add_argument("--moe-fused-mlp", dest="moe_fused_mlp", action="store_true", default=None,
                   help="training, MoE: the routed experts' MLP as one fused operation, the activation and its "
                        "quantisation in the GEMM epilogues (Megatron's --use-transformer-engine-op-fuser; "
                        "Megatron-Bridge's cutedsl_fused_grouped_mlp presets)")
    p.add_argument("--moe-expert-kernels", dest="moe_expert_kernels", choices=MOE_EXPERT_KERNELS, default=None,
                   help="training, MoE: per_expert (default: each local expert's GEMMs and casts their own kernels, "
                        "Transformer Engine's GroupedLinear as Megatron-Core runs it; the host's time to issue them "
                        "bounds small expert layers) or grouped (one grouped GEMM for all local experts, torch's "
                        "_grouped_mm as torchtitan runs it)")
    p.add_argument("--cuda-graph", dest="cuda_graph", choices=CUDA_GRAPHS, default=None,
                   help="training: CUDA graphs (Megatron's --cuda-graph-impl / --cuda-graph-scope): none (default), "
                        "partial (layer-wise scopes; dropless experts stay eager) or full_iteration (the whole step "
                        "replayed: the host issues no expert kernel)")
    p.add_argument("--mtp-layers", dest="mtp_layers", type=int, metavar="N", default=None,
                   help="training: multi-token prediction depths on the last pipeline stage (DeepSeek-V3's MTP: "
                        "Megatron's --mtp-num-layers; its recipes train with 1): a decoder layer, a projection and "
                        "one more pass of the head and loss each (default 0)")
    p.add_argument("--no-split-embedding", dest="split_embedding", action="store_false", default=None,
                   help="training, pipelines: the embedding counts no layer in the stage split (default: one, "
                        "Megatron's --account-for-embedding-in-pipeline-split; Megatron-Bridge's DeepSeek-V3 "
                        "layouts count none)")
    p.add_argument("--memory-headroom", type=float, metavar="FRACTION",
                   help="training: fraction of device memory a layout must leave free (default 0.05)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--emit-launch", metavar="ENGINE", choices=ENGINES, default=None,
                   help=f"write the winner's launch command for an engine: {', '.join(ENGINES)} (refused in one line "
                        f"if the engine cannot express it)")
    p.add_argument("--out", metavar="DIR", default=None, help="--emit-launch: write launch.sh (and its files) into DIR "
                                                               "instead of printing them")
    from modelcarve.commands.planning.pricing import add_price_arguments
    from modelcarve.commands.planning.serving_plan import add_serve_arguments

    add_serve_arguments(p)
    add_price_arguments(p)


BRIDGED = {"megatron-bridge": ("megatron", {"fp8_param_gather": True})}
"""Frameworks that run another engine's layouts: name -> (that engine, the planner options its plans are
priced with). Megatron-Bridge runs Megatron-Core, and every FP8 preset of it sets fp8_param_gather
(commands/emit/bridge_vocab.py ``PRESETS``); ``plan --engine`` ranks what the engine expresses."""


def _options(args) -> dict:
    """Goal options from the flags that were given (a goal ignores the ones it does not know)."""
    names = ("global_batch", "seq", "attention", "dropout", "overlap_grad_reduce", "overlap_p2p", "load_imbalance",
             "precision", "loss", "memory_headroom", "offload_layers", "fp8_param_gather", "moe_probs_on_combine",
             "moe_a2a_overlap", "moe_fused_mlp", "moe_expert_kernels", "cuda_graph", "grad_dtype", "mtp_layers",
             "split_embedding")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _planner_options(engine: str) -> dict:
    """The training planner's options that describe how ``engine`` runs (its table's
    ``planner_options``): ``param_policy`` (how it holds the parameters, plan/train/states.py;
    DeepSpeed's bf16 optimizer keeps bf16 weights and an fp32 master, as Megatron does) and
    ``moe_probs_on_combine`` (torchtitan's score-before-experts and modelcarve's runtime, which
    weighs the experts' outputs, keep one more copy of the routed tokens; Megatron-Core 0.13+ does not)
    and ``loss`` / ``loss_chunks`` (torchtitan 0.3.0's recipes compute the loss with its
    ``ChunkedLossWrapper``, 8 chunks) and ``moe_expert_kernels`` (torchtitan's GroupedExperts run one
    ``torch._grouped_mm`` for all local experts). They are defaults: an option the user states wins."""
    if engine in ("deepspeed", "megatron-bridge"):  # read-only vocabularies (no launch table)
        return {"param_policy": "megatron"}
    from modelcarve.commands.emit import table

    return {"param_policy": "megatron", **table(engine).get("planner_options", {})}


_POLICY_NOTES = {
    "megatron": "{engine} holds 16-bit weights (FP8 ones under --fp8-param-gather) and an fp32 master copy in the "
                "optimizer: 12 bytes a parameter of optimizer state with the two moments",
    "torch": "{engine} holds fp32 parameters, their own master copy, and computes in bf16 (FSDP2 "
             "MixedPrecisionPolicy / autocast): 4 + 8 bytes a parameter beside the fp32 gradients",
    "modelcarve": "{engine} holds fp32 parameters, their own master copy, except under its distributed optimizer "
                  "(zero=1/2 over dp x cp > 1: bf16 + an fp32 master), spec/support.held_param_dtype",
}
"""The sentence ``estimate --framework`` prints for the parameter policy it priced."""


def _why_filtered(engine: str | None, model, ranking: list | None) -> str:
    """``plan --engine`` that kept nothing: why the engine refuses the best layout found (often a
    setting every layout shares, such as --grad-dtype bf16 under torchtitan), or nothing."""
    if not engine or not ranking:
        return ""
    from modelcarve.commands.emit import problem

    found = problem(engine, ranking[0], model, serving=False)
    return f": it refuses the best found, {ranking[0].short()}: {found[0]}" if found else ""


def _load(args):
    from modelcarve.plan.goals import get_goal
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster

    return get_model(args.model), parse_cluster(args.cluster), get_goal(args.goal)


def _out_needs_emit_launch(args) -> None:
    if getattr(args, "out", None) and not getattr(args, "emit_launch", None):
        raise ModelcarveError(f"--out {args.out} is where --emit-launch writes its files; add --emit-launch ENGINE "
                              f"({', '.join(ENGINES)}), or use --emit FILE for the layout alone")


def _estimate(args) -> int:
    from modelcarve.spec.layout import Layout

    _out_needs_emit_launch(args)

    model, cluster, goal = _load(args)
    notes, framework_options = [], {}
    if args.framework:
        from modelcarve.commands.emit.vocab import read_layout, read_options

        framework_options = read_options(args.framework, args.layout)
        args.layout, notes = read_layout(args.framework, args.layout, devices=cluster.num_devices)
        if not args.json:
            for note in notes:
                print(f"note: {note}")
    layout = Layout.parse(args.layout)
    from modelcarve.commands.planning.serving_plan import is_serve_goal, run_serve_estimate

    if is_serve_goal(args.goal):
        if args.emit_launch:
            check_launch(args, model, cluster, layout)
        code = run_serve_estimate(args, model, cluster, layout)
        if args.emit_launch:
            from modelcarve.commands.planning.serving_plan import serve_options_from_args

            emit_launch(args, model, cluster, args._launch_layout,
                        max_batch=args.launch_batch or args.batch or args.max_batch, priced=serve_options_from_args(args))
        return code
    options = _options(args)
    if args.goal == "train" and args.framework:
        options.update(framework_options)
        options = {**_planner_options(args.framework), **options}  # what the user stated wins
        framework_notes = [_POLICY_NOTES[options["param_policy"]].format(engine=args.framework)]
        if model.is_moe and options.get("moe_probs_on_combine"):
            framework_notes.append(f"{args.framework} weighs the routed tokens by the router's scores outside the "
                                   "expert activation: one more bf16 copy of them kept per MoE layer")
        notes += framework_notes
        if not args.json:
            for note in framework_notes:
                print(f"note: {note}")
    if args.goal == "train":
        if layout.gbs and options.get("global_batch") not in (None, layout.gbs):
            raise ModelcarveError(
                f"--global-batch {options['global_batch']} disagrees with the layout's gbs={layout.gbs}; give one"
            )
        if "global_batch" in options and not layout.gbs:
            layout = layout.replace(gbs=options["global_batch"])
            layout.check()
        if "seq" in options:
            layout = layout.replace(seq=options["seq"])
        options.pop("global_batch", None)
        options.pop("seq", None)
    if args.emit_launch:  # on the final layout, before any output
        check_launch(args, model, cluster, layout)
    result = goal.evaluate(model, cluster, layout, **options)
    if result.get("goal") == "train":
        from modelcarve.plan.train.report import memory_sources

        result["memory"]["sources"] = memory_sources(result, goal.cost_model(model, cluster, **options).options)
        attach_published(result, model, cluster, "train")
    if notes:
        result["read_as"] = notes
    from modelcarve.commands.timeline import draw_estimate

    draw_estimate(getattr(args, "timeline", None), layout, model, cluster)
    from modelcarve.commands.planning.pricing import attach_costs, print_costs

    costs = attach_costs(args, cluster, [result], serving=False)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from modelcarve.report.tables import console, estimate_table

    out = console()
    for table in estimate_table(result, model, cluster):
        out.print(table)
    for warning in result.get("warnings", []):
        out.print(f"[yellow]warning:[/] {warning}")
    print_published(out, result, model, "train")
    if not result["fits"]:
        out.print(f"[red]does not fit:[/] {result.get('reject_reason')}")
    print_costs(costs, serving=False)
    emit_launch(args, model, cluster, layout, priced=options)
    return 0


def _plan(args) -> int:
    _out_needs_emit_launch(args)
    from modelcarve.plan.search import nothing_qualifies, search

    from modelcarve.spec import files

    framework = args.engine
    if framework in BRIDGED:  # a framework over another's engine: what that engine expresses, priced as it holds it
        args.engine = BRIDGED[framework][0]
    if args.engine and args.emit_launch and args.engine != args.emit_launch:
        raise ModelcarveError(f"--engine {framework} and --emit-launch {args.emit_launch} disagree; give one engine")
    for flag, value in (("--emit", args.emit), ("--plot", args.plot)):
        if value:
            files.output_path(value, flag)  # before the search, not after it
    model, cluster, goal = _load(args)
    from modelcarve.commands.planning.serving_plan import is_serve_goal, run_serve_plan

    if is_serve_goal(args.goal):
        return run_serve_plan(args, model, cluster, top=args.top)
    options = _options(args)
    if args.goal == "train" and args.engine:
        options = {**_planner_options(framework), **options}  # what the user stated wins
        options.update(BRIDGED.get(framework, (None, {}))[1])
    if args.goal == "train" and not options.get("global_batch"):
        raise ModelcarveError("planning training needs --global-batch (sequences per optimiser step), e.g. --global-batch 1024")
    result, ranking = ranked_search(args, model, cluster, goal.name, args.top, options)
    if not result["layouts"]:
        raise nothing_qualifies(result, f"no layout of {model.name} fits on {cluster.name}"
                                + (f" that {args.engine} can express" if args.engine else "")
                                + _why_filtered(args.engine, model, ranking))
    launch_winner(args, model, cluster, result, ranking)
    if args.emit:
        from modelcarve.spec.layout import Layout

        winner = Layout.from_dict(result["layouts"][0]["layout"])
        files.write_text(args.emit, winner.to_json() + "\n", "--emit")
    if args.plot:
        from modelcarve.report.figures import plot_plan

        plot_plan(result, args.plot, title=f"{model.name} on {cluster.name}")
    from modelcarve.commands.planning.pricing import attach_costs, print_costs

    costs = attach_costs(args, cluster, result["layouts"], serving=False)
    if goal.name == "train":
        attach_published(result, model, cluster, "train")
    if args.json:
        print(json.dumps(result, indent=2))
        if args.emit_launch:
            layout, batch, label = args._launch
            emit_launch(args, model, cluster, layout, max_batch=batch, label=label, priced=options)
        return 0
    from modelcarve.report.tables import console, plan_tables

    out = console()
    for table in plan_tables(result, model, cluster):
        out.print(table)
    print_costs(costs, serving=False)
    print_published(out, result, model, "train", warned=False)
    out.print(
        f"{result['evaluated']:,} layouts evaluated in {result['elapsed_s']:.2f} s"
        + (f"; wrote {args.emit}" if args.emit else "")
        + (f"; drew {args.plot}" if args.plot else "")
    )
    if args.emit_launch:
        layout, batch, label = args._launch
        emit_launch(args, model, cluster, layout, max_batch=batch, label=label, priced=options)
    return 0

