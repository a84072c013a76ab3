"""The batch-independent costs of one serving layout, computed once and shared.

``layout_costs(...)`` gives a layout's ``LayoutCosts``: everything its decode step and prefills
need that does not depend on the batch (weights read, per-sequence GEMM/attention/element-wise
seconds, link tiers, the collectives as affine functions of the batch). What the eight weight/KV dtype
variants of one mesh share (tiers, FLOPs per token, collectives, the dtype-independent half of
both prefills) is one ``_Mesh``. Both are memoised (a search builds hundreds of thousands);
``clear_caches`` forgets them. time.py turns a ``LayoutCosts`` and a batch into TTFT, TPOT
and tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from modelcarve.plan.cost import comm
from modelcarve.plan.serve import rates as serve_rates
from modelcarve.plan.cost.quant import weight_format
from modelcarve.plan.serve.ep import ep_round_trip_s
from modelcarve.plan.serve.memory import ACT_BYTES, MOE_IMBALANCE, PREFILL_CHUNK, ShardFacts, kv_seq_bytes, shard_facts
from modelcarve.plan.serve.rates import (
    _attn_peak,
    _device_key,
    _eff_parts,
    _tier,
    device_dtype,
    tp_all_reduce_s,
)
from modelcarve.spec.hardware import ClusterSpec
from modelcarve.spec.model import ModelSpec

@dataclass(kw_only=True, slots=True)
class LayoutCosts:
    """Everything of a layout that does not depend on the batch (filled in by ``layout_costs``; the
    prefill figures on first use)."""

    model: ModelSpec
    cluster: ClusterSpec
    f: ShardFacts
    tp: int
    pp: int
    ep: int
    dp: int
    hbm: float
    """Achievable HBM bytes/s."""
    peak: float
    """Dense FLOP/s of the dtype the GEMMs run in."""
    device: object
    compute_dtype: str
    attn_peak: float
    """Achievable FLOP/s of attention kernels (bf16 tensor cores at the device's large-GEMM fraction)."""
    tier_tp: comm.Tier
    tier_ep: comm.Tier
    tier_pp: comm.Tier
    input_len: int
    output_len: int
    imbalance: float
    """Busiest EP rank's routed tokens over the mean."""
    mean_ctx: float
    """Mean context of a decoding sequence: input + output / 2 tokens."""
    attn_flops_per_ctx: float
    """Decode attention FLOPs per token per context token on this device (fullest stage)."""
    weights_fixed: float
    """Weight bytes every decode step reads (all but the routed experts and the embedding)."""
    experts_all: float
    """Routed-expert bytes on this device (read in the fraction the batch touches)."""
    n_gemm: float
    """n of the representative decode/prefill GEMM (the MLP up-projection on one TP rank)."""
    k_gemm: float = 0.0
    """GEMM FLOPs per sequence of the batch per decode step."""
    k_attn: float = 0.0
    """Attention seconds per sequence per step (KV read or score FLOPs, whichever is slower)."""
    k_elem: float = 0.0
    """Element-wise kernel seconds per sequence per step (activation traffic)."""
    k_attn_elem: float = 0.0
    """k_attn + k_elem."""
    expert_miss: float = 1.0
    """Probability one routed token misses a given expert: 1 - top_k / experts."""
    eff_key: tuple = ()
    """(device, n, k, dtype) of the representative GEMM, for the efficiency memo."""
    effs: dict | None = None
    """That GEMM's efficiency by rows m (shared by every layout with the same ``eff_key``)."""
    eff_parts: tuple = ()
    """Its efficiency's factors that do not depend on m (``_eff_parts``)."""
    comm_lines: tuple = ()
    """Per axis ('tp', 'ep', 'pp'): (count, pieces, floor, extra): ``count`` collectives per
    step, each taking the cheapest of the affine ``pieces`` (latency s, s per sequence) but no
    less than ``floor``, plus an ``extra`` affine term (tp: the logits all-gather)."""
    fixed_s: float = 0.0
    """Per-layer fixed overhead of the stage's decode step (``serve_rates.layer_overhead_s`` x layers)."""
    step_s: float = 0.0
    """Fixed seconds of every engine step (decode round or prefill chunk), once per step, not per
    stage: ``serve_rates.engine_step_s`` (the probed host overhead and the plan broadcast)."""
    seq_host_s: float = 0.0
    """Host seconds per sequence per engine step, a floor under the stage step
    (``serve_rates.ENGINE_SEQ_HOST_S``; 0 on a probed device, whose measured host costs stand instead)."""
    prefill_s: float = -1.0
    """One prompt's prefill alone (TTFT without queueing); -1 until first needed."""
    prefill_token_s: float = -1.0
    """Seconds of batched prefill per prompt token through all stages (not pipelined)."""
    dtypes: tuple = ()
    """(weight, KV, expert dtype, redundant experts): what ``layout_costs`` was asked, to cost the other stages."""
    walk_s: float = -1.0
    """One sequence's decode step through every pipeline stage in turn (time.py ``walk_s``); -1 until needed."""
    mesh: "_Mesh | None" = None
    """The dtype-independent costs this layout shares with its other dtype variants."""


_CTX: dict[tuple, LayoutCosts] = {}


@dataclass(kw_only=True, slots=True)
class _Mesh:
    """What a layout's costs share with every weight/KV dtype variant of the same mesh, request
    shape and fullest stage (the search scores eight dtype variants per mesh): link tiers,
    per-token FLOPs, collectives, and the dtype-independent half of both prefills."""

    tier_tp: comm.Tier
    tier_ep: comm.Tier
    tier_pp: comm.Tier
    hbm: float
    attn_peak: float
    mean_ctx: float
    attn_flops_per_ctx: float
    n_gemm: float
    k_gemm: float
    """2 x non-expert matmul params per token (the dense part of ``LayoutCosts.k_gemm``)."""
    k_gemm_experts: float
    """What the routed experts add to ``k_gemm`` (when the stage holds any)."""
    k_elem: float
    expert_miss: float
    fixed_s: float
    step_s: float
    comm_lines: tuple
    prefill_parts: tuple
    """For (one prompt alone, a full batch of prefill tokens): (tokens, chunk, chunks, GEMM FLOPs per
    token, collective seconds, pipeline hop seconds, attention FLOPs per token); see time.py ``_prefill_from``."""
    gemm: dict
    """weight dtype -> (compute dtype, its dense peak FLOP/s, the decode GEMM's efficiency key and
    its efficiency-by-rows memo)."""
    prefills: dict
    """(compute dtype, weight bytes read per chunk) -> (prefill_s, prefill_token_s)."""
    head_read: float = 0.0
    """Bytes the LM head adds to a step's weight read beyond ``weights_bytes - embed_bytes`` (a tied
    head's GEMV over the embedding table, ``ShardFacts.tied_head_bytes``), and whether a prefill runs
    the head on each prompt's last row only (``head_last_row``): both measured-engine terms, on
    probed devices (``serve_rates.achieved``) only -- the GPU-fitted constants were fitted without them."""
    head_last_row: bool = False


_MESH: dict[tuple, _Mesh] = {}
_LINES: dict[tuple, tuple] = {}


def clear_caches() -> None:
    """Forget every memoised serving cost (after changing a fitted constant; benchmarks start cold)."""
    from modelcarve.plan.serve import memory as serve_memory

    for cache in (serve_memory._FACTS, serve_memory._TP, serve_memory._STAGES, serve_memory._WEIGHTS, _CTX, _MESH,
                  serve_rates._EFF_CACHE, _LINES, serve_rates._TIER_CACHE, serve_rates._ATTN_PEAK, serve_rates._EFF_BY_SHAPE):
        cache.clear()


def layout_costs(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len,
                 imbalance: float = MOE_IMBALANCE, f: ShardFacts | None = None, expert_dtype: str = "",
                 redundant_experts: int = 0, stage: int | None = None) -> LayoutCosts:
    """The batch-independent costs of one layout, memoised (``f``: its ``shard_facts``, when the
    caller has them already; ``expert_dtype``: the routed experts' dtype when not ``weight_dtype``;
    ``redundant_experts``: EPLB replicas, ``Layout.redundant_experts``).

    Redundant experts are priced in what they change for certain: each rank holds and reads
    ``(E + R) / ep`` experts (memory, and the expert weights a decode step reads, with routing
    spread uniformly over the ``E + R`` physical experts: ``expert_miss = 1 - top_k / (E + R)``),
    while every token still goes to ``top_k`` experts (the all-to-all bytes do not change).
    What EPLB is for, a lower load on the busiest rank, is NOT modelled from R: no published
    figure gives the busiest-rank factor as a function of the replicas in text (the SGLang team's
    large-scale EP blog, 2025-05-05, plots simulated "balancedness", mean over max tokens per GPU,
    with and without EPLB only as a figure; its table gives prefill at 50,302 tokens/s per node with
    the default expert placement vs 59,337 with simulated perfect EPLB, an end-to-end figure, not
    an imbalance). ``imbalance`` (``--load-imbalance``) stays as given: set it to the balance the
    deployment's EPLB reaches (vLLM logs it with ``log_balancedness``).

    ``stage``: the costs of that distinct stage kind (serve_memory.stage_kind_counts' order) rather
    than the fullest stage's; time.py walks a lone sequence through every stage with them."""
    key = (id(model), id(cluster), tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len, imbalance, expert_dtype,
           serve_rates.ENGINE_SEQ_HOST_S, redundant_experts, stage)
    ctx = _CTX.get(key)
    if ctx is not None and ctx.model is model and ctx.cluster is cluster:
        return ctx
    if f is None:
        f = shard_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype, expert_dtype=expert_dtype,
                        redundant_experts=redundant_experts, stage=stage)
    mesh = _mesh(model, cluster, tp, pp, ep, dp, f, input_len, output_len, imbalance)
    device = cluster.device
    gemm = mesh.gemm.get(weight_dtype)
    if gemm is None:
        compute_dtype = device_dtype(device, weight_format(weight_dtype).compute_dtype)
        eff_key = (_device_key(device, compute_dtype), mesh.n_gemm, model.hidden_size)
        held = serve_rates._EFF_BY_SHAPE.get(eff_key)
        if held is None:
            held = serve_rates._EFF_BY_SHAPE[eff_key] = ({}, _eff_parts(device, compute_dtype, mesh.n_gemm, model.hidden_size))
        peak = device.flops(compute_dtype) * (serve_rates.FP4_GEMM_FRACTION if compute_dtype == "fp4" else 1.0)
        gemm = mesh.gemm[weight_dtype] = (compute_dtype, peak, eff_key) + held
    compute_dtype, peak, eff_key, effs, eff_parts = gemm
    experts_all = f.stage_moe_layers * f.experts_per_rank * f.expert_bytes
    k_gemm = mesh.k_gemm
    if experts_all:
        # Tokens x experts landing on the busiest rank: b x ep x k / ep x imbalance.
        k_gemm += mesh.k_gemm_experts
    # KV read per step: windowed layers read at most their window (serve_memory.kv_seq_bytes)
    k_attn = max(kv_seq_bytes(f, mesh.mean_ctx) / mesh.hbm, mesh.mean_ctx * mesh.attn_flops_per_ctx / mesh.attn_peak)
    # Every field assigned here, without the generated __init__: matching 34 keyword
    # arguments costs more than the rest of this function (once per candidate layout).
    ctx = object.__new__(LayoutCosts)
    ctx.model = model
    ctx.cluster = cluster
    ctx.f = f
    ctx.tp = tp
    ctx.pp = pp
    ctx.ep = ep
    ctx.dp = dp
    ctx.hbm = mesh.hbm
    ctx.peak = peak
    ctx.device = device
    ctx.compute_dtype = compute_dtype
    ctx.attn_peak = mesh.attn_peak
    ctx.tier_tp = mesh.tier_tp
    ctx.tier_ep = mesh.tier_ep
    ctx.tier_pp = mesh.tier_pp
    ctx.input_len = input_len
    ctx.output_len = output_len
    ctx.imbalance = imbalance
    ctx.mean_ctx = mesh.mean_ctx
    ctx.attn_flops_per_ctx = mesh.attn_flops_per_ctx
    ctx.weights_fixed = f.weights_bytes - f.embed_bytes + mesh.head_read - experts_all
    ctx.experts_all = experts_all
    ctx.n_gemm = mesh.n_gemm
    ctx.k_gemm = k_gemm
    ctx.k_attn = k_attn
    ctx.k_elem = mesh.k_elem
    ctx.k_attn_elem = k_attn + mesh.k_elem
    ctx.expert_miss = mesh.expert_miss
    ctx.eff_key = eff_key
    ctx.effs = effs
    ctx.eff_parts = eff_parts
    ctx.comm_lines = mesh.comm_lines
    ctx.fixed_s = mesh.fixed_s
    ctx.step_s = mesh.step_s
    # Host work is per executor: an MoE model is served with attention DP (TensorRT-LLM's MoE llm_options,
    # perf-overview.md: enable_attention_dp), so each of the tp ranks' executors holds batch / tp sequences.
    ctx.seq_host_s = 0.0 if serve_rates.achieved(device) else serve_rates.ENGINE_SEQ_HOST_S / (tp if model.is_moe else 1)
    ctx.mesh = mesh
    ctx.prefill_s = ctx.prefill_token_s = -1.0
    ctx.dtypes = (weight_dtype, kv_dtype, expert_dtype, redundant_experts)
    ctx.walk_s = -1.0
    if len(_CTX) > 100_000:
        _CTX.clear()
    _CTX[key] = ctx
    return ctx


