"""Pipeline schedules: bubble fraction and the micro-batches whose activations a stage holds.

Usage::

    from modelcarve.plan.cost.schedule import bubble_fraction, in_flight_microbatches
    bubble_fraction("1f1b", p=8, m=48)                      # (p-1)/(m+p-1) = 0.127
    in_flight_microbatches("interleaved-1f1b", p=8, m=48, v=2)   # first stage: p + (p-1)/v

Bubble (idle fraction of the pipeline's step, per-micro-batch forward+backward time ``t``):

* GPipe and 1F1B: ``(p-1) / (m+p-1)`` (Narayanan et al. 2021, Section 2.2);
* interleaved 1F1B with ``v`` model chunks per rank: the bubble time shrinks ``v``-fold,
  ``((p-1)/v) / (m + (p-1)/v)`` (ibid., Section 2.2.2);
* zero-bubble, as ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): splitting the
  backward into input- and weight-gradient halves fills all but a third of 1F1B's bubble with
  the same activation memory as 1F1B: ``((p-1)/3) / (m + (p-1)/3)``.

Micro-batches in flight on the first stage (whose activations it holds at the peak), in units
of one micro-batch through the whole stage: GPipe ``m``; 1F1B and ZB-H1 ``min(m, p)``;
interleaved ``p + (p-1)/v`` chunks-worth, from the warm-up of Megatron's interleaved schedule
(``2(p-1) + (v-1)p + 1`` chunks of ``1/v`` of the stage; Korthikanti et al. 2022 Section 4.2.3
states the same ``1 + (p-1)/(pv)`` factor over 1F1B).
"""

from __future__ import annotations


def bubble_time_units(schedule: str, p: int, v: int = 1) -> float:
    """Idle time of a step, in units of one micro-batch's forward+backward on one stage."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved-1f1b":
        return (p - 1) / max(1, v)
    if schedule == "zero-bubble":
        return (p - 1) / 3.0
    return float(p - 1)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Fraction of the pipeline's step spent idle in the bubble (see module doc)."""
    idle = bubble_time_units(schedule, p, v)
    return idle / (m + idle) if idle else 0.0


def in_flight_microbatches(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches' worth of activations pipeline stage ``stage`` (0 = first) holds at its
    peak; the first stage holds the most."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b" and v > 1:
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - stage))
