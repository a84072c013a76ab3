"""The train goal's search space: which layouts of a training job exist, block by block.

    for block in layout_blocks(model, cluster, global_batch=1536, seq=2048): ...
    layouts = enumerate_layouts(model, cluster, 1536, 2048)

The rules (every factorisation, the micro-batch sizes, SP, recomputation, expert folding,
precisions, ZeRO / HSDP, schedules and virtual stages) are stated in plan/train/goal.py's module
doc; ``TrainGoal.candidates`` and the sweep (plan/train/sweep.py) both walk these blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

from modelcarve.plan.cost.schedule import in_flight_microbatches
from modelcarve.plan.factors import divisors
from modelcarve.plan.train.candidate import FIELDS, Candidate
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

MAX_MBS = 32
"""Largest micro-batch size tried."""
MAX_MB_TOKENS = 32768
"""Most tokens per micro-batch tried (mbs x seq): beyond it every GEMM's m dimension is already
saturated (the efficiency ramp is within 0.3% of its limit), so larger micro-batches only add
activation memory and bubble."""
MIN_CP_CHUNK = 256
"""Fewest tokens per context-parallel rank tried."""
MAX_VIRTUAL = 8
"""Most model chunks per pipeline rank tried (interleaved 1F1B)."""


def enumerate_layouts(model: "ModelSpec", cluster: "ClusterSpec", global_batch: int, seq: int,
                      max_mbs: int = MAX_MBS, precisions: tuple = (("bf16", "delayed"),),
                      grad_dtype: str = "fp32") -> Iterator[Candidate]:
    """Every valid training layout as a ``Candidate``, for each (param_dtype, fp8_scaling) in
    ``precisions`` (bf16 unless the user asks for FP8), each with gradients in ``grad_dtype``
    (``grad_dtype_of``: the framework's setting, not a choice the search makes)."""
    new = tuple.__new__  # Candidate(...) through its generated __new__ costs ~7% of a full search
    for tp, cp, pp, dp, mbs, ep, etp, sp, rc, zeros, scheds in layout_blocks(model, cluster, global_batch, seq, max_mbs):
        for zero, shard in zeros:
            for sched, v in scheds:
                for prec, scaling in precisions:
                    yield new(Candidate, (tp, cp, pp, dp, ep, mbs, sp, rc, zero, shard, sched,
                                          v, prec, grad_dtype, "fp32", etp, scaling))


RECOMPUTES = ("none", "selective", "full")
"""Activation recomputation modes tried, in the search's order."""


def layout_blocks(model: "ModelSpec", cluster: "ClusterSpec", global_batch: int, seq: int,
                  max_mbs: int = MAX_MBS) -> Iterator[tuple]:
    """The search space in blocks, in ``enumerate_layouts``' order: ``(tp, cp, pp, dp, mbs, ep, etp,
    sp, recompute, zeros, schedules)``, each block standing for every ``(zero, dp_shard)`` in
    ``zeros`` x ``(schedule, virtual_stages)`` in ``schedules`` x precision, in that order: each
    rest of ``layout_rests`` with each of ``RECOMPUTES`` in turn."""
    for tp, cp, pp, dp, mbs, ep, etp, sp, zeros, scheds in layout_rests(model, cluster, global_batch, seq, max_mbs):
        for rc in RECOMPUTES:
            yield tp, cp, pp, dp, mbs, ep, etp, sp, rc, zeros, scheds


def layout_rests(model: "ModelSpec", cluster: "ClusterSpec", global_batch: int, seq: int,
                 max_mbs: int = MAX_MBS) -> Iterator[tuple]:
    """``layout_blocks`` without the recompute mode: ``(tp, cp, pp, dp, mbs, ep, etp, sp, zeros,
    schedules)``, each standing for its blocks with recompute ``"none"``, ``"selective"`` and
    ``"full"``, in that order (the sweep reads a rest's three blocks together)."""
    n = cluster.num_devices
    L = model.num_layers
    moe = model.is_moe
    kv = model.num_kv_heads

    def tp_ok(t: int) -> bool:
        if model.num_heads % t or model.ffn_size % t:
            return False
        if moe and model.expert_ffn_size % t:
            return False
        if model.attention_kind == "gqa" and kv % t and t % kv:
            return False
        return True

    inner_cache: dict = {}
    for tp in (t for t in divisors(n) if tp_ok(t)):
        sps = (False, True) if tp > 1 and seq % tp == 0 else (False,)
        for pp in (p for p in divisors(n // tp) if p <= L):
            for cp in divisors(n // (tp * pp)):
                if cp > 1 and (seq % (2 * cp) or seq // cp < MIN_CP_CHUNK):
                    continue
                dp = n // (tp * pp * cp)
                if global_batch % dp:
                    continue
                per_replica = global_batch // dp
                # (ep, etp): EP inside dp x cp with expert TP = TP, and (MoE parallel folding) EP
                # taking the tensor-parallel ranks too, with expert TP 1
                eps = [(e, tp) for e in divisors(math.gcd(model.num_experts, dp * cp))] if moe else [(1, tp)]
                if moe and tp > 1:
                    eps += [(e, 1) for e in divisors(math.gcd(model.num_experts, dp * cp * tp)) if (dp * cp) % e]
                shards = [0]
                if dp > 1:
                    in_node = cluster.fast_domain // (tp * cp)
                    if 1 < in_node < dp and dp % in_node == 0:  # HSDP: shard inside a node, replicate across
                        shards.append(in_node)
                zeros = [(z, 0) for z in (0, 1, 2, 3)] + [(3, s) for s in shards[1:]] if dp * cp > 1 else [(0, 0)]
                for mbs in (b for b in divisors(per_replica) if b <= max_mbs and (b == 1 or b * seq <= MAX_MB_TOKENS)):
                    n_mb = per_replica // mbs
                    key = (pp, n_mb)
                    scheds = inner_cache.get(key)
                    if scheds is None:
                        scheds = inner_cache[key] = _schedules(L, pp, n_mb)
                    for ep, etp in eps:
                        for sp in sps:
                            yield tp, cp, pp, dp, mbs, ep, etp, sp, zeros, scheds


def _grown(rows: list, sched: str, pp: int, n_mb: int, v: int, growth: float) -> list:
    """Each stage's activations in flight and buffers, grown by the allocator's share, as
    ``TrainCostModel.peak_bytes`` sums them (``inflight_of`` inlined for 1F1B and zero-bubble)."""
    if sched == "1f1b" or sched == "zero-bubble":
        return [((pp - index if pp - index < n_mb else n_mb) * act_mb + fixed) * growth
                for _kind, index, act_mb, fixed in rows]
    if sched == "gpipe":  # in_flight_microbatches: every micro-batch (one without a pipeline)
        held = float(n_mb) if pp > 1 else 1.0
        return [(held * act_mb + fixed) * growth for _kind, _index, act_mb, fixed in rows]
    return [(in_flight_microbatches(sched, pp, n_mb, v, index) * act_mb + fixed) * growth
            for _kind, index, act_mb, fixed in rows]


def inflight_of(schedule: str, pp: int, n_mb: int, v: int, index: int):
    """Micro-batches in flight on pipeline rank ``index``, as ``TrainCostModel.peak_bytes`` counts them."""
    if schedule == "1f1b" or schedule == "zero-bubble":
        return pp - index if pp - index < n_mb else n_mb
    return in_flight_microbatches(schedule, pp, n_mb, v, index)


def _compute(prec: str, scaling: str) -> str:
    """The compute key of a precision (TrainCostModel.compute_key): ``fp8cs`` for FP8 with current scaling."""
    return "fp8cs" if prec == "fp8" and scaling == "current" else prec


def _precisions(cluster: "ClusterSpec", precision: str | None) -> tuple:
    """(param_dtype, fp8_scaling) pairs the search tries: bf16, or the precision asked for
    (``--precision fp8`` / ``fp8-cs`` / ``mxfp8``), checked against the device."""
    if not precision or precision == "bf16":
        return (("bf16", "delayed"),)
    probe = Layout.parse(f"precision={precision}")
    probe.validate_precision(cluster)
    return ((probe.param_dtype, probe.fp8_scaling),)


GRAD_DTYPES = ("fp32", "bf16")
"""Gradient buffers a search may hold: fp32 (Megatron-LM's default with bf16, torch's FSDP2 reduce) or
bf16 (Megatron's --grad-reduce-in-bf16, every Megatron-Bridge performance recipe)."""


def grad_dtype_of(value: str | None) -> str:
    """The gradient dtype every searched layout holds (``--grad-dtype``; default fp32). It is the
    framework's setting, so the search does not pick it: bf16 always holds less and sends less, and
    what it costs in precision is not a number the planner ranks."""
    if value is None:
        return "fp32"
    if value not in GRAD_DTYPES:
        raise LayoutError(f"--grad-dtype {value}: gradients are held in {' or '.join(GRAD_DTYPES)}; "
                          f"give --grad-dtype fp32 (the default) or bf16")
    return value


def _schedules(L: int, pp: int, n_mb: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1)]
    if L % pp == 0 and n_mb % pp == 0:
        out += [("interleaved-1f1b", v) for v in divisors(L // pp) if 1 < v <= MAX_VIRTUAL]
    return out


def candidate_layout(candidate: Candidate, global_batch: int, seq: int) -> Layout:
    """The Layout a candidate stands for."""
    return Layout(**dict(zip(FIELDS, candidate)), gbs=global_batch, seq=seq)
