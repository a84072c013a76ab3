"""The "train" goal: every layout of a training job, screened fast, ranked by tokens/s.

Usage::

    from modelcarve.plan.search import search
    result = search(get_model("gpt3-175b"), parse_cluster("128x8xA100-80GB"), "train",
                    global_batch=1536, seq=2048, top=5)

The space (``candidates``): every factorisation ``devices = tp x cp x pp x dp`` with tp dividing
the heads and FFN sizes (and kv heads or their multiple), pp at most the layer count, cp with
chunks of at least ``MIN_CP_CHUNK`` tokens (shorter chunks leave ring attention nothing to
overlap), dp dividing the global batch; ep dividing the experts and dp x cp (MoE); every
micro-batch size dividing the per-replica batch up to ``MAX_MBS`` and ``MAX_MB_TOKENS``; SP on/off when tp > 1;
recomputation none/selective/full (op-level modes are estimated when a layout names them, not
searched); expert parallelism also folded over the TP ranks with expert TP 1 (MoE parallel
folding); param_dtype bf16, or the one ``precision`` names (fp8, fp8-cs, mxfp8); gradients fp32, or
bf16 under ``grad_dtype="bf16"`` (the framework's setting, never searched: space.grad_dtype_of); ZeRO 0-3 when there is a data-parallel group, plus HSDP
(ZeRO-3 sharded inside a node, replicated across); schedules 1F1B, GPipe, zero-bubble and
interleaved 1F1B with every virtual-stage count that divides the layers per stage (when the
micro-batch count is a multiple of pp, as Megatron requires).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator

from modelcarve.plan.train.candidate import Candidate
from modelcarve.plan.train.model import TrainCostModel, TrainOptions
from modelcarve.plan.train.space import (MAX_MB_TOKENS, MAX_MBS, MAX_VIRTUAL, MIN_CP_CHUNK,  # noqa: F401 (re-exported)
                                         _precisions, candidate_layout, enumerate_layouts, grad_dtype_of,
                                         layout_blocks)
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout
from modelcarve.spec.support import training_problems

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

_OPTION_FIELDS = {f.name for f in dataclasses.fields(TrainOptions)}


class TrainGoal:
    """Maximise training tokens/s subject to the worst device's memory."""

    name = "train"
    description = "training throughput (tokens/s) of one optimiser step, memory-feasible"

    def __init__(self) -> None:
        self._models: dict = {}

    # --- cost models are cached per (model, cluster, options) -----------------------------------
    def cost_model(self, model: "ModelSpec", cluster: "ClusterSpec", **options) -> TrainCostModel:
        opts = TrainOptions(**{k: v for k, v in options.items() if k in _OPTION_FIELDS and v is not None})
        key = (model, cluster, opts)
        cost = self._models.get(key)
        if cost is None:
            if len(self._models) > 16:
                self._models.clear()
            cost = self._models[key] = TrainCostModel(model, cluster, opts)
        return cost

    # --- the Goal protocol ---------------------------------------------------------------------------
    def candidates(self, model: "ModelSpec", cluster: "ClusterSpec", **options) -> Iterator[Candidate]:
        gbs = options.get("global_batch")
        seq = options.get("seq") or 2048
        if not gbs:
            raise LayoutError("planning a training job needs the global batch: give --global-batch (sequences per step)")
        precisions = _precisions(cluster, options.get("precision"))
        yield from enumerate_layouts(model, cluster, gbs, seq, precisions=precisions,
                                     grad_dtype=grad_dtype_of(options.get("grad_dtype")),
                                     **{k: options[k] for k in ("max_mbs",) if k in options})

    def prepare(self, model: "ModelSpec", cluster: "ClusterSpec", **options):
        return self.cost_model(model, cluster, **options)._evaluate  # screen() without the extra call

    def sweep(self, model: "ModelSpec", cluster: "ClusterSpec", top: int, **options) -> tuple:
        """The search's screening pass (plan/train/sweep.py: the same answer as screening every
        candidate, tokens/s computed only where it can change it)."""
        from modelcarve.plan.train.sweep import sweep

        return sweep(self, model, cluster, top, **options)



    def family(self, model: "ModelSpec", cluster: "ClusterSpec", candidate: Candidate) -> str | None:
        """Label of the kind of layout, for 'why not X' alternatives in a plan."""
        tp, cp, pp, dp, ep, _mbs, _sp, _rc, zero = candidate[:9]
        if len(candidate) > 15 and ep > 1 and candidate[15] != tp:  # etp: MoE parallel folding
            return "MoE parallel folding (EP over the TP ranks)"
        if tp > cluster.fast_domain:
            return "tensor parallelism across nodes"
        if tp == 1 and pp == 1 and cp == 1 and zero == 3:
            return "ZeRO-3 / FSDP alone"
        if tp == 1 and pp == 1 and cp == 1:
            return "data parallelism alone"
        if pp == 1:
            return "no pipeline"
        return None

    def evaluate(self, model: "ModelSpec", cluster: "ClusterSpec", candidate, **options) -> dict:
        if isinstance(candidate, Layout):
            options = dict(options)
            gbs = options.get("global_batch")
            if gbs and candidate.gbs and gbs != candidate.gbs:
                raise LayoutError(f"the layout says gbs={candidate.gbs} but the global batch given is {gbs}; drop one")
            if gbs and not candidate.gbs:
                candidate = candidate.replace(gbs=gbs)
            if options.get("seq") and options["seq"] != candidate.seq:
                candidate = candidate.replace(seq=options["seq"])
            candidate.validate(model, cluster)  # also checks the batch divides into micro-batches
            if candidate.redundant_experts:
                raise LayoutError(
                    f"redundant_experts={candidate.redundant_experts}: redundant experts (EPLB) are a serving technique "
                    f"the training planner does not price; use redundant_experts=0 with ep dividing the experts, or a "
                    f"serve-* goal")
            options["global_batch"], options["seq"] = candidate.global_batch, candidate.seq
        cost = self.cost_model(model, cluster, **options)
        estimate = cost.estimate(candidate)
        estimate["runtime"] = runtime_mark(model, estimate["layout"])
        return estimate

    def score(self, result: dict) -> float:
        tps = result["time"]["tokens_per_s"]
        return tps if result["fits"] else -1.0 / tps

    def compare(self, result: dict, best: dict) -> str:
        """Why ``result`` ranks below ``best``: the part of its step that grew most against the winner's."""
        step, best_step = result["time"]["step_s"], best["time"]["step_s"]
        parts, best_parts = _step_parts(result), _step_parts(best)
        key = max(parts, key=lambda k: parts[k][1] / step - best_parts[k][1] / best_step)
        label, seconds = parts[key]
        ratio = result["time"]["tokens_per_s"] / best["time"]["tokens_per_s"]
        return (
            f"{result['short']} reaches {ratio:.0%} of the winner's tokens/s: {label} {seconds / step:.0%} "
            f"of its step (winner: {best_parts[key][1] / best_step:.0%})"
        )


