"""verify: a layout against the single-device reference, on the same weights and the same data.

Every rank builds the reference model from the same (spec, seed) or checkpoint; rank 0 keeps an
unsplit copy. The parallel model (runtime/parallel/parallelize.py) and the reference then see the same
global batches. Compared, each against a stated tolerance:

* ``logits``: the first batch's logits before any update (max abs diff; when the layout can
  produce them: cp pieces are reassembled by context.unshard_sequence, pipelined layouts run
  forward only; cp together with pp is reported as not compared),
* ``loss``: every step's loss (relative difference),
* ``grad/<fqn>``: every parameter's gradient of the first step, before clipping (max abs diff),
* ``grad_norm``: every step's global gradient norm (relative; it sets the clipping, max_norm 1),
* ``grad_max/step<i>``: every later step's largest gradient difference over all parameters (fp32),
* ``param/<fqn>``: every parameter after ``steps`` AdamW steps (max abs diff), each element
  allowed, beyond the tolerance, what AdamW's own arithmetic can make of the measured gradient
  differences (``adamw_allowance``): the update m/(sqrt(v)+eps) has slope up to 1/eps = 1e8 where
  a gradient is near zero, so a 1e-9 reassociation difference there may move a parameter by
  ~lr. Elsewhere the allowance is a few ulps, so the check stays as tight as the tolerance
  (fp32; bf16's parameter tolerance is already above what AdamW can do in a few steps).

Full tensors are gathered by FQN from the shard records (runtime/distributed/shards.py) and FSDP2's DTensor
placements, so any layout's pieces (pp/tp/fsdp/ep/cp) reassemble without per-axis code here.

``verify_worker(...)`` runs on every rank (under torchrun or the test harness) and returns the
report on rank 0 (None elsewhere). ``format_report`` renders it; ``modelcarve verify`` drives it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from modelcarve.runtime.distributed.primitives import gather_cat
from modelcarve.runtime.parallel.parallelize import StepHooks
from modelcarve.spec.support import held_param_dtype

# Tolerances: fp32 from the issue; bf16 measured (tests/runtime/test_runtime_layouts.py) with margin:
# both sides run bf16 autocast, the differences come from reduction order in bf16 matmuls. A split
# layout (tp / cp > 1) in bf16 holds its logits and first-step gradients to anchored_tolerance (the
# reference's own distance from an fp32 run, times split_roundings) where that is the larger.
TOLERANCES = {
    "fp32": dict(logits=1e-4, loss=1e-5, grad=1e-4, param=1e-4, routing=0.0),
    "bf16": dict(logits=5e-2, loss=1e-2, grad=5e-3, param=1e-2, routing=0.25),
}
# routing: MoE tokens per expert, max difference relative to the largest count. fp32 routes
# exactly as the reference; bf16 flips near-tied choices once the weights drift (measured: up
# to 2 of ~20 tokens on tiny-moe after 3 steps).

BF16_UNIT_ROUNDOFF = 2.0**-8
"""u of bf16 (8 significant bits): rounding to nearest moves a value by at most u of its size."""
BF16_MASTER_GRAD_ROUNDINGS = 4
"""How many bf16 roundings of a partial gradient sum can separate the runtime's and the
reference's gradient of one weight when both hold bf16 parameters (``held_param_dtype``).

