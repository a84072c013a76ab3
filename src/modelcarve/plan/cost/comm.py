"""Collective communication cost: bytes each device sends and alpha-beta time, per link tier.

Usage::

    from modelcarve.plan.cost.comm import group_tier, all_reduce_s, ring_all_reduce_bytes
    tier = group_tier(cluster, group_size=64, inner=8)    # a DP group of 64, TP=8 inside it
    seconds = all_reduce_s(grad_bytes, 64, tier)

Bytes (what one device sends, ring algorithms, ``n`` ranks, ``S`` the full buffer):

* all-reduce ``2 (n-1)/n S`` (reduce-scatter then all-gather),
* all-gather and reduce-scatter ``(n-1)/n S`` (``S`` the gathered size),
* all-to-all ``(n-1)/n S`` (``S`` what one rank holds before the exchange),
* point-to-point ``S``.

Time = ``steps x latency + bytes / bandwidth`` with the ring's step count (``2(n-1)`` for
all-reduce, ``n-1`` for the others, 1 for a send).

Which link a group uses
-----------------------
Mesh axes nest TP (innermost), CP, DP, PP (outermost); a group of ``group_size`` ranks whose
members are ``inner`` ranks apart stays inside a node iff ``group_size * inner <=
devices_per_node`` (more exactly: inside the NVLink domain, ``cluster.fast_domain``, which is
the node except for rack-scale NVLink such as GB200 NVL72, where it is up to 72 devices). Across nodes, every device of a node talks at once (the other groups of the
same axis run their own collectives concurrently), so each device has its share of the node's
NICs, ``cluster.inter_bytes_per_s_per_device``. When ``k = devices_per_node / inner`` members of
the group sit in each node, NCCL's rings (one channel per NIC) cross the node boundary once per
ring, so the ``k`` members' NIC shares add up: the ring's bus bandwidth is ``k x`` the per-device
share (capped by the intra-node link). This equals a hierarchical all-reduce (reduce-scatter
inside the node, all-reduce of ``S/k`` across nodes, all-gather inside) to within the intra-node
phases, and matches measurements: an all-reduce over 2 nodes of 8 A100s with 4x HDR each reaches
86 GB/s bus bandwidth against the nodes' 100 GB/s of NICs (nccl-tests issue #175).

Achievable fractions of the nominal link bandwidth (bus bandwidth of large NCCL all-reduces):
``INTRA_EFFICIENCY = 0.77`` (DGX A100, 8 GPUs, 232 GB/s of 300 GB/s per direction, nccl-tests
issue #175; nccl-tests #149 reports ~200-208 GB/s on HGX A100), ``INTER_EFFICIENCY = 0.86``
(86 of 100 GB/s, same issue; issue #119 reports 85-96 of 100 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec

INTRA_EFFICIENCY = 0.77
"""Achieved NCCL bus bandwidth / nominal per-direction link bandwidth inside a node."""
INTER_EFFICIENCY = 0.86
"""Achieved NCCL bus bandwidth / nominal NIC bandwidth across nodes."""
OVERLAP_COMPUTE_COST = 0.15
"""A collective hidden behind compute is not free: NCCL runs one thread block per channel on an
SM (16-32 channels against 108 SMs on A100, 132 on H100) and streams through HBM, so the GEMMs it
overlaps lose about that share of the device. Charged as this fraction of the hidden time (a
stated assumption, not fitted)."""


@dataclass(frozen=True, kw_only=True)
class Tier:
    """The link a collective's slowest hop runs over, as one device sees it."""

    name: str
    """'intra' (inside a node) or 'inter' (across nodes)."""
    bytes_per_s: float
    """Achievable bandwidth per device per direction (bus bandwidth), bytes/s."""
    latency_s: float
    """Per-step latency (alpha), seconds."""
    members_per_node: int = 0
    """Across nodes: members of the group in each node (k); 0 for an intra-node tier."""
    nic_bytes_per_s: float = 0.0
    """Across nodes: one device's own achievable share of its node's NICs, bytes/s."""
    peer_latency_s: float = 0.0
    """Inside a node: per-step latency of a one-/two-shot all-reduce through peer memory (the
    link's ``peer_latency_s``); 0 = ``latency_s``."""

    @property
    def peer_alpha(self) -> float:
        """The alpha of a one-/two-shot all-reduce (serving's TP all-reduce inside a node)."""
        return self.peer_latency_s or self.latency_s

    @property
    def nic_fraction(self) -> float:
        """Fraction of a device's ring-collective bytes that cross a NIC (0 inside a node,
        1/k when k members of the group share each node; see the module doc)."""
        return 1.0 / self.members_per_node if self.members_per_node else 0.0


