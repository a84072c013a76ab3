"""memory_report.measure_step: bytes per rank by category, against hand-derived figures.

One 2-rank gloo world, tiny-llama in fp32 (P parameters in n tensors; AdamW keeps two fp32
moments per element and one fp32 step counter per tensor: 8 P + 4 n bytes of state):

* params: every rank holds 4 P under dp=2 and zero=1; FSDP2 shards them: the ranks' bytes add
  up to 4 P exactly (its local shards are unpadded);
* grads: 4 P on every rank under dp=2 and zero=1 (read before the optimiser frees them, not 0);
  FSDP2's reduce-scattered shards add up to 4 P;
* optimizer: 8 P + 4 n under dp=2; ZeRO-1 (zero_optimizer.py) gives each rank a contiguous
  range of one flat buffer of all P (padded to Pp, a multiple of 2) and one step counter:
  8 Pp / 2 + 4 on each rank; FSDP2 shards every tensor, so the moments add up to 8 P and each
  rank keeps all n step counters (8 P + 4 n x 2 in all); each rank holds less than the whole;
* comm_buffers: under dp=2 the largest collective is the flat gradient bucket, 4 P;
* activations: what autograd saves is, tensor by tensor, either proportional to the micro-batch
  rows b or independent of them, so the peak A(b) is affine in b: A(3) - A(2) == A(2) - A(1)
  exactly; gradient accumulation frees a micro-batch's activations in its backward, so two
  micro-batches of 1 row peak exactly where one does; full recomputation saves strictly less.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

COMMON = "seq=16,param_dtype=fp32"
CASES = {
    "dp": f"dp=2,gbs=2,mbs=1,{COMMON}",
    "zero1": f"dp=2,zero=1,gbs=2,mbs=1,{COMMON}",
    "fsdp": f"dp=2,fsdp,gbs=2,mbs=1,{COMMON}",
    "b1": f"dp=2,gbs=2,mbs=1,{COMMON}",
    "b2": f"dp=2,gbs=4,mbs=2,{COMMON}",
    "b3": f"dp=2,gbs=6,mbs=3,{COMMON}",
    "accum": f"dp=2,gbs=4,mbs=1,{COMMON}",
    "full": f"dp=2,gbs=2,mbs=1,recompute=full,{COMMON}",
}


def _worker():
    import torch.distributed as dist

    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.measure.memory_report import measure_step
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data, seed_everything
    from modelcarve.spec.layout import Layout

    out = {}
    for name, text in CASES.items():
        layout = Layout.parse(text)
        seed_everything(0)
        mesh = build_mesh(layout)
        model, spec = load_model("tiny-llama", seed=0)
        n = len(list(model.parameters()))
        trainer = Trainer(parallelize(model, layout, mesh), layout, mesh, TrainConfig())
        tokens, targets = make_data(None, spec.vocab_size, 0).batch(0, layout.global_batch, layout.seq)
        _, mem = measure_step(trainer, tokens, targets)
        out[name] = mem | {"n": n}
        dist.barrier()
    return out


def test_memory_categories():
    from modelcarve.spec.catalog import get_model

    P = get_model("tiny-llama").total_params
    ranks = run_distributed(_worker, 2, timeout=300)
    n = ranks[0]["dp"]["n"]
    state = 8 * P + 4 * n
    for r in ranks:
        assert r["dp"]["params"] == r["zero1"]["params"] == 4 * P
        assert r["dp"]["grads"] == r["zero1"]["grads"] == 4 * P
        assert r["dp"]["optimizer"] == state
        assert 0 < r["zero1"]["optimizer"] < state and 0 < r["fsdp"]["optimizer"] < state
        assert r["dp"]["comm_buffers"] == 4 * P
    assert sum(r["fsdp"]["params"] for r in ranks) == 4 * P
    assert sum(r["fsdp"]["grads"] for r in ranks) == 4 * P
    Pp = -(-P // 2) * 2
    for r in ranks:
        assert r["zero1"]["optimizer"] == 12 * Pp // 2 + 4  # fp32 master range + two moments, one step counter
    # FSDP2 shards every tensor over both ranks: each holds a step counter for all n of them
    assert sum(r["fsdp"]["optimizer"] for r in ranks) == 8 * P + 4 * n * len(ranks)
    for r in ranks:
        a1, a2, a3 = (r[f"b{b}"]["activations"] for b in (1, 2, 3))
        assert a1 > 0 and a3 - a2 == a2 - a1 > 0
        assert r["accum"]["activations"] == a1
        assert 0 < r["full"]["activations"] < a1
