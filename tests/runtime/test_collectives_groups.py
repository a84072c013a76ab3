"""Process groups are created identically on every rank, whatever a rank's stage holds.

The case (issue 13): a DeepSeek-V3 checkpoint with 3 layers and ``first_k_dense_replace=1``
under ``dp=2,ep=2,pp=2`` puts only the dense layer 0 on pipeline stage 0. ``new_group`` is a
collective over the whole world, so a stage that skipped the expert groups used to leave the
other stage's ranks waiting in ``new_group`` until the collective timeout. Here the whole
``modelcarve verify`` worker runs that layout in 4 gloo ranks with a short collective timeout
(a hang fails as a timeout instead of passing) and must match the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

LAYOUTS = [
    "dp=2,ep=2,pp=2,gbs=4,seq=16,mbs=1,param_dtype=fp32",
    "dp=2,ep=2,pp=2,fsdp,gbs=4,seq=16,mbs=1,param_dtype=fp32",
]


def _worker(path, ckpt):
    import torch.distributed as dist

    from modelcarve.runtime.train.launch import run_worker
    from modelcarve.verify.reference import verify_worker

    reports = []
    for layout in LAYOUTS:
        reports.append(verify_worker(path, layout, steps=2))
        dist.barrier()
    # the `run` worker on a checkpoint (meta model, each rank reads its slices) takes the same path
    ran = run_worker(ckpt, LAYOUTS[0], steps=2, quiet=True)
    return reports, ran


def test_dense_only_stage_does_not_hang(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_runtime_moe import DEEPSEEK

    from test_moe_layer import save_tiny_moe

    transformers.DeepseekV3Config(**DEEPSEEK).save_pretrained(tmp_path / "config")
    hf = save_tiny_moe("deepseek_v3", tmp_path / "ckpt")
    assert DEEPSEEK["num_hidden_layers"] == 3 and DEEPSEEK["first_k_dense_replace"] == 1
    assert (hf.config.num_hidden_layers, hf.config.first_k_dense_replace) == (3, 1)
    from modelcarve.runtime.parallel.pipeline_split import stage_layer_ranges
    from modelcarve.spec.layout import Layout

    assert list(stage_layer_ranges(3, Layout.parse(LAYOUTS[0]))[0]) == [0]  # stage 0: the dense layer alone
    results = run_distributed(_worker, 4, str(tmp_path / "config"), str(tmp_path / "ckpt"), timeout=300, collective_s=30)
    reports, ran = results[0]
    assert ran["steps"] == 2 and all(h["loss"] > 0 for h in ran["history"])
    for layout, report in zip(LAYOUTS, reports):
        bad = [c for c in report["checks"] if not c["passed"]]
        assert report["checks"] and not bad, (layout, bad[:5])
