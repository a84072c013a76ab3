"""Factorising a device count over mesh axes: divisors and ordered factorisations.

Every goal enumerates its candidate meshes with these (``tp x pp x dp ...`` = devices).
"""

from __future__ import annotations

from typing import Iterator, Sequence


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending."""
    if n < 1:
        return []
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def factorizations(n: int, num_axes: int, allowed: Sequence[Sequence[int] | None] = ()) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``num_axes`` positive integers whose product is ``n``.

    ``allowed[i]`` (optional) restricts axis ``i`` to those values; the last axis takes what is
    left, so it is checked rather than enumerated."""
    allowed = list(allowed) + [None] * (num_axes - len(allowed))

    def rec(rest: int, axis: int) -> Iterator[tuple[int, ...]]:
        if axis == num_axes - 1:
            if allowed[axis] is None or rest in allowed[axis]:
                yield (rest,)
            return
        for d in divisors(rest):
            if allowed[axis] is not None and d not in allowed[axis]:
                continue
            for tail in rec(rest // d, axis + 1):
                yield (d,) + tail

    if num_axes < 1:
        raise ValueError("num_axes must be at least 1")
    yield from rec(n, 0)
