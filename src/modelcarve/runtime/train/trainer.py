"""One training step for any layout, the data it reads, and the loss normalisation every axis keeps.

Loss normalisation (the contract the pipeline, expert and context modules keep)
------------------------------------------------------------------------------
The step's loss is the mean token cross-entropy over the global batch: ``N = gbs x seq`` tokens.
Every rank computes, for each micro-batch it runs, ``sum(CE over its tokens) / N`` (``loss_fn``
below) and back-propagates that. Summing those over micro-batches and over the ``dp x cp``
ranks gives exactly the global mean and its gradient, so the data-parallel reduction is a SUM
(data_parallel.py) and no axis divides by its size. TP ranks compute identical losses (the
vocab-parallel cross-entropy yields every token's full loss on each TP rank) and are not summed.

Data layout: the global batch [gbs, seq] is split into ``dp`` contiguous row blocks (dp rank i
gets rows [i gbs/dp, (i+1) gbs/dp)); each block into ``num_microbatches`` micro-batches of
``mbs`` rows. CP splits each micro-batch along the sequence (context.py: ``shard_batch``).

Hooks (parallelize.StepHooks, so this module imports no parallelism): pp > 1 takes the
runner of ``pipeline.build_pipeline(chunks, layout, mesh, loss_fn)``, whose
``step(tokens, targets, positions) -> loss`` runs forward+backward over this replica's
micro-batches. The pipeline keeps torch's own convention instead: its ``loss_fn`` is the
micro-batch MEAN (``sum / (mbs x seq / cp)``), torch's ``scale_grads`` divides the accumulated
gradients by the micro-batch count, and the returned loss is already the global mean; so the
step divides the summed gradients by ``dp x cp`` afterwards and does not reduce the loss again.
Both paths yield the gradient of the global-batch mean. cp > 1 takes this rank's piece of each
micro-batch from ``context.shard_batch(tokens, targets, mesh, layout) -> (tokens, targets, positions)``.

Mixed precision: ``param_dtype=bf16`` runs forward and backward under ``torch.autocast`` (bf16
matmuls) with fp32 gradients, fp32 reductions and fp32 AdamW state. Under ZeRO-1/2 the model's
parameters are bf16 and the fp32 master weights live in the distributed optimiser's owned range
(parallel/zero_optimizer.py, as Megatron's distributed optimiser holds them); with zero=0 and
FSDP2 the fp32 parameters are the master weights themselves (``grad_dtype``/``optim_dtype`` other
than fp32, and fp16, are refused by spec/support.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from modelcarve.runtime.distributed.mesh import axis_group, axis_rank, axis_size, device_type
from modelcarve.runtime.parallel.parallelize import StepHooks
from modelcarve.spec.errors import ModelcarveError


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    seed: int = 0
    moe_capacity_factor: float = 0.0
    """MoE: 0 for dropless routing, else the per-sequence expert capacity factor (moe.py)."""
    moe_aux_loss_coef: float = 0.0
    """MoE: weight of the load-balancing loss (only its gradient is added; the loss reported is the CE)."""
    moe_bias_rate: float = 0.0
    """MoE: step size of DeepSeek-V3's aux-loss-free router bias update, once per step (0: off)."""
    dry_run: bool = False
    """Accept a model on the ``meta`` device (runtime/dryrun/rank_programs.py plays a full-scale
    step of shapes for its collectives): the loss and gradient norm it reports are then nan."""

    def adamw(self) -> dict:
        return dict(lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps)


def autocast(layout):
    # no weight-cast cache: FSDP2 frees and re-gathers the unsharded weights between uses
    return torch.autocast(device_type(), dtype=torch.bfloat16, enabled=layout.param_dtype == "bf16", cache_enabled=False)


# --- data -------------------------------------------------------------------------------


