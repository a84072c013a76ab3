"""memory_report.SavedActivations tells an autocast copy of a weight by its autograd history, not
by its shape: a bf16 activation whose shape equals a weight's (64 tokens into a 64 x 64 linear)
is an activation and counts; the weight's own bf16 copy (and its transpose) does not."""

from __future__ import annotations

import torch


def test_weight_shaped_activation_counts_and_weight_cast_does_not():
    from modelcarve.runtime.measure.memory_report import SavedActivations, weight_cast

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(64, 64, requires_grad=True) * 1.0  # 64 tokens x 64 hidden (a weight's shape), not a leaf
    with SavedActivations([lin]) as acts, torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    # F.linear under autocast saves the bf16 input (an activation, 64 x 64 x 2 bytes) and the bf16
    # weight copy (not one); the old shape rule dropped both
    assert acts.peak == 64 * 64 * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = lin.weight.to(torch.bfloat16)
    assert weight_cast(w) and weight_cast(w.t()) and not weight_cast(x.to(torch.bfloat16))
    y.float().sum().backward()
    assert acts.live == 0


def test_fp32_linear_counts_its_input_only():
    from modelcarve.runtime.measure.memory_report import SavedActivations

    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(64, 64, requires_grad=True) * 1.0
    with SavedActivations([lin]) as acts:
        lin(x).sum().backward()
    assert acts.peak == 64 * 64 * 4 and acts.live == 0
