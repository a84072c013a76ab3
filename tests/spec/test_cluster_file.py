"""Issue 14 §2 / 16 §4.5: typed cluster files: base + overrides, numbers as YAML writes them, caps,
messages naming the field, the schema in ``hardware --help`` and the docs, ``hardware --json`` read back."""

import dataclasses
import json
from pathlib import Path

import pytest

from modelcarve.cli import main
from modelcarve.spec import cluster_file
from modelcarve.spec.errors import SpecError
from modelcarve.spec.hardware import DeviceSpec, LinkSpec, get_device, get_link, parse_cluster

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cluster_files.md"


def load(tmp_path, text, suffix=".yaml"):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    return parse_cluster(str(path))


def test_base_device_with_single_fields_overridden(tmp_path):
    cluster = load(tmp_path, "nodes: 4\ndevice:\n  base: H100\n  memory_bytes: 1.0e11\n  peak_flops: {fp8: 2.0e15}\n"
                             "inter_link: {base: ib-ndr, bytes_per_s: 2.5e10}\n")
    h100 = get_device("H100")
    assert cluster.device.memory_bytes == 100_000_000_000 and isinstance(cluster.device.memory_bytes, int)
    assert cluster.device.peak_flops["fp8"] == 2.0e15
    assert cluster.device.peak_flops["bf16"] == h100.peak_flops["bf16"]  # the base's other dtypes kept
    assert cluster.device.hbm_bytes_per_s == h100.hbm_bytes_per_s and cluster.device.name == "H100"
    assert cluster.inter_link.bytes_per_s == 2.5e10 and cluster.inter_link.latency_s == get_link("ib-ndr").latency_s
    assert cluster.num_devices == 32 and cluster.intra_link == get_link("nvlink4")


def test_yaml_11_exponent_strings_read_as_numbers(tmp_path):
    # PyYAML (YAML 1.1) reads 4.0e12 and 1e9 as strings; the schema reads them as the numbers they spell
    cluster = load(tmp_path, "device: {base: H100, hbm_bytes_per_s: 4.0e12, memory_bytes: 8e10}\n"
                             "intra_link: {bytes_per_s: 1e9, latency_s: 5e-6}\n")
    assert cluster.device.hbm_bytes_per_s == 4.0e12 and cluster.device.memory_bytes == 80_000_000_000
    assert cluster.intra_link.bytes_per_s == 1e9 and cluster.intra_link.latency_s == 5e-6


@pytest.mark.parametrize("text, fragment", [
    ("device: {base: H100, memory_bytes: 8.5}\n", "device.memory_bytes=8.5 must be a whole number"),
    ("device: {base: H100, peak_flops: {bf16: -1}}\n", "device.peak_flops.bf16=-1 is outside the accepted range"),
    ("device: {base: H100, peak_flops: {BF 16: 1}}\n", "is not a dtype name"),
    ("device: {base: H100, nvlink_domain: 1.0e400}\n", "device.nvlink_domain"),
    ("device: {base: H900}\n", "unknown device 'H900'"),
    ("device: {base: H100, colour: red}\n", "unknown keys ['device.colour']"),
    ("device: H100\nintra_link: {base: nvlink4, latency_s: fast}\n", "intra_link.latency_s must be a number >= 0"),
    ("device: H100\ninter_link: 7\n", "inter_link must be a catalogue link name or a mapping, got integer 7"),
    ("device: [H100]\n", "device must be a catalogue name or a mapping, got list"),
    ("device: H100\nnodes: true\n", "nodes must be an integer >= 1 and <= 131,072, got boolean"),
    ("device: H100\nnodes: 2\nnum_devices: 8\n", "num_devices=8 but nodes x devices_per_node = 2 x 8 = 16"),
    ("device: {name: X, memory_bytes: 1, peak_flops: {fp8: 1}, hbm_bytes_per_s: 1}\n", "needs a bf16 entry"),
    ("device: {name: X, memory_bytes: 1, peak_flops: {bf16: 1}, hbm_bytes_per_s: 1}\n", "intra_link is missing"),
    ("nodes: 2\n", "missing 'device'"),
    ("- 1\n- 2\n", "the file must be a mapping, got list"),
    ("nodes: 200000\ndevice: H100\n", "nodes=200000 is outside the accepted range (>= 1 and <= 131,072)"),
    ("nodes: 4096\ndevices_per_node: 4096\ndevice: H100\n", "16,777,216 devices is more than the 1,048,576"),
])
def test_each_problem_names_the_field(tmp_path, text, fragment):
    with pytest.raises(SpecError) as err:
        load(tmp_path, text)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_json_file_and_huge_number(tmp_path):
    with pytest.raises(SpecError, match="devices_per_node=9223372036854775807 is outside"):
        load(tmp_path, json.dumps({"device": "H100", "devices_per_node": 2**63 - 1}), ".json")
    assert load(tmp_path, json.dumps({"device": "B200", "nodes": 2}), ".json").num_devices == 16


@pytest.mark.parametrize("shorthand", ["2x8xH100", "72xGB200", "H100-PCIe", "4xL4"])
def test_hardware_json_reads_back_as_a_cluster_file(capsys, tmp_path, shorthand):
    assert main(["hardware", "--cluster", shorthand, "--json"]) == 0
    written = capsys.readouterr().out
    path = tmp_path / "back.json"
    path.write_text(written)
    assert parse_cluster(str(path)) == parse_cluster(shorthand)
    assert parse_cluster(str(path)).device.peak_flops == parse_cluster(shorthand).device.peak_flops
    assert main(["hardware", "--cluster", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(written)  # a fixed point
    yaml_path = tmp_path / "back.yaml"  # JSON is YAML: the same file read as YAML
    yaml_path.write_text(written)
    assert parse_cluster(str(yaml_path)) == parse_cluster(shorthand)


def test_schema_matches_the_dataclasses_and_is_documented(capsys):
    assert set(cluster_file.DEVICE_FIELDS) - {"base"} == {f.name for f in dataclasses.fields(DeviceSpec)}
    assert set(cluster_file.LINK_FIELDS) - {"base"} == {f.name for f in dataclasses.fields(LinkSpec)}
    text = cluster_file.schema_text()
    assert main(["hardware", "--help"]) == 0
    help_text = capsys.readouterr().out
    for key in (*cluster_file.CLUSTER_FIELDS, *cluster_file.DEVICE_FIELDS, *cluster_file.LINK_FIELDS):
        assert f"    {key}" in help_text
    assert "base" in help_text and "4.0e12" in help_text
    assert text in DOCS.read_text(), "docs/cluster_files.md must carry schema_text() (regenerate its last block)"


def test_yaml_alias_bomb_is_refused_without_expanding(tmp_path):
    """9 levels of 9 aliases (9^9 strings if expanded): the depth/integer walks visit each shared
    node once and the message's repr is bounded, so it is refused at once."""
    parts = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    with pytest.raises(SpecError, match="device must be a catalogue name or a mapping, got list") as err:
        load(tmp_path, "device: [" + ", ".join(parts) + "]\n")
    assert len(str(err.value)) < 300
