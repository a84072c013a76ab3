"""verify of bf16 ZeRO-1/2 (bf16 parameters, fp32 master weights in the distributed optimiser)
against a reference that holds the same precision policy (spec/support.held_param_dtype,
verify/reference.py's MasterWeightsAdamW), on the tied std=0.2 llama (real gloo ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py, hf_tiny.py
from dist import run_distributed  # noqa: E402

CASES = ["dp=2,zero=1,gbs=2,seq=64,mbs=1,param_dtype=bf16", "dp=2,zero=2,gbs=4,seq=32,mbs=1,param_dtype=bf16",
         "dp=2,gbs=2,seq=64,mbs=1,param_dtype=bf16"]


def _worker(ckpt):
    import torch.distributed as dist

    from modelcarve.verify.reference import verify_worker

    out = []
    for layout in CASES:
        out.append(verify_worker(ckpt, layout, steps=3))
        dist.barrier()
    return out


def test_bf16_zero_matches_a_reference_of_the_same_policy(tmp_path):
    from hf_tiny import save_hf

    from modelcarve.spec.layout import Layout
    from modelcarve.spec.support import held_param_dtype

    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path / "tied", tie_word_embeddings=True)
    reports = run_distributed(_worker, 2, str(tmp_path / "tied"), timeout=600)[0]
    assert [held_param_dtype(Layout.parse(c)) for c in CASES] == ["bf16", "bf16", "fp32"]
    assert [r["precision"] for r in reports] == ["bf16-master", "bf16-master", "bf16"]
    for layout, report in zip(CASES, reports):
        bad = [c for c in report["checks"] if not c["passed"]]
        assert not bad, (layout, bad)
    for report in reports[:2]:
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["logits"]["max_abs"] == 0.0  # the same bf16 weights, the same per-row arithmetic
        assert any(n.startswith("grad/") and c["max_abs"] > 0 for n, c in checks.items())  # a real comparison
