"""Weight-only quantisation of a built model, and quantise / dequantise helpers for KV-cache tensors.

Usage::

    from modelcarve.runtime.engine.quant import quantize_model, weight_bytes
    model = build_model(spec, dtype=torch.bfloat16)        # or after parallelize(...) on a rank
    quantize_model(model, "int4", group_size=128)           # int8 | int4 | fp8, in place
    print(weight_bytes(model))                              # resident bytes of weights on this rank

What is quantised is what the planner (plan/cost/quant.py) counts as quantised: the matrices of the
attention and MLP of every layer (nn.Linear, and tensor.py's RowParallelLinear after TP), MoE
shared experts, and the routed experts (moe.GroupedExperts, swapped for ``QuantExperts``: one
QuantLinear per expert matrix, whatever EP / expert TP left on this rank). The embedding, the
LM head, norms, biases and the MoE router keep the model's dtype.

Storage per quantised matrix W [out, in] (bytes per weight; the planner's figure beside it):

* ``int8``: symmetric per output channel, int8 values + one fp16 scale per channel:
  ``1 + 2 / in`` (planner: ``1 + 2 / hidden``). GEMM: ``torch.ops.aten._weight_int8pack_mm``
  (PyTorch's CPU kernel, activations fp32/bf16, scales cast to the activation dtype per call).
* ``int4``: asymmetric per group of ``group_size`` (32, 64 or 128) inputs, values 0..15 packed two
  per byte in the layout of ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``, one fp16 scale
  and one 4-bit zero point (two per byte) per group: ``0.5 + 2.5 / group`` (planner, g128:
  0.5195). GEMM: ``torch.ops.aten._weight_int4pack_mm_for_cpu``; its ``scales_and_zeros``
  operand ([groups, out, 2] in the activation dtype, 4x the stored scale bytes) is built per
  call from the compact scales and zeros, so it is workspace, not resident.
* ``fp8``: ``torch.float8_e4m3fn`` values with one fp32 scale per output channel: ``1 + 4 / in``
  (planner: 128x128 block scales, ``1 + 4 / 16384``). No CPU fp8 GEMM: dequantised to the
  activation dtype per call, then ``F.linear``.

Off CPU every kind dequantises and runs ``F.linear`` (the CPU kernels' packings are CPU-only).

KV cache (``quantize_kv`` / ``dequantize_kv``, used by the engine's cache): int8 (symmetric) or
fp8 e4m3, one fp16 scale per (token, head) vector, i.e. over the last dim (head_dim, or MLA's
latent): ``1 + 2 / head_dim`` bytes per element (``kv_bytes_per_element``). The planner's KV
figure (plan/cost/quant.py ``kv_bytes``) is 1.0 byte: the scales add 2 / head_dim to it (1.6% at
head_dim 128, 0.35% for DeepSeek-V3's 576-wide latent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modelcarve.spec.errors import LayoutError

WEIGHT_KINDS = ("int8", "int4", "fp8")
INT4_GROUPS = (32, 64, 128)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# --- quantisers (pure functions of a weight matrix) --------------------------------------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp16 scale [out]) with w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).half()
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values 0..15 int32 [out, in], fp16 scale [out, groups], zero 0..15 uint8 [out, groups])
    with w ~= (q - zero) * scale per group of ``group_size`` inputs (asymmetric, round to nearest)."""
    out, fan_in = w.shape
    g = w.float().view(out, fan_in // group_size, group_size)
    low, high = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)  # zero exactly representable
    scale = ((high - low) / 15.0).clamp(min=1e-12).half()
    s = scale.float()
    zero = torch.round(-low / s).clamp(0, 15)
    q = (torch.round(g / s[..., None]) + zero[..., None]).clamp(0, 15)
    return q.view(out, fan_in).to(torch.int32), scale, zero.to(torch.uint8)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], fp32 scale [out]) with w ~= q * scale[:, None]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _pack_nibbles(x: torch.Tensor) -> torch.Tensor:
    """uint8 [.., n] of values 0..15 -> [.., ceil(n / 2)], two per byte (low nibble first)."""
    if x.shape[-1] % 2:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)
    return x[..., 0::2] | (x[..., 1::2] << 4)


