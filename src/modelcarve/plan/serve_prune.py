"""Pruning for the serve-throughput screen: a ceiling on a layout's tokens/s that needs no
decode-step search, and what the screen may conclude from it (search.py's ``screen.above``).

Usage::

    from modelcarve.plan.serve_prune import group_ceiling, prune
    group_ceiling(c, max_b, ttft_s, tpot_s)   # >= _rates(c, b)[3] for every admissible b <= max_b
    prune(c, max_b, ttft_s, tpot_s, floor)     # 0.0: accepted, not above floor; round at batch 1:
                                               # rejected for TPOT at batch 1; None: search the batch

``c`` is a layout's ``serve_time._Ctx`` with its prefills costed. Every bound here is proven, not
estimated (the argument is in each docstring; tests/test_serve_prune.py checks it on every
candidate of several searches): a pruned search returns exactly what an unpruned one returns.
"""

from __future__ import annotations

from modelcarve.plan.serve_time import _stage_step

_INF = float("inf")

_CEILING_MARGIN = 1.0 + 1e-9
"""Relative slack on ``group_ceiling``: its arithmetic and the exact figures' round differently
(by ~1e-16 relative), and a bound must not fall below the figure it bounds."""
_FLOOR_MARGIN = 1.0 - 1e-9
"""The same slack on a lower bound."""


_MESH_FLOORS: dict[tuple, tuple] = {}
"""(id of a ``_Mesh``, micro-batch q) -> (that mesh, experts touched by 1 and by q sequences (as
fractions), ``_comm_floor``): what ``_round_floor`` shares across a mesh's dtype variants (the
mesh is kept in the entry so its id cannot be reused)."""


def _comm_floor(lines: tuple, q: int) -> tuple[float, float]:
    """(a, s): the collectives of a step (``_Ctx.comm_lines``) take at least ``a + s x b`` seconds at
    every micro-batch ``b >= 0``. Each line, ``count x max(floor, cheapest piece) + extra``, is at
    least ``count x floor + extra`` and at least ``count x (least intercept + least slope x b) +
    extra``; the one larger at ``q`` is taken."""
    a_sum = s_sum = 0.0
    for _, count, pieces, floor, extra in lines:
        a_min = min(a for a, _ in pieces)
        s_min = min(s for _, s in pieces)
        if count * floor >= count * (a_min + s_min * q):
            a_sum += count * floor + extra[0]
            s_sum += extra[1]
        else:
            a_sum += count * a_min + extra[0]
            s_sum += count * s_min + extra[1]
    return a_sum, s_sum


def _round_floor(c, max_b: int) -> tuple[float, float, float]:
    """(S0, K, D): at every batch ``b`` in 1..max_b the decode round is at least ``pp S0 + b K``
    seconds and each sequence's prefill share at least ``D`` seconds per output token; ``S0`` and
    ``K`` are not negative (otherwise ``K`` is returned as -1: no bound).

    A stage step is at least an affine ``S0 + q K`` in its micro-batch ``q`` (fixed overhead and
    dense weights read; attention and element-wise time, exactly ``k_attn_elem`` per sequence; the
    routed experts read, above its chord; each collective, above an affine lower bound, see
    ``_comm_floor``; the GEMMs' compute side, left out, only adds), and ``pp`` steps of
    ``ceil(b / min(pp, b))`` sequences hold at least ``b`` of them. The prefill share is
    ``drain / min(pp, b)``, at least ``D = drain / pp``."""
    pp = c.pp
    q = -(-max_b // pp)  # the largest micro-batch
    mesh = c.mesh
    key = (id(mesh), q)
    held = _MESH_FLOORS.get(key)
    if held is None or held[0] is not mesh:
        if len(_MESH_FLOORS) > 100_000:
            _MESH_FLOORS.clear()
        # The experts read, E(q) = experts_all (1 - miss^(q ep)) / hbm, is concave in q, so on
        # 1 <= q <= the largest micro-batch it lies above its chord: an affine lower bound.
        touched_1 = 1.0 - c.expert_miss ** c.ep
        touched_q = 1.0 - c.expert_miss ** (q * c.ep)
        held = _MESH_FLOORS[key] = (mesh, touched_1, touched_q) + _comm_floor(c.comm_lines, q)
    _, touched_1, touched_q, comm_s0, comm_k = held
    s0 = c.fixed_s + c.weights_fixed / c.hbm + comm_s0
    k = c.k_attn_elem + comm_k
    experts = c.experts_all
    if experts:
        one = experts * touched_1 / c.hbm
        chord = (experts * touched_q / c.hbm - one) / (q - 1) if q > 1 else 0.0
        s0 += one - chord
        k += chord
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
    round_1 = c.pp * _stage_step(c, 1)  # the search's round at batch 1, the same operations
    if round_1 <= tpot_bound:
        return 0.0
    s0, k, d = bounds
    if max_b == 1 or (k >= 0.0 and (c.pp * s0 + 2.0 * k + d) * _FLOOR_MARGIN > tpot_bound):
        return round_1
    return None
