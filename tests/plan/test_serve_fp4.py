"""FP4 serving against hand-derived figures: NVFP4 / MXFP4 weight bytes (scales included), NVFP4 KV
bytes, the FP4 peak on Blackwell and the bf16 fallback elsewhere, and the quality floor."""

import pytest

from modelcarve.plan.cost.quant import KV_FORMATS, WEIGHT_FORMATS, quality_note
from modelcarve.plan.search import search
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.memory import shard_facts
from modelcarve.plan.serve import rates as serve_rates
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

# Llama-3.1-8B: h 4096, 32 layers, 32 heads / 8 kv heads of 128, ffn 14336, vocab 128256, untied.
H, LAYERS, VOCAB = 4096, 32, 128256
ATTN = H * (2 * 32 * 128 + 2 * 8 * 128)  # q, o: h x 4096; k, v: h x 1024
MLP = 3 * H * 14336
EMBED = VOCAB * H * 2  # bf16
NORMS = (LAYERS * 2 * H + H) * 2


def test_scale_overheads_per_weight():
    assert WEIGHT_FORMATS["nvfp4"].bytes_per_param(H) == 0.5 + 1 / 16  # one e4m3 scale per 16
    assert WEIGHT_FORMATS["mxfp4"].bytes_per_param(H) == 0.5 + 1 / 32  # one e8m0 scale per 32
    assert WEIGHT_FORMATS["fp4"].bytes_per_param(H) == WEIGHT_FORMATS["nvfp4"].bytes_per_param(H)
    assert KV_FORMATS["fp4"][0] == 0.5625


@pytest.mark.parametrize("dtype,per_weight", [("nvfp4", 0.5625), ("mxfp4", 0.53125)])
def test_fp4_weight_bytes_are_hand_derived(dtype, per_weight):
    expected = LAYERS * (ATTN + MLP) * per_weight + 2 * EMBED + NORMS
    f = shard_facts(get_model("llama-3.1-8b"), tp=1, weight_dtype=dtype)
    assert f.weights_bytes == pytest.approx(expected, rel=1e-12)
    # 6.98e9 layer weights x 0.5625 + 2.10e9 bf16 embedding and head = 6.03e9 bytes for NVFP4
    if dtype == "nvfp4":
        assert expected == 6_027_747_328


def test_fp4_kv_cache_bytes_per_token():
    f = shard_facts(get_model("llama-3.1-8b"), tp=1, weight_dtype="nvfp4", kv_dtype="fp4")
    assert f.kv_bytes_per_token == LAYERS * 2 * 8 * 128 * 0.5625 == 36_864


def test_fp4_gemms_run_at_the_fp4_peak_on_blackwell_and_bf16_elsewhere():
    model = get_model("llama-3.1-8b")
    # the FP4 dense peak times the one fitted FP4 fraction (serve_rates.FP4_GEMM_FRACTION)
    frac = serve_rates.FP4_GEMM_FRACTION
    for cluster, dtype, peak in (("B200", "fp4", 9.0e15 * frac), ("GB200", "fp4", 1.0e16 * frac), ("H100", "bf16", 989.4e12)):
        c = layout_costs(model, parse_cluster(cluster), 1, 1, 1, 1, "nvfp4", "fp4", 2048, 256)
        assert (c.compute_dtype, c.peak) == (dtype, peak), cluster
    # Decode at batch 1 streams the weights: the GEMM side of a step is the layer weights over the
    # achievable HBM rate (B200: 8 TB/s x the fitted decode efficiency).
    c = layout_costs(model, parse_cluster("B200"), 1, 1, 1, 1, "nvfp4", "fp4", 2048, 256)
    layer_weights = LAYERS * (ATTN + MLP) * 0.5625 + EMBED + NORMS  # the input embedding is not read whole
    assert c.weights_fixed == pytest.approx(layer_weights, rel=1e-12)
    assert c.weights_fixed / c.hbm == pytest.approx(layer_weights / (8e12 * serve_rates.DECODE_HBM_EFFICIENCY), rel=1e-12)


def test_fp4_prefill_is_faster_than_fp8_by_at_most_the_peak_ratio():
    """Compute-bound prefill: FP4's dense peak is twice FP8's on B200 (FP4_GEMM_FRACTION of it reached), so it takes at
    least half as long (the GEMM efficiency model is shared; attention and collectives do not speed up)."""
    from modelcarve.plan.serve.time import serve_time

    model, cl = get_model("llama-3.1-70b"), parse_cluster("B200")
    fp8 = serve_time(model, cl, weight_dtype="fp8", kv_dtype="fp8", input_len=8192, output_len=16)
    fp4 = serve_time(model, cl, weight_dtype="nvfp4", kv_dtype="fp4", input_len=8192, output_len=16)
    assert 0.5 * fp8.prefill_s <= fp4.prefill_s < fp8.prefill_s


def test_quality_floor_by_default_and_widened_on_request():
    model, cl = get_model("llama-3.1-70b"), parse_cluster("2xB200")
    shape = dict(input_len=2048, output_len=256)
    default = search(model, cl, "serve-throughput", top=20, **shape)
    assert {r["layout"]["weight_dtype"] for r in default["layouts"]} <= {"bf16", "fp8"}
    wide = search(model, cl, "serve-throughput", top=5, weight_dtypes="bf16,fp8,int4,fp4", kv_dtypes="fp8,fp4", **shape)
    best = wide["layouts"][0]
    assert best["layout"]["weight_dtype"] == "fp4" and best["quality_short"] == "small"
    assert "NVFP4" in best["quality"] and "June 2025" in best["quality"]
    assert any("quality:" in w for w in best["warnings"])
    assert "gpt-oss" in quality_note("mxfp4")
