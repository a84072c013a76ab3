"""Activation recomputation (runtime/parallel/recompute.py): the recomputed pieces run their forward
twice, gradients do not change. (Under TP/FSDP: tests/runtime/test_runtime_layouts.py.)"""

import pytest
import torch

from modelcarve.runtime.model.transformer import build_model
from modelcarve.runtime.parallel.recompute import apply_recompute
from modelcarve.spec.catalog import get_model


def _grads_and_calls(mode):
    model = build_model(get_model("tiny-llama"), seed=0)
    calls = {"ffn": 0, "core": 0}
    for block in model.layers.values():
        for attr, key in ((block.feed_forward, "ffn"), (block.attention.core_attention, "core")):
            original = attr.forward

            def counted(*a, __f=original, __k=key, **k):
                calls[__k] += 1
                return __f(*a, **k)

            attr.forward = counted
    apply_recompute(model, mode)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("mode, ffn, core", [("none", 1, 1), ("selective", 1, 2), ("full", 2, 2)])
def test_recompute_reruns_forward_and_keeps_gradients(mode, ffn, core):
    reference, _ = _grads_and_calls("none")
    grads, calls = _grads_and_calls(mode)
    layers = 4
    assert calls == {"ffn": ffn * layers, "core": core * layers}
    for name, g in grads.items():
        assert torch.equal(g, reference[name]), name
