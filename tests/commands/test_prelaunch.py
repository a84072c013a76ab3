"""Issue 16 §3: what ``run``/``verify`` refuse (or derive) before any rank starts, one line each.

All but the last test run ``cli.main`` in-process with the launch replaced by a recorder, so a
refused input is proved to stop before torchrun; the last runs real ranks, where NaN weights are
found as the ranks read them.
"""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelcarve.cli import main
from modelcarve.commands.launching import prelaunch
from modelcarve.commands import run as run_cmd

ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from hf_tiny import save_hf

    path = tmp_path_factory.mktemp("ckpt") / "base"
    save_hf("LlamaConfig", "LlamaForCausalLM", path)
    return path


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(run_cmd, "_launch", lambda command, args, payload, per_node, under: calls.append(payload) or 0)
    return calls


def copy(base, tmp_path, name="m"):
    return shutil.copytree(base, tmp_path / name)


def refused(capsys, launches, argv, fragment):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and not launches, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    return lines[0]


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_bin_only_and_config_only_directories(capsys, launches, base, tmp_path):
    d = copy(base, tmp_path, "bin")
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    line = refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], "holds no safetensors weights")
    assert "pytorch_model.bin" in line and "not loaded, on purpose" in line and "--init random" in line
    os.remove(d / "pytorch_model.bin")
    refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], "config.json but no weights")
    assert main(["run", "--model", str(d), "--layout", "dp=1", "--init", "random"]) == 0 and len(launches) == 1
    assert "using seq=64" in capsys.readouterr().err  # the tiny config's max_position_embeddings
    refused(capsys, [], ["run", "--model", str(base), "--layout", "dp=1", "--init", "random"],
            "holds safetensors weights but --init random")


def test_generate_and_serve_refuse_a_directory_without_weights(capsys, base, tmp_path):
    """The same listing check guards generation and serving: a .bin-only or config-only directory
    is refused before any rank (or server) starts, not run with random weights."""
    d = copy(base, tmp_path, "bin")
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    for argv in (["generate", "--model", str(d), "--layout", "tp=1", "--prompt-ids", "1,2,3"],
                 ["serve", "--model", str(d), "--layout", "tp=1", "--port", "1"]):
        line = refused(capsys, [], argv, "holds no safetensors weights")
        assert "not loaded, on purpose" in line, line


def test_config_with_fewer_layers_than_the_checkpoint(capsys, launches, base, tmp_path):
    d = copy(base, tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"],
            "the checkpoint holds 2 layers (e.g. 'model.layers.1.")


def test_unused_and_integer_tensors_named(capsys, launches, base, tmp_path):
    d = copy(base, tmp_path, "extra")
    rewrite(d, lambda t: t.update({"model.extra_proj.weight": torch.zeros(4, 4)}))
    refused(capsys, launches, ["verify", "--model", str(d), "--layout", "dp=1"], "does not use: 'model.extra_proj.weight'")
    d = copy(base, tmp_path, "ints")
    rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"],
            "tensor model.norm.weight (I32 in model.safetensors) is not floating point")
    d = copy(base, tmp_path, "bools")
    rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.bool)}))
    refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], "model.norm.weight (BOOL")


def _sharded(base, tmp_path, weight_map=None, index=None):
    d = copy(base, tmp_path, "sharded")
    os.rename(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
    names = list(load_file(d / "model-00001-of-00001.safetensors"))
    body = index if index is not None else {"metadata": {}, "weight_map": weight_map or {
        n: "model-00001-of-00001.safetensors" for n in names}}
    (d / "model.safetensors.index.json").write_text(json.dumps(body))
    return d, names


def test_index_problems_name_the_file(capsys, launches, base, tmp_path):
    d, names = _sharded(base, tmp_path)
    assert main(["run", "--model", str(d), "--layout", "dp=1,seq=16"]) == 0 and len(launches) == 1  # a good index
    launches.clear()
    capsys.readouterr()
    index = str(d / "model.safetensors.index.json")
    cases = [
        ({"metadata": {}}, "has no weight_map"),
        ({"weight_map": [1, 2]}, "has no weight_map"),
        ({"weight_map": {n: "../x.safetensors" for n in names}}, "weight_map points outside the checkpoint directory"),
        ({"weight_map": {n: "/etc/passwd" for n in names}}, "weight_map points outside"),
        ({"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}},
         "names shard 'model-00002-of-00002.safetensors', which is missing"),
        ({"weight_map": {"model.nope": "model-00001-of-00001.safetensors"}}, "that shard has no such tensor"),
    ]
    for body, fragment in cases:
        (d / "model.safetensors.index.json").write_text(json.dumps(body))
        line = refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], fragment)
        assert index in line
    (d / "model.safetensors.index.json").write_text("{")
    refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], "cannot parse: not valid JSON")


