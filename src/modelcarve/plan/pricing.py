"""Dollars: what a served token and a training run cost on the user's cluster, at the user's prices,
and where self-hosting beats a hosted API ("should we self-host?").

Pure arithmetic over the planner's own figures (a serving estimate's tokens/s and request capacity,
a training estimate's tokens/s), so every number here is checkable by hand:

* the cluster costs ``devices x $/device-hour`` every hour it is held, busy or idle;
* serving at utilisation ``u`` (``--utilisation``, or ``rate / capacity`` with ``--rate``) delivers
  ``u x capacity`` requests/s of ``input_len`` in and ``output_len`` out, so
  ``$ per request = cluster $/s / (u x capacity)``, ``$ per M output tokens = cluster $/s /
  (u x capacity x output_len) x 1e6``, and per M tokens in + out likewise;
* a hosted API charges ``input_len x IN + output_len x OUT`` per request (``--api-price IN,OUT``,
  $ per M tokens): self-hosting is cheaper above the rate at which the cluster's hourly cost is
  spread thin enough, ``break-even rps = cluster $/s / API $ per request``, and only if that rate is
  within the cluster's capacity;
* a training run of ``N`` tokens takes ``N / tokens/s x (1 + overhead)`` hours (``overhead``: the
  failures, restarts and evaluation a run loses, 0 unless stated) on all the devices.
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0


def serving_cost(result: dict, *, devices: int, usd_per_device_hour: float, input_len: int, output_len: int,
                 utilisation: float | None = None, api_price: tuple[float, float] | None = None) -> dict:
    """Dollars of one serving estimate (``serve`` and, with a rate, ``queue`` as the planner gives them)."""
    serve, queue = result["serve"], result.get("queue")
    per_s = devices * usd_per_device_hour / SECONDS_PER_HOUR
    if queue:  # a stated request rate: the utilisation is what the rate asks of the capacity
        capacity_rps = queue["capacity_total_rps"]
        util = queue["rate_rps"] / capacity_rps
    else:
        capacity_rps = serve["tokens_per_s_per_device"] * devices / output_len
        util = 1.0 if utilisation is None else utilisation
    served_rps = util * capacity_rps
    out = {
        "usd_per_device_hour": usd_per_device_hour,
        "devices": devices,
        "usd_per_hour": per_s * SECONDS_PER_HOUR,
        "utilisation": util,
        "capacity_rps": capacity_rps,
        "usd_per_request": per_s / served_rps,
        "usd_per_m_output_tokens": per_s / (served_rps * output_len) * 1e6,
        "usd_per_m_tokens": per_s / (served_rps * (input_len + output_len)) * 1e6,
        "usd_per_m_output_tokens_full_load": per_s / (capacity_rps * output_len) * 1e6,
    }
    if api_price is not None:
        api_in, api_out = api_price
        api_request = (input_len * api_in + output_len * api_out) / 1e6
        break_even = per_s / api_request
        out["api"] = {
            "usd_per_m_input_tokens": api_in,
            "usd_per_m_output_tokens": api_out,
            "usd_per_request": api_request,
            "break_even_rps": break_even,
            "break_even_utilisation": break_even / capacity_rps,
            "self_hosting_can_win": break_even <= capacity_rps,
            "cheaper_now": out["usd_per_request"] < api_request,
        }
    return out


def training_cost(result: dict, *, devices: int, usd_per_device_hour: float, tokens: float,
                  overhead: float = 0.0) -> dict:
    """Dollars and device-hours of a run of ``tokens`` training tokens at the estimate's tokens/s."""
    tokens_per_s = result["time"]["tokens_per_s"]
    hours = tokens / tokens_per_s / SECONDS_PER_HOUR * (1.0 + overhead)
    return {
        "usd_per_device_hour": usd_per_device_hour,
        "devices": devices,
        "tokens": tokens,
        "overhead": overhead,
        "hours": hours,
        "device_hours": hours * devices,
        "usd": hours * devices * usd_per_device_hour,
        "usd_per_m_tokens": devices * usd_per_device_hour / SECONDS_PER_HOUR / tokens_per_s * (1.0 + overhead) * 1e6,
    }


def price_front(front: dict, *, usd_per_device_hour: float, utilisation: float = 1.0) -> list[dict]:
    """Each point of a serving Pareto front (plan/serve/pareto.py) with its dollars per million
    output tokens: a device serving ``t`` tokens/s at utilisation ``u`` costs
    ``$/device-hour / 3600 / (u x t) x 1e6`` per million (every device of the layout alike)."""
    per_device_s = usd_per_device_hour / SECONDS_PER_HOUR
    return [dict(p, usd_per_m_output_tokens=per_device_s / (utilisation * p["tokens_per_s_per_device"]) * 1e6)
            for p in front["front"]]
