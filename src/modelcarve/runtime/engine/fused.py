"""The engine's packed and fused linears: ``PackedLinear`` (one packed weight copy: in the engine's
own kernels' layout, ``native.py``, where they are built here, else oneDNN's), and a llama-shaped
decoder block in a few ops (``FusedBlock``), both built once at load.

Per token, the reference block (runtime/model/transformer.py) runs about 45 small tensor ops and
7 linears through 11 ``nn.Module`` calls; at batch 1 the linears stream the weights and the
rest is host work (~2 ms a step on the ~110M llama of benchmarks/serve_vs_peers.py). For a
block the engine recognises (``fuse_blocks``), ``FusedBlock`` computes the same function with:

* one packed linear (``pack_weight``) for ``wq | wk | wv`` and one for ``w1 | w3`` (the weights
  concatenated along the output dimension, packed once; each output element is the same dot
  product as before), replacing the per-module ``PackedLinear`` copies (memory unchanged);
* rotary embedding applied to q and k together on the fused projection's rows
  (``x * cos + rotate_half(x) * sin``, element for element ``apply_rope``'s arithmetic) with
  the step's cos/sin computed once per step (``rope_table``: rows of a table made at load);
* the paged attention called on ``[T, heads, d]`` views (no per-layer transposes of k/v);
* RMSNorm with the reference's arithmetic (fp32 statistics, cast back, times the weight).

A block qualifies when it is the plain single-device llama/mistral/qwen2 shape: ``Attention``
with rope, no q/k norm, GQA paged attention installed, ``RMSNorm`` norms, a SwiGLU
``FeedForward``, every linear a ``PackedLinear`` (fp32 / bf16 on CPU), and no forward hooks
anywhere in it -- or the same block sharded by tensor parallelism without sequence parallelism:
its column shards packed (``PackedLinear``), its output projections ``PackedRowParallel`` (the
local shard packed, then the sum over the TP group, then the bias, as ``RowParallelLinear``), and
no hooks but TP's region pre-hooks on its attention and MLP (identity in the forward; recognised
by their ``tp_region`` mark). The fused block then reduces after ``wo`` and ``w2`` as the module
path does: the same collectives, in the same order. Every other block (MLA, MoE, GELU MLP,
LayerNorm, qk-norm, quantised linears, sequence parallelism) runs as before.
``MODELCARVE_ENGINE_FUSED=0`` turns the fused path off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from modelcarve.runtime.engine import native


MIN_ROWS = int(os.environ.get("MODELCARVE_ENGINE_MIN_ROWS", "4"))
"""Row count a packed linear runs at least (``packed_linear``): fewer rows are padded with zeros up
to it and the extra output rows dropped. oneDNN picks its kernel by the row count, and the kernels
for 1-2 rows stream a weight from memory slower than the one for 4: the ~97M llama's decode
linears (48 + the tied head, 388 MB fp32, each weight read once, as a decode step reads them;
one thread, quiet machine), milliseconds per sweep at 1 / 2 / 3 / 4 / 5 / 6 / 8 rows: fp32 28.0 /
32.8 / 24.9 / 23.4 / 23.2 / 23.1 / 30.2, bf16 15.3 / 17.1 / 14.3 / 13.9 / 13.8 / 13.9 / 17.3 (a
weight that stays in cache, timed alone, shows the opposite: 1 row faster). Each output row is
its own dot products (no row depends on another's), so the padding changes no real row beyond
the summation order of the kernel. ``MODELCARVE_ENGINE_MIN_ROWS=1`` turns it off."""


def pack_weight(weight: torch.Tensor):
    """A linear's weight packed once, at load: in the engine's own kernels' layout
    (``native.NativeWeight``: fp32, bf16) where they are built here, else oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``)."""
    weight = weight.detach()
    if native.NativeWeight.fits(weight) and native.available():
        return native.NativeWeight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed, bias) -> torch.Tensor:
    """``x W^T + b`` of a 2-D ``x`` through a weight ``pack_weight`` packed: the native kernel at any
    row count, oneDNN's at no fewer than ``MIN_ROWS`` rows."""
    if type(packed) is native.NativeWeight:
        return packed(x, bias)
    rows = x.shape[0]
    if 0 < rows < MIN_ROWS:
        pad = x.new_zeros(MIN_ROWS, x.shape[1])
        pad[:rows] = x
        return torch.ops.mkldnn._linear_pointwise(pad, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` (fp32 or bf16, CPU) with a second copy of its weight packed once, at load
    (``pack_weight``): for the native kernels where they are built (``native.py``: ~1.4x oneDNN's
    bf16 rate at 1-6 rows, ~1.3x fp32, as fast or faster up to 512 rows), else into oneDNN's
    blocked layout (``torch.ops.mkldnn._reorder_linear_weight``), run by
    ``torch.ops.mkldnn._linear_pointwise`` at every row count. Measured here (2 busy cores, one
    thread, the ~110M llama of benchmarks/serve_vs_peers.py): fp32 decode at 2..16 rows ~1.2-1.4x
    faster than the BLAS sgemm of ``F.linear``; fp32 batch-1 TPOT 25.3 -> 15.1 ms against BLAS gemv
    at one row (an isolated one-row gemv whose weight stays in cache looks as fast, but in the
    model the weights stream from memory, and the packed layout streams faster); bf16: ``F.linear``
    reorders the weight for oneDNN on every call, ~1.8-2.7x slower at 1..4 rows, ~1.5x at 16 (an
    avx512_bf16 CPU without AMX). Same ``x W^T + b`` up to summation order (fp32 accumulation both
    ways; bf16 output rounding)."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.out_features, self.in_features = lin.weight.shape
        self.packed = pack_weight(lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class PackedRowParallel(torch.nn.Module):
    """``parallel.tensor.RowParallelLinear`` (a TP rank's input-feature shard of a linear, then the
    reduction over the TP group, then the whole bias) with its shard packed as ``PackedLinear``
    packs: the reduction is the same ``leave_region`` call, so only the local GEMM's kernel changes
    (oneDNN's blocked layout instead of BLAS's ``F.linear``: at tp=2 the row-parallel ``wo`` / ``w2``
    of a 64-token prefill ran at ~70 GFLOP/s through BLAS, ~110 packed, here)."""

    def __init__(self, row):
        super().__init__()
        self.weight, self.bias, self.group, self.sp = row.weight, row.bias, row.group, row.sp
        self.out_features, self.in_features = row.weight.shape
        self.packed = pack_weight(row.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x.reshape(-1, self.in_features).contiguous(), self.packed, None)
        return _reduced(y.view(*x.shape[:-1], self.out_features), self.group, self.sp, self.bias)


def packable_dtypes() -> tuple:
    """The weight dtypes ``prepack_linears`` packs here: fp32 with oneDNN, bf16 too where oneDNN
    has bf16 kernels for this CPU (avx512bw/vl/dq or AMX; ``_is_mkldnn_bf16_supported``)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return ()
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def _packed_cat(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)])
    return pack_weight(weight), bias


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """runtime.model.transformer.RMSNorm.forward on [T, H] in one kernel (bit-equal to it here: fp32
    statistics, ``x * rsqrt(mean(x^2) + eps)`` rounded to the input dtype, then times the weight)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def _hooked(*mods) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for mod in mods for m in mod.modules())


def _tp_group(block):
    """The TP group of a block whose only hooks are tensor parallelism's region pre-hooks on its
    attention and MLP (``parallel.tensor._region_hook``, identity in the forward without sequence
    parallelism), both over one group, with no sequence parallelism; ``None`` for a block with no
    hooks at all; ``False`` for anything else (other hooks, sequence parallelism)."""
    attn, ffn = block.attention, block.feed_forward
    if not _hooked(block):
        return None
    regions = []
    for mod in block.modules():
        if mod._forward_hooks:
            return False
        for hook in mod._forward_pre_hooks.values():
            if mod not in (attn, ffn) or getattr(hook, "tp_region", None) is None:
                return False
            regions.append(hook.tp_region)
    if len(regions) != 2 or regions[0][0] is not regions[1][0] or any(sp for _, sp in regions):
        return False
    return regions[0][0]


def _row(mod):
    """(packed weight, bias, the reduction's group or None) of a block's output projection:
    ``PackedLinear`` (one rank) or ``PackedRowParallel`` (its bias added after the reduction)."""
    if type(mod) is PackedRowParallel:
        return mod.packed, mod.bias, mod.group
    return mod.packed, mod.bias, None


class FusedBlock:
    """One recognised TransformerBlock's forward on packed rows ``h [1, T, H]`` (see module doc)."""

    def __init__(self, block):
        attn, ffn = block.attention, block.feed_forward
        self.attn_norm, self.attn_eps = block.attention_norm.weight, block.attention_norm.eps
        self.ffn_norm, self.ffn_eps = block.ffn_norm.weight, block.ffn_norm.eps
        self.heads, self.kv_heads, self.d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.q_cols, self.k_cols = self.heads * self.d, self.kv_heads * self.d
        self.qkv = _packed_cat([attn.wq, attn.wk, attn.wv])
        self.wo = _row(attn.wo)
        self.ffn_size = ffn.w1.out_features
        self.w13 = _packed_cat([ffn.w1, ffn.w3])
        self.w2 = _row(ffn.w2)
        self.act = ffn.act
        self.paged = attn.kv_cache
        # the per-module packed copies of the fused linears are no longer used: drop them
        for owner, leaf in ((attn, "wq"), (attn, "wk"), (attn, "wv"), (ffn, "w1"), (ffn, "w3")):
            mod = getattr(owner, leaf)
            if type(mod) is PackedLinear:
                lin = torch.nn.Linear(1, 1, bias=mod.bias is not None)
                lin.in_features, lin.out_features = mod.in_features, mod.out_features
                lin.weight, lin.bias = mod.weight, mod.bias
                setattr(owner, leaf, lin)

    def __call__(self, h: torch.Tensor, rope) -> torch.Tensor:
        cos, sin = rope                                     # [T, d] each
        t = h.shape[1]
        x = h.view(t, -1)
        qkv = packed_linear(_rms(x, self.attn_norm, self.attn_eps), *self.qkv)   # [T, (heads + 2 kv) d]
        qk = qkv[:, :self.q_cols + self.k_cols].view(t, -1, self.d)
        half = self.d // 2
        rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos[:, None] + rot * sin[:, None]         # apply_rope, element for element
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        v = qkv[:, self.q_cols + self.k_cols:].view(t, -1, self.d)
        out = self.paged.packed(q, k, v)                    # [T, heads * d]
        x = x + _project(out, *self.wo)
        gu = packed_linear(_rms(x, self.ffn_norm, self.ffn_eps), *self.w13)
        x = x + _project(self.act(gu[:, :self.ffn_size]) * gu[:, self.ffn_size:], *self.w2)
        return x.view(1, t, -1)


def _project(x: torch.Tensor, packed: torch.Tensor, bias, group) -> torch.Tensor:
    """An output projection: the packed GEMM, then (TP) the sum over the group's ranks, as
    ``RowParallelLinear`` does (``leave_region``), then the whole bias."""
    if group is None:
        return packed_linear(x, packed, bias)
    return _reduced(packed_linear(x, packed, None), group, False, bias)


def _reduced(y: torch.Tensor, group, sp: bool, bias) -> torch.Tensor:
    """A row-parallel projection's local result summed over ``group`` (``RowParallelLinear``'s
    ``leave_region``), then its whole bias."""
    from modelcarve.runtime.parallel.tensor import leave_region

    out = leave_region(y, group, sp)
    return out if bias is None else out + bias


def _fusable(block) -> bool:
    from modelcarve.runtime.engine.paged_attention import PagedGQA
    from modelcarve.runtime.model.mlp import FeedForward
    from modelcarve.runtime.model.transformer import Attention, RMSNorm, TransformerBlock

    if type(block) is not TransformerBlock:
        return False
    attn, ffn = block.attention, block.feed_forward
    if not (type(attn) is Attention and attn.rope and attn.q_norm is None and type(attn.kv_cache) is PagedGQA
            and type(block.attention_norm) is RMSNorm and type(block.ffn_norm) is RMSNorm
            and type(ffn) is FeedForward and ffn.swiglu and ffn.act is F.silu
            and all(type(m) is PackedLinear for m in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3))
            and attn.wq.weight.dtype == attn.wk.weight.dtype == attn.wv.weight.dtype):
        return False
    group = _tp_group(block)
    if group is None:  # one rank: every linear whole
        return type(attn.wo) is PackedLinear and type(ffn.w2) is PackedLinear
    # tensor parallelism without sequence parallelism: the column shards fuse as whole linears do,
    # the row-parallel projections reduce over the blocks' own group
    return group is not False and all(type(m) is PackedRowParallel and m.group is group and not m.sp
                                      for m in (attn.wo, ffn.w2))


def fuse_blocks(chunk) -> list:
    """Per layer of ``chunk`` (in order): its ``FusedBlock`` where it qualifies, else the module."""
    if os.environ.get("MODELCARVE_ENGINE_FUSED", "1") == "0":
        return list(chunk.layers.values())
    return [FusedBlock(block) if _fusable(block) else block for block in chunk.layers.values()]


class RopeTable:
    """cos/sin rows for positions ``0 .. max_position - 1`` made once (``rope_cos_sin``'s
    arithmetic); ``None`` from ``make`` for rope types whose tables depend on the call (dynamic)."""

    def __init__(self, chunk, dtype: torch.dtype, device):
        from modelcarve.runtime.model.rope import rope_cos_sin

        pos = torch.arange(chunk.spec.max_position, device=device)
        self.cos, self.sin = rope_cos_sin(pos, chunk.rope_dim, chunk.spec, dtype)

    @classmethod
    def make(cls, chunk, dtype, device):
        if not getattr(chunk, "rope_dim", 0) or chunk.spec.rope_parameters.get("rope_type", "default") == "dynamic":
            return None
        return cls(chunk, dtype, device)

    def __call__(self, positions: torch.Tensor):
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
