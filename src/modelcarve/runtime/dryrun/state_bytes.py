"""Per-rank parameter / gradient / optimiser bytes of a layout at full scale, measured without devices.

``dry_run_bytes(model_name, layout, cluster)`` builds the whole model ONCE on the ``meta`` device
(shapes, no storage), then for every pipeline rank initialises torch's ``fake`` process group of
the layout's FULL world size at a rank of that stage (``init_process_group("fake", rank=r,
world_size=W, store=FakeStore())``: every collective returns at once), builds the mesh and runs
``parallelize`` on it: the same pipeline split, tensor/expert/context parallelism and FSDP2
wrapping a real launch does. Each stage only touches its own layers (pipeline_split shares the
modules), so one meta model serves every stage.

Which ranks are distinct: ranks of one stage that differ in tp / ep / cp / dp coordinates hold
tensors of the same shapes (TP and EP split evenly, the vocabulary is padded to a multiple of
tp). What differs inside a stage is the data-parallel partition of the ZeRO state, so every
rank's figures are computed from the stage's built parameter list and grouped: one row per
distinct (stage, figures), with how many ranks share it.

The byte figures need no training step (the proof, checked against torch in
tests/runtime/test_dry_run_bytes.py):
* weights: ZeRO-1/2 with ``param_dtype=bf16`` holds bf16 parameters (zero_optimizer.py's mixed
  precision: the fp32 master is the optimiser's owned range), so 2 bytes x local elements; every
  other layout keeps fp32 parameters (bf16 runs under autocast), 4 bytes x local elements (a
  DTensor's local shard under FSDP2);
* gradients: autograd accumulates ``.grad`` in the parameter's shape and dtype; FSDP2
  reduce-scatters into the sharded gradient, so the same local elements x 4;
* optimiser: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the parameter (2 x 4 bytes per
  local element; its ``step`` counters are host scalars, not device memory). ZeRO-1/2 is
  zero_optimizer.ShardedAdamW: one flat bucket per gradient group (dense: dp x cp; experts:
  their expert-data-parallel group), padded to a multiple of the group size ``n``; each rank
  owns ``padded / n`` elements and keeps an fp32 master copy of them plus the two moments (12
  bytes each). ZeRO-1 keeps the whole padded flat gradient buffer, ZeRO-2 its owned range (fp32
  under mixed precision too: the hooks accumulate the bf16 micro-batch gradients into it).

The planner's figures (``planner_figures``) are plan/train/model.py's ``rank_state_parts`` of
each pipeline rank (the layers spec/stages.py's split gives it: the split ``parallelize``
builds) for the same cluster: weights, gradients, optimizer_states, priced for the parameters as
the runtime holds them: the planner's ``param_policy="modelcarve"`` (plan/train/states.py
``stored_param_dtype``, which reads spec/support.held_param_dtype, the one precision-policy rule):
a bf16 layout the runtime keeps in fp32 (zero=0, FSDP2, a ZeRO stage over one replica) is priced
as fp32 parameters that are their own master copy, 4 + 4 + 8 bytes a parameter, as torch-native
trainers (FSDP2, DDP under autocast) hold them, which ``estimate --framework modelcarve`` prints
too; plain ``estimate`` prices Megatron's bf16 weights with an fp32 master (2 + 4 + 12). ``compare`` marks a category different when it is off by more than
``tolerance_bytes(layout)``: the planner divides element counts by ``n`` as a real number, the
buckets pad each group to a multiple of ``n``, so a category may exceed the planner's by under
``n`` elements per bucket, at most 12 bytes each: 12 x (n_dense + n_expert) bytes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.stages import stage_kind
from modelcarve.spec.support import held_param_dtype

MASTER_BYTES = 4  # fp32 master weights, gradients and Adam moments (train/trainer.py, spec/support.py)
LOW_BYTES = 2  # bf16 parameters of mixed-precision ZeRO-1/2 (zero_optimizer.py)
CATEGORIES = ("weights", "gradients", "optimizer_states")
ZERO_STATE_BYTES = 12  # zero_optimizer: fp32 master of the owned range + exp_avg + exp_avg_sq


def tolerance_bytes(layout) -> float:
    """Largest padding difference between the planner's real-valued shards and the buckets'."""
    n_dense = (layout.dp_shard or layout.dp) * layout.cp
    n_exp = max(1, layout.tp * layout.cp * layout.dp // (layout.expert_tp * layout.ep))
    return float(12 * (n_dense + n_exp))


def fsdp_local(shape: tuple, index: int, n: int) -> int:
    """Elements of FSDP2 shard ``index`` of ``n`` of a parameter of ``shape`` (dim-0 chunks of
    ceil(d0 / n) rows, the last ones short or empty, as torch.chunk)."""
    if not shape:
        return 1 if index == 0 else 0
    d0, rest = shape[0], 1
    for d in shape[1:]:
        rest *= d
    chunk = -(-d0 // n)
    return max(0, min(chunk, d0 - index * chunk)) * rest


def _stage_params(chunks) -> list[tuple[str, tuple, int, bool]]:
    """(fqn, full shape before FSDP, local elements on this rank, is-expert-group) per parameter."""
    from torch.distributed.tensor import DTensor

    from modelcarve.runtime.distributed.shards import grad_groups_of

    rows = []
    for chunk in chunks:
        overrides = grad_groups_of(chunk)
        for fqn, p in chunk.named_parameters():
            local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            rows.append((fqn, tuple(p.shape), local, fqn in overrides))
    return rows


def _rank_figures(layout, params, q: int) -> tuple[float, float, float]:
    """(weights, gradients, optimiser) bytes of the stage rank ``q`` (0 <= q < tp x cp x dp)."""
    tp, cp, dp, ep = layout.tp, layout.cp, layout.dp, layout.ep
    replicas = dp * cp
    f = q // tp  # dp x cp index (TP innermost: q = (d * cp + c) * tp + t)
    zero = layout.zero if replicas > 1 else 0
    if zero == 3:
        shard_n = (layout.dp_shard or dp) * cp
        expert_n = max(1, replicas // ep)
        elems = 0
        for _fqn, shape, _local, expert in params:
            n, i = (expert_n, f // ep) if expert and ep > 1 else (shard_n, f % shard_n)
            elems += fsdp_local(shape, i, n)
        return elems * MASTER_BYTES, elems * MASTER_BYTES, 2.0 * elems * MASTER_BYTES
    elems = sum(local for _f, _s, local, _e in params)
    if zero == 0:
        return elems * MASTER_BYTES, elems * MASTER_BYTES, 2.0 * elems * MASTER_BYTES
    dense_n = (layout.dp_shard * cp) if layout.dp_shard and layout.dp_shard < dp else replicas
    expert_n = max(1, tp * cp * dp // (layout.expert_tp * ep)) if layout.folded else max(1, replicas // ep)
    grads = opt = 0
    for expert, n in ((False, dense_n), (True, expert_n)):
        total = sum(local for _f, _s, local, e in params if e == expert)
        padded = -(-total // n) * n  # zero_optimizer._Bucket: one flat bucket per gradient group
        grads += padded if zero == 1 else padded // n  # ZeRO-1 keeps the flat buffer, ZeRO-2 its range
        opt += padded // n
    weight = LOW_BYTES if held_param_dtype(layout) == "bf16" else MASTER_BYTES
    return elems * weight, grads * MASTER_BYTES, ZERO_STATE_BYTES * opt


def measure(model_name: str, layout) -> dict:
    """{pp_rank: {"params": [...], "ranks": {q: (w, g, o)}}} for every pipeline rank (module doc)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelcarve.runtime.checkpoint.hf_load import load_model, model_spec
    from modelcarve.runtime.distributed.mesh import build_mesh, destroy, init_distributed
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.spec.support import check_training

    if dist.is_initialized():
        raise LayoutError("the dry run needs a process without a process group (it plays the ranks itself)")
    check_training(layout, model_spec(model_name), world_size=layout.world_size)  # before the 10 s build
    model, _spec = load_model(model_name, device="meta", dtype=torch.float32)
    per_stage = layout.tp * layout.cp * layout.dp
    out = {}
    for p in range(layout.pp):
        dist.init_process_group("fake", store=FakeStore(), rank=p * per_stage, world_size=layout.world_size)
        try:
            init_distributed()
            chunks = parallelize(model, layout, build_mesh(layout))
            params = _stage_params(chunks)
            ranks = {q: _rank_figures(layout, params, q) for q in range(per_stage)}
            out[p] = {"params": params, "ranks": ranks, "stages": [getattr(c, "stage_index", 0) for c in chunks],
                      "layers": sum(len(getattr(c, "layer_ids", list(c.layers.keys()))) for c in chunks)}
        finally:
            destroy()
    return out


