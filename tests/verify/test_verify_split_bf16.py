"""verify's bf16 bound for split layouts (verify/reference.py ``split_roundings``, ``anchored_tolerance``):
a tp / cp run in bf16 is held against the single-device bf16 reference within ``k`` times the
reference's own distance from an fp32 run of the same weights and batch, ``k = 2 + tp [tp>1] + cp [cp>1]``.

* by hand: the factor per layout, and the bound of synthetic tensors;
* first-order check of the derivation on one row-parallel product in plain torch: splitting a bf16
  GEMM's reduction over ``t`` partial results (each rounded, then summed and rounded) lands no
  further from the fp64 product than ``t + 1`` times the unsplit bf16 GEMM's worst rounding bound
  allows, and the split-vs-unsplit difference stays inside ``k`` x (unsplit vs exact) on average
  over seeds (the bound is first order in the unit roundoff, so it is checked on the mean, not
  element by element).
"""

from __future__ import annotations

import torch

from modelcarve.spec.layout import Layout
from modelcarve.verify.reference import anchored_tolerance, split_roundings


def test_factor_by_hand():
    assert split_roundings(Layout.parse("dp=2")) == 2
    assert split_roundings(Layout.parse("tp=2")) == 4
    assert split_roundings(Layout.parse("cp=2")) == 4
    assert split_roundings(Layout.parse("tp=2,cp=2")) == 6
    assert split_roundings(Layout.parse("tp=4")) == 6


def test_bound_by_hand():
    ref, exact = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.25, 3.0])
    layout = Layout.parse("tp=2")
    assert anchored_tolerance(0.05, layout, ref, exact) == 4 * 0.25
    assert anchored_tolerance(5.0, layout, ref, exact) == 5.0  # the fixed tolerance where it is larger


def test_split_reduction_inside_the_factor():
    ratios = []
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 256, generator=g)
        w = torch.randn(256, 128, generator=g) * 0.2
        exact = x.double() @ w.double()
        whole = (x.bfloat16() @ w.bfloat16()).double()  # one rounding of the full sum
        t = 2
        parts = [(x[:, i::t].bfloat16() @ w[i::t].bfloat16()) for i in range(t)]  # each partial rounded
        split = (parts[0] + parts[1]).double()  # the bf16 all-reduce: the sum rounded again
        ratios.append(float((split - whole).abs().max() / (whole - exact).abs().max()))
    k = split_roundings(Layout.parse("tp=2"))
    assert sum(ratios) / len(ratios) <= k