# --- bytes each device sends ------------------------------------------------------------------
def ring_all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each of ``n`` devices sends to all-reduce a ``size_bytes`` buffer: 2(n-1)/n x size."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * size_bytes


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes each device sends to all-gather a buffer whose gathered size is ``size_bytes``."""
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes


def reduce_scatter_bytes(size_bytes: float, n: int) -> float:
    """Bytes each device sends to reduce-scatter a ``size_bytes`` buffer into n shards."""
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes


def all_to_all_bytes(size_bytes: float, n: int) -> float:
    """Bytes each device sends in an all-to-all of the ``size_bytes`` it holds (1/n stays home)."""
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes


# --- which link --------------------------------------------------------------------------------
def intra_tier(cluster: "ClusterSpec") -> Tier:
    link = cluster.intra_link
    return Tier(name="intra", bytes_per_s=link.bytes_per_s * INTRA_EFFICIENCY, latency_s=link.latency_s,
                peer_latency_s=link.peer_latency_s)


def inter_tier(cluster: "ClusterSpec", members_per_node: int = 1) -> Tier:
    """Across nodes, with ``members_per_node`` members of the group in each node."""
    k = max(1, members_per_node)
    share = cluster.inter_bytes_per_s_per_device * INTER_EFFICIENCY
    intra = cluster.intra_link.bytes_per_s * INTRA_EFFICIENCY
    return Tier(
        name="inter",
        bytes_per_s=min(k * share, intra),
        latency_s=cluster.inter_link.latency_s,
        members_per_node=k,
        nic_bytes_per_s=share,
    )


def group_tier(cluster: "ClusterSpec", group_size: int, inner: int = 1) -> Tier:
    """The link a group of ``group_size`` ranks uses when ``inner`` ranks separate its members
    (``inner`` = product of the mesh axes nested inside this one; TP innermost, then CP, DP, PP).

    "Inside" means inside the cluster's NVLink domain (``cluster.fast_domain``): the node, or a
    whole NVL72 rack of several 4-GPU trays. Across domains, ``k`` members per domain aggregate
    their NIC shares as they do per node."""
    domain = cluster.fast_domain
    if group_size <= 1 or group_size * inner <= domain:
        return intra_tier(cluster)
    return inter_tier(cluster, domain // inner if inner < domain else 1)


# --- time --------------------------------------------------------------------------------------
def _time(steps: int, nbytes: float, tier: Tier) -> float:
    return steps * tier.latency_s + nbytes / tier.bytes_per_s


def all_reduce_s(size_bytes: float, n: int, tier: Tier) -> float:
    """Seconds to ring-all-reduce ``size_bytes`` over ``n`` ranks on ``tier``."""
    if n <= 1:
        return 0.0
    return _time(2 * (n - 1), ring_all_reduce_bytes(size_bytes, n), tier)


def all_gather_s(size_bytes: float, n: int, tier: Tier) -> float:
    """Seconds to all-gather to a gathered buffer of ``size_bytes``."""
    if n <= 1:
        return 0.0
    return _time(n - 1, all_gather_bytes(size_bytes, n), tier)


def reduce_scatter_s(size_bytes: float, n: int, tier: Tier) -> float:
    """Seconds to reduce-scatter a ``size_bytes`` buffer."""
    if n <= 1:
        return 0.0
    return _time(n - 1, reduce_scatter_bytes(size_bytes, n), tier)


def all_to_all_s(size_bytes: float, n: int, tier: Tier, crossing_bytes: float | None = None) -> float:
    """Seconds for an all-to-all in which each rank starts with ``size_bytes``.

    Across nodes an all-to-all gains nothing from NIC aggregation (every pair talks directly):
    the ``(n-k)/n`` of the data bound for other nodes goes over the device's own NIC share
    (``crossing_bytes`` replaces that share where the exchange sends less across, e.g. a token
    once per node: ``moe_remote_nodes``)."""
    if n <= 1:
        return 0.0
    if tier.members_per_node:
        k = tier.members_per_node
        crossing = size_bytes * (n - k) / n if crossing_bytes is None else crossing_bytes
        return (n - 1) * tier.latency_s + crossing / tier.nic_bytes_per_s
    return _time(n - 1, all_to_all_bytes(size_bytes, n), tier)


def moe_remote_nodes(num_experts: int, top_k: int, nodes: int) -> float:
    """Expected number of OTHER nodes a routed token's ``top_k`` experts lie on, its experts drawn
    uniformly without replacement from ``num_experts`` split evenly over ``nodes`` nodes (the EP
    ranks of a node hold contiguous experts). A node-aware dispatcher (DeepEP's internode kernels,
    HybridEP: Megatron's flex dispatcher) sends a token across the network once per such node and
    fans it out to that node's experts over NVLink, and combines the same way back; Megatron's
    all-to-all dispatcher sends every routed copy (``top_k (n - k) / n`` of them cross)."""
    if nodes <= 1:
        return 0.0
    per_node = num_experts / nodes
    miss = 1.0  # probability that a given other node holds none of the token's experts
    for i in range(top_k):
        miss *= max(0.0, num_experts - per_node - i) / (num_experts - i)
    return (nodes - 1) * (1.0 - miss)


def p2p_s(size_bytes: float, tier: Tier) -> float:
    """Seconds to send ``size_bytes`` to one neighbour. Across nodes a send gains nothing from
    the other members' NICs: it goes over the device's own share."""
    if tier.members_per_node:
        return tier.latency_s + size_bytes / tier.nic_bytes_per_s
    return _time(1, size_bytes, tier)


def nic_bytes(device_bytes: float, tier: Tier) -> float:
    """Of the bytes a device sends in a ring collective on ``tier``, those that cross a NIC."""
    return device_bytes * tier.nic_fraction


def all_to_all_nic_bytes(size_bytes: float, n: int, tier: Tier, crossing_bytes: float | None = None) -> float:
    """Of an all-to-all's bytes (each rank holding ``size_bytes``), those bound for other nodes
    (``crossing_bytes`` where the exchange sends less across: see ``all_to_all_s``)."""
    if n <= 1 or not tier.members_per_node:
        return 0.0
    return size_bytes * (n - tier.members_per_node) / n if crossing_bytes is None else crossing_bytes
