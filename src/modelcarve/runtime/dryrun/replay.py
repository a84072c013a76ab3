"""What a rank played on the meta device computes once and replays: meta kernels' output shapes, the stage
compute of repeated pipeline micro-batches, and torch's schedule lowering (runtime/dryrun/rank_programs.py
plays the ranks; this module makes the playing cheap without changing what is issued).

``MetaShapeCache`` memoises the meta kernels of the pure ops (same op, same input shapes/strides/dtypes and
arguments -> the same output shapes), which torch computes in Python: it changes the cost, not what is issued.

**Replayed micro-batches** (``ActionMemo``; a class played without a hook, 4 or more micro-batches).
Most of a stage's time went into its model compute on meta, micro-batch after micro-batch, each
the same (DeepSeek-V3: ~0.2 s per micro-batch of an MoE stage, 960 of them). Played for real:
the model's build and ``parallelize``; torch's schedule, every action of every micro-batch in its
order, with torch's stage bookkeeping (the activation and gradient caches, the pipeline's sends and
receives, the last stage's loss); everything of the step outside the actions (the loss broadcast
and reductions, the tied-embedding sum, the dp / ZeRO gradient reductions, the optimiser, the MoE
stats); and the stage compute of micro-batches 0, 1 and the last one. For every other micro-batch
the stage compute inside torch's F, B, I and W (its ``forward_maybe_with_nosync`` /
``backward_maybe_with_nosync`` calls) is replayed: the events micro-batch 1's action of the same
kind on the same (virtual) stage recorded are appended to the log, and fresh meta tensors of its
results' shapes (the activations, the input gradients; the weight pass's result, which torch
drops, is not kept) are handed to torch, without running the model. Checked: micro-batches 0 and
1 must record the same calls, events (op, group, shapes, dtype, bytes) and result shapes for each
kind and stage, and the last micro-batch again the same; any difference, or a replay finding no
memo, plays the rank again from the start with every micro-batch real (``play_rank``'s
``stats["fallback"]`` says why). What that check cannot see is a compute whose collectives depend
on the micro-batch index elsewhere than at 0, 1 and the last (a counter firing at micro-batch k);
the runtime has none: with pp > 1 the dp gradient reductions run after the schedule
(grad_buckets.py), ZeRO's accumulation hooks issue no collective, and what the replayed compute
would have changed (``.grad`` accumulation, the MoE row counts) are values, not shapes. The
tiny-layout verdicts below equal collective_order's, which plays everything. torch's schedule
lowering (``_add_unshard_reshard``, quadratic in the actions, and ``_add_send_recv``), which every
played rank runs for the whole pipeline, is memoised across the ranks of one process
(``schedule_memo``: pure functions, keyed by their whole arguments).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_SKIP_TAGS = ("nondeterministic_seeded", "dynamic_output_shape", "data_dependent_output")


class MetaShapeCache(TorchDispatchMode):
    """Memoise the output shapes of pure aten ops on meta tensors (module doc): an op with no
    mutation and no aliasing whose tensor inputs are all plain meta tensors; keyed by the op,
    every input's shape, stride, dtype and storage offset and every other argument's value."""

    def __init__(self):
        super().__init__()
        self.memo: dict = {}
        self.pure: dict = {}
        self.hits = self.misses = 0

    def _is_pure(self, func) -> bool:
        ok = self.pure.get(func)
        if ok is None:
            s = func._schema
            ok = (func.namespace == "aten" and not s.is_mutable and len(s.returns) > 0
                  and all(r.alias_info is None for r in s.returns) and all(a.alias_info is None for a in s.arguments)
                  and not any(getattr(torch.Tag, t, None) in func.tags for t in _SKIP_TAGS))
            self.pure[func] = ok
        return ok

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types) or not self._is_pure(func):
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        key, tensors = [func, spec], 0
        for x in flat:
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta":
                    return func(*args, **kwargs)
                tensors += 1
                key.append((tuple(x.shape), x.stride(), x.dtype, x.storage_offset()))
            else:
                key.append((type(x), x))
        if not tensors:  # factories: their device is an argument, nothing to learn from inputs
            return func(*args, **kwargs)
        try:
            key = tuple(key)
            shapes = self.memo.get(key)
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        if shapes is None:
            self.misses += 1
            out = func(*args, **kwargs)
            if all(t.device.type == "meta" for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                self.memo[key] = tree_map(lambda t: _Shape(tuple(t.shape), t.stride(), t.dtype)
                                          if isinstance(t, torch.Tensor) else t, out)
            return out
        self.hits += 1
        return tree_map(lambda s: torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
                        if isinstance(s, _Shape) else s, shapes)


@dataclass(frozen=True)
class _Shape:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


# --- playing one rank on meta -------------------------------------------------------------


class MemoMismatch(Exception):
    """An action kind's events (or its results' shapes) differ between two real plays, or a
    replay would need a memo not learnt: the rank is played again without the memo (module doc).
    Not a RuntimeError: the pipeline runner's error wrapping lets it through."""


@dataclass(frozen=True)
class _Spec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    requires_grad: bool


