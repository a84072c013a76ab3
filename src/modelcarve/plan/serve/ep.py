"""The MoE token exchange of serving with expert parallelism, wide EP (32-320 ranks) included:
one dispatch and one combine per MoE layer, priced on the links the EP group really spans.

Usage::

    from modelcarve.plan.serve.ep import ep_exchange_s
    dispatch_s, combine_s = ep_exchange_s(128, model, 64, tier)   # 128 tokens per rank

* Inside one NVLink domain (node, or NVL72 rack): bf16 both ways, ``(ep - 1) / ep`` of the copies
  over the NVLink bandwidth, one latency (every peer's buffer written at once, as DeepEP's
  intranode kernels and NVSwitch allow).
* Across domains, as DeepEP's kernels run it (the DeepSeek-V3 / SGLang / vLLM wide-EP
  deployments): each rank posts its RDMA writes to every peer at once, so the exchange pays one
  network latency, not one per peer; the bytes bound for other nodes,
  ``tokens x top_k x hidden x imbalance x (ep - k) / ep`` (k ranks of the group per node), go over
  the rank's own NIC share; dispatch is sent in FP8 (1 byte per element plus a per-128 scale,
  1.03 bytes), combine in bf16. Node-limited routing and NVLink forwarding (DeepEP's
  normal kernels) would send fewer bytes; not modelled, so prefill's exchange is an upper bound.

Checked against DeepEP's published low-latency kernel times (tests/plan/test_serve_disagg.py):
H800 + CX7 400 Gb/s, 128 tokens per rank, hidden 7168, top-8, EP 16-256.
"""

from __future__ import annotations

from modelcarve.plan.cost import comm

DISPATCH_BYTES = 1.0 + 4.0 / 128
"""Bytes per element of a cross-node dispatch: FP8 with one fp32 scale per 128 (DeepEP's low-latency default)."""
COMBINE_BYTES = 2.0
"""Bytes per element of a combine (bf16)."""
INTRA_BYTES = 2.0


def remote_copies(model, ep: int, members_per_node: int, dedup: bool) -> float:
    """Copies of one token's hidden state that cross the network (see the module doc)."""
    if dedup:
        nodes = ep / members_per_node
        return nodes * (1.0 - (1.0 - 1.0 / nodes) ** model.top_k) * (nodes - 1.0) / nodes
    return model.top_k * (ep - members_per_node) / ep


def ep_exchange_s(tokens: float, model, ep: int, tier: comm.Tier, imbalance: float = 1.0,
                  dedup: bool = False) -> tuple[float, float]:
    """(dispatch seconds, combine seconds) for ``tokens`` tokens held by each of ``ep`` ranks."""
    if ep <= 1:
        return 0.0, 0.0
    per_token = model.top_k * model.hidden_size * imbalance
    if not tier.members_per_node:
        # NVLink: every peer written at once as well (one latency), (ep - 1) / ep of the bf16 copies leave.
        t = tier.latency_s + comm.all_to_all_bytes(tokens * per_token * INTRA_BYTES, ep) / tier.bytes_per_s
        return t, t
    crossing = tokens * model.hidden_size * imbalance * remote_copies(model, ep, tier.members_per_node, dedup)
    return (tier.latency_s + crossing * DISPATCH_BYTES / tier.nic_bytes_per_s,
            tier.latency_s + crossing * COMBINE_BYTES / tier.nic_bytes_per_s)


def ep_round_trip_s(tokens: float, model, ep: int, tier: comm.Tier, imbalance: float = 1.0, dedup: bool = False) -> float:
    """Mean of one dispatch and one combine (a MoE layer pays two of these)."""
    dispatch, combine = ep_exchange_s(tokens, model, ep, tier, imbalance, dedup)
    return 0.5 * (dispatch + combine)
