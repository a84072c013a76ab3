"""Training throughput (tokens/s) per layout on CPU for small-llama (~20M parameters), and our
hand-written TP (runtime/tensor.py) against a plain ``parallelize_module`` TP baseline, same run.

    OMP_NUM_THREADS=1 python benchmarks/runtime_tokens.py --out benchmarks/results/runtime_tokens.json

Every layout runs ``--steps`` AdamW steps of ``gbs x seq`` tokens (synthetic data, fp32) in real
gloo processes, one process per rank, one thread per process; tokens/s is the mean over the
steps after the first (warm-up). The baseline is written here: torch's ``ColwiseParallel`` /
``RowwiseParallel`` on the same projections, vocab-parallel embedding (``RowwiseParallel`` with
replicated input) and LM head (``ColwiseParallel`` with sharded DTensor logits) under
``loss_parallel`` — the torchtitan recipe without sequence parallelism — and the same AdamW
and global-norm clipping (torch's ``get_total_norm`` on the DTensor and the plain gradients).
Figures depend on the machine and its load; the JSON records both.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import time
import traceback
from pathlib import Path

LAYOUTS = ["dp=1", "dp=2", "dp=2,zero=1", "dp=2,fsdp", "tp=2", "tp=2,sp", "pp=2,schedule=1f1b"]


def _child(fn, args, rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        from modelcarve.runtime.mesh import destroy, init_distributed

        init_distributed(120)
        out.put((rank, "ok", fn(*args)))
        destroy()
    except BaseException:  # noqa: BLE001
        out.put((rank, "error", traceback.format_exc()))


def spawn(fn, world, *args, timeout=900):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(fn, args, r, world, port, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        rank, status, value = out.get(timeout=timeout)
        if status != "ok":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    for p in procs:
        p.join(timeout=10)
    return [results[r] for r in range(world)]


def ours(model, layout, steps):
    from modelcarve.runtime.launch import run_worker

    result = run_worker(model=model, layout=layout, steps=steps, quiet=True)
    if result is None:
        return None
    return dict(tokens_per_s=result["tokens_per_s"], losses=[h["loss"] for h in result["history"]],
                step_tokens_per_s=[round(h["tokens_per_s"]) for h in result["history"]],
                comm_bytes_per_step=result["memory"][0]["comm_bytes_per_step"],
                peak_rss_mib=[round(m["peak_rss_bytes"] / 2**20) for m in result["memory"]])


def baseline_tp(model_name, layout_text, steps):
    """Plain parallelize_module TP (see module doc) on the same model, data and optimiser."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    from modelcarve.runtime.model import build_model
    from modelcarve.runtime.train import SyntheticData, TrainConfig
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(layout_text)
    spec = get_model(model_name)
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
    config = TrainConfig()
    opt = torch.optim.AdamW(model.parameters(), **config.adamw())
    data = SyntheticData(spec.vocab_size, 0)
    times, losses = [], []
    for step in range(steps):
        tokens, targets = data.batch(step, layout.global_batch, layout.seq)
        start = time.perf_counter()
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
            loss.backward()
        _clip(model, config.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    if dist.get_rank():
        return None
    tokens = layout.global_batch * layout.seq
    rest = times[1:] or times
    return dict(tokens_per_s=tokens * len(rest) / sum(rest), losses=losses, step_s=[round(t, 4) for t in times])


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
    parser.add_argument("--out", default="benchmarks/results/runtime_tokens.json")
    args = parser.parse_args()
    common = f"seq={args.seq},gbs={args.gbs},mbs=1,param_dtype=fp32"
    rows = []
    for layout in args.layouts:
        from modelcarve.spec.layout import Layout

        lay = Layout.parse(f"{layout},{common}")
        result = spawn(ours, lay.world_size, args.model, f"{layout},{common}", args.steps)[0]
        rows.append(dict(layout=lay.short(), layout_text=layout, world_size=lay.world_size, impl="modelcarve") | result)
        print(f"{lay.short():>14} {result['tokens_per_s']:10.0f} tok/s  loss0 {result['losses'][0]:.5f}", flush=True)
    base = spawn(baseline_tp, 2, args.model, f"tp=2,{common}", args.steps)[0]
    rows.append(dict(layout="TP2", layout_text="tp=2", world_size=2, impl="parallelize_module baseline") | base)
    print(f"{'TP2 baseline':>14} {base['tokens_per_s']:10.0f} tok/s  loss0 {base['losses'][0]:.5f}", flush=True)
    ours_tp2 = next(r for r in rows if r["layout_text"] == "tp=2" and r["impl"] == "modelcarve")
    ratio = ours_tp2["tokens_per_s"] / base["tokens_per_s"]
    print(f"ours tp2 / parallelize_module tp2 = {ratio:.2f}")
    from modelcarve.spec.catalog import get_model

    report = dict(
        model=args.model, params=get_model(args.model).total_params, seq=args.seq, gbs=args.gbs, steps=args.steps,
        dtype="fp32", machine=dict(cpus=os.cpu_count(), platform=platform.platform(), threads_per_rank=1),
        results=rows, tp2_ours_over_parallelize_module=ratio,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