def _unpack_nibbles(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([x & 15, x >> 4], dim=-1).flatten(-2)[..., :n]


# --- the quantised linear layer -----------------------------------------------------------------


class QuantLinear(nn.Module):
    """``y = after(x W^T) + b`` with W stored as ``kind`` (see the module doc); inference only.
    ``after`` is the TP row-parallel reduction when this replaces a RowParallelLinear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, group_size: int = 128,
                 after=None):
        super().__init__()
        if kind not in WEIGHT_KINDS:
            raise LayoutError(f"weight_dtype={kind!r}: quantised kinds are {', '.join(WEIGHT_KINDS)}")
        self.out_features, self.in_features = weight.shape
        self.kind, self.group_size, self.after = kind, group_size, after
        w = weight.detach()
        if kind == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)
        elif kind == "fp8":
            q, scale = quantize_fp8(w)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)
        else:
            if group_size not in INT4_GROUPS or self.in_features % group_size:
                raise LayoutError(f"int4 group size {group_size} must be one of {INT4_GROUPS} and divide the "
                                  f"fan-in {self.in_features}; choose a group dividing it")
            q, scale, zero = quantize_int4(w, group_size)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), 2).to(w.device))
            self.register_buffer("scale", scale)
            self.register_buffer("zero", _pack_nibbles(zero))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _zeros(self) -> torch.Tensor:
        return _unpack_nibbles(self.zero, self.scale.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] as the GEMM sees it, in ``dtype``."""
        if self.kind in ("int8", "fp8"):
            return (self.qweight.float() * self.scale.float()[:, None]).to(dtype)
        # the packing is the CPU kernel's own (undocumented) layout: let the kernel unpack it
        eye = torch.eye(self.in_features)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight.cpu(), self.group_size,
                                                          self._scales_and_zeros(torch.float32).cpu())
        return w_t.t().to(device=self.qweight.device, dtype=dtype)

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """The int4 kernel's operand: w = (q - 8) * scale + z, so z = (8 - zero) * scale."""
        s = self.scale.float()
        z = (8.0 - self._zeros().float()) * s
        return torch.stack([s.t(), z.t()], dim=-1).to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x.device.type != "cpu" or self.kind == "fp8":
            y = F.linear(x2, self.dequantize(x.dtype))
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale.to(x.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size,
                                                            self._scales_and_zeros(x.dtype))
        y = y.view(*shape[:-1], self.out_features)
        if self.after is not None:
            y = self.after(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}{group}"


class QuantExperts(nn.Module):
    """Drop-in for moe.GroupedExperts (same ``forward(x, counts)``) with quantised expert matrices."""

    def __init__(self, experts: nn.Module, kind: str, group_size: int):
        super().__init__()
        self.num_experts, self.act = experts.num_experts, experts.act
        for name in ("w1", "w3", "w2"):
            stacked = getattr(experts, name).detach()
            setattr(self, name, nn.ModuleList(QuantLinear(w, None, kind, group_size) for w in stacked))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            if rows.shape[0]:
                outs.append(self.w2[e](self.act(self.w1[e](rows)) * self.w3[e](rows)))
            else:
                outs.append(rows)
        return torch.cat(outs) if outs else x[:0]


# --- swapping a model's layers ------------------------------------------------------------------


def _quantised(mod: nn.Module, kind: str, group_size: int) -> QuantLinear | None:
    if isinstance(mod, nn.Linear):
        return QuantLinear(mod.weight, mod.bias, kind, group_size)
    from modelcarve.runtime.parallel.tensor import RowParallelLinear, leave_region

    if isinstance(mod, RowParallelLinear):
        group, sp = mod.group, mod.sp
        return QuantLinear(mod.weight, mod.bias, kind, group_size, after=lambda y: leave_region(y, group, sp))
    return None


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str, group_size: int = 128) -> nn.Module:
    """Swap the attention and MLP matrices of every layer of ``model`` (a Transformer or a pipeline
    chunk, before or after TP) for ``QuantLinear`` of ``kind``, in place; returns ``model``.
    ``kind`` in ("fp32", "bf16", "fp16") leaves the model as it is."""
    if kind in ("fp32", "bf16", "fp16"):
        return model
    if kind not in WEIGHT_KINDS:
        raise LayoutError(f"weight_dtype={kind!r} cannot be executed by the runtime; use one of "
                          f"fp32, bf16, {', '.join(WEIGHT_KINDS)}")
    from modelcarve.runtime.model.moe import GroupedExperts

    for block in model.layers.values():
        if isinstance(getattr(block.feed_forward, "experts", None), GroupedExperts):
            block.feed_forward.experts = QuantExperts(block.feed_forward.experts, kind, group_size)
        for part in (block.attention, block.feed_forward):
            for name, mod in list(part.named_modules()):
                if not name or "router" in name.split("."):
                    continue
                new = _quantised(mod, kind, group_size)
                if new is not None:
                    owner, _, leaf = name.rpartition(".")
                    setattr(part.get_submodule(owner) if owner else part, leaf, new)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of every parameter and buffer of ``model`` (shared storages counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if hasattr(t, "to_local"):
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# --- KV-cache tensors ---------------------------------------------------------------------------

KV_KINDS = ("int8", "fp8")


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [..., d] int8 / float8_e4m3fn, fp16 scales [..., 1]): one scale per vector over the
    last dim (per token and head for k/v [.., heads, d]; per token for MLA's latent)."""
    if kind not in KV_KINDS:
        raise LayoutError(f"kv_dtype={kind!r}: quantised KV kinds are {', '.join(KV_KINDS)}")
    x = x.float()
    top = 127.0 if kind == "int8" else FP8_MAX
    scale = (x.abs().amax(dim=-1, keepdim=True) / top).clamp(min=1e-12).half()
    y = x / scale.float()
    if kind == "int8":
        return torch.round(y).clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def kv_bytes_per_element(kind: str, vector: int) -> float:
    """Stored bytes per KV element: the value byte plus the fp16 scale shared by ``vector`` elements."""
    if kind in KV_KINDS:
        return 1.0 + 2.0 / vector
    return {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[kind]
