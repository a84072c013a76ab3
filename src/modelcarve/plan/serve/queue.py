"""Time to first token with queueing, at a request rate: the M/D/1 queue in front of each replica.

Usage::

    from modelcarve.plan.serve.queue import queued_ttft
    q = queued_ttft(ttft_s=0.12, capacity_rps=8.0, rate_rps=20.0, replicas=4)
    q["ttft_s"], q["wait_s"], q["utilisation"]

The queue model (stated, so it can be checked by hand):

* Requests arrive as a Poisson process of ``rate_rps`` requests/s, spread evenly over
  ``replicas`` identical replicas (each sees a Poisson stream of ``lambda = rate / replicas``).
* A replica admits requests at its steady-state capacity ``mu = capacity_rps`` requests/s (the
  throughput model's tokens/s of one replica over output_len, or a prefill pool's 1 / prefill
  seconds per prompt), one admission every ``1 / mu`` seconds: a deterministic service time.
* That is an M/D/1 queue. Pollaczek-Khinchine gives the mean wait before service for an
  M/G/1 queue, ``W_q = lambda E[S^2] / (2 (1 - rho))`` with ``rho = lambda E[S]``; a deterministic
  ``S = 1 / mu`` has ``E[S^2] = 1 / mu^2``, so ``W_q = rho / (2 mu (1 - rho))``.
* TTFT = ``W_q`` + the unloaded TTFT (the prefill, and for a colocated engine the decode round a
  new request waits for). At ``rho >= 1`` the queue grows without bound: the rate is refused with
  the capacity it exceeds.

Worked case: ``mu = 10`` req/s, ``lambda = 5`` req/s -> ``rho = 0.5``, ``W_q = 0.5 / (2 x 10 x 0.5)
= 50 ms``. The median and tails of an M/D/1 wait are not modelled (mean only).
"""

from __future__ import annotations

from modelcarve.spec.errors import ModelcarveError


def md1_wait_s(rate_rps: float, capacity_rps: float) -> float:
    """Mean wait in queue of an M/D/1 queue (Poisson arrivals at ``rate_rps``, deterministic service
    at ``capacity_rps``), seconds; inf at or above capacity."""
    if rate_rps < 0 or capacity_rps <= 0:
        raise ModelcarveError(f"request rate {rate_rps} must be >= 0 and capacity {capacity_rps} > 0")
    rho = rate_rps / capacity_rps
    if rho >= 1.0:
        return float("inf")
    return rho / (2.0 * capacity_rps * (1.0 - rho))


def queued_ttft(*, ttft_s: float, capacity_rps: float, rate_rps: float, replicas: int = 1) -> dict:
    """TTFT at ``rate_rps`` requests/s over ``replicas`` replicas of ``capacity_rps`` each (see module doc)."""
    if replicas < 1:
        raise ModelcarveError(f"replicas={replicas} must be at least 1")
    per_replica = rate_rps / replicas
    wait = md1_wait_s(per_replica, capacity_rps)
    return {
        "rate_rps": rate_rps,
        "rate_per_replica_rps": per_replica,
        "capacity_rps": capacity_rps,
        "capacity_total_rps": capacity_rps * replicas,
        "utilisation": per_replica / capacity_rps,
        "wait_s": wait,
        "ttft_s": ttft_s + wait,
        "stable": wait != float("inf"),
        "queue_model": "M/D/1 per replica (Poisson arrivals, deterministic admission at capacity)",
    }


def check_rate(rate_rps: float, capacity_total_rps: float, what: str = "the layout") -> None:
    """One-line refusal of a rate the layout cannot sustain."""
    if rate_rps >= capacity_total_rps:
        raise ModelcarveError(
            f"--rate {rate_rps:g} requests/s is at or above {what}'s capacity of {capacity_total_rps:.3g} requests/s; "
            f"the queue would grow without bound: lower --rate or add replicas"
        )


def serve_capacity_rps(serve: dict, output_len: int, dp: int) -> float:
    """Requests/s one replica of a serving estimate sustains: its output tokens/s over output_len
    (``serve``: the ``serve`` dict of a serve-latency / serve-throughput result)."""
    return serve["tokens_per_s_cluster"] / dp / output_len


def with_rate(result: dict, rate_rps: float, output_len: int) -> dict:
    """A serve-* result with ``result['queue']`` at ``rate_rps`` (for ``estimate --rate``)."""
    serve = result.get("serve") or {}
    if not serve:
        return result
    dp = result["layout"].get("dp", 1)
    capacity = serve_capacity_rps(serve, output_len, dp)
    result["queue"] = queued_ttft(ttft_s=serve["ttft_s"], capacity_rps=capacity, rate_rps=rate_rps, replicas=dp)
    return result
