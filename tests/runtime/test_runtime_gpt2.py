"""gpt2 checkpoints (Conv1D weights [in, out], fused c_attn, tied head, learned positions): our
logits equal GPT2LMHeadModel's; and what the runtime can know in advance about a checkpoint or
layout is refused by ``modelcarve run`` before torchrun starts any rank (one line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_tiny import logits_diff, save_hf

transformers = pytest.importorskip("transformers")

GPT2 = dict(vocab_size=263, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)


def test_gpt2_logits_equal_transformers(tmp_path):
    from modelcarve.runtime.checkpoint.hf_load import load_model

    hf = save_hf("GPT2Config", "GPT2LMHeadModel", tmp_path, base=GPT2)
    ours, spec = load_model(str(tmp_path))
    assert spec.family == "gpt2" and spec.tied_embeddings
    assert ours.output.weight is ours.tok_embeddings.weight
    ids = torch.randint(0, GPT2["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    assert logits_diff(ours, hf, ids) <= 1e-5


def test_gpt2_untied_head(tmp_path):
    from modelcarve.runtime.checkpoint.hf_load import load_model

    hf = save_hf("GPT2Config", "GPT2LMHeadModel", tmp_path, base=GPT2 | dict(tie_word_embeddings=False))
    ours, spec = load_model(str(tmp_path))
    assert not spec.tied_embeddings and ours.output.weight is not ours.tok_embeddings.weight
    ids = torch.randint(0, GPT2["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    assert logits_diff(ours, hf, ids) <= 1e-5


def _cli(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=120)
    return proc.returncode, proc.stderr


def test_refusals_before_any_rank_starts(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf("GPT2Config", "GPT2LMHeadModel", tmp_path / "ok", base=GPT2)
    cases = [
        (str(tmp_path / "ok"), "tp=2,sp,seq=16", "learned positions"),
        (str(tmp_path / "ok"), "seq=128", "exceeds the 64 learned positions"),
    ]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    tensors.pop("transformer.h.1.mlp.c_fc.weight")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    cases.append((str(broken), "dp=2,seq=16", "no tensor 'transformer.h.1.mlp.c_fc.weight'"))
    for model, layout, fragment in cases:
        code, err = _cli("run", "--model", model, "--layout", layout, "--steps", "1")
        assert code == 2 and fragment in err, (layout, err)
        assert err.count("\n") == 1 and "Traceback" not in err and "torch.distributed.run" not in err
