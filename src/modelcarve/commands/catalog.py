"""``modelcarve models [show NAME] [--json]`` and ``modelcarve hardware``: the catalogues."""

from __future__ import annotations

import json

from modelcarve.report.tables import console
from modelcarve.spec.catalog import catalog_entry, get_model, model_names
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import get_device, get_link, device_names, link_names, parse_cluster
from modelcarve.spec.layout import DTYPE_BYTES


def register(sub) -> None:
    models = sub.add_parser("models", help="list catalogued models, or show one")
    models.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    models.add_argument("name", nargs="?", help="catalogue name or config.json path (with show)")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=_models)

    import argparse

    from modelcarve.spec.cluster_file import schema_text

    hardware = sub.add_parser("hardware", help="list catalogued devices and links, or describe a cluster",
                              epilog=schema_text() + "\n\nSee docs/cluster_files.md.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    hardware.add_argument("--cluster", help="describe a cluster, e.g. 2x8xH200 or cluster.yaml (schema below)")
    hardware.add_argument("--json", action="store_true", help="machine-readable; with --cluster, a cluster file "
                                                               "that --cluster reads back")
    hardware.add_argument("--probe", action="store_true", help="measure this machine (GEMM, copy, gloo links) as a cluster file")
    hardware.add_argument("--probe-ranks", type=int, default=2, help="--probe: local ranks to measure with (default 2)")
    hardware.add_argument("--emit", default=None, metavar="YAML", help="--probe: write the measured cluster file here")
    hardware.add_argument("--probe-quick", action="store_true",
                          help="--probe: serve each probe model for one pass of 2 requests (after 1 warm-up) instead of "
                               "two passes of 8: the same measurements, noisier figures, in less time (a smoke test)")
    hardware.set_defaults(func=_hardware)


def _human(count: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}{unit}"
    return f"{count:.0f}{unit}"


def _gb(n: float) -> str:
    """Bytes in GiB, the unit ``plan`` and ``estimate`` print, so the same weights read the same."""
    return f"{n / 2**30:,.1f} GiB"


def _models(args) -> int:
    from rich.table import Table

    if args.action == "show":
        if not args.name:
            raise SpecError("models show needs a NAME; e.g. modelcarve models show kimi-k2")
        spec = get_model(args.name)
        data = spec.to_dict()
        if args.json:
            print(json.dumps(data, indent=2))
            return 0
        out = console()
        table = Table(title=f"{spec.name} ({spec.family})", show_header=False)
        for key, value in data.items():
            if key == "moe_layers" and value:
                value = f"{len(value)} layers: {value[0]}..{value[-1]}"
            if key in ("total_params", "active_params"):
                value = f"{value:,} ({_human(value)})"
            table.add_row(key, str(value))
        out.print(table)
        return 0

    rows = []
    for name in model_names():
        spec = get_model(name)
        entry = catalog_entry(name)
        rows.append(
            dict(
                name=name,
                family=entry["family"],
                layers=spec.num_layers,
                total_params=spec.total_params,
                active_params=spec.active_params,
                experts=spec.num_experts,
                top_k=spec.top_k,
                **{f"weights_{d}_bytes": int(spec.total_params * DTYPE_BYTES[d]) for d in ("bf16", "fp8", "int4")},
            )
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="Catalogued models (weights only: no KV cache, activations or optimiser)")
    for col in ("name", "family", "layers", "total", "active", "experts", "bf16", "fp8", "int4"):
        table.add_column(col, justify="left" if col in ("name", "family") else "right")
    for r in rows:
        table.add_row(
            r["name"],
            r["family"],
            str(r["layers"]),
            _human(r["total_params"]),
            _human(r["active_params"]),
            f"{r['experts']} (top {r['top_k']})" if r["experts"] else "-",
            _gb(r["weights_bf16_bytes"]),
            _gb(r["weights_fp8_bytes"]),
            _gb(r["weights_int4_bytes"]),
        )
    console().print(table)
    return 0


def _hardware(args) -> int:
    from rich.table import Table

    if getattr(args, "probe", False):
        if getattr(args, "emit", None):
            from modelcarve.spec.files import output_path

            output_path(args.emit, "--emit")  # before measuring, not after
        from modelcarve.commands.probe.machine import run_probe

        return run_probe(args)

    if args.cluster:
        cluster = parse_cluster(args.cluster)
        if args.json:
            from dataclasses import asdict

            print(json.dumps(asdict(cluster) | {"num_devices": cluster.num_devices}, indent=2))
        else:
            print(cluster.describe())
        return 0
    devices = [get_device(n) for n in device_names()]
    links = [get_link(n) for n in link_names()]
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"devices": [asdict(d) for d in devices], "links": [asdict(l) for l in links]}, indent=2))
        return 0
    out = console()
    table = Table(title="Devices (dense peaks)")
    for col in ("device", "memory", "HBM", "bf16", "fp8", "int8", "node links", "source"):
        table.add_column(col, overflow="fold")
    for d in devices:
        fp8 = d.peak_flops.get("fp8")
        table.add_row(
            d.name,
            f"{d.memory_bytes / 2**30:.0f} GiB",
            f"{d.hbm_bytes_per_s / 1e12:.2f} TB/s",
            f"{d.peak_flops['bf16'] / 1e12:.0f} TFLOP/s",
            f"{fp8 / 1e12:.0f} TFLOP/s" if fp8 else "-",
            f"{d.peak_flops['int8'] / 1e12:.0f} TOP/s",
            f"{d.devices_per_node}x {d.intra_link}, {d.nics_per_node}x {d.inter_link}"
            + (f"; NVLink domain of {d.nvlink_domain}" if d.nvlink_domain else ""),
            d.source,
        )
    out.print(table)
    table = Table(title="Links (per direction per device)")
    for col in ("link", "bandwidth", "latency", "source"):
        table.add_column(col, overflow="fold")
    for l in links:
        table.add_row(l.name, f"{l.bytes_per_s / 1e9:.1f} GB/s", f"{l.latency_s * 1e6:.0f} us", l.source)
    out.print(table)
    return 0