Both sides compute every activation of a row identically (the same bf16 weights, the same
per-row arithmetic: the first batch's logits compare equal bit for bit), so they differ only
where a weight's gradient is summed over the batch's tokens. Each sum is accumulated in fp32
inside the kernel (an error of n 2^-24, negligible) and its result rounded to bf16 once (at
most u = 2^-8 of its size). The runtime rounds each (rank, micro-batch) block's sum, adds the
blocks in fp32, and its total is rounded once more when verify reads it back as the bf16
``.grad`` (ShardedAdamW.full_gradients): 2 roundings; the reference rounds its full sum once;
a tied embedding's two uses (lookup and head) are added in bf16 by autograd, one more
rounding on each side: 4 at most. With no block's sum larger than the tensor's largest
gradient, the difference of any element is at most 4 u = 2^-6 = 1.6% of the tensor's largest
gradient: the ``grad`` tolerance of ``bf16-master``, held as max|got - ref| / max|ref| (the
``rel`` metric). (Measured on the tied std=0.2 llama, dp=2,zero=1 at seq 64: 2.8 u.) The
absolute 5e-3 of ``bf16`` cannot hold here: a gradient of 0.7 has a bf16 spacing of 2^-8 =
3.9e-3, so one rounding flip on each side exceeds it."""
BF16_PARAM_ULP = 2.0**-7
"""The largest spacing of bf16 values relative to the value (2 u): after each step both sides
round their fp32 masters to the nearest bf16 parameter, so two masters that AdamW left within
``param`` of each other may still land one spacing apart (a parameter near 1 by 2^-7 = 7.8e-3).
``bf16-master``'s parameter check allows each element that one spacing, 2^-7 |p|, on top of the
``param`` tolerance (which is itself above what AdamW can move apart in a few steps: 2 C lr per
step, 6e-3 at lr 1e-3 and 3 steps, ``adamw_step_allowance``)."""
TOLERANCES["bf16-master"] = dict(TOLERANCES["bf16"], grad=BF16_MASTER_GRAD_ROUNDINGS * BF16_UNIT_ROUNDOFF)
GRAD_METRIC = {"fp32": "abs", "bf16": "abs", "bf16-master": "rel"}


def split_roundings(layout) -> int:
    """How many times a bf16 run of ``layout`` may round a value the single-device reference rounds
    once, plus one: the bound factor ``k`` of ``anchored_tolerance``. A row-parallel output over
    ``tp`` ranks is rounded to bf16 in each rank's partial GEMM and again in the bf16 sum (``tp + 1``
    roundings where the reference has 1); ring attention over ``cp`` ranks likewise rounds each of
    its ``cp`` block results and their merge (``cp + 1``). To first order in the unit roundoff the
    errors these inject add up through the network: the split run's distance from the exact (fp32)
    result is at most ``R`` times the reference's, ``R = 1 + tp [tp > 1] + cp [cp > 1]``, and
    ``|split - ref| <= |split - fp32| + |ref - fp32| <= (R + 1) |ref - fp32|``: ``k = R + 1``."""
    return 2 + (layout.tp if layout.tp > 1 else 0) + (layout.cp if layout.cp > 1 else 0)


def anchored_tolerance(base: float, layout, ref: torch.Tensor, exact: torch.Tensor) -> float:
    """The bf16 tolerance of one checked quantity of a split (tp / cp) layout: ``split_roundings(layout)``
    times the reference's own distance from an fp32 run of the same weights and batch (``exact``),
    measured in this run, or the fixed ``base`` tolerance where that is larger. The split run and the
    reference round at the same points but at the reductions the split adds (``split_roundings``), so
    a split run off by more than that is off by more than bf16 arithmetic explains."""
    own = float((ref.detach().double().cpu() - exact.detach().double().cpu()).abs().max()) if ref.numel() else 0.0
    return max(base, split_roundings(layout) * own)


@dataclass
class Check:
    name: str
    max_abs: float
    max_rel: float
    tol: float
    metric: str  # "abs" or "rel": which of the two is held against tol
    excess: float | None = None
    """With an elementwise allowance: max(|got - ref| - allowance), held against tol instead."""
    allowance: float = 0.0
    """The largest elementwise allowance (0 without one)."""

    @property
    def passed(self) -> bool:
        value = self.max_abs if self.metric == "abs" else self.max_rel
        if self.excess is not None:
            value = self.excess
        return math.isfinite(value) and value <= self.tol

    def to_dict(self) -> dict:
        return dict(name=self.name, max_abs=self.max_abs, max_rel=self.max_rel, tol=self.tol, metric=self.metric,
                    allowance=self.allowance, passed=self.passed)


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float, metric: str = "abs",
            allowance: torch.Tensor | None = None) -> Check:
    """Max abs / rel difference of two tensors; with ``allowance`` (same shape, abs metric), each
    element may differ by its allowance on top of ``tol``."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        return Check(name, float("inf"), float("inf"), tol, metric)
    diff = (got - ref).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    if allowance is None or not diff.numel():
        return Check(name, max_abs, max_abs / scale if scale > 0 else max_abs, tol, metric)
    allowance = allowance.double().cpu()
    return Check(name, max_abs, max_abs / scale if scale > 0 else max_abs, tol, metric,
                 excess=float((diff - allowance).max()), allowance=float(allowance.max()))


