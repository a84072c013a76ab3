"""Serving memory per device: weights at their stored dtype, KV cache, workspace, and how many
sequences fit.

A serving layout (the same ``Layout`` the training planner uses) cuts one model copy into
``tp x pp`` devices: every layer split ``tp`` ways, layers split into ``pp`` stages as the
runtime splits them (spec/stages.py: the embedding and the LM head weigh one layer each on the
first and last stage, so 126 layers on pp=16 give [7] + [8] * 14 + [7]). ``dp``
such copies serve requests side by side. With ``ep > 1`` the routed experts of ``ep`` copies
are pooled and sharded over them (attention stays data-parallel: the DeepSeek / SGLang "DP
attention + EP" arrangement), so ``ep`` must divide ``dp`` as the Layout requires.

Per device (the heaviest pipeline stage):

* weights: layer matrices at the weight dtype's bytes, scales included (``plan.quant``); the
  embedding, LM head, router and norms in bf16. Attention and MLP matrices split by ``tp``,
  except what cannot be split: GQA k/v projections are replicated when ``tp > kv heads``, and
  MLA's down-projections (q_a, kv_a) are replicated on every TP rank. Routed experts are split
  ``ep`` ways (whole experts) and then ``tp`` ways (each expert's matrices); shared experts only
  ``tp`` ways. With redundant experts (EPLB, ``Layout.redundant_experts = R``) the layer holds
  ``E + R`` physical experts and each EP rank ``(E + R) / ep`` of them (DeepSeek-V3 with 32
  redundant over EP72: 288 / 72 = 4 per rank, as many as 256 / 64 without). The embedding and head are vocabulary-parallel over ``tp``, on the first and last
  stage.
* KV cache per token: ``layers on the stage x elems per layer per rank x kv dtype bytes``;
  GQA holds ``max(1, kv_heads / tp)`` heads of k and v per rank, MLA holds the whole
  compressed latent (``kv_lora_rank + qk_rope_head_dim``) on every TP rank (it has no head axis
  to split; vLLM and SGLang replicate it).
* workspace: the transient activations of one layer for a prefill chunk (flash attention, so no
  seq x seq scores; for MoE also the permuted per-expert copies of each token's hidden state,
  in and out) plus fp32 logits for every sequence in the batch.
* runtime: a fixed 1 GiB for the CUDA context, cuBLAS/NCCL buffers and captured graphs.
* budget: the engine's rule (``MemoryRule``). ``device`` (the default; vLLM's
  ``gpu_memory_utilization``, 0.90): the server may use that fraction of the device, weights,
  workspace and runtime included, so the KV cache gets what is left of it. ``free``
  (TensorRT-LLM's ``KvCacheConfig.free_gpu_memory_fraction``, 0.90): the KV cache gets that
  fraction of the memory still free once the weights are loaded and the activations profiled,
  so the margin is 10% of that remainder, not of the device. With the same fraction ``free``
  gives the KV cache ``(1 - fraction) x (weights + runtime + workspace)`` more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelcarve.plan.cost.quant import kv_bytes, weight_format
from modelcarve.spec.model import ModelSpec
from modelcarve.spec.stages import rank_holdings

GiB = 2**30
RUNTIME_BYTES = 1 * GiB
"""CUDA context, cuBLAS workspace, NCCL buffers and captured CUDA graphs: an assumption of the
order serving engines report at startup, not a measurement."""
MEMORY_FRACTION = 0.90
"""Share of device memory the server may use (vLLM's default gpu_memory_utilization)."""
KV_MEMORY_RULES = ("device", "free")


@dataclass(frozen=True)
class MemoryRule:
    """How a serving engine sizes its KV cache: ``fraction`` of the whole ``device`` (vLLM's
    ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``: weights and KV together within
    it), or of the memory ``free`` after the weights, runtime and profiled activations
    (TensorRT-LLM's ``kv_cache_config.free_gpu_memory_fraction``, default 0.90; trtllm-bench's
    ``--kv_cache_free_gpu_mem_fraction``)."""

    fraction: float = MEMORY_FRACTION
    of: str = "device"

    def budget(self, memory_bytes: float, fixed_bytes: float) -> float:
        """Bytes the server may use on a device of ``memory_bytes`` whose weights, runtime and
        workspace take ``fixed_bytes``: all of it the engine's KV cache may grow into, plus the fixed part."""
        if self.of == "free":
            return fixed_bytes + self.fraction * max(0.0, memory_bytes - fixed_bytes)
        return self.fraction * memory_bytes

    def options(self) -> dict:
        """The serving options that select this rule (``ServeOptions.kv_memory`` / ``memory_fraction``)."""
        return {"kv_memory": self.of, "memory_fraction": self.fraction}


DEVICE_RULE = MemoryRule()
"""The default rule: 90% of the device (vLLM's default)."""
ENGINE_MEMORY_RULES = {
    "vllm": DEVICE_RULE,
    "trtllm": MemoryRule(0.90, "free"),
}
"""Each engine's own rule at its defaults. vLLM: ``--gpu-memory-utilization`` 0.9 of the whole device
(EngineArgs). TensorRT-LLM: ``KvCacheConfig.free_gpu_memory_fraction`` 0.9 of the memory free after the
model is loaded and its activations profiled ("TensorRT LLM will try to allocate 90% of free GPU memory for
KV cache": nvidia.github.io/TensorRT-LLM/examples/kvcacheconfig.html; trtllm-bench's
``--kv_cache_free_gpu_mem_fraction``; its
perf-overview page used 0.9 by default and 0.95 in many runs). ``plan --engine`` / ``--emit-launch`` and
the calibration against published runs (plan/serve/calibration.py) price each engine with its own.
SGLang's ``mem_fraction_static`` is a share of the device too, but its default depends on the GPU's
memory; it is not listed (the device rule at 0.9 applies)."""
ENGINE_KV_MEMORY = {**{engine: rule.of for engine, rule in ENGINE_MEMORY_RULES.items()}, "sglang": "device"}
"""The kind of rule each serving engine implements, whatever its fraction (a plan for one of them is not
priced with the other kind): the listed engines' own, and SGLang's share of the device."""
PREFILL_CHUNK = 8192
"""Tokens per prefill chunk (chunked prefill; TensorRT-LLM's default max_num_tokens per step)."""
MOE_IMBALANCE = 1.25
"""Default tokens on the busiest expert-parallel rank over the mean (the straggler factor). An
assumption, the same default as the training planner's ``load_imbalance``; serving goals take
``--load-imbalance`` for time (this default sizes the MoE prefill workspace). The runtime
measures the real per-expert token counts."""
ACT_BYTES = 2.0
"""Activations and all-to-all payloads are bf16."""


@dataclass(frozen=True, kw_only=True)
class ServeMemory:
    """Bytes on the fullest device of one serving layout at a batch and context."""

    weights_bytes: float
    kv_bytes_per_token: float
    """KV-cache bytes one token of context adds on this device."""
    kv_bytes: float
    """KV cache for ``batch`` sequences of ``context`` tokens."""
    workspace_bytes: float
    runtime_bytes: float
    budget_bytes: float
    """What the server may use (``MemoryRule.budget``): by default 0.90 x device memory."""
    batch: int
    context: int
    max_sequences: int
    """Sequences of ``context`` tokens that fit beside the weights (0: not even one)."""

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes + self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {
            "weights_gib": self.weights_bytes / GiB,
            "kv_cache_gib": self.kv_bytes / GiB,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "workspace_gib": self.workspace_bytes / GiB,
            "runtime_gib": self.runtime_bytes / GiB,
            "total_gib": self.total_bytes / GiB,
            "budget_gib": self.budget_bytes / GiB,
            "batch": self.batch,
            "context": self.context,
            "max_sequences": self.max_sequences,
            "fits": self.fits,
        }


@dataclass(kw_only=True, slots=True)
class ShardFacts:
    """Per-device quantities of one (model, tp, pp, ep, weight dtype, kv dtype): everything that
    does not depend on batch or context, computed once and reused across a batch sweep."""

    weights_bytes: float
    """Heaviest stage's weights on one device."""
    dense_layer_bytes: float
    """One dense layer's weights on one device (attention + MLP + norms)."""
    attn_layer_bytes: float
    """One layer's attention weights on one device."""
    expert_bytes: float
    """One routed expert's weights on one device (after the tp split)."""
    shared_moe_bytes: float
    """One MoE layer's non-routed weights on one device (attention, router, shared experts, norms)."""
    experts_per_rank: int
    """Routed experts (redundant replicas included) on one EP rank: ``(E + R) / ep``."""
    stage_layers: int
    """Layers on the fullest stage."""
    stage_moe_layers: int
    """MoE layers on that stage."""
    head_bytes: float
    """Embedding / LM-head weights on the fullest stage."""
    embed_bytes: float
    """Of those, the input embedding table (a decode step reads only its batch's rows)."""
    matmul_params_per_token: float
    """Weight elements one token is multiplied by on this device, routed experts excluded
    (attention, dense MLP, router, shared experts, LM head on the last stage)."""
    expert_matmul_params: float
    """Weight elements of one routed expert on this device (after the tp split)."""
    kv_bytes_per_token: float
    """Per device, for the fullest stage."""
    kv_elems_per_token_layer: int
    """KV elements one token adds to one layer on one device."""
    kv_windows: tuple = ()
    """(layers, window tokens) of the fullest stage's windowed layers (sliding window: gemma3's 5 of 6
    local layers, gpt-oss's alternate layers; llama4's chunked-attention layers): their KV holds at
    most ``window`` tokens of a sequence (engines free the blocks that fall out of the window).
    Layer counts are the model-wide share times the stage's layers (the patterns interleave evenly)."""
    act_bytes_per_token: float
    """Transient activation bytes per prefill token (one layer live at a time)."""
    logits_bytes_per_seq: float
    act_traffic_per_token: float
    """HBM bytes of activations read and written per token by the fullest stage's kernels
    (every GEMM reads its input and writes its output; fused norm + residual read and write
    the hidden state three times; the SwiGLU activation reads 2 x ffn and writes ffn):
    ``(10 h + 2 q + 2 kv + 6 ffn) x 2 bytes`` per layer, ffn/q/kv per TP rank."""
    head_matmul_params: float = 0.0
    """Of ``matmul_params_per_token``, the LM head's (``vocab x hidden / tp`` on the last stage, else 0):
    a prefill runs only each prompt's last row through it (the row that samples)."""
    physical_experts: int = 0
    """Routed experts per MoE layer over the EP group, redundant replicas included (``E + R``)."""
    tied_head_bytes: float = 0.0
    """Bytes the LM head reads per decode step that ``weights_bytes`` does not hold as a head: a tied
    head (one stage) is the embedding table, counted once as ``embed_bytes``, yet every step's
    logits read it whole as a GEMV (``vocab x hidden / tp`` elements); 0 otherwise."""


_FACTS: dict[tuple, tuple] = {}


def shard_facts(model: ModelSpec, *, tp: int, pp: int = 1, ep: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                expert_dtype: str = "", redundant_experts: int = 0, stage: int | None = None) -> ShardFacts:
    """``expert_dtype``: the routed experts' dtype when not ``weight_dtype`` (gpt-oss's released
    MXFP4 experts: ``released_expert_dtype``); "" for all layer matrices in ``weight_dtype``.
    ``redundant_experts``: EPLB replicas (``Layout.redundant_experts``), each EP rank holding
    ``(E + R) / ep`` routed experts. ``stage``: the facts of that distinct stage kind
    (``stage_kind_counts``' order) instead of the fullest stage's."""
    # Keyed by object identity, with the model kept in the entry so the id cannot be reused.
    key = (id(model), tp, pp, ep, weight_dtype, kv_dtype, expert_dtype, redundant_experts, stage)
    held = _FACTS.get(key)
    if held is None or held[0] is not model:
        if len(_FACTS) > 100_000:
            _FACTS.clear()
        held = _FACTS[key] = (model, _compute_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                                    expert_dtype=expert_dtype, redundant_experts=redundant_experts,
                                                    stage=stage))
    return held[1]


