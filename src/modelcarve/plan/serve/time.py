"""Serving time of one layout: prefill, decode step, TTFT, TPOT and output tokens/s.

Usage::

    from modelcarve.plan.serve.time import serve_time
    t = serve_time(model, cluster, tp=2, weight_dtype="fp8", batch=64, input_len=1000, output_len=1000)
    t.tpot_s, t.tokens_per_s_per_device

The model (all per device, the fullest pipeline stage):

* **Decode step** of ``b`` sequences on one stage: kernels run one after another, so each
  class of kernel has its own roofline and the times add. GEMMs: the weights read (routed
  experts only in the fraction the batch touches) over the achievable HBM bandwidth, against
  their FLOPs over the achievable GEMM rate, whichever is larger. Attention: the KV cache of
  ``b`` sequences at the mean decode context ``input + output/2`` against its score/value
  FLOPs. Element-wise kernels: the activations they read and write. Communication is added on
  top (decode collectives sit on the critical path): two TP all-reduces per layer of
  ``b x hidden`` bf16 values with a latency term (one-shot all-reduce inside a node, a tree
  across nodes: at batch 1 the alpha costs, not the bytes), an all-gather of the logits, two
  EP all-to-alls per MoE layer scaled by the load-imbalance factor, and a PP hand-off per stage.
  The EP all-to-all is the plain one: a bf16 copy of the token per routed expert, no per-node
  deduplication (DeepEP-style dispatch, fp8 payloads, would cut the cross-node bytes several-fold).
* **Experts touched**: ``T`` tokens routed top-k over ``E`` uniform experts touch on average
  ``E (1 - (1 - k/E)^T)`` of them; with EP the ``ep`` attention groups decode in lockstep, so
  ``T = b x ep`` tokens reach each MoE layer and a rank reads that fraction of its experts.
* **Pipeline**: ``B`` sequences split into ``m = min(pp, B)`` micro-batches; one decode round
  (every sequence advances one token) takes ``max(m, pp)`` stage steps, so with fewer than
  ``pp`` micro-batches in flight the stages idle (bubble ``1 - m/pp``).
* **Weights read** per decode step on a probed device include the LM head's GEMV over a tied
  embedding table (held once, as the embedding, but every step's logits read it whole).
* **Prefill** of a prompt is compute-bound: forward GEMM FLOPs (on a probed device the
  LM head on the prompt's last row only, the one that samples) over the device's
  achievable GEMM rate (``plan.efficiency``; a routed expert's GEMMs at the rows a chunk routes to
  it, ``chunk x ep x top_k / (E + R)``, as the training planner prices them) plus causal attention's score/value FLOPs over the
  attention kernels' peak (bf16, as in decode: an FP4/FP8 checkpoint's GEMM peak is not
  attention's), not below one read of the weights per chunk, plus
  its TP/EP/PP traffic (on a probed CPU device the weight read and the arithmetic add: one core
  does both). Stages run one after another for a single prompt; with EP the prompt's
  expert work is costed as if its own rank did it (right in steady state, when every rank
  prefills its own requests; pessimistic for a lone prompt).
* **TTFT** = the prompt's prefill (on a probed device after the server's measured request path,
  ``DeviceSpec.request_overhead_s``: HTTP read, admission, the first token's delivery), plus one decode round of the running batch when other
  requests are in flight (continuous batching admits a request at the next step; queueing
  under overload is not modelled).
* **TPOT** as a user sees it under continuous batching: the decode round plus the other
  ``B - 1`` requests' prefills interleaved with it (each sequence needs ``input`` tokens of
  prefill per ``output`` tokens decoded). Under a pipeline a prefill's micro-batch walks every
  stage and every micro-batch in flight trails it, so the round it falls in lasts about its whole
  walk: prefills overlap over the stages only when several fall in one round (``prefill_overlap``).
* **Throughput**: ``B`` sequences per attention group (``tp x pp`` devices) finish ``B x
  output`` tokens in ``output`` rounds plus their own ``B`` prefills; reported per model
  replica (``ep`` groups share experts), per device and per cluster (``dp`` groups).

Fitted constants (three, to eight published batch-1 latencies; plan/serve/rates.py):
the achievable HBM fraction in decode, a fixed per-layer overhead per decode step, and a floor
under every all-reduce. Otherwise: ``plan.efficiency.HBM_EFFICIENCY`` for prefill's weight read, and the training
planner's ``matmul_efficiency`` of the dense peak of the dtype the GEMMs run in (fp8 for fp8
weights, int8 for W8A8, bf16 for W4A16 int4; ``plan.quant``).

Probed devices (``hardware --probe``; ``DeviceSpec.gemm_efficiency > 0``): the peaks are achieved
rates, so GEMMs run at ``gemm_efficiency`` (1.0) of them and weights stream at that fraction of
``hbm_bytes_per_s`` (the measured GEMV rate), with no GPU-fitted efficiency on top; the per-layer
overhead is the measured ``layer_overhead_s``; every engine step (a decode round, a prefill chunk)
adds ``serve_rates.engine_step_s`` once (the measured host cost of a step, plus the plan broadcast's
two alphas on several ranks), and prefill chunks pay the per-layer overhead too. Catalogue
devices have none of these fields and are costed as above.

The pieces: per-device and per-link rates and the fitted constants live in plan/serve/rates.py,
a layout's batch-independent costs (memoised) in plan/serve/layout_costs.py; this module holds the
decode step, the prefills and what a user sees (TTFT, TPOT, tokens/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelcarve.plan.cost import comm
from modelcarve.plan.cost.efficiency import TILE
from modelcarve.plan.serve.layout_costs import LayoutCosts, layout_costs, _prefill_fixed, clear_caches  # noqa: F401 - clear_caches: the serving model's
from modelcarve.plan.serve.memory import ACT_BYTES, MOE_IMBALANCE, kv_seq_bytes, stage_kind_counts
from modelcarve.plan.serve.rates import _decode_gemm_efficiency, achieved, gemm_efficiency, prefill_hbm_efficiency, request_overhead_s
from modelcarve.spec.hardware import ClusterSpec
from modelcarve.spec.model import ModelSpec

_INF = float("inf")


@dataclass(frozen=True, kw_only=True)
class ServeTime:
    """Latency and throughput of one serving layout at one concurrency (seconds, tokens/s)."""

    batch: int
    """Sequences in flight per attention group (tp x pp devices)."""
    prefill_s: float
    """One prompt's prefill, alone (on a probed device from its arrival: the request path included)."""
    ttft_s: float
    decode_step_s: float
    """One decode round: every sequence of the batch advances one token (no prefills)."""
    tpot_s: float
    """Time per output token a user sees: the decode round plus the other requests' prefills."""
    tokens_per_s: float
    """Output tokens/s of one model replica (tp x pp x ep devices)."""
    tokens_per_s_per_device: float
    tokens_per_s_cluster: float
    bound: str
    """The largest share of the decode step: 'memory', 'compute', 'communication' or 'overhead'."""
    bubble: float
    """Fraction of a decode round pipeline stages sit idle."""
    weights_read_bytes: float
    """Weight bytes one device reads per decode step (routed experts: only those touched)."""
    decode_parts: dict
    """Seconds of one decode round: roofline (with its memory and compute sides), overhead
    (fixed per-layer cost), tp, ep, pp."""
    comm: dict
    """Per axis: link tier, seconds added to each decode round, bytes per device per round."""

    def to_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "batch": self.batch,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tokens_per_s_cluster": self.tokens_per_s_cluster,
            "prefill_s": self.prefill_s,
            "decode_step_s": self.decode_step_s,
            "bound": self.bound,
            "bubble": self.bubble,
            "weights_read_bytes": self.weights_read_bytes,
            "decode_parts_s": dict(self.decode_parts),
        }


