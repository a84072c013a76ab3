"""``modelcarve layout LAYOUT [--model M] [--cluster C | --world-size N]``: parse, check, print.

Prints the layout's short form and the JSON that ``run`` reads (``--emit FILE`` writes it),
after validating it against a model and cluster when given. Exit 2 with one line on bad input.
"""

from __future__ import annotations

from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout


def register(sub) -> None:
    p = sub.add_parser("layout", help="parse and validate a layout string or file; print its JSON")
    p.add_argument("layout", help='e.g. "tp=8,pp=4,dp=2,zero=1,mbs=1" or layout.json')
    p.add_argument("--model", help="validate against this model (catalogue name or config.json)")
    p.add_argument("--cluster", help="validate the device count against this cluster (e.g. 2x8xH200)")
    p.add_argument("--world-size", type=int, help="validate against this many ranks instead of a cluster")
    p.add_argument("--emit", help="write the layout JSON to this file")
    p.set_defaults(func=_layout)


def _layout(args) -> int:
    from modelcarve.spec import files

    if args.emit:
        files.output_path(args.emit, "--emit")
    layout = Layout.parse(args.layout)
    if args.model:
        cluster = parse_cluster(args.cluster) if args.cluster else None
        layout.validate(get_model(args.model), cluster, world_size=args.world_size)
    elif args.cluster or args.world_size:
        devices = parse_cluster(args.cluster).num_devices if args.cluster else args.world_size
        if layout.world_size != devices:
            from modelcarve.spec.errors import LayoutError

            raise LayoutError(f"layout {layout.short()} uses {layout.world_size} devices but {devices} are given")
    if args.emit:
        files.write_text(args.emit, layout.to_json() + "\n", "--emit")
    print(layout.short())
    print(layout.to_json())
    return 0
