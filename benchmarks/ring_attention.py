"""Ring attention (runtime/parallel/ring_attention.py) on CPU: time per rank, balance across ranks, bytes.

    OMP_NUM_THREADS=1 python benchmarks/ring_attention.py --out benchmarks/results/ring_attention.json

For one global causal attention problem (``--seq`` tokens, 8 query heads, 4 kv heads, head dim
64, batch 1, fp32) and each cp in ``--cp``, every rank runs forward + backward of its zig-zag
piece ``--reps`` times (after one warm-up) in real gloo processes, one thread each. Recorded
per cp: the median step time of every rank, the imbalance (slowest / fastest rank; the zig-zag
order should keep it near 1), the bytes each rank sent per step
(metrics.CommCounter: payload of its sends, each message counted once) next to the count derived from the
algorithm; and, alternated in one process on the whole problem, torch's SDPA against the ring
(one rank) with each tile kernel: "flash" (torch's fused CPU kernel, the default on CPU) and
"math" (written out). Wall times depend on the machine and its load (recorded); the bytes do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from runtime_tokens import spawn  # the shared harness (tests/dist.py) via runtime_tokens

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def _problem(seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=gen)
    dout = torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen)
    return q, k, v, dout


def _worker(seq: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.distributed.mesh import new_group
    from modelcarve.runtime.measure.metrics import CommCounter
    from modelcarve.runtime.parallel.ring_attention import ring_attention
    from modelcarve.runtime.distributed.zigzag import zigzag_shard

    rank, cp = dist.get_rank(), dist.get_world_size()
    group = new_group(list(range(cp))) if cp > 1 else None
    q, k, v, dout = (zigzag_shard(t, 2, cp, rank) for t in _problem(seq))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        ring_attention(q, k, v, group).backward(dout)

    step()  # warm-up
    times = []
    with CommCounter() as comm:
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return dict(rank=rank, median_s=statistics.median(times), bytes_per_step=comm.bytes["send"] / reps)


def _one_process_seconds(seq: int, reps: int) -> dict:
    """torch SDPA and our ring (one rank) on the whole problem, alternated in one process so that
    the machine's load affects both alike."""
    import torch
    import torch.nn.functional as F

    from modelcarve.runtime.parallel.ring_attention import ring_attention

    torch.set_num_threads(1)
    q, k, v, dout = _problem(seq)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    steps = {
        "sdpa_s": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout),
        "ring_flash_s": lambda: ring_attention(q, k, v, kernel="flash").backward(dout),
        "ring_math_s": lambda: ring_attention(q, k, v, kernel="math").backward(dout),
    }
    times = {name: [] for name in steps}
    for name, step in steps.items():
        step()  # warm-up
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def expected_bytes(seq: int, cp: int) -> int:
    """Per rank and step: forward passes the K/V block on (cp - 1) times; backward the K/V block
    (cp - 1) times and the fp32 dK/dV accumulator (cp - 1) times; each hop counted once, at
    its sender, as CommCounter counts them. (With fp32 inputs the accumulator is as
    large as the K/V block; with bf16 it is twice as large.)"""
    if cp == 1:
        return 0
    block = KV_HEADS * (seq // cp) * 2 * HEAD_DIM * 4  # K and V of one rank, fp32
    return block * 3 * (cp - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for cp in args.cp:
        per_rank = spawn(_worker, cp, args.seq, args.reps)
        times = [r["median_s"] for r in per_rank]
        row = dict(
            cp=cp,
            rank_median_s=times,
            step_s=max(times),
            imbalance=max(times) / min(times),
            bytes_per_rank=[r["bytes_per_step"] for r in per_rank],
            expected_bytes_per_rank=expected_bytes(args.seq, cp),
        )
        rows.append(row)
        print(f"cp={cp}: step {row['step_s'] * 1e3:.0f} ms (slowest rank), imbalance {row['imbalance']:.2f}, "
              f"{row['bytes_per_rank'][0] / 2**20:.2f} MiB/rank (expected {row['expected_bytes_per_rank'] / 2**20:.2f})")
    one = _one_process_seconds(args.seq, args.reps)
    print(f"one process, alternated: torch SDPA {one['sdpa_s'] * 1e3:.0f} ms, ring cp=1 with flash tiles "
          f"{one['ring_flash_s'] * 1e3:.0f} ms, with math tiles {one['ring_math_s'] * 1e3:.0f} ms")
    result = dict(
        problem=dict(seq=args.seq, batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="fp32", causal=True),
        reps=args.reps,
        rows=rows,
        one_process=one,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg=os.getloadavg()),
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
