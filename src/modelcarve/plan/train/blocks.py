"""What the train goal's sweep (plan/train/sweep.py) reads of one block of the search space.

    n_closed, closed_best, opens, reserved, bucket = _settings(cost, goal, model, cluster, zeros, zl, vj, spec, ...)
    memory = _memory(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype, etp, v, n_mb, growth)
    by_rc = _recomputes(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, dtype, etp, v, n_mb)
    kinds = _kinds(specs, vj, memory, bound, pp, n_mb, cost, lean, slots)

A block's ZeRO settings as its memory test reads them (``_settings``, once per mesh), its specs
grouped by the micro-batches they hold in flight (``_plan``), each group's per-stage memory in
flight (``_memory``, shared between blocks whose memory rows are the same numbers, kept by recompute
mode: ``_recomputes``) and the highest tokens/s bound of each group (``_kinds``). The sweep's
docstring states why each is exact.
"""

from __future__ import annotations

from modelcarve.plan.train.candidate import Candidate
from modelcarve.plan.train.model import TrainCostModel
from modelcarve.plan.train.space import _grown

_KIND_PLANS: dict = {}
"""(id(specs), (v, precision index)) -> (specs, [(in-flight kind, its first schedule, v, the specs'
positions, their number)]): ``_kinds``' grouping, once per shape of a block's specs."""


def _settings(cost: TrainCostModel, goal, model, cluster, zeros: list, zl: list, vj: tuple, spec: tuple, tp: int,
              cp: int, pp: int, dp: int, ep: int, etp: int, mbs: int, sp: bool, rc: str, g_dt: str = "fp32") -> tuple:
    """What the single-group test of a block reads of each ZeRO setting of the mesh, filling the
    sweep's ``statics`` and ``family`` of each (``zl``) as its loop does: ``(settings over the
    states floor, the highest of their scores, [(states per stage, the largest, family label, its
    position among the settings, the settings over the floor before it)] of the others in order, the
    runtime reserve, the gradient buckets, the chain)`` (the reserve and buckets read no ZeRO). The
    chain: those others again, by their largest stage, when each one's states are no larger than
    the next one's at every stage; else None."""
    sched, v, prec, scaling, _vj = spec
    capacity = cost.capacity
    n_closed, closed_best, opens = 0, None, []
    reserved = bucket = None
    for i, ((zero, shard), (statics, family)) in enumerate(zip(zeros, zl)):
        static = statics.get(vj)
        if static is None:
            floor = cost.states_floor(tp, cp, pp, dp, ep, zero, shard, prec, g_dt, "fp32", etp, v, vj[2])
            static = statics[vj] = (floor,) + cost.dp_static((tp, cp, pp, dp, ep), etp, v, zero, shard, prec, g_dt,
                                                             "fp32", vj[2])
        if not family:  # family() reads tp, cp, pp, ep, zero and etp only
            family.append(goal.family(model, cluster, tuple.__new__(
                Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched, v, prec, g_dt, "fp32", etp,
                            scaling))))
        floor, states, top_states, reserved, bucket = static
        if floor > capacity:
            n_closed += 1
            if closed_best is None or -floor > closed_best:
                closed_best = -floor
        else:
            opens.append((states, top_states, family[0], i, n_closed))
    chain = sorted(opens, key=lambda o: o[1])
    for (low, *_), (high, *_) in zip(chain, chain[1:]):
        if any(a > b for a, b in zip(low, high)):
            chain = None
            break
    return n_closed, closed_best, opens, reserved, bucket, chain


def _kinds(specs: list, vj: tuple, memory: list, bound: float | None, pp: int, n_mb: int,
           cost: TrainCostModel | None = None, lean: tuple | None = None, slots: list | None = None) -> list:
    """The specs of group ``vj`` by the memory they hold in flight: ``[grown, count, highest
    bound]`` per distinct per-stage list, ``memory`` (``_memory``'s) with a bound each. With a
    ``bound`` (the recompute shortcut) every spec's bound is that number; else each spec's own,
    from its screen profile ``lean``, filling ``slots`` (step without the DP part, bound, in-flight
    list) as the per-candidate loop does."""
    if bound is not None:
        return [(grown, count, bound) for grown, count in memory]
    kinds = []
    t_mb, _rows, _buffers, p2p_s, _n, tokens = lean[:6]
    step_base_of = cost.step_base
    for (_in_flight, _sched, v, ks, count), (grown, _count) in zip(_plan(specs, vj), memory):
        most = None
        for k in ks:
            slot = slots[k]
            if slot is None:
                step_base = step_base_of(t_mb, p2p_s, specs[k][0], pp, n_mb, v)[3]
                slot = slots[k] = (step_base, tokens / step_base, grown)
            if most is None or slot[1] > most:
                most = slot[1]
        kinds.append((grown, count, most))
    return kinds


def _plan(specs: list, vj: tuple) -> list:
    """The specs of group ``vj`` by the micro-batches they hold in flight: ``(in-flight kind, its
    first schedule, v, the specs' positions, their number)`` per kind, in order of first appearance
    (1F1B and zero-bubble hold the same micro-batches), once per shape of a block's specs."""
    plan = _KIND_PLANS.get((id(specs), vj))
    if plan is None or plan[0] is not specs:
        by_kind: dict = {}  # in-flight kind -> (its first schedule, v, the specs' positions)
        for k, (sched, v, _prec, _scaling, svj) in enumerate(specs):
            if svj == vj:
                in_flight = (vj, "1f1b" if sched == "zero-bubble" else sched)  # the same micro-batches held
                by_kind.setdefault(in_flight, (sched, v, []))[2].append(k)
        plan = _KIND_PLANS[(id(specs), vj)] = (specs, [(key, sched, v, ks, len(ks))
                                                       for key, (sched, v, ks) in by_kind.items()])
    return plan[1]