def _stage_step(c: LayoutCosts, b: int, detail: bool = False):
    """One stage's decode step for ``b`` sequences, seconds; with ``detail`` also its parts, the
    weight bytes read and the bytes each axis sends.

    Kernels run one after another, so each class has its own roofline and the times add: GEMMs
    (weights vs FLOPs), attention (KV cache vs score/value FLOPs), element-wise kernels
    (activation traffic), then the collectives, which sit on the decode critical path. At small
    batches the GEMMs are memory-bound GEMVs and their compute term is far below the weight
    read; it matters only for batches of hundreds."""
    weights_read = c.weights_fixed
    if c.experts_all:
        # Expected share of the experts touched (see experts_touched_fraction), inlined: this
        # function runs a few times for every candidate of a search.
        weights_read += c.experts_all * (1.0 - c.expert_miss ** (b * c.ep))
    gemm_mem = weights_read / c.hbm
    m_tile = b if b > TILE else TILE
    eff = c.effs.get(m_tile)
    if eff is None:
        eff = c.effs[m_tile] = _decode_gemm_efficiency(c, m_tile)
    gemm_cmp = b * c.k_gemm / (c.peak * eff)
    step = (gemm_mem if gemm_mem > gemm_cmp else gemm_cmp) + b * c.k_attn_elem + c.fixed_s
    if not detail:
        for _, count, pieces, floor, extra in c.comm_lines:
            best = None
            for a, slope in pieces:
                t = a + slope * b
                if best is None or t < best:
                    best = t
            step += count * (best if best > floor else floor) + extra[0] + extra[1] * b
        host = c.seq_host_s * b
        return step if step > host else host
    comm_s = {}
    straggler = 0.0
    for axis, count, pieces, floor, extra in c.comm_lines:
        t = count * max(floor, min(a + slope * b for a, slope in pieces)) + extra[0] + extra[1] * b
        comm_s[axis] = t
        step += t
        if axis == "ep":
            # The bytes part scales with the busiest rank's share; the rest would be paid anyway.
            straggler = count * pieces[0][1] * b * (1.0 - 1.0 / c.imbalance)
    m, f = c.model, c.f
    h = m.hidden_size
    roof = step - sum(comm_s.values()) - c.fixed_s
    attn_mem = b * kv_seq_bytes(f, c.mean_ctx) / c.hbm
    attn_cmp = b * c.mean_ctx * c.attn_flops_per_ctx / c.attn_peak
    # The engine's per-sequence host work is overlapped with the GPU step: it shows only where it is longer.
    host = c.seq_host_s * b - step if c.seq_host_s * b > step else 0.0
    parts = {
        "roofline": roof, "memory": gemm_mem + attn_mem + b * c.k_elem, "compute": gemm_cmp + attn_cmp,
        "overhead": c.fixed_s, "tp": comm_s.get("tp", 0.0), "ep": comm_s.get("ep", 0.0), "pp": comm_s.get("pp", 0.0),
        "host": host, "ep_straggler": straggler,
    }
    step += host
    act = b * h * ACT_BYTES
    sent = {
        "tp": 2 * f.stage_layers * comm.ring_all_reduce_bytes(act, c.tp)
        + comm.all_gather_bytes(b * m.vocab_size * ACT_BYTES, c.tp),
        "ep": 2 * f.stage_moe_layers * comm.all_to_all_bytes(b * m.top_k * h * ACT_BYTES * c.imbalance, c.ep) if c.ep > 1 else 0.0,
        "pp": act if c.pp > 1 else 0.0,
    }
    return step, parts, weights_read, sent


