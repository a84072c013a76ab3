"""Tensor parallelism (Megatron-style) and sequence parallelism for the reference model.

Hand-written, not DTensor/``parallelize_module``, and this is why:

* the sharded weights stay plain tensors, so FSDP2 can shard them again over the data-parallel
  mesh, ``torch.distributed.pipelining`` can send the activations of a stage, and the MoE/CP
  modules see ordinary tensors; DTensor activations would leak into all of them;
* the model's attention reshapes with ``-1`` heads and GQA-expands k/v locally; with one
  collective per region (below) the model file runs unchanged on the local heads;
* vocab-parallel cross-entropy and the sequence-parallel embedding need their own autograd
  functions anyway (``loss_parallel`` only wraps a DTensor logits tensor).

The benchmark (benchmarks/runtime_tokens.py) compares this against a plain ``parallelize_module``
baseline on the same model.

What is sharded over the ``tp`` mesh axis (size t):

* attention: ``wq/wk/wv`` column-parallel by heads (bias too), ``wo`` row-parallel; the model's
  ``n_heads/n_kv_heads`` become local counts. When t exceeds the kv heads (t = kv x r), each
  rank keeps the single kv head its query heads use: ``wk/wv`` are replicated over the r ranks
  sharing a head (their gradients are partial sums over those r ranks) and sharded over the kv
  ranks holding different heads. MLA: ``wq``/``wq_b`` and
  ``wkv_b`` column-parallel, ``wq_a``/``wkv_a`` and their norms replicated, ``wo`` row-parallel.
* MLP: ``w1``/``w3`` column-parallel, ``w2`` row-parallel.
* MoE blocks (expert TP = TP, spec/layout.py): each expert's (and the shared experts') ``w1/w3``
  split by columns and ``w2`` by rows; the router is replicated (its gradient is a partial sum
  per rank), the block enters/leaves the TP region once like a dense MLP. Expert parallelism
  (expert.py) then spreads the experts over the EP group.
* embedding: vocab-parallel (rows ``[r V/t, (r+1) V/t)``; other ids give zero, then a sum);
  LM head: column-parallel over the vocabulary, its logits stay sharded and go straight into
  ``vocab_parallel_cross_entropy`` (never gathered in training).
* vocabulary padding (Megatron's ``make_vocab_size_divisible_by``): when t does not divide the
  vocabulary V, embedding and head are padded with zero rows to ``padded_vocab_size(V, t)``, the
  next multiple of ``t x VOCAB_GRANULE`` (128, Megatron's default); a V that t divides is not
  padded (the planner counts V / t rows per rank). Padded columns are -inf inside
  ``vocab_parallel_cross_entropy`` (no loss, no gradient: the padded rows stay zero);
  ``full_vocab_logits`` gathers the logits and cuts them to V (and ``mask_padded_logits`` sets a
  local shard's padded columns to -inf) so no padded id is ever sampled; ``shards.padding_of(chunk)``
  records ``{fqn: (dim, V, padded)}`` so gathered / saved weights are cut back to V
  (verify.gather_full) and checkpoint slices are zero-filled past V (checkpoint.load_sharded).

Communication per region (``f``/``g`` of Megatron): entering attention, MLP or the LM head the
input is copied (forward identity, backward all-reduce), leaving ``wo``/``w2`` the partial
outputs are all-reduced. With sequence parallelism (``sp``) the residual stream and the norms
hold ``s / t`` tokens per rank: entering a region all-gathers the sequence (backward:
reduce-scatter), leaving it reduce-scatters (backward: all-gather), and the embedding
reduce-scatters its partial sums.

Replicated parameters whose gradient is only a partial sum on each rank (qwen3 q/k norms, MLA's
replicated pieces; with sp also the norms and the row-parallel biases) are registered with
``record_partial_grad`` (shards.py); the train step all-reduces their gradients over ``tp``.

Pipeline stages under sp: a stage that does not start with the embedding receives hidden
states already split along the sequence ([b, s/t, H]) and must be given the full ``positions``
(the default ``arange`` would count only s/t tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modelcarve.runtime.model.mlp import FeedForward
from modelcarve.runtime.model.transformer import Attention, MLAttention
from modelcarve.runtime.model.moe import MoE
from modelcarve.runtime.distributed.primitives import all_reduce_sum, gather_cat, reduce_scatter_tensor, slice_param
from modelcarve.runtime.distributed.shards import record_padding, record_partial_grad, record_shard
from modelcarve.spec.errors import LayoutError

# --- collectives with autograd ----------------------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce_sum(x, group)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk along ``dim``."""
    size = dist.get_world_size(group)
    chunks = x.chunk(size, dim=dim)
    flat = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, flat, group=group)
    return out.view(chunks[0].shape)


