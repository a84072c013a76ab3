"""Training cost model: memory of the worst device, step time and link traffic of one layout.

Usage::

    from modelcarve.plan.train.model import TrainCostModel, TrainOptions
    cost = TrainCostModel(model, cluster, TrainOptions(global_batch=1536, seq=2048))
    result = cost.estimate(Layout.parse("tp=8,pp=2,dp=32,mbs=4,recompute=full"))  # the JSON dict
    score, category, reason = cost.screen(cost.key(layout))                       # the fast path

One code path (``_evaluate``) serves both: the search screens hundreds of thousands of layouts
with ``detail=False`` (plain floats, per-model and per-(tp, cp, pp, mbs, ...) constants cached),
then asks for the breakdown of the finalists with ``detail=True``; the two cannot disagree.
This module owns the caches and the assembly of a step (its options: plan/train/options.py); one layer's cost is in
plan/train/layer.py, one micro-batch's stage profiles in plan/train/profile.py, model states and
data-parallel traffic in plan/train/states.py, the JSON and its warnings in plan/train/report.py.

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
  Megatron's scatter-gather); on the critical path, except that the interleaved schedule's
  steady-state sends overlap compute when ``overlap_p2p`` (Megatron-Core).
* DP: gradient all-reduce (ZeRO-0), reduce-scatter + parameter all-gather (ZeRO-1; ZeRO-2
  keeps only its gradient shard, so it reduce-scatters after every micro-batch), or
  per-micro-batch parameter all-gathers and gradient reduce-scatters (ZeRO-3/FSDP; HSDP adds an
  all-reduce across replicas; with a pipeline, as torch's pipelining runs FSDP under every schedule,
  the stage's gradients stay unsharded and its layers gathered after each backward until the step's
  one reduce-scatter per unit, the root unit gathered for the step: ``holds_layers``; each layer
  gathered ``m + 1`` times a step, once under zero-bubble, spec/support.py ``fsdp_layer_gathers``);
  gradient reduction hides behind the last micro-batch's backward,
  the parameter all-gather behind the first forward (when ``overlap_grad_reduce`` /
  ``overlap_param_gather``), ZeRO-3 traffic behind each micro-batch's compute.
* Bubble by schedule (plan/cost/schedule.py); the optimiser step streams its state through HBM.
* Candidates carry ``etp`` (expert TP; MoE parallel folding) and ``fp8_scaling``; FP8 / MXFP8
  GEMMs, quantisation traffic and FP8 weight caches are plan/train/layer.py's and
  plan/train/states.py's. Memory: states + activations of the micro-batches in flight + loss
  logits (``TrainOptions.loss``) + buffers, the allocator's ``fragmentation`` of the transient
  part, the itemised runtime reserve; a layout fits within ``(1 - memory_headroom)`` of the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.cost import comm
from modelcarve.plan.cost.schedule import bubble_time_units, in_flight_microbatches
from modelcarve.plan.train.profile import LOGITS_BYTES_PER_ELEM, LOSS_KINDS, ProfileMixin  # noqa: F401 - re-exported
from modelcarve.plan.train.options import CUDA_GRAPHS, MOE_EXPERT_KERNELS, TrainOptions  # noqa: F401 - TrainOptions re-exported
from modelcarve.plan.train.report import build_report
from modelcarve.plan.train.candidate import FIELDS, Candidate
from modelcarve.plan.train.states import (  # noqa: F401 - re-exported for callers of this module
    DP_BUCKET_BYTES,
    FP8_DTYPES,
    FRAGMENTATION,
    GIB,
    MEMORY_HEADROOM,
    PARAM_POLICIES,
    RESERVED_BYTES,
    dp_traffic,
    fp8_cache_bytes,
    held_layer_bytes,
    model_state_bytes_per_param,
    optimizer_bytes_per_param,
    param_storage,
    reserved_bytes,
    stage_row,
    state_factors,
    weight_bytes,
)
from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import DTYPE_BYTES, Layout
from modelcarve.spec.stages import layout_holdings, planned_layout, rank_holdings, split_costs, stage_kind
from modelcarve.spec.support import fsdp_holds_gradients, fsdp_layer_gathers, fsdp_reshards_after_forward

if TYPE_CHECKING:
    from modelcarve.spec.hardware import ClusterSpec
    from modelcarve.spec.model import ModelSpec


__all__ = [
    "FIELDS", "GIB", "RESERVED_BYTES", "FRAGMENTATION", "DP_BUCKET_BYTES", "TrainCostModel", "TrainOptions",
    "model_state_bytes_per_param", "optimizer_bytes_per_param",
]


STATES_DO_NOT_FIT = "weights, gradients and optimizer states alone exceed device memory"
ACTIVATIONS_DO_NOT_FIT = "activations do not fit beside the model states"

# candidate tuple fields (the search's currency; Layout converts to and from it)


class TrainCostModel(ProfileMixin):
    """Cost of training ``model`` on ``cluster``; per-model constants are computed once."""

    def __init__(self, model: "ModelSpec", cluster: "ClusterSpec", options: TrainOptions | None = None):
        self.model, self.cluster = model, cluster
        self.options = options or TrainOptions()
        if self.options.attention not in ("flash", "materialized"):
            raise LayoutError(f"attention={self.options.attention!r} must be 'flash' or 'materialized'")
        if self.options.loss not in LOSS_KINDS:
            raise LayoutError(f"loss={self.options.loss!r} must be one of: {', '.join(LOSS_KINDS)}")
        if self.options.cuda_graph not in CUDA_GRAPHS:
            raise LayoutError(f"cuda_graph={self.options.cuda_graph!r} must be one of: {', '.join(CUDA_GRAPHS)}")
        if self.options.moe_expert_kernels not in MOE_EXPERT_KERNELS:
            raise LayoutError(f"moe_expert_kernels={self.options.moe_expert_kernels!r} must be one of: "
                              f"{', '.join(MOE_EXPERT_KERNELS)}")
        if not 0.0 <= self.options.memory_headroom < 0.5:
            raise LayoutError(f"memory headroom {self.options.memory_headroom} must be a fraction in [0, 0.5), e.g. 0.05")
        if self.options.param_policy not in PARAM_POLICIES:
            raise LayoutError(f"param_policy={self.options.param_policy!r} must be one of: {', '.join(PARAM_POLICIES)}")
        if not 0.0 <= self.options.fragmentation < 1.0:
            raise LayoutError(f"fragmentation {self.options.fragmentation} must be a fraction in [0, 1), e.g. 0.05")
        self._growth = 1.0 + self.options.fragmentation
        off = self.options.offload_layers
        if not 0 <= off < model.num_layers:
            raise LayoutError(f"offload_layers={off} must be from 0 to {model.num_layers - 1} "
                              f"(fewer than the model's {model.num_layers} layers)")
        self._offload = off
        if self.options.loss_chunk < 1:
            raise LayoutError(f"loss_chunk={self.options.loss_chunk} must be at least 1 token")
        if not 0 <= self.options.mtp_layers <= 8:
            raise LayoutError(f"mtp_layers={self.options.mtp_layers} must be from 0 to 8 multi-token prediction depths "
                              f"(DeepSeek-V3 trains with 1)")
        if self.options.loss_chunks < 0:
            raise LayoutError(f"loss_chunks={self.options.loss_chunks} must be 0 (chunks of loss_chunk tokens) or "
                              f"a number of chunks a micro-batch, e.g. 8 (torchtitan's default)")
        self.device = cluster.device
        self.device_memory = cluster.device.memory_bytes
        self.capacity = cluster.device.memory_bytes * (1.0 - self.options.memory_headroom)
        self.seq = self.options.seq or 2048
        self._profiles: dict = {}
        self._tiers: dict = {}
        self._layers: dict = {}
        self._layer_bases: dict = {}
        self._causal_shares: dict = {}  # seq -> layer.py's _causal_share
        self._act_terms: dict = {}  # layer.py's activation terms and working set per shape
        self._layer_gemms: dict = {}  # layer.py's GEMM seconds per shape (no sp)
        self._is_moe = model.is_moe
        self._gemms: dict = {}
        self._traffic: dict = {}
        self._stage_params: dict = {}
        self._split_ids: dict = {}
        self._splits: dict = {}
        self._floors: dict = {}
        self._states: dict = {}
        self._dp_static: dict = {}
        self._heads: dict = {}
        self._leans: dict = {}
        self._last_pkey: tuple | None = None
        self._last_dtype = "bf16"
        self._last_etp = 0
        self._last_v = 1
        self._dtype = "bf16"  # compute dtype of the profile being built
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
        self._split = split_costs(self.options.split_embedding, self.options.mtp_layers)
        self._mtp_moe = (m.num_layers - 1) in self.moe_set  # an MTP depth is a layer of the last layer's kind
        self._held: dict[tuple, tuple] = {}

    # --- candidate <-> Layout ----------------------------------------------------------------------
    @staticmethod
    def key(layout: Layout) -> Candidate:
        return Candidate(
            layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.mbs, layout.sp, layout.recompute,
            layout.zero, layout.dp_shard, layout.schedule, layout.virtual_stages,
            layout.param_dtype, layout.grad_dtype, layout.optim_dtype, layout.expert_tp, layout.fp8_scaling,
        )

    @staticmethod
    def full_candidate(cand: tuple) -> Candidate:
        """A ``Candidate`` with expert TP resolved and the FP8 scaling present (from any tuple in
        field order, older 15-field ones included)."""
        if type(cand) is Candidate and cand.etp:
            return cand
        tp, cp, dp, ep = cand[0], cand[1], cand[3], cand[4]
        etp = (cand[15] if len(cand) > 15 else 0) or (tp if (dp * cp) % ep == 0 else 1)
        return Candidate(*cand[:15], etp, cand[16] if len(cand) > 16 else "delayed")

    @staticmethod
    def compute_key(cand: Candidate) -> str:
        """The GEMM precision a candidate runs: its param_dtype, ``fp8cs`` for current scaling."""
        if cand.param_dtype == "fp8" and cand.fp8_scaling == "current":
            return "fp8cs"
        return cand.param_dtype

    def layout(self, cand: tuple) -> Layout:
        values = dict(zip(FIELDS, cand))
        if values.get("etp") == (values["tp"] if (values["dp"] * values["cp"]) % values["ep"] == 0 else 1):
            values["etp"] = 0  # the default: keep the layout's one-line form unchanged
        return Layout(**values, gbs=self.options.global_batch or values["mbs"] * values["dp"], seq=self.seq)

    # --- tiers ---------------------------------------------------------------------------------------
    def tier(self, group: int, inner: int) -> comm.Tier:
        key = (group, inner)
        tier = self._tiers.get(key)
        if tier is None:
            tier = self._tiers[key] = comm.group_tier(self.cluster, group, inner)
        return tier

    # --- per (tp, cp, pp, dp, ep, mbs, sp, recompute): stage compute and memory profile ---------------

    def stage_params(self, tp: int, pp: int, ep: int, etp: int = 0, v: int = 1) -> list[tuple]:
        """Per stage kind: (kind, pipeline rank, MoE layers, dense params, expert params, one
        layer's params, linear-layer params, layers) held by one device of that rank, before ZeRO
        sharding (``etp``: expert TP, 0 = tp; ``v``: virtual stages per rank). The layers are the
        runtime's split (spec/stages.py): the embedding's rank (first), the head's (last) and the
        fullest middle rank (most parameters; the earliest on ties: it keeps the most micro-
        batches in flight), each rank summing its virtual stages."""
        etp = etp or tp
        key = (tp, pp, ep, etp, v)
        rows = self._stage_params.get(key)
        if rows is not None:
            return rows
        held = self.holdings(pp, v)
        rows = [stage_row(self, stage_kind(r, pp), r, *held[r], tp, pp, ep, etp) for r in dict.fromkeys((0, pp - 1))]
        if pp > 2:
            firsts = {held[r]: r for r in range(pp - 2, 0, -1)}  # each distinct middle holding at its first rank
            middles = [stage_row(self, "middle", r, *h, tp, pp, ep, etp) for h, r in firsts.items()]
            rows.insert(1, max(middles, key=lambda row: (row[3] + row[4], -row[1])))
        self._stage_params[key] = rows
        return rows

    def holdings(self, pp: int, v: int) -> tuple:
        """(layers, MoE layers) of every pipeline rank: the split (spec/stages.py, with this run's
        ``split_costs``), the last rank also holding the ``mtp_layers`` multi-token-prediction
        depths' decoder layers (of the model's last layer's kind)."""
        held = self._held.get((pp, v))
        if held is None:
            o, mtp = self.options, self.options.mtp_layers
            if o.pipeline_layout or o.first_stage_layers or o.last_stage_layers:  # the stages stated
                stated = self.layout_string(pp, v)
                held, _counts, named = layout_holdings(stated, self.model.num_layers, pp, v, self.moe_set)
                if named != mtp:
                    raise LayoutError(f"pipeline layout {stated!r} places {named} MTP depth(s) "
                                      f"(m); mtp_layers is {mtp}: give the same number (Megatron's --mtp-num-layers)")
            else:
                held = rank_holdings(self.model.num_layers, pp, v, self.moe_set, *self._split)
            if mtp:
                n, k = held[-1]
                held = held[:-1] + ((n + mtp, k + (mtp if self._mtp_moe else 0)),)
            self._held[(pp, v)] = held
        return held

    def layout_string(self, pp: int, v: int) -> str:
        """This run's split over ``pp`` ranks x ``v`` virtual stages as Megatron-Core's layout string
        (spec/stages.py ``planned_layout``: stated, Megatron's uneven split, or the balanced one)."""
        o = self.options
        return planned_layout(self.model.num_layers, pp, v, layout=o.pipeline_layout, first=o.first_stage_layers,
                              last=o.last_stage_layers, split_embedding=o.split_embedding, mtp_layers=o.mtp_layers)

    def split_id(self, pp: int, v: int) -> int:
        """A small id of the runtime's split of the layers over ``pp`` ranks with ``v`` virtual
        stages each (spec/stages.py), equal for every (pp, v) whose ranks hold the same layers
        (128 layers on pp=32: v = 1, 2 and 4 all give 4 layers per rank), so those share profiles."""
        key = (pp, v)
        sid = self._split_ids.get(key)
        if sid is None:
            held = self.holdings(pp, v)
            sid = self._split_ids[key] = self._splits.setdefault(held, len(self._splits))
        return sid

    def stage_states(self, tp: int, cp: int, pp: int, dp: int, ep: int, zero: int, dp_shard: int,
                     p_dt: str, g_dt: str, o_dt: str, etp: int = 0, v: int = 1, held: bool = False) -> list[float]:
        """Weights + gradients + optimiser states (+ ZeRO-3 gather buffers, + FP8 weight caches)
        per stage kind, bytes, in ``stage_params`` order; independent of micro-batching, so
        cached per mesh and ZeRO. ``held``: FSDP holds the stage's gradients unsharded and its
        layers gathered to the step's end (``holds_layers``: any pipeline); ZeRO-3 then adds each
        stage's ``held_layer_bytes``."""
        etp = etp or tp
        held = held and zero == 3
        key = (tp, cp, pp, dp, ep, zero, dp_shard, p_dt, g_dt, o_dt, etp, v, held)
        states = self._states.get(key)
        if held and states is None:
            states = self._states[key] = [
                st + held_layer_bytes(self, row, tp, ep, etp, p_dt, g_dt) for st, row in zip(
                    self.stage_states(tp, cp, pp, dp, ep, zero, dp_shard, p_dt, g_dt, o_dt, etp, v),
                    self.stage_params(tp, pp, ep, etp, v))]
        if states is None:
            s_dt, fp8w = param_storage(p_dt, zero, dp * cp, self.options)
            per_full, per_local, gather = state_factors(zero, s_dt, g_dt, o_dt, p_dt)
            n_dense, n_exp = self._shards(tp, cp, dp, ep, zero, dp_shard, etp)
            cache = fp8_cache_bytes(p_dt)
            # FP8 weights (fp8_weights): the quantised copies are the linear weights, no bf16 beside them
            bf16_lin = weight_bytes(p_dt) if fp8w else 0.0
            states = self._states[key] = [
                per_full * (pd + pe) + per_local * (pd / n_dense + pe / n_exp) + gather * layer
                + cache * (lin if zero < 3 else layer)  # FSDP caches only the gathered layer's quantised copy
                - bf16_lin * lin
                for _, _, _, pd, pe, layer, lin, _ in self.stage_params(tp, pp, ep, etp, v)
            ]
        return states

    @staticmethod
    def _shards(tp: int, cp: int, dp: int, ep: int, zero: int, dp_shard: int, etp: int) -> tuple[int, int]:
        """Ranks dense and expert ZeRO state is sharded over: dp_shard x cp, and the expert-data-
        parallel ranks among them (tp x cp x shard / (etp x ep))."""
        if not zero:
            return 1, 1
        shard = dp_shard or dp
        return shard * cp, max(1, shard * cp * tp // (etp * ep))

    def states_floor(self, tp: int, cp: int, pp: int, dp: int, ep: int, zero: int, dp_shard: int,
                     p_dt: str, g_dt: str, o_dt: str, etp: int = 0, v: int = 1, held: bool = False) -> float:
        """Model states of the fullest stage plus the runtime reserve: no micro-batching or
        schedule can bring a layout below this (``held``: ``holds_layers``, which reads the
        pipeline's size only)."""
        etp = etp or tp
        held = held and zero == 3
        key = (tp, cp, pp, dp, ep, zero, dp_shard, v, p_dt, g_dt, o_dt, etp, held)  # the hot path's slice + held
        floor = self._floors.get(key)
        if floor is None:
            states = self.stage_states(tp, cp, pp, dp, ep, zero, dp_shard, p_dt, g_dt, o_dt, etp, v, held)
            edp = max(1, tp * cp * dp // (etp * ep))
            floor = self._floors[key] = reserved_bytes(tp, cp, pp, dp, ep, edp if ep > 1 else 1) + max(states)
        return floor


    def _dp_entry(self, prof: dict, cand: tuple) -> dict:
        """Model states per stage for one (profile, ZeRO, dtypes): constant across schedules, so
        cached in the profile; the data-parallel traffic is added by ``_dp_comm`` when needed."""
        pk = prof["key"]
        held = self.holds_layers(cand.zero, cand.pp)
        gathers = fsdp_layer_gathers(cand.pp, cand.schedule, prof["n_mb"]) if held else 0
        states, top_states, reserved, bucket = self.dp_static(pk[:5], pk[8], pk[9], cand.zero, cand.dp_shard,
                                                              cand.param_dtype, cand.grad_dtype, cand.optim_dtype, held)
        buffers = prof["buffers"] + bucket
        base = buffers * self._growth + reserved
        return {
            "states": states,
            "buffers": buffers,
            "reserved": reserved,
            "base_bytes": base,
            "floor_bytes": top_states + base,
            "exposed_s": None,
            "held": held,
            "layer_gathers": gathers,
        }

    @staticmethod
    def holds_layers(zero: int, pp: int) -> bool:
        """ZeRO-3 under a pipeline, any schedule (spec/support.py ``fsdp_holds_gradients``: torch's
        pipeline stage turns FSDP's gradient sync and its reshard after backward off until the step's
        ``perform_reduce_grad``): the stage's gradients held unsharded and its layers and root unit
        gathered (``held_layer_bytes``), one reduce-scatter a step per unit, each layer gathered
        ``fsdp_layer_gathers`` times a step (``_dp_comm``)."""
        return zero == 3 and fsdp_holds_gradients(pp)

    @staticmethod
    def fsdp_mode(zero: int, pp: int, schedule: str) -> int:
        """What of a schedule the DP entry depends on (its cache key's third item): 0 FSDP's
        gradients not held (or no ZeRO-3), 1 held with the layers resharded after forward
        (``m + 1`` gathers a step), 2 held with the layers kept gathered (zero-bubble: one)."""
        if zero != 3 or not fsdp_holds_gradients(pp):
            return 0
        return 1 if fsdp_reshards_after_forward(pp, schedule) else 2

    def dp_static(self, mesh: tuple, etp: int, v: int, zero: int, dp_shard: int, p_dt: str, g_dt: str,
                  o_dt: str, held: bool = False) -> tuple:
        """The part of a DP entry (``_dp_entry``) that depends on the mesh ``(tp, cp, pp, dp, ep)``,
        ZeRO and dtypes only, not the micro-batching: (states per stage, the largest, the
        runtime reserve, the gradient buckets); buffers and floor are ``_dp_entry``'s sums of these."""
        held = held and zero == 3
        skey = (mesh, etp, v, zero, dp_shard, p_dt, g_dt, o_dt, held)
        static = self._dp_static.get(skey)
        if static is None:
            tp, cp, pp, dp, ep = mesh
            states = self.stage_states(tp, cp, pp, dp, ep, zero, dp_shard, p_dt, g_dt, o_dt, etp, v, held)
            reserved = reserved_bytes(tp, cp, pp, dp, ep, max(1, tp * cp * dp // (etp * ep)) if ep > 1 else 1)
            static = self._dp_static[skey] = (states, max(states), reserved, DP_BUCKET_BYTES if dp * cp > 1 else 0.0)
        return static

    def state_parts(self, prof: dict, cand: tuple, kind: str) -> dict[str, float]:
        """Weights, gradients, optimiser states and ZeRO-3 gather buffers of one stage, bytes."""
        return self._parts(prof["stages"][kind], self.full_candidate(cand), *prof["key"][:5], prof["key"][8])

    def rank_state_parts(self, cand: tuple, pp_rank: int) -> dict[str, float]:
        """``state_parts`` of pipeline rank ``pp_rank`` itself, whatever the runtime's split gives
        it (a middle rank may hold fewer layers than the fullest one the search prices)."""
        cand = self.full_candidate(cand)
        tp, cp, pp, dp, ep = cand[:5]
        v, etp = cand.virtual_stages, cand.etp
        nls, n_moe = self.holdings(pp, v)[pp_rank]
        row = stage_row(self, stage_kind(pp_rank, pp), pp_rank, nls, n_moe, tp, pp, ep, etp)
        st = {"params_dense": row[3], "params_expert": row[4], "layer_params": row[5], "linear_params": row[6],
              "layers": nls, "moe_layers": n_moe}
        return self._parts(st, cand, tp, cp, pp, dp, ep, etp)

    def _parts(self, st: dict, cand: Candidate, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int) -> dict[str, float]:
        zero, dp_shard = cand.zero, cand.dp_shard
        held = 0.0
        if self.holds_layers(zero, pp):  # the stage's gradients unsharded, its units gathered
            row = (None, None, st["moe_layers"], st["params_dense"], None, st["layer_params"], None, st["layers"])
            held = held_layer_bytes(self, row, tp, ep, etp, cand.param_dtype, cand.grad_dtype)
        s_dt, fp8w = param_storage(cand.param_dtype, zero, dp * cp, self.options)
        pb, gb = weight_bytes(s_dt), DTYPE_BYTES[cand.grad_dtype]
        ob = optimizer_bytes_per_param(s_dt, cand.optim_dtype)
        cb = weight_bytes(cand.param_dtype)  # a ZeRO-3 layer is gathered in the compute dtype
        n_dense, n_exp = self._shards(tp, cp, dp, ep, zero, dp_shard, etp)
        pd, pe = st["params_dense"], st["params_expert"]
        full, local = pd + pe, pd / n_dense + pe / n_exp
        cache = fp8_cache_bytes(cand.param_dtype)
        bf16_lin = cb if fp8w else 0.0
        return {
            "weights": pb * (full if zero < 3 else local) - bf16_lin * st["linear_params"],
            "gradients": gb * (full if zero < 2 else local),
            "optimizer_states": ob * (full if zero == 0 else local),
            "zero3_gather_buffers": (2 * cb + gb) * st["layer_params"] + held if zero == 3 else 0.0,
            "fp8_weight_cache": cache * (st["linear_params"] if zero < 3 else st["layer_params"]),
        }

    def _dp_comm(self, prof: dict, d: dict, cand: tuple) -> None:
        """Exposed data-parallel time and optimiser time of one (profile, ZeRO, dtypes), into ``d``:
        the traffic (``_dp_traffic``) set against this profile's compute windows."""
        o = self.options
        slow, n_mb = prof["slow"], prof["n_mb"]
        r = dp_traffic(self, prof, cand)
        win_b = slow["bwd_s"] if o.overlap_grad_reduce else 0.0
        win_f = slow["fwd_s"] if o.overlap_param_gather else 0.0
        if d["held"]:
            # the root gathered once and the layers' first pass behind the first forward (the first
            # layer's exposed), each further pass of the layers (one a micro-batch: the backward after
            # a forward finds them resharded) behind a backward, one reduce-scatter a unit after the
            # last backward (spec/support.py fsdp_holds_gradients, fsdp_layer_gathers)
            g = d["layer_gathers"]
            exposed = (max(0.0, r["gather_s"] - slow["fwd_s"]) + r["first_gather_s"]
                       + (g - 1) * (max(0.0, r["layer_gather_s"] - slow["bwd_s"]) + r["first_gather_s"])
                       + max(0.0, r["reduce_s"] - slow["bwd_s"]) + max(0.0, r["replica_s"] - win_b))
            total = r["gather_s"] + (g - 1) * r["layer_gather_s"] + r["reduce_s"] + r["replica_s"]
            nbytes = r["held_bytes"] + (g - 1) * r["layer_gather_bytes"] + r["step_bytes"]
            nic = r["held_nic"] + (g - 1) * r["layer_gather_nic"] + r["step_nic"]
        elif cand.zero == 3:
            per_mb = r["per_mb_s"]
            # the first layer's gather cannot be prefetched; the rest hides behind the micro-batch's compute
            exposed = n_mb * (max(0.0, per_mb - (slow["fwd_s"] + slow["bwd_s"])) + r["first_gather_s"])
            exposed += max(0.0, r["replica_s"] - win_b)
            total = n_mb * per_mb + r["replica_s"]
            nbytes, nic = n_mb * r["per_mb_bytes"] + r["step_bytes"], n_mb * r["per_mb_nic"] + r["step_nic"]
        elif cand.zero == 2:
            # a gradient reduce-scatter per micro-batch (only the shard is kept), each behind its backward
            exposed = n_mb * max(0.0, r["reduce_s"] - win_b) + max(0.0, r["gather_s"] - win_f)
            total = n_mb * r["reduce_s"] + r["gather_s"]
            nbytes, nic = n_mb * r["per_mb_bytes"] + r["step_bytes"], n_mb * r["per_mb_nic"] + r["step_nic"]
        else:
            exposed = max(0.0, r["reduce_s"] - win_b) + max(0.0, r["gather_s"] - win_f)
            total = r["reduce_s"] + r["gather_s"]
            nbytes, nic = r["step_bytes"], r["step_nic"]
        exposed += comm.OVERLAP_COMPUTE_COST * max(0.0, total - exposed)  # hidden traffic still slows compute
        d.update(
            exposed_s=exposed + r["tied_s"] + r["optimizer_s"],
            optimizer_s=r["optimizer_s"],
            total_s=total + r["tied_s"],
            bytes=nbytes,
            nic=nic,
            tier=r["tier"],
        )

    # --- the two halves of one layout's screen, shared by _evaluate and the train goal's sweep --------
    def peak_bytes(self, prof: dict, d: dict, schedule: str, pp: int, n_mb: int, v: int) -> tuple:
        """(peak bytes, its stage kind, its micro-batches in flight) of the worst device: every
        stage kind's states + activations in flight + buffers, keep the largest."""
        peak, worst, worst_inflight = -1.0, None, 0.0
        base = d["base_bytes"]
        growth = self._growth
        simple = schedule == "1f1b" or schedule == "zero-bubble"  # inlined in_flight_microbatches
        for (kind, index, act_mb, fixed), states in zip(prof["rows"], d["states"]):
            if simple:
                inflight = pp - index if pp - index < n_mb else n_mb
            else:
                inflight = in_flight_microbatches(schedule, pp, n_mb, v, index)
            total = states + (inflight * act_mb + fixed) * growth + base
            if total > peak:
                peak, worst, worst_inflight = total, kind, inflight
        return peak, worst, worst_inflight

    def step_base(self, t_mb: float, p2p_s: float, schedule: str, pp: int, n_mb: int, v: int) -> tuple:
        """(bubble units, exposed pipeline sends, all pipeline sends, step seconds without the
        data-parallel part): the step is ``step_base + d["exposed_s"]``, and ``exposed_s >= 0``,
        so ``prof["tokens"] / step_base`` bounds the tokens/s from above (in floating point too:
        adding a non-negative number never lowers a sum, dividing by a larger one never raises a
        quotient). ``t_mb`` and ``p2p_s``: the profile's."""
        idle = bubble_time_units(schedule, pp, v) if pp > 1 else 0.0
        p2p_total = p2p = 0.0
        if pp > 1:
            p2p_total = p2p = 2.0 * (n_mb * v + pp - 1) * p2p_s
            if v > 1 and self.options.overlap_p2p:
                # Megatron-Core overlaps the interleaved schedule's sends with compute; only the
                # warm-up and cool-down sends stay on the critical path
                edge = 2.0 * (pp - 1) * p2p_s
                p2p = edge + comm.OVERLAP_COMPUTE_COST * (p2p_total - edge)
        return idle, p2p, p2p_total, (n_mb + idle) * t_mb + p2p

    # --- one layout ------------------------------------------------------------------------------------
    def screen(self, cand: tuple) -> tuple[float, str | None, str | None]:
        """(tokens/s, reject category, reject reason) of a candidate tuple; the search's fast path."""
        return self._evaluate(cand, False)

    def estimate(self, layout: Layout | tuple) -> dict:
        """The estimate JSON of one layout (see commands/plan.py for the field contract)."""
        cand = self.key(layout) if isinstance(layout, Layout) else layout
        return self._evaluate(cand, True)

    def _evaluate(self, cand: Candidate, detail: bool = False):
        if type(cand) is not Candidate or not cand.etp:
            cand = self.full_candidate(cand)
        # unpacked once: this is the search's hot path (slices of the tuple key the caches below)
        tp, cp, pp, dp, ep, mbs, sp, recompute, zero, dp_shard, schedule, v = cand[:12]
        etp = cand.etp
        held = zero == 3 and fsdp_holds_gradients(pp)  # holds_layers, inlined
        if not detail:
            floor = self._floors.get(cand[:5] + cand[8:10] + cand[11:16] + (held,))
            if floor is None:
                floor = self.states_floor(tp, cp, pp, dp, ep, zero, dp_shard, *cand[12:16], v, held)
            if floor > self.capacity:
                # hopeless whatever the micro-batching; rank such layouts by how close they come to fitting
                return -floor, STATES_DO_NOT_FIT, None
        pkey = cand[:8]
        dtype = cand.param_dtype
        if dtype == "fp8" and cand.fp8_scaling == "current":  # compute_key, inlined on the search's hot path
            dtype = "fp8cs"
        if pkey == self._last_pkey and dtype == self._last_dtype and etp == self._last_etp and v == self._last_v:
            prof = self._last_prof
        else:
            prof = self.profile(tp, cp, pp, dp, ep, mbs, sp, recompute, self.seq, dtype, etp, v)
            self._last_pkey, self._last_prof, self._last_dtype, self._last_etp = pkey, prof, dtype, etp
            self._last_v = v
        dkey = (zero, dp_shard, self.fsdp_mode(zero, pp, schedule) if held else 0) + cand[12:]
        d = prof["dp"].get(dkey)
        if d is None:
            d = prof["dp"][dkey] = self._dp_entry(prof, cand)
        if not detail and d["floor_bytes"] > self.capacity:
            # no schedule brings this below capacity: one micro-batch's buffers already overflow
            return -d["floor_bytes"], ACTIVATIONS_DO_NOT_FIT, None
        if d["exposed_s"] is None:
            self._dp_comm(prof, d, cand)
        n_mb = prof["n_mb"]

        peak, worst, worst_inflight = self.peak_bytes(prof, d, schedule, pp, n_mb, v)
        fits = peak <= self.capacity
        idle, p2p, p2p_total, step_base = self.step_base(prof["t_mb"], prof["p2p_s"], schedule, pp, n_mb, v)
        step = step_base + d["exposed_s"]
        tokens_per_s = prof["tokens"] / step
        if not detail:
            if fits:
                return tokens_per_s, None, None
            return tokens_per_s, ACTIVATIONS_DO_NOT_FIT, None

        self._complete(prof)
        t_mb = prof["t_mb"]
        return build_report(
            self, cand, prof, d, peak=peak, worst=worst, inflight=worst_inflight, fits=fits, n_mb=n_mb,
            idle=idle, t_mb=t_mb, p2p=p2p, p2p_total=p2p_total, step=step, tokens_per_s=tokens_per_s,
        )
