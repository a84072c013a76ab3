"""Training cost model: memory of the worst device, step time and link traffic of one layout.

Usage::

    from modelcarve.plan.train_model import TrainCostModel, TrainOptions
    cost = TrainCostModel(model, cluster, TrainOptions(global_batch=1536, seq=2048))
    result = cost.estimate(Layout.parse("tp=8,pp=2,dp=32,mbs=4,recompute=full"))  # the JSON dict
    score, category, reason = cost.screen(cost.key(layout))                       # the fast path

One code path (``_evaluate``) serves both: the search screens hundreds of thousands of layouts
with ``detail=False`` (plain floats, per-model and per-(tp, cp, pp, mbs, ...) constants cached),
then asks for the breakdown of the finalists with ``detail=True``; the two cannot disagree.

What a step costs (per device; see the helpers' docstrings for each formula)
---------------------------------------------------------------------------
* Compute per micro-batch and stage: every GEMM of a layer at ``matmul_efficiency`` of its
  per-device shape (TP shrinks n or k, fine-grained experts shrink m), memory-bound element-wise
  work (norms, residuals, activation functions, softmax of materialised attention, MoE
  permutation) at HBM speed; backward = 2x forward (flash attention: 2.5x, it recomputes the
  scores); recomputation adds the forward (full) or the attention core (selective).
* TP: two all-reduces of ``2 T h`` bytes per layer forward, two backward (with SP: all-gather +
  reduce-scatter, same bytes), two more for a full recompute; exposed (Megatron runs them on the
  critical path) unless ``tp_overlap`` says what fraction is hidden.
* CP: ring exchange of K and V (forward) and of K, V, dK, dV (backward), hidden behind the
  attention core; only the excess is exposed.
* EP: dispatch + combine all-to-all per MoE layer forward, twice backward, times the
  load-imbalance factor (the busiest rank sets the pace); exposed.
* PP: one activation send per micro-batch and chunk boundary each way (``2 T h / t`` bytes with
  Megatron's scatter-gather); on the critical path.
* DP: gradient all-reduce (ZeRO-0), reduce-scatter + parameter all-gather (ZeRO-1/2), or
  per-micro-batch parameter all-gathers and gradient reduce-scatters (ZeRO-3/FSDP; HSDP adds an
  all-reduce across replicas); gradient reduction hides behind the last micro-batch's backward,
  the parameter all-gather behind the first forward (when ``overlap_grad_reduce`` /
  ``overlap_param_gather``), ZeRO-3 traffic behind each micro-batch's compute.
* Bubble by schedule (plan/schedule.py); the optimiser step streams its state through HBM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelcarve.plan import comm
from modelcarve.plan.activations import kv_heads_per_rank, layer_activation_terms
from modelcarve.plan.efficiency import gemm_time_s, memory_bound_time_s
from modelcarve.plan.schedule import bubble_time_units, in_flight_microbatches
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import DTYPE_BYTES, Layout

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec

GIB = 2**30
RESERVED_BYTES = 1.5 * GIB
"""Memory a device never gives the model: CUDA context, cuBLAS workspaces, NCCL buffers."""
FRAGMENTATION = 0.05
"""Caching-allocator fragmentation, as a fraction of activations and buffers (a stated margin)."""
_GROWTH = 1.0 + FRAGMENTATION
LOGITS_BYTES_PER_ELEM = 10.0
"""Bytes per logit on the last stage: bf16 logits, their fp32 copy in the cross entropy, and the
fp32 softmax it keeps for backward."""
DP_BUCKET_BYTES = 2 * 40e6
"""Gradient-reduction buckets in flight (two of Megatron's 40 MB buckets)."""
FLASH_EFFICIENCY = 0.85
"""Flash attention's throughput relative to a plain GEMM of the same shape (FlashAttention-2
reaches about 70% of A100 peak forward, a large GEMM about 80%)."""
FLASH_BACKWARD = 2.5
"""Flash attention's backward costs 2.5 forwards (it recomputes the scores: 5 matmuls vs 2)."""

_PER_LAYER_SUMS = (
    "compute_s", "fwd_s", "bwd_s", "tp_s", "tp_total_s", "cp_s", "cp_total_s", "ep_s", "tp_bytes", "tp_nic", "cp_bytes", "cp_nic",
    "ep_bytes", "ep_nic", "act_bytes",
)

STATES_DO_NOT_FIT = "weights, gradients and optimizer states alone exceed device memory"
ACTIVATIONS_DO_NOT_FIT = "activations do not fit beside the model states"

# candidate tuple fields (the search's currency; Layout converts to and from it)
FIELDS = (
    "tp", "cp", "pp", "dp", "ep", "mbs", "sp", "recompute", "zero", "dp_shard", "schedule", "virtual_stages",
    "param_dtype", "grad_dtype", "optim_dtype",
)


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Workload and system facts a layout does not carry."""

    global_batch: int = 0
    """Sequences per optimiser step; 0 takes the layout's gbs."""
    seq: int = 0
    """Sequence length; 0 takes the layout's seq."""
    attention: str = "flash"
    """'flash' (no s^2 activations, causal blocks skipped) or 'materialized' (Megatron 2021)."""
    dropout: bool = False
    """Dropout layers present (their masks are stored); Megatron's 2021 GPT runs had them."""
    overlap_grad_reduce: bool = True
    """Gradient reduction overlaps the last backward (torch DDP, Megatron-Core); False: after it."""
    overlap_param_gather: bool = True
    """ZeRO-1/2 parameter all-gather overlaps the next forward."""
    tp_overlap: float = 0.0
    """Fraction of TP communication hidden behind GEMMs (0 without TE comm-GEMM overlap)."""
    load_imbalance: float = 1.25
    """Tokens on the busiest expert rank / the mean (MoE): scales expert compute and all-to-all."""
    scatter_gather_p2p: bool = True
    """Pipeline sends carry 1/t of the activation and all-gather over NVLink (Megatron)."""


class TrainCostModel:
    """Cost of training ``model`` on ``cluster``; per-model constants are computed once."""

    def __init__(self, model: "ModelSpec", cluster: "ClusterSpec", options: TrainOptions | None = None):
        self.model, self.cluster = model, cluster
        self.options = options or TrainOptions()
        if self.options.attention not in ("flash", "materialized"):
            raise LayoutError(f"attention={self.options.attention!r} must be 'flash' or 'materialized'")
        self.device = cluster.device
        self.capacity = cluster.device.memory_bytes
        self.seq = self.options.seq or 2048
        self._profiles: dict = {}
        self._tiers: dict = {}
        self._layers: dict = {}
        self._gemms: dict = {}
        self._windows: dict = {}
        self._traffic: dict = {}
        self._stage_params: dict = {}
        self._floors: dict = {}
        self._last_pkey: tuple | None = None
        self._last_prof: dict | None = None
        self._params()

    # --- per-model constants -------------------------------------------------------------------
    def _params(self) -> None:
        m = self.model
        h = m.hidden_size
        norm = m._norm_params(h)
        rep = 2 * norm  # the two pre-norms are replicated over TP
        if m.attention_kind == "mla":
            rq = m.q_lora_rank or 0
            mla_rep = (h * rq + rq if rq else 0) + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            rep += mla_rep
            attn_split = m.attention_params - mla_rep
        else:
            attn_split = m.attention_params
        self.attn_split, self.layer_rep = attn_split, rep
        self.dense_split = attn_split + m.ffn_params(m.ffn_size)
        self.moe_split = attn_split + m.num_shared_experts * m.expert_params
        self.moe_rep = rep + m.router_params
        self.moe_experts = m.num_experts * m.expert_params
        self.vocab_h = m.vocab_size * h
        self.pos = m.max_position * h if m.position_kind == "learned" else 0
        self.final_norm = norm
        self.moe_set = frozenset(m.moe_layers)
        self.head_fwd_flops_token = 2.0 * m.vocab_size * h

    # --- candidate <-> Layout ----------------------------------------------------------------------
    @staticmethod
    def key(layout: Layout) -> tuple:
        return (
            layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.mbs, layout.sp, layout.recompute,
            layout.zero, layout.dp_shard, layout.schedule, layout.virtual_stages,
            layout.param_dtype, layout.grad_dtype, layout.optim_dtype,
        )

    def layout(self, cand: tuple) -> Layout:
        values = dict(zip(FIELDS, cand))
        return Layout(**values, gbs=self.options.global_batch or values["mbs"] * values["dp"], seq=self.seq)

    # --- tiers ---------------------------------------------------------------------------------------
    def tier(self, group: int, inner: int) -> comm.Tier:
        key = (group, inner)
        tier = self._tiers.get(key)
        if tier is None:
            tier = self._tiers[key] = comm.group_tier(self.cluster, group, inner)
        return tier

    # --- per (tp, cp, pp, dp, ep, mbs, sp, recompute): stage compute and memory profile ---------------
    def profile(self, tp: int, cp: int, pp: int, dp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int) -> dict:
        key = (tp, cp, pp, dp, ep, mbs, sp, recompute, seq)
        prof = self._profiles.get(key)
        if prof is None:
            prof = self._profiles[key] = self._build_profile(tp, cp, pp, dp, ep, mbs, sp, recompute, seq)
        return prof

    def _layer_cached(self, moe: bool, tp: int, cp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int) -> dict:
        key = (moe, tp, cp, ep if moe else 1, mbs, sp, recompute, seq)
        layer = self._layers.get(key)
        if layer is None:
            layer = self._layers[key] = self._layer(moe, tp, cp, ep, mbs, sp, recompute, seq)
        return layer

    def _layer(self, moe: bool, tp: int, cp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int) -> dict:
        """Times (s) and bytes of one layer for one micro-batch on one device."""
        m, o, dev = self.model, self.options, self.device
        h = m.hidden_size
        T = mbs * seq / cp
        s_loc = seq / cp
        heads = m.num_heads / tp
        dqk, dv = m.qk_head_dim, m.attn_v_head_dim
        kvl = kv_heads_per_rank(m, tp)
        rep = tp if sp else 1
        g = 0.0  # forward GEMM seconds outside the attention core
        if m.attention_kind == "mla":
            rq = m.q_lora_rank or 0
            if rq:
                g += self._gemm(T, rq, h) + self._gemm(T, heads * dqk, rq)
            else:
                g += self._gemm(T, heads * dqk, h)
            g += self._gemm(T, m.kv_lora_rank + m.qk_rope_head_dim, h)
            g += self._gemm(T, heads * (m.qk_nope_head_dim + dv), m.kv_lora_rank)
        else:
            g += self._gemm(T, (heads + kvl) * dqk + kvl * dv, h)
        g += self._gemm(T, h, heads * dv)
        # attention core: QK^T and PV, batch = mbs x local heads
        batch = mbs * heads
        core = self._gemm(s_loc, seq, dqk, batch) + self._gemm(s_loc, dv, seq, batch)
        ew = (8 + 12 + (10 if o.dropout else 0)) * T * h / rep  # norms, residual adds, dropouts
        if m.position_kind == "rope":
            ew += 4.0 * T * (heads + kvl) * (m.qk_rope_head_dim if m.attention_kind == "mla" else dqk)
        if o.attention == "flash":
            core = core * 0.5 / FLASH_EFFICIENCY  # causal: half the blocks are skipped
            core_bwd = core * FLASH_BACKWARD
            core_ew = 0.0
        else:
            core_bwd = 2.0 * core
            core_ew = (9.0 if o.dropout else 4.0) * batch * s_loc * seq  # softmax (+ dropout) traffic
        a2a_bytes = 0.0
        if moe:
            k, fe, E = m.top_k, m.expert_ffn_size, m.num_experts
            n_in = 3 if m.ffn_kind == "swiglu" else 2
            g += self._gemm(T, E, h)  # router
            per_expert = T * ep * k * o.load_imbalance / E
            local = E / ep
            g += self._gemm(per_expert, (n_in - 1) * fe / tp, h, local) + self._gemm(per_expert, h, fe / tp, local)
            if m.num_shared_experts:
                fs = m.num_shared_experts * fe
                g += self._gemm(T, (n_in - 1) * fs / tp, h) + self._gemm(T, h, fs / tp)
            routed = T * k * o.load_imbalance
            ew += (6.0 if m.ffn_kind == "swiglu" else 4.0) * routed * fe / tp + 8.0 * routed * h
            if m.num_shared_experts:
                ew += (6.0 if m.ffn_kind == "swiglu" else 4.0) * T * m.num_shared_experts * fe / tp
            # each TP rank dispatches 1/t of the tokens; the busiest rank receives imbalance x the mean
            a2a_bytes = 2.0 * T * k * h / tp * o.load_imbalance
        else:
            f = m.ffn_size
            n_in = 2 if m.ffn_kind == "swiglu" else 1
            g += self._gemm(T, n_in * f / tp, h) + self._gemm(T, h, f / tp)
            ew += (6.0 if m.ffn_kind == "swiglu" else 4.0) * T * f / tp
        ew_s = memory_bound_time_s(dev, ew)
        core_ew_s = memory_bound_time_s(dev, core_ew)
        fwd = g + core + ew_s + core_ew_s
        bwd = 2.0 * g + core_bwd + 2.0 * (ew_s + core_ew_s)
        # communication per layer (seconds; bytes each device sends)
        act = 2.0 * T * h
        tp_tier = self.tier(tp, 1)
        tp_one = comm.all_reduce_s(act, tp, tp_tier) * (1.0 - o.tp_overlap)
        tp_bytes_one = comm.ring_all_reduce_bytes(act, tp)
        cp_tier = self.tier(cp, tp)
        kv = 2.0 * T * kvl * (dqk + dv)
        cp_fwd_bytes = (cp - 1) * kv if cp > 1 else 0.0
        cp_fwd = (cp - 1) * comm.p2p_s(kv, cp_tier) if cp > 1 else 0.0
        cp_exposed = max(0.0, cp_fwd - core) + max(0.0, 2.0 * cp_fwd - core_bwd)
        ep_tier = self.tier(ep, tp)
        ep_one = comm.all_to_all_s(a2a_bytes, ep, ep_tier) if moe else 0.0
        ep_bytes_one = comm.all_to_all_bytes(a2a_bytes, ep) if moe else 0.0
        ep_nic_one = comm.all_to_all_nic_bytes(a2a_bytes, ep, ep_tier) if moe else 0.0
        n_tp = 4 + (2 if recompute == "full" else 0)
        n_ep = 4 + (2 if recompute == "full" else 0)
        if recompute == "full":
            rc = fwd
        elif recompute == "selective":
            rc = core + core_ew_s
        else:
            rc = 0.0
        act_terms = layer_activation_terms(
            m, tokens=T, seq_ctx=seq, tp=tp, sp=sp, recompute=recompute, moe=moe,
            attention=o.attention, dropout=o.dropout, expert_tokens_factor=o.load_imbalance,
        )
        work = 0.0
        if recompute == "full":  # the layer being recomputed holds its full activations
            work = sum(layer_activation_terms(
                m, tokens=T, seq_ctx=seq, tp=tp, sp=sp, recompute="none", moe=moe,
                attention=o.attention, dropout=o.dropout, expert_tokens_factor=o.load_imbalance,
            ).values())
        return {
            "compute_s": fwd + bwd + rc,
            "fwd_s": fwd,
            "bwd_s": bwd,
            "tp_s": n_tp * tp_one,
            "tp_total_s": n_tp * comm.all_reduce_s(act, tp, tp_tier),
            "cp_s": cp_exposed,
            "cp_total_s": 3.0 * cp_fwd,
            "ep_s": n_ep * ep_one,
            "tp_bytes": n_tp * tp_bytes_one,
            "tp_nic": n_tp * comm.nic_bytes(tp_bytes_one, tp_tier),
            "cp_bytes": 3.0 * cp_fwd_bytes,
            "cp_nic": 3.0 * comm.nic_bytes(cp_fwd_bytes, cp_tier) if cp_tier.members_per_node else 0.0,
            "ep_bytes": n_ep * ep_bytes_one,
            "ep_nic": n_ep * ep_nic_one,
            "act_bytes": sum(act_terms.values()),
            "act_terms": act_terms,
            "work_bytes": work,
        }

    def _moe_counts(self, nls: int) -> tuple[int, int, int]:
        """MoE layers among the first, the last and the worst middle window of ``nls`` layers."""
        counts = self._windows.get(nls)
        if counts is None:
            L = self.model.num_layers
            first = sum(1 for i in range(min(nls, L)) if i in self.moe_set)
            last = sum(1 for i in range(max(0, L - nls), L) if i in self.moe_set)
            counts = self._windows[nls] = (first, last, min(nls, self.model.num_moe_layers))
        return counts

    def _gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        key = (m, n, k, batch)
        t = self._gemms.get(key)
        if t is None:
            t = self._gemms[key] = gemm_time_s(self.device, m, n, k, batch)
        return t

    def stage_params(self, tp: int, pp: int, ep: int) -> list[tuple]:
        """Per stage kind: (kind, index, MoE layers, dense params, expert params, one layer's
        params) held by one device of the stage, before ZeRO sharding."""
        key = (tp, pp, ep)
        rows = self._stage_params.get(key)
        if rows is not None:
            return rows
        m = self.model
        nls = math.ceil(m.num_layers / pp)
        moe_first, moe_last, moe_mid = self._moe_counts(nls)
        kinds = [("first", moe_first, 0), ("last", moe_last, pp - 1)] if pp > 1 else [("only", moe_first, 0)]
        if pp > 2:
            kinds.insert(1, ("middle", moe_mid, 1))
        rows = []
        for kind, n_moe, index in kinds:
            n_dense = nls - n_moe
            layer_split = n_dense * self.dense_split + n_moe * self.moe_split
            layer_rep = n_dense * self.layer_rep + n_moe * self.moe_rep
            params_dense = layer_split / tp + layer_rep
            if kind in ("first", "only"):
                params_dense += self.vocab_h / tp + self.pos
            if kind in ("last", "only"):
                params_dense += self.final_norm
                if not m.tied_embeddings or pp > 1:
                    params_dense += self.vocab_h / tp
            params_exp = n_moe * self.moe_experts / (ep * tp)
            layer = (self.dense_split if n_dense else self.moe_split) / tp + ((self.moe_experts / (ep * tp)) if n_moe else 0.0)
            rows.append((kind, index, n_moe, params_dense, params_exp, layer))
        self._stage_params[key] = rows
        return rows

    def states_floor(self, tp: int, cp: int, pp: int, dp: int, ep: int, zero: int, dp_shard: int,
                     p_dt: str, g_dt: str, o_dt: str) -> float:
        """Weights + gradients + optimiser states (+ ZeRO-3 gather buffers) of the fullest stage
        plus the runtime reserve: no schedule or micro-batch can bring a layout below this."""
        key = (tp, cp, pp, dp, ep, zero, dp_shard, p_dt, g_dt, o_dt)
        floor = self._floors.get(key)
        if floor is None:
            per_full, per_local, gather = _state_factors(zero, p_dt, g_dt, o_dt)
            shard = (dp_shard or dp) if zero else 1
            n_dense, n_exp = (shard * cp, max(1, shard * cp // ep)) if zero else (1, 1)
            floor = self._floors[key] = RESERVED_BYTES + max(
                per_full * (pd + pe) + per_local * (pd / n_dense + pe / n_exp) + gather * layer
                for _, _, _, pd, pe, layer in self.stage_params(tp, pp, ep)
            )
        return floor

    def _build_profile(self, tp, cp, pp, dp, ep, mbs, sp, recompute, seq) -> dict:
        m, o = self.model, self.options
        nls = math.ceil(m.num_layers / pp)
        dense = self._layer_cached(False, tp, cp, ep, mbs, sp, recompute, seq)
        moe = self._layer_cached(True, tp, cp, ep, mbs, sp, recompute, seq) if m.is_moe else dense
        h, V = m.hidden_size, m.vocab_size
        T = mbs * seq / cp
        # LM head + loss (last stage) and embedding (first stage), per micro-batch
        head_fwd = self._gemm(T, V / tp, h)
        loss_s = memory_bound_time_s(self.device, 14.0 * T * V / tp)
        head_s = 3.0 * head_fwd + loss_s
        logits_bytes = LOGITS_BYTES_PER_ELEM * T * V / tp
        stages = {}
        for kind, index, n_moe, params_dense, params_exp, layer in self.stage_params(tp, pp, ep):
            n_dense = nls - n_moe
            last = kind in ("last", "only")
            stage = {key: dense[key] * n_dense + moe[key] * n_moe for key in _PER_LAYER_SUMS}
            if last:
                stage["compute_s"] += head_s
                stage["fwd_s"] += head_fwd
                stage["bwd_s"] += 2 * head_fwd + loss_s
            stage.update(
                index=index,
                layers=nls,
                moe_layers=n_moe,
                params_dense=params_dense,
                params_expert=params_exp,
                work_bytes=max(dense["work_bytes"], moe["work_bytes"] if n_moe else 0.0),
                logits_bytes=logits_bytes if last else 0.0,
                layer_params=layer,
            )
            stages[kind] = stage
        act = 2.0 * T * h
        p2p_bytes = act / tp if (o.scatter_gather_p2p and tp > 1) or sp else act
        pp_tier = self.tier(pp, dp * cp * tp)
        gbs = o.global_batch or mbs * dp
        slow = max(stages.values(), key=lambda st: st["compute_s"] + st["tp_s"] + st["cp_s"] + st["ep_s"])
        return {
            "stages": stages,
            "rows": [(k, st["index"], st["act_bytes"], st["work_bytes"] + st["logits_bytes"]) for k, st in stages.items()],
            "params_rows": [(st["params_dense"], st["params_expert"], st["layer_params"]) for st in stages.values()],
            "slow": slow,
            "t_mb": slow["compute_s"] + slow["tp_s"] + slow["cp_s"] + slow["ep_s"],
            "n_mb": gbs // (mbs * dp),
            "tokens": gbs * seq,
            "key": (tp, cp, pp, dp, ep, mbs, sp, recompute),
            "dense": dense,
            "moe": moe,
            "p2p_s": comm.p2p_s(p2p_bytes, pp_tier) if pp > 1 else 0.0,
            "p2p_bytes": p2p_bytes if pp > 1 else 0.0,
            "p2p_nic": p2p_bytes if pp > 1 and pp_tier.members_per_node else 0.0,
            "buffers": (2 * p2p_bytes if pp > 1 else 0.0) + (act if sp else 0.0)
            + (2.0 * 2.0 * T * m.top_k * h / tp * o.load_imbalance if m.is_moe and ep > 1 else 0.0),
            "dp": {},
        }

    def _dp_entry(self, prof: dict, cand: tuple) -> dict:
        """Model states per stage for one (profile, ZeRO, dtypes): constant across schedules, so
        cached in the profile; the data-parallel traffic is added by ``_dp_comm`` when needed."""
        cp, dp, ep = prof["key"][1], prof["key"][3], prof["key"][4]
        zero, dp_shard = cand[8], cand[9]
        shard = (dp_shard or dp) if zero else 1
        n_dense = shard * cp if zero else 1
        n_exp = max(1, shard * cp // ep) if zero else 1
        per_full, per_local, gather = _state_factors(zero, *cand[12:15])
        states = [
            per_full * (pd + pe) + per_local * (pd / n_dense + pe / n_exp) + gather * layer
            for pd, pe, layer in prof["params_rows"]
        ]
        buffers = prof["buffers"] + (DP_BUCKET_BYTES if dp * cp > 1 else 0.0)
        base = buffers * (1.0 + FRAGMENTATION) + RESERVED_BYTES
        return {
            "states": states,
            "buffers": buffers,
            "base_bytes": base,
            "floor_bytes": max(states) + base,
            "exposed_s": None,
        }

    def _state_parts(self, prof: dict, cand: tuple, kind: str) -> dict[str, float]:
        """Weights, gradients, optimiser states and ZeRO-3 gather buffers of one stage, bytes."""
        cp, dp, ep = prof["key"][1], prof["key"][3], prof["key"][4]
        zero, dp_shard = cand[8], cand[9]
        pb, gb = DTYPE_BYTES[cand[12]], DTYPE_BYTES[cand[13]]
        ob = optimizer_bytes_per_param(cand[12], cand[14])
        shard = (dp_shard or dp) if zero else 1
        n_dense = shard * cp if zero else 1
        n_exp = max(1, shard * cp // ep) if zero else 1
        st = prof["stages"][kind]
        pd, pe = st["params_dense"], st["params_expert"]
        full, local = pd + pe, pd / n_dense + pe / n_exp
        return {
            "weights": pb * (full if zero < 3 else local),
            "gradients": gb * (full if zero < 2 else local),
            "optimizer_states": ob * (full if zero == 0 else local),
            "zero3_gather_buffers": (2 * pb + gb) * st["layer_params"] if zero == 3 else 0.0,
        }

    def _dp_comm(self, prof: dict, d: dict, cand: tuple) -> None:
        """Exposed data-parallel time and optimiser time of one (profile, ZeRO, dtypes), into ``d``:
        the traffic (``_dp_traffic``) set against this profile's compute windows."""
        o = self.options
        slow, n_mb = prof["slow"], prof["n_mb"]
        r = self._dp_traffic(prof, cand)
        win_b = slow["bwd_s"] if o.overlap_grad_reduce else 0.0
        win_f = slow["fwd_s"] if o.overlap_param_gather else 0.0
        if cand[8] == 3:
            per_mb = r["per_mb_s"]
            # the first layer's gather cannot be prefetched; the rest hides behind the micro-batch's compute
            exposed = n_mb * (max(0.0, per_mb - (slow["fwd_s"] + slow["bwd_s"])) + r["first_gather_s"])
            exposed += max(0.0, r["replica_s"] - win_b)
            total = n_mb * per_mb + r["replica_s"]
            nbytes, nic = n_mb * r["per_mb_bytes"] + r["step_bytes"], n_mb * r["per_mb_nic"] + r["step_nic"]
        else:
            exposed = max(0.0, r["reduce_s"] - win_b) + max(0.0, r["gather_s"] - win_f)
            total = r["reduce_s"] + r["gather_s"]
            nbytes, nic = r["step_bytes"], r["step_nic"]
        d.update(
            exposed_s=exposed + r["tied_s"] + r["optimizer_s"],
            optimizer_s=r["optimizer_s"],
            total_s=total + r["tied_s"],
            bytes=nbytes,
            nic=nic,
            tier=r["tier"],
        )

    def _dp_traffic(self, prof: dict, cand: tuple) -> dict:
        """Data-parallel collectives of the stage with the most parameters: seconds and bytes
        (per step, or per micro-batch for ZeRO-3). Depends only on the mesh, ZeRO and dtypes, so
        it is shared by every micro-batch size and recomputation mode."""
        tp, cp, pp, dp, ep = prof["key"][:5]
        zero, dp_shard = cand[8], cand[9]
        key = (tp, cp, pp, dp, ep, zero, dp_shard) + cand[12:15]
        cached = self._traffic.get(key)
        if cached is not None:
            return cached
        p_dt, g_dt, o_dt = cand[12:15]
        pb, gb = DTYPE_BYTES[p_dt], DTYPE_BYTES[g_dt]
        ob = optimizer_bytes_per_param(p_dt, o_dt)
        shard = (dp_shard or dp) if zero else 1
        n_dense = shard * cp if zero else 1
        edp = dp * cp // ep
        n_exp = max(1, shard * cp // ep) if zero else 1
        big = max(prof["stages"].values(), key=lambda st: st["params_dense"] + st["params_expert"])
        pd, pe = big["params_dense"], big["params_expert"]
        dense_t = self.tier(dp * cp, tp)
        exp_t = self.tier(edp, tp * ep)
        r = {"tier": dense_t.name, "reduce_s": 0.0, "gather_s": 0.0, "per_mb_s": 0.0, "first_gather_s": 0.0,
             "replica_s": 0.0, "per_mb_bytes": 0.0, "per_mb_nic": 0.0, "step_bytes": 0.0, "step_nic": 0.0}
        if zero == 0:
            r["reduce_s"] = comm.all_reduce_s(gb * pd, dp * cp, dense_t) + comm.all_reduce_s(gb * pe, edp, exp_t)
            b1, b2 = comm.ring_all_reduce_bytes(gb * pd, dp * cp), comm.ring_all_reduce_bytes(gb * pe, edp)
            r["step_bytes"], r["step_nic"] = b1 + b2, comm.nic_bytes(b1, dense_t) + comm.nic_bytes(b2, exp_t)
        elif zero in (1, 2):
            r["reduce_s"] = comm.reduce_scatter_s(gb * pd, dp * cp, dense_t) + comm.reduce_scatter_s(gb * pe, edp, exp_t)
            r["gather_s"] = comm.all_gather_s(pb * pd, dp * cp, dense_t) + comm.all_gather_s(pb * pe, edp, exp_t)
            b1 = comm.reduce_scatter_bytes(gb * pd, dp * cp) + comm.all_gather_bytes(pb * pd, dp * cp)
            b2 = comm.reduce_scatter_bytes(gb * pe, edp) + comm.all_gather_bytes(pb * pe, edp)
            r["step_bytes"], r["step_nic"] = b1 + b2, comm.nic_bytes(b1, dense_t) + comm.nic_bytes(b2, exp_t)
        else:
            sd_t = self.tier(shard * cp, tp)
            r["tier"] = sd_t.name
            se_n = max(1, shard * cp // ep)
            se_t = self.tier(se_n, tp * ep)
            # FSDP gathers and reduces layer by layer: one collective's latency per layer each
            nl = max(1, big["layers"])
            per_mb = nl * (
                2 * comm.all_gather_s(pb * pd / nl, shard * cp, sd_t) + comm.reduce_scatter_s(gb * pd / nl, shard * cp, sd_t)
                + 2 * comm.all_gather_s(pb * pe / nl, se_n, se_t) + comm.reduce_scatter_s(gb * pe / nl, se_n, se_t)
            )
            r["per_mb_s"], r["first_gather_s"] = per_mb, per_mb / (3.0 * nl)
            b1 = 2 * comm.all_gather_bytes(pb * pd, shard * cp) + comm.reduce_scatter_bytes(gb * pd, shard * cp)
            b2 = 2 * comm.all_gather_bytes(pb * pe, se_n) + comm.reduce_scatter_bytes(gb * pe, se_n)
            r["per_mb_bytes"], r["per_mb_nic"] = b1 + b2, comm.nic_bytes(b1, sd_t) + comm.nic_bytes(b2, se_t)
            replicas = dp // shard
            if replicas > 1:
                rep_t = self.tier(replicas, tp * cp * shard)
                local = gb * (pd / (shard * cp) + pe / se_n)
                r["replica_s"] = comm.all_reduce_s(local, replicas, rep_t)
                b3 = comm.ring_all_reduce_bytes(local, replicas)
                r["step_bytes"], r["step_nic"] = b3, comm.nic_bytes(b3, rep_t)
                if rep_t.name == "inter":
                    r["tier"] = "inter"
        r["tied_s"] = 0.0
        if pp > 1 and self.model.tied_embeddings:
            # the first and last stages hold copies of the tied embedding: all-reduce its gradient
            emb_t = self.tier(2, dp * cp * tp * (pp - 1))
            r["tied_s"] = comm.all_reduce_s(gb * self.vocab_h / tp, 2, emb_t)
            b4 = comm.ring_all_reduce_bytes(gb * self.vocab_h / tp, 2)
            r["step_bytes"] += b4
            r["step_nic"] += comm.nic_bytes(b4, emb_t)
        r["optimizer_s"] = memory_bound_time_s(self.device, (pd / n_dense + pe / n_exp) * (2 * ob + gb + pb))
        self._traffic[key] = r
        return r

    # --- one layout ------------------------------------------------------------------------------------
    def screen(self, cand: tuple) -> tuple[float, str | None, str | None]:
        """(tokens/s, reject category, reject reason) of a candidate tuple; the search's fast path."""
        return self._evaluate(cand, False)

    def estimate(self, layout: Layout | tuple) -> dict:
        """The estimate JSON of one layout (see commands/plan.py for the field contract)."""
        cand = self.key(layout) if isinstance(layout, Layout) else layout
        return self._evaluate(cand, True)

    def _evaluate(self, cand: tuple, detail: bool = False):
        tp, cp, pp, dp, ep, mbs, sp, recompute, zero, dp_shard, schedule, v = cand[:12]
        if not detail:
            floor = self._floors.get(cand[:5] + cand[8:10] + cand[12:15])
            if floor is None:
                floor = self.states_floor(tp, cp, pp, dp, ep, zero, dp_shard, *cand[12:15])
            if floor > self.capacity:
                # hopeless whatever the micro-batching; rank such layouts by how close they come to fitting
                return -floor, STATES_DO_NOT_FIT, None
        pkey = cand[:8]
        if pkey == self._last_pkey:
            prof = self._last_prof
        else:
            prof = self.profile(tp, cp, pp, dp, ep, mbs, sp, recompute, self.seq)
            self._last_pkey, self._last_prof = pkey, prof
        dkey = (zero, dp_shard) + cand[12:]
        d = prof["dp"].get(dkey)
        if d is None:
            d = prof["dp"][dkey] = self._dp_entry(prof, cand)
        if not detail and d["floor_bytes"] > self.capacity:
            # no schedule brings this below capacity: one micro-batch's buffers already overflow
            return -d["floor_bytes"], ACTIVATIONS_DO_NOT_FIT, None
        if d["exposed_s"] is None:
            self._dp_comm(prof, d, cand)
        n_mb = prof["n_mb"]

        # --- memory: every stage kind, keep the worst ---------------------------------------------
        peak, worst, worst_inflight = -1.0, None, 0.0
        base = d["base_bytes"]
        simple = schedule == "1f1b" or schedule == "zero-bubble"  # inlined in_flight_microbatches
        for (kind, index, act_mb, fixed), states in zip(prof["rows"], d["states"]):
            if simple:
                inflight = pp - index if pp - index < n_mb else n_mb
            else:
                inflight = in_flight_microbatches(schedule, pp, n_mb, v, index)
            total = states + (inflight * act_mb + fixed) * _GROWTH + base
            if total > peak:
                peak, worst, worst_inflight = total, kind, inflight
        fits = peak <= self.capacity

        # --- time ------------------------------------------------------------------------------------
        t_mb = prof["t_mb"]
        idle = bubble_time_units(schedule, pp, v) if pp > 1 else 0.0
        p2p = 2.0 * (n_mb * v + pp - 1) * prof["p2p_s"] if pp > 1 else 0.0
        step = (n_mb + idle) * t_mb + p2p + d["exposed_s"]
        tokens_per_s = prof["tokens"] / step
        if not detail:
            if fits:
                return tokens_per_s, None, None
            return tokens_per_s, ACTIVATIONS_DO_NOT_FIT, None

        # --- the JSON -------------------------------------------------------------------------------
        seq, tokens = self.seq, prof["tokens"]
        p_dt = cand[12]
        st_w = prof["stages"][worst]
        inflight = worst_inflight
        act = inflight * st_w["act_bytes"] + st_w["work_bytes"] + st_w["logits_bytes"]
        buffers = d["buffers"]
        breakdown = self._state_parts(prof, cand, worst)
        breakdown.update({
            "activations": inflight * st_w["act_bytes"],
            "recompute_working_layer": st_w["work_bytes"],
            "logits": st_w["logits_bytes"],
            "comm_buffers": buffers,
            "allocator_fragmentation": FRAGMENTATION * (act + buffers),
            "reserved_runtime": RESERVED_BYTES,
        })
        breakdown = {k: int(round(x)) for k, x in breakdown.items()}
        peak_int = sum(breakdown.values())
        peak_dev = self.device.flops(p_dt)
        n_dev = tp * cp * pp * dp
        model_flops = 3.0 * self.model.forward_flops_per_token(seq) * tokens
        rc_flops = 0.0
        if recompute == "full":
            rc_flops = (self.model.forward_flops_per_token(seq) - self.head_fwd_flops_token) * tokens
        elif recompute == "selective":
            rc_flops = self.model.attention_flops_per_token(seq) * tokens
        slow = prof["slow"]
        axis_tier = {
            "tp": self.tier(tp, 1).name, "cp": self.tier(cp, tp).name, "ep": self.tier(ep, tp).name,
            "pp": self.tier(pp, dp * cp * tp).name if pp > 1 else "intra",
            "dp": d["tier"],
        }
        # per-micro-batch communication in the bubble is part of the bubble, not counted again here
        exposed_axis = {
            "tp": n_mb * slow["tp_s"], "cp": n_mb * slow["cp_s"], "ep": n_mb * slow["ep_s"],
            "pp": p2p, "dp": d["exposed_s"] - d["optimizer_s"],
        }
        total_axis = {
            "tp": n_mb * slow["tp_total_s"], "cp": n_mb * slow["cp_total_s"], "ep": n_mb * slow["ep_s"],
            "pp": p2p, "dp": d["total_s"],
        }
        bytes_axis = {
            "tp": n_mb * slow["tp_bytes"], "cp": n_mb * slow["cp_bytes"], "ep": n_mb * slow["ep_bytes"],
            "pp": 2.0 * n_mb * v * prof["p2p_bytes"], "dp": d["bytes"],
        }
        nic_axis = {
            "tp": n_mb * slow["tp_nic"], "cp": n_mb * slow["cp_nic"], "ep": n_mb * slow["ep_nic"],
            "pp": 2.0 * n_mb * v * prof["p2p_nic"], "dp": d["nic"],
        }
        inter = sum(nic_axis.values())
        by_link = {"intra": int(round(sum(bytes_axis.values()) - inter)), "inter": int(round(inter))}
        exposed_link = {"intra": 0.0, "inter": 0.0}
        for axis, seconds in exposed_axis.items():
            exposed_link[axis_tier[axis]] += seconds
        layout = self.layout(cand)
        warnings = self._warnings(layout, exposed_axis, step, idle / (n_mb + idle) if idle else 0.0, fits)
        reason = None
        cap = self.capacity / GIB
        where = "the device" if worst == "only" else f"the {worst} pipeline stage"
        if not fits and self.states_floor(tp, cp, pp, dp, ep, zero, dp_shard, *cand[12:15]) > self.capacity:
            states_gib = sum(self._state_parts(prof, cand, worst).values()) / GIB
            reason = (
                f"weights, gradients and optimizer states alone need {states_gib:.1f} GiB of {cap:.1f} GiB on {where}"
                + ("" if zero == 3 else "; a higher ZeRO stage, more TP/PP or EP shard them")
            )
        elif not fits:
            reason = (
                f"needs {peak_int / GIB:.1f} GiB of {cap:.1f} GiB on {where}: activations of "
                f"{inflight:g} micro-batch{'es' if inflight != 1 else ''} in flight take {breakdown['activations'] / GIB:.1f} GiB"
                + ("" if cand[7] == "full" else " (recomputation would shrink them)")
            )
        return {
            "goal": "train",
            "layout": layout.to_dict(),
            "short": layout.short(),
            "fits": fits,
            "memory": {
                "peak_bytes": peak_int,
                "capacity_bytes": int(self.capacity),
                "worst_stage": worst,
                "breakdown": breakdown,
            },
            "time": {
                "step_s": step,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": (model_flops + rc_flops) / step / n_dev / 1e12,
                "mfu": model_flops / (step * n_dev * peak_dev),
                "compute_s": n_mb * (slow["compute_s"]),
                "bubble_s": idle * t_mb,
                "optimizer_s": d["optimizer_s"],
                "microbatches": n_mb,
            },
            "comm": {
                "bytes_per_step_by_link": by_link,
                "bytes_per_step_by_axis": {k: int(round(x)) for k, x in bytes_axis.items()},
                "exposed_s": sum(exposed_axis.values()),
                "exposed_s_by_link": exposed_link,
                "exposed_s_by_axis": exposed_axis,
                "total_s_by_axis": total_axis,
                "hidden_s_by_axis": {k: max(0.0, total_axis[k] - exposed_axis[k]) for k in total_axis},
                "link_by_axis": axis_tier,
            },
            "bubble_fraction": idle / (n_mb + idle) if idle else 0.0,
            "warnings": warnings,
            "reject_reason": reason,
        }

    def _warnings(self, layout: Layout, exposed: dict, step: float, bubble: float, fits: bool) -> list[str]:
        """Sentences about what this layout spends its step on, when it is worth saying."""
        cl = self.cluster
        per_node = cl.devices_per_node
        out = []
        nic = link_words(cl.inter_link.name)
        if layout.tp > per_node:
            out.append(
                f"tp={layout.tp} spans {layout.tp // per_node} nodes: its all-reduces over {nic} take "
                f"{exposed['tp'] / step:.0%} of the step"
            )
        if layout.cp > 1 and layout.cp * layout.tp > per_node:
            out.append(f"cp={layout.cp} crosses nodes: ring attention over {nic} exposes {exposed['cp'] / step:.0%} of the step")
        if layout.ep > 1 and layout.ep * layout.tp > per_node:
            out.append(f"ep={layout.ep} crosses nodes: all-to-all over {nic} takes {exposed['ep'] / step:.0%} of the step")
        if bubble > 0.15:
            out.append(f"pipeline bubble is {bubble:.0%} of the step; more micro-batches or interleaving shrink it")
        if exposed["dp"] / step > 0.10:
            out.append(f"data-parallel traffic not hidden by compute takes {exposed['dp'] / step:.0%} of the step")
        if exposed["tp"] / step > 0.25 and layout.tp <= per_node:
            out.append(f"tensor-parallel all-reduces take {exposed['tp'] / step:.0%} of the step")
        return out


def link_words(name: str) -> str:
    """A catalogue link name as a sentence says it (``ib-hdr`` -> ``InfiniBand HDR``)."""
    kind, _, rest = name.partition("-")
    words = {"ib": "InfiniBand", "eth": "Ethernet", "nvlink3": "NVLink 3", "nvlink4": "NVLink 4",
             "nvlink5": "NVLink 5", "pcie4": "PCIe 4", "pcie5": "PCIe 5", "xgmi": "Infinity Fabric"}
    return f"{words.get(kind, kind)} {rest.upper()}".strip() if kind in words else name


def _state_factors(zero: int, p_dt: str, g_dt: str, o_dt: str) -> tuple[float, float, float]:
    """Bytes per parameter held in full, bytes per parameter sharded over the ZeRO group, and
    bytes per parameter of one layer gathered in full (ZeRO-3), for ZeRO stage ``zero``."""
    pb, gb = DTYPE_BYTES[p_dt], DTYPE_BYTES[g_dt]
    ob = optimizer_bytes_per_param(p_dt, o_dt)
    if zero == 0:
        return pb + gb + ob, 0.0, 0.0
    if zero == 1:
        return pb + gb, ob, 0.0
    if zero == 2:
        return pb, gb + ob, 0.0
    return 0.0, pb + gb + ob, 2 * pb + gb


def optimizer_bytes_per_param(param_dtype: str = "bf16", optim_dtype: str = "fp32") -> float:
    """Adam state per parameter: two moments, plus a master copy when it differs from the
    compute dtype (mixed precision: 4 + 4 + 4 = 12 bytes)."""
    o = DTYPE_BYTES[optim_dtype]
    return 2 * o + (0.0 if param_dtype == optim_dtype else o)


def model_state_bytes_per_param(zero: int, n: int, param_dtype: str = "bf16", grad_dtype: str = "bf16",
                                optim_dtype: str = "fp32") -> float:
    """Bytes per parameter of weights + gradients + Adam state with ZeRO stage ``zero`` over
    ``n`` ranks (Rajbhandari et al. 2020: 16, 4 + 12/N, 2 + 14/N, 16/N for fp16 mixed precision)."""
    p, g, o = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype], optimizer_bytes_per_param(param_dtype, optim_dtype)
    if zero == 0:
        return p + g + o
    if zero == 1:
        return p + g + o / n
    if zero == 2:
        return p + (g + o) / n
    return (p + g + o) / n
