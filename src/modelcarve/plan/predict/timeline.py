"""Pipeline timelines as plain records: the planner's schedule model, and the bubble of any timeline.

A record is a dict ``{"rank", "stage", "mb", "kind", "start", "end"}`` (``kind`` F / B / I / W
for compute, ``send`` / ``recv`` for point-to-point, then also ``dir`` F or B and ``peer``, the
other stage). The runtime's measured records (runtime/measure/timeline.py, seconds) and the model's
(``model_records``, time units) have the same form, so report/timeline.py draws both.

Usage::

    from modelcarve.plan.predict.timeline import model_records, bubble
    recs = model_records("1f1b", p=2, m=4)       # F = 1 unit, B = 2 units (I = W = 1)
    bubble(recs)["overall"]                      # 0.2 = (p-1)/(m+p-1), plan/cost/schedule.py's formula

The model is list scheduling of each rank's action order with zero-cost communication: an
action starts when its rank is free and its inputs exist (F after the previous stage's F of the
micro-batch; B / I after the next stage's backward, the last stage's after its own F; W after
its I). Orders: GPipe all F then all B; 1F1B ``p-r-1`` warm-up forwards on rank ``r``, then
F,B pairs, then the remaining B; interleaved 1F1B Megatron's order (``v`` chunks per rank, stage
``c*p + r``, groups of ``p`` micro-batches, ``2(p-r-1) + (v-1)p`` warm-up chunks); zero-bubble
(ZB-H1) the 1F1B order with B split into I and W, each W deferred and run only when the rank's
next action must wait (or at the end).
"""

from __future__ import annotations

COMPUTE = ("F", "B", "I", "W")


def bubble(records: list[dict]) -> dict:
    """Idle fraction of the step: per rank ``1 - busy / wall`` and overall
    ``1 - sum(busy) / (ranks x wall)``; wall = latest compute end - earliest compute start over
    all ranks, busy = the rank's summed compute time (send/recv waits count as idle)."""
    compute = [r for r in records if r["kind"] in COMPUTE]
    if not compute:
        raise ValueError("no compute actions in the timeline")
    t0, t1 = min(r["start"] for r in compute), max(r["end"] for r in compute)
    wall = t1 - t0
    ranks = sorted({r["rank"] for r in compute})
    busy = {k: sum(r["end"] - r["start"] for r in compute if r["rank"] == k) for k in ranks}
    per_rank = {k: (1.0 - busy[k] / wall) if wall > 0 else 0.0 for k in ranks}
    overall = 1.0 - sum(busy.values()) / (len(ranks) * wall) if wall > 0 else 0.0
    return dict(overall=overall, per_rank=per_rank, wall=wall, busy=busy)


def complete_comms(records: list[dict]) -> list[dict]:
    """Give each measured send/recv its end: a recv ends when the action that consumes it starts
    (torch waits on the recv right before it, so this bounds the wait from above); a send ends
    when the peer's matching recv ends (the bytes were there by then). Returns new records."""
    starts: dict[tuple, float] = {}
    for r in records:
        if r["kind"] in ("F", "B", "I"):
            key = ("F" if r["kind"] == "F" else "B", r["stage"], r["mb"])
            starts.setdefault(key, r["start"])
    out, recv_end = [], {}
    for r in records:
        r = dict(r)
        if r["kind"] == "recv":
            r["end"] = max(r["start"], starts.get((r["dir"], r["stage"], r["mb"]), r["start"]))
            recv_end[(r["dir"], r["peer"], r["stage"], r["mb"])] = r["end"]
        out.append(r)
    for r in out:
        if r["kind"] == "send":
            r["end"] = max(r["start"], recv_end.get((r["dir"], r["stage"], r["peer"], r["mb"]), r["start"]))
    return out


