"""``modelcarve run --dry-run``: per-rank weight / gradient / optimiser bytes of a layout at full
scale, measured on the meta device under torch's fake process group, beside the planner's.

    modelcarve run --dry-run --model deepseek-v3 --layout layout.json --cluster 256x8xH100 [--json]

No rank is started and no device is needed (runtime/dryrun/state_bytes.py). Exit 0 when every
distinct rank matches the planner, 1 when any category differs, 2 on bad input.

With ``--check-order`` the collective order is checked first at the same full world size
(runtime/dryrun/rank_programs.py: one training step of one rank per pipeline stage on meta, every
rank's groups instantiated from its coordinates): a mismatched order is refused (exit 2, the
LayoutError naming two ranks) before the bytes; the ranks and collectives checked are printed
(``order`` in the JSON).
"""

from __future__ import annotations

import json

from modelcarve.spec.errors import LayoutError


def dry_run(args) -> int:
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster
    from modelcarve.spec.layout import Layout

    if not args.cluster:
        raise LayoutError("--dry-run compares with the planner's figures for a cluster; give --cluster, e.g. 256x8xH100")
    layout = Layout.parse(args.layout)
    if args.dtype:
        layout = layout.replace(param_dtype=args.dtype)
    spec = get_model(args.model)
    cluster = parse_cluster(args.cluster)
    layout.validate(spec, cluster)
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise LayoutError("--dry-run needs PyTorch, which is not installed: pip install torch==2.13.0 (CPU)")
    from modelcarve.runtime.dryrun.state_bytes import dry_run_bytes, format_report

    order = None
    if getattr(args, "check_order", False):
        from modelcarve.runtime.dryrun.rank_programs import check_layout_order_at_scale

        order = check_layout_order_at_scale(args.model, layout, cluster, seed=getattr(args, "seed", 0))
        if not args.json:
            print(f"collective order: {order['world_size']} ranks agree ({order['classes']} classes played: ranks "
                  f"{order['ranks_played'][:8]}{'...' if order['classes'] > 8 else ''}; {order['collectives']} "
                  f"collectives over every rank; {order['elapsed_s']} s)")
    report = dry_run_bytes(args.model, layout, cluster)
    if order is not None:
        report["order"] = order
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["ok"] else 1
