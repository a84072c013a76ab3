"""The serving planner against published, measured serving results (data/serving_published.csv:
TensorRT-LLM's H100 FP8 throughput table, vLLM batch-1 latencies on A100 and H100, gpt-fast's
batch-1 tensor-parallel sweep; every source cited in its header)."""

import statistics
from pathlib import Path

import pytest

from modelcarve.plan.serve import rates as serve_rates
from modelcarve.plan.serve.calibration import TOLERANCE, calibrate, fit_decode_constants, fit_fp4_fraction

DATA = Path(__file__).resolve().parents[2] / "data" / "serving_published.csv"


@pytest.fixture(scope="module")
def rows():
    return calibrate(DATA)


ORIGINAL = ("trtllm", "vllm-a100", "vllm-h100", "gpt-fast")
"""The sources of the first calibration (H100/A100, bf16/fp8); the FP4 / Blackwell / disaggregated rows have their own tests."""


def test_independent_checks_from_two_sources_within_tolerance(rows):
    checks = [r for r in rows if r["role"] == "check" and r["source"] in ORIGINAL]
    assert {"trtllm", "vllm-h100"} <= {r["source"] for r in checks}
    errors = [abs(r["error"]) for r in checks]
    # Most within +-20%, the median well inside, none wildly off: the misses (listed in
    # docs/calibration_serving.md) are Llama-3.1-405B at TP8 with long outputs, over-predicted.
    assert sum(e <= TOLERANCE for e in errors) >= 0.9 * len(errors)
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.30
    for r in checks:
        if r["metric"] == "tpot_ms":
            assert abs(r["error"]) <= TOLERANCE, r


def test_fit_rows_are_reproduced(rows):
    fits = [r for r in rows if r["role"] == "fit"]
    assert len(fits) == 8
    assert all(abs(r["error"]) < 0.05 for r in fits)


def test_decode_constants_are_the_fit():
    """The constants in serve_rates.py are what the fit gives (to one grid step): not stale."""
    fit = fit_decode_constants(DATA, grid=41)
    assert fit["DECODE_HBM_EFFICIENCY"] == pytest.approx(serve_rates.DECODE_HBM_EFFICIENCY, abs=0.011)
    assert fit["LAYER_OVERHEAD_S"] == pytest.approx(serve_rates.LAYER_OVERHEAD_S, abs=2.1e-6)
    assert fit["ALLREDUCE_FLOOR_S"] == pytest.approx(serve_rates.ALLREDUCE_FLOOR_S, abs=1.6e-6)
    assert fit["rms_log_error"] < 0.03


def test_fp4_fraction_is_the_fit_and_reproduces_its_rows(rows):
    """One constant (FP4_GEMM_FRACTION) fitted to TensorRT-LLM's ten Llama-3.1-405B NVFP4 rows on 4 B200."""
    fits = [r for r in rows if r["role"] == "fit-fp4"]
    assert len(fits) == 10 and all(abs(r["error"]) <= TOLERANCE for r in fits)
    fit = fit_fp4_fraction(DATA)
    assert fit["FP4_GEMM_FRACTION"] == pytest.approx(serve_rates.FP4_GEMM_FRACTION, abs=0.011)  # one grid step


def test_fp4_blackwell_checks(rows):
    """The independent FP4 rows (B200 and GB200; Llama-3.3-70B TP1, Llama-3.1-405B TP4 on GB200,
    Qwen3-235B TP8). Measured: 37 of 40 within +-20% with GB200's GEMM peak fraction at 0.625; 35 of 40
    (median |error| 11.1%, max 26.2%) since the training calibration refitted it to 0.6 (plan/cost/efficiency.py,
    shared by both planners): the misses are the 128/128 rows on GB200 (-22%, -20%) and Qwen3-235B TP8 at
    128/128, 128/2048 and 5000/500 (docs/calibration_serving.md). Asserted: no row beyond the original
    checks' 30% bound, and most rows within the issue's 20%."""
    checks = [r for r in rows if r["role"] == "check" and r["source"] == "trtllm-fp4" and r["model"] != "qwen3-30b-a3b"]
    assert len(checks) == 40 and {r["device"] for r in checks} == {"B200", "GB200"}
    errors = [abs(r["error"]) for r in checks]
    assert max(errors) <= 0.30
    assert sum(e <= TOLERANCE for e in errors) > 0.8 * len(errors)


def test_qwen3_30b_a3b_host_floor(rows):
    """Qwen3-30B-A3B NVFP4 on one B200 / GB200 (20 rows, checks since the host floor
    serve_rates.ENGINE_SEQ_HOST_S, a published figure, not fitted). Measured: mean |error| 131% -> 62%;
    within 20%: B200 128/128 (-19.8%), 128/2048 (-10%), GB200 128/2048 (+8%); the long-context and
    prefill-heavy rows stay 30-150% high (not explained). Since the routed experts' prefill GEMMs run at
    their own rows (512 a chunk here: plan/serve/layout_costs.py ``_prefill_fixed``) every row's prefill
    is a little slower: mean |error| 56%, B200 128/128 -20.3%. Asserted: that state, so a regression
    shows: the two 128/2048 rows within 20%, B200 128/128 inside the original checks' 30% bound."""
    qwen = [r for r in rows if r["model"] == "qwen3-30b-a3b"]
    assert len(qwen) == 20 and all(r["role"] == "check" for r in qwen)
    assert sum(abs(r["error"]) for r in qwen) / len(qwen) < 0.7
    short = {(r["device"], r["input_len"], r["output_len"]): r["error"] for r in qwen}
    assert abs(short[("B200", 128, 128)]) <= 0.30 and abs(short[("B200", 128, 2048)]) <= TOLERANCE
    assert abs(short[("GB200", 128, 2048)]) <= TOLERANCE


def test_disaggregated_phases_within_tolerance(rows):
    """SGLang's 96-H100 DeepSeek deployment: prefill unit (EP32) and decode unit (EP72 with 32 redundant
    experts, EPLB: 288 physical experts, 4 a GPU, as it ran), per device, no constant fitted to them."""
    disagg = [r for r in rows if r["source"] == "sglang-disagg"]
    decode = [r for r in disagg if r["metric"] == "decode_tokens_per_s_per_device"]
    assert [(r["devices"], r["layout"]) for r in decode] == [(72, "DP72-EP72-EPLB32")]
    assert {r["metric"] for r in disagg} == {"prefill_tokens_per_s_per_device", "decode_tokens_per_s_per_device"}
    assert all(abs(r["error"]) <= TOLERANCE for r in disagg)