def _carry_dtype(x: torch.Tensor):
    """The dtype a backward message carries: the autocast dtype of the forward (bf16 layouts move
    bf16 gradients, as Megatron does), None outside autocast (fp32 layouts: the gradient's own).
    A ``meta`` tensor (the full-scale dry run, runtime/dryrun/rank_programs.py) has no autocast
    of its own: the host's (the trainer's ``autocast`` of mesh.device_type()) decides."""
    device = x.device.type
    if device == "meta":
        from modelcarve.runtime.distributed.mesh import device_type

        device = device_type()
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _carried(grad: torch.Tensor, dtype, collective):
    """``collective`` applied to ``grad`` carried in ``dtype`` (None: as it is), back in grad's dtype."""
    if dtype is None or grad.dtype == dtype:
        return collective(grad)
    return collective(grad.to(dtype)).to(grad.dtype)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.carry = group, _carry_dtype(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return _carried(grad.clone(), ctx.carry, lambda g: _all_reduce(g, ctx.group)), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.carry = group, _carry_dtype(x)
        return gather_cat(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _carried(grad, ctx.carry, lambda g: _reduce_scatter(g, 1, ctx.group)), None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence (forward); all-gather (backward)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.carry = group, _carry_dtype(x)
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _carried(grad, ctx.carry, lambda g: gather_cat(g, 1, ctx.group)), None


def enter_region(x: torch.Tensor, group, sp: bool) -> torch.Tensor:
    return _GatherSequence.apply(x, group) if sp else _CopyToRegion.apply(x, group)


def leave_region(x: torch.Tensor, group, sp: bool) -> torch.Tensor:
    return _ScatterSequence.apply(x, group) if sp else _ReduceFromRegion.apply(x, group)


# --- vocab-parallel cross-entropy -------------------------------------------------------


VOCAB_GRANULE = 128
"""Megatron's default ``make_vocab_size_divisible_by``: a padded vocabulary is a multiple of tp x this."""


def padded_vocab_size(vocab_size: int, tp: int, granule: int = VOCAB_GRANULE) -> int:
    """``vocab_size`` if ``tp`` divides it, else the next multiple of ``tp * granule``."""
    if vocab_size % tp == 0:
        return vocab_size
    multiple = tp * granule
    return -(-vocab_size // multiple) * multiple


def mask_padded_logits(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """A vocab shard's logits (columns ``vocab_start..``) with ids >= ``vocab_size`` set to -inf."""
    ids = vocab_start + torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def full_vocab_logits(logits: torch.Tensor, chunk: nn.Module) -> torch.Tensor:
    """The logits of the true vocabulary ([.., V]) from the last chunk's output: gathered over tp
    when the head is vocab-parallel, padded columns cut off."""
    if getattr(chunk, "vocab_parallel", False):
        logits = gather_cat(logits, -1, chunk.tp_group)
    return logits[..., : chunk.spec.vocab_size]


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded on the last dim over ``group``."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, vocab_size=None):
        logits = logits.float()
        if vocab_size is not None and vocab_start + logits.shape[-1] > vocab_size:
            logits = mask_padded_logits(logits, vocab_start, vocab_size)  # padding: exp(-inf) = 0
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(in_shard, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target_logit, group=group)
        loss = sum_exp.log() - target_logit
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, in_shard)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, in_shard = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -in_shard.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy per token ([b, s]) of vocab-sharded logits [b, s, V/t]; the full vocabulary's
    softmax is formed with three all-reduces of [b, s] tensors, never the full logits. Columns
    at ids >= ``vocab_size`` (vocabulary padding) take no part."""
    start = logits.shape[-1] * dist.get_rank(group)
    return _VocabParallelCE.apply(logits, targets, start, group, vocab_size)


# --- sharded modules --------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + V/t) on this rank; other ids contribute zero."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group, sp: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.group, self.sp = vocab_start, group, sp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mask = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
        return _ScatterSequence.apply(out, self.group) if self.sp else _ReduceFromRegion.apply(out, self.group)


class RowParallelLinear(nn.Module):
    """y = reduce(x_local @ W_local^T) + b: the input features are sharded, the bias is whole."""

    def __init__(self, linear: nn.Linear, rank: int, size: int, group, sp: bool):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(size, dim=1)[rank].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = leave_region(F.linear(x, self.weight), self.group, self.sp)
        return out if self.bias is None else out + self.bias


def _shard_column(linear: nn.Linear, rank: int, size: int) -> None:
    """Keep rows [r out/t, (r+1) out/t) of an nn.Linear (and of its bias), in place."""
    # not primitives.slice_param: these new parameters always require grad (slice_param keeps the
    # old flag); the same for every weight parallelize sees today, kept as it was
    linear.weight = nn.Parameter(linear.weight.detach().chunk(size, dim=0)[rank].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(size, dim=0)[rank].clone())
    linear.out_features = linear.weight.shape[0]


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` with zero rows appended up to ``rows`` (vocabulary padding)."""
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _shard_experts(moe: nn.Module, *, chunk: nn.Module, fqn: str, group, sp: bool) -> None:
    """Expert tensor parallelism (expert TP = TP) of one MoE block over ``group`` (see module doc)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    spec = chunk.spec
    if spec.expert_ffn_size % t:
        raise LayoutError(f"tp={t} does not divide the expert ffn size {spec.expert_ffn_size}; choose tp dividing it")
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        slice_param(moe.experts, name, dim, r, t)
        record_shard(chunk, f"{fqn}.experts.{name}", group, dim)
    shared = moe.shared_experts
    if shared is not None:
        if any(getattr(shared, name).bias is not None for name in ("w1", "w3", "w2")):
            raise LayoutError(f"{fqn}: tensor parallelism of shared experts with MLP biases is not supported; use tp=1")
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            slice_param(getattr(shared, name), "weight", dim, r, t)
            record_shard(chunk, f"{fqn}.shared_experts.{name}.weight", group, dim)
    record_partial_grad(chunk, f"{fqn}.router.weight", group)
    moe.aux_grad_share = 1.0 / t  # every TP rank injects the same aux gradient; the all-reduce sums them

    def enter(module, args):
        return (enter_region(args[0], group, sp),)

    def leave(module, args, out):
        return leave_region(out, group, sp)

    moe.register_forward_pre_hook(enter)
    moe.register_forward_hook(leave)


def kv_replica_groups(mesh, t: int, kv: int):
    """For t = kv x r (r > 1) ranks per TP group: (the kv ranks holding different kv heads,
    the r ranks sharing ours). Every rank creates every such group, in the same order
    (new_group is collective over the world); cached on the mesh."""
    from modelcarve.runtime.distributed.mesh import new_group

    key = f"_mc_kv_groups_{t}_{kv}"
    if key not in mesh.__dict__:
        me, r = dist.get_rank(), t // kv
        heads = replicas = None
        for row in mesh.mesh.reshape(-1, t).tolist():  # TP is innermost: rows are TP groups
            for j in range(r):
                ranks = [row[j + r * i] for i in range(kv)]
                g = new_group(ranks)
                heads = g if me in ranks else heads
            for i in range(kv):
                ranks = row[i * r : (i + 1) * r]
                g = new_group(ranks)
                replicas = g if me in ranks else replicas
        mesh.__dict__[key] = (heads, replicas)
    return mesh.__dict__[key]


def _region_hook(group, sp):
    def hook(module, args, kwargs):
        return (enter_region(args[0], group, sp), *args[1:]), kwargs

    hook.tp_region = (group, sp)  # read by the engine's fused blocks (engine/fused.py) to recognise it
    return hook


def apply_tensor_parallel(chunk: nn.Module, mesh, layout) -> None:
    """Shard ``chunk`` (a Transformer or one pipeline chunk of it) over the ``tp`` axis, in place."""
    from modelcarve.runtime.distributed.mesh import axis_group, axis_rank, axis_size

    t = axis_size(mesh, "tp")
    if t == 1:
        return
    group, rank, sp = axis_group(mesh, "tp"), axis_rank(mesh, "tp"), layout.sp
    spec = chunk.spec
    kv = spec.num_kv_heads
    if spec.attention_kind == "gqa" and kv % t and t % kv:
        raise LayoutError(f"tp={t} and {kv} kv heads: one must divide the other (to shard or to replicate kv heads)")
    kv_groups = kv_replica_groups(mesh, t, kv) if spec.attention_kind == "gqa" and kv % t else None
    vocab, padded = spec.vocab_size, padded_vocab_size(spec.vocab_size, t)
    hooks = []

    def column(mod: nn.Linear, fqn: str) -> None:
        _shard_column(mod, rank, t)
        record_shard(chunk, f"{fqn}.weight", group, 0)
        if mod.bias is not None:
            record_shard(chunk, f"{fqn}.bias", group, 0)

    def row(parent: nn.Module, attr: str, fqn: str) -> None:
        new = RowParallelLinear(getattr(parent, attr), rank, t, group, sp)
        setattr(parent, attr, new)
        record_shard(chunk, f"{fqn}.weight", group, 1)
        if new.bias is not None and sp:
            record_partial_grad(chunk, f"{fqn}.bias", group)

    def replicated_partial(mod: nn.Module | None, fqn: str) -> None:
        if mod is not None:
            for name, _ in mod.named_parameters():
                record_partial_grad(chunk, f"{fqn}.{name}", group)

    for key, block in chunk.layers.items():
        base = f"layers.{key}"
        attn = block.attention
        if isinstance(attn, Attention):
            column(attn.wq, f"{base}.attention.wq")
            if kv_groups is None:
                column(attn.wk, f"{base}.attention.wk")
                column(attn.wv, f"{base}.attention.wv")
                attn.n_kv_heads //= t
            else:  # t > kv heads: each rank keeps the one kv head its query heads use
                heads_group, replica_group = kv_groups
                for name in ("wk", "wv"):
                    mod = getattr(attn, name)
                    _shard_column(mod, rank // (t // kv), kv)
                    for pname, _ in mod.named_parameters():
                        record_shard(chunk, f"{base}.attention.{name}.{pname}", heads_group, 0)
                        record_partial_grad(chunk, f"{base}.attention.{name}.{pname}", replica_group)
                attn.n_kv_heads = 1
            attn.n_heads //= t
            replicated_partial(attn.q_norm, f"{base}.attention.q_norm")
            replicated_partial(attn.k_norm, f"{base}.attention.k_norm")
        elif isinstance(attn, MLAttention):
            if attn.wq is not None:
                column(attn.wq, f"{base}.attention.wq")
            else:
                column(attn.wq_b, f"{base}.attention.wq_b")
                replicated_partial(attn.wq_a, f"{base}.attention.wq_a")
                replicated_partial(attn.q_norm, f"{base}.attention.q_norm")
            column(attn.wkv_b, f"{base}.attention.wkv_b")
            replicated_partial(attn.wkv_a, f"{base}.attention.wkv_a")
            replicated_partial(attn.kv_norm, f"{base}.attention.kv_norm")
            attn.n_heads = attn.n_kv_heads = attn.n_heads // t
        else:  # pragma: no cover - future attention kinds
            raise LayoutError(f"tensor parallelism does not know attention {type(attn).__name__}")
        row(attn, "wo", f"{base}.attention.wo")
        hooks.append(attn)
        ffn = block.feed_forward
        if isinstance(ffn, FeedForward):
            column(ffn.w1, f"{base}.feed_forward.w1")
            if ffn.w3 is not None:
                column(ffn.w3, f"{base}.feed_forward.w3")
            row(ffn, "w2", f"{base}.feed_forward.w2")
            hooks.append(ffn)
        elif isinstance(ffn, MoE):  # expert TP = TP; a folded expert mesh (etp != tp) is expert.py's alone
            if not layout.folded:
                _shard_experts(ffn, chunk=chunk, fqn=f"{base}.feed_forward", group=group, sp=sp)
        else:
            raise LayoutError(f"tensor parallelism does not know the MLP {type(ffn).__name__} of layer {key}")
        if sp:
            replicated_partial(block.attention_norm, f"{base}.attention_norm")
            replicated_partial(block.ffn_norm, f"{base}.ffn_norm")
    for mod in hooks:
        mod.register_forward_pre_hook(_region_hook(group, sp), with_kwargs=True)

    emb = chunk.tok_embeddings
    tied = chunk.output is not None and emb is not None and chunk.output.weight is emb.weight
    if emb is not None:
        shard = _pad_rows(emb.weight.detach(), padded).chunk(t, dim=0)[rank].clone()
        chunk.tok_embeddings = VocabParallelEmbedding(shard, rank * shard.shape[0], group, sp)
        record_shard(chunk, "tok_embeddings.weight", group, 0)
        if padded != vocab:
            record_padding(chunk, "tok_embeddings.weight", 0, vocab, padded)
    if chunk.norm is not None and sp:
        replicated_partial(chunk.norm, "norm")
    if chunk.output is not None:
        if tied:
            chunk.output.weight = chunk.tok_embeddings.weight
            chunk.output.out_features = chunk.output.weight.shape[0]
        else:
            chunk.output.weight = nn.Parameter(_pad_rows(chunk.output.weight.detach(), padded))
            column(chunk.output, "output")
        if padded != vocab:
            record_padding(chunk, "output.weight", 0, vocab, padded)
        chunk.output.register_forward_pre_hook(_region_hook(group, sp), with_kwargs=True)
    chunk.tp_group = group
    chunk.vocab_parallel = chunk.output is not None

