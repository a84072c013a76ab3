"""Model states and data-parallel traffic: bytes per parameter by ZeRO stage, the stated memory
margins, and the data-parallel collectives of one mesh.

Usage::

    from modelcarve.plan.train.states import model_state_bytes_per_param
    model_state_bytes_per_param(zero=1, n=64)     # 4 + 12/64 bytes for bf16 + fp32 Adam

Mixed-precision Adam keeps bf16/fp16 weights (2 bytes), gradients in ``grad_dtype`` (Megatron's
fp32 main gradients: 4; the ZeRO paper's fp16: 2) and fp32 master weights and two moments (12):
Rajbhandari et al. 2020's 16 bytes per parameter, 4 + 12/N with ZeRO-1, 2 + 14/N with ZeRO-2,
16/N with ZeRO-3, ``N`` the ranks the state is sharded over (dp x cp; for experts, the
expert-data-parallel group).

FP8 training (``param_dtype`` fp8 / mxfp8, as Transformer Engine under Megatron-Core runs it
without ``--fp8-param-gather``): the weights stay bf16 (2 bytes), master weights and moments
fp32 (12), and every linear layer's weight is also cached quantised for the micro-batches of a
step (TE's weight workspaces, ``is_first_microbatch``): ``FP8_WEIGHT_CACHE_BYTES`` per linear
parameter, row-wise and column-wise copies (the forward GEMM reads W, the data-gradient GEMM
W^T; on Hopper FP8 GEMMs take only the TN layout, on Blackwell MXFP8 scales run along one
direction).

Runtime memory that is no tensor of the model (``reserved_bytes``), explicit: the CUDA context
(``CUDA_CONTEXT_BYTES``), cuBLAS / Transformer Engine workspaces (``WORKSPACE_BYTES``) and
NCCL's buffers, ``NCCL_BYTES_PER_COMM`` per communicator the layout opens (one per parallel
axis larger than 1; the pipeline's two neighbours count as two). The caching allocator's
fragmentation is ``FRAGMENTATION`` of the activations and transient buffers (model states are
allocated once and do not fragment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.cost import comm
from modelcarve.plan.cost.efficiency import memory_bound_time_s
from modelcarve.spec.layout import DTYPE_BYTES

if TYPE_CHECKING:
    from modelcarve.plan.train.protocol import TrainCost

GIB = 2**30
MIB = 2**20
CUDA_CONTEXT_BYTES = 600 * MIB
"""CUDA context with lazily loaded kernels (CUDA 12, PyTorch + TE): what nvidia-smi shows for an
idle process on H100 (500-600 MiB); stated, not fitted."""
WORKSPACE_BYTES = 256 * MIB
"""cuBLAS(Lt) and Transformer Engine GEMM workspaces (32 MiB per stream and handle, several
streams for communication overlap)."""
NCCL_BYTES_PER_COMM = 128 * MIB
"""One NCCL communicator's buffers: NCCL_BUFFSIZE (4 MiB, the default) per channel and
direction, 16 channels on NVLink (NCCL docs, NCCL_BUFFSIZE / NCCL_MIN_NCHANNELS)."""
RESERVED_BYTES = CUDA_CONTEXT_BYTES + WORKSPACE_BYTES + 4 * NCCL_BYTES_PER_COMM
"""Runtime reserve of a typical 3-D layout (four communicators); ``reserved_bytes`` counts them."""
FRAGMENTATION = 0.05
"""Caching-allocator fragmentation, as a fraction of activations and buffers (a stated margin:
PyTorch's allocator reserves 3-10% above allocated on training steps; expandable segments keep
it near the low end)."""
FRAGMENTATION_FIXED_SEGMENTS = 0.20
"""The same overhead with PyTorch's default allocator (fixed segments, eager kernels): fitted to
torchtitan's published reserved memory of Llama 3.1 8B with FSDP and op-level SAC on 8 H100 (82.4
GiB, benchmarks/llama3_h100_202412_torchtitan.md Table 1); its other rows are the check. Chosen
when those rows were priced with Megatron's parameters (-2.6% on that row); with FSDP2's own
(``param_policy="torch"``, 1.87 GiB less) -4.9%, kept rather than refitted to one row."""
MEMORY_HEADROOM = 0.05
"""Default fraction of device memory a planned layout must leave free (``--memory-headroom``):
winners are not placed at 97-99% of memory, where a longer sequence or a driver update OOMs."""
FP8_WEIGHT_CACHE_BYTES = 2.0
"""Bytes per linear-layer parameter of the quantised weight copies TE keeps for a step (fp8
row-wise + column-wise; MX scales add 1/32 each, counted in ``fp8_cache_bytes``)."""
FP8_DTYPES = ("fp8", "mxfp8")


def fp8_cache_bytes(param_dtype: str) -> float:
    """Quantised-weight workspace bytes per linear-layer parameter for ``param_dtype``."""
    if param_dtype == "fp8":
        return FP8_WEIGHT_CACHE_BYTES
    if param_dtype == "mxfp8":
        return FP8_WEIGHT_CACHE_BYTES * (1.0 + 1.0 / 32.0)
    return 0.0


def weight_bytes(param_dtype: str) -> float:
    """Bytes per stored weight: FP8 training keeps its weights in bf16."""
    return 2.0 if param_dtype in FP8_DTYPES else DTYPE_BYTES[param_dtype]


PARAM_POLICIES = ("megatron", "torch", "modelcarve")
"""Who holds the parameters how (TrainOptions.param_policy): 'megatron' (Megatron-LM / Megatron-Bridge,
DeepSpeed: bf16 weights, an fp32 master copy in the optimizer); 'torch' (torchtitan and torch-native
trainers: FSDP2's MixedPrecisionPolicy or DDP under autocast keep fp32 parameters, which are their own
master, and compute in bf16: 4 + 4 + 8 bytes a parameter); 'modelcarve' (this project's runtime:
spec/support.held_param_dtype, bf16 + master only under its distributed optimizer)."""


def stored_param_dtype(param_dtype: str, zero: int, replicas: int, policy: str) -> str:
    """The dtype a layout's parameters are stored in under ``policy`` (``PARAM_POLICIES``):
    ``param_dtype`` itself (FP8: bf16 weights, ``weight_bytes``), or fp32 where the parameters are
    their own master copy: every torch-native layout, FP8 ones too (torchao's float8 linears cast
    fp32 parameters each forward; its FP8 all-gather is not modelled), and the runtime's by its rule."""
    if param_dtype == "fp32" or policy == "megatron":
        return param_dtype
    if policy == "torch":
        return "fp32"
    if param_dtype not in ("bf16", "fp16"):
        return param_dtype
    from modelcarve.spec.support import held_dtype_of

    return held_dtype_of(param_dtype, zero, replicas)


