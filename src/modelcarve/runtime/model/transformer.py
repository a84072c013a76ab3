"""The single-device reference decoder, built from a ModelSpec, in plain PyTorch.

Every layout is checked against this model, and each parallelism is applied to it by its own
module (tensor.py, pipeline.py, expert.py, context.py, data_parallel.py) without editing this
file: this file never imports torch.distributed. It computes what Hugging Face's llama,
mistral, qwen2, qwen3, gpt2 and deepseek_v3 (MLA) models compute on the same weights
(tests/runtime/test_runtime_checkpoint.py compares logits); MoE blocks come from moe.py, the dense MLP
from mlp.py, rotary frequencies from rope.py. It imports no module of the runtime but those three.

Structure (torchtitan-like, so parallelisms can find their pieces by name)::

    Transformer
      tok_embeddings  nn.Embedding | None     (None on pipeline stages after the first)
      pos_embeddings  nn.Embedding | None     (learned positions, gpt2)
      layers          nn.ModuleDict "0".."L-1" (stages delete entries; keys stay checkpoint FQNs)
        TransformerBlock: attention_norm, attention (Attention | MLAttention), ffn_norm,
                          feed_forward (FeedForward | MoE)
      norm, output    | None                  (on the last stage only)

Usage::

    from modelcarve.spec.catalog import get_model
    from modelcarve.runtime.model.transformer import build_model
    model = build_model(get_model("tiny-llama"), seed=0)
    logits = model(torch.randint(0, 256, (2, 16)))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modelcarve.runtime.model.mlp import FeedForward
from modelcarve.runtime.model.moe import MoE
from modelcarve.runtime.model.rope import rope_cos_sin, rope_scale_softmax
from modelcarve.spec.model import ModelSpec

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Hugging Face's llama family does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    dim = dim or spec.hidden_size
    if spec.norm_kind == "layernorm":
        return nn.LayerNorm(dim, eps=spec.norm_eps)
    return RMSNorm(dim, spec.norm_eps)


# --- rotary embeddings (frequencies and tables: rope.py) ------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, d] by position; ``interleave`` first de-interleaves pairs."""
    if interleave:
        b, h, s, d = x.shape
        x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return x * cos + _rotate_half(x) * sin


# --- attention --------------------------------------------------------------------------


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [.., q, k] mask, True where a query may attend a key: causal (``k <= q``) and, with a
    sliding ``window``, ``k > q - window`` (itself and window - 1 before it, as transformers)."""
    q, k = q_positions[..., :, None], k_positions[..., None, :]
    allowed = k <= q
    return allowed & (k > q - window) if window is not None else allowed


class CoreAttention(nn.Module):
    """Causal softmax(q k^T * scale) v, over a sliding ``window`` when the layer has one. Context
    parallelism swaps this module for ring attention.

    q [b, heads, s, d_qk]; k [b, kv_heads, s_k, d_qk]; v [b, kv_heads, s_k, d_v]; GQA expands k/v.
    ``mask`` (from ``attention_mask``; e.g. a KV cache's query vs cached positions) replaces the
    default: the causal (windowed) mask of q and k at positions 0..s-1.
    """

    def __init__(self, scale: float, window: int | None = None):
        super().__init__()
        self.scale, self.window = scale, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is None and (self.window is None or q.shape[2] <= self.window):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        if mask is None:
            pos = torch.arange(q.shape[2], device=q.device)
            mask = attention_mask(pos, pos, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


class Attention(nn.Module):
    """Multi-head attention with grouped kv heads (MHA, GQA, MQA), optional q/k norm (qwen3).
    ``kv_cache`` (None: attend within the call) is a callable the generation engine installs
    (runtime/engine/paged_attention.py): ``(q, k, v) -> out`` over its paged KV cache."""

    kv_cache = None

    def __init__(self, spec: ModelSpec, layer_id: int = 0):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.rope = spec.position_kind == "rope"
        self.wq = nn.Linear(h, self.n_heads * d, bias=spec.qkv_bias)
        self.wk = nn.Linear(h, self.n_kv_heads * d, bias=spec.qkv_bias)
        self.wv = nn.Linear(h, self.n_kv_heads * d, bias=spec.qkv_bias)
        self.wo = nn.Linear(self.n_heads * d, h, bias=spec.o_bias)
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.core_attention = CoreAttention(1.0 / math.sqrt(d), spec.attention_window(layer_id))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: TP shards the projections and rewrites n_heads/n_kv_heads to local counts.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core_attention(q, k, v) if self.kv_cache is None else self.kv_cache(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention (the naive, non-absorbed form HF computes).
    ``kv_cache`` (the engine's, runtime/engine/paged_attention.py) caches the normalised latent and the
    rotated k_rot: ``(attn, q, latent, k_rot) -> out``."""

    kv_cache = None

    def __init__(self, spec: ModelSpec, layer_id: int = 0):
        super().__init__()
        h, nh = spec.hidden_size, spec.num_heads
        self.n_heads = self.n_kv_heads = nh
        self.nope, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.qk_dim = self.nope + self.rope_dim
        self.kv_lora_rank = spec.kv_lora_rank
        self.interleave = spec.rope_interleave
        if spec.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=spec.qkv_bias)
            self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, nh * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(h, nh * self.qk_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=spec.qkv_bias)
        self.kv_norm = RMSNorm(self.kv_lora_rank, spec.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(nh * self.v_dim, h, bias=spec.o_bias)
        self.core_attention = CoreAttention(self.qk_dim**-0.5 * rope_scale_softmax(spec), spec.attention_window(layer_id))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(b, s, -1, self.qk_dim).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        kv_a = self.wkv_a(x)
        latent, k_rot = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rot = k_rot.view(b, 1, s, self.rope_dim)
        cos, sin = rope
        q_rot = apply_rope(q_rot, cos, sin, self.interleave)
        k_rot = apply_rope(k_rot, cos, sin, self.interleave)
        if self.kv_cache is not None:
            out = self.kv_cache(self, torch.cat((q_pass, q_rot), dim=-1), latent, k_rot)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))
        kv = self.wkv_b(latent).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.expand(-1, k_pass.shape[1], -1, -1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot), dim=-1)
        out = self.core_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


# --- block -------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(spec)
        self.attention = (MLAttention if spec.attention_kind == "mla" else Attention)(spec, layer_id)
        self.ffn_norm = make_norm(spec)
        self.is_moe = spec.is_moe_layer(layer_id)
        self.feed_forward = MoE(spec) if self.is_moe else FeedForward(spec)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole decoder (or, after a pipeline split, one stage of it; see module doc)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.tok_embeddings = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings = nn.Embedding(spec.max_position, h) if spec.position_kind == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.num_layers)})
        self.norm = make_norm(spec)
        self.output = nn.Linear(h, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if spec.position_kind == "rope":
            self.rope_dim = spec.qk_rope_head_dim if spec.attention_kind == "mla" else spec.head_dim
        else:
            self.rope_dim = 0

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if not self.rope_dim:
            return None
        return rope_cos_sin(positions, self.rope_dim, self.spec, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
        else:
            h = x
        rope = self.rope(positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic init in module-registration order: matrices and embeddings N(0, 0.02),
    biases 0, norm weights 1 (MoE blocks may define ``init_weights(generator)`` themselves)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seen: set[int] = set()
    for module in model.modules():
        if hasattr(module, "init_weights") and module is not model:
            module.init_weights(gen)
            seen.update(id(p) for p in module.parameters())
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                param.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias" or param.dim() == 1:
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def build_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """The reference model with deterministic weights (same spec + seed -> same weights)."""
    model = Transformer(spec)
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype)
