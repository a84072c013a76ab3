"""The serving goals at a request rate (``plan`` / ``estimate --goal serve-* --rate``): a layout
must sustain the rate, TPOT is that of the batch the rate keeps in flight (Little's law), and
TTFT carries the M/D/1 queue wait (issue 27 item 1).

The figures of the model itself (a decode round, a prompt's prefill) are read from
``plan/serve/time.py``'s ``_rates``; what is checked by hand is the arithmetic the rate adds:
which batch, which capacity, which wait."""

import json

import pytest

from modelcarve.cli import main
from modelcarve.plan.search import search
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.time import _rates
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster

RATE = "capacity below the request rate"  # plan/serve/goal.py's category


def _time_in_system(c, b: int) -> float:
    """A request's seconds in the engine at batch ``b``: 256 tokens at TPOT(b) plus its own prefill."""
    return c.output_len * _rates(c, b)[1] + c.input_len * c.prefill_token_s


def test_plan_latency_at_rate_uses_the_sustained_batch_and_the_queue():
    """llama-3.1-8b on 8xH100 at 20 requests/s, 2048 in / 256 out: the winner is TP8 fp8/fp8.

    Before: TP8 at batch 1 (TPOT 2.39 ms, no queue) although batch 1 carries at most 1.6
    requests/s. Now the batch is the one the rate keeps in flight. Little's law, N = rate x T(N),
    with T(b) = 256 x TPOT(b) + the request's own prefill (8.80 ms of batched prefill):
      b = 15: TPOT 2.990 ms, T = 256 x 2.990 + 8.80 = 774.2 ms, 20 x 0.7742 = 15.48 > 15: too few;
      b = 16: TPOT 3.033 ms, T = 256 x 3.033 + 8.80 = 785.2 ms, 20 x 0.7852 = 15.70 <= 16.
    So N = 16 and the TPOT shown is TPOT(16) = 3.03 ms.
    Capacity: the full batch (1024, no bounds) decodes at the engine's host floor (GPU round 15.17 ms <
    1024 x 29.37 us = 30.07 ms, serve_rates.ENGINE_SEQ_HOST_S) and completes 1024 / (256 x 30.07 ms + 1024 x
    8.80 ms) = 1024 / 16.71 s = 61.3 requests/s (79.9 before the floor). M/D/1: rho = 20 / 61.3 = 0.326,
    W = rho / (2 mu (1 - rho)) = 0.326 / (2 x 61.3 x 0.674) = 3.96 ms, added to the unqueued TTFT
    (prefill 9.45 ms + one decode round 2.52 ms = 11.97 ms): 15.92 ms. (The prefills' attention is priced at
    the attention peak, bf16, since the attention-peak change: 8.72 / 9.37 ms before, capacity 61.6/s, TTFT 15.78 ms.)"""
    model, cluster = get_model("llama-3.1-8b"), parse_cluster("8xH100")
    best = search(model, cluster, "serve-latency", top=1, rate=20)["layouts"][0]
    assert best["name"] == "TP8 wfp8/kvfp8"
    c = layout_costs(model, cluster, 8, 1, 1, 1, "fp8", "fp8", 2048, 256)
    assert 20 * _time_in_system(c, 15) > 15 and 20 * _time_in_system(c, 16) <= 16
    serve, q = best["serve"], best["queue"]
    assert serve["batch"] == q["batch"] == 16 and q["full_batch"] == 1024
    assert serve["tpot_s"] == pytest.approx(_rates(c, 16)[1], rel=1e-12)
    assert serve["tpot_s"] == pytest.approx(3.03e-3, abs=0.01e-3)
    round_full = _rates(c, 1024)[0]
    mu = 1024 / (256 * round_full + 1024 * c.input_len * c.prefill_token_s)
    assert q["capacity_rps"] == pytest.approx(mu, rel=1e-9) and mu == pytest.approx(61.26, abs=0.01)
    rho = 20 / mu
    wait = rho / (2 * mu * (1 - rho))
    assert q["wait_s"] == pytest.approx(wait, rel=1e-9) and wait == pytest.approx(3.96e-3, abs=0.01e-3)
    assert serve["ttft_s"] == pytest.approx(c.prefill_s + _rates(c, 16)[0] + wait, rel=1e-9)
    assert serve["ttft_s"] == pytest.approx(15.92e-3, abs=0.01e-3)


