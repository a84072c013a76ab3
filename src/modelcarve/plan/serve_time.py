"""Serving time of one layout: prefill, decode step, TTFT, TPOT and output tokens/s.

Usage::

    from modelcarve.plan.serve_time import serve_time
    t = serve_time(model, cluster, tp=2, weight_dtype="fp8", batch=64, input_len=1000, output_len=1000)
    t.tpot_s, t.tokens_per_s_per_device

The model (all per device, the fullest pipeline stage):

* **Decode step** of ``b`` sequences on one stage: kernels run one after another, so each
  class of kernel has its own roofline and the times add. GEMMs: the weights read (routed
  experts only in the fraction the batch touches) over the achievable HBM bandwidth, against
  their FLOPs over the achievable GEMM rate, whichever is larger. Attention: the KV cache of
  ``b`` sequences at the mean decode context ``input + output/2`` against its score/value
  FLOPs. Element-wise kernels: the activations they read and write. Communication is added on
  top (decode collectives sit on the critical path): two TP all-reduces per layer of
  ``b x hidden`` bf16 values with a latency term (one-shot all-reduce inside a node, a tree
  across nodes: at batch 1 the alpha costs, not the bytes), an all-gather of the logits, two
  EP all-to-alls per MoE layer scaled by the load-imbalance factor, and a PP hand-off per stage.
  The EP all-to-all is the plain one: a bf16 copy of the token per routed expert, no per-node
  deduplication (DeepEP-style dispatch, fp8 payloads, would cut the cross-node bytes several-fold).
* **Experts touched**: ``T`` tokens routed top-k over ``E`` uniform experts touch on average
  ``E (1 - (1 - k/E)^T)`` of them; with EP the ``ep`` attention groups decode in lockstep, so
  ``T = b x ep`` tokens reach each MoE layer and a rank reads that fraction of its experts.
* **Pipeline**: ``B`` sequences split into ``m = min(pp, B)`` micro-batches; one decode round
  (every sequence advances one token) takes ``max(m, pp)`` stage steps, so with fewer than
  ``pp`` micro-batches in flight the stages idle (bubble ``1 - m/pp``).
* **Prefill** of a prompt is compute-bound: forward FLOPs (causal attention) over the device's
  achievable GEMM rate (``plan.efficiency``), not below one read of the weights per chunk, plus
  its TP/EP/PP traffic. Stages run one after another for a single prompt; with EP the prompt's
  expert work is costed as if its own rank did it (right in steady state, when every rank
  prefills its own requests; pessimistic for a lone prompt).
* **TTFT** = the prompt's prefill, plus one decode round of the running batch when other
  requests are in flight (continuous batching admits a request at the next step; queueing
  under overload is not modelled).
* **TPOT** as a user sees it under continuous batching: the decode round plus the other
  ``B - 1`` requests' prefills interleaved with it (each sequence needs ``input`` tokens of
  prefill per ``output`` tokens decoded; prefills of different requests overlap over up to
  ``min(pp, B)`` stages).
* **Throughput**: ``B`` sequences per attention group (``tp x pp`` devices) finish ``B x
  output`` tokens in ``output`` rounds plus their own ``B`` prefills; reported per model
  replica (``ep`` groups share experts), per device and per cluster (``dp`` groups).

Fitted constants (three, to eight published batch-1 latencies; see DECODE_HBM_EFFICIENCY):
the achievable HBM fraction in decode, a fixed per-layer overhead per decode step, and a floor
under every all-reduce. Otherwise: ``plan.efficiency.HBM_EFFICIENCY`` for prefill's weight read, and the training
planner's ``matmul_efficiency`` of the dense peak of the dtype the GEMMs run in (fp8 for fp8
weights, int8 for W8A8, bf16 for W4A16 int4; ``plan.quant``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelcarve.plan import comm
from modelcarve.plan.efficiency import HBM_EFFICIENCY, RAMP_DIM, TILE, matmul_efficiency, peak_fraction
from modelcarve.plan.quant import weight_format
from modelcarve.plan.serve_memory import ACT_BYTES, MOE_IMBALANCE, PREFILL_CHUNK, ShardFacts, shard_facts
from modelcarve.spec.hardware import ClusterSpec
from modelcarve.spec.model import ModelSpec

DECODE_HBM_EFFICIENCY = 0.80
"""Achievable fraction of datasheet HBM bandwidth in decode (GEMV weight streaming, paged KV
attention). One of the three decode constants fitted together (least squares in log error) to
the eight batch-1 latencies marked ``fit`` in data/serving_published.csv: gpt-fast's Llama-2-7B
and -70B bf16 tensor-parallel sweep (TP 1-8, A100) and vLLM's Llama-3.1-8B on an A100-40GB;
RMS error 1.7% (``benchmarks/calibrate_serving.py --fit``). The same value as the STREAM-like
``plan.efficiency.HBM_EFFICIENCY``; it is kept separate because it is fitted to decode."""

LAYER_OVERHEAD_S = 41e-6
"""Fixed seconds per layer per decode step on top of the rooflines: the ~10 kernels of a layer
each cost a few microseconds of launch, tail and synchronisation however little they move
(CUDA graphs remove the CPU launch, not the GPU-side gaps). Fitted with the other two decode
constants (see DECODE_HBM_EFFICIENCY); it is what makes TP8 at batch 1 about 3 ms per token for
a 7B model, not the 1 ms its weight read alone would take."""
ALLREDUCE_FLOOR_S = 10.5e-6
"""Least time of one all-reduce however small (NCCL and custom all-reduce kernels: launch,
flag exchange, completion), seconds. Fitted with the other two decode constants (see above)."""

_EFF_CACHE: dict[tuple, float] = {}
_TIER_CACHE: dict[tuple, tuple] = {}
_LINES: dict[tuple, tuple] = {}


def gemm_efficiency(device, m: float, n: float, k: float, dtype: str) -> float:
    """Achievable fraction of the ``dtype`` dense peak for an (m x k) @ (k x n) GEMM: the training
    planner's model (``plan.efficiency.matmul_efficiency``), memoised (a plan asks for the same
    shapes thousands of times)."""
    key = (_device_key(device, dtype), m, n, k)
    eff = _EFF_CACHE.get(key)
    if eff is None:
        eff = matmul_efficiency(device, max(1.0, m), max(1.0, n), max(1.0, k), dtype)
        if len(_EFF_CACHE) > 200_000:
            _EFF_CACHE.clear()
        _EFF_CACHE[key] = eff
    return eff


_INF = float("inf")
_EFF_BY_SHAPE: dict[tuple, tuple] = {}
"""Decode GEMM shape -> (efficiency by rows m, ``_eff_parts``)."""


def _eff_parts(device, dtype: str, n: int, k: int) -> tuple:
    """The factors of ``matmul_efficiency(device, m, n, k, dtype)`` that do not depend on ``m``."""
    return (
        peak_fraction(device), n / (n + RAMP_DIM), k / (k + RAMP_DIM), n / (math.ceil(n / TILE) * TILE),
        device.flops(dtype), 1.0 if dtype in ("fp8", "int8") else 2.0, device.hbm_bytes_per_s * HBM_EFFICIENCY, n, k,
    )


def _decode_gemm_efficiency(c: "_Ctx", m: int) -> float:
    """``gemm_efficiency(c.device, m, c.n_gemm, hidden, c.compute_dtype)`` (the decode GEMM at
    ``m >= 1`` rows, or a prefill chunk of ``m`` tokens), with the factors that do not depend on
    ``m`` computed once per shape (``_eff_parts``): the batch search asks for a new ``m`` at
    almost every step. The same operations in the same order as
    ``plan.efficiency.matmul_efficiency`` (tests/test_serve_speed.py checks they agree exactly)."""
    frac, ramp_n, ramp_k, pad_n, peak, elem, hbm, n, k = c.eff_parts
    eff = frac * (m / (m + RAMP_DIM)) * ramp_n * ramp_k * (m / (-(-m // TILE) * TILE)) * pad_n
    memory_s = elem * (m * k + k * n + m * n) / hbm
    if memory_s > 2.0 * m * n * k / (peak * eff):
        eff = 2.0 * m * n * k / (peak * memory_s)
    return eff


def _device_key(device, dtype: str) -> tuple:
    """What a GEMM's efficiency depends on: a device from a cluster file may reuse a catalogue
    name with other figures, so the name alone is not a key."""
    return (device.name, device.hbm_bytes_per_s, device.peak_flops.get(dtype), dtype)


_ATTN_PEAK: dict[tuple, float] = {}


def _attn_peak(device) -> float:
    key = _device_key(device, "bf16")
    peak = _ATTN_PEAK.get(key)
    if peak is None:
        peak = _ATTN_PEAK[key] = device.flops("bf16") * peak_fraction(device)
    return peak


def _tier(cluster: ClusterSpec, size: int, inner: int) -> comm.Tier:
    # Keyed by object identity, with the cluster kept in the entry so the id cannot be reused.
    key = (id(cluster), size, inner)
    held = _TIER_CACHE.get(key)
    if held is None or held[0] is not cluster:
        held = _TIER_CACHE[key] = (cluster, comm.group_tier(cluster, size, inner))
    return held[1]


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
        return max(ALLREDUCE_FLOOR_S, min(ring, one_shot, two_shot))
    tree = 2 * math.ceil(math.log2(n)) * tier.latency_s + bw
    return max(ALLREDUCE_FLOOR_S, min(ring, tree))


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
    """Time per output token a user sees: the decode round plus the other requests' prefills."""
    tokens_per_s: float
    """Output tokens/s of one model replica (tp x pp x ep devices)."""
    tokens_per_s_per_device: float
    tokens_per_s_cluster: float
    bound: str
    """The largest share of the decode step: 'memory', 'compute', 'communication' or 'overhead'."""
    bubble: float
    """Fraction of a decode round pipeline stages sit idle."""
    weights_read_bytes: float
    """Weight bytes one device reads per decode step (routed experts: only those touched)."""
    decode_parts: dict
    """Seconds of one decode round: roofline (with its memory and compute sides), overhead
    (fixed per-layer cost), tp, ep, pp."""
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
            "weights_read_bytes": self.weights_read_bytes,
            "decode_parts_s": dict(self.decode_parts),
        }


