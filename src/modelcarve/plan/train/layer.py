"""One transformer layer's cost for one micro-batch on one device: compute time, per-axis
communication (seconds and bytes), and the activation bytes it keeps.

Usage (through the cost model, which caches one result per shape)::

    layer = layer_cost(cost_model, moe=False, tp=8, cp=1, ep=1, mbs=1, sp=True, recompute="selective", seq=2048)
    layer["compute_s"], layer["tp_s"], layer["act_bytes"]

Compute: every GEMM at ``matmul_efficiency`` of its per-device shape, element-wise work (norms,
residual adds, dropout, rotary, activation functions, MoE permutation; the softmax of
materialised attention) at HBM speed; backward twice the forward (flash attention 2.5x);
recomputation adds the forward (full) or the attention core (selective). Communication: TP two
all-reduces of ``2 T h`` bytes each way (+2 for a full recompute), CP's ring exchange of K/V
hidden behind the attention core, EP's dispatch and combine all-to-alls scaled by the
load-imbalance factor. Activations: plan/cost/activations.py.

FP8 (compute key ``fp8``, ``fp8cs``, ``mxfp8``): the linear layers' GEMMs (QKV, projection, MLP,
experts) run at the device's FP8 peak (plan/cost/efficiency.py, with its FP8 fraction); the attention
core, the router and the LM head stay bf16, as in Transformer Engine recipes; each linear
layer's input is quantised in the forward and its output gradient in the backward, at HBM
speed (``quantise_bytes``). Weight casts happen once per step (cached) and are not charged.

Expert tensor parallelism ``etp`` (MoE parallel folding): a local expert's GEMMs are split
``etp`` ways and see the tokens of ``etp`` TP ranks: ``T k etp ep / (t E)`` tokens per local
expert; the all-to-all runs over EP ranks ``etp`` apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.cost import comm, efficiency
from modelcarve.plan.cost.activations import ACT_BYTES, kv_heads_per_rank, layer_activation_terms
from modelcarve.plan.cost.efficiency import memory_bound_time_s
from modelcarve.plan.cost.unfused import NONE, unfused_bytes
from modelcarve.spec.layout import recompute_modules

if TYPE_CHECKING:
    from modelcarve.plan.train.protocol import TrainCost

FLASH_EFFICIENCY = 0.85
"""Flash attention's throughput relative to a plain GEMM of the same shape (FlashAttention-2
reaches about 70% of A100 peak forward, a large GEMM about 80%)."""
FLASH_BACKWARD = 2.5
"""Flash attention's backward costs 2.5 forwards (it recomputes the scores: 5 matmuls vs 2)."""


def layer_cost(cost: "TrainCost", moe: bool, tp: int, cp: int, ep: int, mbs: int, sp: bool, recompute: str, seq: int,
               etp: int = 0, base: dict | None = None) -> dict:
    """Times (s) and bytes of one layer for one micro-batch on one device (``etp``: expert TP, 0 = tp).

    ``base``: ``layer_base(cost, moe, tp, cp, ep, mbs, sp, seq, etp)`` at the same compute dtype,
    when the caller keeps it (the cost model shares one across the recomputation modes: nothing in
    it reads ``recompute``, so the result is the same to the last bit as without it)."""
    if base is None:
        base = layer_base(cost, moe, tp, cp, ep, mbs, sp, seq, etp)
    return _layer_finish(cost, base, recompute)


