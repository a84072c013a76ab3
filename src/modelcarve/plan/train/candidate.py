"""One training layout as the search enumerates and prices it: a typed tuple, ``Candidate``.

The training search screens hundreds of thousands of layouts per plan, so a candidate is a
``NamedTuple`` (a tuple to the cost model's caches, which key on slices of it; named fields to a
reader) rather than a full ``spec.layout.Layout``; ``TrainCostModel.layout`` turns the winners
into Layouts. The field order is part of the caches' keys: add a field at the end.
"""

from __future__ import annotations

from typing import NamedTuple


class Candidate(NamedTuple):
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    mbs: int
    sp: bool
    recompute: str
    zero: int
    dp_shard: int
    schedule: str
    virtual_stages: int
    param_dtype: str
    grad_dtype: str
    optim_dtype: str
    etp: int
    """Expert tensor parallelism, resolved (never 0 in a search candidate)."""
    fp8_scaling: str


FIELDS = Candidate._fields
"""The field names, in order (``dict(zip(FIELDS, cand))`` gives a Layout's keyword arguments)."""
