"""The rates a serving step is built from, per device and link, and the three fitted decode constants.

GEMM efficiency (the training planner's ``matmul_efficiency``, memoised; the decode GEMM's with
its batch-independent factors computed once), the attention kernels' peak, the dtype GEMMs run
in on a device, link tiers, the small all-reduce of decode (ring, one-/two-shot, tree, above a
fitted floor) and the fraction of experts a batch touches. layout_costs.py and time.py
read the fitted constants as ``serve_rates.NAME`` (not copied), because the calibration
(plan/serve/calibration.py) refits them by assigning here.
"""

from __future__ import annotations

import math

from modelcarve.plan.cost import comm, efficiency
from modelcarve.plan.cost.efficiency import HBM_EFFICIENCY, RAMP_DIM, TILE, achieved, matmul_efficiency, peak_fraction
from modelcarve.spec.hardware import ClusterSpec

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
FP4_GEMM_FRACTION = 0.68
"""Share of the FP4 (NVFP4/MXFP4 W4A4) dense peak the serving GEMMs reach relative to what the GEMM
efficiency model gives other dtypes: block-scale handling and the bf16 epilogue. Fitted to the
``fit-fp4`` rows of data/serving_published.csv (TensorRT-LLM's Llama-3.1-405B NVFP4 on 4 B200, ten request
shapes; ``serve_calibration.fit_fp4_fraction``: 0.68, rms log error 0.09 with TensorRT-LLM's own KV memory
rule); it multiplies B200's GEMM peak fraction, so it is refitted whenever the training calibration moves
that: 0.54 at B200 0.675, 0.49 at 0.75, 0.68 at 0.55 (2026-12-06, the training constants fitted to every
release); the product, what the rows see, stays about 0.37); every other FP4 row is a check."""

ENGINE_SEQ_HOST_S = 45.11e-3 / 1536
"""Host seconds the serving engine spends per sequence in flight per engine step (its executor loop:
scheduling, input preparation, sampler update, stop checks and response handling, one Python pass
over every live request), a floor under the decode step, not added to it: with an overlap
scheduler (TensorRT-LLM's PyTorch backend, on by default; vLLM V1's async scheduling) the host
prepares step n+1 while the GPU runs step n, so a round takes ``max(GPU step, this x batch)``.
It binds only where the GPU does little per sequence: a small-active-parameter model (Qwen3-30B-A3B,
3.3B active) at batches of hundreds to thousands on one GPU. Published size: TensorRT-LLM PR #10273
(https://github.com/NVIDIA/TensorRT-LLM/pull/10273, GB200, attention-DP rank at max_batch_size 1536,
1k/1k max throughput): "average per iteration host_step_time is 45.11 ms", 29 us per sequence per
step on a Grace CPU; taken as published (45.11 ms / 1536 = 29.4 us), not fitted. Per executor: an MoE
model runs attention DP (layout_costs: divided by tp). It brings TensorRT-LLM's Qwen3-30B-A3B short rows
(data/serving_published.csv) within ~20%; its long-context and prefill-heavy rows stay high (not modelled; the
CSV's header has the issue-28 diagnosis: ~6-8 us per prompt token on B200 that is neither FLOPs nor HBM traffic)."""

_EFF_CACHE: dict[tuple, float] = {}
_TIER_CACHE: dict[tuple, tuple] = {}


def decode_hbm_efficiency(device) -> float:
    """Fraction of ``hbm_bytes_per_s`` decode streams weights at: ``DECODE_HBM_EFFICIENCY`` of a
    datasheet figure; for a probed device (whose figure is the achieved GEMV weight-streaming
    rate) its ``gemm_efficiency`` (1.0 from ``hardware --probe``)."""
    return device.gemm_efficiency if achieved(device) else DECODE_HBM_EFFICIENCY


def prefill_hbm_efficiency(device) -> float:
    """The same for prefill's weight read: ``plan.efficiency.HBM_EFFICIENCY``, or a probed device's flat fraction."""
    return device.gemm_efficiency if achieved(device) else HBM_EFFICIENCY


def layer_overhead_s(device) -> float:
    """Fixed seconds per layer per engine step: the probed ``DeviceSpec.layer_overhead_s`` (the host
    cost of running one more layer, measured on the engine itself), else the GPU-fitted ``LAYER_OVERHEAD_S``."""
    return device.layer_overhead_s if getattr(device, "layer_overhead_s", 0.0) > 0.0 else LAYER_OVERHEAD_S


