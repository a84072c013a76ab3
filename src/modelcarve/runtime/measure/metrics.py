"""Measurements of a run: tokens/s, memory per rank, bytes handed to collectives.

* ``StepTimer``: wall time per step and tokens/s (global tokens of the step / step time).
* ``memory_stats()``: this process's peak resident memory (``ru_maxrss``), the bytes of its
  parameters, gradients and optimiser state, and on CUDA the allocator's peak.
* ``CommCounter``: while active, the payload bytes of every collective and message this rank
  issues, by op; collectives.py's ``CommLog`` underneath sees them all (ours, FSDP2's,
  DTensor's, pipelining's) and also holds the wire bytes, axis and link tier of each.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

class CommCounter(contextlib.ContextDecorator):
    """``with CommCounter(layout) as c: ...``; then ``c.bytes`` (payload by op), ``c.calls``,
    ``c.total``, and ``c.log`` (collectives.CommLog: every event, per op x axis x tier tables).

    Counts through collectives.CommLog, the one place every collective is seen (our calls,
    FSDP2's, DTensor's, pipelining's), payload once per message (a send, not its receive)."""

    def __init__(self, layout=None):
        self.layout = layout
        self.log = None
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def __enter__(self):
        from modelcarve.runtime.distributed.collectives import CommLog

        self.log = CommLog(self.layout)
        self.log.__enter__()
        return self

    def __exit__(self, *exc):
        self.log.__exit__(*exc)
        self.count(self.log)
        return False

    def count(self, log) -> None:
        """Add the events of a finished CommLog (e.g. memory_report.measure_step's)."""
        self.log = log
        for e in log.events:
            self.calls[e.op] += 1
            if e.op != "recv":
                self.bytes[e.op] += e.payload

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class StepTimer:
    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.times: list[float] = []
        self._start = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.times.append(time.perf_counter() - self._start)
        return False

    @property
    def last_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.times[-1] if self.times else 0.0

    def tokens_per_s(self, skip: int = 1) -> float:
        """Mean over the steps after the first ``skip`` (warm-up) ones."""
        times = self.times[skip:] or self.times
        return self.tokens_per_step * len(times) / sum(times) if times else 0.0


def _tensor_bytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def memory_stats(chunks=None, optimizer=None) -> dict:
    """Bytes this rank holds: peak RSS, parameters, gradients, optimiser state (local shards)."""
    stats = dict(peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if chunks is not None:
        params = {id(p): p for c in chunks for p in c.parameters()}.values()
        stats["param_bytes"] = sum(_tensor_bytes(p) for p in params)
        stats["grad_bytes"] = sum(_tensor_bytes(p.grad) for p in params)
    if optimizer is not None:
        state = getattr(optimizer, "optim", optimizer).state  # ZeroRedundancyOptimizer wraps the local one
        stats["optim_bytes"] = sum(_tensor_bytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        stats["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return stats
