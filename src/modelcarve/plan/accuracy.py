"""How the planner fared on the published runs of the model it is asked about, training or serving.

Usage::

    from modelcarve.plan.accuracy import published_accuracy, accuracy_warning
    seen = published_accuracy("gpt-oss-120b", "GB200")   # None when no published run of the model was checked
    seen["out_of_sample"]["low"], seen["out_of_sample"]["high"], seen["runs"]
    accuracy_warning(seen)                                # a sentence when the shipped planner's errors pass ACCURACY_WARN

This module owns the reading of ``plan/data/published_accuracy.csv`` and ``serving_accuracy.csv`` (written by
``python benchmarks/calibrate_training.py`` / ``calibrate_serving.py``: every published run the planner answers, with
its relative error ``predicted / published - 1`` under the code's constants and out of sample, the
constants fitted on every other source) and the choice of the runs quoted beside an estimate: those
of the same model on the same device when there are any, else those of the same model on any device.
What an estimate is flagged by is the error of the planner as shipped (``code_constants``: the numbers the
user's estimate is made with); the out-of-sample span says how well the method transfers to a source its
constants never saw. A model no published run used gets no figure: its estimate was not checked against a
measurement.
"""

from __future__ import annotations

import csv
import functools
import io
from importlib import resources

ACCURACY_WARN = 0.20
"""An estimate is flagged when the shipped planner was off a published run like it by more than this (issue
28's serving tolerance, the band a user can plan within)."""


TABLES = {"train": "published_accuracy.csv", "serve": "serving_accuracy.csv"}
"""The table of each kind of goal: the training runs (``python benchmarks/calibrate_training.py``) and the
serving runs (``python benchmarks/calibrate_serving.py``), one shape of row."""


@functools.lru_cache(maxsize=2)
def _rows(kind: str = "train") -> tuple[dict, ...]:
    text = resources.files("modelcarve.plan").joinpath("data", TABLES[kind]).read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return tuple(csv.DictReader(io.StringIO("\n".join(lines))))


def _family(device: str) -> str:
    """The device a run's name gives, without its memory variant (``H100-96GB-HBM2e`` is an H100)."""
    return device.split("-")[0].upper()


def published_accuracy(model: str, device: str, rows: tuple[dict, ...] | None = None, kind: str = "train") -> dict | None:
    """The published runs of ``model`` the planner was checked on, and its errors on them: those on
    ``device`` (its family: the name before any ``-``) when there are any (``same_device``), else those on
    every device; None when no published run of ``model`` was checked. ``rows``: the table's rows (default
    the shipped table of ``kind``, 'train' or 'serve': ``TABLES``)."""
    rows = _rows(kind) if rows is None else rows
    of_model = [r for r in rows if r["model"] == model]
    if not of_model:
        return None
    same = [r for r in of_model if _family(r["device"]) == _family(device)]
    chosen = same or of_model

    def span(key: str) -> dict:
        errors = [float(r[key]) for r in chosen]
        return {"low": min(errors), "high": max(errors), "mean_abs": sum(abs(e) for e in errors) / len(errors)}

    return {
        "model": model,
        "device": device if same else "any",
        "same_device": bool(same),
        "runs": len(chosen),
        "sources": sorted({r["source"] for r in chosen}),
        "metric": sorted({r["metric"] for r in chosen}),
        "out_of_sample": span("out_of_sample_error"),
        "code_constants": span("code_error"),
        "kind": kind,
        "table": f"plan/data/{TABLES[kind]}",
    }


DOCS = {"train": "docs/calibration_training.md", "serve": "docs/calibration_serving.md"}
"""Where each kind's published runs and the planner's errors on them are listed."""


def accuracy_words(seen: dict | None, model: str, kind: str = "train") -> str:
    """One sentence on ``seen`` (``published_accuracy``'s answer for a ``kind`` of goal) for a person
    reading an estimate."""
    if seen is None:
        return (f"no published run of {model} was checked: this estimate rests on the cost model alone "
                f"({DOCS[kind]} lists the runs that were)")
    c, o = seen["code_constants"], seen["out_of_sample"]
    where = f"on {seen['device']}" if seen["same_device"] else "(none on this device; every device)"
    return (f"published runs of {seen['model']} {where}: {seen['runs']} checked, this planner {c['low']:+.0%} to "
            f"{c['high']:+.0%} off them (mean |error| {c['mean_abs']:.0%}; + means it predicted faster than the run "
            f"was; refitted without each run's source {o['low']:+.0%} to {o['high']:+.0%})")


def accuracy_warning(seen: dict | None) -> str | None:
    """A warning sentence when the shipped planner was off a published run like this one by more than
    ``ACCURACY_WARN``; None otherwise (or when no run was checked: ``accuracy_words`` says that)."""
    if seen is None:
        return None
    c = seen["code_constants"]
    if max(abs(c["low"]), abs(c["high"])) <= ACCURACY_WARN:
        return None
    return accuracy_words(seen, seen["model"]) + f"; read this estimate with that error ({DOCS[seen['kind']]})"