def test_truncated_and_garbage_safetensors(capsys, launches, base, tmp_path):
    d = copy(base, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    file = str(d / "model.safetensors")
    for content, fragment in [
        (data[: len(data) // 2], "is truncated: tensor"),
        (data[:5], "shorter than its 8-byte header length"),
        (os.urandom(2000), "is not a valid safetensors file"),
        (struct.pack("<Q", 5) + b"[1,2]", "is not a valid safetensors file: its header is not a JSON object"),
        (struct.pack("<Q", 2) + b"{", "is not a valid safetensors file"),
    ]:
        (d / "model.safetensors").write_bytes(content)
        line = refused(capsys, launches, ["run", "--model", str(d), "--layout", "dp=1"], fragment)
        assert file in line


def test_seq_data_and_derived_batch(capsys, launches):
    refused(capsys, launches, ["run", "--model", "tiny-llama", "--layout", "tp=2,seq=1024"],
            "seq=1024 is longer than the 512 positions tiny-llama was trained for")
    refused(capsys, launches, ["run", "--model", "tiny-llama", "--layout", "dp=2", "--data", "no-such-tokens.npy"],
            "--data no-such-tokens.npy does not exist")
    # verify --layout pp=4: 1f1b needs >= 4 micro-batches; the smallest global batch it accepts is 4 x mbs x dp
    assert main(["verify", "--model", "tiny-llama", "--layout", "pp=4"]) == 2  # the recorder writes no report
    err = capsys.readouterr().err
    assert "using gbs=4, the smallest global batch schedule 1f1b accepts with pp=4" in err
    assert "using seq=512, the model's max_position_embeddings" in err
    ran = json.loads(launches[0]["layout"])
    assert ran["gbs"] == 4 and ran["pp"] == 4 and ran["seq"] == 512
    launches.clear()
    assert main(["run", "--model", "tiny-llama", "--layout", "pp=2,dp=2,mbs=2"]) == 0
    assert json.loads(launches[0]["layout"])["gbs"] == 2 * 2 * 2
    launches.clear()
    capsys.readouterr()
    assert main(["run", "--model", "tiny-llama", "--layout", "pp=2,gbs=8,seq=64"]) == 0  # given: kept as given
    assert launches[0]["layout"] == "pp=2,gbs=8,seq=64"
    assert "note" not in capsys.readouterr().err


def test_predicted_memory_over_the_device_is_refused_with_layouts_that_fit(capsys, launches, monkeypatch):
    """The limit is set between two layouts' predictions (both the planner's), so the test does not
    depend on this machine's free memory: dp=2 (replicated weights and Adam state) must not fit,
    fsdp on the same two ranks must, and be named."""
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec = get_model("small-llama")
    dp2 = Layout.parse("dp=2,seq=256")
    fsdp = Layout.parse("dp=2,seq=256,zero=3")
    need_dp, need_fsdp = (prelaunch.predicted_bytes(lay, spec, on_gpu=False) for lay in (dp2, fsdp))
    assert need_fsdp < need_dp
    limit = (need_dp + need_fsdp) // 2
    monkeypatch.setattr(prelaunch, "_mem_available", lambda: 2 * limit)  # 2 ranks share it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refused(capsys, launches, ["run", "--model", "small-llama", "--layout", "dp=2,seq=256"],
                   f"DP2 needs {need_dp / 2**30:.2f} GiB per rank")
    assert f"a rank has {limit / 2**30:.2f} GiB (available RAM" in line and "DP2-Z3" in line
    monkeypatch.setattr(prelaunch, "_mem_available", lambda: 2 * need_dp)
    assert main(["run", "--model", "small-llama", "--layout", "dp=2,seq=256"]) == 0 and len(launches) == 1
    refused(capsys, launches[:0], ["run", "--model", "llama-3.1-405b", "--layout", "dp=2,seq=256"],
            "no layout of these ranks fits")


def test_nan_weights_refused_in_the_rank_naming_the_tensor(base, tmp_path):
    d = copy(base, tmp_path)
    rewrite(d, lambda t: t["model.layers.1.mlp.down_proj.weight"].view(-1)[7:9].copy_(torch.tensor([float("nan"),
                                                                                                      float("inf")])))
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", "run", "--model", str(d), "--layout", "dp=1,seq=16",
                           "--steps", "1", "--timeout", "60"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert all(line.startswith("modelcarve:") for line in lines), proc.stderr  # progress lines, then the one error
    errors = [line for line in lines if "Error" in line or "error" in line]
    assert len(errors) == 1, proc.stderr
    assert "tensor 'model.layers.1.mlp.down_proj.weight' holds NaN or Inf values" in errors[0]

