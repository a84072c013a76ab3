"""ModelSpec: the architecture of a dense or mixture-of-experts decoder, and its exact counts.

Everything downstream (planner memory and FLOPs, runtime model construction) reads these
fields, so the parameter count here is tested to equal transformers' own count exactly for
every supported ``model_type`` (tests/test_spec_model.py).

Counting conventions
--------------------
* ``total_params``: every trainable parameter, as ``sum(p.numel() for p in model.parameters())``
  counts it in transformers (buffers such as DeepSeek's ``e_score_correction_bias`` excluded;
  the LM head counted once when it is tied to the embedding).
* ``active_params``: parameters a single token touches: ``total_params`` minus the routed
  experts it is not sent to (``num_experts - top_k`` per MoE layer).
* ``forward_flops_per_token(seq_len)``: ``2 * matmul_params_active + attention term``, where
  ``matmul_params_active`` is every weight matrix a token is multiplied by (attention and MLP
  projections, router, active experts, the LM head; not the input embedding lookup, norms or
  biases) and the attention term per layer is ``2 * ctx * heads * (qk_head_dim + v_head_dim)``
  (``Q K^T`` plus ``softmax(.) V``), with ``ctx = seq_len`` (Narayanan et al. 2021's
  convention, no causal halving) or ``seq_len / 2`` when ``causal=True``. For GPT-style
  models this reproduces Eq. 3 of Narayanan et al.: ``24 h^2 + 4 s h`` per layer per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from modelcarve.spec.errors import SpecError

FfnKind = Literal["swiglu", "gelu"]
NormKind = Literal["rmsnorm", "layernorm"]
PositionKind = Literal["rope", "learned", "alibi"]
AttentionKind = Literal["gqa", "mla"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, dense or MoE, by its dimensions (no weights)."""

    name: str
    """Catalogue name or the path it was read from."""
    family: str
    """Hugging Face ``model_type`` it was read as (llama, mistral, qwen2, qwen3, mixtral,
    qwen3_moe, deepseek_v3, gpt2; and spec/hf_models.py's gpt_oss, llama4, gemma3, deepseek_v2, phi3,
    nemotron, bloom, opt)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads: equal to ``num_heads`` for MHA, fewer for GQA, 1 for MQA."""
    head_dim: int
    """Per-head dimension of q, k and v for ``gqa`` attention (for MLA see the mla_ fields)."""
    ffn_kind: FfnKind = "swiglu"
    """``swiglu``: a gated MLP, ``down(act(gate x) * up x)``, three matrices (SwiGLU; also gemma3's
    gated GELU); ``gelu``: a two-matrix MLP, ``down(act(up x))`` (GELU; also OPT's ReLU and
    nemotron's squared ReLU). ``activation`` names the function."""
    activation: str = "silu"
    """Hugging Face activation name (silu for SwiGLU; gelu, gelu_new (tanh approximation) for GELU)."""
    ffn_size: int
    """Intermediate size of the dense MLP (and of dense layers of an MoE model)."""
    norm_kind: NormKind = "rmsnorm"
    norm_eps: float = 1e-6
    tied_embeddings: bool = False
    position_kind: PositionKind = "rope"
    max_position: int = 4096
    """Context the model was trained for; size of the table for learned positions."""
    rope_theta: float = 10000.0
    rope_interleave: bool = False
    """Rotary pairs are interleaved (x0,x1),(x2,x3)... rather than split halves (DeepSeek-V3)."""
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """Rotary scaling as sorted (key, value) pairs, resolved from config.json's ``rope_scaling`` /
    ``rope_parameters``: ``rope_type`` (linear, dynamic, yarn, llama3), ``factor`` and the type's own
    keys (``original_max_position_embeddings`` filled in as transformers does). Empty: plain rope."""
    sliding_window: int | None = None
    """Attention window in tokens on the layers of ``sliding_layers``: a query sees itself and the
    ``sliding_window - 1`` tokens before it (transformers' ``kv_idx > q_idx - sliding_window``)."""
    sliding_layers: tuple[int, ...] = ()
    """Layers that use ``sliding_window`` (mistral, mixtral: all; qwen2/qwen3: from ``max_window_layers``)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (qwen2, gpt2, llama with attention_bias)."""
    o_bias: bool = False
    """Bias on the attention output projection (gpt2, llama with attention_bias)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (qwen3, qwen3_moe)."""
    attention_kind: AttentionKind = "gqa"
    # --- mixture of experts -------------------------------------------------------------
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    """Routed experts each token is sent to."""
    num_shared_experts: int = 0
    """Always-on experts per MoE layer (DeepSeek-V3, Kimi K2)."""
    expert_ffn_size: int = 0
    """Intermediate size of one routed (and one shared) expert."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is an MoE block; the others are dense."""
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one."""
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    """Group-limited routing (DeepSeek-V3 ``n_group``): experts split into this many groups."""
    topk_groups: int = 1
    """Groups a token may route into (``topk_group``)."""
    # --- multi-head latent attention (DeepSeek-V3, Kimi K2) ------------------------------
    q_lora_rank: int | None = None
    """Rank of the compressed query (None: full q projection)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    source: str = ""
    """Where the dimensions come from (URL of the config.json or paper)."""
    # --- layers of the newer families (spec/hf_models.py; the runtime refuses them, spec/support.py)
    layer_norms: int = 2
    """Norms per decoder layer (gemma3: 4, pre and post both sub-blocks)."""
    embedding_norm: bool = False
    """A norm right after the token embedding (bloom's word_embeddings_layernorm)."""
    position_offset: int = 0
    """Extra rows of a learned position table (OPT: 2)."""
    attention_sinks: bool = False
    """One learned sink logit per head per layer in the softmax (gpt-oss)."""
    router_bias: bool = False
    """Bias on the MoE router (gpt-oss)."""
    partial_rotary_factor: float = 1.0
    """Share of each head's dims that rotary embedding rotates (nemotron: 0.5)."""
    attention_chunk: int | None = None
    """Chunked attention (llama4): a query sees only its own ``attention_chunk``-token chunk on ``chunked_layers``."""
    chunked_layers: tuple[int, ...] = ()
    expert_checkpoint_dtype: str = ""
    """dtype the released checkpoint stores routed experts in when not the rest's (gpt-oss: mxfp4)."""
    extra: dict = field(default_factory=dict, compare=False)
    """Facts that are not architecture (e.g. the published parameter count)."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SpecError(f"model {self.name!r}: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; GQA needs whole query groups per kv head"
            )
        if self.num_experts:
            if not 0 < self.top_k <= self.num_experts:
                raise SpecError(f"model {self.name!r}: top_k={self.top_k} must be in 1..{self.num_experts}")
            if self.expert_ffn_size <= 0:
                raise SpecError(f"model {self.name!r}: an MoE model needs expert_ffn_size > 0")
            if self.num_experts % self.num_expert_groups:
                raise SpecError(
                    f"model {self.name!r}: {self.num_experts} experts do not split into "
                    f"{self.num_expert_groups} groups"
                )
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if bad:
            raise SpecError(f"model {self.name!r}: moe_layers {bad} outside 0..{self.num_layers - 1}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise SpecError(f"model {self.name!r}: sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.attention_kind == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
            raise SpecError(f"model {self.name!r}: MLA needs kv_lora_rank, qk_rope_head_dim and v_head_dim")

    # --- shape facts ----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    @property
    def rope_parameters(self) -> dict:
        """``rope_scaling`` as a dict (empty for plain rope)."""
        return dict(self.rope_scaling)

    def attention_window(self, layer_id: int) -> int | None:
        """Sliding-window size of layer ``layer_id``, or None for full causal attention."""
        if layer_id in self.sliding_layers:
            return self.sliding_window
        return self.attention_chunk if layer_id in self.chunked_layers else None

    def is_moe_layer(self, index: int) -> bool:
        return index in self._moe_set

    @property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    @property
    def qk_head_dim(self) -> int:
        """Per-head dimension of q·k (MLA: nope + rope parts)."""
        if self.attention_kind == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.attention_kind == "mla" else self.head_dim

    @property
    def kv_cache_elems_per_token_per_layer(self) -> int:
        """Elements of KV cache one token adds to one layer (MLA: the compressed latent)."""
        if self.attention_kind == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    # --- parameter counts ---------------------------------------------------------------
    def _norm_params(self, dim: int) -> int:
        return dim * (2 if self.norm_kind == "layernorm" else 1)

    def _linear(self, fan_in: int, fan_out: int, bias: bool) -> int:
        return fan_in * fan_out + (fan_out if bias else 0)

    def ffn_params(self, size: int) -> int:
        """One MLP (dense or one expert) of intermediate ``size``."""
        h = self.hidden_size
        if self.ffn_kind == "swiglu":
            return 2 * self._linear(h, size, self.mlp_bias) + self._linear(size, h, self.mlp_bias)
        return self._linear(h, size, self.mlp_bias) + self._linear(size, h, self.mlp_bias)

    @property
    def attention_params(self) -> int:
        """One layer's attention block, its q/k norms included (not the pre-norm)."""
        h, nh = self.hidden_size, self.num_heads
        if self.attention_kind == "mla":
            bias = self.qkv_bias
            if self.q_lora_rank:
                q = (
                    self._linear(h, self.q_lora_rank, bias)
                    + self.q_lora_rank
                    + self.q_lora_rank * nh * self.qk_head_dim
                )
            else:
                q = h * nh * self.qk_head_dim
            kv = (
                self._linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias)
                + self.kv_lora_rank
                + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)
            )
            return q + kv + self._linear(nh * self.v_head_dim, h, self.o_bias)
        q_out, kv_out = nh * self.head_dim, self.num_kv_heads * self.head_dim
        params = (
            self._linear(h, q_out, self.qkv_bias)
            + 2 * self._linear(h, kv_out, self.qkv_bias)
            + self._linear(q_out, h, self.o_bias)
        )
        if self.qk_norm:
            params += 2 * self.head_dim
        if self.attention_sinks:
            params += nh
        return params

    @property
    def router_params(self) -> int:
        return self.num_experts * (self.hidden_size + (1 if self.router_bias else 0))

    @property
    def expert_params(self) -> int:
        """One routed expert."""
        return self.ffn_params(self.expert_ffn_size)

    @property
    def moe_block_params(self) -> int:
        """One MoE MLP block: router, all routed experts, shared experts."""
        return self.router_params + (self.num_experts + self.num_shared_experts) * self.expert_params

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + self.ffn_params(self.ffn_size) + self.layer_norms * self._norm_params(self.hidden_size)

    @property
    def moe_layer_params(self) -> int:
        return self.attention_params + self.moe_block_params + self.layer_norms * self._norm_params(self.hidden_size)

    @property
    def embedding_params(self) -> int:
        """Input token embedding (plus the learned position table)."""
        params = self.vocab_size * self.hidden_size
        if self.position_kind == "learned":
            params += (self.max_position + self.position_offset) * self.hidden_size
        if self.embedding_norm:
            params += self._norm_params(self.hidden_size)
        return params

    @property
    def lm_head_params(self) -> int:
        """Output projection; 0 when tied to the input embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.num_dense_layers * self.dense_layer_params
            + self.num_moe_layers * self.moe_layer_params
            + self._norm_params(self.hidden_size)
            + self.lm_head_params
        )

    @property
    def total_expert_params(self) -> int:
        """All routed-expert weights (the part expert parallelism shards)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        inactive = self.num_moe_layers * (self.num_experts - self.top_k) * self.expert_params
        return self.total_params - inactive

    # --- FLOPs --------------------------------------------------------------------------
    def _ffn_matmul(self, size: int) -> int:
        return (3 if self.ffn_kind == "swiglu" else 2) * self.hidden_size * size

    @property
    def attention_matmul_params(self) -> int:
        """Weights of one layer's attention projections (no biases, no norms)."""
        h, nh = self.hidden_size, self.num_heads
        if self.attention_kind == "mla":
            q = (
                h * self.q_lora_rank + self.q_lora_rank * nh * self.qk_head_dim
                if self.q_lora_rank
                else h * nh * self.qk_head_dim
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * nh * (
                self.qk_nope_head_dim + self.v_head_dim
            )
            return q + kv + nh * self.v_head_dim * h
        return h * (2 * nh * self.head_dim + 2 * self.num_kv_heads * self.head_dim)

    @property
    def matmul_params_active(self) -> int:
        """Weight-matrix elements one token is multiplied by in a forward pass."""
        dense_mlp = self._ffn_matmul(self.ffn_size)
        moe_mlp = self.router_params + (self.top_k + self.num_shared_experts) * self._ffn_matmul(self.expert_ffn_size)
        return (
            self.num_layers * self.attention_matmul_params
            + self.num_dense_layers * dense_mlp
            + self.num_moe_layers * moe_mlp
            + self.vocab_size * self.hidden_size
        )

    def attention_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Score and value FLOPs of all layers for one token attending to its context."""
        ctx = seq_len / 2 if causal else seq_len
        return 2.0 * ctx * self.num_heads * (self.qk_head_dim + self.attn_v_head_dim) * self.num_layers

    def forward_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Forward FLOPs per token: 2 x active matmul params + the attention term (see module doc)."""
        return 2.0 * self.matmul_params_active + self.attention_flops_per_token(seq_len, causal)

    # --- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["moe_layers"] = list(self.moe_layers)
        data.update(
            total_params=self.total_params,
            active_params=self.active_params,
            layers=self.num_layers,
            hidden=self.hidden_size,
            experts=self.num_experts,
        )
        return data

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)
