"""TTFT with queueing (plan/serve/queue.py): the M/D/1 mean wait, by hand and against a simulation
of the queue (Lindley's recursion over seeded Poisson arrivals, an oracle independent of the
Pollaczek-Khinchine formula), and ``estimate --rate`` end to end."""

import json
import random

import pytest

from modelcarve.cli import main
from modelcarve.plan.serve.queue import md1_wait_s, queued_ttft


def test_hand_derived_wait():
    # mu = 10 req/s, lambda = 5 req/s: rho = 0.5, W_q = rho / (2 mu (1 - rho)) = 0.5 / (2 x 10 x 0.5) = 50 ms
    assert md1_wait_s(5.0, 10.0) == pytest.approx(0.05, rel=1e-12)
    # rho = 0.9: 0.9 / (2 x 10 x 0.1) = 450 ms; M/D/1 waits half as long as M/M/1 (rho / (mu (1 - rho)))
    assert md1_wait_s(9.0, 10.0) == pytest.approx(0.45, rel=1e-12)
    assert md1_wait_s(0.0, 10.0) == 0.0
    assert md1_wait_s(10.0, 10.0) == float("inf")


def test_replicas_split_the_rate_and_the_wait_adds_to_ttft():
    q = queued_ttft(ttft_s=0.2, capacity_rps=10.0, rate_rps=20.0, replicas=4)
    assert q["rate_per_replica_rps"] == 5.0 and q["utilisation"] == 0.5
    assert q["ttft_s"] == pytest.approx(0.2 + 0.05, rel=1e-12)
    assert q["capacity_total_rps"] == 40.0


def _simulated_wait(rate, service, n, seed):
    rng = random.Random(seed)
    wait = total = 0.0
    for _ in range(n):
        total += wait
        wait = max(0.0, wait + service - rng.expovariate(rate))  # Lindley: W_{n+1} = max(0, W_n + S - A)
    return total / n


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_formula_matches_a_simulated_md1_queue(rho):
    """Mean wait of 300k simulated customers vs P-K. Tolerance: at rho 0.5 the per-customer wait has a
    relative s.d. of about 1.5 (E[W^2] = lambda E[S^3] / (3 (1 - rho)) + 2 W_q^2) and waits are
    correlated over about 1 / (1 - rho)^2 = 4 customers, so the mean's relative s.e. is ~1.5 / sqrt(75k)
    = 0.55%; at rho 0.8 (correlation ~25 customers, relative s.d. ~1.2) ~1.1%. 5% is over 4 s.e. in both;
    the seed makes the run deterministic."""
    mu = 10.0
    simulated = _simulated_wait(rho * mu, 1.0 / mu, 300_000, seed=7)
    assert simulated == pytest.approx(md1_wait_s(rho * mu, mu), rel=0.05)


def test_estimate_rate_reports_the_queue_and_refuses_past_capacity(capsys):
    args = ["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-8b", "--cluster", "8xH100",
            "--layout", "tp=2,weight_dtype=fp8", "--tpot-ms", "30", "--json"]
    assert main(args + ["--rate", "20"]) == 0
    result = json.loads(capsys.readouterr().out)
    q, serve = result["queue"], result["serve"]
    # per replica (tp=2 devices): its output tokens/s at the full batch over output_len 256
    capacity = q["capacity_tokens_per_s_per_device"] * 2 / 256
    assert q["capacity_rps"] == pytest.approx(capacity, rel=1e-12)
    assert q["ttft_s"] == pytest.approx(serve["ttft_unqueued_s"] + md1_wait_s(5.0, capacity), rel=1e-12)
    code = main(args + ["--rate", str(5 * capacity)])
    assert code == 2
    err = capsys.readouterr().err
    assert "capacity" in err and len(err.strip().splitlines()) == 1
