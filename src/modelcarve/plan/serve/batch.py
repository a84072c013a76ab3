"""The serving goals' choice of batch: the largest that meets the TTFT and TPOT bounds, or the
one a request rate keeps in flight.

``_largest_batch(ctx, max_b, ttft_bound, tpot_bound)`` searches bands of batches that share one
decode step (see its docstring), with a few decode-step evaluations per layout where trying
every batch would take ``max_b``; tests/plan/test_serve_speed.py checks it against trying every batch.
``sustained_batch(ctx, max_b, rate_per_replica)`` is the steady-state batch at a request rate
(Little's law, see its docstring), with the replica's capacity; ``at_rate`` adds what a request
sees there: itself plus, on average, the others in flight beside it (a fractional batch).
"""

from __future__ import annotations

from modelcarve.plan.serve.time import _ensure_prefill, _rates, _step_slope, prefill_overlap, round_s as _round_s, walk_s

_INF = float("inf")


def _largest_batch(c, max_b: int, ttft_bound: float, tpot_bound: float) -> tuple[int, tuple]:
    """Largest batch in 1..max_b meeting both bounds (TPOT and TTFT grow with the batch), or 1
    if none does, with its ``_rates``.

    A batch ``b`` runs ``min(pp, b)`` micro-batches of ``q = ceil(b / micro)`` sequences, so all
    the batches of one *band* ``(q - 1) pp < b <= q pp`` share one decode step and differ only in
    arithmetic on it. The search is over bands, one decode-step evaluation each, starting from
    the largest: Newton's method on the bounds' slack at a band's first batch, aimed with the
    step's slopes (``_step_slope``: attention, element-wise traffic and collectives are affine in
    the batch, the GEMMs affine on either side of their roofline, so the aim lands on the answer
    or next to it), kept inside the bracket of bands known to pass and to fail, bisecting if it
    stalls; then a bisection inside the last passing band, with no further step evaluations.
    A band passes or fails on the exact figures (the same operations as ``_rates``), or fails
    without an evaluation when the step's proven growth (``_step_slope``) already breaks a bound
    with a margin; the slopes only choose which band to try next, so a poor aim costs
    evaluations, never a different batch (given, as any bracketing search assumes, that the
    bounds' slack falls with the batch; tests/plan/test_serve_speed.py compares with trying every
    batch). Typically 2-3 decode-step evaluations per layout, where trying every batch takes
    max_b."""
    if c.prefill_s < 0:
        _ensure_prefill(c)
    pp = c.pp
    prefill = c.prefill_s
    drain = c.input_len * c.prefill_token_s  # prefill seconds one sequence adds, before sharing
    out = c.output_len
    per_pp = drain / pp / out  # a sequence's least prefill share of each token (prefill_overlap <= pp)
    if prefill > ttft_bound:  # even one sequence alone misses the TTFT bound
        round_s = _round_s(c, 1)
        return 1, (round_s, round_s, prefill, 1 / (round_s + drain / 1 / out))
    top = -(-max_b // (pp if pp < max_b else max_b))
    lo, hi, q = 0, top + 1, top  # band lo's first batch meets the bounds (0: none known), hi's does not
    step, slope, other, other_slope, grows = _step_slope(c, top)
    walk = walk_s(c) if pp > 1 else 0.0  # no round beats one walk through the stages (time.round_s)
    round_s = (pp * step if pp * step > walk else walk) + c.step_s if max_b >= pp else _round_s(c, max_b)
    per_seq = drain / prefill_overlap(pp, max_b, out) / out
    if tpot_bound - (round_s + (max_b - 1) * per_seq) >= 0 and ttft_bound - (prefill + (round_s if max_b > 1 else 0.0)) >= 0:
        return max_b, (round_s, round_s + (max_b - 1) * per_seq, prefill + (round_s if max_b > 1 else 0.0), max_b / (round_s + max_b * per_seq))
    lo_round = 0.0
    tries = 0
    rise_pp = pp * per_pp  # what each band adds to TPOT through the prefill share
    # A band that a lower bound proves to fail needs no evaluation; the margin covers rounding.
    tpot_over, ttft_over = tpot_bound * (1 + 1e-12), ttft_bound * (1 + 1e-12)
    while True:
        b = 1 if q == 1 else (q - 1) * pp + 1  # the band's first batch
        per_seq = drain / prefill_overlap(pp, b, out) / out
        tpot_slack = tpot_bound - (round_s + (b - 1) * per_seq)
        if tpot_slack >= 0 and ttft_bound - (prefill + (round_s if b > 1 else 0.0)) >= 0:
            lo, lo_round = q, round_s
            if grows >= 0 and q + 1 < hi:
                # The next band's round is at least this one's plus what the step surely grows
                # by (see _step_slope).
                least = pp * (step + grows) + c.step_s
                if least + q * rise_pp > tpot_over or prefill + least > ttft_over:
                    hi = q + 1
        else:
            hi = q
        if hi - lo <= 1:
            break
        tries += 1
        nq = (lo + hi) // 2 if lo else (hi + 1) // 2
        if tries <= 6:
            # Where each bound is met on the tangent of each roofline side; the step is the
            # larger side, so the answer is the nearest of the two sides' crossings.
            ttft_slack = ttft_bound - (prefill + round_s)
            aim = _INF
            d = pp * slope + rise_pp
            if d > 0:
                aim = q + tpot_slack / d
            if slope > 0:
                x = q + ttft_slack / (pp * slope)
                if x < aim:
                    aim = x
            gap = pp * (other - step)  # the other side's round minus the actual round (<= 0)
            d = pp * other_slope + rise_pp
            if d > 0:
                x = q + (tpot_slack - gap) / d
                if x < aim:
                    aim = x
            if other_slope > 0:
                x = q + (ttft_slack - gap) / (pp * other_slope)
                if x < aim:
                    aim = x
            if aim == aim:  # not NaN
                nq = hi - 1 if aim >= hi else (int(aim) if aim > lo else lo + 1)
        q = nq if lo < nq < hi else (lo + 1 if nq <= lo else hi - 1)
        step, slope, other, other_slope, grows = _step_slope(c, q)
        round_s = (pp * step if pp * step > walk else walk) + c.step_s if q > 1 else _round_s(c, 1)
    if lo == 0:
        round_s = _round_s(c, 1)
        return 1, (round_s, round_s, prefill, 1 / (round_s + drain / 1 / out))
    # Inside band lo every batch shares its round: bisect on the arithmetic alone.
    round_s = lo_round
    b_lo, b_hi = (1 if lo == 1 else (lo - 1) * pp + 1), min(lo * pp, max_b)
    while b_lo < b_hi:
        mid = (b_lo + b_hi + 1) // 2
        per_seq = drain / prefill_overlap(pp, mid, out) / out
        # band 1 (one sequence a micro-batch): the round grows with the batch up to pp sequences
        # (time.round_s: pp steps of the fullest stage may exceed the walk), not shared
        r = _round_s(c, mid) if lo == 1 else round_s
        if tpot_bound - (r + (mid - 1) * per_seq) >= 0 and ttft_bound - (prefill + r) >= 0:
            b_lo = mid
        else:
            b_hi = mid - 1
    if lo == 1:
        round_s = _round_s(c, b_lo)
    per_seq = drain / prefill_overlap(pp, b_lo, out) / out
    ttft = prefill + (round_s if b_lo > 1 else 0.0)
    return b_lo, (round_s, round_s + (b_lo - 1) * per_seq, ttft, b_lo / (round_s + b_lo * per_seq))


def sustained_batch(c, max_b: int, rate_per_replica: float) -> tuple[int, float, tuple]:
    """(batch, capacity requests/s, ``_rates`` at that batch) of one replica (attention group)
    receiving ``rate_per_replica`` requests/s, at most ``max_b`` sequences in flight.

    Capacity: the requests/s the replica completes at its full batch ``max_b``, its output
    tokens/s over ``output_len`` (``_rates(c, max_b)[3] / output_len``). At or above it the queue
    grows without bound: the batch returned is then ``max_b`` and the caller refuses the rate.

    Below it, the batch is the steady-state number of sequences in flight (Little's law: ``N =
    rate x T``, T the time a request spends in the engine). At batch ``b`` a request's time is its
    ``output_len`` decode rounds plus the prefills interleaved with them (TPOT x output_len) plus
    its own prefill share: exactly ``b`` over the replica's requests/s at ``b``, ``T(b) = b /
    cap(b)`` (``_rates``: ``cap(b) = b / (output_len x round(b) + b x input_len x prefill s per
    token / prefill_overlap)``). So ``N = rate x T(N)`` holds where ``cap(N) = rate``; whole
    sequences: the smallest ``b`` with ``cap(b) >= rate`` (bisection; the capacity grows with the
    batch, as ``_largest_batch`` assumes of the bounds' slack). The queue wait in front of the
    replica (plan/serve/queue.py, M/D/1 at the capacity) is the caller's to add to TTFT."""
    if c.prefill_s < 0:
        _ensure_prefill(c)
    out = c.output_len
    full = _rates(c, max_b)
    capacity = full[3] / out
    if rate_per_replica >= capacity or max_b == 1:
        return max_b, capacity, full
    first = _rates(c, 1)
    if first[3] / out >= rate_per_replica:
        return 1, capacity, first
    lo, hi, at_hi = 1, max_b, full  # cap(lo) < rate <= cap(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at = _rates(c, mid)
        if at[3] / out >= rate_per_replica:
            hi, at_hi = mid, at
        else:
            lo = mid
    return hi, capacity, at_hi


def _interpolated(rates, n: float, max_b: int) -> tuple:
    """``rates(b)`` (``_rates`` at a whole batch) at a fractional batch ``n`` (1 <= n <= max_b): linear
    between the whole batches around it, element by element (round, TPOT, TTFT, tokens/s)."""
    k = int(n)
    lo = rates(k)
    f = n - k
    if f <= 0.0 or k >= max_b:
        return lo
    hi = rates(k + 1)
    return tuple(a + f * (b - a) for a, b in zip(lo, hi))


def at_rate(c, max_b: int, rate_per_replica: float) -> tuple[int, float, tuple, float]:
    """(sustained batch, capacity requests/s, ``_rates`` as a request sees them, concurrency ``n``)
    of one replica receiving ``rate_per_replica`` requests/s (Poisson arrivals).

    ``sustained_batch`` gives the whole batch the rate keeps in flight (Little's law: the time
    average of the number in the engine, ``rate x T``) and the capacity. A request decodes beside
    itself and the others in flight while it is: with Poisson arrivals and a time ``T`` in the
    engine, on average ``rate x T`` others (those there when it arrives and have not left, plus
    those arriving since: ``rate (T - t) + rate t`` at every moment ``t`` of its stay). So it sees a
    batch of ``n = 1 + rate x T(n)`` on average, where ``T(n)`` = ``output_len`` tokens at TPOT(n) plus
    its own prefill, solved by fixed-point iteration (``T`` grows with ``n`` more slowly than
    ``1 / rate`` below capacity), and TPOT and TTFT are ``_rates``' figures interpolated at ``n``
    (``_interpolated``). Below one request in flight this is what the whole batch rounds away: a
    request at 0.66 requests/s spending 0.55 s in the engine shares it with another 36% of the
    time, so 36% of the way from batch 1's TPOT and TTFT to batch 2's (which carry the other
    request's decode and its prefill, ``_rates``). At or above capacity: the full batch, ``n =
    max_b``."""
    batch, capacity, at = sustained_batch(c, max_b, rate_per_replica)
    if rate_per_replica >= capacity or max_b == 1:
        return batch, capacity, at, float(batch)
    own_prefill = c.input_len * c.prefill_token_s
    whole = {batch: at}  # _rates by whole batch: the iterations keep landing between the same two

    def rates(b: int) -> tuple:
        got = whole.get(b)
        if got is None:
            got = whole[b] = _rates(c, b)
        return got

    n = float(batch)
    for _ in range(50):
        nxt = min(float(max_b), 1.0 + rate_per_replica * (c.output_len * _interpolated(rates, n, max_b)[1] + own_prefill))
        if abs(nxt - n) < 1e-9:
            break
        n = nxt
    return batch, capacity, _interpolated(rates, n, max_b), n