def _spec(out):
    """The shapes of a compute result (tensors only: plain meta tensors, else MemoMismatch)."""
    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "meta":
            raise MemoMismatch(f"a stage computes a {type(t).__name__} on {t.device}, not a plain meta tensor")
        return _Spec(tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
    return tree_map(one, out)


def _fresh(spec):
    def one(s):
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta").requires_grad_(s.requires_grad)
    return tree_map(lambda s: one(s) if isinstance(s, _Spec) else s, spec)


class ActionMemo:
    """The memo of a pipeline stage's compute actions (module doc, "Replayed micro-batches").

    Micro-batches 0, 1 and the last one are played for real; every other micro-batch's F, B, I
    and W replay, in place of the stage's compute (``forward_maybe_with_nosync`` /
    ``backward_maybe_with_nosync``), the events and result shapes its kind recorded at
    micro-batch 1, once micro-batches 0 and 1 recorded the same. torch's own stage bookkeeping
    (caches, the pipeline's sends and receives, the loss) runs for every micro-batch. Any
    difference (0 vs 1, the last vs the memo, a replay without a memo) raises MemoMismatch."""

    def __init__(self, runner, log, n_microbatches: int):
        self.log, self.last = log, n_microbatches - 1
        self.memo: dict = {}  # (stage index, kind) -> [(call, events, result spec, param_groups)]
        self.first: dict = {}  # (stage index, kind) -> the calls of micro-batch 0
        self.played = self.replayed = 0
        for stage in runner.stages:
            self._install(stage)

    def _install(self, stage) -> None:
        now: dict = {}
        fwd, bwd, bww = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        fcomp, bcomp = stage.forward_maybe_with_nosync, stage.backward_maybe_with_nosync

        def action(kind, mb, run):
            now["kind"], now["mb"], now["calls"] = kind, mb, []
            try:
                out = run()
            except Exception as err:  # torch's stage wraps a forward's exception in a RuntimeError
                cause = err
                while cause is not None and not isinstance(cause, MemoMismatch):
                    cause = cause.__cause__
                raise cause or err
            self._learn((stage.stage_index, kind), mb, now.pop("calls"))
            return out

        def compute(call, run):
            key, mb, calls = (stage.stage_index, now["kind"]), now["mb"], now["calls"]
            if mb in (0, 1, self.last):
                start = len(self.log.events)
                out = run()
                grads, groups = (out, None) if call == "forward" else out
                if call == "weight":  # the stage drops it (the gradients accumulate in .grad)
                    grads = groups = None
                calls.append((call, tuple(self.log.events[start:]), _spec(grads), groups))
                return out
            memo = self.memo.get(key)
            if memo is None or len(calls) >= len(memo) or memo[len(calls)][0] != call:
                raise MemoMismatch(f"stage {key[0]} {key[1]} of micro-batch {mb}: no memo of its call #{len(calls) + 1}")
            call_, events, spec, groups = memo[len(calls)]
            calls.append(memo[len(calls)])
            self.log.events.extend(events)
            return _fresh(spec) if call == "forward" else (_fresh(spec), groups)

        stage.forward_one_chunk = lambda mb, *a, **k: action("F", mb, lambda: fwd(mb, *a, **k))
        stage.backward_one_chunk = lambda mb, loss=None, full_backward=True, last_backward=False: action(
            "B" if full_backward else "I", mb,
            lambda: bwd(mb, loss=loss, full_backward=full_backward, last_backward=last_backward))
        stage.backward_weight_one_chunk = lambda mb, last_backward=False: action(
            "W", mb, lambda: bww(mb, last_backward=last_backward))
        stage.forward_maybe_with_nosync = lambda *a, **k: compute("forward", lambda: fcomp(*a, **k))
        stage.backward_maybe_with_nosync = lambda kind, kw, last_backward=False: compute(
            kind, lambda: bcomp(kind, kw, last_backward=last_backward))

    def _learn(self, key, mb, calls) -> None:
        def same(a, b):
            return len(a) == len(b) and all(x[:3] == y[:3] for x, y in zip(a, b))

        if mb not in (0, 1, self.last):
            if key not in self.memo or len(calls) != len(self.memo[key]):
                raise MemoMismatch(f"stage {key[0]} {key[1]} of micro-batch {mb}: replayed before its memo was "
                                    f"learnt, or fewer calls than its memo")
            self.replayed += 1
            return
        self.played += 1
        if mb == 0:
            self.first[key] = calls
        elif mb == 1:
            if key not in self.first or not same(self.first[key], calls):
                raise MemoMismatch(f"stage {key[0]} {key[1]}: micro-batches 0 and 1 issue different events")
            self.memo[key] = calls
        elif key in self.memo and not same(self.memo[key], calls):
            raise MemoMismatch(f"stage {key[0]} {key[1]}: the last micro-batch issues other events than the memo")


_LOWERED: dict = {}
"""torch's pipeline schedule lowering, memoised across the ranks one process plays (``schedule_memo``)."""


@contextmanager
def schedule_memo():
    """Memoise the two pure functions torch's schedules lower every pp rank's action list with
    (``_add_unshard_reshard``, quadratic in the actions: ~0.3 s per pp rank at 960 micro-batches,
    and ``_add_send_recv``): every played rank builds the whole pipeline's schedule, the same
    one (module doc). Keyed by their whole arguments; each call gets fresh lists."""
    from torch.distributed.pipelining import schedules

    unshard, send_recv = schedules._add_unshard_reshard, schedules._add_send_recv

    def add_unshard_reshard(actions, max_active_stages=3):
        key = ("unshard", tuple(actions), max_active_stages)
        if key not in _LOWERED:
            _LOWERED[key] = tuple(unshard(list(actions), max_active_stages))
        return list(_LOWERED[key])

    def add_send_recv(actions, stage_to_rank, num_stages):
        key = ("send_recv", tuple((r, tuple(a)) for r, a in sorted(actions.items())),
               tuple(stage_to_rank(s) for s in range(num_stages)), num_stages)
        if key not in _LOWERED:
            _LOWERED[key] = {r: tuple(a) for r, a in send_recv(actions, stage_to_rank, num_stages).items()}
        return {r: list(a) for r, a in _LOWERED[key].items()}

    schedules._add_unshard_reshard, schedules._add_send_recv = add_unshard_reshard, add_send_recv
    try:
        yield
    finally:
        schedules._add_unshard_reshard, schedules._add_send_recv = unshard, send_recv