def _memory(cost: TrainCostModel, shared: dict, specs: list, vj: tuple, tp: int, cp: int, pp: int, ep: int,
            mbs: int, sp: bool, rc: str, dtype: str, etp: int, v: int, n_mb: int, growth: float,
            rows: list | None = None, by_rc: dict | None = None) -> list:
    """Per in-flight kind of group ``vj`` (``_plan``'s order): ``(grown, count)``, each stage's
    activations in flight and buffers as ``peak_bytes`` sums them (``_grown``) from the rows of
    ``screen_rows(tp, cp, pp, ep, mbs, sp, rc, seq, dtype, etp, v)`` (``rows``: those rows, when
    the caller has them), and the number of specs holding it; kept in ``by_rc`` (``_recomputes``' of
    the same block, when the caller has it) under ``rc``."""
    if by_rc is None:
        by_rc = _recomputes(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, dtype, etp, v, n_mb)
    memory = by_rc.get(rc)
    if memory is None:
        if rows is None:
            rows = cost.screen_rows(tp, cp, pp, ep, mbs, sp, rc, cost.seq, dtype, etp, v)
        memory = by_rc[rc] = [(_grown(rows, sched, pp, n_mb, kv, growth), count)
                              for _key, sched, kv, _ks, count in _plan(specs, vj)]
    return memory


def _recomputes(cost: TrainCostModel, shared: dict, specs: list, vj: tuple, tp: int, cp: int, pp: int, ep: int,
                mbs: int, sp: bool, dtype: str, etp: int, v: int, n_mb: int) -> dict:
    """Where ``_memory`` keeps its lists, by recompute mode: one dict for the three blocks of a rest
    (they differ in nothing else), shared in ``shared`` by every block whose rows are the same
    numbers: the rows read the layers' activation and working bytes (layer.py, kept per tokens ``T =
    mbs seq / cp``, tp, sp, recompute, dtype and expert TP), the head's logits (per T, tp and dtype)
    and, of the stage rows, only each one's kind, rank, MoE layers and layers (``_holding``); nothing
    else of cp, mbs or ep (none at all of ep), unless activations are offloaded (then compute times
    enter: a fresh dict, the three blocks' alone)."""
    if cost._offload:
        return {}
    hkey = (tp, pp, ep, etp, v)
    hid = shared.get(hkey)  # the holdings' id, kept beside the lists (keys of another length)
    if hid is None:
        hid = shared[hkey] = _holding(cost, shared, tp, pp, ep, etp, v)
    key = (mbs * cost.seq / cp, tp, sp, dtype, etp, hid, n_mb, id(specs), vj)
    by_rc = shared.get(key)
    if by_rc is None:
        by_rc = shared[key] = {}
    return by_rc


def _holding(cost: TrainCostModel, shared: dict, tp: int, pp: int, ep: int, etp: int, v: int) -> int:
    """A small id of what the memory rows read of ``stage_params(tp, pp, ep, etp, v)``: each stage
    row's kind, rank, MoE layers and layers (equal ids, equal tuples), kept in ``shared``."""
    held = tuple((kind, index, n_moe, nls) for kind, index, n_moe, _pd, _pe, _layer, _lin, nls
                 in cost.stage_params(tp, pp, ep, etp, v))
    return shared.setdefault(("held", held), len(shared))


def _fit_prefix(chain: list, grown: list, base: float, capacity: float, j0: int) -> int:
    """How many of the chain's first ``j0`` settings (``_settings``' chain: states no smaller stage by
    stage along it) fit beside the in-flight bytes ``grown`` and ``base``: those that fit are a
    prefix, so only its edge is looked for, the prefix's ends first, then by halving (any order
    finds the one edge). Each test is the expression ``peak_bytes`` compares."""
    lo, hi = 0, j0  # chain[:lo] fit, chain[hi:j0] do not
    if not hi:
        return 0
    for st, g in zip(chain[0][0], grown):
        if st + g + base > capacity:
            return 0
    lo = 1
    if lo < hi:
        for st, g in zip(chain[hi - 1][0], grown):
            if st + g + base > capacity:
                hi -= 1
                break
        else:
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            for st, g in zip(chain[mid][0], grown):
                if st + g + base > capacity:
                    hi = mid
                    break
            else:
                lo = mid + 1
    return lo


def _beats_a_family(chain: list, n: int, best_family: dict, most: float) -> bool:
    """Whether a candidate bounded by ``most`` in one of the chain's first ``n`` settings could beat
    its family's best (no best held yet, or ``most`` above it): then the block is not quiet."""
    for _states, _top, fam, _i, _n in chain[:n]:
        if fam is not None:
            held_fam = best_family.get(fam)
            if held_fam is None or most > held_fam[0]:
                return True
    return False


def _setting_rejects(states: list, kinds: list, base: float, capacity: float, low: float | None, fam,
                     held_fam: tuple | None, held_act: tuple | None) -> int | None:
    """The quiet test of one ZeRO setting (``states`` per stage, ``base`` bytes) over ``kinds``
    (``[grown, count, highest bound]``): the number of its candidates rejected for activations when
    none of them can change anything but the counts (a fitting kind's bound no higher than the top's
    lowest ``low`` and its family's best ``held_fam``, a rejected kind's no higher than ``held_act``'s
    score); None when one can."""
    n_act = 0
    for grown, n_grown, most in kinds:
        for st, g in zip(states, grown):
            if st + g + base > capacity:  # the expression peak_bytes compares
                break
        else:  # fits
            if low is None or most > low or (fam is not None and (held_fam is None or most > held_fam[0])):
                return None
            continue
        n_act += n_grown
        if held_act is None or most > held_act[0]:
            return None
    return n_act
