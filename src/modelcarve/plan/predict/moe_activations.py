"""Bytes the eager runtime saves for backward in the MoE blocks of one rank (plan/predict/activations.py's terms for the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcarve.spec.layout import Layout
    from modelcarve.spec.model import ModelSpec


def moe_rank_activation_bytes(spec: "ModelSpec", layout: "Layout", rank: int, layers: int,
                              routing: dict | None) -> float | None:
    """Peak saved-for-backward bytes of one rank of an MoE model (None: not modelled)."""
    return None