def runtime_mark(model: "ModelSpec", layout: dict) -> dict:
    """Whether modelcarve's own runtime (``modelcarve run``) executes this layout, and if not, why:
    spec/support.py's one check, so a plan never ranks a layout as runnable that ``run`` refuses.
    Shown beside the estimate, never a reason to drop it (another framework may run it)."""
    problems = training_problems(Layout.from_dict(layout), model)
    return {"runs": not problems, "why": "; ".join(problems)}


_AXIS_NAMES = {"tp": "tensor-parallel all-reduces", "cp": "context-parallel exchanges", "ep": "expert all-to-alls",
               "pp": "pipeline sends", "dp": "data-parallel gradient and parameter collectives"}


def _step_parts(result: dict) -> dict[str, tuple[str, float]]:
    """Parts of a step by key, each with the words (subject and verb) that name it in this layout."""
    t, c = result["time"], result["comm"]
    parts = {
        "compute": ("compute (GEMMs and element-wise kernels) takes", t["compute_s"] - t["recompute_s"]),
        "recompute": ("recomputing activations takes", t["recompute_s"]),
        "bubble": ("the pipeline bubble takes", t["bubble_s"]),
        "optimizer": ("the optimizer step takes", t["optimizer_s"]),
    }
    for axis, seconds in c["exposed_s_by_axis"].items():
        link = "across nodes" if c["link_by_axis"][axis] == "inter" else "inside the node"
        parts[axis] = (f"exposed {_AXIS_NAMES[axis]} {link} take", seconds)
    return parts




GOAL = TrainGoal()
