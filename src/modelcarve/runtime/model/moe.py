"""The mixture-of-experts block of the reference model: router, routed SwiGLU experts, shared experts.

Plain PyTorch, no torch.distributed, and no import of the parallel modules: ``expert.py`` makes
it expert-parallel by shrinking ``experts`` to the local ones and installing a ``dispatcher``
(all-to-all), and tensor.py splits the experts' matrices over tp, both without touching this file.
What it computes is what Hugging Face's mixtral, qwen3_moe and deepseek_v3 compute on the same
weights (tests/runtime/test_moe_layer.py compares logits with transformers).

Structure (names are checkpoint FQNs under ``layers.<i>.feed_forward``)::

    MoE
      router          Router: weight [E, H]; buffer e_score_correction_bias [E] (fp32; in the
                      state dict for sigmoid routers, as in DeepSeek-V3 checkpoints)
      experts         GroupedExperts: w1 (gate) [E, F, H], w3 (up) [E, F, H], w2 (down) [E, H, F]
      shared_experts  FeedForward of size num_shared_experts * expert_ffn_size, or None

Routing (the router always runs in fp32, autocast off, as DeepSeek-V3 stores its router; Mixtral
and Qwen3-MoE compute the router matmul in the input dtype, which differs only in bf16):

1. ``scores = softmax(x W^T)`` or ``sigmoid(x W^T)`` (``spec.router_scoring``).
2. Choice: ``scores + e_score_correction_bias`` (the aux-loss-free balancing bias; zero unless
   updated by :meth:`MoE.update_bias`). With ``num_expert_groups > 1`` (DeepSeek-V3 group-limited
   routing) each group is scored by the sum of its two best choice scores, the ``topk_groups``
   best groups are kept and the others masked out.
3. ``top_k`` experts by choice score; their weights are the *unbiased* ``scores``, divided by
   their sum when ``norm_topk_prob``, then times ``routed_scaling_factor``.
4. ``out = sum_k weight_k * expert_k(x) + shared_experts(x)``.

Dropless by default. With ``capacity_factor`` set, each expert takes at most
``ceil(capacity_factor * s * top_k / E)`` assignments *per sequence* (GShard priority: all first
choices, in token order, before any second choice); the rest are dropped (the token keeps only
its residual and shared-expert path) and counted in ``dropped_tokens``. Per sequence, so the drop
pattern does not depend on how a batch is split over data-parallel ranks or micro-batches; a
sequence split by context parallelism is decided on its gathered routing (``sequence_gather``).

Auxiliary load-balancing loss (Switch/Mixtral form, per sequence as DeepSeek-V3's sequence-wise
loss): ``aux = E * sum_e (n_e / s) * mean_t p_e``, with ``n_e`` the assignments to expert e in
the sequence and ``p`` the router probabilities (sigmoid scores normalised per token); ``top_k``
at perfect balance. Context parallelism: see ``_aux_loss``. Its value (mean over the forward's
sequences) is kept in ``aux_loss``. With ``aux_loss_coef > 0`` its gradient ``coef * d(sum_seq
aux) / aux_loss_sequences`` is injected in backward (Megatron's trick: the model output and the
training loss stay unchanged, so pipeline stages need no extra loss plumbing);
``aux_loss_sequences`` is the number of sequences the training objective averages over (default:
this forward's batch).

Bookkeeping for metrics: ``tokens_per_expert`` (int64 [E], routed assignments, kept ones only)
and ``dropped_tokens`` accumulate over forwards until :meth:`MoE.reset_counts`; a forward re-run
by activation recomputation (inside backward) is not counted again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modelcarve.runtime.model.mlp import FeedForward, activation_fn
from modelcarve.spec.model import ModelSpec


def in_backward() -> bool:
    """True while autograd runs a backward pass, where activation recomputation re-runs forwards."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class Router(nn.Module):
    """Scores tokens against experts and picks ``top_k`` of them (see module doc for the rule)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.scoring = spec.router_scoring
        self.norm_topk_prob = spec.norm_topk_prob
        self.scaling = spec.routed_scaling_factor
        self.num_groups, self.topk_groups = spec.num_expert_groups, spec.topk_groups
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        # Saved with the weights only where Hugging Face stores it (sigmoid routers: DeepSeek-V3).
        bias = torch.zeros(spec.num_experts, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", bias, persistent=spec.router_scoring == "sigmoid")

    def _apply(self, fn, recurse=True):
        # The balancing bias moves in steps of ~1e-3: it stays fp32 whatever dtype the model is cast to.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != bias.dtype:  # a cast: keep the fp32 values
            self.e_score_correction_bias = bias.to(device=self.e_score_correction_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (indices [T, k] int64, weights [T, k] in x's dtype, scores [T, E] fp32)."""
        with torch.autocast(x.device.type, enabled=False):  # fp32 even under bf16 autocast
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.e_score_correction_bias
        if self.num_groups > 1:
            per_group = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
            best = group_score.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        return indices, weights.to(x.dtype), scores


