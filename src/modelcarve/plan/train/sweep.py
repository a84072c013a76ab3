"""The train goal's screening pass: every candidate's verdict, tokens/s only where it can matter.

    best, rejected, best_rejected, best_family, evaluated = sweep(GOAL, model, cluster, top=10, global_batch=1536, seq=2048)

``plan/search.py`` calls a goal's ``sweep`` when it has one instead of screening candidate by
candidate; ``TrainGoal.sweep`` (plan/train/goal.py) is this function. It walks
``plan/train/space.py``'s ``layout_blocks`` (rest by rest: ``layout_rests``, each rest's blocks with
recompute "none", "selective" and "full" in turn) and gives the very answer of the one-by-one loop (the
exact shortcuts are stated in ``sweep``'s docstring; the blocks it cannot count as a whole go setting
by setting, plan/train/by_setting.py); tests/plan/test_search_golden.py and
tests/plan/test_sweep_shortcuts.py hold it to that.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from modelcarve.plan.train.blocks import (
    _KIND_PLANS,
    _beats_a_family,
    _fit_prefix,
    _kinds,
    _memory,
    _recomputes,
    _setting_rejects,
    _settings,
)
from modelcarve.plan.train.by_setting import by_setting
from modelcarve.plan.train.space import (
    RECOMPUTES,
    _compute,
    _precisions,
    grad_dtype_of,
    layout_rests,
)
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.support import fsdp_holds_gradients

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

def sweep(goal, model: "ModelSpec", cluster: "ClusterSpec", top: int, **options) -> tuple:
    """The search's screening pass (plan/search.py ``_screened``) over every candidate, with
    the same answer, faster: ``(best, rejected, best_rejected, best_family, evaluated)``
    exactly as that loop leaves them (the heap ``best`` holds ``(score, position, candidate)``,
    position in ``candidates``' order, so its order is the loop's).

    It walks ``layout_blocks`` (as ``layout_rests`` and each rest's ``RECOMPUTES``: what a block reads
    of its rest alone, its specs, ZeRO settings and their summary, is looked up once for the three)
    and decides each candidate's reject category exactly as
    ``TrainCostModel._evaluate`` does: the same states floor, the same DP memory sums
    (``dp_static``), the same profile numbers (``screen_profile``, which ``profile`` is built
    from) and the same per-stage sum ``peak_bytes`` compares with capacity; it computes a
    candidate's tokens/s (``by_setting._exact``: the full profile, DP entry and traffic, as ``_evaluate``)
    only when that number can change the answer. Two exact shortcuts:

    * The bound: ``tokens / step_base`` is at least the candidate's tokens/s, because its step
      is ``step_base + exposed_s`` with ``exposed_s >= 0`` (TrainCostModel.step_base), in
      floating point as in exact arithmetic. Every use the loop makes of a score is a strict
      ``>`` against a score held (the top's lowest once the top is full, the best of the
      candidate's family, the best of its reject category), so a candidate whose bound is no
      higher than each score its outcome meets changes nothing but the counts, which are kept.
    * Whole groups: the states floor and the DP memory floor depend on the (v, precision) of
      a candidate and not on its schedule (FSDP's gradients held to the step's end read the
      pipeline's size only: spec/support.py ``fsdp_holds_gradients``, a group's third key, the
      same for every spec of a block), so when every group of a ZeRO setting is rejected
      by one of them, its candidates are counted together; the best rejected of a category is
      then the first candidate of the first group holding its best score, as the loop's
      strict ``>`` keeps the first of equals.
    * Quiet ZeRO settings: when the highest bound among a ZeRO setting's fitting candidates is
      no higher than the top's lowest (top full) and its family's best, the highest among its
      candidates rejected for activations no higher than that category's best, and each
      group-rejected score no higher than its category's best, no candidate of the setting
      changes anything but the counts (each is a no-op by the bound above, and a no-op leaves
      the scores the next one meets as they were), so the setting's verdicts are counted
      together: every memory verdict is still decided, per distinct per-stage in-flight list.
      The scores tested against may be read before the block and not after a setting that
      only counted rejections: a score held only ever rises, so a stale one is never higher
      and at worst sends a setting the exact way.
    * Recomputation bounds: a block with recompute "selective" or "full" comes after the "none"
      block of the same rest (tp, cp, pp, mbs, ep, etp, sp), and each of its candidates'
      bound is at most the "none" candidate's of the same schedule and precision: a layer's
      forward and backward are the same numbers (``layer_base``), recomputation adds a
      non-negative time, the TP and EP collectives are counted 6 times instead of 4, the CP,
      pipeline and head terms are equal, and in floating point ``x <= y`` implies
      ``x + z <= y + z``, ``a x <= a y`` (a >= 0) and ``max`` of larger terms is larger, so the
      stage times, ``t_mb`` and ``step_base`` are no smaller and ``tokens / step_base`` no
      larger. Such a block first tries the quiet test with the "none" block's highest bound per
      group and only the memory rows (``TrainCostModel.screen_rows``, the screen profile's own
      expressions; the buffers do not read recompute); a setting that is not quiet under it
      makes the block build its own screen profile and bounds, as any other. With one group and
      a chain (below), the numbers that test reads of the rest, the base bytes and the chain's
      settings over capacity on their own, are the same for its two recomputing blocks (the base
      reads the "none" block's buffers, the ZeRO-free reserve and buckets): taken once, after the
      "none" block, and each recomputing block makes the whole-block test with them first; one that
      is not quiet goes the general way, which makes the same tests again.
    * Whole blocks (one group): when every ZeRO setting of a block would be quiet, tested in
      order against the same scores the setting-by-setting loop reads (a quiet setting changes
      only the counts, so the scores the next one meets are the same), the block's counts are
      added at once; else the loop decides it setting by setting (plan/train/by_setting.py), as before. When the open
      settings' states form a chain (each no larger than the next at every stage,
      ``blocks._settings``), each memory sum is no smaller along it (``x <= y`` implies
      ``x + z <= y + z``), so the settings whose largest stage overflows on its own are a suffix
      and those whose candidates of one in-flight kind fit a prefix: only its edges are tested,
      each kind's edge found by testing the prefix's two ends first (most kinds fit every open
      setting or none), then by halving what is left; any order of tests finds the one edge. When
      every kind has one bound (a recomputing block's quick test, below), the tests the loop would
      make kind by kind, each of which must pass for the block to be quiet, are made once: against
      the widest prefix that fits and, if any kind does not fit all, the activations' best; the
      counts are the same sums.
    * Sequence parallelism: a recompute="none" block without SP is followed (after its
      recomputing blocks) by the same block with SP, and each of its candidates' bound is at most
      that block's candidate's of the same schedule: SP divides the element-wise bytes (norms,
      residuals, the quantised inputs) by tp and the pipeline send by tp or leaves it, and changes
      no GEMM, collective or recomputation term, so the stage times, ``t_mb`` and ``step_base``
      are no smaller without it (floating point as above). Such a block (one group, no offload)
      builds the SP block's screen profile and bounds first (kept for that block) and tries the
      whole-block test with them and its own memory (``screen_buffers``, ``_memory``); if that test
      fails, the block builds its own, as any other. Its recomputing blocks take the same bound.
    * Shared memory rows: a block's per-stage memory in flight (``blocks._memory``) is the same
      list for every block with the same tokens per micro-batch, tp, sp, recompute, dtype, expert
      TP, stage holdings and micro-batch count (whatever its cp, mbs and ep), so it is built once;
      the three recompute modes' lists of a block are kept in one dict (``blocks._recomputes``),
      which the "none" block hands its recomputing blocks with its bounds: they differ from it in
      the recompute mode alone, so they look nothing else up.
    """
    # the cyclic collector has nothing to find in the sweep's short-lived tuples and lists, yet
    # would scan them every few hundred allocations: paused for the sweep (no number changes)
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _sweep(goal, model, cluster, top, **options)
    finally:
        if paused:
            gc.enable()


def _sweep(goal, model: "ModelSpec", cluster: "ClusterSpec", top: int, **options) -> tuple:
    """``sweep`` itself (see there)."""
    from modelcarve.plan.train.model import ACTIVATIONS_DO_NOT_FIT, STATES_DO_NOT_FIT

    gbs = options.get("global_batch")
    seq = options.get("seq") or 2048
    if not gbs:
        raise LayoutError("planning a training job needs the global batch: give --global-batch (sequences per step)")
    precisions = _precisions(cluster, options.get("precision"))
    g_dt = grad_dtype_of(options.get("grad_dtype"))
    cost = goal.cost_model(model, cluster, **options)
    capacity, growth = cost.capacity, cost._growth
    best: list = []
    rejected: dict[str, int] = {}
    best_rejected: dict = {}
    best_family: dict = {}
    position = 0
    # the blocks, rest by rest: each rest's three recompute modes in turn ("none" first)
    rests = layout_rests(model, cluster, gbs, seq, **{k: options[k] for k in ("max_mbs",) if k in options})
    shapes: dict = {}  # id(schedules) -> (schedules, specs, groups): a block's candidates after its ZeRO
    _KIND_PLANS.clear()  # keyed by id(specs) of this sweep's shapes
    shared: dict = {}  # _memory's: per-stage memory in flight by what it reads, and the stage holdings' ids
    mesh = None
    for tp, cp, pp, dp, mbs, ep, etp, sp, zeros, scheds in rests:
        n_mb = gbs // (mbs * dp)
        if (tp, cp, pp) != mesh:
            mesh = (tp, cp, pp)
            # (ep, etp) -> per (zero, dp_shard) of the mesh: ({(v, precision): (states floor,) +
            # dp_static(...)}, [family label]): what the memory checks and the family read that no
            # micro-batching changes, for this (tp, cp, pp, dp)
            per_zero: dict = {}
            summaries: dict = {}  # (ep, etp) -> _settings(...) of the single group
            ahead: dict = {}  # (mbs, ep, etp, vj) -> the sp=True "none" block's (screen profile, slots, kinds)
        shape = shapes.get(id(scheds))
        if shape is None or shape[0] is not scheds:
            # specs: (schedule, v, precision, scaling, (v, precision index, FSDP gradients held)) in the
            # candidates' order; groups: each such key with its number of specs and its first, in order of
            # first appearance (the states floor and the DP memory depend on nothing else of a spec)
            held = fsdp_holds_gradients(pp)
            specs = [(sched, v, prec, scaling, (v, j, held)) for sched, v in scheds
                     for j, (prec, scaling) in enumerate(precisions)]
            groups: dict = {}
            for spec in specs:
                held = groups.get(spec[4])
                groups[spec[4]] = [1, spec] if held is None else [held[0] + 1, held[1]]
            shape = shapes[id(scheds)] = (scheds, specs, list(groups.items()))
        _, specs, groups = shape
        n_spec = len(specs)
        n_block = n_spec * len(zeros)  # candidates of a block
        zl = per_zero.get((ep, etp))
        if zl is None:
            zl = per_zero[(ep, etp)] = [({}, []) for _ in zeros]
        # one group (a single (v, precision)): the quiet test first, the base bytes once per block;
        # a setting that is not quiet goes the general way
        single = groups[0] if len(groups) == 1 else None
        if single is not None:
            vj, (count, (_sched, v, prec, scaling, _vj)) = single
            dtype_s = "fp8cs" if prec == "fp8" and scaling == "current" else prec  # _compute, inlined
            summary = summaries.get((ep, etp))
            if summary is None:
                summary = summaries[(ep, etp)] = _settings(
                    cost, goal, model, cluster, zeros, zl, vj, single[1][1], tp, cp, pp, dp, ep, etp, mbs, sp, "none",
                    g_dt)
            n_closed, closed_best, summary_opens, reserved, bucket, chain = summary
        covered = None  # the recompute="none" block's, per group: (buffers, highest bound, _recomputes)
        quick = None  # what the recomputing blocks' quiet test reads of it (after the "none" block)
        for rc in RECOMPUTES:
            if quick is not None:
                # a recomputing block of a single group the "none" block covered, with a chain: the quiet
                # test below (the "none" block's bound for every kind), its base bytes and the chain's
                # settings over capacity on their own taken once for the rest's two; a block that is not
                # quiet goes the general way, which makes the same tests again
                most, by_rc, base, j0, n_over, over = quick
                low = best[0][0] if len(best) == top else None
                held_act = best_rejected.get(ACTIVATIONS_DO_NOT_FIT)
                quiet = True
                if n_closed:
                    held = best_rejected.get(STATES_DO_NOT_FIT)
                    quiet = held is not None and closed_best <= held[0]
                if n_over and (held_act is None or over > held_act[0]):
                    quiet = False
                if quiet:
                    memory = by_rc.get(rc) if by_rc is not None else None
                    if memory is None:
                        memory = _memory(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb,
                                         growth, None, by_rc)
                    n_act = n_over
                    widest = 0
                    short = False
                    for grown, n_grown in memory:
                        lo = _fit_prefix(chain, grown, base, capacity, j0)  # chain[:lo] fit, chain[lo:j0] do not
                        if lo > widest:
                            widest = lo
                        if lo < j0:  # some do not fit
                            short = True
                            n_act += n_grown * (j0 - lo)
                    if widest and (low is None or most > low):
                        quiet = False
                    elif short and (held_act is None or most > held_act[0]):
                        quiet = False
                    elif _beats_a_family(chain, widest, best_family, most):
                        quiet = False
                    if quiet:
                        if n_closed:
                            rejected[STATES_DO_NOT_FIT] += n_closed * count
                        if n_act:
                            rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT, 0) + n_act
                        position += n_block
                        continue
            # per spec: step without the DP part, the tokens/s bound, each stage's activations in flight
            # and buffers (as peak_bytes sums them); built when first needed
            slots: list = [None] * n_spec
            leans: dict = {}  # (v, precision index) -> the cost model's screen_profile
            kinds_of: dict = {}  # (v, precision index) -> _kinds(...): the specs by memory in flight, with bounds
            # recomputation after recompute="none" of the same rest: that block's bounds bound this one's
            upper = covered
            low = best[0][0] if len(best) == top else None  # the top's lowest once it is full
            held_act = best_rejected.get(ACTIVATIONS_DO_NOT_FIT)
            s_base = s_kinds = borrowed = None  # borrowed: (buffers, highest bound, _recomputes) from the sp=True block
            own_rc = None  # _recomputes(...) of the single group, when this block looked it up
            settings = zip(zeros, zl)
            if single is not None:
                # the whole block at once: when every ZeRO setting of it would be quiet in by_setting's loop
                # (the same tests, against the same scores: a quiet setting changes only the counts), its
                # counts are added together; else the loop decides setting by setting
                opens = summary_opens
                quiet = True
                if n_closed:
                    held = best_rejected.get(STATES_DO_NOT_FIT)
                    quiet = held is not None and closed_best <= held[0]
                n_act = 0
                if quiet and opens:
                    seq = cost.seq
                    if upper is not None and vj in upper:
                        buffers, most, by_rc = upper[vj]
                        s_kinds = [(grown, n_grown, most) for grown, n_grown in _memory(
                            cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb, growth, None,
                            by_rc)]
                    elif rc == "none" and not sp and tp > 1 and seq % tp == 0 and not cost._offload:
                        # sequence parallelism never lowers the bound (sweep's docstring): the bounds of the
                        # sp=True block that follows, built now and kept for it, bound this block's
                        lean = cost.screen_profile(tp, cp, pp, dp, ep, mbs, True, rc, cost.seq, dtype_s, etp, v,
                                                   keep=False)
                        slots_sp = [None] * n_spec
                        by_rc = _recomputes(cost, shared, specs, vj, tp, cp, pp, ep, mbs, True, dtype_s, etp, v, n_mb)
                        kinds_sp = _kinds(specs, vj, _memory(cost, shared, specs, vj, tp, cp, pp, ep, mbs, True, rc,
                                                             dtype_s, etp, v, n_mb, growth, lean[1], by_rc),
                                          None, pp, n_mb, cost, lean, slots_sp)
                        ahead[(mbs, ep, etp, vj)] = (lean, slots_sp, kinds_sp, by_rc)
                        buffers = cost.screen_buffers(mbs * cost.seq / cp, tp, pp, ep, sp, cp, etp)[1]
                        by_rc = own_rc = _recomputes(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, dtype_s, etp, v,
                                                     n_mb)
                        memory = _memory(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb,
                                         growth, None, by_rc)
                        s_kinds = [(grown, n_grown, kind[2]) for (grown, n_grown), kind in zip(memory, kinds_sp)]
                        borrowed = (buffers, max(kind[2] for kind in kinds_sp), by_rc)
                    else:
                        kept = ahead.pop((mbs, ep, etp, vj), None) if rc == "none" and sp else None
                        if kept is not None:  # built by the sp=False block before: the same numbers
                            lean, slots, s_kinds, own_rc = kept
                            leans[vj], kinds_of[vj] = lean, s_kinds
                        else:
                            lean = leans[vj] = cost.screen_profile(tp, cp, pp, dp, ep, mbs, sp, rc, cost.seq, dtype_s,
                                                                   etp, v, keep=False)
                            own_rc = _recomputes(cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, dtype_s, etp, v, n_mb)
                            s_kinds = kinds_of[vj] = _kinds(specs, vj, _memory(
                                cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, dtype_s, etp, v, n_mb, growth,
                                lean[1], own_rc), None, pp, n_mb, cost, lean, slots)
                        buffers = lean[2]
                    base = s_base = (buffers + bucket) * growth + reserved  # reserved, bucket: ZeRO-free
                    if chain is not None:
                        # the open settings' states rise stage by stage along the chain (blocks._settings), so
                        # in floating point each test's sum does too: those over capacity on their own are a
                        # suffix, those whose candidates of a kind fit a prefix: each kind's edge is found by
                        # testing the ends first (most kinds fit all or none), then halving
                        n_open = j0 = len(chain)
                        while j0 and chain[j0 - 1][1] + base > capacity:
                            j0 -= 1
                        if j0 < n_open:  # the highest score among them is the first's
                            if held_act is None or -(chain[j0][1] + base) > held_act[0]:
                                quiet = False
                            n_act += (n_open - j0) * count
                        if quiet:
                            for grown, n_grown, most in s_kinds:
                                lo = _fit_prefix(chain, grown, base, capacity, j0)  # chain[:lo] fit, chain[lo:j0] do not
                                if lo:  # some fit
                                    if low is None or most > low or _beats_a_family(chain, lo, best_family, most):
                                        quiet = False
                                        break
                                if lo < j0:  # some do not
                                    if held_act is None or most > held_act[0]:
                                        quiet = False
                                        break
                                    n_act += n_grown * (j0 - lo)
                        if not quiet and borrowed is not None:  # by_setting takes this block's own bounds
                            s_base = s_kinds = borrowed = None
                        opens = ()
                    for states, top_states, fam, i, n_before in opens:
                        n_act_before = n_act
                        if top_states + base > capacity:
                            if held_act is None or -(top_states + base) > held_act[0]:
                                quiet = False
                                break
                            n_act += count
                            continue
                        held_fam = best_family.get(fam) if fam is not None else None
                        n_set = _setting_rejects(states, s_kinds, base, capacity, low, fam, held_fam, held_act)
                        if n_set is None:
                            quiet = False
                        else:
                            n_act += n_set
                        if not quiet:
                            # the settings before this one were quiet: counted; the loop takes it from here
                            if n_before:
                                rejected[STATES_DO_NOT_FIT] += n_before * count
                            if n_act_before:
                                rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT, 0) + n_act_before
                            position += n_spec * i
                            settings = zip(zeros[i:], zl[i:])
                            if borrowed is not None:  # the loop takes this block's own bounds
                                s_base = s_kinds = borrowed = None
                            break
                if quiet:
                    if n_closed:
                        rejected[STATES_DO_NOT_FIT] += n_closed * count
                    if n_act:
                        rejected[ACTIVATIONS_DO_NOT_FIT] = rejected.get(ACTIVATIONS_DO_NOT_FIT, 0) + n_act
                    position += n_spec * len(zeros)
                    settings = ()
            if settings:  # not counted as a whole: the setting-by-setting loop (plan/train/by_setting.py)
                position = by_setting(goal, model, cluster, cost, top, g_dt, shared, best, rejected, best_rejected,
                                      best_family, position, settings, (tp, cp, pp, dp, mbs, ep, etp, sp, rc), single,
                                      specs, groups, n_spec, n_mb, slots, leans, kinds_of, upper, s_base, s_kinds,
                                      dtype_s if single is not None else None, low, held_act)
            if rc == "none":
                # what the recompute="selective" and "full" blocks of the same rest may take as bounds
                covered = {}
                for vj, (_count, (_sched, v, prec, scaling, _vj)) in groups:
                    lean = leans.get(vj)
                    if lean is None:
                        if borrowed is not None:  # a bound of this block's candidates, so of those recomputing
                            covered[vj] = borrowed
                        continue
                    kinds = kinds_of.get(vj)
                    if kinds is None:
                        kinds = kinds_of[vj] = _kinds(specs, vj, _memory(
                            cost, shared, specs, vj, tp, cp, pp, ep, mbs, sp, rc, _compute(prec, scaling), etp, v, n_mb,
                            growth, lean[1]), None, pp, n_mb, cost, lean, slots)
                    highest = None
                    for _grown, _n, most in kinds:
                        if highest is None or most > highest:
                            highest = most
                    covered[vj] = (lean[2], highest, own_rc if single is not None else None)
                if single is not None and summary_opens and chain is not None and vj in covered:
                    _buffers, most, by_rc = covered[vj]
                    base = (_buffers + bucket) * growth + reserved  # as the general test's
                    n_open = j0 = len(chain)
                    while j0 and chain[j0 - 1][1] + base > capacity:
                        j0 -= 1
                    quick = (most, by_rc, base, j0, (n_open - j0) * count,
                             -(chain[j0][1] + base) if j0 < n_open else None)
    return best, rejected, best_rejected, best_family, position