def stage_kind_counts(model: ModelSpec, pp: int) -> tuple[int, ...]:
    """How many pipeline stages each distinct stage kind (``shard_facts(stage=k)``) stands for."""
    holdings = rank_holdings(model.num_layers, pp, 1, model._moe_set)
    found = [(count, n_moe, stage == 0, stage == pp - 1) for stage, (count, n_moe) in enumerate(holdings)]
    return tuple(found.count(kind) for kind in _stage_kinds(model, pp))


def released_expert_dtype(model: ModelSpec, weight_dtype: str) -> str:
    """The routed experts' dtype when a model's checkpoint ships them narrower than ``weight_dtype``
    (gpt-oss: MXFP4 experts, the rest bf16): that released dtype, else "" (the experts follow
    ``weight_dtype``). Storing a released 4-bit expert wider adds bytes and no accuracy, so the
    serving planner's default sizes the experts as released (plan/serve/options.py)."""
    released = getattr(model, "expert_checkpoint_dtype", "")
    if not released or not model.is_moe:
        return ""
    h = model.hidden_size
    if weight_format(released).bytes_per_param(h) < weight_format(weight_dtype).bytes_per_param(h):
        return released
    return ""


def served_expert_dtype(model: ModelSpec, weight_dtype: str, released_experts: bool) -> str:
    """The one rule every serving goal sizes routed experts by (serve-latency, serve-throughput,
    serve-disagg, ``--pareto``): as the checkpoint ships them (``released_expert_dtype``) unless the
    user named the weight dtypes (``ServeOptions.released_experts`` False), then ``weight_dtype``
    ("")."""
    return released_expert_dtype(model, weight_dtype) if released_experts else ""


