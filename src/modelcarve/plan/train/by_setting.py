"""The train goal's sweep, setting by setting: a block's ZeRO settings one at a time, for the blocks
the sweep cannot count as a whole (plan/train/sweep.py), and a candidate's exact tokens/s.

    position = by_setting(goal, model, cluster, cost, top, g_dt, shared, best, rejected, best_rejected,
                          best_family, position, settings, block, single, specs, groups, ...)

Each setting is first tried quiet (only the counts change: ``sweep``'s docstring says why that is
exact); a setting that is not is screened candidate by candidate as ``TrainCostModel._evaluate``
decides it, and tokens/s are computed in full (``_exact``) only where the bound says they can change
the answer. It updates the sweep's heap and dictionaries in place and returns the next position.
"""

from __future__ import annotations

from heapq import heappush, heapreplace

from modelcarve.plan.train.blocks import _kinds, _memory, _setting_rejects
from modelcarve.plan.train.candidate import Candidate
from modelcarve.plan.train.model import ACTIVATIONS_DO_NOT_FIT, STATES_DO_NOT_FIT, TrainCostModel
from modelcarve.plan.train.space import _compute, inflight_of

new = tuple.__new__


def by_setting(goal, model, cluster, cost: TrainCostModel, top: int, g_dt: str, shared: dict, best: list,
               rejected: dict, best_rejected: dict, best_family: dict, position: int, settings, block: tuple,
               single: tuple | None, specs: list, groups: list, n_spec: int, n_mb: int, slots: list, leans: dict,
               kinds_of: dict, upper: dict | None, s_base: float | None, s_kinds: list | None, dtype_s: str | None,
               low: float | None, held_act: tuple | None) -> int:
    """The sweep's loop over ``settings`` (``(zero, dp_shard), (statics, family)`` pairs of one
    block, ``block`` = ``(tp, cp, pp, dp, mbs, ep, etp, sp, recompute)``): the counts, the best
    rejected per category, the families' bests and the top heap ``best`` as the candidate-by-candidate
    loop leaves them; ``slots``, ``leans`` and ``kinds_of`` are the block's (filled as needed),
    ``upper`` the "none" block's bounds when this block recomputes, ``s_base`` / ``s_kinds`` the
    single group's base bytes and kinds when the whole-block test built them, ``low`` / ``held_act``
    the scores it tested against. Returns the position after the block."""
    tp, cp, pp, dp, mbs, ep, etp, sp, rc = block
    capacity, growth = cost.capacity, cost._growth
    if single is not None:
        vj, (count, (_sched, v, prec, scaling, _vj)) = single
    grown_of: dict = {}  # ((v, precision index), in-flight kind) -> per-stage activations and buffers
    upper_kinds: dict = {}  # (v, precision index) -> _kinds of the shortcut (memory only, one bound)
    for (zero, shard), (statics, family) in settings:
        if single is not None:
            static = statics.get(vj)
            if static is None:
                floor = cost.states_floor(tp, cp, pp, dp, ep, zero, shard, prec, g_dt, "fp32", etp, v, vj[2])
                static = statics[vj] = (floor,) + cost.dp_static(
                    (tp, cp, pp, dp, ep), etp, v, zero, shard, prec, g_dt, "fp32", vj[2])
            if not family:  # family() reads tp, cp, pp, ep, zero and etp only
                family.append(goal.family(model, cluster, new(
                    Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, _sched, v, prec, g_dt, "fp32",
                                etp, scaling))))
            floor, states, top_states, reserved, bucket = static
            if floor > capacity:
                held = best_rejected.get(STATES_DO_NOT_FIT)
                if held is not None and -floor <= held[0]:
                    rejected[STATES_DO_NOT_FIT] += count
                    position += n_spec
                    continue
            else:
                if s_base is None:
                    if upper is not None and vj in upper:
                        buffers, most, _by_rc = upper[vj]
                        s_kinds = [(grown, n_grown, most) for grown, n_grown in _memory(
                            cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb,
                            growth)]
                    else:
                        lean = leans.get(vj)
                        if lean is None:
                            lean = leans[vj] = cost.screen_profile(
                                tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq, dtype_s, etp, v,
                                keep=False)
                        buffers = lean[2]
                        s_kinds = kinds_of.get(vj)
                        if s_kinds is None:
                            s_kinds = kinds_of[vj] = _kinds(specs, vj, _memory(
                                cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb,
                                growth, lean[1]), None, pp, n_mb, cost, lean, slots)
                    s_base = (buffers + bucket) * growth + reserved  # reserved, bucket: ZeRO-free
                base = s_base
                if top_states + base > capacity:
                    if held_act is not None and -(top_states + base) <= held_act[0]:
                        rejected[ACTIVATIONS_DO_NOT_FIT] += count
                        position += n_spec
                        continue
                else:
                    fam = family[0]
                    held_fam = best_family.get(fam) if fam is not None else None
                    n_act = _setting_rejects(states, s_kinds, base, capacity, low, fam, held_fam, held_act)
                    if n_act is not None:  # quiet
                        if n_act:
                            rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT,
                                                                            0) + n_act
                        position += n_spec
                        continue
        # per group: (category, score) when every candidate of it is rejected whatever its
        # schedule (as _evaluate: the states floor, or one micro-batch's buffers, over capacity),
        # else (None, None, states per stage, base bytes) for the per-schedule memory check
        entries: dict = {}
        open_groups = False
        for vj, (_count, (_sched, v, prec, scaling, _vj)) in groups:
            static = statics.get(vj)
            if static is None:
                floor = cost.states_floor(tp, cp, pp, dp, ep, zero, shard, prec, g_dt, "fp32", etp, v, vj[2])
                static = statics[vj] = (floor,) + cost.dp_static(
                    (tp, cp, pp, dp, ep), etp, v, zero, shard, prec, g_dt, "fp32", vj[2])
            floor, states, top_states, reserved, bucket = static
            if floor > capacity:
                entries[vj] = (STATES_DO_NOT_FIT, -floor)
                continue
            if upper is not None and vj in upper:
                buffers = upper[vj][0]  # the same number: no term of the buffers reads recompute
            else:
                upper = None  # a group the shortcut does not cover: the block is screened in full
                lean = leans.get(vj)
                if lean is None:
                    lean = leans[vj] = cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq,
                                                           _compute(prec, scaling), etp, v, keep=False)
                buffers = lean[2]
            # _dp_entry's memory sums, without the entry (built for those priced in full)
            base = (buffers + bucket) * growth + reserved
            if top_states + base > capacity:
                entries[vj] = (ACTIVATIONS_DO_NOT_FIT, -(top_states + base))
            else:
                entries[vj] = (None, None, states, base)
                open_groups = True
        if not open_groups:
            # every candidate of this ZeRO setting rejected by its group: count them together; the
            # best of a category is the first candidate of the first group holding its best score
            for vj, (count, (sched, v, prec, scaling, _vj)) in groups:
                category, score = entries[vj]
                rejected[category] = rejected.get(category, 0) + count
                held = best_rejected.get(category)
                if held is None or score > held[0]:
                    cand = new(Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v, prec,
                                           g_dt, "fp32", etp, scaling))
                    best_rejected[category] = (score, cand, None)
            position += n_spec
            continue
        if not family:  # family() reads tp, cp, pp, ep, zero and etp only
            sched, v, prec, scaling, _vj = specs[0]
            family.append(goal.family(model, cluster, new(
                Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v, prec, g_dt, "fp32", etp,
                            scaling))))
        fam = family[0]
        # the quiet case: no candidate of this ZeRO setting can change anything but the counts
        # (sweep's docstring), so the setting is counted in one step
        held_fam = best_family.get(fam) if fam is not None else None
        while True:
            fits_of: dict = {}  # id(grown) -> whether the candidates with that memory in flight fit
            quiet = True
            n_act = 0
            for vj, (count, (_sched, v, prec, scaling, _vj)) in groups:
                entry = entries[vj]
                category = entry[0]
                if category is not None:
                    held = best_rejected.get(category)
                    if held is None or entry[1] > held[0]:
                        quiet = False
                        break
                    continue
                if upper is not None:
                    kinds = upper_kinds.get(vj)
                    if kinds is None:
                        kinds = upper_kinds[vj] = _kinds(specs, vj, _memory(
                            cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, _compute(prec, scaling), etp, v,
                            n_mb, growth), upper[vj][1], pp, n_mb)
                else:
                    kinds = kinds_of.get(vj)
                    if kinds is None:
                        lean = leans.get(vj)
                        if lean is None:
                            lean = leans[vj] = cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq,
                                                                   _compute(prec, scaling), etp, v, keep=False)
                        kinds = kinds_of[vj] = _kinds(specs, vj, _memory(
                            cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, _compute(prec, scaling), etp, v,
                            n_mb, growth, lean[1]), None, pp, n_mb, cost, lean, slots)
                states, base = entry[2], entry[3]
                for grown, n_grown, most in kinds:
                    fits = True
                    for st, g in zip(states, grown):
                        if st + g + base > capacity:  # the expression peak_bytes compares
                            fits = False
                            break
                    fits_of[id(grown)] = fits
                    if fits:
                        if low is None or most > low or (fam is not None and (held_fam is None
                                                                              or most > held_fam[0])):
                            quiet = False
                            break
                    else:
                        n_act += n_grown
                        if held_act is None or most > held_act[0]:
                            quiet = False
                            break
                if not quiet:
                    break
            if quiet or upper is None:
                break
            upper = None  # the shortcut's bound is not low enough here: the block is screened in full
        if quiet:
            for vj, (count, _spec) in groups:
                category = entries[vj][0]
                if category is not None:
                    rejected[category] = rejected.get(category, 0) + count
            if n_act:
                rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT, 0) + n_act
            position += n_spec
            continue
        for k in range(n_spec):
            sched, v, prec, scaling, vj = specs[k]
            position += 1
            entry = entries[vj]
            category = entry[0]
            if category is not None:
                rejected[category] = rejected.get(category, 0) + 1
                held = best_rejected.get(category)
                if held is None or entry[1] > held[0]:
                    cand = new(Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v, prec,
                                           g_dt, "fp32", etp, scaling))
                    best_rejected[category] = (entry[1], cand, None)
                continue
            slot = slots[k]
            if slot is None:
                lean = leans.get(vj)
                if lean is None:
                    lean = leans[vj] = cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq,
                                                           _compute(prec, scaling), etp, v, keep=False)
                t_mb, rows, _buffers, p2p_s, _n, tokens = lean[:6]
                step_base = cost.step_base(t_mb, p2p_s, sched, pp, n_mb, v)[3]
                # 1F1B and zero-bubble hold the same micro-batches in flight: one list for both
                in_flight = (vj, "1f1b" if sched == "zero-bubble" else sched)
                grown = grown_of.get(in_flight)
                if grown is None:
                    grown = grown_of[in_flight] = [
                        (inflight_of(sched, pp, n_mb, v, index) * act_mb + fixed) * growth
                        for _kind, index, act_mb, fixed in rows]
                slot = slots[k] = (step_base, tokens / step_base, grown)
            step_base, bound, grown = slot
            fits = fits_of.get(id(grown))
            if fits is None:
                base = entry[3]
                fits = True
                for states, g in zip(entry[2], grown):
                    if states + g + base > capacity:  # the expression peak_bytes compares
                        fits = False
                        break
                fits_of[id(grown)] = fits
            cand = None
            if fits:
                held = best_family.get(fam) if fam is not None else None
                if (len(best) == top and bound <= best[0][0]
                        and (fam is None or (held is not None and bound <= held[0]))):
                    continue  # accepted; provably neither in the top nor its family's best
                cand = cand or new(Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v,
                                               prec, g_dt, "fp32", etp, scaling))
                score = _exact(cost, cand, step_base)
                item = (score, position, cand)
                if len(best) < top:
                    heappush(best, item)
                elif score > best[0][0]:
                    heapreplace(best, item)
                if fam is not None and (held is None or score > held[0]):
                    best_family[fam] = (score, cand)
                continue
            rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT, 0) + 1
            held = best_rejected.get(ACTIVATIONS_DO_NOT_FIT)
            if held is None or bound > held[0]:
                cand = new(Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v,
                                       prec, g_dt, "fp32", etp, scaling))
                score = _exact(cost, cand, step_base)
                if held is None or score > held[0]:
                    best_rejected[ACTIVATIONS_DO_NOT_FIT] = (score, cand, None)
        low = best[0][0] if len(best) == top else None  # the scores the next setting meets
        held_act = best_rejected.get(ACTIVATIONS_DO_NOT_FIT)
    return position


def _exact(cost: TrainCostModel, cand: Candidate, step_base: float) -> float:
    """A candidate's tokens/s, as ``TrainCostModel._evaluate`` computes it (``step_base``:
    its ``step_base``, the same number from the screen profile as from the full one)."""
    dtype = "fp8cs" if cand.param_dtype == "fp8" and cand.fp8_scaling == "current" else cand.param_dtype
    prof = cost.profile(*cand[:8], cost.seq, dtype, cand.etp, cand.virtual_stages)
    dkey = (cand.zero, cand.dp_shard, cost.fsdp_mode(cand.zero, cand.pp, cand.schedule)) + cand[12:]
    d = prof["dp"].get(dkey)
    if d is None:
        d = prof["dp"][dkey] = cost._dp_entry(prof, cand)
    if d["exposed_s"] is None:
        cost._dp_comm(prof, d, cand)
    return prof["tokens"] / (step_base + d["exposed_s"])
