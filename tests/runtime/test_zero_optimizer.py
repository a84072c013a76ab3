"""ZeRO-1 / ZeRO-2 (zero_optimizer.py) and bucketed plain DP (grad_buckets.py) against torch.

One 2-rank gloo world, tiny-llama fp32, dp=2, gbs=4, mbs=1 (two micro-batches per rank, so
gradient accumulation is exercised); P parameters, padded to Pp = P rounded up to even.

1. Exactness, clipping off (max_norm=0), 3 steps: plain DP (one 25 MiB bucket), plain DP with
   4 KiB buckets (many buckets, launched from the hooks during the backward), ZeRO-1 and ZeRO-2
   give bit-identical parameters and losses. Why exact: with two ranks every reduced element is
   the one addition a + b, whichever collective (all-reduce, reduce-scatter) does it; AdamW on
   CPU runs its single-tensor (for-loop) kernel, elementwise, so stepping one flat range applies
   the same operations to each element as stepping each parameter.
2. Oracle (torch's own DDP, clip_grad_norm_ at 1.0 and torch.optim.AdamW, same seed, one step)
   for plain DP, ZeRO-1 and ZeRO-2: the loss (rel 1e-5) and the gradients before clipping (abs
   1e-4) within verify's fp32 tolerances; the global norm (rel 1e-5, the loss tolerance: fp32
   reassociation); the parameters after the step within the first AdamW step's sensitivity:
   at step 1 m_hat = g and sqrt(v_hat) = |g|, so the update is lr g/(|g|+eps); for two
   gradients of the same sign its difference is at most lr |g1-g2| eps/(min|g| + eps)^2, and at
   most 2 lr if the signs differ; plus 16 fp32 roundings of the update (lr 16 2^-24) and two
   of the parameter (4 eps32 |p|). Weight decay multiplies the same parameter alike.
3. CommLog (hand-derived bytes) of one step: ZeRO-1/2 issue over the dp group (at dp=2 it is
   the whole world: CommLog names it ``world``) exactly one reduce_scatter and one all_gather,
   fp32, payload 4 Pp each (wire 2 Pp each: (n-1)/n S), no broadcast and no gradient
   all-reduce; the only all-reduces are the step loss (fp32, 4 bytes) and the squared global
   norm (fp64, 8 bytes). Plain DP: fp32 gradient all-reduces on dp
   whose payloads add up to 4 P (one 25 MiB bucket: one call).
4. Memory by category: optimizer state 8 Pp/2 + 4 (one flat range, one step counter) per rank;
   gradients 4 P (ZeRO-1, the whole flat buffer) and 4 Pp/2 (ZeRO-2, the owned range only).
5. ZeRO-2 composed with tp+sp, with a pp=2 1f1b pipeline and with EP experts (their own
   expert-data-parallel group) on 4 ranks: verify's checks against the single-device reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402

COMMON = "dp=2,gbs=4,mbs=1,seq=16,param_dtype=fp32"
CASES = {"dp": COMMON, "dp_small_buckets": COMMON, "zero1": f"{COMMON},zero=1", "zero2": f"{COMMON},zero=2"}


def _build(text):
    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(text)
    mesh = build_mesh(layout)
    model, spec = load_model("tiny-llama", seed=0)
    return parallelize(model, layout, mesh), layout, mesh, spec


def _worker():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from modelcarve.runtime.parallel import grad_buckets
    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.distributed.collectives import CommLog
    from modelcarve.runtime.measure.memory_report import measure_step
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data

    rank = dist.get_rank()
    out = {"exact": {}, "oracle": {}, "comm": {}, "mem": {}}
    # 1. exactness, clipping off
    for name, text in CASES.items():
        grad_buckets.BUCKET_BYTES = 4096 if name == "dp_small_buckets" else 25 * 2**20
        chunks, layout, mesh, spec = _build(text)
        trainer = Trainer(chunks, layout, mesh, TrainConfig(max_norm=0.0))
        data = make_data(None, spec.vocab_size, 0)
        losses = [trainer.step(*data.batch(s, layout.global_batch, layout.seq))["loss"] for s in range(3)]
        buckets = chunks[0].__dict__.get("_mc_grad_buckets")
        out["exact"][name] = dict(losses=losses, params={k: v.detach().clone() for k, v in chunks[0].state_dict().items()},
                                  buckets=len(buckets.buckets) if buckets else 0,
                                  overlapped=buckets.overlapped if buckets else 0)
    grad_buckets.BUCKET_BYTES = 25 * 2**20
    # 2. torch DDP oracle, one step with clipping at 1.0
    config = TrainConfig(max_norm=1.0)
    ref, spec = load_model("tiny-llama", seed=0)
    ddp = DistributedDataParallel(ref, process_group=dist.group.WORLD)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **config.adamw())
    tokens, targets = make_data(None, spec.vocab_size, 0).batch(0, 4, 16)
    rows = slice(2 * rank, 2 * rank + 2)
    logits = ddp(tokens[rows])
    ref_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[rows].reshape(-1))
    ref_loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.max_norm))
    clipped = {k: p.grad.clone() for k, p in ref.named_parameters()}
    ref_opt.step()
    loss_all = ref_loss.detach().clone()
    dist.all_reduce(loss_all)
    out["oracle"]["torch"] = dict(loss=float(loss_all) / 2, grads=ref_grads, clipped=clipped, norm=ref_norm,
                                  params={k: p.detach().clone() for k, p in ref.named_parameters()})
    for name in ("dp", "zero1", "zero2"):
        chunks, layout, mesh, spec = _build(CASES[name])
        trainer = Trainer(chunks, layout, mesh, config)
        loss = trainer.forward_backward(tokens, targets)
        if hasattr(trainer.optimizer, "full_gradients"):
            trainer.optimizer.full_gradients()
        grads = {k: p.grad.clone() for k, p in chunks[0].named_parameters()}
        norm = trainer.optimizer_step()
        out["oracle"][name] = dict(loss=loss, grads=grads, norm=norm,
                                   params={k: p.detach().clone() for k, p in chunks[0].named_parameters()})
    # 3./4. CommLog and memory categories of one step
    for name in ("dp", "zero1", "zero2"):
        chunks, layout, mesh, spec = _build(CASES[name])
        trainer = Trainer(chunks, layout, mesh, TrainConfig())
        tok, tgt = make_data(None, spec.vocab_size, 0).batch(0, layout.global_batch, layout.seq)
        with CommLog(layout) as log:
            trainer.step(tok, tgt)
        out["comm"][name] = [(e.op, e.axis, e.dtype, e.payload, e.wire) for e in log.events]
        _, mem = measure_step(trainer, tok, tgt)
        out["mem"][name] = mem
    dist.barrier()
    return _plain(out)


def _plain(obj):
    """Tensors as numpy arrays: results cross the process boundary by value."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _first_step_allowance(p_ref, g1, g2, lr, eps):
    import torch

    small = torch.minimum(g1.abs(), g2.abs())
    same = torch.sign(g1) == torch.sign(g2)
    f = torch.where(same, (g1 - g2).abs() * eps / (small + eps) ** 2, torch.full_like(g1, 2.0)).clamp(max=2.0)
    return lr * (f + 16 * 2.0**-24) + 4 * torch.finfo(torch.float32).eps * p_ref.abs()