class _TpCounts:
    """Elements on one TP rank of one layer's parts (dtype-independent), cached per (model, tp)."""

    __slots__ = ("attn_q", "attn_p", "norm_p", "dense_q", "expert_q", "expert_p", "router_p", "embed_p", "head_p",
                 "final_p", "kv_elem", "q_out", "act_elems", "traffic_fixed", "ffn_traffic", "moe_ffn_traffic")


_TP: dict[tuple, tuple] = {}
_STAGES: dict[tuple, tuple] = {}


def _tp_counts(model: ModelSpec, tp: int) -> _TpCounts:
    key = (id(model), tp)
    held = _TP.get(key)
    if held is not None and held[0] is model:
        return held[1]
    c = _TpCounts()
    h, nh = model.hidden_size, model.num_heads
    if model.attention_kind == "mla":
        qr, kvr, rope = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
        # Down-projections (q_a, kv_a) have no head axis: every TP rank holds them whole.
        replicated = (h * qr if qr else 0) + h * (kvr + rope)
        split = (qr if qr else h) * nh * model.qk_head_dim + kvr * nh * (model.qk_nope_head_dim + model.v_head_dim)
        split += nh * model.v_head_dim * h
        c.attn_q = replicated + split / tp
        c.attn_p = (qr or 0) + kvr
        c.kv_elem = model.kv_cache_elems_per_token_per_layer
    else:
        hd = model.head_dim
        kv_heads_rank = max(1, model.num_kv_heads // tp)  # replicated when tp > kv heads
        c.attn_q = 2 * h * nh * hd / tp + 2 * h * kv_heads_rank * hd
        bias = (nh * hd / tp + 2 * kv_heads_rank * hd if model.qkv_bias else 0) + (h if model.o_bias else 0)
        c.attn_p = bias + (2 * hd if model.qk_norm else 0) + (nh / tp if model.attention_sinks else 0)
        c.kv_elem = 2 * kv_heads_rank * hd
    ffn_mats = 3 if model.ffn_kind == "swiglu" else 2
    c.norm_p = model.layer_norms * model._norm_params(h)
    c.dense_q = ffn_mats * h * model.ffn_size / tp
    c.expert_q = ffn_mats * h * model.expert_ffn_size / tp if model.is_moe else 0.0
    # Expert biases (gpt-oss: gate/up and down of every expert), attention sinks and a router bias.
    c.expert_p = ((ffn_mats - 1) * model.expert_ffn_size / tp + h) if (model.is_moe and model.mlp_bias) else 0.0
    c.router_p = model.router_params  # (its bias included)
    c.embed_p = model.vocab_size * h / tp + (model.max_position * h if model.position_kind == "learned" else 0)
    c.head_p = model.vocab_size * h / tp
    c.final_p = model._norm_params(h)
    c.q_out = nh * model.qk_head_dim / tp
    mlp_inter = model.ffn_size / tp
    if model.is_moe:
        mlp_inter = max(mlp_inter, MOE_IMBALANCE * (model.top_k + model.num_shared_experts) * model.expert_ffn_size / tp)
    c.act_elems = 3 * h + 2 * c.q_out + c.kv_elem + ffn_mats * mlp_inter
    if model.is_moe:
        # A fused MoE kernel holds each token's hidden state once per routed expert on the way
        # in (permuted copy) and on the way out (before the weighted sum over top-k).
        c.act_elems += 2 * MOE_IMBALANCE * model.top_k * h
    c.traffic_fixed = 10 * h + 2 * c.q_out + 2 * c.kv_elem
    c.ffn_traffic = model.ffn_size / tp
    c.moe_ffn_traffic = (model.top_k + model.num_shared_experts) * model.expert_ffn_size / tp if model.is_moe else 0.0
    _TP[key] = (model, c)
    return c


def _stage_kinds(model: ModelSpec, pp: int) -> tuple:
    """Distinct stages of a ``pp``-way split: (layers, MoE layers, holds embedding, holds head),
    the runtime's split (spec/stages.py: the embedding and the head count one layer each)."""
    key = (id(model), pp)
    held = _STAGES.get(key)
    kinds = held[1] if held is not None and held[0] is model else None
    if kinds is None:
        holdings = rank_holdings(model.num_layers, pp, 1, model._moe_set)
        found = [(count, n_moe, stage == 0, stage == pp - 1) for stage, (count, n_moe) in enumerate(holdings)]
        kinds = tuple(dict.fromkeys(found))
        _STAGES[key] = (model, kinds)
    return kinds


_WEIGHTS: dict[tuple, tuple] = {}


def _weight_side(model: ModelSpec, tp: int, pp: int, ep: int, weight_dtype: str, expert_dtype: str = "",
                 redundant_experts: int = 0) -> tuple:
    """What ``_compute_facts`` needs that does not depend on the KV dtype, memoised (the search
    asks for both KV dtypes of every weight dtype): the TP counts, per-layer bytes, and each
    distinct stage's weights (routed experts in ``expert_dtype`` when given)."""
    key = (id(model), tp, pp, ep, weight_dtype, expert_dtype, redundant_experts)
    held = _WEIGHTS.get(key)
    if held is not None and held[0] is model:
        return held[1]
    c = _tp_counts(model, tp)
    q = weight_format(weight_dtype).bytes_per_param(model.hidden_size)
    pb = 4.0 if weight_dtype == "fp32" else 2.0  # unquantised parts (embeddings, head, norms, router, biases)
    small = pb * (c.attn_p + c.norm_p)
    dense_layer = q * (c.attn_q + c.dense_q) + small
    shared_expert = q * c.expert_q + pb * c.expert_p
    qe = weight_format(expert_dtype).bytes_per_param(model.hidden_size) if expert_dtype else q
    expert = qe * c.expert_q + pb * c.expert_p  # a routed expert
    # EPLB: the E + R physical experts (R redundant replicas) split whole over the ep ranks
    experts_per_rank = (model.num_experts + redundant_experts) // ep if model.is_moe else 0
    shared_moe = q * c.attn_q + small + pb * c.router_p + model.num_shared_experts * shared_expert
    moe_layer = shared_moe + experts_per_rank * expert
    embed = pb * c.embed_p
    head = pb * c.head_p if (not model.tied_embeddings or pp > 1) else 0.0
    final_norm = pb * c.final_p
    stages = []
    for count, n_moe, first, last in _stage_kinds(model, pp):
        extra = (embed if first else 0.0) + (head + final_norm if last else 0.0)
        weights = (count - n_moe) * dense_layer + n_moe * moe_layer + extra
        stages.append((weights, count, n_moe, extra, first, last))
    side = (c, q, pb, dense_layer, expert, experts_per_rank, shared_moe, embed, tuple(stages))
    if len(_WEIGHTS) > 100_000:
        _WEIGHTS.clear()
    _WEIGHTS[key] = (model, side)
    return side


def _compute_facts(model: ModelSpec, *, tp: int, pp: int, ep: int, weight_dtype: str, kv_dtype: str, expert_dtype: str = "",
                   redundant_experts: int = 0, stage: int | None = None) -> ShardFacts:
    c, q, pb, dense_layer, expert, experts_per_rank, shared_moe, embed, stages = _weight_side(
        model, tp, pp, ep, weight_dtype, expert_dtype, redundant_experts)
    kv_layer = c.kv_elem * kv_bytes(kv_dtype)

    best = None
    if stage is not None:
        best = (0.0,) + stages[stage]
    for weights, count, n_moe, extra, first, last in (stages if stage is None else ()):
        # The fullest stage bounds memory; ties broken by KV (the part that grows with batch).
        rank = weights + count * kv_layer * 4096
        if best is None or rank > best[0]:
            best = (rank, weights, count, n_moe, extra, first, last)
    _, weights, count, n_moe, extra, first, last = best
    mm_tok = count * c.attn_q + (count - n_moe) * c.dense_q + n_moe * (c.router_p + model.num_shared_experts * c.expert_q)
    if last:
        mm_tok += c.head_p
    # Every field assigned here, without the generated __init__ (matching 17 keyword
    # arguments is a third of this function's time; it runs once per candidate layout).
    facts = object.__new__(ShardFacts)
    facts.weights_bytes = weights
    facts.dense_layer_bytes = dense_layer
    facts.attn_layer_bytes = q * c.attn_q + pb * c.attn_p
    facts.expert_bytes = expert
    facts.shared_moe_bytes = shared_moe
    facts.experts_per_rank = experts_per_rank
    facts.physical_experts = model.num_experts + redundant_experts if model.is_moe else 0
    facts.stage_layers = count
    facts.stage_moe_layers = n_moe
    facts.head_bytes = extra
    facts.embed_bytes = embed if first else 0.0
    facts.matmul_params_per_token = mm_tok
    facts.expert_matmul_params = c.expert_q
    facts.kv_bytes_per_token = count * kv_layer
    facts.kv_elems_per_token_layer = c.kv_elem
    facts.kv_windows = _kv_windows(model, count)
    facts.act_bytes_per_token = ACT_BYTES * c.act_elems
    facts.logits_bytes_per_seq = 4.0 * model.vocab_size / tp
    facts.act_traffic_per_token = ACT_BYTES * (count * c.traffic_fixed + 6 * ((count - n_moe) * c.ffn_traffic + n_moe * c.moe_ffn_traffic))
    facts.head_matmul_params = c.head_p if last else 0.0
    facts.tied_head_bytes = pb * c.head_p if (last and model.tied_embeddings and pp == 1) else 0.0
    return facts


def _kv_windows(model: ModelSpec, count: int) -> tuple:
    out = []
    for layers, window in ((model.sliding_layers, model.sliding_window), (model.chunked_layers, model.attention_chunk)):
        if layers and window:
            out.append((count * len(layers) / model.num_layers, window))
    return tuple(out)


def kv_seq_bytes(f: ShardFacts, context: float) -> float:
    """KV-cache bytes of one sequence of ``context`` tokens on this device, windowed layers capped."""
    full = f.kv_bytes_per_token * context
    if not f.kv_windows:
        return full
    per_layer = f.kv_bytes_per_token / f.stage_layers
    for layers, window in f.kv_windows:
        if window < context:
            full -= layers * per_layer * (context - window)
    return full


def serve_memory(
    model: ModelSpec,
    memory_bytes: float,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int = 1,
    context: int = 2048,
    prefill_chunk: int = PREFILL_CHUNK,
    rule: MemoryRule = DEVICE_RULE,
    expert_dtype: str = "",
    redundant_experts: int = 0,
) -> ServeMemory:
    """Memory of the fullest device for ``batch`` sequences of ``context`` tokens each."""
    f = shard_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype, expert_dtype=expert_dtype,
                    redundant_experts=redundant_experts)
    return memory_from_facts(f, memory_bytes, batch=batch, context=context, prefill_chunk=prefill_chunk, rule=rule)


