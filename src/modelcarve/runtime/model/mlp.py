"""The dense feed-forward block of the reference model (SwiGLU or GELU MLP) and the activations.

Shared by the dense layers (model.py) and the experts and shared experts of the MoE block
(moe.py); plain PyTorch, no torch.distributed (tensor.py shards ``w1``/``w3`` by columns and
``w2`` by rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelcarve.spec.model import ModelSpec


def activation_fn(name: str):
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name.startswith("gelu"):
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported")


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or a GELU MLP (w2(gelu(w1 x)))."""

    def __init__(self, spec: ModelSpec, ffn_size: int | None = None):
        super().__init__()
        h, size = spec.hidden_size, ffn_size or spec.ffn_size
        self.swiglu = spec.ffn_kind == "swiglu"
        self.act = activation_fn(spec.activation)
        self.w1 = nn.Linear(h, size, bias=spec.mlp_bias)
        self.w3 = nn.Linear(h, size, bias=spec.mlp_bias) if self.swiglu else None
        self.w2 = nn.Linear(size, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x)))
