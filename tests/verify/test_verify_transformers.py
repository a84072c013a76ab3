"""``modelcarve verify --reference transformers``: our single-device reference and split layouts
(tp2, pp2, dp2; real gloo processes) against transformers' logits and greedy generations on the
same tiny checkpoint (std-0.2 weights, llama3 rope scaling, prompts past original_max); a
deliberately wrong rope makes it fail; without transformers installed, one line before any rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist import run_distributed
from hf_tiny import save_hf

transformers = pytest.importorskip("transformers")

ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)
LAYOUTS = ["tp=2,seq=32,gbs=2,param_dtype=fp32", "pp=2,seq=32,gbs=2,param_dtype=fp32",
           "dp=2,seq=32,gbs=2,param_dtype=fp32"]


def _worker(path, layouts, break_rope):
    import torch.distributed as dist

    from modelcarve.verify.against_transformers import verify_transformers_worker

    if break_rope:  # a reference with the plain rope table: must not pass
        import modelcarve.runtime.model.transformer as model

        plain = model.rope_cos_sin
        model.rope_cos_sin = lambda pos, dim, spec, dtype: plain(pos, dim, spec.replace(rope_scaling=()), dtype)
    reports = [verify_transformers_worker(path, text, seed=0, new_tokens=12) for text in layouts]
    return reports if dist.get_rank() == 0 else None


def test_reference_and_split_layouts_equal_transformers(tmp_path):
    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, rope_parameters=dict(ROPE), max_position_embeddings=64)
    reports = run_distributed(_worker, 2, str(tmp_path), LAYOUTS, False, timeout=600)[0]
    for text, report in zip(LAYOUTS, reports):
        checks = {c["name"]: c for c in report["checks"]}
        assert set(checks) == {"logits/reference", "greedy/reference", "logits/split", "greedy/split"}, text
        assert report["passed"], (text, report["checks"])
        assert checks["logits/split"]["max_abs"] <= 1e-4 and checks["greedy/split"]["max_abs"] == 0
        assert report["prompt_lengths"][0] == 32 - 12 and len(set(report["prompt_lengths"])) == 2
    broken = run_distributed(_worker, 2, str(tmp_path), LAYOUTS[:1], True, timeout=600)[0][0]
    failed = {c["name"] for c in broken["checks"] if not c["passed"]}
    assert {"logits/reference", "logits/split"} <= failed and not broken["passed"]


def test_cli_end_to_end(tmp_path):
    # mistral, window 8 < prompts of 12 and 24; with these seeds the second row's greedy continuation
    # passes through id 2, the config's end-of-sequence id, which generate must not stop at
    save_hf("MistralConfig", "MistralForCausalLM", tmp_path, sliding_window=8)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", "verify", "--reference", "transformers",
                           "--model", str(tmp_path), "--layout", "tp=2,seq=32,gbs=2", "--dtype", "fp32", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["reference"] == "transformers" and report["passed"] and len(report["checks"]) == 4


def test_without_transformers_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    from modelcarve.cli import main

    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    code = main(["verify", "--reference", "transformers", "--model", str(tmp_path), "--layout", "tp=2"])
    err = capsys.readouterr().err
    assert code == 2 and "needs transformers, which is not installed: pip install transformers" in err
    assert err.count("\n") == 1
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert main(["verify", "--reference", "transformers", "--model", "tiny-llama", "--layout", "tp=2"]) == 2
    assert "needs a checkpoint directory" in capsys.readouterr().err