def adamw_step_allowance(sqrt_v_hat, grad_diff: float, lr: float, step: int, betas, eps: float):
    """How far one AdamW step's update can move between two runs whose gradients have differed
    by at most ``grad_diff`` (any element, any step so far), per element, given the reference's
    bias-corrected sqrt(v_hat) after this step (a tensor, or 0.0 for the worst case).

    Derivation (update f = m_hat / (sqrt(v_hat) + eps), times lr): m_hat is a weighted mean of
    the gradient history (weights w_s summing to 1) and sqrt(v_hat) a weighted 2-norm of it
    (weights a_s), so both move by at most D = grad_diff. By Cauchy-Schwarz |m_hat| <= C sqrt(v_hat)
    with C = sqrt(sum w_s^2 / a_s) (1 at step 1), hence |df/dm| <= 1/(r + eps) and |df/dr| <=
    C/(r + eps) at any point r >= sqrt(v_hat) - D between the two runs: |df| <= (1 + C) D /
    (max(sqrt(v_hat) - D, 0) + eps); and |f| <= C, so never more than 2C. Decoupled weight decay
    shrinks an earlier difference by (1 - lr wd) < 1, so the steps' allowances add up."""
    b1, b2 = betas
    w = [(1 - b1) * b1 ** (step - s) / (1 - b1**step) for s in range(1, step + 1)]
    a = [(1 - b2) * b2 ** (step - s) / (1 - b2**step) for s in range(1, step + 1)]
    c = math.sqrt(sum(wi * wi / ai for wi, ai in zip(w, a)))
    if isinstance(sqrt_v_hat, torch.Tensor):
        return lr * torch.clamp((1 + c) * grad_diff / ((sqrt_v_hat - grad_diff).clamp(min=0) + eps), max=2 * c)
    return lr * min(2 * c, (1 + c) * grad_diff / (max(sqrt_v_hat - grad_diff, 0.0) + eps))


ULPS_PER_STEP = 4 * torch.finfo(torch.float32).eps
"""fp32 rounding of one AdamW update, relative to the parameter's magnitude."""


class MasterWeightsAdamW:
    """The reference's optimiser when the layout holds bf16 parameters (spec/support.py's
    ``held_param_dtype``): the same policy as the runtime's mixed-precision ZeRO
    (parallel/zero_optimizer.py), on one device. The model's parameters are cast to bf16 once
    their fp32 master copies are taken; after the backward each bf16 gradient is taken into its
    master's fp32 ``.grad`` (``take_grads``, where clipping then acts, as the runtime clips its
    fp32 master gradients), AdamW steps the fp32 masters, and the result is copied back into the
    bf16 parameters (rounded to nearest). The masters are never refreshed from the parameters."""

    def __init__(self, model, dtype=torch.bfloat16, **adamw):
        self.pairs = []
        with torch.no_grad():
            for p in model.parameters():
                master = p.detach().clone().float()
                p.data = p.data.to(dtype)
                self.pairs.append((p, master))
        self.optim = torch.optim.AdamW([m for _, m in self.pairs], **adamw)
        self.param_groups = self.optim.param_groups

    def take_grads(self) -> list[torch.Tensor]:
        """Move every parameter's (bf16) gradient into its master's fp32 ``.grad``; the masters."""
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def step(self) -> None:
        self.optim.step()
        for p, master in self.pairs:
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            p.grad = None


