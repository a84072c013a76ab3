"""Pruning for the serve-throughput screen: a ceiling on a layout's tokens/s that needs no
decode-step search, and what the screen may conclude from it (search.py's ``screen.above``).

Usage::

    from modelcarve.plan.serve.prune import group_ceiling, prune
    group_ceiling(c, max_b, ttft_s, tpot_s)   # >= _rates(c, b)[3] for every admissible b <= max_b
    prune(c, max_b, ttft_s, tpot_s, floor)     # 0.0: accepted, not above floor; round at batch 1:
                                               # rejected for TPOT at batch 1; None: search the batch

``c`` is a layout's ``layout_costs.LayoutCosts`` with its prefills costed. Every bound here is
proven, not estimated (the argument is in each docstring; tests/plan/test_serve_prune.py checks it on every
candidate of several searches): a pruned search returns exactly what an unpruned one returns.
"""

from __future__ import annotations

from modelcarve.plan.serve.time import round_s, walk_s

_INF = float("inf")

_CEILING_MARGIN = 1.0 + 1e-9
"""Relative slack on ``group_ceiling``: its arithmetic and the exact figures' round differently
(by ~1e-16 relative), and a bound must not fall below the figure it bounds."""
_FLOOR_MARGIN = 1.0 - 1e-9
"""The same slack on a lower bound."""


_MESH_FLOORS: dict[int, tuple] = {}
"""id of a ``_Mesh`` -> (that mesh, the experts one sequence touches (a fraction), ``_comm_pieces``):
what ``_round_floor`` shares across a mesh's dtype variants (the mesh is kept in the entry so its
id cannot be reused)."""


def _comm_pieces(lines: tuple) -> tuple:
    """Per collective line of a step (``LayoutCosts.comm_lines``, ``count x max(floor, cheapest piece) +
    extra`` at micro-batch ``b``): (count x floor, count x least intercept, count x least slope,
    extra intercept, extra slope). The line is at least ``count x floor + extra`` and at least
    ``count x (least intercept + least slope x b) + extra``: two affine lower bounds."""
    return tuple(
        (count * floor, count * min(a for a, _ in pieces), count * min(s for _, s in pieces), extra[0], extra[1])
        for _, count, pieces, floor, extra in lines
    )


