"""memory_report.SavedActivations under recomputation (runtime/parallel/recompute.py), by hand.

One tiny-llama block (hidden 64, 4 heads of 16, 2 kv heads, ffn 128, vocab 256), seq 16, one
sequence, fp32, the head and loss on it; a byte count per tensor:

* always: the token ids 16 x 8 = 128; the final norm's input, output (2 x 4,096) and inverse RMS
  64; the head's input 4,096; the fp32 logits 16 x 256 x 4 = 16,384 (log-softmax's output, the
  loss's input: one storage); the targets 128 and the loss's total weight 4: 28,996 bytes.
* ``none``: the block's own saved tensors, 78,208 (plan/predict/activations.py ``layer_terms``: its
  input, the embedding's output, among them as its first norm's input) and the rotary cos / sin
  2 x 16 x 16 x 4 = 2,048: 28,996 + 78,208 + 2,048 = 109,252 at the end of the forward.
* ``full``: the checkpoint keeps the block's input 4,096 and its ``(cos, sin)`` 2,048: 35,140
  after the forward; in the backward, once the loss's tensors are freed (all but the ids), the
  recomputed block re-saves its 78,208 bytes, the input among them counted once: 128 + 4,096 +
  2,048 + 78,208 - 4,096 = 80,384, the peak; 0 once the backward is done (the frame released).
* ``selective``: the attention core keeps its inputs q (4 heads) and k, v (2 kv heads), 8,192,
  instead of the 16,640 it saves (q, k and v expanded to 4 heads 12,288; output 4,096 and its
  log-sum-exp 256): 109,252 - 16,640 + 8,192 = 100,804, at the end of the forward.
"""

from __future__ import annotations

import pytest
import torch


def _one_block(mode: str, measure: bool = True):
    from modelcarve.runtime.measure.memory_report import SavedActivations
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.recompute import apply_recompute
    from modelcarve.spec.catalog import get_model

    model = build_model(get_model("tiny-llama"), seed=0)
    for key in list(model.layers)[1:]:
        del model.layers[key]
    apply_recompute(model, mode)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))

    def step():
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        return loss

    if not measure:
        step().backward()
        return model, None
    with SavedActivations([model]) as acts:
        loss = step()
        after_forward = acts.live
        loss.backward()
        del loss
    return model, dict(forward=after_forward, peak=acts.peak, end=acts.live)


@pytest.mark.parametrize("mode, forward, peak", [("none", 109_252, 109_252), ("full", 35_140, 80_384),
                                                 ("selective", 100_804, 100_804)])
def test_recomputed_regions_counted_by_hand(mode, forward, peak):
    _, got = _one_block(mode)
    assert got == dict(forward=forward, peak=peak, end=0)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_measuring_changes_nothing(mode):
    """The measurement's context_fn runs the same region: gradients equal, hook unset after."""
    measured, _ = _one_block(mode)
    plain, _ = _one_block(mode, measure=False)
    for (name, p), q in zip(measured.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    hooks = [m.__dict__["forward"] for m in measured.modules() if "forward" in m.__dict__]
    assert hooks and all(f.measure is None for f in hooks)


def test_predicted_terms_match_by_hand():
    """plan/predict/activations.py on the same block gives the same three peaks."""
    from modelcarve.plan.predict.activations import rank_activation_bytes
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout

    spec = get_model("tiny-llama")
    got = {mode: rank_activation_bytes(spec, Layout.parse(f"gbs=1,seq=16,mbs=1,param_dtype=fp32,recompute={mode}"), 1, True, True)
           for mode in ("none", "full", "selective")}
    assert got == {"none": 109_252, "full": 80_384, "selective": 100_804}
