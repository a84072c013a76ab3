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
    So N = 16 sequences in flight on average. A request decodes beside itself and, on average,
    rate x T others (Poisson arrivals: plan/serve/batch.py ``at_rate``): n = 1 + 20 x T(n), with TPOT
    and TTFT interpolated between the whole batches: n = 16.90 (T = 256 x 3.0716 + 8.80 = 795.1 ms,
    1 + 20 x 0.7951 = 16.90), TPOT = TPOT(16) + 0.90 x (TPOT(17) - TPOT(16)) = 3.033 + 0.90 x 0.043
    = 3.07 ms (before: TPOT(16) = 3.03 ms, the request itself left out of its batch).
    Capacity: the full batch (1024, no bounds) decodes at the engine's host floor (GPU round 15.17 ms <
    1024 x 29.37 us = 30.07 ms, serve_rates.ENGINE_SEQ_HOST_S) and completes 1024 / (256 x 30.07 ms + 1024 x
    8.80 ms) = 1024 / 16.71 s = 61.3 requests/s (79.9 before the floor). M/D/1: rho = 20 / 61.3 = 0.326,
    W = rho / (2 mu (1 - rho)) = 0.326 / (2 x 61.3 x 0.674) = 3.96 ms, added to the unqueued TTFT
    (prefill 9.45 ms + one decode round 2.52 ms, interpolated at n = 11.97 ms): 15.93 ms. (The prefills' attention is priced at
    the attention peak, bf16, since the attention-peak change: 8.72 / 9.37 ms before, capacity 61.6/s, TTFT 15.78 ms.)"""
    model, cluster = get_model("llama-3.1-8b"), parse_cluster("8xH100")
    best = search(model, cluster, "serve-latency", top=1, rate=20)["layouts"][0]
    assert best["name"] == "TP8 wfp8/kvfp8"
    c = layout_costs(model, cluster, 8, 1, 1, 1, "fp8", "fp8", 2048, 256)
    assert 20 * _time_in_system(c, 15) > 15 and 20 * _time_in_system(c, 16) <= 16
    serve, q = best["serve"], best["queue"]
    assert serve["batch"] == q["batch"] == 16 and q["full_batch"] == 1024
    n, r16, r17 = q["concurrency"], _rates(c, 16), _rates(c, 17)
    own = c.input_len * c.prefill_token_s
    assert n == pytest.approx(1 + 20 * (256 * serve["tpot_s"] + own), rel=1e-9) and n == pytest.approx(16.90, abs=0.01)
    assert serve["tpot_s"] == pytest.approx(r16[1] + (n - 16) * (r17[1] - r16[1]), rel=1e-12)
    assert serve["tpot_s"] == pytest.approx(3.07e-3, abs=0.01e-3)
    round_full = _rates(c, 1024)[0]
    mu = 1024 / (256 * round_full + 1024 * c.input_len * c.prefill_token_s)
    assert q["capacity_rps"] == pytest.approx(mu, rel=1e-9) and mu == pytest.approx(61.26, abs=0.01)
    rho = 20 / mu
    wait = rho / (2 * mu * (1 - rho))
    assert q["wait_s"] == pytest.approx(wait, rel=1e-9) and wait == pytest.approx(3.96e-3, abs=0.01e-3)
    assert serve["ttft_s"] == pytest.approx(c.prefill_s + r16[0] + (n - 16) * (r17[0] - r16[0]) + wait, rel=1e-9)
    assert serve["ttft_s"] == pytest.approx(15.93e-3, abs=0.01e-3)


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
    So 6 sequences per replica; a request sees n = 1 + 5 x T(n) = 6.18 (plan/serve/batch.py
    ``at_rate``) and TPOT(6) + 0.18 x (TPOT(7) - TPOT(6)) = 3.98 ms (TPOT(6) = 3.97 before); the
    capacity is still the full batch's."""
    args = ["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-8b", "--cluster", "8xH100",
            "--layout", "tp=2,weight_dtype=fp8,kv_dtype=fp8", "--rate", "20", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    serve, q = result["serve"], result["queue"]
    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 2, 1, 1, 4, "fp8", "fp8", 2048, 256)
    assert 5 * _time_in_system(c, 5) > 5 and 5 * _time_in_system(c, 6) <= 6
    assert serve["batch"] == q["batch"] == 6 and q["full_batch"] > 400
    n = q["concurrency"]
    assert n == pytest.approx(1 + 5 * (256 * serve["tpot_s"] + c.input_len * c.prefill_token_s), rel=1e-9)
    assert serve["tpot_s"] == pytest.approx(_rates(c, 6)[1] + (n - 6) * (_rates(c, 7)[1] - _rates(c, 6)[1]), rel=1e-12)
    assert serve["tpot_s"] == pytest.approx(3.98e-3, abs=0.01e-3)
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


def test_below_one_request_in_flight_a_request_shares_the_engine_part_of_the_time():
    """llama-3.1-8b TP8 fp8 on 8xH100 at 0.5 requests/s, 2048 in / 256 out: the whole batch the rate
    keeps in flight is 1 (0.5 x T(1) < 1), which left out that a request still shares the engine
    with another part of its time. With a = TPOT(1), d = TPOT(2) - a, P its own prefill and L = 256
    tokens, n = 1 + rate (L TPOT(n) + P) and TPOT(n) = a + (n - 1) d solve in closed form:
    n - 1 = rate (L a + P) / (1 - rate L d); TPOT and TTFT are then (n - 1) of the way to batch 2's."""
    from modelcarve.plan.serve.batch import at_rate

    c = layout_costs(get_model("llama-3.1-8b"), parse_cluster("8xH100"), 8, 1, 1, 1, "fp8", "fp8", 2048, 256)
    r1, r2 = _rates(c, 1), _rates(c, 2)
    a, d, own, rate = r1[1], r2[1] - r1[1], c.input_len * c.prefill_token_s, 0.5
    expected_n = 1 + rate * (256 * a + own) / (1 - rate * 256 * d)
    batch, _, got, n = at_rate(c, 1024, rate)
    assert batch == 1 and 1 < n < 2
    assert n == pytest.approx(expected_n, rel=1e-9)
    assert got[1] == pytest.approx(a + (n - 1) * d, rel=1e-12)
    assert got[2] == pytest.approx(r1[2] + (n - 1) * (r2[2] - r1[2]), rel=1e-12)
