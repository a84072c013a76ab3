"""Weight and KV-cache dtypes for serving: bytes per element (scales included), the dtype the
GEMMs run in, and the usual quality cost of each, stated beside every plan that uses it.

What is quantised: the weight matrices inside the transformer layers (attention projections,
dense MLPs, shared and routed experts). The token embedding, the LM head, norms and the MoE
router stay in bf16, as the common recipes keep them (AutoAWQ / GPTQ leave ``lm_head``
unquantised; DeepSeek-V3's and Kimi K2's fp8 checkpoints keep embeddings, head and gate in bf16).

Scale overheads, per quantised weight:

* fp8 (e4m3) with 128x128 block scales in fp32 (the DeepSeek-V3 / Kimi K2 checkpoint format):
  4 bytes / 16384 weights.
* int8 W8A8 (SmoothQuant-style) with one fp16 scale per output channel: 2 bytes / fan-in.
* int4 W4A16 (AWQ / GPTQ) with group size 128: one fp16 scale and one packed 4-bit zero point
  per group, 2.5 bytes / 128 weights, so 0.5195 bytes per weight rather than 0.5.
* nvfp4 (``fp4`` is its alias): 4-bit e2m1 values with one fp8 (e4m3) scale per 16 weights and a
  per-tensor fp32 scale (negligible): 0.5 + 1/16 = 0.5625 bytes per weight (NVIDIA, "Introducing
  NVFP4 for Efficient and Accurate Low-Precision Inference", developer.nvidia.com, June 2025).
  W4A4: the GEMMs run on the FP4 tensor cores at the device's fp4 peak (Blackwell); a device
  without one dequantises to bf16 (W4A16, as vLLM's FP4 Marlin kernels on Hopper).
* mxfp4 (OCP Microscaling v1.0): e2m1 values with one e8m0 scale per 32 weights:
  0.5 + 1/32 = 0.53125 bytes per weight; the same FP4 peak on Blackwell.
* fp4 / nvfp4 KV cache: e2m1 with an fp8 scale per 16 elements, 0.5625 bytes per element
  (TensorRT-LLM's NVFP4 KV cache on Blackwell).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from modelcarve.spec.errors import LayoutError


@dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """How one weight dtype is stored and computed with."""

    name: str
    bytes_per_weight: float
    """Payload bytes per quantised weight, before scales."""
    scale_bytes: float
    """Bytes of scales (and zero points) per scale group."""
    group_size: int
    """Weights per scale group; 0 means one group per output channel (group = fan-in)."""
    compute_dtype: str
    """dtype the GEMMs run at (W8A8 runs at the fp8/int8 peak; W4A16 dequantises to bf16)."""
    quality: str
    """Usual quality impact, in words, with where that figure comes from."""

    def bytes_per_param(self, fan_in: int) -> float:
        """Stored bytes per quantised weight of a matrix with ``fan_in`` inputs, scales included."""
        group = self.group_size or fan_in
        return self.bytes_per_weight + self.scale_bytes / group


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat(
        name="fp32", bytes_per_weight=4.0, scale_bytes=0.0, group_size=1, compute_dtype="fp32",
        quality="reference precision; no loss",
    ),
    "bf16": WeightFormat(
        name="bf16", bytes_per_weight=2.0, scale_bytes=0.0, group_size=1, compute_dtype="bf16",
        quality="as released; no loss",
    ),
    "fp16": WeightFormat(
        name="fp16", bytes_per_weight=2.0, scale_bytes=0.0, group_size=1, compute_dtype="fp16",
        quality="as bf16 unless activations overflow fp16's range",
    ),
    "fp8": WeightFormat(
        name="fp8", bytes_per_weight=1.0, scale_bytes=4.0, group_size=128 * 128, compute_dtype="fp8",
        quality="near-lossless: DeepSeek-V3 and Kimi K2 are trained and released in fp8; fp8 W8A8 "
        "checkpoints of bf16 models typically stay within ~1% of the bf16 benchmark scores",
    ),
    "int8": WeightFormat(
        name="int8", bytes_per_weight=1.0, scale_bytes=2.0, group_size=0, compute_dtype="int8",
        quality="small loss: W8A8 SmoothQuant keeps perplexity within ~1% of fp16 on OPT/Llama "
        "(Xiao et al. 2023); needs calibration data",
    ),
    "int4": WeightFormat(
        name="int4", bytes_per_weight=0.5, scale_bytes=2.5, group_size=128, compute_dtype="bf16",
        quality="noticeable on hard tasks: 4-bit g128 (AWQ, GPTQ, round-to-nearest) adds about 0.1-0.3 "
        "WikiText-2 perplexity to Llama-2 (Lin et al., AWQ, MLSys 2024); losses grow on reasoning and code",
    ),
}
_NVFP4_QUALITY = (
    "small: NVIDIA reports NVFP4 DeepSeek-R1-0528 within 1% of its FP8 scores on the key benchmarks "
    "(NVIDIA, 'Introducing NVFP4 for Efficient and Accurate Low-Precision Inference', June 2025); "
    "needs a calibrated (ModelOpt) checkpoint; Blackwell runs it at the FP4 peak"
)
WEIGHT_FORMATS["nvfp4"] = WeightFormat(
    name="nvfp4", bytes_per_weight=0.5, scale_bytes=1.0, group_size=16, compute_dtype="fp4", quality=_NVFP4_QUALITY,
)
WEIGHT_FORMATS["fp4"] = dataclasses.replace(WEIGHT_FORMATS["nvfp4"], name="fp4")
WEIGHT_FORMATS["mxfp4"] = WeightFormat(
    name="mxfp4", bytes_per_weight=0.5, scale_bytes=1.0, group_size=32, compute_dtype="fp4",
    quality="none for models trained for it (gpt-oss's experts are trained and released in MXFP4, OpenAI "
    "gpt-oss model card, arXiv 2508.10925); post-training MXFP4 of a bf16 model loses more than NVFP4 "
    "(power-of-two scales over 32 weights; NVIDIA's NVFP4 article, June 2025)",
)

KV_FORMATS: dict[str, tuple[float, str]] = {
    "fp32": (4.0, "reference precision"),
    "bf16": (2.0, "no loss"),
    "fp16": (2.0, "no loss"),
    "fp8": (1.0, "near-lossless with per-tensor scales (vLLM/TensorRT-LLM fp8 KV cache)"),
    "int8": (1.0, "small loss; needs per-head or per-token scales"),
    "fp4": (0.5625, "small: NVFP4 KV cache (e2m1, fp8 scale per 16 elements); NVIDIA reports it within 1% of "
            "an FP8 KV cache on long-context benchmarks (NVIDIA technical blog on NVFP4 KV cache, TensorRT-LLM, 2025)"),
}
KV_FORMATS["nvfp4"] = KV_FORMATS["fp4"]


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise LayoutError(f"weight_dtype={name!r} is not one of: {', '.join(WEIGHT_FORMATS)}") from None


def kv_bytes(name: str) -> float:
    """Bytes per KV-cache element (per-tensor scales are negligible)."""
    try:
        return KV_FORMATS[name][0]
    except KeyError:
        raise LayoutError(f"kv_dtype={name!r} is not one of: {', '.join(KV_FORMATS)}") from None


def quality_note(weight_dtype: str, kv_dtype: str = "bf16") -> str:
    """One line saying what these dtypes usually cost in quality."""
    note = f"weights {weight_dtype}: {weight_format(weight_dtype).quality}"
    if kv_dtype not in ("bf16", "fp16", "fp32"):
        note += f"; KV {kv_dtype}: {KV_FORMATS[kv_dtype][1]}"
    return note


# Short form for tables, ordered from no loss to most loss.
QUALITY_SHORT = {"fp32": "none", "bf16": "none", "fp16": "none", "fp8": "~none", "int8": "small", "int4": "noticeable",
                 "fp4": "small", "nvfp4": "small", "mxfp4": "small"}
QUALITY_FLOOR = ("bf16", "fp8")
"""Weight dtypes the serving search considers unless ``--weight-dtypes`` widens it: near-lossless ones."""
