"""Our step time over plain PyTorch's, paired: dp2 vs DDP, fsdp2 vs fully_shard, tp2 vs parallelize_module.

    OMP_NUM_THREADS=1 python benchmarks/runtime_vs_torch.py      # writes benchmarks/results/runtime_vs_torch.json

For each pair, two gloo processes (one thread each) hold both implementations of the same
model (``--model``, fp32, synthetic data, AdamW with the same settings and global-norm clipping
at 1.0) and run ``--steps`` training steps of each, interleaved step by step in the same
processes (the order alternates every step, so a shared machine's load and any order effect
hit both alike). Each step's ratio is ours / torch's; the first ``--warmup`` pairs are dropped;
the figure is the median ratio, with its min, max and quartiles (the spread). Plain PyTorch:

* dp2: ``DistributedDataParallel`` (bucketed all-reduce overlapped with backward, averaging;
  its loss is the local mean, ours the global-token-normalised sum: the same gradient);
* fsdp2: ``fully_shard`` on every block and the root;
* tp2: ``parallelize_module`` with Colwise/Rowwise plans and ``loss_parallel``
  (benchmarks/runtime_tokens.py's baseline, the torchtitan recipe without SP).

Goal (issue 13): every ratio <= 1.05. Timings depend on the machine and its load; the JSON
records the load averages. Nothing here is asserted by a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))
sys.path.insert(0, str(ROOT))
from dist import run_distributed  # noqa: E402

PAIRS = {"dp2": "dp=2", "fsdp2": "dp=2,fsdp", "tp2": "tp=2"}


def _torch_model(kind, spec, layout):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from modelcarve.runtime.model.transformer import build_model

    if kind == "tp2":
        from runtime_tokens import _baseline_model

        return _baseline_model(spec, layout)
    model = build_model(spec, seed=0)
    if kind == "dp2":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=dist.group.WORLD)
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def pair(kind, model_name, layout_text, steps):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

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
    base = _torch_model(kind, spec, layout)
    base_opt = torch.optim.AdamW(base.parameters(), **config.adamw())
    data = SyntheticData(spec.vocab_size, 0)
    rows = layout.global_batch // layout.dp
    me = dist.get_rank() if kind != "tp2" else 0

    def ours_step(tokens, targets):
        trainer.step(tokens, targets)

    def torch_step(tokens, targets):
        tok, tgt = tokens[me * rows:(me + 1) * rows], targets[me * rows:(me + 1) * rows]
        logits = base(tok)
        if kind == "tp2":
            from torch.distributed.tensor.parallel import loss_parallel

            from runtime_tokens import _clip

            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), tgt.reshape(-1))
                loss.backward()
            _clip(base, config.max_norm)
        else:
            F.cross_entropy(logits.flatten(0, 1).float(), tgt.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(base.parameters(), config.max_norm)
        base_opt.step()
        base_opt.zero_grad(set_to_none=True)

    times = {"ours": [], "torch": []}
    for step in range(steps):
        tokens, targets = data.batch(step, layout.global_batch, layout.seq)
        order = (("ours", ours_step), ("torch", torch_step))
        for name, fn in (order if step % 2 == 0 else order[::-1]):
            dist.barrier()
            start = time.perf_counter()
            fn(tokens, targets)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def summary(times, warmup):
    ratios = sorted(o / t for o, t in zip(times["ours"][warmup:], times["torch"][warmup:]))
    q = statistics.quantiles(ratios, n=4)
    return dict(median=statistics.median(ratios), min=ratios[0], max=ratios[-1], q1=q[0], q3=q[2],
                pairs=len(ratios), ours_median_s=statistics.median(times["ours"][warmup:]),
                torch_median_s=statistics.median(times["torch"][warmup:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="steps of each implementation, interleaved")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS))
    parser.add_argument("--out", default=str(ROOT / "results" / "runtime_vs_torch.json"))
    args = parser.parse_args()
    if args.steps - args.warmup < 20:
        parser.error("--steps minus --warmup must leave at least 20 paired steps")
    load_start = list(os.getloadavg())
    report = dict(model=args.model, seq=args.seq, gbs=args.gbs, steps=args.steps, warmup=args.warmup, dtype="fp32",
                  machine=dict(cpus=os.cpu_count(), platform=platform.platform(), threads_per_rank=1,
                               load_average_at_start=load_start))
    for kind in args.pairs:
        text = f"{PAIRS[kind]},seq={args.seq},gbs={args.gbs},mbs={args.gbs // (2 if kind != 'tp2' else 1)},param_dtype=fp32"
        times = run_distributed(pair, 2, kind, args.model, text, args.steps, timeout=1200, collective_s=300)[0]
        report[kind] = summary(times, args.warmup)
        report[kind]["layout"] = text
        r = report[kind]
        print(f"{kind}: ours / torch = {r['median']:.3f} (median of {r['pairs']}; quartiles {r['q1']:.3f}-{r['q3']:.3f}, "
              f"range {r['min']:.3f}-{r['max']:.3f})", flush=True)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