@dataclass(kw_only=True, slots=True)
class _Ctx:
    """Everything of a layout that does not depend on the batch (filled in by ``_context``; the
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
    """Per-layer fixed overhead of the stage's decode step (LAYER_OVERHEAD_S x layers)."""
    prefill_s: float = -1.0
    """One prompt's prefill alone (TTFT without queueing); -1 until first needed."""
    prefill_token_s: float = -1.0
    """Seconds of batched prefill per prompt token through all stages (not pipelined)."""
    mesh: "_Mesh | None" = None
    """The dtype-independent costs this layout shares with its other dtype variants."""


_CTX: dict[tuple, _Ctx] = {}


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
    """2 x non-expert matmul params per token (the dense part of ``_Ctx.k_gemm``)."""
    k_gemm_experts: float
    """What the routed experts add to ``k_gemm`` (when the stage holds any)."""
    k_elem: float
    expert_miss: float
    fixed_s: float
    comm_lines: tuple
    prefill_parts: tuple
    """For (one prompt alone, a full batch of prefill tokens): (tokens, chunk, chunks, FLOPs per
    token, collective seconds, pipeline hop seconds); see ``_prefill_s``."""
    gemm: dict
    """weight dtype -> (compute dtype, its dense peak FLOP/s, the decode GEMM's efficiency key and
    its efficiency-by-rows memo)."""
    prefills: dict
    """(compute dtype, weight bytes read per chunk) -> (prefill_s, prefill_token_s)."""


