"""`modelcarve export`: a DCP training checkpoint -> a directory transformers loads, same logits.

One 2-rank world trains two models a couple of steps and saves (the run worker, real gloo):
  * a qwen3 model with tied embeddings and a vocabulary of 100 under tp=2: tensor parallelism
    pads the vocabulary to 256 rows (tensor.py), the checkpoint and the export hold the true 100;
  * tiny-moe (Mixtral) under dp=2, ep=2: the stacked experts go back to per-expert tensors.
Then, in this process, ``modelcarve export`` (the CLI) writes each as several safetensors shards
and transformers' ``AutoModelForCausalLM.from_pretrained`` is compared with our reference model
holding the checkpoint's trained weights (read by DCP, not through the export).
Tolerance 1e-5 absolute on the logits, as for our reference vs transformers on the same weights
(tests/runtime/test_runtime_checkpoint.py): fp32, the same operations in a different order.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist import run_distributed

SRC = Path(__file__).resolve().parents[2] / "src"
QWEN = dict(model_type="qwen3", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            max_position_embeddings=64, architectures=["Qwen3ForCausalLM"])
BASE = "gbs=4,seq=16,mbs=1,param_dtype=fp32"


def _train(cases):
    import torch.distributed as dist

    from modelcarve.runtime.train.launch import run_worker

    for model, layout, ckpt in cases:
        run_worker(model, layout, steps=2, quiet=True, checkpoint=dict(checkpoint_dir=ckpt, save_every=2))
        dist.barrier()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    (root / "qwen").mkdir()
    (root / "qwen" / "config.json").write_text(json.dumps(QWEN))
    cases = [(str(root / "qwen"), f"tp=2,{BASE}", str(root / "ck-qwen")),
             ("tiny-moe", f"dp=2,ep=2,{BASE}", str(root / "ck-moe"))]
    run_distributed(_train, 2, cases, timeout=600)
    return root


def _export(ckpt: Path, out: Path, size="60KB"):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "modelcarve.cli", "export", "--checkpoint", str(ckpt), "--out", str(out),
                           "--max-shard-size", size], capture_output=True, text=True, env=env, timeout=300)


def _ours(step_dir: Path, config: dict):
    from modelcarve.runtime.checkpoint.export_hf import full_model_state
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.spec.hf_config import spec_from_hf_config

    model = build_model(spec_from_hf_config(config), dtype=torch.float32, seed=123)
    state = full_model_state(step_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "output.weight" for k in missing), (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("name", ["qwen", "moe"])
def test_export_loads_in_transformers_with_our_logits(checkpoints, tmp_path, name):
    from transformers import AutoModelForCausalLM

    ckpt = checkpoints / f"ck-{name}"
    proc = _export(ckpt, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "exported step 2" in proc.stdout
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    config = json.loads((out / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours = _ours(ckpt / "step_00000002", config)
    vocab = config["vocab_size"]
    if name == "qwen":
        assert vocab == 100 and hf.get_output_embeddings().weight.shape[0] == 100  # no tp padding
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    # the trained weights, not the initial ones: training moved them
    init = AutoModelForCausalLM.from_config(hf.config)
    assert not torch.equal(init.state_dict()[next(iter(index["weight_map"]))], hf.state_dict()[next(iter(index["weight_map"]))])


def test_export_refuses_damaged_and_nonempty(checkpoints, tmp_path):
    ckpt = checkpoints / "ck-qwen" / "step_00000002"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    proc = _export(ckpt, tmp_path / "full")
    assert proc.returncode == 2 and "not empty" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _export(ckpt, tmp_path / "o", size="many")
    assert proc.returncode == 2 and "--max-shard-size" in proc.stderr