def layer_base(cost: "TrainCost", moe: bool, tp: int, cp: int, ep: int, mbs: int, sp: bool, seq: int,
               etp: int = 0) -> dict:
    """The part of ``layer_cost`` no recomputation mode changes (GEMMs, element-wise work,
    communication per collective), for the compute dtype ``cost._dtype``."""
    m, o, dev = cost.model, cost.options, cost.device
    etp = etp or tp
    h = m.hidden_size
    T = mbs * seq / cp
    s_loc = seq / cp
    heads = m.num_heads / tp
    dqk, dv = m.qk_head_dim, m.attn_v_head_dim
    kvl = kv_heads_per_rank(m, tp)
    rep = tp if sp else 1
    kept = getattr(cost, "_layer_gemms", None)  # the GEMMs do not read sp: kept by the cost model per the rest
    gkey = (moe, tp, cp, ep, mbs, seq, cost._dtype, etp)
    gemms = kept.get(gkey) if kept is not None else None
    if gemms is None:
        gemms = _gemms(cost, moe, tp, cp, ep, mbs, seq, etp)
        if kept is not None:
            kept[gkey] = gemms
    g, g_o, g_k, core, g_ffn, g_up2 = gemms
    batch = mbs * heads
    ew_norm = 8.0 * T * h / rep
    ew = (8 + 12 + (10 if o.dropout else 0)) * T * h / rep  # norms, residual adds, dropouts
    if m.position_kind == "rope":
        ew += 4.0 * T * (heads + kvl) * (m.qk_rope_head_dim if m.attention_kind == "mla" else dqk)
    if o.attention == "flash":
        shares = getattr(cost, "_causal_shares", None)  # kept by the cost model: one number per seq
        share = shares.get(seq) if shares is not None else None
        if share is None:
            share = _causal_share(m, seq)
            if shares is not None:
                shares[seq] = share
        core = core * share / FLASH_EFFICIENCY
        core_bwd = core * FLASH_BACKWARD
        core_ew = 0.0
    else:
        core_bwd = 2.0 * core
        core_ew = (9.0 if o.dropout else 4.0) * batch * s_loc * seq  # softmax (+ dropout) traffic
    a2a_bytes = 0.0
    # elements entering (forward) and leaving (backward gradients) the linear layers: what FP8 quantises
    q_in = T * (h / rep + heads * dv + h / rep)
    q_out = T * ((heads + kvl) * dqk + kvl * dv + h)
    if moe:
        k, fe, E = m.top_k, m.expert_ffn_size, m.num_experts
        n_in = 3 if m.ffn_kind == "swiglu" else 2
        routed = T * k * o.load_imbalance  # elements of expert intermediates per device: routed x fe / tp
        # the op fuser runs the activation and its quantisation in the GEMM epilogues (TrainOptions.moe_fused_mlp)
        ew_act = 0.0 if o.moe_fused_mlp else (6.0 if m.ffn_kind == "swiglu" else 4.0) * routed * fe / tp
        ew_moe = efficiency.MOE_TOKEN_BYTES * routed * h * etp / tp
        q_in += routed * (h * etp + (0.0 if o.moe_fused_mlp else fe)) / tp
        q_out += routed * ((0.0 if o.moe_fused_mlp else (n_in - 1) * fe) + h * etp) / tp
        if m.num_shared_experts:
            fs = m.num_shared_experts * fe
            ew_act += (6.0 if m.ffn_kind == "swiglu" else 4.0) * T * fs / tp
            q_in += T * (h / rep + fs / tp)
            q_out += T * ((n_in - 1) * fs / tp + h)
        ew += ew_act + ew_moe
        # each TP rank dispatches 1/t of the tokens; the busiest rank receives imbalance x the mean
        a2a_bytes = 2.0 * T * k * h / tp * o.load_imbalance
    else:
        f = m.ffn_size
        n_in = 2 if m.ffn_kind == "swiglu" else 1
        ew_act = (6.0 if m.ffn_kind == "swiglu" else 4.0) * T * f / tp
        ew += ew_act
        q_in += T * f / tp
        q_out += T * (n_in * f / tp + h)
    qf, qb = quantise_bytes(cost._dtype)
    q_fwd_s = memory_bound_time_s(dev, qf * q_in)
    q_bwd_s = memory_bound_time_s(dev, qb * q_out)
    ew_s = memory_bound_time_s(dev, ew)
    core_ew_s = memory_bound_time_s(dev, core_ew)
    # Megatron-Core's unfused paths for YaRN rotary, a clamped GLU and expert biases (plan/cost/unfused.py); a run
    # held the Megatron way (param_policy, the default) is Megatron's code: torchtitan and this runtime run their own
    xu = NONE
    if o.param_policy == "megatron":
        rot = m.qk_rope_head_dim if m.attention_kind == "mla" else dqk
        xu = unfused_bytes(m, q_kv_elems=T * (heads + kvl) * rot, fc1_elems=2.0 * routed * fe / tp if moe else 0.0,
                           fc2_elems=routed * h * etp / tp if moe else 0.0, fused_mlp=o.moe_fused_mlp,
                           fp32_probs=o.moe_dispatcher == "fused")
    x_moe_s, x_act_s = memory_bound_time_s(dev, xu.moe_fwd), memory_bound_time_s(dev, xu.act_fwd)
    x_fwd_s = memory_bound_time_s(dev, xu.fwd)
    fwd = g + core + ew_s + core_ew_s + q_fwd_s + x_fwd_s
    bwd = 2.0 * g + core_bwd + 2.0 * (ew_s + core_ew_s) + q_bwd_s + memory_bound_time_s(dev, xu.bwd)
    stall_fwd = 0.0  # the forward's wait on the host; a recomputed MoE forward waits again under all-to-all (_layer_finish)
    fwd_gpu, bwd_gpu = fwd, bwd
    host_fwd = host_bwd = 0.0
    host_ahead = False  # the host issues ahead of the GPU (no count sync): passes last max(GPU work, host issue time)
    launching = expert_kernel_sets(o, m.num_experts / ep) if moe else 0.0
    if launching:
        n_fwd, n_bwd = expert_launches(cost._dtype)
        host_fwd = efficiency.moe_host_launch_s(launching, n_fwd)
        host_bwd = efficiency.moe_host_launch_s(launching, n_bwd)
        if o.moe_dispatcher == "alltoall":  # the host waits for the counts, then the GPU for the host
            moe_fwd = g_ffn + memory_bound_time_s(dev, ew_act + ew_moe) + x_moe_s
            stall_fwd = max(0.0, host_fwd - moe_fwd)
            fwd += stall_fwd
            bwd += max(0.0, host_bwd - 2.0 * moe_fwd)
        else:  # no sync: the host issues ahead, and the layer lasts at least the time to issue its expert kernels
            # (the max itself, not fwd + (host - fwd): a bound the host sets is the same number whatever else moved)
            stall_fwd = max(0.0, host_fwd - fwd)
            fwd, bwd = max(fwd, host_fwd), max(bwd, host_bwd)
            host_ahead = True
    # communication per layer (seconds; bytes each device sends)
    act = 2.0 * T * h
    tp_tier = cost.tier(tp, 1)
    tp_one = comm.all_reduce_s(act, tp, tp_tier) * (1.0 - o.tp_overlap)
    tp_bytes_one = comm.ring_all_reduce_bytes(act, tp)
    cp_tier = cost.tier(cp, tp)
    kv = 2.0 * T * kvl * (dqk + dv)
    cp_fwd_bytes = (cp - 1) * kv if cp > 1 else 0.0
    cp_fwd = (cp - 1) * comm.p2p_s(kv, cp_tier) if cp > 1 else 0.0
    cp_exposed = max(0.0, cp_fwd - core) + max(0.0, 2.0 * cp_fwd - core_bwd)
    cp_exposed += comm.OVERLAP_COMPUTE_COST * max(0.0, 3.0 * cp_fwd - cp_exposed)  # hidden, yet it slows compute
    ep_tier = cost.tier(ep, etp)
    crossing = None
    ep_one = 0.0
    if moe and o.moe_dispatcher == "fused" and ep_tier.members_per_node and ep > ep_tier.members_per_node:
        # the flex dispatcher (DeepEP / HybridEP) sends a token once to each other node holding one
        # of its experts (a2a_bytes is top_k copies of each token), and NVLink fans the copies out
        # inside each node, pipelined with the network: the slower of the two
        k_node = ep_tier.members_per_node
        crossing = a2a_bytes * comm.moe_remote_nodes(m.num_experts, m.top_k, ep // k_node) / m.top_k
        ep_one = max(comm.all_to_all_s(a2a_bytes, ep, ep_tier, crossing),
                     comm.all_to_all_s(a2a_bytes, k_node, cost.tier(k_node, etp)))
    elif moe:
        ep_one = comm.all_to_all_s(a2a_bytes, ep, ep_tier)
    ep_bytes_one = comm.all_to_all_bytes(a2a_bytes, ep) if moe else 0.0
    ep_nic_one = comm.all_to_all_nic_bytes(a2a_bytes, ep, ep_tier, crossing) if moe else 0.0
    return {
        "T": T, "moe": moe, "tp": tp, "sp": sp, "etp": etp, "seq": seq, "g_k": g_k, "g_o": g_o, "g_up2": g_up2,
        "g_ffn": g_ffn, "core": core, "core_ew_s": core_ew_s, "ew_norm": ew_norm, "ew_act": ew_act,
        "ew_moe": ew_moe if moe else 0.0, "ew_s": ew_s, "q_fwd_s": q_fwd_s, "stall_fwd": stall_fwd, "fwd": fwd,
        "bwd": bwd, "fwd_gpu": fwd_gpu, "bwd_gpu": bwd_gpu, "host_fwd": host_fwd, "host_bwd": host_bwd,
        "host_ahead": host_ahead, "tp_one": tp_one, "tp_all_reduce": comm.all_reduce_s(act, tp, tp_tier),
        "tp_bytes_one": tp_bytes_one, "tp_nic_one": comm.nic_bytes(tp_bytes_one, tp_tier), "cp_exposed": cp_exposed,
        "cp_fwd": cp_fwd, "cp_fwd_bytes": cp_fwd_bytes,
        "cp_nic": 3.0 * comm.nic_bytes(cp_fwd_bytes, cp_tier) if cp_tier.members_per_node else 0.0,
        "ep_one": ep_one, "ep_bytes_one": ep_bytes_one, "ep_nic_one": ep_nic_one,
        "x_fwd_s": x_fwd_s, "x_moe_s": x_moe_s, "x_act_s": x_act_s,
    }


def _layer_finish(cost: "TrainCost", b: dict, recompute: str) -> dict:
    """``layer_cost`` from its ``layer_base`` ``b``: what the recomputation mode changes."""
    m, o, dev = cost.model, cost.options, cost.device
    mods = _modules(recompute)
    moe, fwd, bwd, g_ffn, stall_fwd, ew_s, q_fwd_s = b["moe"], b["fwd"], b["bwd"], b["g_ffn"], b["stall_fwd"], b["ew_s"], b["q_fwd_s"]
    core, core_ew_s, ew_act, ew_moe = b["core"], b["core_ew_s"], b["ew_act"], b["ew_moe"]
    tp, sp, etp, T, seq = b["tp"], b["sp"], b["etp"], b["T"], b["seq"]
    tp_one, tp_bytes_one, cp_fwd, cp_fwd_bytes = b["tp_one"], b["tp_bytes_one"], b["cp_fwd"], b["cp_fwd_bytes"]
    ep_one, ep_bytes_one, ep_nic_one = b["ep_one"], b["ep_bytes_one"], b["ep_nic_one"]
    n_tp = 4 + (2 if recompute == "full" else 0)
    n_ep = 4 + (2 if recompute == "full" or "mlp" in mods else 0)
    if recompute == "full":
        rc = fwd
    elif recompute == "ops":
        # matmuls not saved (k, o, the second MLP input projection) and every element-wise op
        rc = b["g_k"] + b["g_o"] + b["g_up2"] + ew_s + q_fwd_s + b["x_fwd_s"]
    else:
        rc = 0.0
        if "core_attn" in mods:
            rc += core + core_ew_s
        if "layernorm" in mods:
            rc += memory_bound_time_s(dev, b["ew_norm"])
        if "mlp" in mods:
            rc += g_ffn + memory_bound_time_s(dev, ew_act + ew_moe) + b["x_moe_s"]
            if not b["host_ahead"]:
                rc += stall_fwd  # all-to-all: the recomputed MoE block waits for the host after its counts again
        elif "mlp_act" in mods:
            rc += memory_bound_time_s(dev, ew_act) + b["x_act_s"]
        if "mla_up_proj" in mods and m.attention_kind == "mla":
            rc += _mla_up_proj_s(cost, T, tp)
    if b["host_ahead"]:
        # No count sync (flex dispatchers): the host issues the backward's kernels, and a recomputed MoE block's
        # (full, or Megatron's "mlp" module) forward expert kernels again, ahead of the GPU, which runs the backward
        # and the recomputation: the pair lasts max(GPU work, host issue time), so what the recomputation adds is
        # that max less the backward's own max(bwd_gpu, host_bwd).
        rc_gpu = b["fwd_gpu"] if recompute == "full" else rc
        rc_host = b["host_fwd"] if recompute == "full" or "mlp" in mods else 0.0
        if b["host_bwd"] + rc_host > b["bwd_gpu"] + rc_gpu or bwd > b["bwd_gpu"]:  # the host binds somewhere
            rc = max(b["bwd_gpu"] + rc_gpu, b["host_bwd"] + rc_host) - bwd
        else:
            rc = rc_gpu  # the GPU binds throughout: its recomputation as it stands (no rounding of x + rc - x)
    # the activation terms read tokens, tp, sp, the layer kind, expert TP and the dtype, not cp or ep
    # alone: kept by the cost model per that shape (the same call, the same numbers)
    kept = getattr(cost, "_act_terms", None)
    akey = (moe, T, tp, sp, recompute, cost._dtype, etp)
    acts = kept.get(akey) if kept is not None else None
    if acts is None:
        act_kwargs = dict(
            tokens=T, seq_ctx=seq, tp=tp, sp=sp, moe=moe, attention=o.attention, dropout=o.dropout,
            expert_tokens_factor=o.load_imbalance, expert_tp=etp, gemm_input_bytes=saved_input_bytes(cost._dtype),
            probs_on_combine=o.moe_probs_on_combine,
        )
        act_terms = layer_activation_terms(m, recompute=recompute, **act_kwargs)
        work = 0.0
        if recompute == "full":  # the layer being recomputed holds its full activations
            work = sum(layer_activation_terms(m, recompute="none", **act_kwargs).values())
        acts = (act_terms, sum(act_terms.values()), work)
        if kept is not None:
            kept[akey] = acts
    act_terms, act_bytes, work = acts
    return {
        "compute_s": fwd + bwd + rc,
        "recompute_s": rc,
        "fwd_s": fwd,
        "bwd_s": bwd,
        "tp_s": n_tp * tp_one,
        "tp_total_s": n_tp * b["tp_all_reduce"],
        "cp_s": b["cp_exposed"],
        "cp_total_s": 3.0 * cp_fwd,
        "ep_s": _ep_exposed(n_ep * ep_one, fwd + bwd) if moe and o.moe_a2a_overlap else n_ep * ep_one,
        "tp_bytes": n_tp * tp_bytes_one,
        "tp_nic": n_tp * b["tp_nic_one"],
        "cp_bytes": 3.0 * cp_fwd_bytes,
        "cp_nic": b["cp_nic"],
        "ep_bytes": n_ep * ep_bytes_one,
        "ep_nic": n_ep * ep_nic_one,
        "act_bytes": act_bytes,
        "act_terms": act_terms,
        "work_bytes": work,
    }


def _ep_exposed(ep_s: float, window_s: float) -> float:
    """A layer's EP exchange under ``moe_a2a_overlap``: hidden behind the paired micro-batch's
    forward and backward of the layer (``window_s``), the rest exposed; what is hidden slows that
    compute by ``comm.OVERLAP_COMPUTE_COST``."""
    hidden = min(ep_s, window_s)
    return ep_s - hidden + comm.OVERLAP_COMPUTE_COST * hidden


def _gemms(cost: "TrainCost", moe: bool, tp: int, cp: int, ep: int, mbs: int, seq: int, etp: int) -> tuple:
    """A layer's GEMM seconds at the compute dtype ``cost._dtype`` (``etp`` resolved): (forward GEMMs
    outside the attention core, the output projection, the k projection, the attention core before
    the flash scaling, the MLP or experts, the second MLP input projection), summed in
    ``layer_base``'s order. Nothing here reads sequence parallelism."""
    m, o = cost.model, cost.options
    h = m.hidden_size
    T = mbs * seq / cp
    s_loc = seq / cp
    heads = m.num_heads / tp
    dqk, dv = m.qk_head_dim, m.attn_v_head_dim
    kvl = kv_heads_per_rank(m, tp)
    g = 0.0  # forward GEMM seconds outside the attention core
    if m.attention_kind == "mla":
        rq = m.q_lora_rank or 0
        if rq:
            g += cost._gemm(T, rq, h) + cost._gemm(T, heads * dqk, rq)
        else:
            g += cost._gemm(T, heads * dqk, h)
        g += cost._gemm(T, m.kv_lora_rank + m.qk_rope_head_dim, h)
        g += cost._gemm(T, heads * (m.qk_nope_head_dim + dv), m.kv_lora_rank)
    else:
        g += cost._gemm(T, (heads + kvl) * dqk + kvl * dv, h)
    g_o = cost._gemm(T, h, heads * dv)
    g += g_o
    g_k = cost._gemm(T, kvl * dqk, h)  # op-level SAC recomputes k (and o and the second MLP input)
    # attention core: QK^T and PV, batch = mbs x local heads; bf16 under FP8 recipes
    batch = mbs * heads
    core = cost._gemm(s_loc, seq, dqk, batch, "bf16") + cost._gemm(s_loc, dv, seq, batch, "bf16")
    if moe:
        k, fe, E = m.top_k, m.expert_ffn_size, m.num_experts
        n_in = 3 if m.ffn_kind == "swiglu" else 2
        g += cost._gemm(T, E, h, 1.0, "bf16")  # router
        local = E / ep
        per_expert = T * k * o.load_imbalance * ep * etp / (tp * E)  # tokens per local expert
        g_ffn = cost._gemm(per_expert, (n_in - 1) * fe / etp, h, local) + cost._gemm(per_expert, h, fe / etp, local)
        g_up2 = cost._gemm(per_expert, fe / etp, h, local) if n_in == 3 else cost._gemm(per_expert, h, fe / etp, local)
        if m.num_shared_experts:
            fs = m.num_shared_experts * fe
            g_ffn += cost._gemm(T, (n_in - 1) * fs / tp, h) + cost._gemm(T, h, fs / tp)
        g += g_ffn
    else:
        f = m.ffn_size
        n_in = 2 if m.ffn_kind == "swiglu" else 1
        g_ffn = cost._gemm(T, n_in * f / tp, h) + cost._gemm(T, h, f / tp)
        g_up2 = cost._gemm(T, f / tp, h) if n_in == 2 else cost._gemm(T, h, f / tp)
        g += g_ffn
    return g, g_o, g_k, core, g_ffn, g_up2


def _causal_share(model, seq: int) -> float:
    """Share of the ``seq x seq`` score blocks a flash kernel computes, averaged over the layers:
    half under a causal mask; a sliding-window or chunked layer (``local_layers``, gpt-oss, Gemma 3,
    Llama 4) sees at most ``local_window`` keys per query."""
    # spec/model.py names them sliding_layers / sliding_window (local_* in older specs)
    local = len(getattr(model, "sliding_layers", ()) or getattr(model, "local_layers", ()) or ())
    window = getattr(model, "sliding_window", 0) or getattr(model, "local_window", 0) or 0
    if not local or not window:
        return 0.5
    f = local / model.num_layers
    w = min(window, seq)
    local_share = (w * seq - w * w / 2.0) / (seq * seq)  # causal band of width w
    return (1.0 - f) * 0.5 + f * local_share


def _mla_up_proj_s(cost: "TrainCost", T: float, tp: int) -> float:
    """Seconds to recompute MLA's up projections (Megatron's ``mla_up_proj`` module): per head, q
    from the q latent (``r_q -> d_qk``; the plain q projection when the model has no q latent is
    not an up projection and is kept) and k-nope, v from the kv latent (``r_kv -> d_nope + d_v``),
    plus rotary on q and k's rope part, for ``T`` tokens on one TP rank."""
    m, dev = cost.model, cost.device
    heads = m.num_heads / tp
    nope = m.qk_head_dim - m.qk_rope_head_dim
    s = cost._gemm(T, heads * (nope + m.attn_v_head_dim), m.kv_lora_rank)
    if m.q_lora_rank:
        s += cost._gemm(T, heads * m.qk_head_dim, m.q_lora_rank)
    return s + memory_bound_time_s(dev, 4.0 * T * (heads + 1) * m.qk_rope_head_dim)


def _modules(recompute: str) -> frozenset:
    if recompute in ("none", "full", "ops"):
        return frozenset()
    return recompute_modules(recompute)


def quantise_bytes(compute: str) -> tuple[float, float]:
    """HBM bytes per element to quantise a linear layer's input (forward) and its output gradient
    (backward) for compute key ``compute``: read bf16 (2) and write fp8 (1) = 3 with delayed
    scaling (amax fused into the cast); current scaling reads the tensor once more for its amax
    first (5); MXFP8 writes row- and column-wise copies with their 1 x 32 block scales (2 + 2 +
    2/32). 0 for 16/32-bit compute."""
    return {"fp8": (3.0, 3.0), "fp8cs": (5.0, 5.0), "mxfp8": (4.0625, 4.0625)}.get(compute, (0.0, 0.0))


def expert_kernel_sets(options, local_experts: float) -> float:
    """How many times the host issues ``expert_launches``' kernels per MoE pass: once per local expert
    where each expert's GEMMs and casts are their own kernels (``moe_expert_kernels='per_expert'``,
    Transformer Engine's GroupedLinear as Megatron-Core runs it), once where one grouped kernel serves
    every local expert (``'grouped'``: torch's ``_grouped_mm`` in torchtitan; the fused grouped MLP,
    ``moe_fused_mlp``, whose device-initiated grouped GEMMs read the experts' shapes from GPU memory,
    Megatron-Bridge docs/training/moe-optimization.md at v0.5.0), and never where the host issues nothing
    per step (``cuda_graph='full_iteration'``). The host then bounds the layer (plan/cost/efficiency.py
    ``MOE_HOST_S_PER_LAUNCH``): with the all-to-all dispatcher's count synchronisation, the MoE block
    after it; without, the whole layer's pass, as the host runs ahead of the GPU elsewhere."""
    if options.cuda_graph == "full_iteration":
        return 0.0
    return 1.0 if options.moe_expert_kernels == "grouped" or options.moe_fused_mlp else local_experts


def expert_launches(compute: str) -> tuple[int, int]:
    """Kernels one local expert launches in an MoE forward and in its backward, for compute key
    ``compute`` (Transformer Engine's GroupedLinear runs each expert's GEMMs one by one): each of
    the two expert linears (fc1, fc2; fc1 holds gate and up) runs one GEMM forward and two backward
    (data and weight gradient), and an FP8 recipe quantises each GEMM's input in the forward and
    its output gradient in the backward per expert, ``quantise_bytes``' casts: one kernel under
    delayed scaling (the amax is fused into the cast) and MXFP8 (one kernel writes both copies
    with their block scales), three under current scaling (amax, scale from amax, cast). Weight
    casts happen once per step and are not counted. bf16: (2, 4); FP8 delayed / MXFP8: (4, 6);
    FP8 current scaling: (8, 10)."""
    q = {"fp8": 1, "mxfp8": 1, "fp8cs": 3}.get(compute, 0)
    return 2 * (1 + q), 2 * (2 + q)


def saved_input_bytes(compute: str) -> float:
    """Bytes per element of a saved linear-layer input (plan/cost/activations.py module doc)."""
    if compute in ("fp8", "fp8cs"):
        return 1.0
    if compute == "mxfp8":
        return 1.0 + 1.0 / 32.0
    return ACT_BYTES