def _round_floor(c, max_b: int) -> tuple[float, float, float]:
    """(S0, K, D): at every batch ``b`` in 1..max_b the decode round is at least ``pp S0 + b K``
    seconds and each sequence's prefill share at least ``D`` seconds per output token; ``S0`` and
    ``K`` are not negative (otherwise ``K`` is returned as -1: no bound).

    A stage step is at least an affine ``S0 + q K`` in its micro-batch ``q`` (fixed overhead and
    dense weights read; attention and element-wise time, exactly ``k_attn_elem`` per sequence; the
    routed experts read, above its chord; each collective, above an affine lower bound, see
    ``_comm_pieces``; the GEMMs' compute side, left out, only adds), and ``pp`` steps of
    ``ceil(b / min(pp, b))`` sequences hold at least ``b`` of them. Below ``pp`` sequences a round
    is at least the walk through every stage (time.py ``walk_s``), which can be less than ``pp``
    fullest steps: ``S0`` is lowered until ``pp S0 + b K`` stays under the walk for ``b < pp``. The prefill share is
    ``drain / min(pp, b)``, at least ``D = drain / pp``."""
    pp = c.pp
    q = -(-max_b // pp)  # the largest micro-batch
    mesh = c.mesh
    held = _MESH_FLOORS.get(id(mesh))
    if held is None or held[0] is not mesh:
        if len(_MESH_FLOORS) > 100_000:
            _MESH_FLOORS.clear()
        held = _MESH_FLOORS[id(mesh)] = (mesh, 1.0 - c.expert_miss ** c.ep, _comm_pieces(c.comm_lines))
    _, touched_1, pieces = held
    s0 = c.fixed_s + c.weights_fixed / c.hbm
    k = c.k_attn_elem
    for at_floor, a_min, s_min, e0, e1 in pieces:
        # Of each collective's two affine lower bounds, the larger at the largest micro-batch.
        if at_floor >= a_min + s_min * q:
            s0 += at_floor + e0
            k += e1
        else:
            s0 += a_min + e0
            k += s_min + e1
    experts = c.experts_all
    if experts:
        # The experts read, E(q) = experts_all (1 - miss^(q ep)) / hbm, is concave in q, so on
        # 1 <= q <= the largest micro-batch it lies above its chord: an affine lower bound.
        one = experts * touched_1 / c.hbm
        chord = (experts * (1.0 - c.expert_miss ** (q * c.ep)) / c.hbm - one) / (q - 1) if q > 1 else 0.0
        s0 += one - chord
        k += chord
    if pp > 1 and max_b > 1 and k >= 0.0:
        # Below pp sequences a token walks the stages (time.round_s): at least walk_s, which may be
        # under pp S0; so the affine floor must also stay under walk_s up to b = pp - 1.
        top = walk_s(c) - (min(pp, max_b) - 1) * k
        if top < pp * s0:
            s0 = top / pp
    if k < 0.0 or s0 < 0.0:
        k = -1.0
    return s0, k, c.input_len * c.prefill_token_s / pp / c.output_len


def group_ceiling(c, max_b: int, ttft_bound: float, tpot_bound: float, parts: tuple | None = None) -> float:
    """An upper bound on the output tokens/s of the attention group (``_rates``' last figure) at
    every batch ``b`` in 1..max_b that meets both bounds, and at ``b = 1``, without a decode step
    (``parts``: ``_round_floor(c, max_b)``, when the caller has it).

    With ``_round_floor``'s S0, K, D: tokens/s <= ``b / (pp S0 + b (K + D))``, which grows with
    ``b``; the bounds cap ``b`` (TPOT >= ``pp S0 + b K + (b - 1) D``; TTFT >= prefill + ``pp S0 + b
    K`` when ``b > 1``), so the ceiling is that at the largest ``b`` they allow (real, not rounded
    down). inf when there is no bound."""
    s0, k, d = parts or _round_floor(c, max_b)
    if k < 0.0:
        return _INF
    pp = c.pp
    b = float(max_b)
    if k + d > 0.0:
        limit = (tpot_bound - pp * s0 + d) / (k + d)
        if limit < b:
            b = limit
    if k > 0.0:
        limit = (ttft_bound - c.prefill_s - pp * s0) / k
        if limit < b:
            b = limit
    if b < 1.0:
        b = 1.0
    return b / (pp * s0 + b * (k + d)) * _CEILING_MARGIN


def prune(c, max_b: int, ttft_bound: float, tpot_bound: float, floor: float) -> float | None:
    """What the throughput screen can say about a layout (prefills costed) without its batch
    search, given that only a group tokens/s above ``floor`` matters: 0.0 when it is accepted
    whatever batch the search would choose and its ceiling is no higher than ``floor``; the decode
    round at batch 1 when it is rejected for TPOT at batch 1 (the search then returns batch 1);
    None when the batch search must run.

    Accepted: batch 1 meets both bounds, and then the search never returns a batch that fails
    (see ``_largest_batch``). Rejected: batch 1 misses the TPOT bound and the round's floor proves
    every larger batch does too (TPOT >= ``pp S0 + 2 K + D`` from ``b = 2`` on)."""
    if c.prefill_s > ttft_bound:  # the search answers after one step (batch 1, TTFT)
        return None
    bounds = _round_floor(c, max_b)
    if group_ceiling(c, max_b, ttft_bound, tpot_bound, bounds) > floor:
        return None
    round_1 = round_s(c, 1)  # the search's round at batch 1, the same operations
    if round_1 <= tpot_bound:
        return 0.0
    s0, k, d = bounds
    if max_b == 1 or (k >= 0.0 and (c.pp * s0 + 2.0 * k + d) * _FLOOR_MARGIN > tpot_bound):
        return round_1
    return None