def test_zero_and_bucketed_dp_against_torch():
    import torch

    from modelcarve.spec.catalog import get_model

    P = get_model("tiny-llama").total_params
    Pp = -(-P // 2) * 2
    ranks = run_distributed(_worker, 2, timeout=600)
    T = torch.from_numpy
    for r in ranks:
        ex = r["exact"]
        assert ex["dp"]["buckets"] == 1 and ex["dp_small_buckets"]["buckets"] > 4
        # dense model: every bucket is complete, hence launched, inside the last backward
        assert ex["dp_small_buckets"]["overlapped"] == ex["dp_small_buckets"]["buckets"]
        for name in ("dp_small_buckets", "zero1", "zero2"):
            assert ex[name]["losses"] == ex["dp"]["losses"], name
            for k, v in ex["dp"]["params"].items():
                assert torch.equal(T(ex[name]["params"][k]), T(v)), (name, k)
    config_lr, eps = 1e-3, 1e-8
    for r in ranks:
        ref = r["oracle"]["torch"]
        for name in ("dp", "zero1", "zero2"):
            got = r["oracle"][name]
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), name
            assert abs(got["norm"] - ref["norm"]) <= 1e-5 * ref["norm"], name
            coef = torch.tensor(min(1.0, 1.0 / (got["norm"] + 1e-6)), dtype=torch.float64).float()
            for k, g in ref["grads"].items():
                assert (T(got["grads"][k]) - T(g)).abs().max() <= 1e-4, (name, k)
                allowance = _first_step_allowance(T(ref["params"][k]), T(got["grads"][k]) * coef, T(ref["clipped"][k]),
                                                  config_lr, eps)
                assert ((T(got["params"][k]) - T(ref["params"][k])).abs() <= allowance).all(), (name, k)
    for r in ranks:
        for name in ("zero1", "zero2"):
            events = r["comm"][name]
            ops = sorted((op, axis, dtype, payload, wire) for op, axis, dtype, payload, wire in events)
            assert ops == sorted([("reduce_scatter", "dp", "float32", 4 * Pp, 2.0 * Pp),
                                  ("all_gather", "dp", "float32", 4 * Pp, 2.0 * Pp),
                                  ("all_reduce", "dp", "float32", 4, 4.0),
                                  ("all_reduce", "dp", "float64", 8, 8.0)]), (name, events)
        dp = [e for e in r["comm"]["dp"] if e[0] == "all_reduce" and e[2] == "float32" and e[3] > 4]
        assert sum(e[3] for e in dp) == 4 * P and len(dp) == 1
        assert not [e for e in r["comm"]["dp"] if e[0] in ("broadcast", "reduce_scatter", "all_gather")]
        mem = r["mem"]
        assert mem["zero1"]["optimizer"] == mem["zero2"]["optimizer"] == 12 * Pp // 2 + 4  # fp32 master range + two moments
        assert mem["zero1"]["grads"] == 4 * P
        assert mem["zero2"]["grads"] == 4 * Pp // 2