def _bf16_held_in_fp32(layout) -> bool:
    """A bf16 layout whose parameters the runtime holds in fp32 (spec/support.held_param_dtype)."""
    return layout.param_dtype == "bf16" and held_param_dtype(layout) == "fp32"


def planner_figures(spec, cluster, layout) -> dict[int, dict[str, float]]:
    """The planner's weights / gradients / optimizer_states bytes of every pipeline rank, from
    the layers the runtime's split gives that rank (spec/stages.py, the split ``parallelize``
    builds); the search prices the fullest middle rank, so the others are asked for one by one."""
    from modelcarve.plan.goals import get_goal

    cost = get_goal("train").cost_model(spec, cluster, global_batch=layout.global_batch, seq=layout.seq,
                                        param_policy="modelcarve")
    cand = cost.full_candidate(cost.key(layout))
    return {p: {c: cost.rank_state_parts(cand, p)[c] for c in CATEGORIES} for p in range(layout.pp)}


def dry_run_bytes(model_name: str, layout, cluster) -> dict:
    """The JSON report: world_size, one row per distinct rank (predicted and measured bytes per
    category), and ``ok`` (every category within ``tolerance_bytes``)."""
    from modelcarve.runtime.checkpoint.hf_load import model_spec

    t0 = time.perf_counter()
    spec = model_spec(model_name)
    predicted = planner_figures(spec, cluster, layout)
    measured = measure(model_name, layout)
    per_stage = layout.tp * layout.cp * layout.dp
    tol = tolerance_bytes(layout)
    rows = []
    for p, m in measured.items():
        pred = predicted[p]
        groups: dict = {}
        for q, fig in m["ranks"].items():
            groups.setdefault(fig, []).append(p * per_stage + q)
        for fig, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
            meas = dict(zip(CATEGORIES, fig))
            diff = {c: meas[c] - pred[c] for c in CATEGORIES}
            rows.append({
                "rank": ranks[0], "ranks": len(ranks), "pp_rank": p, "stage_kind": stage_kind(p, layout.pp),
                "layers": m["layers"], "predicted": pred, "measured": meas, "difference": diff,
                "ok": all(abs(d) <= tol for d in diff.values()),
            })
    return {"model": spec.name, "layout": layout.short(), "world_size": layout.world_size,
            "bf16_held_in_fp32": _bf16_held_in_fp32(layout),
            "distinct_ranks": len(rows), "rows": rows, "ok": all(r["ok"] for r in rows),
            "elapsed_s": round(time.perf_counter() - t0, 1)}


