"""What a device-hour costs: the price catalogue (spec/catalog/prices.json, with source and date)
and the user's own prices, which win.

``--price 2.49`` prices the cluster's device; ``--price H100=2.49`` (repeatable) names it; a price
file (JSON or YAML ``{H100: 2.49, ...}``) gives several; a cluster file may carry ``price`` for its
device. ``device_price(device_name, given)`` returns ``(usd_per_hour, source)`` or refuses in one
line naming how to give a price. Pure data, no torch.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

from modelcarve.spec.errors import SpecError


@functools.cache
def catalogue() -> dict[str, dict]:
    """The catalogue's entries by device (read once; treat as read-only)."""
    text = resources.files("modelcarve.spec.catalog").joinpath("prices.json").read_text()
    return json.loads(text)["devices"]


def _usd(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{what}: {text!r} is not a price in US dollars per device-hour (e.g. 2.49)") from None
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{what}: a price must be a positive number of dollars per device-hour, got {text!r}")
    return value


def parse_prices(items: list[str] | None) -> dict[str, float]:
    """``["2.49"]`` -> ``{"*": 2.49}`` (the cluster's device); ``["H100=2.49", ...]`` -> by device."""
    prices: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            prices["*"] = _usd(name.strip(), "--price")
        else:
            if not name.strip():
                raise SpecError(f"--price {item!r}: give DEVICE=USD, e.g. H100=2.49")
            prices[name.strip()] = _usd(value.strip(), f"--price {name.strip()}")
    return prices


def device_price(device: str, given: dict[str, float] | None = None, cluster_price: float = 0.0) -> tuple[float, str]:
    """(dollars per device-hour, where the figure comes from) for ``device``: the user's ``--price``,
    else the cluster file's ``usd_per_hour``, else the catalogue's dated list price."""
    given = given or {}
    for key in (device, device.upper(), "*"):
        if key in given:
            return given[key], "given"
    if cluster_price > 0:
        return cluster_price, "the cluster file's usd_per_hour"
    entry = catalogue().get(device)
    if entry is None:
        known = ", ".join(sorted(catalogue()))
        raise SpecError(f"no list price for {device} in the catalogue (it has {known}); give one: --price {device}=USD")
    return float(entry["usd_per_hour"]), f"list price {entry['date']}: {entry['source']}"