def fp8_weights(param_dtype: str, zero: int, fp8_param_gather: bool, policy: str = "megatron") -> bool:
    """Whether the linear layers' weights are held as FP8 tensors with no bf16 copy: an FP8
    ``param_dtype`` under Megatron's ``--fp8-param-gather`` (TrainOptions.fp8_param_gather) with
    whole weights (ZeRO 0-2: the distributed optimizer). Each linear weight then takes its
    row- and column-wise quantised copies (``fp8_cache_bytes``, the weight cache's size) instead of
    2 B of bf16 plus the cache. Megatron-FSDP's FP8 shards (ZeRO-3) are not modelled: priced as
    bf16 shards plus the gathered layer's cache. Megatron's flag: under another ``policy`` (fp32
    parameters of their own) it changes nothing."""
    return fp8_param_gather and param_dtype in FP8_DTYPES and zero < 3 and policy == "megatron"


def param_storage(param_dtype: str, zero: int, replicas: int, options) -> tuple[str, bool]:
    """(``stored_param_dtype``, ``fp8_weights``) of a layout under ``options``' ``param_policy`` and
    ``fp8_param_gather`` (a TrainOptions; ``replicas``: dp x cp): the pair every state figure reads
    (the states, their parts, the data-parallel traffic and estimate's rule words)."""
    policy = options.param_policy
    return (stored_param_dtype(param_dtype, zero, replicas, policy),
            fp8_weights(param_dtype, zero, options.fp8_param_gather, policy))


