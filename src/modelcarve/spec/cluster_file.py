"""The typed schema of cluster files (YAML or JSON): every field's type, range and meaning.

``validate(raw, where, lookup)`` checks a parsed cluster file against the schema and returns plain
keyword dicts for ``DeviceSpec``, ``LinkSpec`` and ``ClusterSpec`` (spec/hardware.py builds them);
each problem is one SpecError naming the field (``device.memory_bytes must be a number ...``).
``lookup(table, name)`` finds a catalogue entry (hardware.py passes its own), which is how a
device or link says ``base: H100`` and overrides single fields. ``schema_text()`` is the schema
as ``modelcarve hardware --help`` and docs/cluster_files.md show it.

Numbers may be written as YAML/JSON numbers or as strings of a number: YAML 1.1 reads ``4.0e12``
(no sign in the exponent) as a string, and that string is read as the number it means. Counts are
capped (``MAX_NODES``, ``MAX_DEVICES_PER_NODE``, ``MAX_DEVICES``) so that a typo of 2^63 devices is
refused at once instead of keeping the planner busy for minutes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import modelcarve.spec.config_checks as config_checks
from modelcarve.spec.config_checks import _show
from modelcarve.spec.errors import SpecError

MAX_NODES = 2**17
MAX_DEVICES_PER_NODE = 4096
MAX_DEVICES = 2**20
"""At most 1,048,576 devices in one cluster (the largest published training clusters hold ~10^5)."""


@dataclass(frozen=True)
class Field:
    kind: str
    """int, number, string, flops (dtype -> FLOP/s), device (name or mapping), link (name or mapping)."""
    doc: str
    low: float = 0
    high: float = math.inf
    low_open: bool = False
    """The value must be strictly above ``low``."""


DEVICE_FIELDS = {
    "base": Field("string", "catalogue device to start from (H100, B200, ...); the fields below override it"),
    "name": Field("string", "name shown in plans (default: the base's name)"),
    "memory_bytes": Field("int", "device memory, bytes (80 GiB = 85899345920)", 1, 1e18),
    "peak_flops": Field("flops", "dense peak FLOP/s per dtype: {bf16: 9.894e14, fp8: ...}; with a base, "
                                 "the dtypes given replace the base's, the others are kept", 0, 1e21, True),
    "hbm_bytes_per_s": Field("number", "memory bandwidth, bytes/s", 0, 1e18, True),
    "intra_link": Field("string", "catalogue link inside a node (used when the cluster gives none)"),
    "inter_link": Field("string", "catalogue link between nodes (used when the cluster gives none)"),
    "nics_per_node": Field("int", "NICs per node (used when the cluster gives none)", 1, 4096),
    "devices_per_node": Field("int", "devices per node (used when the cluster gives none)", 1, MAX_DEVICES_PER_NODE),
    "nvlink_domain": Field("int", "devices sharing intra_link when more than a node (NVL72: 72); 0 = the node",
                           0, MAX_DEVICES),
    "gemm_efficiency": Field("number", "0 = model the achievable fraction of the peaks (GPU-fitted); > 0: peak_flops and "
                             "hbm_bytes_per_s are achieved rates (hardware --probe writes 1) and the planner applies this "
                             "fraction flat", 0, 1.0),
    "step_overhead_s": Field("number", "measured host seconds every engine step costs (hardware --probe)", 0, 10.0),
    "usd_per_hour": Field("number", "what one device-hour costs you, US dollars (plan/estimate --price overrides; "
                                    "0 = the catalogue's list price)", 0, 1e6),
    "layer_overhead_s": Field("number", "measured host seconds per layer per engine step; 0 = the GPU-fitted constant", 0, 1.0),
    "request_overhead_s": Field("number", "measured host seconds a served request's path adds to TTFT (hardware --probe)",
                                0, 10.0),
    "pipeline_action_s": Field("number", "measured host seconds a pipeline rank spends per schedule action "
                                         "(hardware --probe)", 0, 1.0),
    "source": Field("string", "where the figures come from"),
}
LINK_FIELDS = {
    "base": Field("string", "catalogue link to start from (nvlink4, ib-ndr, ...)"),
    "name": Field("string", "name shown in plans (default: the base's name, or the field's)"),
    "bytes_per_s": Field("number", "bandwidth per direction per device, bytes/s", 0, 1e16, True),
    "latency_s": Field("number", "per-message latency, seconds", 0, 1.0),
    "peer_latency_s": Field("number", "per-step latency of a one-/two-shot all-reduce through peer memory (serving's TP "
                                      "all-reduce; hardware --probe); 0 = latency_s", 0, 1.0),
    "source": Field("string", "where the figures come from"),
}
CLUSTER_FIELDS = {
    "nodes": Field("int", "nodes (default 1)", 1, MAX_NODES),
    "devices_per_node": Field("int", "devices per node (default: the device's)", 1, MAX_DEVICES_PER_NODE),
    "device": Field("device", "a catalogue name (H100) or a mapping of the device fields below"),
    "intra_link": Field("link", "link inside a node: a catalogue name or a mapping of the link fields "
                                "(default: the device's)"),
    "inter_link": Field("link", "link between nodes, as intra_link (default: the device's)"),
    "nics_per_node": Field("int", "NICs per node, shared by its devices (default: the device's)", 1, 4096),
    "nvlink_domain": Field("int", "devices sharing intra_link across nodes (NVL72: 72); 0 = the node", 0,
                           MAX_DEVICES),
    "num_devices": Field("int", "optional check: nodes x devices_per_node (as `hardware --json` writes it)", 1,
                         MAX_DEVICES),
}

_NUMBER = re.compile(r"^[-+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")

Lookup = Callable[[str, str], tuple[str, dict]]


def _kind(value) -> str:
    return config_checks._kind(value, "list", "mapping")


def _num(x: float) -> str:
    return f"{int(x):,}" if x == int(x) and abs(x) < 1e9 else f"{x:g}"


def _range(field: Field) -> str:
    low = f"> {_num(field.low)}" if field.low_open else f">= {_num(field.low)}"
    return low if field.high == math.inf else f"{low} and <= {_num(field.high)}"


def _number(value, name: str, field: Field, where: str) -> float | int:
    """A number from a number or a string of one (YAML 1.1's ``4.0e12``), in the field's range."""
    what = "an integer" if field.kind == "int" else "a number"
    number = value
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        number = float(value.strip().replace("_", ""))
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise SpecError(f"{where}: {name} must be {what} {_range(field)}, got {_kind(value)} {_show(value)}")
    if isinstance(number, float) and not math.isfinite(number) or number < field.low or (field.low_open and number <= field.low) \
            or number > field.high:
        raise SpecError(f"{where}: {name}={_show(value)} is outside the accepted range ({_range(field)})")
    if field.kind == "int":
        if number != int(number):
            raise SpecError(f"{where}: {name}={_show(value)} must be a whole number")
        return int(number)
    return float(number)


def _mapping(raw, fields: dict[str, Field], prefix: str, where: str) -> dict:
    """The fields of ``raw`` checked against ``fields`` (keys named ``prefix.key`` in messages)."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: {prefix or 'the file'} must be a mapping, got {_kind(raw)} {_show(raw)}")
    unknown = [k for k in raw if k not in fields]
    if unknown:
        names = [f"{prefix}.{k}" if prefix else str(k) for k in unknown]
        raise SpecError(f"{where}: unknown keys {_show(names)}; known: {', '.join(fields)}")
    out = {}
    for key, value in raw.items():
        field, name = fields[key], f"{prefix}.{key}" if prefix else key
        if field.kind in ("int", "number"):
            out[key] = _number(value, name, field, where)
        elif field.kind == "string":
            if not isinstance(value, str) or not value.strip() and key != "source":
                raise SpecError(f"{where}: {name} must be a non-empty string, got {_kind(value)} {_show(value)}")
            if len(value) > 1000:
                raise SpecError(f"{where}: {name} is {len(value)} characters long; at most 1000")
            out[key] = value
        elif field.kind == "flops":
            if not isinstance(value, dict) or not value:
                raise SpecError(f"{where}: {name} must be a mapping of dtype to FLOP/s (e.g. {{bf16: 9.894e14}}), "
                                f"got {_kind(value)} {_show(value)}")
            flops = {}
            for dtype, peak in value.items():
                if not isinstance(dtype, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", dtype):
                    raise SpecError(f"{where}: {name} has a key {_show(dtype)} that is not a dtype name "
                                    f"(bf16, fp16, fp8, int8, tf32, fp32, fp4)")
                flops[dtype] = _number(peak, f"{name}.{dtype}", field, where)
            out[key] = flops
        else:
            out[key] = value
    return out


def _device(raw, lookup: Lookup, where: str) -> dict:
    if isinstance(raw, str):
        key, entry = lookup("devices", raw)
        return dict(entry, name=key)
    fields = _mapping(raw, DEVICE_FIELDS, "device", where)
    base = {}
    if "base" in fields:
        key, entry = lookup("devices", fields.pop("base"))
        base = dict(entry, name=key)
        if "peak_flops" in fields:
            fields["peak_flops"] = dict(base["peak_flops"]) | fields["peak_flops"]
    device = base | fields
    missing = [k for k in ("name", "memory_bytes", "peak_flops", "hbm_bytes_per_s") if k not in device]
    if missing:
        raise SpecError(f"{where}: device lacks {', '.join(missing)}; give them, or base: a catalogue device "
                        f"(e.g. base: H100) and only the fields that differ")
    if "bf16" not in device["peak_flops"]:
        raise SpecError(f"{where}: device.peak_flops needs a bf16 entry (the planner's default GEMM dtype)")
    return device


def _link(raw, name: str, lookup: Lookup, where: str) -> dict:
    if isinstance(raw, str):
        if not raw:
            raise SpecError(f"{where}: {name} is missing; give a catalogue link name or a mapping with "
                            f"bytes_per_s and latency_s")
        key, entry = lookup("links", raw)
        return dict(entry, name=key)
    fields = _mapping(raw, LINK_FIELDS, name, where)
    base = {}
    if "base" in fields:
        key, entry = lookup("links", fields.pop("base"))
        base = dict(entry, name=key)
    link = {"name": name} | base | fields
    missing = [k for k in ("bytes_per_s", "latency_s") if k not in link]
    if missing:
        raise SpecError(f"{where}: {name} lacks {', '.join(missing)}; give them, or base: a catalogue link")
    return link


def validate(raw, where: str, lookup: Lookup) -> dict:
    """Keyword dicts for ClusterSpec: ``device`` and the two links as dicts of their fields."""
    fields = _mapping(raw, CLUSTER_FIELDS, "", where)
    if "device" not in fields:
        raise SpecError(f"{where}: missing 'device' (a catalogue name such as H100, or a mapping)")
    if not isinstance(fields["device"], (str, dict)):
        raise SpecError(f"{where}: device must be a catalogue name or a mapping, got {_kind(fields['device'])} "
                        f"{_show(fields['device'])}")
    device = _device(fields["device"], lookup, where)
    per_node = fields.get("devices_per_node", device.get("devices_per_node", 8))
    nodes = fields.get("nodes", 1)
    domain_default = device.get("nvlink_domain", 0) if per_node == device.get("devices_per_node", 8) else 0
    out = dict(
        nodes=nodes,
        devices_per_node=per_node,
        device=device,
        nics_per_node=fields.get("nics_per_node", device.get("nics_per_node", 8)),
        nvlink_domain=fields.get("nvlink_domain", domain_default),
    )
    for name in ("intra_link", "inter_link"):
        value = fields.get(name, device.get(name, ""))
        if not isinstance(value, (str, dict)):
            raise SpecError(f"{where}: {name} must be a catalogue link name or a mapping, got {_kind(value)} "
                            f"{_show(value)}")
        out[name] = _link(value, name, lookup, where)
    check_counts(nodes, per_node, where)
    if "num_devices" in fields and fields["num_devices"] != nodes * per_node:
        raise SpecError(f"{where}: num_devices={fields['num_devices']} but nodes x devices_per_node = "
                        f"{nodes} x {per_node} = {nodes * per_node}; fix one or drop num_devices")
    return out


def check_counts(nodes: int, per_node: int, where: str) -> None:
    """Refuse a cluster too large to plan (see the caps above)."""
    if not 1 <= per_node <= MAX_DEVICES_PER_NODE:
        raise SpecError(f"{where}: devices_per_node={per_node} is outside 1..{MAX_DEVICES_PER_NODE:,}")
    if not 1 <= nodes <= MAX_NODES:
        raise SpecError(f"{where}: nodes={nodes} is outside 1..{MAX_NODES:,}")
    if nodes * per_node > MAX_DEVICES:
        raise SpecError(f"{where}: {nodes} x {per_node} = {nodes * per_node:,} devices is more than the "
                        f"{MAX_DEVICES:,} modelcarve plans for")


def schema_text() -> str:
    """The schema as the help and the docs show it."""
    lines = ["Cluster file (YAML or JSON; `hardware --cluster X --json` output reads back as one):", ""]
    for title, fields in (("top level", CLUSTER_FIELDS), ("device (mapping)", DEVICE_FIELDS),
                          ("intra_link / inter_link (mapping)", LINK_FIELDS)):
        lines.append(f"  {title}:")
        for key, field in fields.items():
            kind = {"int": "integer", "flops": "mapping"}.get(field.kind, field.kind)
            span = f" {_range(field)}" if field.kind in ("int", "number") else ""
            lines.append(f"    {key:<19}{kind}{span}: {field.doc}")
        lines.append("")
    lines += [
        "  Numbers may be strings of a number (YAML 1.1 reads 4.0e12 as a string; it is read as 4e12).",
        f"  Caps: nodes <= {MAX_NODES:,}, devices_per_node <= {MAX_DEVICES_PER_NODE:,}, "
        f"devices <= {MAX_DEVICES:,}.",
        "  Example:",
        "    nodes: 4",
        "    device: {base: H100, memory_bytes: 1.0e11, peak_flops: {fp8: 2.0e15}}",
        "    inter_link: {base: ib-ndr, bytes_per_s: 2.5e10}",
    ]
    return "\n".join(lines)
