"""verify --against-plan on a Qwen2-shaped checkpoint: biases on the q, k and v projections (Qwen2 and
Qwen2.5 ship them; output and MLP biases: test_verify_against_plan_bias.py).

What the per-op model (plan/predict/step_traffic.py) adds for them, judged here on real gloo ranks:
the q / k / v biases are split with their projections' output columns under tp (no tp reduction of
their gradients: each rank's slice is its own), gradients and ZeRO / FSDP state count them, and with
fewer kv heads than TP ranks (tp=4 over 2 kv heads) the k / v biases are replicated with wk / wv and
their gradients summed over the ranks sharing the head, once per step: 2 layers x (16 + 16) x 4 =
256 bytes more on that all-reduce than the Llama-shaped model, to the byte. Activations: the bias
add saves nothing (``addmm`` keeps the input and the weight), so the dense llama's terms hold.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py, hf_tiny.py
from dist import run_distributed  # noqa: E402
from verify_checks import against_plan_worker, assert_every_row_judged  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
CASES = [f"dp=2,zero=2,gbs=8,{FP32}", f"dp=2,fsdp,gbs=4,{FP32}", f"tp=2,sp,gbs=2,{FP32}", f"pp=2,gbs=4,{FP32}",
         f"cp=2,gbs=2,{FP32}", "tp=2,gbs=2,seq=16,mbs=1,param_dtype=bf16"]
CASES_4 = [f"tp=4,gbs=2,{FP32}", "tp=4,sp,gbs=2,seq=16,mbs=1,param_dtype=bf16"]


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    from hf_tiny import save_hf

    path = tmp_path_factory.mktemp("qwen2") / "ckpt"
    save_hf("Qwen2Config", "Qwen2ForCausalLM", path, tie_word_embeddings=False)
    return str(path)


def test_every_row_judged_with_qkv_biases(qwen2_ckpt):
    for layout, report in zip(CASES, run_distributed(against_plan_worker, 2, [(qwen2_ckpt, c) for c in CASES], timeout=600)[0]):
        assert_every_row_judged(layout, report)


def test_replicated_kv_biases_summed_with_their_weights(qwen2_ckpt):
    reports = run_distributed(against_plan_worker, 4, [(qwen2_ckpt, c) for c in CASES_4], timeout=600)[0]
    for layout, report in zip(CASES_4, reports):
        assert_every_row_judged(layout, report)
    rows = [r for r in reports[0]["against_plan"] if r["quantity"] == "payload:all_reduce" and r["axis"] == "tp_sub"]
    # wk + wv of 2 layers: 2 x 2 x 64 x 16 x 4 = 16,384 bytes; their biases 2 x 2 x 16 x 4 = 256 more
    assert rows and all(r["measured"] == r["predicted"] == 16_384 + 256 for r in rows)

