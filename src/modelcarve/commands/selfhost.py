"""``modelcarve selfhost``: the comparison the background reading ends on, as one table.

The same model served in each weight dtype on the fewest devices of one kind that hold it (bf16 on
several, fp8 / int4 / fp4 on fewer), each with its TTFT / TPOT, tokens/s per device, dollars per
million output tokens at the stated utilisation and its usual quality cost, beside a hosted API's
price and the request rate above which self-hosting wins; ``--vs`` adds a second model (a dense
model against an MoE of similar quality) on the same device kind.

    modelcarve selfhost --model qwen3-32b --device H100 --api-price 0.10,0.30 --utilisation 0.4
    modelcarve selfhost --model qwen3-32b --vs qwen3-30b-a3b --device H100 --price H100=2.49

Each row is ``plan --goal serve-throughput`` on ``N x DEVICE`` with that one weight dtype, N the
smallest power of two up to ``--max-devices`` where a layout qualifies; dollars by plan/pricing.py.
"""

from __future__ import annotations

import json

from modelcarve.spec.errors import ModelcarveError

DTYPES = ("bf16", "fp8", "int4", "fp4")


def register(sub) -> None:
    from modelcarve.commands.planning.pricing import add_price_arguments
    from modelcarve.commands.planning.serving_plan import add_serve_arguments

    p = sub.add_parser("selfhost", help="one model (or two) in each weight dtype on the fewest devices, priced, "
                                        "against a hosted API")
    p.add_argument("--model", required=True, help="catalogue name or config.json path")
    p.add_argument("--vs", metavar="MODEL", help="a second model to set beside it (e.g. an MoE of similar quality)")
    p.add_argument("--device", required=True, help="the device kind, e.g. H100, H200, B200")
    p.add_argument("--max-devices", type=int, default=8, help="largest single-node device count tried (default 8)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"weight dtypes to compare (default {','.join(DTYPES)})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_serve_arguments(p)
    add_price_arguments(p)
    p.set_defaults(func=_selfhost)


def compare(model, device: str, dtypes: tuple[str, ...], max_devices: int, options: dict, args) -> list[dict]:
    """One row per weight dtype: the winner on the fewest devices that hold the model, priced."""
    from modelcarve.commands.planning.pricing import attach_costs
    from modelcarve.plan.search import search
    from modelcarve.spec.hardware import parse_cluster

    rows = []
    for dtype in dtypes:
        n, found = 1, None
        while n <= max_devices and found is None:
            cluster = parse_cluster(f"{n}x{device}")
            plan = search(model, cluster, "serve-throughput", top=1, **(options | {"weight_dtypes": dtype}))
            if plan["layouts"]:
                found = (cluster, plan["layouts"][0])
            n *= 2
        if found is None:
            rows.append(dict(model=model.name, weight_dtype=dtype, devices=None,
                             why=f"does not fit on {max_devices} x {device} in {dtype}"))
            continue
        cluster, best = found
        attach_costs(args, cluster, [best], serving=True)
        serve = best["serve"]
        rows.append(dict(model=model.name, weight_dtype=dtype, devices=cluster.num_devices, layout=best.get("name", ""),
                         ttft_s=serve["ttft_s"], tpot_s=serve["tpot_s"],
                         tokens_per_s_per_device=serve["tokens_per_s_per_device"], quality=best.get("quality_short", ""),
                         quality_note=best.get("quality", ""), cost=best["cost"]))
    return rows


def _selfhost(args) -> int:
    from modelcarve.commands.planning.serving_plan import serve_options_from_args
    from modelcarve.spec.catalog import get_model

    if args.max_devices < 1:
        raise ModelcarveError(f"--max-devices {args.max_devices}: give at least 1")
    dtypes = tuple(d for d in args.dtypes.replace(" ", "").split(",") if d)
    if not dtypes:
        raise ModelcarveError("--dtypes: give at least one weight dtype, e.g. bf16,fp8,int4")
    if args.price is None and args.api_price is None and args.utilisation is None:
        args.utilisation = 1.0  # priced at full load with the catalogue's price: say so in the table
    options = serve_options_from_args(args)
    options.pop("weight_dtypes", None)
    models = [get_model(args.model)] + ([get_model(args.vs)] if args.vs else [])
    rows = [row for model in models for row in compare(model, args.device, dtypes, args.max_devices, options, args)]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from modelcarve.report.pricing import selfhost_table
    from modelcarve.report.tables import console

    out = console()
    out.print(selfhost_table(rows, args.device))
    priced = next((r["cost"] for r in rows if r.get("cost")), None)
    if priced:
        out.print(f"price: ${priced['usd_per_device_hour']:.2f} per device-hour ({priced['price_source']}); "
                  f"utilisation {priced['utilisation']:.0%}, idle capacity paid")
    return 0 if any(r.get("cost") for r in rows) else 1
