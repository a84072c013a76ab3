"""``modelcarve run`` and ``modelcarve verify``: execute a layout on real processes.

    modelcarve run --model tiny-llama --layout "tp=2,pp=2" --steps 20
    modelcarve run --model ./my-checkpoint --layout layout.json --data tokens.npy
    modelcarve verify --model tiny-llama --layout "tp=2,dp=2" --steps 3 --json

Both check the layout against the model and the number of ranks BEFORE any process starts
(a LayoutError with the fix, exit 2), then start the ranks through torchrun
(commands/launching/torchrun.py, on ``-m modelcarve.commands.launching.worker``); when this process is
already a torchrun rank they run in place. ``--nnodes/--node-rank/--master-addr/--master-port``
go to torchrun for several machines. ``verify`` prints one row per compared quantity (logits,
loss, gradients, parameters after N AdamW steps) with max abs/rel differences and pass/fail,
and exits 1 if any fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from modelcarve.spec.errors import LayoutError, ModelcarveError


def _add_common(p) -> None:
    p.add_argument("--model", required=True, help="catalogue name (e.g. tiny-llama) or a Hugging Face checkpoint directory")
    p.add_argument("--layout", required=True, help='"tp=2,pp=2,dp=2,..." or a layout.json from `plan --emit`')
    p.add_argument("--steps", type=int, default=None, help="training steps (run: 10, verify: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", choices=("checkpoint", "random"), default="checkpoint",
                   help="random: train a directory holding only config.json from random weights (default: its "
                        "safetensors weights, refused when it has none)")
    p.add_argument("--data", default=None, help="token file (.npy, .bin uint16) or a text file, tokenised with the "
                   "checkpoint's tokenizer (bytes 0-255 when it has none); default synthetic")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="override the layout's param_dtype (a layout string defaults to bf16; verify's fp32 "
                   "tolerances are the tight ones: loss 1e-5 rel, grads and params 1e-4)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout per rank, seconds")
    p.add_argument("--moe-capacity-factor", type=float, default=0.0,
                   help="MoE: per-sequence expert capacity factor; 0 = dropless (default)")
    p.add_argument("--moe-aux-loss-coef", type=float, default=0.0, help="MoE: load-balancing loss weight (default 0)")
    p.add_argument("--moe-bias-rate", type=float, default=0.0,
                   help="MoE: aux-loss-free router bias update per step, DeepSeek-V3 style (default 0: off)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: world size / nnodes)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--check-order", action="store_true",
                   help="before launching, play every rank under torch's fake process group and refuse a layout whose "
                        "ranks would issue collectives in different orders (small models: every rank for real on CPU); "
                        "with --dry-run --cluster: at the full world size on the meta device, one rank per pipeline "
                        "stage (runtime/dryrun/rank_programs.py; minutes for a 405B model)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="account traffic as K ranks per node (intra/inter tiers; default: torchrun's local world size)")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port on one node, 29500 on several")


def register(sub) -> None:
    p = sub.add_parser("run", help="train a model with a layout on real processes (torchrun)")
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.add_argument("--timeline", metavar="PNG", help="draw the pipeline's last step per rank beside the planner's model")
    p.add_argument("--dry-run", action="store_true",
                   help="start no ranks: build every distinct rank's shard on the meta device under a fake process group "
                        "of the full world size and compare its weight/gradient/optimiser bytes with the planner's for "
                        "--cluster (exit 1 on any difference)")
    p.add_argument("--cluster", default=None, help="--dry-run: the cluster the planner's figures are for, e.g. 256x8xH100")
    from modelcarve.commands.launching.checkpoint_flags import add_checkpoint_flags

    add_checkpoint_flags(p)
    p.set_defaults(func=_run)
    v = sub.add_parser("verify", help="compare a layout with the single-device reference (logits, loss, grads, params)")
    _add_common(v)
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--reference", choices=("ours", "transformers"), default="ours",
                   help="ours: the split layout vs our single-device model (logits, loss, grads, params after "
                        "--steps); transformers: our single-device model and the split layout vs transformers' "
                        "logits and greedy generations on the same checkpoint (--model must be a checkpoint)")
    v.add_argument("--new-tokens", type=int, default=8, help="--reference transformers: greedy tokens per prompt")
    v.add_argument("--against-plan", action="store_true", help="also set one step's bytes per op x axis x tier and memory "
                   "per category beside the planner's prediction (exit 1 if a judged row differs, exit 2 with "
                   "the reason if a row cannot be judged: no silent pass)")
    v.set_defaults(func=_verify)


def _prepare(args):
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    from modelcarve.commands.launching import prelaunch

    layout = Layout.parse(args.layout)
    if args.dtype:
        layout = layout.replace(param_dtype=args.dtype)
    prelaunch.check_inputs(args)  # checkpoint listing/headers and --data, before reading the config
    spec = get_model(args.model)
    layout = prelaunch.derive(args, layout, spec)  # gbs / seq the layout leaves out, said on stderr
    if args.nnodes < 1 or layout.world_size % args.nnodes:
        raise LayoutError(f"the layout needs {layout.world_size} ranks, not divisible over --nnodes {args.nnodes}")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise LayoutError(f"--ranks-per-node {args.ranks_per_node} must be at least 1 (e.g. 8 for 8 GPUs per node)")
    per_node = args.nproc_per_node or layout.world_size // args.nnodes
    if per_node * args.nnodes != layout.world_size:
        raise LayoutError(
            f"--nproc-per-node {per_node} x --nnodes {args.nnodes} = {per_node * args.nnodes} ranks but layout "
            f"{layout.short()} needs dp x cp x tp x pp = {layout.world_size}; use --nproc-per-node "
            f"{layout.world_size // args.nnodes} or change the layout"
        )
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun and "WORLD_SIZE" in os.environ else layout.world_size
    _require_torch()
    from modelcarve.spec.support import check_training

    check_training(layout, spec, world_size=world)
    from modelcarve.runtime.checkpoint.hf_load import check_checkpoint, is_checkpoint

    if is_checkpoint(args.model):
        check_checkpoint(args.model, spec)
    prelaunch.check_launch(args, layout, spec, per_node)  # unused/integer tensors, predicted memory per rank
    if getattr(args, "check_order", False) and not under_torchrun:
        from modelcarve.runtime.dryrun.collective_order import check_layout_order

        check_layout_order(args.model, layout, args.seed)  # LayoutError names the ranks that disagree
    return layout, spec, per_node, under_torchrun


def _require_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ModelcarveError(
            "run and verify need PyTorch, which is not installed: pip install torch==2.13.0 (CPU) or a CUDA "
            "build, then pip install 'modelcarve[runtime]'"
        )


def _launch(command: str, args, payload: dict, per_node: int, under_torchrun: bool) -> int:
    payload["timeout_s"] = args.timeout
    from modelcarve.commands.launching.rendezvous import check_rendezvous

    check_rendezvous(args.master_addr, args.master_port, args.node_rank)
    if getattr(args, "ranks_per_node", None):
        payload["ranks_per_node"] = args.ranks_per_node
    if under_torchrun:
        from modelcarve.commands.launching.worker import main

        return main([command, json.dumps(payload)])
    from modelcarve.commands.launching.torchrun import Torchrun, launch

    ranks = Torchrun(nproc_per_node=per_node, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                     master_port=args.master_port, max_restarts=int(getattr(args, "max_restarts", 0) or 0))
    return launch(ranks, "modelcarve.commands.launching.worker", [command, json.dumps(payload)], timeout_s=args.timeout)


def _payload(args, steps_default: int) -> dict:
    moe = {k: getattr(args, k) for k in ("moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_rate") if getattr(args, k, 0)}
    return dict(model=args.model, layout=args.layout, steps=args.steps or steps_default, seed=args.seed,
                data=data_for_ranks(args.data, args.model), lr=args.lr, dtype=args.dtype) | (dict(moe=moe) if moe else {})


def data_for_ranks(data: str | None, model: str) -> str | None:
    """``--data`` as the ranks read it. Token files (.npy, .bin) and synthetic data go as given. A
    text file is tokenised here, once, with the checkpoint's tokenizer when it has one
    (runtime/engine/tokenizer.py; the ranks' data module sits below it), into a .npy named by the
    sha256 of the text and the tokenizer files (so the same --data keeps the same name and a resume
    recognises it); without a tokenizer the ranks read the text's bytes (ids 0-255). One line on
    stderr says which."""
    from pathlib import Path

    if not data or data == "synthetic" or Path(data).suffix in (".npy", ".bin"):
        return data
    from modelcarve.runtime.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model) if os.path.isdir(model) else None
    if tok is None:
        _say(f"--data {data}: read as bytes (ids 0-255); {model} has no tokenizer")
        return data
    import hashlib

    import numpy as np

    text = Path(data).read_bytes()
    digest = hashlib.sha256(text)
    for name in sorted(os.listdir(model)):
        if "token" in name or name in ("vocab.json", "merges.txt"):
            path = Path(model, name)
            if path.is_file():
                digest.update(name.encode() + b"\0" + path.read_bytes())
    cache = Path(tempfile.gettempdir(), "modelcarve-tokens")
    out = cache / f"{Path(data).stem[:40]}-{digest.hexdigest()[:20]}.npy"
    if not out.is_file():
        ids = np.asarray(_encode(tok, text.decode("utf-8", errors="replace")), dtype=np.int64)
        ids = ids.astype(np.int32) if ids.size and ids.max() < 2**31 else ids
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, ids)
        os.replace(tmp, out)  # ranks of one machine may tokenise at once: whole files only
    count = len(np.load(out, mmap_mode="r"))
    _say(f"--data {data}: {count} tokens by {model}'s tokenizer (cached in {out})")
    return str(out)


def _encode(tok, text: str) -> list[int]:
    import logging

    log = logging.getLogger("transformers.tokenization_utils_base")
    level = log.level
    log.setLevel(logging.ERROR)  # "longer than the model's maximum length": a corpus is, it is cut into windows
    try:
        return tok.encode(text)
    finally:
        log.setLevel(level)


def _say(text: str) -> None:
    import sys

    if os.environ.get("RANK", "0") == "0":  # run in place under torchrun: rank 0 speaks for all
        sys.stderr.write(f"modelcarve: {text}\n")
        sys.stderr.flush()


def _run(args) -> int:
    if args.dry_run:
        from modelcarve.commands.launching.dry_run import dry_run

        return dry_run(args)
    layout, spec, per_node, under = _prepare(args)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "run.json")
        from modelcarve.commands.launching.checkpoint_flags import checkpoint_payload

        from modelcarve.commands import timeline

        payload = _payload(args, 10) | dict(report=report, quiet=bool(args.json)) | checkpoint_payload(args) | timeline.check(args.timeline, layout)
        code = _launch("run", args, payload, per_node, under)
        if code:
            return code if code > 128 else 1
        timeline.draw_run(args.timeline, layout, report)
        if args.json and os.path.exists(report):
            print(open(report).read())
    return 0


def _require_transformers(model: str) -> None:
    import importlib.util

    from modelcarve.runtime.checkpoint.hf_load import is_checkpoint

    if importlib.util.find_spec("transformers") is None:
        raise ModelcarveError("verify --reference transformers needs transformers, which is not installed: "
                              "pip install transformers")
    if not is_checkpoint(model):
        raise ModelcarveError(f"verify --reference transformers needs a checkpoint directory (config.json and "
                              f"model.safetensors), not {model!r}")


def _verify(args) -> int:
    extra = {}
    if getattr(args, "reference", "ours") == "transformers":
        _require_transformers(args.model)
        extra = dict(reference="transformers", new_tokens=args.new_tokens)
    elif getattr(args, "against_plan", False):
        extra = dict(against_plan=True)
    layout, spec, per_node, under = _prepare(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "verify.json")
        code = _launch("verify", args, _payload(args, 3) | dict(report=path) | extra, per_node, under)
        if not code and not os.path.exists(path) and (under and os.environ.get("RANK") != "0" or args.node_rank):
            return 0  # only global rank 0 holds the report
        if code or not os.path.exists(path):
            if args.node_rank == 0:
                raise ModelcarveError(f"verify of {layout.short()} did not complete (ranks exited with code {code})")
            return code
        report = json.load(open(path))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    if report.get("against_plan") is not None:
        from modelcarve.verify.against_plan import unjudged

        reasons = unjudged(report["against_plan"])
        if reasons:  # no silent pass: a check that could not be made is not a PASS (exit 2, the reason)
            sys.stderr.write(f"modelcarve: error: verify --against-plan could not judge {layout.short()}: "
                             f"{'; '.join(reasons)}\n")
            return 2
    return 0 if report["passed"] else 1


def print_report(report: dict) -> None:
    from rich.table import Table

    from modelcarve.report.tables import console as wide_console
    from modelcarve.verify.reference import summarise

    console = wide_console()
    if report.get("reference") == "transformers":
        title = (f"verify {report['model']} {report['layout']} ({report['world_size']} ranks, {report['dtype']}): "
                 f"our reference and the split layout against transformers ({len(report['prompt_lengths'])} "
                 f"prompts of {min(report['prompt_lengths'])}-{max(report['prompt_lengths'])} tokens, "
                 f"{report['new_tokens']} greedy tokens each)")
    else:
        title = (f"verify {report['model']} {report['layout']} ({report['world_size']} ranks, "
                 f"{report['steps']} AdamW steps, {report['dtype']}) against the single-device reference")
    table = Table(title=title)
    for col in ("compared", "n", "max abs diff", "max rel diff", "tolerance", "result", "worst"):
        table.add_column(col, justify="right" if col not in ("compared", "worst") else "left")
    for row in summarise(report):
        if not row["count"]:
            if row["kind"] == "routing" and not report.get("moe"):
                continue  # a dense model has no routing to compare
            table.add_row(row["kind"], "0", "-", "-", "-", "[dim]not compared for this layout[/]", "")
            continue
        tol = f"{row['tol']:.0e} {row['metric']}"
        result = "[green]pass[/]" if row["passed"] else "[red]FAIL[/]"
        table.add_row(row["kind"], str(row["count"]), f"{row['max_abs']:.2e}", f"{row['max_rel']:.2e}", tol, result, row["worst"])
    console.print(table)
    if report.get("moe"):
        from modelcarve.report.moe import moe_stats_table

        console.print(moe_stats_table(report["moe"][-1], "experts, last step (tokens = routed assignments)"))
    failed = [c for c in report["checks"] if not c["passed"]]
    for c in failed[:20]:
        console.print(f"[red]FAIL[/] {c['name']}: max abs {c['max_abs']:.3e}, max rel {c['max_rel']:.3e} > tol {c['tol']:.0e}")
    if report.get("against_plan") is not None:
        from modelcarve.report.against_plan import against_plan_table

        console.print(against_plan_table(report))
    outside = sum(r["ok"] is False for r in report.get("against_plan") or [])
    if report.get("against_plan") is not None:
        from modelcarve.verify.against_plan import unjudged

        reasons = unjudged(report["against_plan"])
        if reasons:
            n = sum(r["ok"] is None and r.get("why") in reasons for r in report["against_plan"])
            console.print(f"[bold red]NOT JUDGED[/] ({n} against-plan rows could not be judged: {'; '.join(reasons)}"
                          + (f"; {len(failed)} of {len(report['checks'])} checks failed" if failed else "")
                          + (f", {outside} rows outside" if outside else "") + ")")
            return
    console.print("[bold green]PASS[/]" if report["passed"] else f"[bold red]FAIL[/] ({len(failed)} of {len(report['checks'])} checks"
                  + (f", {outside} against-plan rows outside" if outside else "") + ")")