def _step_slope(c: LayoutCosts, b: int) -> tuple[float, float, float, float, float]:
    """(``_stage_step(c, b)``, its rate of change per sequence, the same two for the other side of
    the GEMM roofline, the least the step is sure to grow by at ``b + 1`` (-1: no such bound)).

    The growth bound: attention and element-wise time add ``k_attn_elem`` per sequence exactly;
    each collective at least its cheapest algorithm's slope (unless its floor binds); the weights
    read, the experts the next sequence touches; the GEMMs' compute side grows by its slope while
    the batch stays inside the first ``TILE`` rows (one efficiency); past them its efficiency
    steps with the tile padding, so a compute-bound step has no bound.
    The step is computed exactly as ``_stage_step`` computes it (same
    operations, same order); the slopes come from the pieces active at ``b`` (the cheapest
    collective algorithm; GEMM efficiency held constant). Only the step decides anything; the
    slopes aim the batch search, which must see where the roofline turns from memory to compute."""
    weights_read = c.weights_fixed
    slope = c.k_attn_elem
    mem_slope = tail = 0.0
    if c.experts_all:
        tail = c.expert_miss ** (b * c.ep)
        weights_read += c.experts_all * (1.0 - tail)
        if tail > 0.0:
            # d/db of experts_all (1 - miss^(b ep)) / hbm
            mem_slope = c.experts_all * tail * c.ep * -math.log(c.expert_miss) / c.hbm
    gemm_mem = weights_read / c.hbm
    m_tile = b if b > TILE else TILE
    eff = c.effs.get(m_tile)
    if eff is None:
        eff = c.effs[m_tile] = _decode_gemm_efficiency(c, m_tile)
    cmp_slope = c.k_gemm / (c.peak * eff)
    gemm_cmp = b * c.k_gemm / (c.peak * eff)
    if gemm_mem > gemm_cmp:
        step = gemm_mem + b * c.k_attn_elem + c.fixed_s
        other, other_slope = gemm_cmp - gemm_mem, slope + cmp_slope
        slope += mem_slope
    else:
        step = gemm_cmp + b * c.k_attn_elem + c.fixed_s
        other, other_slope = gemm_mem - gemm_cmp, slope + mem_slope
        slope += cmp_slope
    comm_grows = 0.0
    for _, count, pieces, floor, extra in c.comm_lines:
        best = None
        least = _INF
        for a, s in pieces:
            t = a + s * b
            if best is None or t < best:
                best, best_s = t, s
            if s < least:
                least = s
        step += count * (best if best > floor else floor) + extra[0] + extra[1] * b
        add = (count * best_s if best > floor else 0.0) + extra[1]
        slope += add
        other_slope += add
        # At b + 1 every algorithm costs at least its slope more, so the cheapest one does.
        comm_grows += (count * least if best > floor else 0.0) + extra[1]
    if gemm_mem > gemm_cmp:
        grows = c.k_attn_elem + comm_grows
        if tail > 0.0:
            # The experts the next sequence touches: experts_all (miss^(b ep) - miss^((b+1) ep)).
            grows += c.experts_all * tail * (1.0 - c.expert_miss ** c.ep) / c.hbm
    else:
        grows = c.k_attn_elem + cmp_slope + comm_grows if b < TILE else -1.0
    host = c.seq_host_s * b
    if host > step:
        # The host floor binds (see _stage_step): the step is host x b, growing by exactly seq_host_s.
        return host, c.seq_host_s, host, c.seq_host_s, c.seq_host_s
    return step, slope, step + other, other_slope, grows


