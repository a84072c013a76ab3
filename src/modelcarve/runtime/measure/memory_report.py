"""Memory of one rank by category over one measured training step: the planner's quantities.

``measure_step(trainer, tokens, targets)`` runs ``trainer.step`` in its two halves and reads, on
this rank (local shards: a DTensor counts its local piece):

* ``params``: bytes of the parameters the rank holds (each tensor once);
* ``grads``: bytes of their gradients after the backward and the gradient reduction, before
  the optimiser step frees them (``zero_grad(set_to_none=True)``), plus what the optimiser holds
  in place of ``p.grad`` (``held_grad_bytes``: ZeRO-2's reduced owned range, kept in its flat
  buffer after every ``p.grad`` is freed); ``held_grads(chunks, optimizer)`` is that sum;
* ``optimizer``: bytes of the optimiser state after the step (AdamW's moments and step
  counters; ZeRO-1/2: this rank's partition, with its fp32 master range);
* ``activations``: the peak, over the step, of the bytes saved for backward and still alive
  (``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves passes through
  ``pack``; it is counted once per distinct view (storage, offset, shape, stride), at the bytes
  it views, while any saved reference to it lives; parameters,
  their gathered copies (FSDP2) and their autocast copies are not activations and are skipped).
  An autocast copy of a weight is told by its autograd history (``weight_cast``: a ``_to_copy``,
  through views, of a leaf that accumulates a gradient), never by its shape: a shape rule would
  drop real bf16 activations whose shape equals a weight's (``mbs x seq == hidden``, e.g. 64
  tokens of a 64-wide model) and keep transposed weight copies. Under a pipeline schedule
  this is the peak over the micro-batches in flight.
  Under recomputation (runtime/parallel/recompute.py: non-reentrant ``torch.utils.checkpoint``)
  a region's own saved tensors never reach these hooks (the checkpoint's are innermost), so each
  region is measured through the ``measure`` attribute recompute.py leaves on the replaced
  ``forward`` and ``checkpoint``'s ``context_fn`` (``_Region``): what the checkpoint keeps, its
  inputs (every tensor of its arguments, also inside tuples such as the rotary ``(cos, sin)``,
  which the checkpoint's frame holds by reference), counted until the frame dies (after the
  region's backward); and, during the backward, each tensor every recomputation saves, counted from
  that recomputation until its storage dies or autograd frees the forward's slot it stands for,
  whichever comes first (``_Count``: a ``weakref.finalize`` on the storage, whose Python object torch
  keeps for as long as the storage lives). That is what the allocator holds: torch's checkpoint keeps
  a recomputed tensor only in ``frame.recomputed[graph task]``, a WeakKeyDictionary keyed by a handle
  that its unpack drops, so each copy is freed once autograd has unpacked it, even under
  ``retain_graph``; the copies never unpacked stay while the slot lives. A single backward (1F1B,
  GPipe, interleaved) unpacks and frees the slot in the same node, so nothing changes there. Under
  zero-bubble (checked with a standalone checkpointed block through torch's ``stage_backward_input``
  / ``stage_backward_weight``, a finalizer on each recomputed storage, and against the bytes the
  checkpoint frames hold at the peak): I (``retain_graph``) frees each copy at its unpack; W runs one
  ``autograd.grad`` per weight group, each a new graph task, so the region is recomputed once per group
  (tiny-llama ``full``: 9 a layer), and the copies its nodes do not unpack stay until the slots die
  (the last stage: the step's end). Counting a slot by an address instead (before issue 26) counted
  an I copy already freed until W and took a later tensor at that address for it: a peak a few KiB
  lower, different each run. Entries are still keyed by address (``_storage_key``), which is now
  unambiguous: every counted entry's storage is alive (held by a saved reference, by the frame, or
  released by its finalizer), so no other storage can sit at its address;
* ``comm_buffers``: the largest single collective buffer of the step (collectives.CommLog's
  largest payload: the flat data-parallel gradient bucket, FSDP2's largest all-gather);
* on CUDA also ``cuda_peak`` (``max_memory_allocated`` over the step).

Returns ``(step output, {category: bytes})``.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t) -> int:
    if t is None:
        return 0
    t = _local(t)
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor):
    """The bytes a tensor views: (device, storage, offset, shape, stride); None without storage."""
    try:
        return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, subclasses)
        return None


_VIEWS = {"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "PermuteBackward0",
          "ExpandBackward0", "AliasBackward0", "ReshapeAliasBackward0"}


_PARAM_PIECES = _VIEWS | {"SelectBackward0", "SliceBackward0", "UnbindBackward0", "SplitBackward0",
                          "SplitWithSizesBackward0"}


def weight_cast(t: torch.Tensor) -> bool:
    """An autocast copy of a parameter (through views): a ``_to_copy`` whose input is a leaf that
    accumulates a gradient. Told by its autograd history, not by its shape."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS and fn.next_functions:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    # a piece of a parameter (an MoE layer's expert ``w1[e]``: select / slice / unbind of the stacked weight)
    while source is not None and type(source).__name__ in _PARAM_PIECES and source.next_functions:
        source = source.next_functions[0][0]
    return source is not None and type(source).__name__ == "AccumulateGrad"


