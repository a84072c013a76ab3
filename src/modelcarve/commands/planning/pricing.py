"""The cost flags of ``plan`` and ``estimate`` (``--price``, ``--utilisation``, ``--api-price``,
``--train-tokens``, ``--overhead``): each estimate gets a ``cost`` entry (plan/pricing.py's
arithmetic at spec/prices.py's price), printed as one more table.

    modelcarve plan --goal serve-throughput --model qwen3-32b --cluster 1xH100 --price H100=2.49 \\
        --api-price 0.10,0.30 --utilisation 0.4
    modelcarve plan --goal train --model llama-3.1-8b --cluster 8x8xH100 --global-batch 512 --seq 8192 \\
        --price 2.49 --train-tokens 1e12 --overhead 0.1
"""

from __future__ import annotations

import argparse

from modelcarve.spec.errors import ModelcarveError


def add_price_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("cost (plan/pricing.py)")
    group.add_argument("--price", action="append", metavar="[DEVICE=]USD",
                       help="dollars per device-hour (repeatable; default: the catalogue's dated list price, "
                            "spec/catalog/prices.json)")
    group.add_argument("--utilisation", type=float, metavar="FRACTION",
                       help="serving: share of the capacity used on average (idle capacity is still paid); "
                            "default 1, or rate / capacity with --rate")
    group.add_argument("--api-price", metavar="IN,OUT",
                       help="serving: a hosted API's $ per million input and output tokens: prints the break-even rate")
    group.add_argument("--train-tokens", type=float, metavar="N",
                       help="training: price a run of N tokens (e.g. 15e12) on each layout")
    group.add_argument("--overhead", type=float, default=0.0, metavar="FRACTION",
                       help="training: time a run loses to failures, restarts and evaluation (default 0)")


def wants_cost(args) -> bool:
    return any(getattr(args, k, None) is not None for k in ("price", "utilisation", "api_price", "train_tokens"))


def _api_price(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(v >= 0 for v in values):
        raise ModelcarveError(f"--api-price {text!r}: give IN,OUT dollars per million input and output tokens, e.g. 0.10,0.30")
    return values


def cluster_price(args, cluster) -> tuple[float, str]:
    """(dollars per device-hour, its source) for ``cluster``'s device: ``--price``, else the cluster
    file's ``usd_per_hour``, else the catalogue (spec/prices.py)."""
    from modelcarve.spec.prices import device_price, parse_prices

    return device_price(cluster.device.name, parse_prices(args.price), cluster.device.usd_per_hour)


def attach_costs(args, cluster, results: list[dict], *, serving: bool) -> list[dict]:
    """Add ``cost`` to each estimate in ``results`` (in place) and return the cost rows."""
    from modelcarve.plan.pricing import serving_cost, training_cost
    from modelcarve.plan.serve.options import serve_options

    if not wants_cost(args):
        return []
    usd, source = cluster_price(args, cluster)
    # the request shape the plan was made for, with serve_options' defaults for what was not given
    shape = serve_options(input_len=getattr(args, "input_len", None), output_len=getattr(args, "output_len", None))
    util = args.utilisation
    if util is not None and not 0 < util <= 1:
        raise ModelcarveError(f"--utilisation {util}: give a fraction in (0, 1]")
    if util is not None and getattr(args, "rate", None):
        raise ModelcarveError("--utilisation and --rate both set the utilisation; give one")
    if args.overhead is not None and args.overhead < 0:
        raise ModelcarveError(f"--overhead {args.overhead}: give a fraction >= 0")
    rows = []
    for result in results:
        if "layout" not in result:
            continue
        if serving:
            if "serve" not in result:
                continue
            cost = serving_cost(result, devices=cluster.num_devices, usd_per_device_hour=usd,
                                input_len=shape.input_len, output_len=shape.output_len,
                                utilisation=util, api_price=_api_price(args.api_price))
        else:
            if args.train_tokens is None:
                raise ModelcarveError("pricing a training plan needs --train-tokens N (the run's tokens)")
            cost = training_cost(result, devices=cluster.num_devices, usd_per_device_hour=usd,
                                 tokens=args.train_tokens, overhead=args.overhead or 0.0)
        cost["price_source"] = source
        result["cost"] = cost
        rows.append(dict(name=result.get("name") or result.get("short") or "", **cost))
    return rows


def print_costs(rows: list[dict], *, serving: bool) -> None:
    if not rows:
        return
    from modelcarve.report.pricing import cost_table
    from modelcarve.report.tables import console

    out = console()
    out.print(cost_table(rows, serving=serving))
    out.print(f"price: ${rows[0]['usd_per_device_hour']:.2f} per device-hour ({rows[0]['price_source']})")