def request_overhead_s(device) -> float:
    """Seconds a served request's own path adds to its TTFT once (HTTP read, admission, waking the
    engine thread, the first token's delivery and SSE write): the probed ``DeviceSpec.request_overhead_s``
    (``hardware --probe`` serves a tiny model: its TTFT less its step); 0 on catalogue devices."""
    return getattr(device, "request_overhead_s", 0.0)


def engine_step_s(cluster: ClusterSpec, tp: int, pp: int, dp: int) -> float:
    """Fixed seconds every engine step costs once, whatever its size (0 on catalogue devices, whose
    fitted per-layer constant carries it):

    * ``DeviceSpec.step_overhead_s``: the host work of one step of the engine on one rank with a
      trivial model (scheduling, block tables, sampling, detokenising), measured by ``hardware --probe``;
    * with more than one rank, rank 0 broadcasts the step's plan to all ranks as one broadcast (its
      length and bytes in one 16 KiB message: ``ModelRunner.broadcast``; a decode step's plan is a
      few hundred bytes), a tree of ``ceil(log2 world)`` messages of the link's latency ``alpha``
      (its bandwidth term is nil)."""
    device = cluster.device
    base = getattr(device, "step_overhead_s", 0.0)
    world = tp * pp * dp
    if base <= 0.0 or world <= 1:
        return base
    link = cluster.intra_link if world <= cluster.fast_domain else cluster.inter_link
    return base + math.ceil(math.log2(world)) * link.latency_s


def gemm_efficiency(device, m: float, n: float, k: float, dtype: str) -> float:
    """Achievable fraction of the ``dtype`` dense peak for an (m x k) @ (k x n) GEMM: the training
    planner's model (``plan.efficiency.matmul_efficiency``), memoised (a plan asks for the same
    shapes thousands of times); a probed device's flat ``gemm_efficiency`` (its peaks are achieved rates)."""
    if achieved(device):
        return device.gemm_efficiency
    key = (_device_key(device, dtype), m, n, k)
    eff = _EFF_CACHE.get(key)
    if eff is None:
        eff = matmul_efficiency(device, max(1.0, m), max(1.0, n), max(1.0, k), dtype)
        if len(_EFF_CACHE) > 200_000:
            _EFF_CACHE.clear()
        _EFF_CACHE[key] = eff
    return eff


_EFF_BY_SHAPE: dict[tuple, tuple] = {}
"""Decode GEMM shape -> (efficiency by rows m, ``_eff_parts``)."""


def _eff_parts(device, dtype: str, n: int, k: int) -> tuple:
    """The factors of ``matmul_efficiency(device, m, n, k, dtype)`` that do not depend on ``m``."""
    return (
        peak_fraction(device), n / (n + RAMP_DIM), k / (k + RAMP_DIM), n / (math.ceil(n / TILE) * TILE),
        device.flops(dtype), 1.0 if dtype in ("fp8", "int8") else 0.5625 if dtype == "fp4" else 2.0,
        device.hbm_bytes_per_s * HBM_EFFICIENCY, n, k, efficiency.FP8_PEAK_RATIO if dtype == "fp8" else 1.0,
    )