def format_report(report: dict) -> str:
    top = max([max(r["predicted"][c], r["measured"][c]) for r in report["rows"] for c in CATEGORIES] + [1.0])
    unit, gib = next((u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1)) if top >= b)
    lines = [f"{report['model']} {report['layout']}: world size {report['world_size']}, "
             f"{report['distinct_ranks']} distinct ranks ({report['elapsed_s']} s); {unit} predicted / measured"]
    if report.get("bf16_held_in_fp32"):
        lines.append("parameters held in fp32, their own master copy (torch-native mixed precision), as "
                     "estimate --framework modelcarve prices them; plain estimate prices Megatron's bf16 weights "
                     "with an fp32 master")
    lines.append(f"{'rank':>6} {'x ranks':>7} {'pp':>3} {'layers':>6}  " + "  ".join(f"{c:>24}" for c in CATEGORIES))
    for r in report["rows"]:
        cells = "  ".join(f"{r['predicted'][c] / gib:>11.3f} /{r['measured'][c] / gib:>11.3f}" for c in CATEGORIES)
        lines.append(f"{r['rank']:>6} {r['ranks']:>7} {r['pp_rank']:>3} {r['layers']:>6}  {cells}"
                     + ("" if r["ok"] else "  DIFFERS"))
    bad = sum(1 for r in report["rows"] if not r["ok"])
    lines.append("all distinct ranks match the planner" if not bad else f"{bad} distinct ranks differ from the planner")
    return "\n".join(lines)