def _prefill_from(c: LayoutCosts, part: tuple, eff: float, walk: bool | None = True) -> float:
    """Prefill of ``part`` (one of ``mesh.prefill_parts``: its tokens of prompts of one length)
    through all stages in turn: compute-bound (FLOPs over the achievable GEMM rate), not below one
    read of the weights per chunk, plus the stage's TP/EP collectives, then the pipeline hops; each
    stage kind priced with its own layers and weights (``_stage_costs``). ``walk=None``: one
    stage's share alone."""
    tokens, _, chunks, per_tok, comm_s, hops, attn, experts = part
    f = c.f
    # GEMMs at the weights' GEMM rate; attention's scores and values at the attention kernels' peak
    # (bf16 tensor cores, as in the decode step), not at an FP4/FP8 GEMM peak they never run at.
    compute_s = tokens * per_tok / (c.peak * eff) + tokens * attn / c.attn_peak
    for flops, rows, n, k in experts:  # each routed expert's GEMMs at its own rows
        compute_s += tokens * flops / (c.peak * gemm_efficiency(c.device, rows, n, k, c.compute_dtype))
    read_s = chunks * (f.weights_bytes - f.embed_bytes + c.mesh.head_read) / (c.device.hbm_bytes_per_s * prefill_hbm_efficiency(c.device))
    # A probed device's host overheads are paid by every engine step, prefill chunks included: per
    # layer per chunk on each stage, and the step's own fixed cost once per chunk. (The GPU-fitted
    # per-layer constant is fitted to decode and is not charged here: catalogue devices unchanged.)
    layers_s = chunks * c.fixed_s if c.device.layer_overhead_s > 0.0 else 0.0
    # A probed (CPU) device's core both streams a chunk's weights in and does its arithmetic, so the
    # two add (hardware --probe: a 16-128-row GEMM through a 64 MiB weight takes about their sum);
    # a GPU overlaps them (the roofline's max).
    stage = (compute_s + read_s if achieved(c.device) else max(compute_s, read_s)) + comm_s + layers_s
    if walk is None:
        return stage
    if c.pp == 1:
        return stage + hops + chunks * c.step_s
    # a prompt crosses every stage in turn: each stage kind its own layers, weights and head
    total = 0.0
    index = c.mesh.prefill_parts.index(part)
    for sc, count in _stage_costs(c):
        sp = sc.mesh.prefill_parts[index]
        s_eff = eff if sp[1] == part[1] else gemm_efficiency(sc.device, sp[1], sc.n_gemm, sc.model.hidden_size, sc.compute_dtype)
        total += count * _prefill_from(sc, sp, s_eff, walk=None)
    return total + hops + chunks * c.step_s


