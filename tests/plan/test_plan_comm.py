"""Collective bytes and alpha-beta times against hand derivations; which link a group uses."""

import pytest
from hypothesis import given, strategies as st

from modelcarve.plan.cost import comm
from modelcarve.spec.hardware import parse_cluster

A100 = parse_cluster("4x8xA100-80GB")  # NVLink3 300 GB/s, 8x HDR 25 GB/s per node


@given(st.integers(1, 4096), st.floats(0, 1e12, allow_nan=False))
def test_ring_all_reduce_bytes_is_2_n_minus_1_over_n(n, size):
    assert comm.ring_all_reduce_bytes(size, n) == pytest.approx(2 * (n - 1) / n * size)


def test_gather_scatter_all_to_all_bytes():
    S = 8e9
    assert comm.all_gather_bytes(S, 8) == pytest.approx(7 / 8 * S)
    assert comm.reduce_scatter_bytes(S, 8) == pytest.approx(7 / 8 * S)
    assert comm.all_to_all_bytes(S, 4) == pytest.approx(3 / 4 * S)
    # all-reduce = reduce-scatter + all-gather
    assert comm.ring_all_reduce_bytes(S, 8) == pytest.approx(comm.reduce_scatter_bytes(S, 8) + comm.all_gather_bytes(S, 8))
    assert comm.ring_all_reduce_bytes(S, 1) == 0.0


def test_group_inside_a_node_uses_nvlink():
    tier = comm.group_tier(A100, group_size=8, inner=1)
    assert tier.name == "intra"
    assert tier.bytes_per_s == pytest.approx(300e9 * comm.INTRA_EFFICIENCY)
    # a DP group of 2 with TP=4 inside it still fits one node of 8
    assert comm.group_tier(A100, 2, inner=4).name == "intra"


def test_group_across_nodes_uses_the_per_device_nic_share():
    # DP group of 4 with TP=8 inside: one member per node, each on its own 25 GB/s NIC share
    tier = comm.group_tier(A100, 4, inner=8)
    assert tier.name == "inter"
    assert tier.members_per_node == 1
    assert tier.bytes_per_s == pytest.approx(25e9 * comm.INTER_EFFICIENCY)
    assert tier.nic_fraction == 1.0


def test_hierarchical_group_adds_the_nic_shares_of_its_members_in_a_node():
    # TP=16 over 2 nodes: 8 members per node, rings cross once per node per NIC -> 8 x share
    tier = comm.group_tier(A100, 16, inner=1)
    assert tier.name == "inter"
    assert tier.members_per_node == 8
    assert tier.bytes_per_s == pytest.approx(8 * 25e9 * comm.INTER_EFFICIENCY)
    assert tier.nic_fraction == pytest.approx(1 / 8)
    # DP=8 with TP=2 inside: 4 members per node
    assert comm.group_tier(A100, 8, inner=2).members_per_node == 4


def test_alpha_beta_times_by_hand():
    tier = comm.Tier(name="intra", bytes_per_s=100e9, latency_s=5e-6)
    S, n = 1e9, 8
    assert comm.all_reduce_s(S, n, tier) == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * S / 100e9)
    assert comm.all_gather_s(S, n, tier) == pytest.approx(7 * 5e-6 + 7 / 8 * S / 100e9)
    assert comm.reduce_scatter_s(S, n, tier) == pytest.approx(7 * 5e-6 + 7 / 8 * S / 100e9)
    assert comm.all_to_all_s(S, n, tier) == pytest.approx(7 * 5e-6 + 7 / 8 * S / 100e9)
    assert comm.p2p_s(S, tier) == pytest.approx(5e-6 + S / 100e9)
    assert comm.all_reduce_s(S, 1, tier) == 0.0


def test_all_to_all_across_nodes_goes_over_each_devices_own_nic():
    # EP=16 with 8 members per node: half of each rank's data leaves the node, over its own share
    tier = comm.group_tier(A100, 16, inner=1)
    S = 1e9
    share = 25e9 * comm.INTER_EFFICIENCY
    assert comm.all_to_all_s(S, 16, tier) == pytest.approx(15 * tier.latency_s + S * 8 / 16 / share)
    assert comm.all_to_all_nic_bytes(S, 16, tier) == pytest.approx(S / 2)


def test_point_to_point_across_nodes_uses_the_devices_own_nic_share():
    # PP=4 with TP=2 x DP=2 inside: two members per node, but a send is one device's traffic
    tier = comm.group_tier(A100, 4, inner=4)
    assert tier.members_per_node == 2
    share = 25e9 * comm.INTER_EFFICIENCY
    assert comm.p2p_s(1e9, tier) == pytest.approx(tier.latency_s + 1e9 / share)
