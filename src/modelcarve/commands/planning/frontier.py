"""The newer serving answers on the command line: ``plan --goal serve-disagg``, ``plan --pareto``,
``estimate --phase prefill|decode`` and ``estimate --rate`` (TTFT with queueing).

Usage::

    modelcarve plan --goal serve-disagg --model llama-3.1-70b --cluster 2x8xH100 --input-len 4096 --output-len 512 \\
        --ttft-ms 2000 --tpot-ms 30
    modelcarve plan --goal serve-throughput --pareto --plot front.png --model llama-3.1-70b --cluster 8xH100
    modelcarve estimate --goal serve-throughput --phase decode --layout tp=4,weight_dtype=fp8 --model ... --cluster 8xH100
    modelcarve estimate --goal serve-throughput --rate 20 --layout tp=2,weight_dtype=fp8 --model ... --cluster 8xH100

commands/planning/serving_plan.py hands these flags here; the figures come from plan/serve/disagg.py,
plan/serve/pareto.py and plan/serve/queue.py, the tables and plot from report/frontier.py.
"""

from __future__ import annotations

import json

from modelcarve.spec.errors import ModelcarveError


def run_frontier_plan(args, model, cluster, options: dict, *, top: int = 5) -> int:
    from modelcarve.report.frontier import plot_pareto, print_disagg_plan, print_pareto
    from modelcarve.report.tables import console as make_console

    as_json = getattr(args, "json", False)
    if getattr(args, "pareto", False):
        from modelcarve.plan.serve.pareto import pareto_front

        front = pareto_front(model, cluster, **options)
        from modelcarve.commands.planning.pricing import wants_cost

        if wants_cost(args):  # issue 30: the front priced, $/M output tokens against tokens/s per user
            from modelcarve.commands.planning.pricing import cluster_price
            from modelcarve.plan.pricing import price_front

            usd, source = cluster_price(args, cluster)
            front["priced"] = price_front(front, usd_per_device_hour=usd, utilisation=args.utilisation or 1.0)
            front["price"] = dict(usd_per_device_hour=usd, source=source, utilisation=args.utilisation or 1.0)
        if as_json:
            print(json.dumps(front, indent=2, default=str))
        else:
            console = make_console()
            console.print(f"{model.name} on {cluster.describe()}")
            print_pareto(front, console)
        if getattr(args, "plot", None) and "priced" in front:
            from modelcarve.report.pricing import plot_priced_front

            plot_priced_front(front["priced"], front["price"], args.plot, title=f"{model.name} on {cluster.name}")
            if not as_json:
                print(f"wrote {args.plot}")
        elif getattr(args, "plot", None):
            plot_pareto(front, args.plot, title=f"{model.name} on {cluster.name}")
            if not as_json:
                print(f"wrote {args.plot}")
        return 0 if front["front"] else 1
    from modelcarve.plan.search import nothing_qualifies, search

    plan = search(model, cluster, "serve-disagg", top=top, **options)
    if not plan["layouts"] and not as_json:
        raise nothing_qualifies(plan, f"no prefill/decode split of {model.name} qualifies on {cluster.name}")
    colocated = search(model, cluster, "serve-throughput", top=1, **options)
    best_colocated = colocated["layouts"][0] if colocated["layouts"] else None
    if as_json:
        print(json.dumps(dict(plan, colocated=best_colocated), indent=2, default=str))
    else:
        console = make_console()
        console.print(f"{model.name} on {cluster.describe()}")
        print_disagg_plan(plan, best_colocated, console)
    if getattr(args, "emit", None) and plan["layouts"]:
        best = plan["layouts"][0]
        with open(args.emit, "w") as handle:
            json.dump({"prefill": best["prefill_layout"], "decode": best["decode_layout"],
                       "prefill_units": best["serve"]["prefill_units"], "decode_units": best["serve"]["decode_units"]}, handle, indent=2)
    return 0 if plan["layouts"] else 1


def run_frontier_estimate(args, model, cluster, layout, options: dict) -> int:
    from modelcarve.plan.serve.disagg import phase_estimate

    if not getattr(args, "phase", None):
        raise ModelcarveError("estimate --goal serve-disagg costs one unit: add --phase prefill or --phase decode "
                              "(or use plan --goal serve-disagg to choose both pools)")
    result = phase_estimate(model, cluster, layout, args.phase, **options)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, default=str))
    else:
        from modelcarve.report.frontier import print_phase_estimate

        print_phase_estimate(result)
    return 0 if result["fits"] and not result["reject_reason"] else 1


def attach_queue(args, result: dict) -> None:
    """``estimate --rate``: the result's TTFT with queueing (``result['queue']``), refused past capacity.
    The serving goals cost the layout at the rate themselves (the sustained batch, the queue in
    TTFT: plan/serve/goal.py); a result without a queue gets one at its own batch."""
    from modelcarve.plan.serve.options import serve_options
    from modelcarve.plan.serve.queue import check_rate, with_rate

    if args.rate <= 0:
        raise ModelcarveError(f"--rate {args.rate:g} must be a positive number of requests/s")
    if not result.get("serve"):
        return
    if "queue" not in result:
        output_len = serve_options(output_len=getattr(args, "output_len", None)).output_len
        with_rate(result, args.rate, output_len)
    check_rate(args.rate, result["queue"]["capacity_total_rps"], result["name"])
    if not getattr(args, "json", False):
        q = result["queue"]
        batch = f"; {q['batch']} sequences in flight per replica at this rate" if "batch" in q else ""
        print(f"at {args.rate:g} requests/s ({q['utilisation']:.0%} of capacity {q['capacity_total_rps']:.2f} req/s, "
              f"{q['queue_model']}): queue wait {q['wait_s'] * 1e3:.0f} ms, TTFT {q['ttft_s'] * 1e3:.0f} ms{batch}")
