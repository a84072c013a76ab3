"""Activation recomputation of the reference model's blocks, as ``layout.recompute`` asks.

``full`` re-runs each transformer block's forward in the backward pass, ``selective`` only the
attention core (``core_attention``: the s^2 part), with ``torch.utils.checkpoint``
(non-reentrant). It is applied by replacing the module's ``forward`` on the instance, so FQNs do
not change; ``parallelize`` applies it after TP/EP/CP and before FSDP2, whose hooks then wrap the
recomputed forward (the parameters are gathered again before the block's backward). Which modes
the runtime runs is spec/support.py's (``RECOMPUTE_RUNTIME``).

A measurement may look inside the checkpointed regions: the replaced ``forward`` carries a
``measure`` attribute, None unless a measurement (runtime/measure/memory_report.py's
``SavedActivations``, which finds the attribute on the chunks' modules: the two packages may not
import each other) sets it to ``measure(forward, args, kwargs) -> (fn, context_fn)``; the region
then runs ``fn`` (which calls ``forward``) with that ``context_fn``. Unset, nothing changes.
"""

from __future__ import annotations

from torch import nn

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.support import RECOMPUTE_RUNTIME


def _checkpoint_forward(module: nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def recomputed(*args, **kwargs):
        if recomputed.measure is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        fn, context_fn = recomputed.measure(forward, args, kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    recomputed.measure = None
    module.forward = recomputed


def apply_recompute(chunk: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for block in chunk.layers.values():
        if mode == "full":
            _checkpoint_forward(block)
        elif mode == "selective":
            _checkpoint_forward(block.attention.core_attention)
        else:
            raise LayoutError(f"recompute={mode!r} is not one of: {', '.join(RECOMPUTE_RUNTIME)}")
