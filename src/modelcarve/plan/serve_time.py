"""Serving time of one layout: prefill, decode step, TTFT, TPOT and output tokens/s.

Usage::

    from modelcarve.plan.serve_time import serve_time
    t = serve_time(model, cluster, tp=2, weight_dtype="fp8", batch=64, input_len=1000, output_len=1000)
    t.tpot_s, t.tokens_per_s_per_device

The model (all per device, the fullest pipeline stage):

* **Decode step** of ``b`` sequences on one stage is a roofline: bytes read (the stage's
  weights, with routed experts counted only when the batch touches them, the KV cache of
  ``b`` sequences at the mean decode context ``input + output/2``, and the activations each
  kernel reads and writes) over the achievable HBM
  bandwidth, against FLOPs over the achievable GEMM rate; the larger wins. Communication is
  added on top (decode collectives sit on the critical path): two TP all-reduces per layer of
  ``b x hidden`` bf16 values with a latency term (one-shot all-reduce inside a node, a tree
  across nodes: at batch 1 the alpha costs, not the bytes), an all-gather of the logits, two
  EP all-to-alls per MoE layer scaled by the load-imbalance factor, and a PP hand-off per stage.
* **Experts touched**: ``T`` tokens routed top-k over ``E`` uniform experts touch on average
  ``E (1 - (1 - k/E)^T)`` of them; with EP the ``ep`` attention groups decode in lockstep, so
  ``T = b x ep`` tokens reach each MoE layer and a rank reads that fraction of its experts.
* **Pipeline**: ``B`` sequences split into ``m = min(pp, B)`` micro-batches; one decode round
  (every sequence advances one token) takes ``max(m, pp)`` stage steps, so with fewer than
  ``pp`` micro-batches in flight the stages idle (bubble ``1 - m/pp``).
* **Prefill** of a prompt is compute-bound: forward FLOPs (causal attention) over the device's
  achievable GEMM rate (``plan.efficiency``), not below one read of the weights per chunk, plus
  its TP/EP/PP traffic. Stages run one after another for a single prompt.
* **TTFT** = the prompt's prefill, plus one decode round of the running batch when other
  requests are in flight (continuous batching admits a request at the next step).
* **TPOT** as a user sees it under continuous batching: the decode round plus the share of the
  other requests' prefills interleaved with it (each of the ``B`` sequences needs ``input``
  tokens of prefill per ``output`` tokens of decode; batched prefills pipeline over stages).
* **Throughput**: ``B / TPOT`` output tokens/s per attention group (``tp x pp`` devices); per
  model replica (``ep`` groups share experts); per device; and per cluster (``dp`` groups).

Achievable rates are the training planner's: ``plan.efficiency.HBM_EFFICIENCY`` of the
datasheet HBM bandwidth, ``matmul_efficiency`` of the dense peak of the dtype the GEMMs run in
(fp8 for fp8 weights, int8 for W8A8, bf16 for W4A16 int4; ``plan.quant``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from modelcarve.plan import comm
from modelcarve.plan.efficiency import HBM_EFFICIENCY, TILE, matmul_efficiency, peak_fraction
from modelcarve.plan.quant import weight_format
from modelcarve.plan.serve_memory import ACT_BYTES, MOE_IMBALANCE, PREFILL_CHUNK, ShardFacts, shard_facts
from modelcarve.spec.hardware import ClusterSpec
from modelcarve.spec.model import ModelSpec

def gemm_efficiency(device, m: float, n: float, k: float, dtype: str) -> float:
    """Achievable fraction of the ``dtype`` dense peak for an (m x k) @ (k x n) GEMM (the
    training planner's model, ``plan.efficiency``)."""
    return matmul_efficiency(device, max(1.0, m), max(1.0, n), max(1.0, k), dtype)


def tp_all_reduce_s(size_bytes: float, n: int, tier: comm.Tier) -> float:
    """All-reduce of a small activation: the cheapest of NCCL's ring, a one-shot / two-shot
    all-reduce inside a node (every rank reads its peers' buffers through NVSwitch, as vLLM's
    and TensorRT-LLM's custom all-reduce do: 2 or 4 latency steps instead of 2(n-1)) and a
    tree across nodes (2 log2 n latency steps)."""
    if n <= 1:
        return 0.0
    ring = comm.all_reduce_s(size_bytes, n, tier)
    bw = 2.0 * (n - 1) / n * size_bytes / tier.bytes_per_s
    if tier.name == "intra":
        one_shot = 2 * tier.latency_s + (n - 1) * size_bytes / tier.bytes_per_s
        two_shot = 4 * tier.latency_s + bw
        return min(ring, one_shot, two_shot)
    tree = 2 * math.ceil(math.log2(n)) * tier.latency_s + bw
    return min(ring, tree)


def device_dtype(device, dtype: str) -> str:
    """The dtype GEMMs really run in on ``device``: fp8 falls back to bf16 where the device has
    no fp8 tensor cores (A100: fp8 weights are dequantised, W8A16)."""
    return dtype if dtype in device.peak_flops or dtype == "int4" else "bf16"


def experts_touched_fraction(tokens: float, top_k: int, num_experts: int) -> float:
    """Expected fraction of ``num_experts`` that ``tokens`` tokens routed top-k (uniformly) touch."""
    if num_experts <= 0:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


@dataclass(frozen=True, kw_only=True)
class ServeTime:
    """Latency and throughput of one serving layout at one concurrency (seconds, tokens/s)."""

    batch: int
    """Sequences in flight per attention group (tp x pp devices)."""
    prefill_s: float
    """One prompt's prefill, alone."""
    ttft_s: float
    decode_step_s: float
    """One decode round: every sequence of the batch advances one token (no prefills)."""
    tpot_s: float
    """Time per output token a user sees: the decode round plus interleaved prefills."""
    tokens_per_s: float
    """Output tokens/s of one model replica (tp x pp x ep devices)."""
    tokens_per_s_per_device: float
    tokens_per_s_cluster: float
    bound: str
    """What the decode step is limited by: 'memory', 'compute' or 'communication'."""
    bubble: float
    """Fraction of a decode round pipeline stages sit idle."""
    weights_read_bytes: float
    """Weight bytes one device reads per decode step (routed experts: only those touched)."""
    decode_parts: dict
    """Seconds of one decode round: memory, compute, tp, ep, pp."""
    comm: dict
    """Per axis: link tier, seconds added to each decode round, bytes per device per round."""

    def to_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "batch": self.batch,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tokens_per_s_cluster": self.tokens_per_s_cluster,
            "prefill_s": self.prefill_s,
            "decode_step_s": self.decode_step_s,
            "bound": self.bound,
            "bubble": self.bubble,
            "decode_parts_s": dict(self.decode_parts),
        }