# --- gathering full tensors ---------------------------------------------------------------


def gather_full(chunks, which: str = "param") -> dict[str, torch.Tensor] | None:
    """{fqn: full tensor} of every parameter (``which="param"``) or gradient (``"grad"``), on rank 0.
    Collective: every rank must call it."""
    from modelcarve.runtime.distributed.shards import shards_of

    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        copies = set()
        try:
            from modelcarve.runtime.distributed.shards import tied_copy_names

            copies = set(tied_copy_names(chunk))
        except ImportError:
            pass
        shards = shards_of(chunk)
        from modelcarve.runtime.distributed.shards import padding_of

        padding = padding_of(chunk)
        for fqn, p in chunk.named_parameters():
            t = p if which == "param" else p.grad
            if t is None:
                t = torch.zeros_like(p)
            t = t.detach()
            if isinstance(t, DTensor):
                t = t.full_tensor()
            for group, dim in reversed(shards.get(fqn, [])):
                t = gather_cat(t, dim, group)
            if fqn in padding:  # vocabulary padding: the full tensor is the true vocabulary's
                dim, size, _ = padding[fqn]
                t = t.narrow(dim, 0, size)
            if fqn not in copies:
                local[fqn] = t.float().cpu()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for fqn, t in part.items():
            merged.setdefault(fqn, t)
    return merged