def model_records(schedule: str, p: int, m: int, v: int = 1, f=1.0, b=2.0, *, i_share=None,
                  host_s: float = 0.0, send_s: float = 0.0) -> list[dict]:
    """The planner's timeline of one step of ``schedule`` on ``p`` ranks with ``m`` micro-batches
    (``v`` chunks per rank for interleaved-1f1b).

    Durations: ``f`` / ``b`` a number, the forward / backward of a whole pipeline rank (a chunk
    takes ``f/v``, ``b/v``: every stage alike), or a sequence of ``p*v`` per-stage times (stage
    ``s`` on rank ``s % p``; the first stage holds the embedding, the last the head and loss, so
    they differ: ``stage_durations`` gives the planner's). Zero-bubble splits B into I (input
    gradient) and W (weight gradient): ``i_share[s]`` of stage ``s``'s B is I (default half:
    ``dX = dY W^T`` and ``dW = X^T dY`` are GEMMs of equal size). ``host_s``: a rank's host time
    after each action before it can start the next (posting the action's sends, the schedule's
    bookkeeping); ``send_s``: from an action's end to its output being usable on the next rank
    (the point-to-point message). Both count as idle, as in the measured timeline."""
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p >= 1 and m >= 1 micro-batches, not p={p}, m={m}")
    v = v if schedule == "interleaved-1f1b" else 1
    if schedule == "interleaved-1f1b" and m % p:
        raise ValueError(f"interleaved-1f1b needs micro-batches a multiple of pp: m={m}, p={p}")
    stages = p * v
    fs = _per_stage(f, stages, v, "f")
    bs = _per_stage(b, stages, v, "b")
    shares = _per_stage(0.5 if i_share is None else i_share, stages, 1, "i_share")
    dur = {("F", s): fs[s] for s in range(stages)}
    for s in range(stages):
        dur["B", s] = bs[s]
        dur["I", s] = bs[s] * shares[s]
        dur["W", s] = bs[s] * (1.0 - shares[s])
    orders = [_order(schedule, p, m, v, r) for r in range(p)]
    done: dict[tuple, float] = {}
    free, pos = [0.0] * p, [0] * p
    pending_w: list[list[tuple]] = [[] for _ in range(p)]
    out: list[dict] = []

    def run(rank: int, act: tuple, start: float) -> None:
        kind, stage, mb = act
        end = start + dur[kind, stage]
        done[("B" if kind == "I" else kind, stage, mb)] = end
        out.append(dict(rank=rank, stage=stage, mb=mb, kind=kind, start=start, end=end))
        free[rank] = end + host_s
        if kind == "I":
            pending_w[rank].append(("W", stage, mb))

    def ready_at(rank: int, dep: tuple) -> float:
        return done[dep] + (send_s if dep[1] % p != rank else 0.0)

    while any(pos[r] < len(orders[r]) or pending_w[r] for r in range(p)):
        progressed = False
        for rank in sorted(range(p), key=lambda k: free[k]):
            if pos[rank] < len(orders[rank]):
                act = orders[rank][pos[rank]]
                deps = _deps(act, stages)
                ready = all(d in done for d in deps)
                at = max([free[rank]] + [ready_at(rank, d) for d in deps if d in done])
                if pending_w[rank] and (not ready or at > free[rank]):
                    run(rank, pending_w[rank].pop(0), free[rank])  # W fills the wait
                elif ready:
                    run(rank, act, at)
                    pos[rank] += 1
                else:
                    continue
            elif pending_w[rank]:
                run(rank, pending_w[rank].pop(0), free[rank])
            else:
                continue
            progressed = True
            break
        if not progressed:
            raise ValueError(f"schedule {schedule} with p={p}, m={m}, v={v} deadlocks in the model")
    return out


def _per_stage(value, stages: int, v: int, name: str) -> list[float]:
    """``value`` per stage: a number (a whole rank's, so each of its ``v`` chunks gets ``1/v``) or a
    sequence of one per stage."""
    if isinstance(value, (int, float)):
        return [float(value) / v] * stages
    values = [float(x) for x in value]
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} per-stage values; the pipeline has {stages} stages")
    return values


def _deps(act: tuple, stages: int) -> list[tuple]:
    kind, stage, mb = act
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        return [("F", stage, mb)] if stage == stages - 1 else [("B", stage + 1, mb), ("F", stage, mb)]
    return [("B", stage, mb)]


def action_order(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple]:
    """Pipeline rank ``r``'s compute actions ``(kind, stage, micro-batch)`` in the order it issues
    them (the module doc's orders; zero-bubble's B is its input-gradient step I, W not listed)."""
    return _order(schedule, p, m, v, r)


def _order(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple]:
    if schedule == "gpipe":
        return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
    if schedule in ("1f1b", "zero-bubble"):
        back = "I" if schedule == "zero-bubble" else "B"
        fwd = [("F", r, i) for i in range(m)]
        bwd = [(back, r, i) for i in range(m)]
        warm = min(p - r - 1, m)
    elif schedule == "interleaved-1f1b":
        total = m * v
        fwd = [("F", ((k // p) % v) * p + r, (k // (p * v)) * p + k % p) for k in range(total)]
        bwd = [("B", (v - 1 - (k // p) % v) * p + r, (k // (p * v)) * p + k % p) for k in range(total)]
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    else:
        raise ValueError(f"unknown schedule {schedule!r}: one of gpipe, 1f1b, interleaved-1f1b, zero-bubble")
    order = fwd[:warm]
    for i in range(len(fwd) - warm):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[len(fwd) - warm:]