@dataclass(frozen=True, kw_only=True)
class _Ctx:
    """Everything of a layout that does not depend on the batch."""

    model: ModelSpec
    f: ShardFacts
    tp: int
    pp: int
    ep: int
    dp: int
    hbm: float
    peak: float
    device: object
    compute_dtype: str
    attn_peak: float
    """Achievable FLOP/s of attention kernels (bf16 tensor cores at the device's large-GEMM fraction)."""
    tier_tp: comm.Tier
    tier_ep: comm.Tier
    tier_pp: comm.Tier
    input_len: int
    output_len: int
    attn_flops_per_ctx: float
    """Decode attention FLOPs per token per context token on this device (fullest stage)."""
    prefill_s: float = 0.0
    """One prompt's prefill alone (TTFT without queueing)."""
    prefill_token_s: float = 0.0
    """Seconds of batched, pipelined prefill per prompt token (throughput cost of admissions)."""


_CTX: dict[tuple, _Ctx] = {}


def _context(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len) -> _Ctx:
    key = (id(model), id(cluster), tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len)
    ctx = _CTX.get(key)
    if ctx is not None and ctx.model is model:
        return ctx
    f = shard_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    device = cluster.device
    heads_rank = model.num_heads / tp
    if model.attention_kind == "mla":
        # vLLM/SGLang decode MLA in the absorbed form: scores and values over the latent.
        per_head = (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    else:
        per_head = model.qk_head_dim + model.attn_v_head_dim
    ctx = _Ctx(
        model=model,
        f=f,
        tp=tp,
        pp=pp,
        ep=ep,
        dp=dp,
        hbm=device.hbm_bytes_per_s * HBM_EFFICIENCY,
        peak=device.flops(device_dtype(device, weight_format(weight_dtype).compute_dtype)),
        device=device,
        compute_dtype=device_dtype(device, weight_format(weight_dtype).compute_dtype),
        attn_peak=device.flops("bf16") * peak_fraction(device),
        tier_tp=comm.group_tier(cluster, tp, 1),
        tier_ep=comm.group_tier(cluster, ep, tp),
        tier_pp=comm.group_tier(cluster, pp, tp * dp),
        input_len=input_len,
        output_len=output_len,
        attn_flops_per_ctx=2.0 * heads_rank * per_head * f.stage_layers,
    )
    batch_tokens = max(input_len, PREFILL_CHUNK)
    ctx = dataclasses.replace(
        ctx,
        prefill_s=_prefill_s(ctx, input_len, input_len),
        prefill_token_s=_prefill_s(ctx, batch_tokens, input_len) / batch_tokens / pp,
    )
    if len(_CTX) > 100_000:
        _CTX.clear()
    _CTX[key] = ctx
    return ctx


def _stage_step(c: _Ctx, b: int) -> tuple[float, dict, float, dict]:
    """One stage's decode step for ``b`` sequences: seconds, parts, weight bytes read, comm."""
    m, f = c.model, c.f
    h = m.hidden_size
    mean_ctx = c.input_len + c.output_len / 2.0
    expert_all = f.stage_moe_layers * f.experts_per_rank * f.expert_bytes
    weights_read = f.weights_bytes - f.embed_bytes - expert_all
    gemm_flops = 2.0 * b * f.matmul_params_per_token
    if f.stage_moe_layers:
        touched = experts_touched_fraction(b * c.ep, m.top_k, m.num_experts)
        weights_read += expert_all * touched
        # Tokens x experts landing on the busiest rank: b x ep x k / ep x imbalance.
        pairs = b * m.top_k * (MOE_IMBALANCE if c.ep > 1 else 1.0)
        gemm_flops += 2.0 * pairs * f.expert_matmul_params * f.stage_moe_layers
    # Kernels run one after another, so each class has its own roofline and the times add:
    # GEMMs (weights vs FLOPs), attention (KV cache vs score/value FLOPs), element-wise
    # kernels (activation traffic). At small batches the GEMMs are memory-bound GEMVs and the
    # compute term is far below the weight read; it matters only for batches of hundreds.
    eff = gemm_efficiency(c.device, max(b, TILE), h / c.tp * 4, h, c.compute_dtype)
    gemm_mem = weights_read / c.hbm
    gemm_cmp = gemm_flops / (c.peak * eff)
    kv_read = b * mean_ctx * f.kv_bytes_per_token
    attn_mem = kv_read / c.hbm
    attn_cmp = b * mean_ctx * c.attn_flops_per_ctx / c.attn_peak
    elem = b * f.act_traffic_per_token / c.hbm
    mem_s = max(gemm_mem, gemm_cmp) + max(attn_mem, attn_cmp) + elem
    memory_part = gemm_mem + attn_mem + elem
    compute_part = gemm_cmp + attn_cmp
    act = b * h * ACT_BYTES
    tp_s = 2 * f.stage_layers * tp_all_reduce_s(act, c.tp, c.tier_tp)
    tp_bytes = 2 * f.stage_layers * comm.ring_all_reduce_bytes(act, c.tp)
    if c.tp > 1:
        logits = b * m.vocab_size * ACT_BYTES
        tp_s += comm.all_gather_s(logits, c.tp, c.tier_tp)
        tp_bytes += comm.all_gather_bytes(logits, c.tp)
    ep_s = ep_bytes = 0.0
    if c.ep > 1 and f.stage_moe_layers:
        size = b * m.top_k * h * ACT_BYTES * MOE_IMBALANCE
        ep_s = 2 * f.stage_moe_layers * comm.all_to_all_s(size, c.ep, c.tier_ep)
        ep_bytes = 2 * f.stage_moe_layers * comm.all_to_all_bytes(size, c.ep)
    pp_s = comm.p2p_s(act, c.tier_pp) if c.pp > 1 else 0.0
    step = mem_s + tp_s + ep_s + pp_s
    parts = {"roofline": mem_s, "memory": memory_part, "compute": compute_part, "tp": tp_s, "ep": ep_s, "pp": pp_s}
    comm_bytes = {"tp": tp_bytes, "ep": ep_bytes, "pp": act if c.pp > 1 else 0.0}
    return step, parts, weights_read, comm_bytes


def _prefill_s(c: _Ctx, tokens: int, prompt_len: int) -> float:
    """Prefill of ``tokens`` tokens of prompts ``prompt_len`` long, through all stages in turn."""
    m, f = c.model, c.f
    h = m.hidden_size
    chunk = min(tokens, PREFILL_CHUNK)
    chunks = math.ceil(tokens / chunk)
    # Per-token FLOPs on one device of a stage; stages run in turn, so x pp for the whole model.
    heads_rank = m.num_heads / c.tp
    attn = 2.0 * (prompt_len / 2.0) * heads_rank * (m.qk_head_dim + m.attn_v_head_dim) * f.stage_layers
    per_tok = 2.0 * f.matmul_params_per_token + attn
    if f.stage_moe_layers:
        per_tok += 2.0 * m.top_k * (MOE_IMBALANCE if c.ep > 1 else 1.0) * f.expert_matmul_params * f.stage_moe_layers
    eff = gemm_efficiency(c.device, chunk, h / c.tp * 4, h, c.compute_dtype)
    compute_s = tokens * per_tok / (c.peak * eff)
    read_s = chunks * (f.weights_bytes - f.embed_bytes) / c.hbm
    act = chunk * h * ACT_BYTES
    comm_s = chunks * 2 * f.stage_layers * tp_all_reduce_s(act, c.tp, c.tier_tp)
    if c.ep > 1 and f.stage_moe_layers:
        size = chunk * m.top_k * h * ACT_BYTES * MOE_IMBALANCE
        comm_s += chunks * 2 * f.stage_moe_layers * comm.all_to_all_s(size, c.ep, c.tier_ep)
    stage = max(compute_s, read_s) + comm_s
    hops = (c.pp - 1) * chunks * comm.p2p_s(act, c.tier_pp) if c.pp > 1 else 0.0
    return c.pp * stage + hops


def serve_time(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int = 1,
    input_len: int = 2048,
    output_len: int = 256,
) -> ServeTime:
    """TTFT, TPOT and throughput of one layout with ``batch`` sequences per attention group."""
    c = _context(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len)
    return _serve_time(c, batch)


def _serve_time(c: _Ctx, batch: int) -> ServeTime:
    batch = max(1, int(batch))
    micro = min(c.pp, batch)
    b = math.ceil(batch / micro)
    step, parts, weights_read, comm_bytes = _stage_step(c, b)
    slots = max(micro, c.pp)
    round_s = slots * step
    bubble = 1.0 - micro / c.pp if c.pp > 1 else 0.0
    prefill = c.prefill_s
    # Batched prefills of the replacement requests (chunks of many prompts) pipeline over stages.
    interleaved = batch * c.input_len * c.prefill_token_s / c.output_len
    tpot = round_s + interleaved
    ttft = prefill + (round_s if batch > 1 else 0.0)
    group = batch / tpot
    devices = c.tp * c.pp
    comm_parts = parts["tp"] + parts["ep"] + parts["pp"]
    roof = parts["roofline"]
    bound = "communication" if comm_parts > roof else ("memory" if parts["memory"] >= parts["compute"] else "compute")
    round_parts = {k: v * slots for k, v in parts.items()}
    comm_info = {
        "tp": {"tier": c.tier_tp.name, "s_per_round": round_parts["tp"], "bytes_per_round": comm_bytes["tp"] * slots} if c.tp > 1 else None,
        "ep": {"tier": c.tier_ep.name, "s_per_round": round_parts["ep"], "bytes_per_round": comm_bytes["ep"] * slots} if c.ep > 1 else None,
        "pp": {"tier": c.tier_pp.name, "s_per_round": round_parts["pp"], "bytes_per_round": comm_bytes["pp"] * slots} if c.pp > 1 else None,
    }
    return ServeTime(
        batch=batch,
        prefill_s=prefill,
        ttft_s=ttft,
        decode_step_s=round_s,
        tpot_s=tpot,
        tokens_per_s=group * c.ep,
        tokens_per_s_per_device=group / devices,
        tokens_per_s_cluster=group * c.dp,
        bound=bound,
        bubble=bubble,
        weights_read_bytes=weights_read,
        decode_parts=round_parts,
        comm={k: v for k, v in comm_info.items() if v is not None},
    )
