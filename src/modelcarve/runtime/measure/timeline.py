"""The measured pipeline timeline of one step: every rank's actions and sends/recvs as plain records.

Usage (every rank; a collective over the default group)::

    recs = local_records(runner)          # right after runner.step(...), this rank's records
    recs = gather_records(recs, runner)   # rank 0: the records of its pipeline; others: None

Records have plan/predict/timeline.py's form (``rank`` = pp rank, times in seconds since the earliest
rank's step start). Each rank's clock is its own ``perf_counter`` from its step start; ranks are
lined up by the ``time.time()`` each took at that start (same machine: the same clock; across
machines as good as their clock sync). Sends/recvs carry the time they were posted; their ends
come from ``plan.timeline.complete_comms`` (a recv ends when its consumer starts, a send when
the matching recv ends).
"""

from __future__ import annotations

import torch.distributed as dist

from modelcarve.plan.predict.timeline import complete_comms


def local_records(runner) -> dict:
    """This rank's records of the runner's last step (plain data, picklable), before alignment."""
    log = runner.actions
    recs = [dict(rank=runner.pp_rank, stage=a.stage, mb=a.microbatch, kind=a.kind, start=a.start_s, end=a.end_s)
            for a in log]
    recs += [dict(rank=runner.pp_rank, stage=stage, mb=mb, kind=kind, dir=direction, peer=peer, start=t, end=t)
             for kind, direction, stage, peer, mb, t in log.comms]
    return dict(records=recs, t0_wall=log.t0_wall, end_s=log.end_s, pp_rank=runner.pp_rank)


def gather_records(local: dict, runner) -> list[dict] | None:
    """One ``gather_object`` to global rank 0; it keeps the ranks of its own pipeline, shifts their
    times onto one clock and completes the send/recv ends. None on the other ranks."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    mine = set(dist.get_process_group_ranks(runner.pp_group))
    parts = [p for rank, p in enumerate(parts) if rank in mine]
    origin = min(p["t0_wall"] for p in parts)
    out = []
    for p in parts:
        shift = p["t0_wall"] - origin
        out += [r | dict(start=r["start"] + shift, end=r["end"] + shift) for r in p["records"]]
    return complete_comms(out)