class SavedActivations:
    """Context manager: the live and peak bytes autograd saves for backward (see module doc)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.live = 0
        self.peak = 0
        self._refs: dict = {}

    def _param_keys(self) -> set:
        """Storages of the parameters now (FSDP2 swaps in the gathered ones during forward), as
        (device, storage address): any view of a parameter's storage. Read through the parameter
        slots taken at ``__enter__`` (``_param_slots``): FSDP2 swaps a parameter by writing its
        module's ``_parameters[name]``, so each read sees the tensor there now, without walking the
        module tree on every saved tensor (that walk was a third of a verify step's CPU time)."""
        keys = set()
        for params, name in self._slots:
            p = params.get(name)
            if p is None:
                continue
            try:
                p = _local(p)
                keys.add((p.device.type, p.untyped_storage().data_ptr()))
            except (RuntimeError, NotImplementedError):  # no storage (meta, subclasses)
                continue
        return keys

    def _param_slots(self) -> list:
        """(module._parameters, name) of every parameter of the chunks, each module once."""
        seen, slots = set(), []
        for chunk in self.chunks:
            for module in chunk.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                slots.extend((module._parameters, name) for name in module._parameters)
        return slots

    def _acquire(self, t: torch.Tensor):
        """Count one saved reference to ``t``'s bytes; its key, or None when it is not an activation."""
        local = _local(t)
        key = _storage_key(local)
        if key is None or key[:2] in self._param_keys() or weight_cast(t):
            return None
        count, size = self._refs.get(key, (0, local.numel() * local.element_size()))
        if count == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] = (count + 1, size)
        return key

    def _pack(self, t: torch.Tensor):
        key = self._acquire(t)
        return t if key is None else _Held(t, key, self)

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def _release(self, key) -> None:
        count, size = self._refs[key]
        if count == 1:
            del self._refs[key]
            self.live -= size
        else:
            self._refs[key] = (count - 1, size)

    def _region(self, forward, args, kwargs):
        """recompute.py's ``measure`` hook: ``(fn, context_fn)`` for one checkpointed region."""
        region = _Region(self, args, kwargs)

        def fn(*a, **k):
            # the checkpoint's frame keeps ``fn`` (in its recomputation closure) as long as it keeps
            # the region's inputs: ``region`` dies with the frame, and its inputs stop counting then
            _ = region
            return forward(*a, **k)

        return fn, region.contexts

    def _regions(self) -> list:
        """The replaced forwards of the checkpointed modules (runtime/parallel/recompute.py)."""
        out = []
        for chunk in self.chunks:
            for module in chunk.modules():
                forward = module.__dict__.get("forward")
                if forward is not None and hasattr(forward, "measure"):
                    out.append(forward)
        return out

    def __enter__(self):
        self._slots = self._param_slots()
        self._checkpointed = self._regions()
        for forward in self._checkpointed:
            forward.measure = self._region
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for forward in self._checkpointed:
            forward.measure = None
        return False