def serve_time(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int = 1,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    batch: int = 1,
    input_len: int = 2048,
    output_len: int = 256,
    load_imbalance: float = MOE_IMBALANCE,
) -> ServeTime:
    """TTFT, TPOT and throughput of one layout with ``batch`` sequences per attention group."""
    c = layout_costs(model, cluster, tp, pp, ep, dp, weight_dtype, kv_dtype, input_len, output_len, load_imbalance)
    return _serve_time(c, batch)


def _ensure_prefill(c: LayoutCosts) -> None:
    """Cost the prefills on first use (a latency screen at batch 1 without a TTFT bound needs none)."""
    if c.prefill_s < 0:
        # The KV dtype plays no part: both KV variants of a weight dtype share their prefills.
        mesh = c.mesh
        shared = (c.compute_dtype, c.f.weights_bytes - c.f.embed_bytes + mesh.head_read)
        held = mesh.prefills.get(shared)
        if held is not None:
            c.prefill_s, c.prefill_token_s = held
            return
        alone, batched = mesh.prefill_parts
        # The GEMM efficiency at each prefill's chunk size.
        eff = c.effs.get(alone[1])
        if eff is None:
            eff = c.effs[alone[1]] = _decode_gemm_efficiency(c, alone[1])
        # A lone prompt's TTFT path: the server's request overhead (probed devices), then its prefill.
        c.prefill_s = request_overhead_s(c.device) + _prefill_from(c, alone, eff)
        eff = c.effs.get(batched[1])
        if eff is None:
            eff = c.effs[batched[1]] = _decode_gemm_efficiency(c, batched[1])
        c.prefill_token_s = _prefill_from(c, batched, eff) / batched[0]
        mesh.prefills[shared] = (c.prefill_s, c.prefill_token_s)


def _stage_costs(c: LayoutCosts) -> list:
    """(LayoutCosts of each distinct stage kind, how many stages it stands for) of ``c``'s pipeline."""
    wd, kd, ed, r = c.dtypes
    return [(layout_costs(c.model, c.cluster, c.tp, c.pp, c.ep, c.dp, wd, kd, c.input_len, c.output_len, c.imbalance,
                          expert_dtype=ed, redundant_experts=r, stage=k), count)
            for k, count in enumerate(stage_kind_counts(c.model, c.pp))]


def walk_s(c: LayoutCosts) -> float:
    """One sequence's decode step through every pipeline stage in turn: the sum of each stage's own
    step (its layers, its weights: the embedding's stage reads no head, the head's stage reads it
    once), memoised. With fewer sequences than stages this, not ``pp`` steps of the fullest stage,
    is what a token waits for."""
    if c.walk_s < 0.0:
        c.walk_s = sum(count * _stage_step(sc, 1) for sc, count in _stage_costs(c)) if c.pp > 1 else _stage_step(c, 1)
    return c.walk_s