class GroupedExperts(nn.Module):
    """SwiGLU experts with stacked 3-D weights; runs tokens already grouped by expert.

    ``num_experts`` here is the number held (all of them, or an expert-parallel rank's share).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, activation: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.act = activation_fn(activation)
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [sum(counts), H], rows grouped by expert in order; counts[e] rows for expert e."""
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            hidden = self.act(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e])
            outs.append(F.linear(hidden, self.w2[e]))
        return torch.cat(outs) if outs else x[:0]


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, gives ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, grad_aux, None


class MoE(nn.Module):
    """Router + routed experts (+ shared experts); forward [b, s, H] -> [b, s, H]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.ffn_kind != "swiglu":
            raise ValueError(
                f"model {spec.name!r}: MoE experts are SwiGLU; ffn_kind={spec.ffn_kind!r} is not supported"
            )
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.router = Router(spec)
        self.experts = GroupedExperts(spec.num_experts, spec.hidden_size, spec.expert_ffn_size, spec.activation)
        self.shared_experts = (
            FeedForward(spec, spec.num_shared_experts * spec.expert_ffn_size) if spec.num_shared_experts else None
        )
        self.capacity_factor: float | None = None
        """None: dropless; else per-sequence expert capacity factor (see module doc)."""
        self.aux_loss_coef = 0.0
        self.aux_loss_sequences: float | None = None
        """Sequences the training objective averages over (None: this forward's batch size)."""
        self.aux_loss: torch.Tensor | None = None
        """The last forward's aux loss, mean over its sequences (under context parallelism: this
        rank's share of it, the shares add up)."""
        self.sequence_shards = 1
        """Ranks each sequence is split over (context parallelism); this block sees 1/shards of it."""
        self.sequence_sum = None
        """With sequence_shards > 1: a callable summing a tensor over those ranks (expert.py)."""
        self.sequence_gather = None
        """With sequence_shards > 1 and a capacity factor: a callable taking this rank's routing
        [b, s, k] to (the whole sequences' [b, S, k], the positions of this rank's tokens)."""
        self.aux_grad_share = 1.0
        """Fraction of the aux gradient this rank injects (1/tp: TP ranks route the same tokens)."""
        self.dispatcher = None
        """None: all experts are here. expert.py installs an all-to-all dispatcher (a callable
        ``(x_sorted, counts [E], experts) -> y_sorted``) when the experts are spread over ranks."""
        self.meta_counts = None
        """The full-scale dry run (runtime/dryrun/fake_transport.balanced_routing): a callable
        ``tokens -> counts [E]`` (host int64) giving the routing's rows per expert when the
        routing itself is on the ``meta`` device (shapes, no values: no bincount)."""
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)

    # --- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        indices, weights, scores = self.router(flat)
        keep = None
        if self.capacity_factor:
            local = indices.view(b, s, self.top_k)
            if self.sequence_gather is None:
                keep = self._capacity_mask(local)
            else:  # the queue order runs over whole sequences: decide on the gathered routing
                full, positions = self.sequence_gather(local)
                keep = self._capacity_mask(full)[:, positions]
        out = self._routed(flat, indices, weights, keep).view(b, s, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.sequence_sum is not None and not self.aux_loss_coef:
            return out  # under context parallelism the aux loss costs a collective: only when used
        aux = self._aux_loss(scores.view(b, s, -1), indices.view(b, s, -1))
        self.aux_loss = aux.detach() / b
        if self.aux_loss_coef and torch.is_grad_enabled():
            scale = self.aux_loss_coef * self.aux_grad_share / (self.aux_loss_sequences or b)
            out = _InjectAuxGrad.apply(out, aux, scale)
        return out

    def _routed(self, flat, indices, weights, keep) -> torch.Tensor:
        """Group the (token, choice) assignments by expert, run the experts, weight and sum back."""
        tokens, k, e = flat.shape[0], self.top_k, self.num_experts
        expert_of = indices.reshape(-1)
        if keep is not None:
            expert_of = expert_of.masked_fill(~keep.reshape(-1), e)  # dropped: a bin past the last expert
        order = torch.argsort(expert_of, stable=True)
        if expert_of.device.type == "meta" and self.meta_counts is not None and keep is None:
            counts = self.meta_counts(tokens)  # the dry run's routing, counted on the host
        else:
            counts = torch.bincount(expert_of, minlength=e + 1)[:e]
        if not in_backward():  # activation recomputation re-runs this forward: count once
            with torch.no_grad():
                self.tokens_per_expert += counts
                self.dropped_tokens += tokens * k - counts.sum()
        order = order[: int(counts.sum())]
        x_sorted = flat[order // k]
        if self.dispatcher is None:
            y_sorted = self.experts(x_sorted, counts.tolist())
        else:
            y_sorted = self.dispatcher(x_sorted, counts, self.experts)
        y = flat.new_zeros(tokens * k, flat.shape[1]).index_copy(0, order, y_sorted)
        return (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _capacity_mask(self, indices: torch.Tensor) -> torch.Tensor:
        """indices [b, s, k] -> keep [b, s, k]: first choices (token order) queue before second ones."""
        b, s, k = indices.shape
        capacity = math.ceil(self.capacity_factor * s * k / self.num_experts)
        by_priority = indices.transpose(1, 2).reshape(b, k * s)
        onehot = F.one_hot(by_priority, self.num_experts)
        position = (onehot.cumsum(dim=1) * onehot).sum(dim=-1)  # 1-based place in its expert's queue
        return (position <= capacity).view(b, k, s).transpose(1, 2)

    def _aux_loss(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over sequences of E * sum_e (n_e / S) * (sum_t p_e / S) (scores [b, s, E], fp32).

        With a sequence split over ``sequence_shards`` ranks (S = s x shards), ``n_e`` is summed
        over them (``sequence_sum``; counts carry no gradient) and the probability sum is this
        rank's tokens only: the ranks' results add up to the whole sequences' loss and gradient."""
        b, s, e = scores.shape
        full = s * self.sequence_shards
        probs = scores if self.router.scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        load = F.one_hot(indices.reshape(b, -1), e).sum(dim=1).to(probs.dtype)  # [b, E]
        if self.sequence_sum is not None:
            load = self.sequence_sum(load)
        return e * (load / full * probs.sum(dim=1) / full).sum()

    # --- bookkeeping ---------------------------------------------------------------------
    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero every buffer (after ``to_empty``; a checkpoint then fills the saved bias)."""
        self.router.e_score_correction_bias.zero_()
        self.reset_counts()

    def reset_counts(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_tokens.zero_()

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the choice bias of under-loaded experts,
        lower it for over-loaded ones, by ``rate``. ``tokens_per_expert``: the step's load over
        the whole global batch (expert.py sums it over data-parallel ranks)."""
        load = tokens_per_expert.to(torch.float32)
        bias = self.router.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.device)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}"
