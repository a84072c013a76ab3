"""Fuzzing the files a user hands over (issue 16 §5): config.json, cluster files, checkpoint directories.

Valid files are mutated (keys set to wrong-typed, huge, NaN, nested values; bytes cut or flipped)
and each is given to the CLI in-process (fuzz_support.check_main). A cluster file that is accepted
must also survive ``hardware --json`` and read back as the same cluster; a checkpoint directory
goes through every pre-launch check of ``run`` with the launch replaced by a recorder.
"""

import json
import os
import shutil

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz_support import FUZZ, JSONISH, NUMBERS, STRINGS, check_main
from modelcarve.commands import run as run_cmd
from modelcarve.spec import cluster_file
from modelcarve.spec.hardware import parse_cluster

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
BASES = [
    LLAMA,
    LLAMA | dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, head_dim=16),
    LLAMA | dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    LLAMA | dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 first_k_dense_replace=1, n_group=1, topk_group=1, rope_scaling={"type": "yarn", "factor": 4.0}),
    dict(model_type="gpt2", vocab_size=128, n_embd=64, n_head=4, n_layer=2, n_positions=64),
]
CONFIG_KEYS = sorted({k for b in BASES for k in b} | {"rope_parameters", "sliding_window", "use_sliding_window",
                                                       "layer_types", "partial_rotary_factor", "head_dim"})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(FUZZ, max_examples=200)
@given(st.sampled_from(BASES), st.dictionaries(st.sampled_from(CONFIG_KEYS), JSONISH, max_size=3),
       st.lists(st.sampled_from(CONFIG_KEYS), max_size=2))
def test_config_json(folder, base, changes, dropped):
    config = {k: v for k, v in (base | changes).items() if k not in dropped}
    (folder / "config.json").write_text(json.dumps(config))
    code, _, _ = check_main(["models", "show", str(folder), "--json"])
    if code == 0:  # an accepted config must also validate and cost a layout without surprises
        check_main(["layout", "tp=2,dp=2,seq=64", "--model", str(folder), "--world-size", "4"])
        check_main(["estimate", "--model", str(folder), "--cluster", "4xH100", "--layout", "tp=2,dp=2,seq=64"])


DEVICE_VALUES = st.one_of(NUMBERS, STRINGS, st.none(), st.dictionaries(st.sampled_from(["bf16", "fp8", "x y"]),
                                                                        NUMBERS, max_size=2), JSONISH)
DEVICE = st.one_of(
    st.sampled_from(["H100", "B200", "GB200", "L4", "H900", ""]),
    st.dictionaries(st.sampled_from(sorted(cluster_file.DEVICE_FIELDS)), DEVICE_VALUES, max_size=4)
    .map(lambda d: d if "base" in d or len(d) % 2 else {"base": "H100"} | d),
)
LINK = st.one_of(st.sampled_from(["nvlink4", "ib-ndr", "pcie9"]),
                 st.dictionaries(st.sampled_from(sorted(cluster_file.LINK_FIELDS)), DEVICE_VALUES, max_size=3))
CLUSTER_VALUE = {"nodes": NUMBERS, "devices_per_node": NUMBERS, "nics_per_node": NUMBERS, "nvlink_domain": NUMBERS,
                 "num_devices": NUMBERS, "device": DEVICE, "intra_link": LINK, "inter_link": LINK}


@st.composite
def cluster_files(draw):
    raw = {"device": draw(DEVICE)}
    for key in draw(st.lists(st.sampled_from(sorted(CLUSTER_VALUE)), max_size=3, unique=True)):
        raw[key] = draw(CLUSTER_VALUE[key])
    if draw(st.booleans()):  # small counts most of the time, so that many files are valid
        raw["nodes"], raw["devices_per_node"] = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4, 8]))
    return raw


@settings(FUZZ, max_examples=200)
@given(cluster_files(), st.sampled_from(["yaml", "json", "yaml-bytes"]), st.integers(0, 400), st.integers(0, 255))
def test_cluster_files(folder, raw, form, cut, byte):
    path = folder / ("c.json" if form == "json" else "c.yaml")
    text = json.dumps(raw) if form == "json" else yaml.safe_dump(raw)
    data = text.encode()
    if form == "yaml-bytes":  # a damaged file: one byte replaced
        data = data[:cut] + bytes([byte]) + data[cut + 1:]
    path.write_bytes(data)
    code, out, _ = check_main(["hardware", "--cluster", str(path), "--json"])
    if code == 0:
        back = folder / "back.json"
        back.write_text(out)
        assert parse_cluster(str(back)) == parse_cluster(str(path))
        devices = json.loads(out)["num_devices"]
        if devices <= 64:  # the planner takes what the schema accepted
            check_main(["estimate", "--model", "tiny-llama", "--cluster", str(path), "--layout", f"dp={devices},seq=64"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_tiny import save_hf

    path = tmp_path_factory.mktemp("ckpt") / "base"
    save_hf("LlamaConfig", "LlamaForCausalLM", path)
    return path


OPS = st.sampled_from(["drop-weights", "truncate", "flip-header", "index", "bin", "config", "rename"])


@settings(FUZZ, max_examples=120)
@given(st.lists(OPS, min_size=1, max_size=3), st.integers(0, 10**6), st.integers(0, 255),
       st.dictionaries(st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "x"]),
                       st.one_of(st.sampled_from(["model-1.safetensors", "../x.safetensors", "/etc/hosts", "nope",
                                                  "sub/x.safetensors", ""]), JSONISH), max_size=3),
       st.dictionaries(st.sampled_from(sorted(LLAMA)), JSONISH, max_size=2))
def test_checkpoint_directories(monkeypatch, folder, checkpoint, ops, offset, byte, weight_map, config_changes):
    monkeypatch.setattr(run_cmd, "_launch", lambda command, args, payload, per_node, under: 0)
    d = folder / "ckpt"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(checkpoint, d)
    weights = d / "model.safetensors"
    for op in ops:
        if not weights.exists() and op in ("truncate", "flip-header", "rename"):
            continue
        if op == "drop-weights":
            weights.unlink(missing_ok=True)
        elif op == "truncate":
            data = weights.read_bytes()
            weights.write_bytes(data[: offset % (len(data) + 1)])
        elif op == "flip-header":  # damage the 8-byte length or the JSON table
            data = bytearray(weights.read_bytes()) or bytearray(b"\0")
            data[offset % min(len(data), 2000)] = byte
            weights.write_bytes(bytes(data))
        elif op == "rename":
            os.rename(weights, d / "model-1.safetensors")
        elif op == "index":
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        elif op == "bin":
            (d / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
        elif op == "config":
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(config | config_changes))
    check_main(["run", "--model", str(d), "--layout", "dp=1,seq=16"])