class SyntheticData:
    """A seeded synthetic language a model can learn, the same on every rank for a given (seed, step).

    Uniform random ids teach nothing (the loss stays at ln V). Instead each token id has
    ``successors`` next tokens, drawn once from the seed with a Zipf(``zipf``) preference over a
    seeded permutation of the vocabulary, taken with probabilities 1/2, 1/4, ... (renormalised): a
    first-order Markov chain whose entropy (about 1.1 nats for 4 successors) is far below ln V and
    whose frequent tokens a model picks up within a few steps. Row starts follow the same Zipf law.
    Batch ``k`` depends on ``(seed, k)`` alone (resume and every layout read the same tokens).
    The table is V x ``successors`` ids, so any vocabulary size costs little."""

    def __init__(self, vocab_size: int, seed: int = 0, successors: int = 4, zipf: float = 1.0):
        self.vocab_size, self.seed = vocab_size, seed
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
        weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64) ** zipf
        self.unigram = torch.empty(vocab_size, dtype=torch.float64)
        self.unigram[torch.randperm(vocab_size, generator=gen)] = weights / weights.sum()
        self.next_ids = torch.multinomial(self.unigram, vocab_size * successors, replacement=True,
                                          generator=gen).view(vocab_size, successors)
        probs = 0.5 ** torch.arange(successors, dtype=torch.float64)
        self.probs = probs / probs.sum()

    def batch(self, step: int, gbs: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.empty(gbs, seq + 1, dtype=torch.int64)
        ids[:, 0] = torch.multinomial(self.unigram, gbs, replacement=True, generator=gen)
        choice = torch.multinomial(self.probs, gbs * seq, replacement=True, generator=gen).view(gbs, seq)
        for i in range(seq):
            ids[:, i + 1] = self.next_ids[ids[:, i], choice[:, i]]
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class TokenFile:
    """Token ids from a local file: ``.npy`` (any integer array), ``.bin`` (uint16, nanoGPT's
    format) or anything else read as bytes (a text file tokenised bytewise, vocabulary 256).
    Each step reads ``gbs`` windows at seeded random offsets (same on every rank)."""

    def __init__(self, path: str | Path, vocab_size: int, seed: int = 0):
        path = Path(path)
        if not path.is_file():
            raise ModelcarveError(f"dataset {path} does not exist")
        if path.suffix == ".npy":
            data = np.load(path, mmap_mode="r")
        elif path.suffix == ".bin":
            data = np.memmap(path, dtype=np.uint16, mode="r")
        else:
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        self.data = data.reshape(-1)
        top = int(self.data.max()) if len(self.data) else 0
        if top >= vocab_size:
            raise ModelcarveError(f"dataset {path} holds token id {top} >= the model's vocabulary {vocab_size}")
        self.seed = seed

    def batch(self, step: int, gbs: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.data) < seq + 2:
            raise ModelcarveError(f"dataset has {len(self.data)} tokens, fewer than seq + 1 = {seq + 1}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - seq - 1, (gbs,), generator=gen).tolist()
        rows = torch.stack([torch.from_numpy(np.asarray(self.data[s : s + seq + 1], dtype=np.int64)) for s in starts])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def make_data(source: str | None, vocab_size: int, seed: int = 0):
    return SyntheticData(vocab_size, seed) if not source or source == "synthetic" else TokenFile(source, vocab_size, seed)


# --- loss -------------------------------------------------------------------------------


def make_loss_fn(chunk: nn.Module | None, num_tokens: int):
    """``loss_fn(logits, targets) -> sum(CE) / num_tokens`` (vocab-parallel when the chunk's
    LM head is tensor-parallel: parallelize.StepHooks.loss_fn)."""
    return StepHooks([chunk]).loss_fn(num_tokens)


# --- the step ---------------------------------------------------------------------------


class Trainer:
    """Forward/backward over this rank's micro-batches, gradient reduction, clipping, AdamW."""

    def __init__(self, chunks: list[nn.Module], layout, mesh, config: TrainConfig = TrainConfig()):
        self.chunks, self.layout, self.mesh, self.config = chunks, layout, mesh, config
        self.hooks = StepHooks(chunks, layout, mesh)
        self.num_tokens = layout.global_batch * layout.seq
        self.loss_fn = self.hooks.loss_fn(self.num_tokens)
        self.optimizer = self.hooks.optimizer(**config.adamw())
        self.runner = None
        if layout.pp > 1:
            # pipeline.py's runner takes a per-micro-batch MEAN loss and divides the accumulated
            # gradients by the micro-batch count (torch's scale_grads): its gradients are this
            # replica's mean, so after the dp x cp SUM we divide by dp x cp (see forward_backward).
            self.loss_fn = self.hooks.loss_fn(layout.mbs * layout.seq // layout.cp)
            self.runner = self.hooks.pipeline(self.loss_fn)
        self.dp_rank = axis_rank(mesh, "dp")
        self.device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
        if self.device.type == "meta" and not config.dry_run:
            raise ModelcarveError("the model is still on the meta device; load its weights (checkpoint.load_sharded) first")
        self.is_moe = chunks[0].spec.is_moe
        if self.is_moe:
            self.hooks.configure_moe(capacity_factor=config.moe_capacity_factor, aux_loss_coef=config.moe_aux_loss_coef)

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor):
        rows = tokens.shape[0] // self.layout.dp
        sl = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        return tokens[sl], targets[sl]

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Gradients of the global-mean loss on every rank (reduced); returns that loss."""
        layout = self.layout
        if tokens.shape != (layout.global_batch, layout.seq):
            raise ModelcarveError(
                f"batch of shape {tuple(tokens.shape)} does not match gbs x seq = {layout.global_batch} x {layout.seq}"
            )
        tokens, targets = self.local_batch(tokens, targets)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        with autocast(layout):
            if self.runner is not None:
                tokens, targets, positions = self.hooks.shard_batch(tokens, targets)
                # the runner returns the global-batch mean already (averaged over dp and cp)
                loss = torch.as_tensor(self.runner.step(tokens, targets, positions), dtype=torch.float32)
                loss = loss.detach().clone()
            else:
                loss = torch.zeros((), dtype=torch.float32, device=self.device)
                model = self.chunks[0]
                for tok, tgt in zip(tokens.split(layout.mbs), targets.split(layout.mbs)):
                    tok, tgt, positions = self.hooks.shard_batch(tok, tgt)
                    mb_loss = self.loss_fn(model(tok, positions), tgt)
                    mb_loss.backward()
                    loss += mb_loss.detach().float()
        self.hooks.reduce_gradients()
        replicas = layout.dp * layout.cp
        if replicas > 1 and self.runner is not None:
            scale_gradients(self.chunks, 1.0 / replicas)
        elif replicas > 1:
            torch.distributed.all_reduce(loss, group=axis_group(self.mesh, "dp_cp"))
        return _host_float(loss)

    def optimizer_step(self) -> float:
        norm = self.hooks.clip_gradients(self.config.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
        loss = self.forward_backward(tokens, targets)
        norm = self.optimizer_step()
        out = dict(loss=loss, grad_norm=norm)
        if self.is_moe:
            out["moe"] = self.moe_stats()
        return out

    def moe_stats(self) -> dict:
        """Per MoE layer, since the last call: tokens per expert and per rank, imbalance, drops
        (expert.py: moe_step_stats, collective); applies the router bias update."""
        return self.hooks.moe_stats(bias_rate=self.config.moe_bias_rate)


def _host_float(x) -> float:
    """``float(x)``; nan for a ``meta`` tensor (the dry run's step has shapes, no values)."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        return float("nan")
    return float(x)


@torch.no_grad()
def scale_gradients(chunks: list[nn.Module], factor: float) -> None:
    from torch.distributed.tensor import DTensor

    for chunk in chunks:
        for p in chunk.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(factor)


# --- the single-device reference step -----------------------------------------------------


def reference_step(model: nn.Module, optimizer, tokens, targets, config: TrainConfig, bf16: bool = False) -> dict:
    """What every layout must reproduce: mean CE over the whole batch, clip, AdamW."""
    device = next(model.parameters()).device
    tokens, targets = tokens.to(device), targets.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm) if config.max_norm else None
    return dict(loss=float(loss.detach()), grad_norm=float(norm) if norm is not None else float("nan"))


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))
    os.environ.setdefault("PYTHONHASHSEED", str(seed))


def tp_size(mesh) -> int:
    return axis_size(mesh, "tp")
