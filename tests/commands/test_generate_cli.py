"""``modelcarve generate``: the --json schema, completions in prompt order equal to transformers'
greedy tokens, a plan --emit layout file (dtypes included) on two ranks, and every refusal a
single line with exit 2 before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_tiny import save_hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_cli")
    hf = save_hf("LlamaConfig", "LlamaForCausalLM", path)
    return str(path), hf


def _cli(args, capsys):
    from modelcarve.cli import main

    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _hf_greedy(hf, ids, n):
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_json_completions_in_prompt_order(ckpt, capsys):
    path, hf = ckpt
    prompts = [[5, 9, 17, 3, 44, 12, 8], [100, 2]]
    code, out, err = _cli(["--model", path, "--layout", "param_dtype=fp32", "--prompt-ids", "5,9,17,3,44,12,8",
                           "--prompt-ids", "100,2", "--max-tokens", "12", "--ignore-eos", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert [c["token_ids"] for c in report["completions"]] == [_hf_greedy(hf, p, 12) for p in prompts]
    assert all(c["finish_reason"] == "length" and c["text"] is None for c in report["completions"])
    for key in ("ttft_s", "tpot_s", "tokens_per_s", "kv_blocks_used", "kv_blocks_total", "kv_bytes_per_token"):
        assert report[key] is not None and report[key] > 0, key
    assert report["weight_dtype"] == report["kv_dtype"] == "fp32"  # default: the layout's param_dtype


def test_streamed_text_and_summary(ckpt, capsys):
    path, _ = ckpt
    code, out, err = _cli(["--model", path, "--prompt-ids", "1,2,3", "--max-tokens", "4"], capsys)
    assert code == 0, err
    assert "loading" in out and "TTFT" in out and "TPOT" in out and "tok/s" in out and "KV blocks used" in out


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hello"], "has no tokenizer"),
    (["--prompt-ids", ",".join(["1"] * 64)], "context is 64"),
    (["--prompt-ids", "1,2", "--layout", "param_dtype=fp16"], "cannot be executed"),
    (["--prompt-ids", "1,2", "--layout", "cp=2"], "cp > 1"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,2", "--max-tokens", "40", "--kv-cache-bytes", "8192"], "holds"),
])
def test_refusals_are_one_line(ckpt, capsys, args, message):
    code, out, err = _cli(["--model", ckpt[0], *args], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "loading" not in out, err


def test_plan_emit_layout_on_two_ranks(ckpt, tmp_path, capsys):
    """What plan --goal serve-latency --emit writes for 2 devices runs as written, dtypes included;
    with tp = pp = 1 (DP replicas) its tokens equal one device's with the same dtypes."""
    from modelcarve.cli import main

    path, _ = ckpt
    layout = tmp_path / "layout.json"
    assert main(["plan", "--model", f"{path}/config.json", "--cluster", "1x2xH200", "--goal", "serve-latency",
                 "--input-len", "16", "--output-len", "16", "--emit", str(layout)]) == 0
    capsys.readouterr()
    emitted = json.loads(layout.read_text())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "modelcarve.cli", "generate", "--model", path, "--prompt-ids", "4,5,6,7",
            "--max-tokens", "8", "--ignore-eos", "--json", "--layout"]
    proc = subprocess.run(base + [str(layout)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["weight_dtype"], report["kv_dtype"]) == (emitted["weight_dtype"], emitted["kv_dtype"])
    assert report["plan_bytes"] > 0
    if emitted["tp"] == emitted["pp"] == 1:
        same = ",".join(f"{k}={emitted[k]}" for k in ("param_dtype", "weight_dtype", "kv_dtype"))
        single = subprocess.run(base + [same], capture_output=True, text=True, env=env, timeout=300)
        assert single.returncode == 0, single.stderr
        assert report["completions"] == json.loads(single.stdout)["completions"] or \
            report["completions"][0]["token_ids"] == json.loads(single.stdout)["completions"][0]["token_ids"]
