"""Measurements of a run: tokens/s, memory per rank, bytes handed to collectives.

* ``StepTimer``: wall time per step and tokens/s (global tokens of the step / step time).
* ``memory_stats()``: this process's peak resident memory (``ru_maxrss``), the bytes of its
  parameters, gradients and optimiser state, and on CUDA the allocator's peak.
* ``CommCounter``: while active, counts the bytes of the tensors this rank passes to
  torch.distributed collectives and point-to-point calls (by function name). It wraps the
  functions of the ``torch.distributed`` module, so it sees our own calls, FSDP2's and
  pipelining's (they call through that module); it counts payload handed in, not wire bytes
  (a ring all-reduce moves about 2 (n-1)/n of that).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_COMM_FUNCS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "send",
    "recv",
    "batch_isend_irecv",
)
# isend/irecv are not wrapped: P2POp checks their identity; pipelining sends through
# batch_isend_irecv, whose P2POp tensors are counted.


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CommCounter(contextlib.ContextDecorator):
    """``with CommCounter() as c: ...``; then ``c.bytes`` (Counter by function) and ``c.total``."""

    def __init__(self):
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self):
        for name in _COMM_FUNCS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, __fn=fn, __name=name, **kwargs):
                # the input tensor is the first tensor argument (output buffers come first for
                # the *_into_tensor / reduce_scatter forms: count the larger of the first two)
                if __name == "batch_isend_irecv":
                    self.bytes[__name] += sum(_nbytes(op.tensor) for op in args[0])
                else:  # positional or keyword (FSDP2 passes output=/input=)
                    tensors = [a for a in (*args[:2], kwargs.get("input"), kwargs.get("output"),
                                           kwargs.get("tensor"), kwargs.get("input_tensor"))
                               if isinstance(a, (torch.Tensor, list, tuple))]
                    self.bytes[__name] += max((_nbytes(t) for t in tensors), default=0)
                self.calls[__name] += 1
                return __fn(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False

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
