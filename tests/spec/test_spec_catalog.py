"""Catalogue facts: real configs parse, counts match transformers and the published figures."""

import json

import pytest

from modelcarve.spec.catalog import catalog_entry, get_model, model_names
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import cluster_from_dict, device_names, get_device, parse_cluster
from modelcarve.spec.hf_config import load_hf_config, spec_from_hf_config

REQUIRED = [
    "gpt3-175b", "gpt-1t", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-72b", "qwen3-32b",
    "qwen3-235b-a22b", "mixtral-8x7b", "mixtral-8x22b", "deepseek-v3", "kimi-k2",
]


def test_catalogue_has_every_required_model_with_a_source():
    for name in REQUIRED:
        entry = catalog_entry(name)
        assert entry["source"], name
        assert get_model(name).total_params > 0


# Published totals (the authors' rounding): total within 1.5% of the stated figure.
PUBLISHED = {
    "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 405.9e9, "qwen2.5-72b": 72.7e9,
    "qwen3-32b": 32.8e9, "qwen3-235b-a22b": 235e9, "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9,
    "deepseek-v3": 671e9, "gpt3-175b": 175e9, "gpt-1t": 1008e9,
}
ACTIVE = {"qwen3-235b-a22b": 22e9, "mixtral-8x7b": 12.9e9, "mixtral-8x22b": 39e9, "deepseek-v3": 37e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_totals_match_published(name):
    assert get_model(name).total_params == pytest.approx(PUBLISHED[name], rel=0.015)
    if name in ACTIVE:
        assert get_model(name).active_params == pytest.approx(ACTIVE[name], rel=0.03)


def test_gpt_flops_per_token_is_narayanan_eq3():
    # Eq. 3 of Narayanan et al. 2021 counts 96 B s l h^2 (1 + s/6h + V/16lh) for fwd+bwd+recompute,
    # i.e. 4x the forward pass (the LM head 3x); forward per token = 24 l h^2 (1 + s/6h) + 2 V h.
    spec = get_model("gpt-1t")
    l, h, s, v = 128, 25600, 2048, 51200
    expected = 24 * l * h * h * (1 + s / (6 * h)) + 2 * v * h
    assert spec.forward_flops_per_token(s) == pytest.approx(expected, rel=1e-9)


def test_unknown_model_and_bad_config(tmp_path):
    with pytest.raises(SpecError, match="unknown model 'gpt-5'"):
        get_model("gpt-5")
    with pytest.raises(SpecError, match="model_type 'bert' is not supported"):
        spec_from_hf_config({"model_type": "bert"})
    with pytest.raises(SpecError, match="lacks required key 'hidden_size'"):
        spec_from_hf_config({"model_type": "llama", "vocab_size": 10})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(SpecError, match="no such config file"):
        load_hf_config(tmp_path / "missing")


def test_config_dir_roundtrip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(catalog_entry("qwen3-32b")["config"]))
    assert get_model(str(tmp_path)).total_params == get_model("qwen3-32b").total_params


def test_hardware_catalogue_and_shorthand():
    for name in ("A100-40GB", "A100-80GB", "H100", "H200", "B200", "MI300X", "L40S", "RTX4090"):
        assert name in device_names()
        assert get_device(name).source
    cluster = parse_cluster("2x8xH200")
    assert cluster.num_devices == 16 and cluster.intra_link.name == "nvlink4" and cluster.inter_link.name == "ib-ndr"
    # 8 NDR NICs of 50 GB/s shared by 8 GPUs: 50 GB/s per device across nodes
    assert cluster.inter_bytes_per_s_per_device == pytest.approx(50e9)
    assert parse_cluster("8xA100-80GB").nodes == 1 and parse_cluster("h100").num_devices == 1
    for bad in ("2x8xH900", "2x8x", "0x8xH100", "foo bar"):
        with pytest.raises(SpecError):
            parse_cluster(bad)


def test_cluster_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 8\ndevice: H100\ninter_link: eth-100g\nnics_per_node: 1\n")
    cluster = parse_cluster(str(path))
    assert cluster.inter_link.name == "eth-100g" and cluster.inter_bytes_per_s_per_device == pytest.approx(12.5e9 / 8)
    custom = cluster_from_dict({"nodes": 1, "device": "L40S", "intra_link": {"name": "x", "bytes_per_s": 1e9, "latency_s": 1e-5}})
    assert custom.intra_link.bytes_per_s == 1e9
    with pytest.raises(SpecError, match="unknown keys"):
        cluster_from_dict({"device": "H100", "gpus": 8})
    (tmp_path / "bad.json").write_text("[1,")
    with pytest.raises(SpecError, match="cannot parse"):
        parse_cluster(str(tmp_path / "bad.json"))
