"""Strict numbers on the command line: ASCII digits, finite floats, each flag's accepted range.

argparse's ``type=int`` takes ``２`` (a full-width digit) and 5,000-digit numbers, and ``type=float``
takes ``nan`` and ``inf``; ``harden(parser)`` swaps every such flag's type, on every sub-command,
for a strict one whose error names the flag and its range (argparse prints it as one line, exit 2)::

    modelcarve plan ... --seq ２      ->  argument --seq: '２' is not an integer (ASCII digits) in 1..2,147,483,648
"""

from __future__ import annotations

import argparse
import math
import re

_INT_RANGES = {
    "steps": (1, 10**9), "top": (1, 10**6), "global_batch": (1, 2**31), "seq": (1, 2**31), "world_size": (1, 2**20),
    "nnodes": (1, 2**17), "nproc_per_node": (1, 4096), "node_rank": (0, 2**17), "master_port": (1, 65535),
    "new_tokens": (1, 10**6), "input_len": (1, 2**31), "output_len": (1, 2**31), "batch": (1, 2**31),
    "max_batch": (1, 2**31), "seed": (0, 2**63 - 1),
}
_DEFAULT_INT = (0, 2**31)
_FLOAT_RANGES = {  # (low, high, low exclusive?)
    "timeout": (0.0, 1e7, True), "load_imbalance": (1.0, 1e3, False), "memory_headroom": (0.0, 0.99, False),
    "ttft_ms": (0.0, 1e12, True), "tpot_ms": (0.0, 1e12, True),
    "utilisation": (0.0, 1.0, True), "train_tokens": (0.0, 1e18, True), "overhead": (0.0, 100.0, False),
}
_DEFAULT_FLOAT = (0.0, 1e12, False)
_INT = re.compile(r"^[+-]?[0-9]{1,19}$")
_FLOAT = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?$")


def strict_int(dest: str):
    low, high = _INT_RANGES.get(dest, _DEFAULT_INT)

    def parse(text: str) -> int:
        if not _INT.match(text.strip()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer (ASCII digits) in {low}..{high:,}")
        return int(text)

    parse.__name__ = "integer"
    return parse


def strict_float(dest: str):
    low, high, open_low = _FLOAT_RANGES.get(dest, _DEFAULT_FLOAT)

    def parse(text: str) -> float:
        ok = bool(_FLOAT.match(text.strip()))
        value = float(text) if ok else math.nan
        if not ok or not math.isfinite(value) or value > high or value < low or (open_low and value == low):
            bound = f"{'>' if open_low else '>='} {low:g} and <= {high:g}"
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a finite number (ASCII digits) {bound}")
        return value

    parse.__name__ = "number"
    return parse


def harden(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Replace ``type=int`` / ``type=float`` by the strict parsers on ``parser`` and its sub-parsers."""
    seen, stack = set(), [parser]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for action in current._actions:
            if action.type is int:
                action.type = strict_int(action.dest)
            elif action.type is float:
                action.type = strict_float(action.dest)
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return parser
