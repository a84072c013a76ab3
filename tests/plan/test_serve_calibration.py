"""The serving planner against published, measured serving results (data/serving_published.csv:
TensorRT-LLM's H100 / H200 FP8 and B200 / GB200 NVFP4 throughput tables, vLLM batch-1 latencies on A100
and H100, gpt-fast's batch-1 tensor-parallel sweep, SGLang's disaggregated DeepSeek; every source cited in
its header)."""

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

MOE_MODELS = ("qwen3-235b-a22b", "llama-4-scout", "llama-4-maverick")


def added_perf_overview_row(r: dict) -> bool:
    """The 110 rows transcribed later from the same TensorRT-LLM page (perf-overview.md @ 00f37686): its H200
    FP8 columns of Llama-3.1-8B / Llama-3.3-70B / Llama-3.1-405B, the FP8 columns of its MoE tables
    (Qwen3-235B-A22B, Llama-4-Scout, Llama-4-Maverick on H200 and H100) and the NVFP4 columns of its Llama 4
    tables (B200, GB200). They have their own tests below; the first calibration's tests keep their rows."""
    if r["source"] == "trtllm":
        return r["device"] == "H200" or r["model"] in MOE_MODELS
    return r["source"] == "trtllm-fp4" and r["model"].startswith("llama-4")


def test_independent_checks_from_two_sources_within_tolerance(rows):
    """The first calibration's 31 checks (TensorRT-LLM's H100 dense Llama tables, vLLM H100); the rows added
    later from the same page (``added_perf_overview_row``) are tested below. Measured: 31 of 31 within 20%,
    median |error| 7.2%, worst +13.7%, with Llama-3.1-405B's KV cache in bf16 as its checkpoint states
    (data/serving_published.csv header) and TensorRT-LLM's own KV memory rule (``memory.ENGINE_MEMORY_RULES``).
    Before: fp8 KV and vLLM's rule, 29 of 31 (405B +26%, +29%); bf16 KV under vLLM's rule, 27 of 31 (405B -21% to
    -25%: 0.9 of the device left its KV 4.9 GiB a device short of what TensorRT-LLM gives it)."""
    checks = [r for r in rows if r["role"] == "check" and r["source"] in ORIGINAL and not added_perf_overview_row(r)]
    assert len(checks) == 31
    assert {"trtllm", "vllm-h100"} <= {r["source"] for r in checks}
    errors = [abs(r["error"]) for r in checks]
    # Most within +-20%, the median well inside, none wildly off (the misses: docs/calibration_serving.md).
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
    checks' 30% bound, and most rows within the issue's 20%. The 28 Llama 4 NVFP4 rows added later from the
    same tables are not among these 40 (test_added_llama4_rows)."""
    checks = [r for r in rows if r["role"] == "check" and r["source"] == "trtllm-fp4" and r["model"] != "qwen3-30b-a3b"
              and not added_perf_overview_row(r)]
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


def test_added_perf_overview_rows_are_all_answered(rows):
    """Every row added later from TensorRT-LLM's perf-overview tables (``added_perf_overview_row``) is a check
    the planner answers: 82 FP8 rows (source trtllm) and 28 NVFP4 rows (trtllm-fp4), none refused as not
    fitting, none erroring."""
    added = [r for r in rows if added_perf_overview_row(r)]
    assert sum(r["source"] == "trtllm" for r in added) == 82 and sum(r["source"] == "trtllm-fp4" for r in added) == 28
    assert all(r["role"] == "check" and r["metric"] == "output_tokens_per_s" and r["concurrency"] == 0 for r in added)
    assert all(r["predicted"] == r["predicted"] and r["predicted"] > 0 and r["batch"] for r in added)
    groups = {}
    for r in added:
        groups[(r["model"], r["device"], r["layout"])] = groups.get((r["model"], r["device"], r["layout"]), 0) + 1
    assert groups == {
        ("llama-3.1-8b", "H200", "DP1"): 10, ("llama-3.1-70b", "H200", "DP1"): 10, ("llama-3.1-405b", "H200", "TP8"): 10,
        ("qwen3-235b-a22b", "H200", "TP8"): 10, ("qwen3-235b-a22b", "H100", "TP8"): 7,
        ("llama-4-scout", "H200", "TP4"): 10, ("llama-4-scout", "H100", "TP4"): 8,
        ("llama-4-maverick", "H200", "TP8"): 10, ("llama-4-maverick", "H100", "TP8"): 7,
        ("llama-4-scout", "B200", "DP1"): 10, ("llama-4-scout", "GB200", "DP1"): 10, ("llama-4-maverick", "B200", "TP8"): 8,
    }


def test_added_h200_dense_llama_checks(rows):
    """The 30 H200 FP8 rows of Llama-3.1-8B (TP1), Llama-3.3-70B (TP1) and Llama-3.1-405B (TP8). Measured:
    30 of 30 within 20%, median |error| 5.2%, worst +17.3% (8B 2048/128); the 405B rows -8.2% to +6.1% with
    their KV cache in bf16 as the checkpoint states (in fp8 they were all over-predicted, +0.9% to +20.2%).
    Asserted: the original checks' bounds."""
    checks = [r for r in rows if added_perf_overview_row(r) and r["model"].startswith("llama-3")]
    assert len(checks) == 30 and {r["device"] for r in checks} == {"H200"}
    errors = [abs(r["error"]) for r in checks]
    assert sum(e <= TOLERANCE for e in errors) >= 0.9 * len(errors)
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.30