def round_s(c: LayoutCosts, batch: int) -> float:
    """One decode round (every sequence of ``batch`` advances a token), seconds. ``m = min(pp, batch)``
    micro-batches of ``ceil(batch / m)`` sequences: with ``m = pp`` every stage is busy and the
    round is ``pp`` steps of the fullest stage; with fewer (``batch < pp``, one sequence each) a
    token walks every stage in turn (``walk_s``), unless the fullest stage's ``m`` steps take longer;
    never less than the walk."""
    micro = c.pp if c.pp < batch else batch
    if c.pp == 1:
        return _stage_step(c, batch) + c.step_s
    # never under the walk: the fullest stage by memory need not be the slowest (a tied head's stage
    # reads the table the embedding's stage, the fullest, skips), and no round beats one walk
    busiest = micro * _stage_step(c, -(-batch // micro))
    walk = walk_s(c)
    return (walk if walk > busiest else busiest) + c.step_s


def decode_tpot_s(c: LayoutCosts, batch: int) -> float:
    """TPOT of a user when no other request's prefill interleaves (``batch == 1``): the decode round."""
    return round_s(c, batch)


def prefill_overlap(pp: int, batch: int, output_len: int) -> float:
    """How many prefills share the stretch of decode time one prefill adds, with ``batch`` sequences
    in ``micro = min(pp, batch)`` micro-batches in flight (``pp = 1``, no pipeline: 1).

    Each sequence prefills once per ``output_len`` rounds, so ``q = batch / output_len`` prefills
    fall in a round on average. Under a pipeline only ``micro`` micro-batches are ever in flight
    (the engine's depth) and each trails the one ahead of it through every stage, so a round
    holding ``k`` prefills (in ``k`` micro-batches) lasts about ``max(1, k / micro)`` prefill walks
    (``k`` prefills keep each stage busy ``k / micro`` walks; one alone still walks every stage):
    a lone prefill delays every request by its whole walk, not ``1 / micro`` of it. Per prefill,
    with ``k`` taken as ``q``: ``q <= 1`` no sharing (1), ``1 <= q <= micro`` ``q``, beyond ``micro``
    ``micro`` (a prefill in every micro-batch of every round). Measured on CPU (pp=2, ~97M llama, 64-token
    prompts, 16 new tokens, 0.65 requests/s): TPOT p50 39.0 ms where the decode walk is ~30 ms,
    i.e. one other request's ~130 ms prefill over 15 tokens, as 1 gives; ``micro`` gave 29.0 ms."""
    micro = pp if pp < batch else batch
    q = batch / output_len
    if q >= micro:
        return float(micro)
    return q if q > 1.0 else 1.0


def _rates(c: LayoutCosts, batch: int) -> tuple[float, float, float, float]:
    """(decode round, TPOT, TTFT, output tokens/s of the attention group) at ``batch``, seconds.

    A round: ``m = min(pp, batch)`` micro-batches of ``ceil(batch / m)`` sequences; every stage
    takes ``max(m, pp)`` steps (idle ones are the bubble). Each sequence's prefill
    (``input_len`` tokens) has to be done once per ``output_len`` tokens decoded; prefills of
    different requests share their walk through the stages as ``prefill_overlap`` says. A user's
    TPOT carries the other ``batch - 1`` requests' prefills; the throughput carries all ``batch``."""
    if c.prefill_s < 0:
        _ensure_prefill(c)
    rnd = round_s(c, batch)
    per_seq = c.input_len * c.prefill_token_s / prefill_overlap(c.pp, batch, c.output_len) / c.output_len
    tpot = rnd + (batch - 1) * per_seq
    ttft = c.prefill_s + (rnd if batch > 1 else 0.0)
    return rnd, tpot, ttft, batch / (rnd + batch * per_seq)


def _serve_time(c: LayoutCosts, batch: int) -> ServeTime:
    batch = max(1, int(batch))
    _ensure_prefill(c)
    micro = min(c.pp, batch)
    b = math.ceil(batch / micro)
    _, parts, weights_read, sent = _stage_step(c, b, detail=True)
    round_s, tpot, ttft, group = _rates(c, batch)
    slots = max(micro, c.pp)
    # The largest share of the step names what bounds it; "overhead" is the fixed per-layer
    # cost (kernel launches and gaps) that dominates when each device has little to do.
    roof_kind = "memory" if parts["memory"] >= parts["compute"] else "compute"
    shares = {roof_kind: parts["roofline"], "communication": parts["tp"] + parts["ep"] + parts["pp"],
              "overhead": parts["overhead"] + parts["host"]}
    bound = max(shares, key=shares.get)
    round_parts = {k: v * slots for k, v in parts.items()}
    if micro < c.pp and walk_s(c) > micro * _stage_step(c, 1):
        # a lone sequence walks the stages: each kind's own parts, as many times as it has stages
        round_parts = dict.fromkeys(parts, 0.0)
        for sc, count in _stage_costs(c):
            for k, v in _stage_step(sc, 1, detail=True)[1].items():
                round_parts[k] += count * v
    round_parts["step"] = c.step_s  # once per round (engine step), not per stage
    tiers = {"tp": (c.tp, c.tier_tp), "ep": (c.ep, c.tier_ep), "pp": (c.pp, c.tier_pp)}
    comm_info = {
        axis: {"tier": tier.name, "s_per_round": round_parts[axis], "bytes_per_round": sent[axis] * slots}
        for axis, (size, tier) in tiers.items()
        if size > 1
    }
    if "ep" in comm_info:
        comm_info["ep"]["straggler_s_per_round"] = round_parts.pop("ep_straggler")
    else:
        round_parts.pop("ep_straggler")
    return ServeTime(
        batch=batch,
        prefill_s=c.prefill_s,
        ttft_s=ttft,
        decode_step_s=round_s,
        tpot_s=tpot,
        tokens_per_s=group * c.ep,
        tokens_per_s_per_device=group / (c.tp * c.pp),
        tokens_per_s_cluster=group * c.dp,
        bound=bound,
        bubble=1.0 - micro / c.pp if c.pp > 1 else 0.0,
        weights_read_bytes=weights_read,
        decode_parts=round_parts,
        comm=comm_info,
    )
