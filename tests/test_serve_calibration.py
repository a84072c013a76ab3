"""The serving planner against published, measured serving results (data/serving_published.csv:
TensorRT-LLM's H100 FP8 throughput table and two vLLM batch-1 latencies, cited in its header)."""

import statistics
from pathlib import Path

import pytest

from modelcarve.plan.serve_calibration import FIT_SOURCES, TOLERANCE, calibrate

DATA = Path(__file__).resolve().parent.parent / "data" / "serving_published.csv"


@pytest.fixture(scope="module")
def rows():
    return calibrate(DATA)


def test_every_source_is_predicted_within_tolerance_somewhere(rows):
    sources = {r["source"] for r in rows}
    assert {"trtllm", "vllm-a100", "vllm-h100"} <= sources
    for source in sources:
        mine = [r for r in rows if r["source"] == source]
        assert any(abs(r["error"]) <= TOLERANCE for r in mine), source


def test_batch_one_latency_within_tolerance(rows):
    latency = [r for r in rows if r["metric"] == "tpot_ms"]
    independent = [r for r in latency if r["source"] not in FIT_SOURCES]
    assert len(latency) >= 2 and independent
    for r in latency:
        assert abs(r["error"]) <= TOLERANCE, r
    # The fitted constant reproduces its own row (the fit is not silently out of date).
    fit = [r for r in latency if r["source"] in FIT_SOURCES]
    assert all(abs(r["error"]) < 0.02 for r in fit)


def test_throughput_table(rows):
    table = [r for r in rows if r["source"] == "trtllm"]
    assert len(table) == 30
    errors = [abs(r["error"]) for r in table]
    # Most rows within +-20%, the median well inside, none wildly off: the misses (listed in
    # docs/calibration_serving.md) are Llama-3.1-405B at TP8 with long outputs, over-predicted.
    assert sum(e <= TOLERANCE for e in errors) >= 0.8 * len(errors)
    assert statistics.median(errors) <= 0.15
    assert max(errors) <= 0.45
