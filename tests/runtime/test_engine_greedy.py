"""Greedy generation equals transformers' ``generate(do_sample=False)`` token for token.

fp32, 32 new tokens, three prompts of 5 / 17 / 30 tokens added at engine steps 0, 2 and 5 (so
prefill and decode of different requests share steps), on tiny random checkpoints of every
family (tests/engine_cases.py), for: one device (in this process), tp=2 (llama and mistral
through the fused TP blocks), pp=2, dp=2 replicas
and ep=2 (MoE, dp=2,ep=2) in one 2-rank gloo world, and tp=2 x pp=2 (and tp=2 x ep=2 for MoE)
in one 4-rank world.
Exact equality is the right criterion: both sides compute the same fp32 arithmetic up to
summation order (~1e-6 relative), and with std-0.2 weights the top two logits of these tiny
models are far further apart than that (a flip would show as a failure, never be tolerated).

A cache broken on purpose (one key position hidden from every query after it) must fail.
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from engine_cases import CKPTS, MOE, build_all, drive, greedy, run_layouts

FP32 = "param_dtype=fp32"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("engine_ckpts"))


def _engine(path, **kw):
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=path, layout=f"tp=1,{FP32}", kv_cache_bytes=1 << 21, **kw))


@pytest.mark.parametrize("name", list(CKPTS))
def test_single_device_equals_transformers(ckpts, name):
    from modelcarve.runtime.engine.model_runner import PackedLinear

    path, prompts, refs = ckpts[name]
    engine = _engine(path)
    # every step (single-row decode steps too) runs through the oneDNN-packed linears on CPU, so they are what is compared
    assert any(isinstance(m, PackedLinear) for m in engine.runner.chunk.modules())
    assert drive(engine, prompts, greedy()) == refs


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_decode_length_groups_equal_transformers(ckpts, name, monkeypatch):
    """Decode steps attended in length groups (``GROUP_COST`` 0: whenever the widths differ), through
    the fused block (llama; mistral with its sliding window) and the module path (qwen3's q/k norm)."""
    from modelcarve.runtime.engine import paged_attention
    from modelcarve.runtime.engine.fused import FusedBlock

    monkeypatch.setattr(paged_attention, "GROUP_COST", 0)
    grouped = []
    real = paged_attention._length_groups

    def spy(*args):
        got = real(*args)
        grouped.append(got is not None and len(got) > 1)
        return got

    monkeypatch.setattr(paged_attention, "_length_groups", spy)
    path, prompts, refs = ckpts[name]
    engine = _engine(path)
    assert any(isinstance(b, FusedBlock) for b in engine.runner.blocks) == (name != "qwen3")
    assert drive(engine, prompts, greedy()) == refs
    assert any(grouped)


def test_broken_cache_fails(ckpts, monkeypatch):
    """Hide key position 3 from every later query: the outputs must stop matching transformers."""
    from modelcarve.runtime.engine import paged_attention

    real = paged_attention.StepContext.mask

    def broken(self, window):
        q, k = self.q_pos[:, None, :, None], self.k_pos
        m = real(self, window)
        if m is None:  # one decoding sequence: all keys visible
            m = torch.ones(q.shape[0], 1, q.shape[2], k.numel(), dtype=torch.bool)
        return m & ~((k == 3) & (q > 3))

    monkeypatch.setattr(paged_attention.StepContext, "mask", broken)
    path, prompts, refs = ckpts["llama"]
    assert drive(_engine(path), prompts, greedy()) != refs


def _layouts_2():
    out = []
    for name in CKPTS:
        out += [(name, f"tp=2,{FP32}"), (name, f"pp=2,{FP32}"), (name, f"dp=2,{FP32}")]
        if name in MOE:
            out.append((name, f"dp=2,ep=2,{FP32}"))
    return out


FUSED_AT_TP2 = ("llama", "mistral")
"""Families whose tp=2 (no sp) layers run as fused blocks (engine/fused.py: the packed column shards,
the row-parallel projections packed and reduced over the TP group); qwen3's q/k norms and the other
families keep the module path."""


def _world(ckpts, layouts):
    return run_layouts(ckpts, layouts)


def test_two_ranks_equal_transformers(ckpts):
    layouts = _layouts_2()
    results = run_distributed(_world, 2, ckpts, layouts, timeout=900)[0]
    bad = [(n, lay) for n, lay in layouts if results[(n, lay)][0] != ckpts[n][2]]
    assert not bad, bad
    for (name, layout), (_, stats, _) in results.items():
        assert stats["plan_bytes"] > 0 and stats["generation_tokens"] == 3 * 32, (name, layout)
        if layout.startswith("pp=2"):  # micro-batches of different requests in flight across steps
            assert stats["max_in_flight"] == 2 and stats["microbatches"] == stats["steps"], (name, stats)
        else:
            assert stats["max_in_flight"] == 0, (name, stats)
        if layout == f"tp=2,{FP32}":  # so the fused TP path is what was compared with transformers
            assert (stats["fused_blocks"] > 0) == (name in FUSED_AT_TP2), (name, stats["fused_blocks"])
        if "tp=2" in layout:  # and the TP collectives went through shared memory (host_shm.py)
            assert stats["shm"] is None and stats["shm_calls"] > 0, (name, stats["shm"], stats["shm_calls"])
    _kv_equals_planner(ckpts, results)


def _kv_equals_planner(ckpts, results):
    """Bytes per token (the fullest rank) and the block count printed at start-up are the planner's
    KV arithmetic for the same model and layout (MLA: the latent on every TP rank; qwen3's one kv
    head replicated over tp=2; per pipeline stage)."""
    from modelcarve.plan.serve.memory import shard_facts
    from modelcarve.runtime.checkpoint.hf_load import model_spec
    from modelcarve.spec.layout import Layout

    for (name, text), (_, stats, _) in results.items():
        lay = Layout.parse(text)
        planned = shard_facts(model_spec(ckpts[name][0]), tp=lay.tp, pp=lay.pp, ep=lay.ep, kv_dtype="fp32")
        assert stats["kv_bytes_per_token"] == planned.kv_bytes_per_token, (name, text)
        blocks = (1 << 21) // (16 * stats["kv_bytes_per_token"])
        assert stats["kv_blocks_total"] == lay.dp * (blocks - 1), (name, text)


def test_four_ranks_equal_transformers(ckpts):
    """tp=2 x pp=2 for every family, tp=2 x ep=2 (expert TP = TP, two DP-attention replicas) for MoE, and
    dp=2 x pp=2 for llama (each micro-batch in flight spans both replicas' pipelines)."""
    layouts = [(name, f"tp=2,pp=2,{FP32}") for name in CKPTS] + [(name, f"tp=2,dp=2,ep=2,{FP32}") for name in MOE]
    layouts.append(("llama", f"dp=2,pp=2,{FP32}"))
    results = run_distributed(_world, 4, ckpts, layouts, timeout=900)[0]
    bad = [(n, lay) for n, lay in layouts if results[(n, lay)][0] != ckpts[n][2]]
    assert not bad, bad
    for (name, layout), (_, stats, _) in results.items():
        assert stats["max_in_flight"] == (2 if "pp=2" in layout else 0), (name, layout, stats)
        if "tp=2" in layout:  # each TP group's collectives through its own shared segment
            assert stats["shm"] is None and stats["shm_calls"] > 0, (name, layout, stats["shm"])
    _kv_equals_planner(ckpts, results)