def memory_from_facts(
    f: ShardFacts,
    memory_bytes: float,
    *,
    batch: int,
    context: int,
    prefill_chunk: int = PREFILL_CHUNK,
    rule: MemoryRule = DEVICE_RULE,
) -> ServeMemory:
    chunk = min(prefill_chunk, context)
    workspace = chunk * f.act_bytes_per_token + batch * f.logits_bytes_per_seq
    fixed = _fixed_bytes(f, chunk)
    budget = rule.budget(memory_bytes, fixed)
    max_seqs = _sequences_in(f, budget - fixed, context)
    return ServeMemory(
        weights_bytes=f.weights_bytes,
        kv_bytes_per_token=f.kv_bytes_per_token,
        kv_bytes=kv_seq_bytes(f, context) * batch,
        workspace_bytes=workspace,
        runtime_bytes=RUNTIME_BYTES,
        budget_bytes=budget,
        batch=batch,
        context=context,
        max_sequences=max_seqs,
    )


def max_sequences(f: ShardFacts, memory_bytes: float, context: int, prefill_chunk: int = PREFILL_CHUNK,
                  rule: MemoryRule = DEVICE_RULE) -> int:
    """Sequences of ``context`` tokens that fit (``memory_from_facts(...).max_sequences``, without
    building the record: the search calls this for every candidate)."""
    fixed = _fixed_bytes(f, min(prefill_chunk, context))
    return _sequences_in(f, rule.budget(memory_bytes, fixed) - fixed, context)