def test_added_qwen3_235b_fp8_checks(rows):
    """The 17 Qwen3-235B-A22B FP8 rows (H200 TP8, ten; H100 TP8, seven), transcribed at TP8 with ep 1 (EP not
    stated; attention DP per the MoE llm_options). Measured: 12 of 17 within 20%, worst +34.1% (H200 5000/500);
    the misses are H200 128/2048 (-28.5%: the planner's batch stops at its 1024 cap for the whole TP group),
    5000/500 (+34.1%) and 20000/2000 (+28.7%), H100 128/2048 (+21.9%) and 5000/500 (+21.3%): the H100 rows are
    +5.8% to +21.9% with TensorRT-LLM's KV memory rule (+3.0% to +19.7% under vLLM's, which gave them 10% of
    the weights less KV cache). Asserted: that state, so a regression shows."""
    qwen = [r for r in rows if added_perf_overview_row(r) and r["model"] == "qwen3-235b-a22b"]
    assert len(qwen) == 17
    errors = [abs(r["error"]) for r in qwen]
    assert sum(e <= TOLERANCE for e in errors) >= 12
    assert max(errors) <= 0.35
    assert all(abs(r["error"]) <= 0.25 for r in qwen if r["device"] == "H100")


def test_added_llama4_rows(rows):
    """The 63 Llama 4 rows: Scout FP8 H200 TP4 (10) and H100 TP4 (8), Maverick FP8 H200 TP8 (10) and H100 TP8 (7),
    Scout NVFP4 on one B200 (10) and one GB200 (10), Maverick NVFP4 B200 TP8 (8). Scout's KV cache is priced
    in bf16, inferred from its rows (the page names no Scout checkpoint; data/serving_published.csv header):
    with fp8 its 38 rows had 3 within 20%, all over-predicted (+24% to +130%). Measured: 37 of 63 within 20%
    (Scout 27 of 38, -30% to +36%), median |error| 16.5%, mean 30.1%, worst +167.9% (Maverick H100 128/4096);
    38 (Scout 28, mean 29.9%) before the training constants were fitted to every release (B200 / GB200 GEMM
    fractions 0.55 / 0.60 against 0.75 / 0.675, FP4_GEMM_FRACTION refitted 0.49 -> 0.68: Scout's GB200 FP4 rows
    moved up about 5%, its 2048/128 row +6.5% -> +19.3%, 128/128 +25.8% -> +32.3%).
    Not explained here (docs/calibration_serving.md lists them): every Maverick H100 row is over-predicted
    (+57% to +168% with TensorRT-LLM's KV memory rule, +50% to +149% under vLLM's: the page's H200 / H100 ratio
    is 2.5-3.8x, the planner's 1.2-2.0x); Maverick's short rows
    on H200/B200 are under-predicted (128/128 -53% / -51%; the planner's batch stops at its 1024 cap for the TP
    group). Asserted: that state, so a regression (or an improvement to record) shows."""
    llama4 = [r for r in rows if added_perf_overview_row(r) and r["model"].startswith("llama-4")]
    assert len(llama4) == 63
    errors = [abs(r["error"]) for r in llama4]
    assert sum(errors) / len(errors) < 0.31
    assert max(errors) <= 1.7
    assert sum(e <= TOLERANCE for e in errors) >= 37
    scout = [r for r in llama4 if r["model"] == "llama-4-scout"]
    assert all(r["kv_dtype"] == "bf16" for r in scout) and sum(abs(r["error"]) <= TOLERANCE for r in scout) >= 27


def test_tensorrt_llm_rows_are_priced_with_its_kv_memory_rule(rows):
    """Every TensorRT-LLM row is priced with TensorRT-LLM's own KV-cache rule (``free_gpu_memory_fraction`` 0.9 of
    what the weights leave, ``memory.ENGINE_MEMORY_RULES``), not vLLM's 0.9 of the device: Llama-3.1-405B FP8 on 8 H100
    (bf16 KV, 128/4096) runs at the largest batch the free rule fits, which the device rule does not."""
    from modelcarve.plan.serve.calibration import ENGINE_OF_SOURCE
    from modelcarve.plan.serve.memory import ENGINE_MEMORY_RULES, max_sequences, shard_facts
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import get_device

    assert {ENGINE_OF_SOURCE[s] for s in ("trtllm", "trtllm-fp4")} == {"trtllm"}
    row = next(r for r in rows if r["source"] == "trtllm" and r["model"] == "llama-3.1-405b" and r["device"] == "H100"
               and (r["input_len"], r["output_len"]) == (128, 4096))
    f = shard_facts(get_model("llama-3.1-405b"), tp=8, weight_dtype="fp8", kv_dtype="bf16")
    memory = get_device("H100").memory_bytes
    free = max_sequences(f, memory, 128 + 4096, rule=ENGINE_MEMORY_RULES["trtllm"])
    assert row["kv_dtype"] == "bf16" and row["batch"] == free > max_sequences(f, memory, 128 + 4096)