def _tensors(value):
    """Every tensor in a region's argument (through tuples, lists and dict values)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _Region:
    """One checkpointed region seen by ``SavedActivations`` (see the module doc).

    Its inputs count from the call until this object dies with the checkpoint's frame. ``contexts``
    is ``checkpoint``'s ``context_fn``: inside the region's forward and its recomputation it stacks
    hooks over the checkpoint's own (read with torch's ``_top_saved_tensors_default_hooks``, only one
    pair of saved-tensor hooks acts at a time) that pass every pack and unpack through to them. In
    the forward each saved tensor gets a ``_Slot`` around the checkpoint's holder (the checkpoint
    keeps no tensor there); the recomputation saves the same tensors in the same order, and the
    ``k``-th one of each recomputation is counted against slot ``k`` (a ``_Count``) until its storage
    dies or autograd frees that slot."""

    def __init__(self, owner: SavedActivations, args, kwargs):
        self.owner = owner
        self.slots: list = []
        self.index = 0
        self.keys = [k for t in _tensors((args, kwargs)) if (k := owner._acquire(t)) is not None]

    def __del__(self):
        for key in self.keys:
            self.owner._release(key)

    def contexts(self):
        return _Stacked(self._forward_pack), _Stacked(self._recompute_pack, self._restart)

    def _forward_pack(self, inner, t):
        slot = _Slot(inner(t), self.owner)
        self.slots.append(weakref.ref(slot))
        return slot

    def _restart(self) -> None:
        self.index = 0

    def _recompute_pack(self, inner, t):
        k, self.index = self.index, self.index + 1
        slot = self.slots[k]() if k < len(self.slots) else None
        if slot is not None and (key := self.owner._acquire(t)) is not None:
            slot.counts.append(_Count(self.owner, key, _local(t).untyped_storage()))
        return inner(t)  # may end the recomputation early (torch's _StopRecomputationError)


class _Stacked:
    """saved_tensors_hooks over the current pair: ``pack(inner_pack, t)``, unpack passed through
    (a ``_Slot`` unwrapped)."""

    def __init__(self, pack, enter=None):
        self.pack, self.enter = pack, enter

    def __enter__(self):
        if self.enter is not None:
            self.enter()
        inner_pack, inner_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self.pack(inner_pack, t),
            lambda obj: inner_unpack(obj.inner if isinstance(obj, _Slot) else obj))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None  # its hooks hold this object: no cycle may keep the checkpoint's frame alive
        return False


class _Slot:
    """A tensor a checkpointed region saved in its forward (the checkpoint's holder ``inner``); each
    recomputation's copy of it counts (``counts``) until its storage dies or autograd frees the slot."""

    __slots__ = ("inner", "counts", "owner", "__weakref__")

    def __init__(self, inner, owner):
        self.inner, self.counts, self.owner = inner, [], owner

    def __del__(self):
        for count in self.counts:
            count.release()


class _Count:
    """One counted recomputed tensor: released once, when its storage dies (the checkpoint drops its
    copy when autograd unpacks it) or when its slot does, whichever comes first."""

    __slots__ = ("owner", "key", "finalizer")

    def __init__(self, owner, key, storage):
        self.owner, self.key = owner, key
        self.finalizer = weakref.finalize(storage, owner._release, key)
        self.finalizer.atexit = False

    def release(self) -> None:
        if self.finalizer.detach() is not None:  # still alive: the slot went first
            self.owner._release(self.key)


class _Held:
    """A saved tensor; when autograd frees it (after its backward) its bytes stop counting."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner._release(self.key)


def param_bytes(chunks) -> int:
    return sum(_bytes(p) for p in {id(p): p for c in chunks for p in c.parameters()}.values())


def grad_bytes(chunks) -> int:
    return sum(_bytes(p.grad) for p in {id(p): p for c in chunks for p in c.parameters()}.values())


def held_grads(chunks, optimizer) -> int:
    """``grads`` of the module doc: every ``p.grad`` plus what the optimiser holds in their place."""
    return grad_bytes(chunks) + getattr(optimizer, "held_grad_bytes", lambda: 0)()


def optimizer_bytes(optimizer) -> int:
    """AdamW's state tensors, plus the fp32 master ranges ZeRO-1/2's ShardedAdamW steps (its
    ``buckets``' ``master``: under ``param_dtype=bf16`` the only fp32 weights, and a copy of the
    owned range beside fp32 parameters too)."""
    states, masters = [], 0
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        states.append(getattr(opt, "optim", opt).state)  # ZeroRedundancyOptimizer wraps the local one
        masters += sum(_bytes(b.master) for b in getattr(opt, "buckets", ()))
    return masters + sum(_bytes(v) for state in states for s in state.values() for v in s.values()
                         if isinstance(v, torch.Tensor))


def measure_step(trainer, tokens, targets) -> tuple[dict, dict]:
    """One ``trainer.step`` with every category measured (see the module doc)."""
    from modelcarve.runtime.distributed.collectives import CommLog

    cuda = torch.cuda.is_available()
    if cuda:  # pragma: no cover - GPU only
        torch.cuda.reset_peak_memory_stats()
    with CommLog(trainer.layout) as log, SavedActivations(trainer.chunks) as acts:
        loss = trainer.forward_backward(tokens, targets)
        grads = held_grads(trainer.chunks, trainer.optimizer)
        norm = trainer.optimizer_step()
    out = dict(loss=loss, grad_norm=norm)
    if trainer.is_moe:
        out["moe"] = trainer.moe_stats()
    mem = dict(params=param_bytes(trainer.chunks), grads=grads, optimizer=optimizer_bytes(trainer.optimizer),
               activations=acts.peak,
               comm_buffers=max((e.payload for e in log.events if e.op != "recv"), default=0))
    if cuda:  # pragma: no cover - GPU only
        mem["cuda_peak"] = torch.cuda.max_memory_allocated()
    out["comm"] = log
    return out, mem