def gathered_param_bytes(param_dtype: str, fp8_params: bool) -> float:
    """Bytes a parameter all-gather of the distributed optimizer moves per linear parameter:
    bf16 (2), or under FP8 weights the FP8 data (1 B, per-tensor scaling); MXFP8's block scales
    run along one direction, so Megatron all-gathers bf16 into the gradient buffer and quantises
    after (Megatron-Bridge ``reuse_grad_buf_for_mxfp8_param_ag``): 2."""
    if fp8_params and param_dtype == "fp8":
        return 1.0
    return weight_bytes(param_dtype)


def reserved_bytes(tp: int, cp: int, pp: int, dp: int, ep: int, edp: int) -> float:
    """Runtime memory outside the model's tensors for a layout's communicators (module doc)."""
    comms = sum(1 for n in (tp, cp, dp, ep, edp) if n > 1) + (2 if pp > 1 else 0)
    return CUDA_CONTEXT_BYTES + WORKSPACE_BYTES + NCCL_BYTES_PER_COMM * comms
DP_BUCKET_BYTES = 2 * 40e6
"""Gradient-reduction buckets in flight (two of Megatron's 40 MB buckets)."""


def state_factors(zero: int, p_dt: str, g_dt: str, o_dt: str, compute_dt: str | None = None) -> tuple[float, float, float]:
    """Bytes per parameter held in full, bytes per parameter sharded over the ZeRO group, and
    bytes per parameter of one layer gathered in full (ZeRO-3), for ZeRO stage ``zero``; ``p_dt``
    the stored dtype, ``compute_dt`` the one a ZeRO-3 layer is gathered in (default ``p_dt``)."""
    pb, gb = weight_bytes(p_dt), DTYPE_BYTES[g_dt]
    ob = optimizer_bytes_per_param(p_dt, o_dt)
    if zero == 0:
        return pb + gb + ob, 0.0, 0.0
    if zero == 1:
        return pb + gb, ob, 0.0
    if zero == 2:
        return pb, gb + ob, 0.0
    return 0.0, pb + gb + ob, 2 * weight_bytes(compute_dt or p_dt) + gb


def optimizer_bytes_per_param(param_dtype: str = "bf16", optim_dtype: str = "fp32") -> float:
    """Adam state per parameter: two moments, plus a master copy when it differs from the
    compute dtype (mixed precision: 4 + 4 + 4 = 12 bytes)."""
    o = DTYPE_BYTES[optim_dtype]
    return 2 * o + (0.0 if param_dtype == optim_dtype else o)  # fp8 compute: an fp32 master copy


def model_state_bytes_per_param(zero: int, n: int, param_dtype: str = "bf16", grad_dtype: str = "bf16",
                                optim_dtype: str = "fp32") -> float:
    """Bytes per parameter of weights + gradients + Adam state with ZeRO stage ``zero`` over
    ``n`` ranks (Rajbhandari et al. 2020: 16, 4 + 12/N, 2 + 14/N, 16/N for fp16 mixed precision)."""
    p, g, o = weight_bytes(param_dtype), DTYPE_BYTES[grad_dtype], optimizer_bytes_per_param(param_dtype, optim_dtype)
    if zero == 0:
        return p + g + o
    if zero == 1:
        return p + g + o / n
    if zero == 2:
        return p + (g + o) / n
    return (p + g + o) / n