def _mesh(model, cluster, tp, pp, ep, dp, f: ShardFacts, input_len, output_len, imbalance) -> _Mesh:
    """The dtype-independent costs of a layout (see ``_Mesh``), memoised. Keyed by the facts of
    the fullest stage too (which stage is fullest can depend on the dtypes) and by the fitted
    constants (the calibration refits them)."""
    key = (id(model), id(cluster), tp, pp, ep, dp, input_len, output_len, imbalance, f.stage_layers,
           f.stage_moe_layers, f.matmul_params_per_token, f.act_traffic_per_token,
           serve_rates.DECODE_HBM_EFFICIENCY, serve_rates.LAYER_OVERHEAD_S, serve_rates.ALLREDUCE_FLOOR_S, f.physical_experts)
    held = _MESH.get(key)
    if held is not None and held[0] is model and held[1] is cluster:
        return held[2]
    device = cluster.device
    if model.attention_kind == "mla":
        # vLLM/SGLang decode MLA in the absorbed form: scores and values over the latent.
        per_head = (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    else:
        per_head = model.qk_head_dim + model.attn_v_head_dim
    hbm = device.hbm_bytes_per_s * serve_rates.decode_hbm_efficiency(device)
    mesh = _Mesh(
        tier_tp=_tier(cluster, tp, 1),
        tier_ep=_tier(cluster, ep, tp),
        tier_pp=_tier(cluster, pp, tp * dp),
        hbm=hbm,
        attn_peak=_attn_peak(device),
        mean_ctx=input_len + output_len / 2.0,
        attn_flops_per_ctx=2.0 * model.num_heads / tp * per_head * f.stage_layers,
        n_gemm=4 * model.hidden_size // tp,
        k_gemm=2.0 * f.matmul_params_per_token,
        k_gemm_experts=2.0 * model.top_k * (imbalance if ep > 1 else 1.0) * f.expert_matmul_params * f.stage_moe_layers,
        k_elem=f.act_traffic_per_token / hbm,
        # routing spread uniformly over the E + R physical experts (R: EPLB's redundant replicas)
        expert_miss=1.0 - model.top_k / (f.physical_experts or model.num_experts) if model.num_experts else 1.0,
        fixed_s=f.stage_layers * serve_rates.layer_overhead_s(device),
        step_s=serve_rates.engine_step_s(cluster, tp, pp, dp),
        comm_lines=(),
        prefill_parts=(),
        gemm={},
        prefills={},
        head_read=f.tied_head_bytes if serve_rates.achieved(device) else 0.0,
        head_last_row=serve_rates.achieved(device),
    )
    mesh.comm_lines = _comm_lines(model, cluster, mesh, tp, pp, ep, dp, f, imbalance)
    batch_tokens = max(input_len, PREFILL_CHUNK)
    mesh.prefill_parts = (
        _prefill_fixed(model, mesh, tp, pp, ep, f, imbalance, input_len, input_len),
        _prefill_fixed(model, mesh, tp, pp, ep, f, imbalance, batch_tokens, input_len),
    )
    if len(_MESH) > 100_000:
        _MESH.clear()
    _MESH[key] = (model, cluster, mesh)
    return mesh


def _affine(fn) -> tuple[float, float]:
    """(a, s) with fn(b) = a + s b, for a cost affine in the batch (alpha-beta collectives)."""
    one, two = fn(1), fn(2)
    return one - (two - one), two - one


def _comm_lines(m, cluster, mesh: _Mesh, tp, pp, ep, dp, f: ShardFacts, imbalance) -> tuple:
    """The decode collectives of a mesh as functions of the micro-batch ``b`` (see
    ``LayoutCosts.comm_lines``): all affine in ``b`` (alpha-beta), TP taking the cheapest algorithm."""
    # The collectives do not depend on dtypes: shared by every dtype variant of a mesh.
    key = (id(cluster), id(m), tp, pp, ep, dp, f.stage_layers, f.stage_moe_layers, serve_rates.ALLREDUCE_FLOOR_S, imbalance)
    cached = _LINES.get(key)
    if cached is not None and cached[0] is m and cached[1] is cluster:
        return cached[2]
    h = m.hidden_size
    lines = []
    if tp > 1:
        n, tier = tp, mesh.tier_tp
        # the logits' gather inside a node goes the way the TP all-reduce does (peer memory where
        # the link has a peer latency: the CPU engine's shared memory; else the link's alpha)
        peer = dataclasses.replace(tier, latency_s=tier.peer_alpha) if tier.name == "intra" else tier
        gather = _affine(lambda b: comm.all_gather_s(b * m.vocab_size * ACT_BYTES, n, peer))
        algorithms = serve_rates.tp_all_reduce_pieces(h * ACT_BYTES, n, tier)  # one row's hidden state per sequence
        lines.append(("tp", 2 * f.stage_layers, algorithms, serve_rates.ALLREDUCE_FLOOR_S, gather))
    if ep > 1 and f.stage_moe_layers:
        # wide EP across nodes: DeepEP-style exchange (plan/serve/ep.py); inside a domain the all-to-all
        a2a = _affine(lambda b: ep_round_trip_s(b, m, ep, mesh.tier_ep, imbalance))
        lines.append(("ep", 2 * f.stage_moe_layers, (a2a,), 0.0, (0.0, 0.0)))
    if pp > 1:
        lines.append(("pp", 1, (_affine(lambda b: comm.p2p_s(b * h * ACT_BYTES, mesh.tier_pp)),), 0.0, (0.0, 0.0)))
    lines = tuple(lines)
    if len(_LINES) > 100_000:
        _LINES.clear()
    _LINES[key] = (m, cluster, lines)
    return lines


def _prefill_fixed(m, mesh: _Mesh, tp, pp, ep, f: ShardFacts, imbalance, tokens: int, prompt_len: int) -> tuple:
    """The dtype-independent half of time.py's ``_prefill_from``: (tokens, chunk, chunks, GEMM FLOPs per token,
    collective seconds per stage, pipeline hop seconds, attention FLOPs per token)."""
    h = m.hidden_size
    chunk = min(tokens, PREFILL_CHUNK)
    chunks = math.ceil(tokens / chunk)
    # Per-token FLOPs on one device of a stage: the GEMMs' (weights), and attention's scores and values
    # (causal: half the prompt on average), which run in the attention kernels, not in the weights' GEMM
    # dtype (an FP4 or FP8 checkpoint's attention core is bf16 flash attention): time.py prices them at
    # the attention peak, as the decode step does.
    attn = 2.0 * (prompt_len / 2.0) * (m.num_heads / tp) * (m.qk_head_dim + m.attn_v_head_dim) * f.stage_layers
    per_tok = 2.0 * f.matmul_params_per_token
    if mesh.head_last_row:  # the LM head runs one row per prompt (its last token, which samples)
        per_tok += 2.0 * f.head_matmul_params * (1.0 / prompt_len - 1.0)
    experts = ()
    if f.stage_moe_layers:
        # The routed experts' GEMMs run per expert, on the rows routed to it (the training planner's
        # rule, plan/train/layer.py): a chunk's tokens from every EP rank, top_k each, over the E + R
        # physical experts, the busiest rank's share under EP. fc1 holds gate and up.
        share = imbalance if ep > 1 else 1.0
        rows = chunk * ep * m.top_k * share / (f.physical_experts or m.num_experts)
        fe = m.expert_ffn_size / tp
        n_in = 2 if m.ffn_kind == "swiglu" else 1
        flops = 2.0 * m.top_k * share * f.stage_moe_layers * h * fe
        experts = ((n_in * flops, rows, n_in * fe, h), (flops, rows, h, fe))
    act = chunk * h * ACT_BYTES
    comm_s = chunks * 2 * f.stage_layers * tp_all_reduce_s(act, tp, mesh.tier_tp)
    if ep > 1 and f.stage_moe_layers:
        comm_s += chunks * 2 * f.stage_moe_layers * ep_round_trip_s(chunk, m, ep, mesh.tier_ep, imbalance, dedup=True)
    hops = (pp - 1) * chunks * comm.p2p_s(act, mesh.tier_pp) if pp > 1 else 0.0
    return tokens, chunk, chunks, per_tok, comm_s, hops, attn, experts
