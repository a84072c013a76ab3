"""verify --against-plan on a Qwen3-shaped checkpoint: per-head q/k RMSNorm (qk-norm) and ONE key/value
head, so under tp=2 the kv head is replicated over both TP ranks, not sharded.

What the per-op model (plan/predict/step_traffic.py, plan/predict/activations.py) adds for it, each
judged here against the runtime on real gloo ranks:

* parameters: ``q_norm`` and ``k_norm`` (one ``head_dim`` weight each per layer, replicated over tp);
  with fewer kv heads than TP ranks, ``wk`` / ``wv`` whole on every rank that uses the head;
* traffic: the replicated weights' partial gradients summed over their group once per step
  (runtime/parallel/tensor.py ``replicated_partial`` / ``kv_replica_groups``): q_norm and k_norm
  over tp (sp or not), wk and wv over the ranks sharing the kv head — to the byte, with the axis
  named (``tp``);
* activations: each qk-norm saves its fp32 input, its fp32 inverse RMS per head and row and its
  output, ``(4 + c) T (nh/t + kv) hd + 4 T (nh/t + kv)`` per layer, within 10% (exact in fp32 but
  for the 28 bytes of boolean masks under tp the dense llama has too); under recomputation the q/k
  norms are re-saved with the block (``full``) or kept beside the core's inputs (``selective``):
  dp full, tp selective, pp 1f1b full in fp32 and dp selective in bf16, exact but for tp's masks.

bf16 is judged on ``dp=2,zero=1`` (bf16 parameters with fp32 master weights) and on ``tp=2`` (autocast),
whose reference checks use verify's anchored bound for split layouts (verify/reference.py
``anchored_tolerance``: the logits differ by 0.0625, two bf16 spacings near 5, above the fixed 0.05
and inside 4 x the reference's own 0.12 distance from fp32).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: dist.py, hf_tiny.py
from dist import run_distributed  # noqa: E402
from verify_checks import against_plan_worker, assert_every_row_judged  # noqa: E402

FP32 = "seq=16,mbs=1,param_dtype=fp32"
CASES = [
    f"dp=2,zero=2,gbs=8,{FP32}",
    f"dp=2,fsdp,gbs=4,{FP32}",
    f"tp=2,gbs=2,{FP32}",
    f"tp=2,sp,gbs=2,{FP32}",
    f"pp=2,gbs=4,schedule=1f1b,{FP32}",
    f"pp=2,gbs=4,schedule=zero-bubble,{FP32}",  # the last stage's q/k norms: W frees their fp32 outputs
    f"cp=2,gbs=2,{FP32}",
    "dp=2,zero=1,gbs=4,seq=16,mbs=1,param_dtype=bf16",
    "tp=2,gbs=2,seq=16,mbs=1,param_dtype=bf16",
    "pp=2,gbs=4,schedule=zero-bubble,seq=16,mbs=1,param_dtype=bf16",  # last stage exact (W frees the q/k norms' bf16 outputs)
    # recomputation: the q/k norms re-saved with the block (full) or kept outside the core (selective)
    f"dp=2,gbs=4,recompute=full,{FP32}",
    f"tp=2,gbs=2,recompute=selective,{FP32}",
    f"pp=2,gbs=4,schedule=1f1b,recompute=full,{FP32}",
    "dp=2,gbs=4,recompute=selective,seq=16,mbs=1,param_dtype=bf16",
]


@pytest.fixture(scope="module")
def qwen3_reports(tmp_path_factory):
    from hf_tiny import save_hf

    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    save_hf("Qwen3Config", "Qwen3ForCausalLM", path, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return run_distributed(against_plan_worker, 2, [(str(path), c) for c in CASES], timeout=600)[0]


def test_every_row_judged_bytes_exact_activations_within_ten_percent(qwen3_reports):
    for layout, report in zip(CASES, qwen3_reports):
        assert_every_row_judged(layout, report)


def test_replicated_kv_head_and_qk_norm_gradients_are_summed_over_tp(qwen3_reports):
    # tiny: hidden 64, head_dim 16, 2 layers: q_norm + k_norm = 2 x 2 x 16 x 4 = 256 bytes, wk + wv of
    # the one kv head = 2 x 2 x 64 x 16 x 4 = 16,384 bytes, all-reduced over the tp pair once per step
    report = qwen3_reports[CASES.index(f"tp=2,gbs=2,{FP32}")]
    rows = {(r["quantity"], r["axis"], r["rank"]): r for r in report["against_plan"]}
    tp_reduce = rows[("payload:all_reduce", "tp", 0)]
    assert tp_reduce["ok"] is True
    # the rest of what goes over the tp pair: per micro-batch (gbs=2, mbs=1: 2 of them) 4 hidden-state
    # all-reduces per layer and the head's input gradient (16 x 64 fp32 values each), the embedding's
    # output (fp32), the vocab-parallel loss's three 16-row fp32 vectors; once, the fp64 gradient norm
    m, T, h = 2, 16, 64
    acts = (4 * 2 + 1) * m * T * h * 4 + m * T * h * 4 + 3 * m * T * 4 + 8
    assert tp_reduce["measured"] == acts + 256 + 16_384
