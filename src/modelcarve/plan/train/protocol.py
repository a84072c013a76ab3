"""What the training cost model's helpers read from it: the ``TrainCost`` protocol.

plan/train/layer.py (one layer's cost), plan/train/states.py (model states, data-parallel
traffic) and plan/train/report.py (the JSON and its warnings) take the cost model as their first
argument; this protocol names what they use of it, so they need not import plan/train/model.py
(which imports them: the cost model sits above its helpers). ``TrainCostModel`` satisfies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from modelcarve.plan.cost import comm
    from modelcarve.spec.hardware import ClusterSpec, DeviceSpec
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec


class TrainCost(Protocol):
    model: "ModelSpec"
    cluster: "ClusterSpec"
    device: "DeviceSpec"
    options: Any
    """The cost model's TrainOptions."""
    capacity: float
    """Bytes of one device's memory a layout may use (the device less the memory headroom)."""
    device_memory: float
    """Bytes of one device's memory."""
    seq: int
    vocab_h: float
    dense_split: float
    moe_split: float
    layer_rep: float
    moe_rep: float
    moe_experts: float
    pos: float
    final_norm: float
    """Per-model parameter counts (plan/train/states.py's ``stage_row`` sums them per rank)."""
    head_fwd_flops_token: float
    _traffic: dict

    def tier(self, group: int, inner: int) -> "comm.Tier": ...

    _dtype: str
    """Compute key of the profile being built (bf16, fp8, fp8cs, mxfp8, ...)."""

    def _gemm(self, m: float, n: float, k: float, batch: float = 1.0, dtype: str | None = None) -> float: ...

    def layout(self, cand: tuple) -> "Layout": ...

    def states_floor(self, *args) -> float: ...

    def holds_layers(self, zero: int, pp: int) -> bool: ...

    def state_parts(self, prof: dict, cand: tuple, kind: str) -> dict[str, float]: ...