def gather_logits(chunks, layout, mesh, tokens, runner=None) -> torch.Tensor | None:
    """Logits of the global batch on rank 0, or None where the layout cannot produce them here
    (cp > 1 together with pp > 1). cp pieces are reassembled by context.unshard_sequence. With
    pp > 1 the pipeline runs forward only (torch's ``schedule.eval``) and the last stage's
    logits travel to rank 0."""
    from modelcarve.runtime.distributed.mesh import axis_group, axis_rank
    from modelcarve.runtime.train.trainer import autocast

    if (layout.cp > 1 and layout.pp > 1) or (layout.pp > 1 and runner is None):
        return None
    hooks = StepHooks(chunks, layout, mesh)
    rows = tokens.shape[0] // layout.dp
    dp_rank = axis_rank(mesh, "dp")
    local = tokens[dp_rank * rows : (dp_rank + 1) * rows]
    local = local.to(next((p.device for c in chunks for p in c.parameters()), local.device))
    local, _, positions = hooks.shard_batch(local, None)  # cp > 1: this rank's zig-zag piece
    last = chunks[-1]
    with torch.no_grad(), autocast(layout):
        if layout.pp == 1:
            logits = chunks[0](local, positions)
        else:
            args = (local,) if runner.has_first else ()
            # the schedule computes a loss on the last stage; any valid ids serve as its targets
            logits = runner.schedule.eval(*args, target=local if runner.has_last else None,
                                          positions=torch.arange(tokens.shape[1], device=local.device))
            if not runner.has_last:
                logits = None
    if logits is not None:
        logits = logits.float()
        if getattr(last, "vocab_parallel", False):
            logits = gather_cat(logits, -1, axis_group(mesh, "tp"))
        logits = logits[..., : last.spec.vocab_size]  # vocabulary padding cut off
        logits = hooks.unshard_sequence(logits, dim=1)
    if layout.pp == 1:
        if layout.dp > 1:
            logits = gather_cat(logits, 0, axis_group(mesh, "dp"))
        return logits if dist.get_rank() == 0 else None
    # pp > 1: the last stage of each data-parallel replica sends its rows to rank 0
    send = (dp_rank, logits) if logits is not None and axis_rank(mesh, "tp") == 0 else None
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(send, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    by_dp = dict(p for p in parts if p is not None)
    return torch.cat([by_dp[i] for i in range(layout.dp)], dim=0)


# --- the run ----------------------------------------------------------------------------------


def verify_worker(model: str, layout: str, steps: int = 3, seed: int = 0, data: str | None = None,
                  lr: float = 1e-3, dtype: str | None = None, moe: dict | None = None,
                  against_plan: bool = False) -> dict | None:
    """Run on every rank after init_distributed(); returns the report on rank 0.

    ``moe``: MoE options of TrainConfig (moe_capacity_factor, moe_aux_loss_coef, moe_bias_rate),
    applied to both runs. ``against_plan``: the first step's bytes and memory beside the
    planner's (verify/against_plan.py), in ``report["against_plan"]``. MoE models also get ``routing/step<i>/<layer>`` checks (tokens per
    expert and dropped assignments over the global batch equal the reference's, exactly) and
    the per-step expert statistics in ``report["moe"]``."""
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.build import build_chunks
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data, reference_step, seed_everything
    from modelcarve.spec.layout import Layout

    model_name, layout = model, Layout.parse(layout)
    if dtype:
        layout = layout.replace(param_dtype=dtype)
    seed_everything(seed)
    mesh = build_mesh(layout)
    from modelcarve.runtime.distributed.mesh import device_type

    rank0 = dist.get_rank() == 0
    whole = []  # rank 0: an unsplit copy of the same weights, taken before parallelize consumes the model

    def keep_reference(model, _spec) -> None:
        whole.append(copy.deepcopy(model) if rank0 else None)

    # every rank builds the whole model (a checkpoint read whole) so rank 0 can keep it
    chunks, spec = build_chunks(model_name, layout, mesh, seed=seed, device=device_type(), sharded=False,
                                on_model=keep_reference)
    reference = whole[0]
    config = TrainConfig(lr=lr, seed=seed, **(moe or {}))
    ref_hooks = StepHooks([reference])  # the single-device reference's MoE options and counts
    if spec.is_moe and rank0:
        ref_hooks.configure_moe(capacity_factor=config.moe_capacity_factor, aux_loss_coef=config.moe_aux_loss_coef)
    moe_stats = []
    trainer = Trainer(chunks, layout, mesh, config)
    source = make_data(data, spec.vocab_size, seed)
    bf16 = layout.param_dtype == "bf16"
    # the reference holds the layout's precision policy: bf16 parameters with fp32 masters where
    # the runtime does (ZeRO-1/2), fp32 parameters under autocast elsewhere
    mixed = held_param_dtype(layout) == "bf16"
    # bf16-master's gradient bound assumes every activation of a row is computed identically on
    # both sides (BF16_MASTER_GRAD_ROUNDINGS); tp and cp split sums inside the forward (row-parallel
    # outputs, ring attention's softmax) and so keep the bf16 tolerances, not derived for them
    exact_rows = layout.tp == 1 and layout.cp == 1
    policy = "bf16-master" if mixed and exact_rows else "bf16" if bf16 else "fp32"
    tol = TOLERANCES[policy]
    # split bf16 layouts (tp / cp reductions inside the forward) get the logits and first gradients
    # bounded against an fp32 run of the reference's weights (anchored_tolerance); rank 0 keeps it
    anchor, anchor_grads = None, {}
    if rank0 and policy == "bf16" and (layout.tp > 1 or layout.cp > 1):
        anchor = copy.deepcopy(reference).float()
    checks: list[Check] = []
    ref_opt = None
    if rank0:
        ref_opt = MasterWeightsAdamW(reference, **config.adamw()) if mixed else \
            torch.optim.AdamW(reference.parameters(), **config.adamw())
    from modelcarve.verify.against_plan import AgainstPlan

    probe = AgainstPlan(trainer, spec, layout) if against_plan else None
    losses = []
    grad_diff, allowance = 0.0, {}  # the largest gradient difference so far; per-parameter allowance
    for step in range(steps):
        tokens, targets = source.batch(step, layout.global_batch, layout.seq)
        if step == 0:
            logits = gather_logits(chunks, layout, mesh, tokens, trainer.runner)
            if rank0 and logits is not None:
                with torch.no_grad(), torch.autocast(device_type(), dtype=torch.bfloat16, enabled=bf16):
                    ref_logits = reference(tokens.to(device_type())).float()
                logits_tol = tol["logits"]
                if anchor is not None:
                    with torch.no_grad():
                        logits_tol = anchored_tolerance(logits_tol, layout, ref_logits, anchor(tokens.to(device_type())))
                checks.append(compare("logits", logits, ref_logits, logits_tol))
            if spec.is_moe:  # count the training step only
                trainer.hooks.reset_moe_counts()
                if rank0:
                    ref_hooks.reset_moe_counts()
        # the counted step: the second when there is one (the first follows the logits' forward,
        # which leaves FSDP2's root unit gathered: not a steady-state step)
        counted = probe if probe and step == min(1, steps - 1) else trainer
        loss = counted.forward_backward(tokens, targets)
        if rank0:
            ref = reference_step(reference, ref_opt, tokens, targets, TrainConfig(lr=lr, max_norm=0.0), bf16)
            if anchor is not None and step == 0:  # the fp32 run of the same weights and batch: its gradients
                reference_step(anchor, None, tokens, targets, TrainConfig(lr=lr, max_norm=0.0), False)
                anchor_grads = {fqn: p.grad for fqn, p in anchor.named_parameters()}
            losses.append((loss, ref["loss"]))
            checks.append(compare(f"loss/step{step}", torch.tensor(loss), torch.tensor(ref["loss"]), tol["loss"], "rel"))
        if hasattr(trainer.optimizer, "full_gradients"):  # ZeRO-1/2 hold the reduced gradient in shards
            trainer.optimizer.full_gradients()
        grads = gather_full(chunks, "grad")
        if rank0:
            step_diff, step_grad = 0.0, 0.0
            for fqn, ref_p in reference.named_parameters():
                got = grads.get(fqn)
                ref_g = ref_p.grad if ref_p.grad is not None else torch.zeros_like(ref_p)
                grad_tol = tol["grad"]
                if step == 0 and anchor_grads.get(fqn) is not None:
                    grad_tol = anchored_tolerance(grad_tol, layout, ref_g, anchor_grads[fqn])
                check = compare(f"grad/{fqn}", got if got is not None else torch.full((0,), math.nan), ref_g, grad_tol,
                                GRAD_METRIC[policy])
                if step == 0:
                    checks.append(check)
                step_diff, step_grad = max(step_diff, check.max_abs), max(step_grad, float(ref_g.abs().max()))
            if step > 0 and not bf16:
                checks.append(Check(f"grad_max/step{step}", step_diff, step_diff, tol["grad"], "abs"))
        norm = counted.optimizer_step()
        if rank0:
            clipped = ref_opt.take_grads() if mixed else reference.parameters()
            ref_norm = torch.nn.utils.clip_grad_norm_(clipped, config.max_norm or math.inf)
            checks.append(compare(f"grad_norm/step{step}", torch.tensor(norm), ref_norm, tol["loss"], "rel"))
            # clipping scales every gradient by max_norm / norm: a relative norm difference rho
            # moves each clipped gradient by at most |g| rho more
            rho = abs(norm - float(ref_norm)) / max(float(ref_norm), 1e-30)
            grad_diff = max(grad_diff, step_diff + step_grad * rho)
            ref_opt.step()
            # bf16 needs no allowance: its parameter tolerance (1e-2) is above the most AdamW can
            # move apart in `steps` steps (2 C lr per step; 6e-3 at lr 1e-3 and 3 steps), and its
            # later-step gradients differ by more than reassociation (routing flips), so only
            # fp32 checks grad_max and conditions the parameter check on it
            for ref_p in ([] if bf16 else reference.parameters()):
                state = ref_opt.state.get(ref_p)
                if state:
                    t = int(state["step"])
                    sqrt_v_hat = (state["exp_avg_sq"] / (1 - config.betas[1] ** t)).sqrt()
                    allowance[ref_p] = allowance.get(ref_p, 0.0) + ULPS_PER_STEP * ref_p.detach().abs() + \
                        adamw_step_allowance(sqrt_v_hat, grad_diff, ref_opt.param_groups[0]["lr"], t, config.betas, config.eps)
            ref_opt.zero_grad(set_to_none=True)
        if spec.is_moe:
            moe_stats.append(trainer.moe_stats())
            if rank0:
                ref_stats = ref_hooks.moe_stats(bias_rate=config.moe_bias_rate)
                for fqn, row in ref_stats.items():
                    got = moe_stats[-1].get(fqn, {})
                    for key in ("tokens_per_expert", "dropped"):
                        value = torch.tensor(got[key] if key in got else math.nan, dtype=torch.float64)
                        checks.append(compare(f"routing/step{step}/{fqn}/{key}", value,
                                              torch.tensor(row[key], dtype=torch.float64), tol["routing"], "rel"))
    from modelcarve.runtime.measure.metrics import memory_stats

    memory = [None] * dist.get_world_size()
    dist.all_gather_object(memory, memory_stats(chunks, trainer.optimizer))
    params = gather_full(chunks, "param")
    from modelcarve.verify.against_plan import gather_rows, passed

    plan_rows = gather_rows(probe.rows()) if probe else None
    if not rank0:
        return None
    for fqn, ref_p in reference.named_parameters():
        got = params.get(fqn)
        allow = BF16_PARAM_ULP * ref_p.detach().float().abs() if mixed else allowance.get(ref_p)  # one bf16 spacing
        checks.append(compare(f"param/{fqn}", got if got is not None else torch.full((0,), math.nan), ref_p, tol["param"],
                              allowance=allow))
    return dict(
        model=spec.name,
        layout=layout.short(),
        layout_fields=layout.to_dict(),
        world_size=dist.get_world_size(),
        steps=steps,
        dtype=layout.param_dtype,
        precision=policy,  # the tolerances' key: bf16-master where both sides hold bf16 parameters
        tolerances=tol,
        losses=[dict(parallel=a, reference=b) for a, b in losses],
        checks=[c.to_dict() for c in checks],
        passed=all(c.passed for c in checks) and (plan_rows is None or passed(plan_rows)),
        moe=moe_stats,
        memory=memory,
    ) | ({"against_plan": plan_rows} if plan_rows is not None else {})


def summarise(report: dict) -> list[dict]:
    """One row per kind (logits, loss, grad, param): worst case and pass/fail."""
    rows = []
    for kind in report.get("kinds", ("logits", "loss", "grad_norm", "grad", "grad_max", "param", "routing")):
        group = [c for c in report["checks"] if c["name"].split("/")[0] == kind]
        if not group:
            rows.append(dict(kind=kind, count=0, worst="-", max_abs=float("nan"), max_rel=float("nan"), tol=None, passed=None))
            continue
        key = "max_rel" if group[0]["metric"] == "rel" else "max_abs"
        worst = max(group, key=lambda c: c[key] if math.isfinite(c[key]) else float("inf"))
        rows.append(dict(kind=kind, count=len(group), worst=worst["name"], max_abs=max(c["max_abs"] for c in group),
                         max_rel=max(c["max_rel"] for c in group), tol=worst["tol"], metric=group[0]["metric"],
                         passed=all(c["passed"] for c in group)))
    return rows