_MESH: dict[tuple, _Mesh] = {}


def clear_caches() -> None:
    """Forget every memoised serving cost (after changing a fitted constant; benchmarks start cold)."""
    from modelcarve.plan import serve_memory

    for cache in (serve_memory._FACTS, serve_memory._TP, serve_memory._STAGES, serve_memory._WEIGHTS, _CTX, _MESH, _EFF_CACHE,
                  _LINES, _TIER_CACHE, _ATTN_PEAK, _EFF_BY_SHAPE):
        cache.clear()


def _context(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len,
             imbalance: float = MOE_IMBALANCE, f: ShardFacts | None = None) -> _Ctx:
    """The batch-independent costs of one layout, memoised (``f``: its ``shard_facts``, when the
    caller has them already)."""
    key = (id(model), id(cluster), tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len, imbalance)
    ctx = _CTX.get(key)
    if ctx is not None and ctx.model is model and ctx.cluster is cluster:
        return ctx
    if f is None:
        f = shard_facts(model, tp=tp, pp=pp, ep=ep, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    mesh = _mesh(model, cluster, tp, pp, ep, dp, f, input_len, output_len, imbalance)
    device = cluster.device
    gemm = mesh.gemm.get(weight_dtype)
    if gemm is None:
        compute_dtype = device_dtype(device, weight_format(weight_dtype).compute_dtype)
        eff_key = (_device_key(device, compute_dtype), mesh.n_gemm, model.hidden_size)
        held = _EFF_BY_SHAPE.get(eff_key)
        if held is None:
            held = _EFF_BY_SHAPE[eff_key] = ({}, _eff_parts(device, compute_dtype, mesh.n_gemm, model.hidden_size))
        gemm = mesh.gemm[weight_dtype] = (compute_dtype, device.flops(compute_dtype), eff_key) + held
    compute_dtype, peak, eff_key, effs, eff_parts = gemm
    experts_all = f.stage_moe_layers * f.experts_per_rank * f.expert_bytes
    k_gemm = mesh.k_gemm
    if experts_all:
        # Tokens x experts landing on the busiest rank: b x ep x k / ep x imbalance.
        k_gemm += mesh.k_gemm_experts
    k_attn = mesh.mean_ctx * max(f.kv_bytes_per_token / mesh.hbm, mesh.attn_flops_per_ctx / mesh.attn_peak)
    # Every field assigned here, without the generated __init__: matching 34 keyword
    # arguments costs more than the rest of this function (once per candidate layout).
    ctx = object.__new__(_Ctx)
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
    ctx.weights_fixed = f.weights_bytes - f.embed_bytes - experts_all
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
    ctx.mesh = mesh
    ctx.prefill_s = ctx.prefill_token_s = -1.0
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
           DECODE_HBM_EFFICIENCY, LAYER_OVERHEAD_S, ALLREDUCE_FLOOR_S)
    held = _MESH.get(key)
    if held is not None and held[0] is model and held[1] is cluster:
        return held[2]
    device = cluster.device
    if model.attention_kind == "mla":
        # vLLM/SGLang decode MLA in the absorbed form: scores and values over the latent.
        per_head = (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    else:
        per_head = model.qk_head_dim + model.attn_v_head_dim
    hbm = device.hbm_bytes_per_s * DECODE_HBM_EFFICIENCY
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
        expert_miss=1.0 - model.top_k / model.num_experts if model.num_experts else 1.0,
        fixed_s=f.stage_layers * LAYER_OVERHEAD_S,
        comm_lines=(),
        prefill_parts=(),
        gemm={},
        prefills={},
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
    ``_Ctx.comm_lines``): all affine in ``b`` (alpha-beta), TP taking the cheapest algorithm."""
    # The collectives do not depend on dtypes: shared by every dtype variant of a mesh.
    key = (id(cluster), id(m), tp, pp, ep, dp, f.stage_layers, f.stage_moe_layers, ALLREDUCE_FLOOR_S, imbalance)
    cached = _LINES.get(key)
    if cached is not None and cached[0] is m and cached[1] is cluster:
        return cached[2]
    h = m.hidden_size
    lines = []
    if tp > 1:
        n, tier = tp, mesh.tier_tp
        gather = _affine(lambda b: comm.all_gather_s(b * m.vocab_size * ACT_BYTES, n, tier))
        algorithms = [_affine(lambda b: comm.all_reduce_s(b * h * ACT_BYTES, n, tier))]
        bw = 2.0 * (n - 1) / n * h * ACT_BYTES / tier.bytes_per_s
        if tier.name == "intra":
            algorithms.append((2 * tier.latency_s, (n - 1) * h * ACT_BYTES / tier.bytes_per_s))  # one-shot
            algorithms.append((4 * tier.latency_s, bw))  # two-shot
        else:
            algorithms.append((2 * math.ceil(math.log2(n)) * tier.latency_s, bw))  # tree
        lines.append(("tp", 2 * f.stage_layers, tuple(algorithms), ALLREDUCE_FLOOR_S, gather))
    if ep > 1 and f.stage_moe_layers:
        size = m.top_k * h * ACT_BYTES * imbalance
        a2a = _affine(lambda b: comm.all_to_all_s(b * size, ep, mesh.tier_ep))
        lines.append(("ep", 2 * f.stage_moe_layers, (a2a,), 0.0, (0.0, 0.0)))
    if pp > 1:
        lines.append(("pp", 1, (_affine(lambda b: comm.p2p_s(b * h * ACT_BYTES, mesh.tier_pp)),), 0.0, (0.0, 0.0)))
    lines = tuple(lines)
    if len(_LINES) > 100_000:
        _LINES.clear()
    _LINES[key] = (m, cluster, lines)
    return lines


def _stage_step(c: _Ctx, b: int, detail: bool = False):
    """One stage's decode step for ``b`` sequences, seconds; with ``detail`` also its parts, the
    weight bytes read and the bytes each axis sends.

    Kernels run one after another, so each class has its own roofline and the times add: GEMMs
    (weights vs FLOPs), attention (KV cache vs score/value FLOPs), element-wise kernels
    (activation traffic), then the collectives, which sit on the decode critical path. At small
    batches the GEMMs are memory-bound GEMVs and their compute term is far below the weight
    read; it matters only for batches of hundreds."""
    weights_read = c.weights_fixed
    if c.experts_all:
        # Expected share of the experts touched (see experts_touched_fraction), inlined: this
        # function runs a few times for every candidate of a search.
        weights_read += c.experts_all * (1.0 - c.expert_miss ** (b * c.ep))
    gemm_mem = weights_read / c.hbm
    m_tile = b if b > TILE else TILE
    eff = c.effs.get(m_tile)
    if eff is None:
        eff = c.effs[m_tile] = _decode_gemm_efficiency(c, m_tile)
    gemm_cmp = b * c.k_gemm / (c.peak * eff)
    step = (gemm_mem if gemm_mem > gemm_cmp else gemm_cmp) + b * c.k_attn_elem + c.fixed_s
    if not detail:
        for _, count, pieces, floor, extra in c.comm_lines:
            best = None
            for a, slope in pieces:
                t = a + slope * b
                if best is None or t < best:
                    best = t
            step += count * (best if best > floor else floor) + extra[0] + extra[1] * b
        return step
    comm_s = {}
    straggler = 0.0
    for axis, count, pieces, floor, extra in c.comm_lines:
        t = count * max(floor, min(a + slope * b for a, slope in pieces)) + extra[0] + extra[1] * b
        comm_s[axis] = t
        step += t
        if axis == "ep":
            # The bytes part scales with the busiest rank's share; the rest would be paid anyway.
            straggler = count * pieces[0][1] * b * (1.0 - 1.0 / c.imbalance)
    m, f = c.model, c.f
    h = m.hidden_size
    roof = step - sum(comm_s.values()) - c.fixed_s
    attn_mem = b * c.mean_ctx * f.kv_bytes_per_token / c.hbm
    attn_cmp = b * c.mean_ctx * c.attn_flops_per_ctx / c.attn_peak
    parts = {
        "roofline": roof, "memory": gemm_mem + attn_mem + b * c.k_elem, "compute": gemm_cmp + attn_cmp,
        "overhead": c.fixed_s, "tp": comm_s.get("tp", 0.0), "ep": comm_s.get("ep", 0.0), "pp": comm_s.get("pp", 0.0),
        "ep_straggler": straggler,
    }
    act = b * h * ACT_BYTES
    sent = {
        "tp": 2 * f.stage_layers * comm.ring_all_reduce_bytes(act, c.tp)
        + comm.all_gather_bytes(b * m.vocab_size * ACT_BYTES, c.tp),
        "ep": 2 * f.stage_moe_layers * comm.all_to_all_bytes(b * m.top_k * h * ACT_BYTES * c.imbalance, c.ep) if c.ep > 1 else 0.0,
        "pp": act if c.pp > 1 else 0.0,
    }
    return step, parts, weights_read, sent


def _step_slope(c: _Ctx, b: int) -> tuple[float, float, float, float, float]:
    """(``_stage_step(c, b)``, its rate of change per sequence, the same two for the other side of
    the GEMM roofline, the least the step is sure to grow by at ``b + 1`` (-1: no such bound)).

    The growth bound: attention and element-wise time add ``k_attn_elem`` per sequence exactly;
    each collective at least its cheapest algorithm's slope (unless its floor binds); the weights
    read, the experts the next sequence touches; the GEMMs' compute side grows by its slope while
    the batch stays inside the first ``TILE`` rows (one efficiency); past them its efficiency
    steps with the tile padding, so a compute-bound step has no bound.
    The step is computed exactly as ``_stage_step`` computes it (same
    operations, same order); the slopes come from the pieces active at ``b`` (the cheapest
    collective algorithm; GEMM efficiency held constant). Only the step decides anything; the
    slopes aim the batch search, which must see where the roofline turns from memory to compute."""
    weights_read = c.weights_fixed
    slope = c.k_attn_elem
    mem_slope = tail = 0.0
    if c.experts_all:
        tail = c.expert_miss ** (b * c.ep)
        weights_read += c.experts_all * (1.0 - tail)
        if tail > 0.0:
            # d/db of experts_all (1 - miss^(b ep)) / hbm
            mem_slope = c.experts_all * tail * c.ep * -math.log(c.expert_miss) / c.hbm
    gemm_mem = weights_read / c.hbm
    m_tile = b if b > TILE else TILE
    eff = c.effs.get(m_tile)
    if eff is None:
        eff = c.effs[m_tile] = _decode_gemm_efficiency(c, m_tile)
    cmp_slope = c.k_gemm / (c.peak * eff)
    gemm_cmp = b * c.k_gemm / (c.peak * eff)
    if gemm_mem > gemm_cmp:
        step = gemm_mem + b * c.k_attn_elem + c.fixed_s
        other, other_slope = gemm_cmp - gemm_mem, slope + cmp_slope
        slope += mem_slope
    else:
        step = gemm_cmp + b * c.k_attn_elem + c.fixed_s
        other, other_slope = gemm_mem - gemm_cmp, slope + mem_slope
        slope += cmp_slope
    comm_grows = 0.0
    for _, count, pieces, floor, extra in c.comm_lines:
        best = None
        least = _INF
        for a, s in pieces:
            t = a + s * b
            if best is None or t < best:
                best, best_s = t, s
            if s < least:
                least = s
        step += count * (best if best > floor else floor) + extra[0] + extra[1] * b
        add = (count * best_s if best > floor else 0.0) + extra[1]
        slope += add
        other_slope += add
        # At b + 1 every algorithm costs at least its slope more, so the cheapest one does.
        comm_grows += (count * least if best > floor else 0.0) + extra[1]
    if gemm_mem > gemm_cmp:
        grows = c.k_attn_elem + comm_grows
        if tail > 0.0:
            # The experts the next sequence touches: experts_all (miss^(b ep) - miss^((b+1) ep)).
            grows += c.experts_all * tail * (1.0 - c.expert_miss ** c.ep) / c.hbm
    else:
        grows = c.k_attn_elem + cmp_slope + comm_grows if b < TILE else -1.0
    return step, slope, step + other, other_slope, grows


def _prefill_fixed(m, mesh: _Mesh, tp, pp, ep, f: ShardFacts, imbalance, tokens: int, prompt_len: int) -> tuple:
    """The dtype-independent half of ``_prefill_s``: (tokens, chunk, chunks, FLOPs per token,
    collective seconds per stage, pipeline hop seconds)."""
    h = m.hidden_size
    chunk = min(tokens, PREFILL_CHUNK)
    chunks = math.ceil(tokens / chunk)
    # Per-token FLOPs on one device of a stage (causal attention: half the prompt on average).
    attn = 2.0 * (prompt_len / 2.0) * (m.num_heads / tp) * (m.qk_head_dim + m.attn_v_head_dim) * f.stage_layers
    per_tok = 2.0 * f.matmul_params_per_token + attn
    if f.stage_moe_layers:
        per_tok += 2.0 * m.top_k * (imbalance if ep > 1 else 1.0) * f.expert_matmul_params * f.stage_moe_layers
    act = chunk * h * ACT_BYTES
    comm_s = chunks * 2 * f.stage_layers * tp_all_reduce_s(act, tp, mesh.tier_tp)
    if ep > 1 and f.stage_moe_layers:
        size = chunk * m.top_k * h * ACT_BYTES * imbalance
        comm_s += chunks * 2 * f.stage_moe_layers * comm.all_to_all_s(size, ep, mesh.tier_ep)
    hops = (pp - 1) * chunks * comm.p2p_s(act, mesh.tier_pp) if pp > 1 else 0.0
    return tokens, chunk, chunks, per_tok, comm_s, hops


def _prefill_s(c: _Ctx, tokens: int, prompt_len: int) -> float:
    """Prefill of ``tokens`` tokens of prompts ``prompt_len`` long, through all stages in turn:
    compute-bound (FLOPs over the achievable GEMM rate), not below one read of the weights per
    chunk, plus the stage's TP/EP collectives, then the pipeline hops."""
    part = _prefill_fixed(c.model, c.mesh, c.tp, c.pp, c.ep, c.f, c.imbalance, tokens, prompt_len)
    eff = gemm_efficiency(c.device, part[1], c.n_gemm, c.model.hidden_size, c.compute_dtype)
    return _prefill_from(c, part, eff)


