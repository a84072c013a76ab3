"""Devices, links and clusters, and the catalogue they are looked up in.

A cluster is ``nodes x devices_per_node`` identical devices; devices inside a node talk over
``intra_link`` (bytes/s per direction per device), nodes over ``inter_link`` with
``nics_per_node`` NICs shared by the node's devices. Built from a shorthand string
(``2x8xH200``: nodes x devices x device, with that device's usual links), or from a YAML or
JSON file for anything else::

    nodes: 4
    devices_per_node: 8
    device: H100            # a catalogue name, or a mapping with DeviceSpec's fields
    intra_link: nvlink4     # a catalogue name, or {bytes_per_s: ..., latency_s: ...}
    inter_link: eth-100g
    nics_per_node: 2
    nvlink_domain: 72       # optional: devices sharing intra_link when larger than a node (NVL72)

The file's typed schema (``device: {base: H100, memory_bytes: ...}`` overrides, numbers written
as YAML 1.1 strings, count caps, messages naming the field) is spec/cluster_file.py's.

A rack-scale NVLink domain (GB200/GB300 NVL72: 72 GPUs on one NVLink Switch fabric, 4 per compute
tray) is larger than a node: ``nvlink_domain`` says how many devices share ``intra_link``, and the
planner places TP/EP/CP groups by domain, not by node (``ClusterSpec.fast_domain``). NICs stay per
node (``nics_per_node`` NICs for the tray's devices).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import modelcarve.spec.cluster_file as cluster_file
import modelcarve.spec.files as files
from modelcarve.spec.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One kind of link, as one device sees it."""

    name: str
    bytes_per_s: float
    """Bandwidth per direction per device (one port / one GPU's share of the switch)."""
    latency_s: float
    """Per-message latency (the alpha of an alpha-beta model), seconds."""
    peer_latency_s: float = 0.0
    """Per-step latency of a one-shot / two-shot all-reduce through peer memory (a serving engine's
    custom all-reduce over NVLink; the engine's shared-memory all-reduce on one CPU host,
    runtime/distributed/host_shm.py), measured by ``hardware --probe``; 0 = ``latency_s``."""
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float] = field(compare=False)
    """Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16, fp8, int8); absent = unsupported."""
    hbm_bytes_per_s: float
    intra_link: str = ""
    """Catalogue name of the link this device usually has inside a node."""
    inter_link: str = ""
    """Catalogue name of the NIC this device's nodes usually have."""
    nics_per_node: int = 8
    devices_per_node: int = 8
    nvlink_domain: int = 0
    """Devices sharing ``intra_link`` when that is more than a node (NVL72 racks: 72); 0 = the node."""
    gemm_efficiency: float = 0.0
    """0: ``peak_flops`` / ``hbm_bytes_per_s`` are datasheet peaks and the planner models the achievable
    fraction (GPU-fitted). > 0: they are achieved rates (``hardware --probe`` measures them and writes
    1.0) and the serving planner multiplies by this fraction only, applying no efficiency model again."""
    step_overhead_s: float = 0.0
    """Host seconds every engine step costs however small (scheduling, block tables, sampling),
    measured by ``hardware --probe``; 0 for catalogue devices (folded into layer_overhead there)."""
    usd_per_hour: float = 0.0
    """What one device-hour costs the user (a cluster file's own price); 0: the catalogue's list price."""
    layer_overhead_s: float = 0.0
    """Host seconds per layer per engine step, measured by ``hardware --probe``; 0 = the planner's
    GPU-fitted ``serve_rates.LAYER_OVERHEAD_S``."""
    request_overhead_s: float = 0.0
    """Host seconds a served request's own path adds to its TTFT (HTTP read, admission, the first
    token's delivery), measured by ``hardware --probe`` on a served tiny model; 0 for catalogue devices."""
    pipeline_action_s: float = 0.0
    """Host seconds a pipeline rank spends after each schedule action before the next (its sends
    posted, the schedule's bookkeeping), measured by ``hardware --probe`` with the runtime's own
    pipeline; 0 for catalogue GPUs (the host enqueues ahead of the stream)."""
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``; int4 runs at the int8 rate, fp32 GEMMs use TF32."""
        key = {"int4": "int8", "fp32": "tf32", "float32": "tf32", "bfloat16": "bf16", "float16": "fp16",
               "mxfp8": "fp8", "fp8cs": "fp8"}.get(dtype, dtype)
        if key not in self.peak_flops:
            key = "bf16" if dtype in ("fp8", "int8", "int4") else key
        if key not in self.peak_flops:
            raise SpecError(f"device {self.name} has no {dtype} peak; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[key]


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """``nodes`` identical nodes of ``devices_per_node`` devices."""

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_link: LinkSpec
    inter_link: LinkSpec
    nics_per_node: int
    nvlink_domain: int = 0
    """Devices that share ``intra_link`` (an NVLink Switch domain spanning several nodes, e.g. 72
    for GB200 NVL72); 0 means the node."""

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"cluster: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.nvlink_domain, int) or self.nvlink_domain < 0:
            raise SpecError(f"cluster: nvlink_domain must be a non-negative integer, got {self.nvlink_domain!r}")
        cluster_file.check_counts(self.nodes, self.devices_per_node, "cluster")
        if self.nvlink_domain and self.nvlink_domain % self.devices_per_node:
            raise SpecError(
                f"cluster: nvlink_domain={self.nvlink_domain} is not a whole number of nodes of "
                f"{self.devices_per_node} devices; give a multiple of {self.devices_per_node}"
            )

    @property
    def fast_domain(self) -> int:
        """Devices a group can span and still talk over ``intra_link``: the node, or the NVLink
        domain when it is larger. A job uses whole domains where it can; when its device count is
        not a multiple of the domain (128 GPUs of NVL72 racks), the scheduler places it in equal
        slices, so this is the largest multiple of the node size, at most the domain, that divides
        the device count (64 for 128 or 256 GB200s)."""
        per_node = self.devices_per_node
        if self.nvlink_domain <= per_node:
            return per_node
        n = self.num_devices
        for size in range(min(self.nvlink_domain, n) // per_node * per_node, per_node - 1, -per_node):
            if n % size == 0:
                return size
        return per_node

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def inter_bytes_per_s_per_device(self) -> float:
        """A device's share of its node's NICs when all devices talk across nodes at once."""
        return self.inter_link.bytes_per_s * self.nics_per_node / self.devices_per_node

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}x{self.device.name}"

    def describe(self) -> str:
        domain = self.fast_domain
        inside = f"inside an NVLink domain of {domain}" if domain > self.devices_per_node else "inside a node"
        return (
            f"{self.name}: {self.num_devices} devices, {self.device.memory_bytes / 2**30:.0f} GiB each; "
            f"{self.intra_link.name} {inside}, {self.nics_per_node}x {self.inter_link.name} per node"
        )


@functools.cache
def _catalog() -> dict:
    text = resources.files("modelcarve.spec.catalog").joinpath("hardware.json").read_text()
    return json.loads(text)


def device_names() -> list[str]:
    return list(_catalog()["devices"])


def link_names() -> list[str]:
    return list(_catalog()["links"])


def _lookup(table: str, name: str) -> tuple[str, dict]:
    entries = _catalog()[table]
    for key, value in entries.items():
        if key.lower() == name.lower() or key.lower().replace("-", "") == name.lower().replace("-", ""):
            return key, value
    kind = table[:-1]
    raise SpecError(f"unknown {kind} {name!r}; known: {', '.join(entries)}")


def get_device(name: str) -> DeviceSpec:
    key, raw = _lookup("devices", name)
    return DeviceSpec(name=key, **raw)


def get_link(name: str) -> LinkSpec:
    key, raw = _lookup("links", name)
    return LinkSpec(name=key, **raw)


_SHORTHAND = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([A-Za-z][\w.-]*)$")


def parse_cluster(text: str) -> ClusterSpec:
    """``2x8xH200`` (nodes x devices x device), ``8xH100`` (one node), ``H100`` (one device),
    or the path of a YAML / JSON cluster file."""
    if not isinstance(text, str):
        raise SpecError(f"a cluster must be a string such as 2x8xH200 or a file name, got {text!r}")
    path = files.user_path(text, "cluster")
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        return load_cluster_file(path)
    match = _SHORTHAND.match(text.strip())
    if not match:
        raise SpecError(
            f"cluster {text!r} is not NODESxDEVICESxDEVICE (e.g. 2x8xH200), DEVICESxDEVICE, or a .yaml/.json file"
        )
    first, second, device_name = match.groups()
    for count in (first, second):
        if count and len(count) > 9:  # past every cap (and int() of 5,000 digits is refused by Python)
            raise SpecError(f"cluster {text[:60]!r}: a count of {count[:30]}{'...' if len(count) > 30 else ''} is "
                            f"more than the {cluster_file.MAX_DEVICES:,} devices modelcarve plans for")
    device = get_device(device_name)
    if second is not None:
        nodes, per_node = int(first), int(second)
    elif first is not None:
        nodes, per_node = 1, int(first)
        dpn = device.devices_per_node
        if device.nvlink_domain > dpn and per_node > dpn and per_node % dpn == 0:
            # 64xGB200: sixteen 4-GPU compute trays of one NVLink domain, not one 64-GPU node
            nodes, per_node = per_node // dpn, dpn
    else:
        nodes, per_node = 1, 1
    if nodes < 1 or per_node < 1:
        raise SpecError(f"cluster {text!r}: node and device counts must be at least 1")
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        device=device,
        intra_link=get_link(device.intra_link),
        inter_link=get_link(device.inter_link),
        nics_per_node=device.nics_per_node,
        nvlink_domain=device.nvlink_domain if per_node == device.devices_per_node else 0,
    )


def cluster_from_dict(raw: dict, where: str = "cluster file") -> ClusterSpec:
    """A ClusterSpec from a parsed cluster file, checked against its typed schema (spec/cluster_file.py)."""
    fields = cluster_file.validate(raw, where, _lookup)
    device = DeviceSpec(**fields.pop("device"))
    return ClusterSpec(device=device, intra_link=LinkSpec(**fields.pop("intra_link")),
                       inter_link=LinkSpec(**fields.pop("inter_link")), **fields)


def load_cluster_file(path: Path) -> ClusterSpec:
    where = f"cluster file {path}"
    if not files.is_file(files.user_path(path, "cluster file")):
        raise SpecError(f"cluster file {path} does not exist")
    if path.suffix.lower() == ".json":
        raw = files.read_json(path, "cluster file", max_bytes=2**20)
    else:
        raw = files.read_yaml(path, "cluster file")
    return cluster_from_dict(raw, where=where)