def dp_traffic(cost: "TrainCost", prof: dict, cand: tuple) -> dict:
    """Data-parallel collectives of the stage with the most parameters: seconds and bytes
    (per step, or per micro-batch for ZeRO-3; ZeRO-3 under a pipeline, whose gradients torch holds
    to the step's end: ``gather_s`` every unit once, ``reduce_s``, ``held_bytes`` once a step, and
    ``layer_gather_s`` / ``_bytes`` / ``_nic`` the decoder layers' pass alone, repeated
    ``fsdp_layer_gathers - 1`` times). Depends only on the mesh, ZeRO and dtypes, so
    it is shared by every micro-batch size and recomputation mode. The cache key holds the
    fullest stage's parameters and layers too: virtual-stage counts that split the layers
    differently give another fullest stage, so the answer never depends on which was priced first."""
    tp, cp, pp, dp, ep = prof["key"][:5]
    etp = prof["key"][8]
    zero, dp_shard = cand.zero, cand.dp_shard
    p_dt, g_dt, o_dt = cand.param_dtype, cand.grad_dtype, cand.optim_dtype
    big = max(prof["stages"].values(), key=lambda st: st["params_dense"] + st["params_expert"])
    pd, pe = big["params_dense"], big["params_expert"]
    key = (tp, cp, pp, dp, ep, zero, dp_shard, etp, p_dt, g_dt, o_dt, pd, pe, big["layers"], big["moe_layers"])
    cached = cost._traffic.get(key)
    if cached is not None:
        return cached
    s_dt, fp8w = param_storage(p_dt, zero, dp * cp, cost.options)  # the options are the cost model's, as the cache
    pb, gb = weight_bytes(p_dt), DTYPE_BYTES[g_dt]  # pb: the compute dtype, what ZeRO-3 gathers
    sb, ob = weight_bytes(s_dt), optimizer_bytes_per_param(s_dt, o_dt)  # as stored (ZeRO-1/2 gather that)
    shard = (dp_shard or dp) if zero else 1
    n_dense = shard * cp if zero else 1
    # expert mesh ETP x EP x EDP over the same ranks as TP x CP x DP (MoE parallel folding)
    edp = max(1, tp * dp * cp // (etp * ep))
    n_exp = max(1, shard * cp * tp // (etp * ep)) if zero else 1
    dense_t = cost.tier(dp * cp, tp)
    exp_t = cost.tier(edp, etp * ep)
    r = {"tier": dense_t.name, "reduce_s": 0.0, "gather_s": 0.0, "per_mb_s": 0.0, "first_gather_s": 0.0,
         "replica_s": 0.0, "per_mb_bytes": 0.0, "per_mb_nic": 0.0, "step_bytes": 0.0, "step_nic": 0.0}
    if zero == 0:
        r["reduce_s"] = comm.all_reduce_s(gb * pd, dp * cp, dense_t) + comm.all_reduce_s(gb * pe, edp, exp_t)
        b1, b2 = comm.ring_all_reduce_bytes(gb * pd, dp * cp), comm.ring_all_reduce_bytes(gb * pe, edp)
        r["step_bytes"], r["step_nic"] = b1 + b2, comm.nic_bytes(b1, dense_t) + comm.nic_bytes(b2, exp_t)
    elif zero in (1, 2):
        r["reduce_s"] = comm.reduce_scatter_s(gb * pd, dp * cp, dense_t) + comm.reduce_scatter_s(gb * pe, edp, exp_t)
        # the parameter all-gather: bf16, or the FP8 data of FP8 weights (gathered_param_bytes)
        gq = gathered_param_bytes(s_dt, fp8w)
        gd = sb * pd - (sb - gq) * (big["linear_params"] - pe)  # the dense stage's linear weights at gq
        ge = gq * pe
        r["gather_s"] = comm.all_gather_s(gd, dp * cp, dense_t) + comm.all_gather_s(ge, edp, exp_t)
        rs1, rs2 = comm.reduce_scatter_bytes(gb * pd, dp * cp), comm.reduce_scatter_bytes(gb * pe, edp)
        ag1, ag2 = comm.all_gather_bytes(gd, dp * cp), comm.all_gather_bytes(ge, edp)
        reduce_bytes, reduce_nic = rs1 + rs2, comm.nic_bytes(rs1, dense_t) + comm.nic_bytes(rs2, exp_t)
        gather_bytes, gather_nic = ag1 + ag2, comm.nic_bytes(ag1, dense_t) + comm.nic_bytes(ag2, exp_t)
        if zero == 1:
            r["step_bytes"], r["step_nic"] = reduce_bytes + gather_bytes, reduce_nic + gather_nic
        else:
            # ZeRO-2 keeps only its gradient shard, so it reduce-scatters after every micro-batch
            r["per_mb_bytes"], r["per_mb_nic"] = reduce_bytes, reduce_nic
            r["step_bytes"], r["step_nic"] = gather_bytes, gather_nic
    else:
        sd_t = cost.tier(shard * cp, tp)
        r["tier"] = sd_t.name
        se_n = max(1, shard * cp * tp // (etp * ep))
        se_t = cost.tier(se_n, etp * ep)
        # FSDP gathers and reduces layer by layer: one collective's latency per layer each
        nl = max(1, big["layers"])
        # one layer's all-gather and reduce-scatter (dense d, expert e), and the stage's bytes of each
        ag_d, rs_d = comm.all_gather_s(pb * pd / nl, shard * cp, sd_t), comm.reduce_scatter_s(gb * pd / nl, shard * cp, sd_t)
        ag_e, rs_e = comm.all_gather_s(pb * pe / nl, se_n, se_t), comm.reduce_scatter_s(gb * pe / nl, se_n, se_t)
        agb_d, rsb_d = comm.all_gather_bytes(pb * pd, shard * cp), comm.reduce_scatter_bytes(gb * pd, shard * cp)
        agb_e, rsb_e = comm.all_gather_bytes(pb * pe, se_n), comm.reduce_scatter_bytes(gb * pe, se_n)
        per_mb = nl * (2 * ag_d + rs_d + 2 * ag_e + rs_e)
        r["per_mb_s"], r["first_gather_s"] = per_mb, per_mb / (3.0 * nl)
        b1, b2 = 2 * agb_d + rsb_d, 2 * agb_e + rsb_e
        r["per_mb_bytes"], r["per_mb_nic"] = b1 + b2, comm.nic_bytes(b1, sd_t) + comm.nic_bytes(b2, se_t)
        # under a pipeline (spec/support.py fsdp_holds_gradients): each unit all-gathered once and
        # reduce-scattered once a step, layer by layer, and the decoder layers alone (the dense ones
        # less the root unit: embedding, final norm, head) gathered again per fsdp_layer_gathers
        r["gather_s"] = nl * (ag_d + ag_e)
        split, rep, _exp = _layer_sums(cost, big["layers"], big["moe_layers"], ep, etp)
        ld = split / tp + rep
        r["layer_gather_s"] = nl * (comm.all_gather_s(pb * ld / nl, shard * cp, sd_t) + ag_e)
        g1 = comm.all_gather_bytes(pb * ld, shard * cp)
        r["layer_gather_bytes"], r["layer_gather_nic"] = g1 + agb_e, comm.nic_bytes(g1, sd_t) + comm.nic_bytes(agb_e, se_t)
        r["reduce_s"] = nl * (rs_d + rs_e)
        h1, h2 = agb_d + rsb_d, agb_e + rsb_e
        r["held_bytes"], r["held_nic"] = h1 + h2, comm.nic_bytes(h1, sd_t) + comm.nic_bytes(h2, se_t)
        replicas = dp // shard
        if replicas > 1:
            rep_t = cost.tier(replicas, tp * cp * shard)
            local = gb * (pd / (shard * cp) + pe / se_n)
            r["replica_s"] = comm.all_reduce_s(local, replicas, rep_t)
            b3 = comm.ring_all_reduce_bytes(local, replicas)
            r["step_bytes"], r["step_nic"] = b3, comm.nic_bytes(b3, rep_t)
            if rep_t.name == "inter":
                r["tier"] = "inter"
    r["tied_s"] = 0.0
    if pp > 1 and cost.model.tied_embeddings:
        # the first and last stages hold copies of the tied embedding: all-reduce its gradient
        emb_t = cost.tier(2, dp * cp * tp * (pp - 1))
        r["tied_s"] = comm.all_reduce_s(gb * cost.vocab_h / tp, 2, emb_t)
        b4 = comm.ring_all_reduce_bytes(gb * cost.vocab_h / tp, 2)
        r["step_bytes"] += b4
        r["step_nic"] += comm.nic_bytes(b4, emb_t)
    r["optimizer_s"] = memory_bound_time_s(cost.device, (pd / n_dense + pe / n_exp) * (2 * ob + gb + sb))
    cost._traffic[key] = r
    return r


def stage_row(cost: "TrainCost", kind: str, index: int, nls: int, n_moe: int, tp: int, pp: int, ep: int, etp: int) -> tuple:
    """One row of the cost model's ``stage_params``: a pipeline rank holding ``nls`` layers,
    ``n_moe`` of them MoE (and the embedding when ``kind`` is first / only, the final norm and
    head when last / only)."""
    m = cost.model
    n_dense = nls - n_moe
    layer_split, layer_rep, params_exp = _layer_sums(cost, nls, n_moe, ep, etp)
    params_dense = layer_split / tp + layer_rep
    linear = layer_split / tp  # weights of the layers' GEMMs (what FP8 caches quantised)
    if kind in ("first", "only"):
        params_dense += cost.vocab_h / tp + cost.pos
    if kind in ("last", "only"):
        params_dense += cost.final_norm
        if not m.tied_embeddings or pp > 1:
            params_dense += cost.vocab_h / tp
        # each MTP depth's input projection (2h -> h, column-parallel) and its three norms (hidden,
        # embedding, and the depth's final one); its decoder layer is counted in nls
        params_dense += cost.options.mtp_layers * (2.0 * m.hidden_size * m.hidden_size / tp + 3.0 * cost.final_norm)
    layer = (cost.dense_split if n_dense else cost.moe_split) / tp + ((cost.moe_experts / (ep * etp)) if n_moe else 0.0)
    return (kind, index, n_moe, params_dense, params_exp, layer, linear + params_exp, nls)


def _layer_sums(cost: "TrainCost", nls: int, n_moe: int, ep: int, etp: int) -> tuple[float, float, float]:
    """Of ``nls`` decoder layers, ``n_moe`` of them MoE: (parameters TP splits, before the split;
    parameters replicated over TP; expert parameters of one device)."""
    n_dense = nls - n_moe
    return (n_dense * cost.dense_split + n_moe * cost.moe_split, n_dense * cost.layer_rep + n_moe * cost.moe_rep,
            n_moe * cost.moe_experts / (ep * etp))


def held_layer_bytes(cost: "TrainCost", row: tuple, tp: int, ep: int, etp: int, p_dt: str, g_dt: str) -> float:
    """Bytes ZeRO-3 holds beyond its two-unit window on a stage (``stage_row``'s ``row``) under a
    pipeline (spec/support.py ``fsdp_holds_gradients``, every schedule): torch's pipeline stage
    turns FSDP's gradient sync and its reshard after backward off for every backward and
    reduce-scatters once, after the last (``perform_reduce_grad``), so every unit's unsharded
    gradient (``g_dt``) accumulates from its first backward to the step's end, every decoder layer
    stays gathered (``weight_bytes(p_dt)``) from a backward to its next forward (zero-bubble: from
    its first forward, ``fsdp_reshards_after_forward``) and the root unit (embedding, final norm,
    head: the stage's dense parameters beyond its layers; FSDP2's root, not resharded after forward)
    from its first forward. So all of them, gathered and with their gradients, less what
    ``state_factors``' gather term already counts for one layer (two gathered, one gradient); never
    below it. Added to the states, so beside the peak micro-batches in flight: exact where the
    layers stay gathered (zero-bubble), and where a forward reshards them at most one micro-batch's
    activations of the stage high (the layers are gathered from a backward to the next forward)."""
    split, rep, exp = _layer_sums(cost, row[7], row[2], ep, etp)
    pb, gb = weight_bytes(p_dt), DTYPE_BYTES[g_dt]
    root = row[3] - (split / tp + rep)
    return max(0.0, (pb + gb) * (split / tp + rep + exp + root) - (2.0 * pb + gb) * row[5])
