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
  this is the peak over the micro-batches in flight;
* ``comm_buffers``: the largest single collective buffer of the step (collectives.CommLog's
  largest payload: the flat data-parallel gradient bucket, FSDP2's largest all-gather);
* on CUDA also ``cuda_peak`` (``max_memory_allocated`` over the step).

Returns ``(step output, {category: bytes})``.
"""

from __future__ import annotations

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
        """Storages of the parameters now (FSDP2 swaps in the gathered ones during forward)."""
        keys = set()
        for chunk in self.chunks:
            for p in chunk.parameters():
                key = _storage_key(_local(p))
                if key is not None:
                    keys.add(key[:2])  # any view of a parameter's storage
        return keys

    def _pack(self, t: torch.Tensor):
        local = _local(t)
        key = _storage_key(local)
        if key is None or key[:2] in self._param_keys() or weight_cast(t):
            return t
        count, size = self._refs.get(key, (0, local.numel() * local.element_size()))
        if count == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] = (count + 1, size)
        return _Held(t, key, self)

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

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


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
