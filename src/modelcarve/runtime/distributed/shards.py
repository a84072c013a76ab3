"""What each rank's model chunk holds of the full model: the records the parallelisms leave.

Every parallelism that changes what a parameter holds records it here, by FQN relative to the
chunk (FQNs survive FSDP2 wrapping, which replaces the Parameter objects). The parallelism
modules (tensor.py, expert.py, pipeline_split.py, ...) write these records and never import
each other; verify/reference.py gathers full tensors, the train step reduces gradients and computes the
global gradient norm, and the checkpoint code loads and saves slices from them alone (plus
FSDP2's own DTensor placements), so a new parallelism needs nothing else.

* ``record_shard(chunk, fqn, group, dim)``: this rank holds a slice of the full tensor along
  ``dim``; the slices of the ranks of ``group`` concatenate (in group-rank order) to the whole.
  Several entries nest (e.g. experts: EP on dim 0, then TP): gathering undoes them last first.
* ``record_partial_grad(chunk, fqn, group)``: the parameter is replicated over ``group`` but each
  rank's gradient is a partial sum; the train step all-reduces it over ``group``.
* ``record_grad_group(chunk, fqn, group)``: sum this parameter's gradient over ``group`` instead
  of the dp x cp group (zero 0/1; experts: the expert-data-parallel group).
* ``record_tied_copy(chunk, copy_fqn, original_fqn)``: the parameter is a copy of another one of
  the full model (a tied LM head on the last pipeline stage); gradient-norm code counts it once.
* ``record_padding(chunk, fqn, dim, true_size, padded)``: the parameter's vocabulary dimension is
  padded (tensor.py pads a vocabulary tp does not divide); saving, exporting and gathering cut it
  back to ``true_size``.
"""

from __future__ import annotations

from torch import nn

TIED_COPY_ATTR = "tied_copy"


def record_shard(chunk: nn.Module, fqn: str, group, dim: int) -> None:
    chunk.__dict__.setdefault("_mc_shards", {}).setdefault(fqn, []).append((group, dim))


def record_partial_grad(chunk: nn.Module, fqn: str, group) -> None:
    chunk.__dict__.setdefault("_mc_partial", {}).setdefault(fqn, []).append(group)


def shards_of(chunk: nn.Module) -> dict:
    return chunk.__dict__.get("_mc_shards", {})


def partial_grads_of(chunk: nn.Module) -> dict:
    return chunk.__dict__.get("_mc_partial", {})


def record_grad_group(chunk: nn.Module, fqn: str, group) -> None:
    """Sum this parameter's gradient over ``group`` instead of the dp x cp group (zero 0/1)."""
    chunk.__dict__.setdefault("_mc_grad_group", {})[fqn] = group


def grad_groups_of(chunk: nn.Module) -> dict:
    return chunk.__dict__.get("_mc_grad_group", {})


def record_tied_copy(chunk: nn.Module, copy_fqn: str, original_fqn: str) -> None:
    setattr(chunk, TIED_COPY_ATTR, {**(getattr(chunk, TIED_COPY_ATTR, None) or {}), copy_fqn: original_fqn})


def unwrap(chunk: nn.Module) -> nn.Module:
    """The Transformer inside a DDP wrapper (FSDP2 and TP keep the module object itself)."""
    return chunk.module if isinstance(getattr(chunk, "module", None), nn.Module) and not hasattr(chunk, "layers") else chunk


def tied_copy_names(chunk: nn.Module) -> dict[str, str]:
    """``{fqn of the copy: fqn of the original}`` for tied parameters duplicated onto this chunk
    (empty for chunks without such a copy); gradient-norm code counts these once."""
    return dict(getattr(unwrap(chunk), TIED_COPY_ATTR, {}) or {})


def record_padding(chunk: nn.Module, fqn: str, dim: int, true_size: int, padded: int) -> None:
    chunk.__dict__.setdefault("_mc_vocab_padding", {})[fqn] = (dim, true_size, padded)


def padding_of(chunk: nn.Module) -> dict[str, tuple[int, int, int]]:
    """{fqn: (dim, true size, padded size)} of this chunk's vocabulary-padded parameters."""
    return chunk.__dict__.get("_mc_vocab_padding", {})