def _prefill_from(c: _Ctx, part: tuple, eff: float) -> float:
    tokens, _, chunks, per_tok, comm_s, hops = part
    f = c.f
    compute_s = tokens * per_tok / (c.peak * eff)
    read_s = chunks * (f.weights_bytes - f.embed_bytes) / (c.device.hbm_bytes_per_s * HBM_EFFICIENCY)
    stage = max(compute_s, read_s) + comm_s
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
    load_imbalance: float = MOE_IMBALANCE,
) -> ServeTime:
    """TTFT, TPOT and throughput of one layout with ``batch`` sequences per attention group."""
    c = _context(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len, load_imbalance)
    return _serve_time(c, batch)


def _ensure_prefill(c: _Ctx) -> None:
    """Cost the prefills on first use (a latency screen at batch 1 without a TTFT bound needs none)."""
    if c.prefill_s < 0:
        # The KV dtype plays no part: both KV variants of a weight dtype share their prefills.
        mesh = c.mesh
        shared = (c.compute_dtype, c.f.weights_bytes - c.f.embed_bytes)
        held = mesh.prefills.get(shared)
        if held is not None:
            c.prefill_s, c.prefill_token_s = held
            return
        alone, batched = mesh.prefill_parts
        # The GEMM efficiency at each prefill's chunk size.
        eff = c.effs.get(alone[1])
        if eff is None:
            eff = c.effs[alone[1]] = _decode_gemm_efficiency(c, alone[1])
        c.prefill_s = _prefill_from(c, alone, eff)
        eff = c.effs.get(batched[1])
        if eff is None:
            eff = c.effs[batched[1]] = _decode_gemm_efficiency(c, batched[1])
        c.prefill_token_s = _prefill_from(c, batched, eff) / batched[0]
        mesh.prefills[shared] = (c.prefill_s, c.prefill_token_s)