def test_plan_rejects_layouts_below_the_rate_and_says_so():
    """At 100 requests/s one TP8 replica (capacity 79.9 requests/s, above) cannot keep up: every
    TP8 candidate is rejected as "capacity below the request rate", as is TP4-DP2 fp8/bf16
    (2 replicas of 49.4 = 98.7 < 100); the winner sustains the rate with replicas to spare
    (TP2-DP4: 4 x 39.7 = 158.7 requests/s)."""
    model, cluster = get_model("llama-3.1-8b"), parse_cluster("8xH100")
    plan = search(model, cluster, "serve-latency", top=5, rate=100)
    assert plan["rejected"].get(RATE, 0) > 0
    assert all(not r["name"].startswith("TP8 ") for r in plan["layouts"])
    assert all(r["queue"]["capacity_total_rps"] > 100 for r in plan["layouts"])
    reasons = [a["reject_reason"] for a in plan["alternatives"] if a.get("reject_category") == RATE]
    assert reasons and "at or below --rate 100" in reasons[0] and "grow without bound" in reasons[0]
    tp4 = [a for a in plan["alternatives"] if a.get("reject_category") == RATE][0]
    assert tp4["queue"]["capacity_total_rps"] < 100


def test_estimate_throughput_at_rate_reports_the_sustained_batch(capsys):
    """estimate --goal serve-throughput --rate 20 --layout tp=2,weight_dtype=fp8 on 8xH100: four
    TP2 replicas, 5 requests/s each. Before: TPOT of the full-load batch (472 sequences, 60 ms)
    beside "16% of capacity". Now: T(b) = 256 x TPOT(b) + 15.33 ms of own prefill;
      b = 5: TPOT 3.87 ms, T = 1.006 s, 5 x 1.006 = 5.03 > 5: too few;
      b = 6: TPOT 3.96 ms, T = 1.029 s, 5 x 1.029 = 5.15 <= 6.
    So 6 sequences per replica and TPOT(6) = 3.96 ms; the capacity is still the full batch's."""
    args = ["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-8b", "--cluster", "8xH100",
            "--layout", "tp=2,weight_dtype=fp8,kv_dtype=fp8", "--rate", "20", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    serve, q = result["serve"], result["queue"]
    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 2, 1, 1, 4, "fp8", "fp8", 2048, 256)
    assert 5 * _time_in_system(c, 5) > 5 and 5 * _time_in_system(c, 6) <= 6
    assert serve["batch"] == q["batch"] == 6 and q["full_batch"] > 400
    assert serve["tpot_s"] == pytest.approx(_rates(c, 6)[1], rel=1e-12)
    assert serve["tpot_s"] == pytest.approx(3.96e-3, abs=0.01e-3)
    assert q["rate_per_replica_rps"] == 5.0 and q["utilisation"] < 0.2
    full = _rates(c, q["full_batch"])
    assert q["capacity_rps"] == pytest.approx(full[3] / 256, rel=1e-12)


def test_estimate_latency_at_rate_batches_instead_of_refusing(capsys):
    """estimate --goal serve-latency --rate 20 --layout tp=8 on 8xH100 (bf16): before, refused
    ("above its capacity of 1.41 requests/s": batch 1's). A TP8 replica batches: 20 requests/s
    keep 21 in flight, well inside its capacity at the full batch (57.6 requests/s)."""
    args = ["estimate", "--goal", "serve-latency", "--model", "llama-3.1-8b", "--cluster", "8xH100",
            "--layout", "tp=8", "--rate", "20", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["queue"]["stable"] and result["serve"]["batch"] == 21
    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 8, 1, 1, 1, "bf16", "bf16", 2048, 256)
    assert 20 * _time_in_system(c, 20) > 20 and 20 * _time_in_system(c, 21) <= 21


def test_rate_must_be_positive():
    with pytest.raises(Exception, match="--rate"):
        search(get_model("llama-3.1-8b"), parse_cluster("8xH100"), "serve-latency", rate=0)