# ZeRO-2 composed with the other axes, on 4 ranks, against the single-device reference (verify:
# loss, every gradient, every parameter after 3 steps, fp32 tolerances of verify.TOLERANCES)
ZERO2_4 = [
    ("tiny-llama", "tp=2,sp,dp=2,zero=2,gbs=4,seq=16,mbs=1,param_dtype=fp32"),
    ("tiny-llama", "pp=2,dp=2,zero=2,gbs=8,schedule=1f1b,seq=16,mbs=1,param_dtype=fp32"),
    ("tiny-moe", "dp=4,ep=2,zero=2,gbs=8,seq=16,mbs=1,param_dtype=fp32"),
]


def _verify_cases(cases):
    import torch.distributed as dist

    from modelcarve.verify.reference import verify_worker

    out = []
    for model, layout in cases:
        out.append(verify_worker(model, layout, steps=3))
        dist.barrier()
    return out


def test_zero2_compositions_match_reference():
    rank0 = run_distributed(_verify_cases, 4, ZERO2_4, timeout=400)[0]
    failures = []
    for (model, layout), report in zip(ZERO2_4, rank0):
        kinds = {c["name"].split("/")[0] for c in report["checks"]}
        assert {"loss", "grad", "param"} <= kinds, (layout, kinds)
        bad = [c for c in report["checks"] if not c["passed"]]
        if bad:
            failures.append((layout, bad[:5]))
    assert not failures, failures
