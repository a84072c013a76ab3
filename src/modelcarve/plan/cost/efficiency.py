"""Achievable fraction of a device's dense peak for one GEMM shape, and compute-time helpers.

Usage::

    from modelcarve.plan.cost.efficiency import matmul_efficiency, gemm_time_s
    eff = matmul_efficiency(device, m=4096, n=1536, k=12288)     # 0..1 of the dense bf16 peak
    seconds = gemm_time_s(device, 4096, 1536, 12288)

The model (three factors and a roofline; each states why)
---------------------------------------------------------
1. ``peak_fraction`` of the device: what cuBLAS reaches on a large, well-shaped GEMM. Tensor
   cores never run at the datasheet clock under sustained load (power capping), and the
   epilogue / prologue of every tile costs cycles.
2. A size ramp ``d / (d + RAMP_DIM)`` for each of ``m``, ``n``, ``k``: small dimensions cannot
   fill all SMs (``m``, ``n``: too few output tiles, wave quantisation) or amortise the tile
   prologue (``k``: too few main-loop iterations). This is why GEMMs slow down as tensor
   parallelism shrinks the per-device matrices and why fine-grained experts run below peak.
3. Padding to the tile grid: ``m`` and ``n`` are computed in tiles of ``TILE`` (partial tiles
   cost a whole tile).
4. Roofline: a GEMM cannot run faster than it can stream its operands once from HBM
   (``2 (mk + kn + mn)`` bytes for 16-bit operands) at ``HBM_EFFICIENCY`` of the datasheet
   bandwidth.

Calibration. ``RAMP_DIM`` and the A100's ``peak_fraction`` are the two constants fitted to the
ten rows of Table 1 of Narayanan et al. 2021 and Korthikanti et al. 2022's two 530B runs, the A100
papers, by grid search (RAMP_DIM 64, A100 0.75: Table 1's RMS log error 0.025, worst row 6.0%;
benchmarks/calibrate_training.py ``shipped_fit``, stage 1, prints the fit and each row's error;
docs/calibration_training.md keeps the result). The peak fractions of the
other devices are set from the same kind of evidence per generation (Hopper runs large bf16
GEMMs at a lower fraction of its higher peak than Ampere: about 0.7 of 989 TFLOP/s in
published cuBLAS sweeps), and are marked as assumptions in ``PEAK_FRACTION_SOURCE``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcarve.spec.hardware import DeviceSpec

RAMP_DIM = 64.0
"""Dimension at which the size ramp halves throughput (fitted to Table 1, see module doc)."""
TILE = 64
"""Granularity m and n are padded to (smallest common cuBLAS tensor-core tile edge)."""
HBM_EFFICIENCY = 0.8
"""Achievable fraction of datasheet HBM bandwidth for streaming kernels (STREAM-like copy)."""

BLACKWELL_PEAK_FRACTION = {"B200": 0.55, "GB200": 0.60, "GB300": 0.825}
"""Fraction of the dense bf16 peak a large GEMM reaches on Blackwell, per system (B300 reads
B200's), as the published Megatron-Bridge / NeMo runs see it: fitted with the other framework
constants to all 135 NeMo / Megatron-Bridge rows, every release (benchmarks/calibrate_training.py
``shipped_fit``; its leave-one-source-out table is these constants' out-of-sample error). Each
system has its own fraction because the published runs do not follow the datasheets: B200 and GB200
share the die (2.25 and 2.5 PFLOP/s dense bf16 at 1,000 and 1,200 W), yet the runs put a large GEMM
at about 1.24 and 1.50 PFLOP/s (these fractions). They are effective fractions (B200's below what a cuBLAS sweep reaches): they also carry
time these runs spend that the model does not itemise, above all gpt-oss-120b's: its 16 Blackwell rows
are still +7..+45% with these fractions (docs/calibration_training.md). History: 0.75 /
0.675 / 0.85 when fitted to the 32 MB-25.11 rows alone (until 2026-12-06), 0.675 / 0.6 / 0.825 on the
draft 25.11 tables."""

PEAK_FRACTION = {
    "A100": 0.75,
    "H100": 0.72,
    "H800": 0.72,
    "H200": 0.74,
    "MI300X": 0.55,
    "MI325X": 0.55,
    "L40S": 0.75,
    "RTX4090": 0.80,
}
"""Fraction of the dense peak a large bf16 GEMM reaches, by device family (prefix match)."""
DEFAULT_PEAK_FRACTION = 0.70
FP8_PEAK_RATIO = 0.95
"""A large FP8 GEMM's fraction of the FP8 peak relative to a bf16 GEMM's fraction of the bf16
peak: fitted to the NeMo / Megatron-Bridge rows (grid 0.80-1.00; 0.95 on all of them, as on the
publisher-corrected 25.11 rows alone; on the draft 25.11 rows it sat at 1.0: FP8 GEMMs reach
nearly the same fraction of their doubled peak, the FP8 recipe's costs being elsewhere:
quantisation traffic, the bf16 attention core and LM head)."""
MOE_TOKEN_BYTES = 16.0
"""HBM bytes per routed token and hidden element an MoE layer's forward moves outside its GEMMs,
the backward twice that. Permuting the dispatched copies and unpermuting the combined ones
(bf16 read + write each) is 8; the fit to the NeMo / Megatron-Bridge rows gives 16 (grid 8-40; 16 on the 25.11 rows alone, 32 on their draft), so
this also carries what the model does not itemise for MoE layers (all-to-all staging copies,
router top-k / probability kernels, grouped-GEMM padding). The held-out Megatron-Core Mixtral
8x7B row (468 TFLOP/s) stays within its +-10% test."""

MOE_HOST_S_PER_LAUNCH = 5.0e-5
"""Host seconds per kernel a local expert launches in one MoE pass (plan/train/layer.py
``expert_kernel_sets``: Transformer Engine's GroupedLinear issues each local expert's kernels one by
one; a grouped GEMM or the device-initiated fused MLP once; a full-iteration CUDA graph never). The
kernels: per local expert, each of the two expert linears' GEMMs (a forward, a data- and a
weight-gradient GEMM backward) and, under an FP8 recipe, the quantisation kernels of each GEMM input
(plan/train/layer.py ``expert_launches``).

How the host's issue time bounds the layer (plan/train/layer.py ``layer_base`` / ``_layer_finish``):
under the dropless all-to-all dispatcher (``TrainOptions.moe_dispatcher = 'alltoall'``) the per-expert
token counts are copied to the host each pass to size the all-to-all and the grouped GEMMs, which
drains the stream, so the MoE block then runs no faster than the host issues its kernels: max(0,
host - GPU) is charged per pass (forward, backward, recomputed forward). Under the flex dispatchers
(DeepEP / HybridEP: buffers sized on the device, no count synchronisation) the host issues ahead and
the bound is the layer's whole pass: the forward lasts max(GPU, host), the backward with its
recomputation max(GPU, host) together. It binds on the 26.02.01+ flex rows of Qwen3-30B on 16 H100
and of DeepSeek-V3 on 256 B200 / B300 at 32 local experts (+31..+34% and +39% / +28% without it). It matters only where the layer's GPU work is small against it: many small local experts and
few tokens (Qwen3-30B-A3B: 16 local experts on B200 at micro-batch 1, on H100 under FP8 current
scaling, whose every quantisation is three kernels); Mixtral's one large local expert hides it.
Fitted to the NeMo / Megatron-Bridge rows (grid 0-80 us, benchmarks/calibrate_training.py): tens of
microseconds per eager PyTorch / Transformer Engine op, the order of its Python dispatch."""


def moe_host_launch_s(local_experts: float, launches_per_expert: float) -> float:
    """Host time of one MoE layer pass after the count synchronisation: ``launches_per_expert``
    kernels for each of ``local_experts`` (see MOE_HOST_S_PER_LAUNCH)."""
    return MOE_HOST_S_PER_LAUNCH * launches_per_expert * local_experts


PEAK_FRACTION_SOURCE = {
    "A100": "fitted to Narayanan et al. 2021 Table 1 (benchmarks/calibrate_training.py)",
    "Blackwell": "fitted to the NeMo / Megatron-Bridge B200 / GB200 / GB300 rows (benchmarks/calibrate_training.py)",
    "default": "assumption: large cuBLAS/hipBLASLt GEMMs on Hopper/CDNA3 reach 0.55-0.75 of dense peak",
}


def peak_fraction(device: "DeviceSpec") -> float:
    """The device family's achievable fraction of dense peak on a large GEMM."""
    name = device.name.upper()
    for family in ("GB300", "GB200", "B300", "B200"):
        if name.startswith(family):  # read at call time: the calibration refits it
            return BLACKWELL_PEAK_FRACTION["B200" if family == "B300" else family]
    for family, fraction in PEAK_FRACTION.items():
        if name.startswith(family.upper()):
            return fraction
    return DEFAULT_PEAK_FRACTION


def achieved(device) -> bool:
    """Whether ``device``'s peaks are achieved rates (a probed device: ``DeviceSpec.gemm_efficiency``
    > 0, ``hardware --probe`` writes 1.0), so no efficiency model applies on top of them: the one
    rule the training planner (``matmul_efficiency``, ``memory_bound_time_s``) and the serving
    planner (plan/serve/rates.py) follow."""
    return getattr(device, "gemm_efficiency", 0.0) > 0.0


def _ramp(d: float) -> float:
    return d / (d + RAMP_DIM)


def _padded(d: float) -> float:
    return d / (math.ceil(d / TILE) * TILE)


def matmul_efficiency(device: "DeviceSpec", m: float, n: float, k: float, dtype: str = "bf16") -> float:
    """Achievable fraction (0..1) of ``device``'s dense ``dtype`` peak for an (m x k) @ (k x n) GEMM."""
    if m <= 0 or n <= 0 or k <= 0:
        return 1.0
    if achieved(device):  # measured rates (a probed CPU): the GPU-fitted ramp and tile model do not apply
        return device.gemm_efficiency
    eff = peak_fraction(device) * _ramp(m) * _ramp(n) * _ramp(k) * _padded(m) * _padded(n)
    if dtype == "fp8":
        eff *= FP8_PEAK_RATIO
    peak = device.flops(dtype)
    elem = 1.0 if dtype in ("fp8", "int8") else 0.5625 if dtype == "fp4" else 2.0  # fp4: NVFP4 weights with their scales
    memory_s = elem * (m * k + k * n + m * n) / (device.hbm_bytes_per_s * HBM_EFFICIENCY)
    compute_s = 2.0 * m * n * k / (peak * eff)
    if memory_s > compute_s:
        eff = 2.0 * m * n * k / (peak * memory_s)
    return eff


def gemm_time_s(device: "DeviceSpec", m: float, n: float, k: float, batch: float = 1.0, dtype: str = "bf16") -> float:
    """Seconds for ``batch`` GEMMs of (m x k) @ (k x n) at the achievable rate."""
    if batch <= 0 or m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return batch * 2.0 * m * n * k / (device.flops(dtype) * matmul_efficiency(device, m, n, k, dtype))


def memory_bound_time_s(device: "DeviceSpec", nbytes: float) -> float:
    """Seconds for a kernel that streams ``nbytes`` through HBM (element-wise ops, norms, softmax);
    on a probed device at its measured rate (``achieved``) times its ``gemm_efficiency``."""
    return nbytes / (device.hbm_bytes_per_s * (device.gemm_efficiency if achieved(device) else HBM_EFFICIENCY))