def _decode_gemm_efficiency(c, m: int) -> float:
    """``gemm_efficiency(c.device, m, c.n_gemm, hidden, c.compute_dtype)`` (the decode GEMM at
    ``m >= 1`` rows, or a prefill chunk of ``m`` tokens), with the factors that do not depend on
    ``m`` computed once per shape (``_eff_parts``): the batch search asks for a new ``m`` at
    almost every step. The same operations in the same order as
    ``plan.efficiency.matmul_efficiency`` (tests/plan/test_serve_speed.py checks they agree exactly)."""
    if achieved(c.device):
        return c.device.gemm_efficiency
    frac, ramp_n, ramp_k, pad_n, peak, elem, hbm, n, k, fp8_ratio = c.eff_parts
    eff = frac * (m / (m + RAMP_DIM)) * ramp_n * ramp_k * (m / (-(-m // TILE) * TILE)) * pad_n * fp8_ratio
    memory_s = elem * (m * k + k * n + m * n) / hbm
    if memory_s > 2.0 * m * n * k / (peak * eff):
        eff = 2.0 * m * n * k / (peak * memory_s)
    return eff


def _device_key(device, dtype: str) -> tuple:
    """What a GEMM's efficiency depends on: a device from a cluster file may reuse a catalogue
    name with other figures, so the name alone is not a key."""
    return (device.name, device.hbm_bytes_per_s, device.peak_flops.get(dtype), dtype, getattr(device, "gemm_efficiency", 0.0))


_ATTN_PEAK: dict[tuple, float] = {}


def _attn_peak(device) -> float:
    key = _device_key(device, "bf16")
    peak = _ATTN_PEAK.get(key)
    if peak is None:
        if achieved(device):
            # Attention runs in the dtype of the activations; a probed device's fastest measured
            # GEMM rate (fp32 on a CPU without native bf16) stands for it.
            peak = _ATTN_PEAK[key] = max(device.peak_flops.values()) * device.gemm_efficiency
        else:
            peak = _ATTN_PEAK[key] = device.flops("bf16") * peak_fraction(device)
    return peak


def _tier(cluster: ClusterSpec, size: int, inner: int) -> comm.Tier:
    # Keyed by object identity, with the cluster kept in the entry so the id cannot be reused.
    key = (id(cluster), size, inner)
    held = _TIER_CACHE.get(key)
    if held is None or held[0] is not cluster:
        held = _TIER_CACHE[key] = (cluster, comm.group_tier(cluster, size, inner))
    return held[1]


def tp_all_reduce_pieces(unit_bytes: float, n: int, tier: comm.Tier) -> tuple:
    """The TP all-reduce algorithms for an activation of ``x * unit_bytes`` as ``(alpha, slope)``
    pairs, each costing ``alpha + slope * x`` seconds: NCCL's ring; inside a node the one-shot /
    two-shot all-reduce (every rank reads its peers' buffers through NVSwitch, as vLLM's and
    TensorRT-LLM's custom all-reduce do, or the CPU engine's shared memory: 2 or 4 steps of the
    link's peer alpha instead of 2(n-1) of its latency); across nodes a tree (2 log2 n latency
    steps). The one place these algorithms are written: ``tp_all_reduce_s`` takes the cheapest at
    one size, the decode step's collective lines (layout_costs.py) keep them all, affine in the
    micro-batch. Empty for ``n <= 1``."""
    if n <= 1:
        return ()
    one, two = comm.all_reduce_s(unit_bytes, n, tier), comm.all_reduce_s(2 * unit_bytes, n, tier)
    pieces = [(one - (two - one), two - one)]  # the ring (alpha-beta: affine in the size)
    bw = 2.0 * (n - 1) / n * unit_bytes / tier.bytes_per_s
    if tier.name == "intra":
        pieces.append((2 * tier.peer_alpha, (n - 1) * unit_bytes / tier.bytes_per_s))  # one-shot
        pieces.append((4 * tier.peer_alpha, bw))  # two-shot
    else:
        pieces.append((2 * math.ceil(math.log2(n)) * tier.latency_s, bw))  # tree
    return tuple(pieces)


def tp_all_reduce_s(size_bytes: float, n: int, tier: comm.Tier) -> float:
    """All-reduce of a small activation of ``size_bytes``: the cheapest of ``tp_all_reduce_pieces``'
    algorithms, not below ``ALLREDUCE_FLOOR_S``; 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    ring = comm.all_reduce_s(size_bytes, n, tier)  # the ring piece at x = 1, evaluated directly
    return max(ALLREDUCE_FLOOR_S, min(ring, *(a + s for a, s in tp_all_reduce_pieces(size_bytes, n, tier)[1:])))


def device_dtype(device, dtype: str) -> str:
    """The dtype GEMMs really run in on ``device``: fp8 falls back to bf16 where the device has
    no fp8 tensor cores (A100: fp8 weights are dequantised, W8A16)."""
    return dtype if dtype in device.peak_flops or dtype == "int4" else "bf16"


def experts_touched_fraction(tokens: float, top_k: int, num_experts: int) -> float:
    """Expected fraction of ``num_experts`` that ``tokens`` tokens routed top-k (uniformly) touch."""
    if num_experts <= 0:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens
