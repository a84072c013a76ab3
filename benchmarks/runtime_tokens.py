"""Training throughput (tokens/s) per layout on CPU for small-llama (~20M parameters), and our
hand-written TP (runtime/parallel/tensor.py) against a plain ``parallelize_module`` TP baseline, same run.

    OMP_NUM_THREADS=1 python benchmarks/runtime_tokens.py --out benchmarks/results/runtime_tokens.json

Every layout runs ``--steps`` AdamW steps of ``gbs x seq`` tokens (synthetic data, fp32; one
micro-batch per data-parallel replica, ``pp`` micro-batches for a pipeline) in real
gloo processes, one process per rank, one thread per process; tokens/s is the mean over the
steps after the first (warm-up). The baseline is written here: torch's ``ColwiseParallel`` /
``RowwiseParallel`` on the same projections, vocab-parallel embedding (``RowwiseParallel`` with
replicated input) and LM head (``ColwiseParallel`` with sharded DTensor logits) under
``loss_parallel`` — the torchtitan recipe without sequence parallelism — and the same AdamW
and global-norm clipping (torch's ``get_total_norm`` on the DTensor and the plain gradients).
The two TP implementations run in the same two processes, one step of each in turn, and their
median step times are compared, so a shared machine's load hits both alike.
Figures depend on the machine and its load; the JSON records both (load averages included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from dist import run_distributed  # noqa: E402 - the shared multi-process harness (tests/dist.py)

LAYOUTS = ["dp=1", "dp=2", "dp=2,zero=1", "dp=2,fsdp", "tp=2", "tp=2,sp", "pp=2,schedule=1f1b"]


def spawn(fn, world, *args):
    """``fn(*args)`` on ``world`` gloo ranks, collective timeout 120 s; one result per rank."""
    return run_distributed(fn, world, *args, timeout=900, collective_s=120)


def ours(model, layout, steps):
    from modelcarve.runtime.train.launch import run_worker

    result = run_worker(model=model, layout=layout, steps=steps, quiet=True)
    if result is None:
        return None
    return dict(tokens_per_s=result["tokens_per_s"], losses=[h["loss"] for h in result["history"]],
                # steps the trainer does not time (the first, a measured one) carry None
                step_tokens_per_s=[None if h["tokens_per_s"] is None else round(h["tokens_per_s"]) for h in result["history"]],
                comm_bytes_per_step=result["memory"][0]["comm_bytes_per_step"],
                peak_rss_mib=[round(m["peak_rss_bytes"] / 2**20) for m in result["memory"]])


def _baseline_model(spec, layout):
    """The reference model with torch's parallelize_module TP plan (see module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from modelcarve.runtime.model.transformer import build_model

    model = build_model(spec, seed=0)
    mesh = init_device_mesh("cpu", (layout.tp,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    return model


def tp_pair(model_name, layout_text, steps):
    """Ours and the baseline in the same two processes, one step of each in turn, so the load of
    this shared machine hits both alike; per-step times, medians compared."""
    import statistics

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from modelcarve.runtime.distributed.mesh import build_mesh, device_type
    from modelcarve.runtime.build import build_chunks
    from modelcarve.runtime.train.trainer import SyntheticData, TrainConfig, Trainer
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(layout_text)
    spec = get_model(model_name)
    config = TrainConfig()
    mesh = build_mesh(layout)
    chunks, _ = build_chunks(model_name, layout, mesh, seed=0, device=device_type())
    trainer = Trainer(chunks, layout, mesh, config)
    base = _baseline_model(spec, layout)
    base_opt = torch.optim.AdamW(base.parameters(), **config.adamw())
    data = SyntheticData(spec.vocab_size, 0)
    times = {"modelcarve": [], "baseline": []}
    losses = {"modelcarve": [], "baseline": []}
    for step in range(steps):
        tokens, targets = data.batch(step, layout.global_batch, layout.seq)
        dist.barrier()
        start = time.perf_counter()
        losses["modelcarve"].append(trainer.step(tokens, targets)["loss"])
        times["modelcarve"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        logits = base(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
            loss.backward()
        _clip(base, config.max_norm)
        base_opt.step()
        base_opt.zero_grad(set_to_none=True)
        times["baseline"].append(time.perf_counter() - start)
        loss = loss.detach()
        losses["baseline"].append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    if dist.get_rank():
        return None
    tokens = layout.global_batch * layout.seq
    out = {}
    for impl in times:
        median = statistics.median(times[impl][1:] or times[impl])
        out[impl] = dict(tokens_per_s=tokens / median, step_s=[round(t, 4) for t in times[impl]], losses=losses[impl])
    return out


def _clip(model, max_norm):
    """torch's clip_grad_norm_ refuses a mix of DTensor (sharded) and plain (norm) gradients:
    take the two norms apart, then scale every gradient by the same coefficient."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norm_sq = torch.nn.utils.get_total_norm(sharded).full_tensor() ** 2 if sharded else 0.0
    norm_sq = norm_sq + (torch.nn.utils.get_total_norm(plain) ** 2 if plain else 0.0)
    coef = torch.clamp(max_norm / (norm_sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--gbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=LAYOUTS)
    parser.add_argument("--pair-steps", type=int, default=8, help="steps of each TP implementation, interleaved")
    parser.add_argument("--out", default="benchmarks/results/runtime_tokens.json")
    args = parser.parse_args()
    common = f"seq={args.seq},gbs={args.gbs},param_dtype=fp32"
    load_start = list(os.getloadavg())
    rows = []
    for layout in args.layouts:
        from modelcarve.spec.layout import Layout

        lay = Layout.parse(f"{layout},{common}")
        # one micro-batch per replica (pipelines: pp of them, the fewest 1f1b accepts)
        text = f"{layout},{common},mbs={args.gbs // (lay.dp * lay.pp)}"
        lay = Layout.parse(text)
        result = spawn(ours, lay.world_size, args.model, text, args.steps)[0]
        rows.append(dict(layout=lay.short(), layout_text=layout, world_size=lay.world_size, impl="modelcarve") | result)
        print(f"{lay.short():>14} {result['tokens_per_s']:10.0f} tok/s  loss0 {result['losses'][0]:.5f}", flush=True)
    pair = spawn(tp_pair, 2, args.model, f"tp=2,{common},mbs={args.gbs}", args.pair_steps)[0]
    for impl, res in pair.items():
        rows.append(dict(layout="TP2", layout_text="tp=2", world_size=2, impl=f"{impl} (interleaved pair)") | res)
        print(f"{'TP2 ' + impl:>22} {res['tokens_per_s']:10.0f} tok/s (median step)  loss0 {res['losses'][0]:.5f}", flush=True)
    ratio = pair["modelcarve"]["tokens_per_s"] / pair["baseline"]["tokens_per_s"]
    print(f"ours tp2 / parallelize_module tp2 = {ratio:.2f}")
    from modelcarve.spec.catalog import get_model

    report = dict(
        model=args.model, params=get_model(args.model).total_params, seq=args.seq, gbs=args.gbs, steps=args.steps,
        dtype="fp32", machine=dict(cpus=os.cpu_count(), platform=platform.platform(), threads_per_rank=1,
                                   load_average_at_start=load_start, load_average_at_end=list(os.getloadavg())),
        results=rows, tp2_ours_over_parallelize_module=ratio,
        note="per-layout rows: mean after the first step, one group per layout, in sequence (sensitive to the "
             "machine's load); the TP2 pair: median step of each implementation, interleaved in the same processes",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