def decode_tpot_s(c: _Ctx, batch: int) -> float:
    """TPOT of a user when no other request's prefill interleaves (``batch == 1``): the decode round."""
    micro = c.pp if c.pp < batch else batch
    return (micro if micro > c.pp else c.pp) * _stage_step(c, -(-batch // micro))


def _rates(c: _Ctx, batch: int) -> tuple[float, float, float, float]:
    """(decode round, TPOT, TTFT, output tokens/s of the attention group) at ``batch``, seconds.

    A round: ``m = min(pp, batch)`` micro-batches of ``ceil(batch / m)`` sequences; every stage
    takes ``max(m, pp)`` steps (idle ones are the bubble). Each sequence's prefill
    (``input_len`` tokens) has to be done once per ``output_len`` tokens decoded; prefills of
    different requests overlap over up to ``min(pp, batch)`` stages. A user's TPOT carries the
    other ``batch - 1`` requests' prefills; the throughput carries all ``batch``."""
    if c.prefill_s < 0:
        _ensure_prefill(c)
    micro = c.pp if c.pp < batch else batch
    round_s = (micro if micro > c.pp else c.pp) * _stage_step(c, -(-batch // micro))
    per_seq = c.input_len * c.prefill_token_s / micro / c.output_len
    tpot = round_s + (batch - 1) * per_seq
    ttft = c.prefill_s + (round_s if batch > 1 else 0.0)
    return round_s, tpot, ttft, batch / (round_s + batch * per_seq)


def _serve_time(c: _Ctx, batch: int) -> ServeTime:
    batch = max(1, int(batch))
    _ensure_prefill(c)
    micro = min(c.pp, batch)
    b = math.ceil(batch / micro)
    _, parts, weights_read, sent = _stage_step(c, b, detail=True)
    round_s, tpot, ttft, group = _rates(c, batch)
    slots = max(micro, c.pp)
    # The largest share of the step names what bounds it; "overhead" is the fixed per-layer
    # cost (kernel launches and gaps) that dominates when each device has little to do.
    roof_kind = "memory" if parts["memory"] >= parts["compute"] else "compute"
    shares = {roof_kind: parts["roofline"], "communication": parts["tp"] + parts["ep"] + parts["pp"], "overhead": parts["overhead"]}
    bound = max(shares, key=shares.get)
    round_parts = {k: v * slots for k, v in parts.items()}
    tiers = {"tp": (c.tp, c.tier_tp), "ep": (c.ep, c.tier_ep), "pp": (c.pp, c.tier_pp)}
    comm_info = {
        axis: {"tier": tier.name, "s_per_round": round_parts[axis], "bytes_per_round": sent[axis] * slots}
        for axis, (size, tier) in tiers.items()
        if size > 1
    }
    if "ep" in comm_info:
        comm_info["ep"]["straggler_s_per_round"] = round_parts.pop("ep_straggler")
    else:
        round_parts.pop("ep_straggler")
    return ServeTime(
        batch=batch,
        prefill_s=c.prefill_s,
        ttft_s=ttft,
        decode_step_s=round_s,
        tpot_s=tpot,
        tokens_per_s=group * c.ep,
        tokens_per_s_per_device=group / (c.tp * c.pp),
        tokens_per_s_cluster=group * c.dp,
        bound=bound,
        bubble=1.0 - micro / c.pp if c.pp > 1 else 0.0,
        weights_read_bytes=weights_read,
        decode_parts=round_parts,
        comm=comm_info,
    )