def _fixed_bytes(f: ShardFacts, chunk: int) -> float:
    """What a device holds whatever the batch: the weights, the runtime, one prefill chunk's activations."""
    return f.weights_bytes + RUNTIME_BYTES + chunk * f.act_bytes_per_token


def _sequences_in(f: ShardFacts, free_bytes: float, context: int) -> int:
    """Sequences of ``context`` tokens (KV cache and logits each) that fit in ``free_bytes``."""
    per_seq = kv_seq_bytes(f, context) + f.logits_bytes_per_seq
    return max(0, math.floor(free_bytes / per_seq)) if per_seq > 0 else 0


def min_devices(
    model: ModelSpec,
    memory_bytes: float,
    *,
    weight_dtype: str,
    kv_dtype: str = "bf16",
    context: int,
    batch: int = 1,
    max_devices: int = 1024,
    expert_dtype: str = "",
) -> int | None:
    """Fewest devices (tp up to the kv-head/heads limits, then pp) that hold the model and
    ``batch`` sequences of ``context`` tokens; None if even ``max_devices`` do not."""
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if model.num_heads % t == 0 and model.ffn_size % t == 0]
    best = None
    for tp in tps:
        pp = 1
        while tp * pp <= max_devices and pp <= model.num_layers:
            mem = serve_memory(model, memory_bytes, tp=tp, pp=pp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, batch=batch, context=context,
                               expert_dtype=expert_dtype)
            if mem.fits:
                if best is None or tp * pp < best:
                    best = tp * pp
                break
            pp *= 2
    return best
