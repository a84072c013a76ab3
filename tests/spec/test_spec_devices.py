"""Device catalogue: every entry loads with dense peaks and a source; NVLink domains larger than a node."""

import pytest

from modelcarve.plan.cost import comm
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import cluster_from_dict, device_names, get_device, parse_cluster

NEW = ["GB200", "B200", "B300", "GB300", "H800", "H20", "L4", "L40S", "H100-PCIe", "H100-NVL", "MI300X", "MI325X"]


@pytest.mark.parametrize("name", NEW)
def test_device_loads_with_sourced_dense_peaks(name):
    assert name in device_names()
    d = get_device(name)
    assert d.source and d.memory_bytes > 16 * 2**30 and d.hbm_bytes_per_s > 0
    for dtype in ("fp32", "bf16", "fp8"):
        assert d.flops(dtype) > 0
    # dense FP8 is twice dense BF16 on every part listed (no sparsity doubling slipped in)
    assert d.flops("fp8") == pytest.approx(2 * d.flops("bf16"), rel=0.015)  # L40S sheet: 362.05 vs 733
    assert d.flops("bf16") > d.flops("tf32") > d.flops("fp32") * 0.99
    parse_cluster(f"{d.devices_per_node}x{name}")  # its usual links resolve


def test_datasheet_figures():
    assert get_device("GB200").flops("bf16") == 2.5e15 and get_device("GB200").flops("fp4") == 10e15
    assert get_device("B200").flops("fp8") == 4.5e15
    assert get_device("H100-PCIe").flops("bf16") == 756e12
    assert get_device("H20").flops("bf16") == 148e12
    assert get_device("H800").flops("bf16") == get_device("H100").flops("bf16")
    assert parse_cluster("8xH800").intra_link.bytes_per_s == 200e9  # 400 GB/s bidirectional
    assert get_device("MI325X").memory_bytes == 256 * 2**30


def test_nvl72_domain_is_larger_than_a_node():
    cl = parse_cluster("64xGB200")
    assert (cl.nodes, cl.devices_per_node, cl.fast_domain) == (16, 4, 64)
    assert parse_cluster("18x4xGB200").fast_domain == 72
    assert parse_cluster("32x4xGB200").fast_domain == 64   # 128 GPUs: two 64-GPU slices of racks
    assert parse_cluster("8xH100").fast_domain == 8
    assert "NVLink domain of 64" in cl.describe()
    # a TP x EP group of 32 stays on NVLink inside the rack; on H100 nodes it crosses the NICs
    assert comm.group_tier(cl, 16, 2).name == "intra"
    assert comm.group_tier(parse_cluster("8x8xH100"), 16, 2).name == "inter"
    # across domains the NIC shares of the domain's members add up, as per node
    big = parse_cluster("36x4xGB200")  # two NVL72 racks
    tier = comm.group_tier(big, 144, 1)
    assert tier.name == "inter" and tier.members_per_node == 72


def test_cluster_file_nvlink_domain():
    cl = cluster_from_dict({"nodes": 16, "devices_per_node": 4, "device": "B200", "nvlink_domain": 32})
    assert cl.fast_domain == 32
    with pytest.raises(SpecError, match="nvlink_domain=30 is not a whole number of nodes"):
        cluster_from_dict({"nodes": 16, "devices_per_node": 4, "device": "B200", "nvlink_domain": 30})
    assert cluster_from_dict({"nodes": 2, "device": "GB200"}).fast_domain == 8


def test_planner_places_tp_and_ep_by_nvlink_domain():
    from modelcarve.plan.goals import get_goal
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    goal = get_goal("train")
    layout = Layout.parse("tp=16,sp,dp=4,mbs=1,gbs=8,seq=4096,zero=1")
    model = get_model("llama-3.1-70b")
    rack = goal.evaluate(model, parse_cluster("64xGB200"), layout)      # 16 trays of 4 in one NVL72 domain
    nodes = goal.evaluate(model, parse_cluster("8x8xB200"), layout)     # 8-GPU nodes: TP16 crosses the NICs
    assert rack["comm"]["link_by_axis"]["tp"] == "intra" and rack["comm"]["link_by_axis"]["dp"] == "intra"
    assert nodes["comm"]["link_by_axis"]["tp"] == "inter"
    assert not any("spans" in w for w in rack["warnings"]) and any("spans" in w for w in nodes["warnings"])
    assert rack["comm"]["bytes_per_step_by_link"]["inter"] == 0
