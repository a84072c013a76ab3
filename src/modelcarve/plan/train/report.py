"""The training estimate as JSON (the field contract other tools read) and its warnings in words.

Fields: ``fits``; ``memory`` {``peak_bytes``, ``capacity_bytes``, ``worst_stage``, ``breakdown``
in bytes}; ``time`` {``step_s``, ``tokens_per_s``, ``tflops_per_device`` (Narayanan et al. 2021
Eq. 3: recomputation counted), ``mfu`` (recomputation not counted), ``compute_s`` (recomputation
included), ``recompute_s``, ``bubble_s``,
``optimizer_s``, ``microbatches``}; ``comm`` {``bytes_per_step_by_link`` (intra, inter: bytes
one device sends per step), ``bytes_per_step_by_axis``, ``exposed_s``, ``exposed_s_by_link``,
``exposed_s_by_axis``, ``total_s_by_axis``, ``hidden_s_by_axis``, ``link_by_axis``};
``bubble_fraction``; ``warnings``; ``reject_reason``. The step is the sum of compute, bubble,
optimizer and the exposed communication of every axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelcarve.plan.train.states import GIB, param_storage

if TYPE_CHECKING:
    from modelcarve.plan.train.candidate import Candidate
    from modelcarve.plan.train.protocol import TrainCost
    from modelcarve.spec.layout import Layout


def build_report(cost: "TrainCost", cand: "Candidate", prof: dict, d: dict, *, peak: float, worst: str,
                 inflight: float, fits: bool, n_mb: int, idle: float, t_mb: float, p2p: float, p2p_total: float, step: float,
                 tokens_per_s: float) -> dict:
    """The estimate JSON of candidate ``cand`` from the cost model's profile and DP entry."""
    tp, cp, pp, dp, ep, mbs, sp, recompute, zero, dp_shard, _schedule, v = cand[:12]
    etp = cand.etp
    seq, tokens = cost.seq, prof["tokens"]
    p_dt = cand.param_dtype
    st_w = prof["stages"][worst]
    act = inflight * st_w["act_bytes"] + st_w["work_bytes"] + st_w["logits_bytes"]
    buffers = d["buffers"]
    breakdown = cost.state_parts(prof, cand, worst)
    breakdown.update({
        "activations": inflight * st_w["act_bytes"],
        "recompute_working_layer": st_w["work_bytes"],
        "logits": st_w["logits_bytes"],
        "comm_buffers": buffers,
        "allocator_fragmentation": cost.options.fragmentation * (act + buffers),
        "reserved_runtime": d["reserved"],
    })
    breakdown = {k: int(round(x)) for k, x in breakdown.items()}
    peak_int = sum(breakdown.values())
    peak_dev = cost.device.flops(p_dt)
    n_dev = tp * cp * pp * dp
    model_flops = 3.0 * cost.model.forward_flops_per_token(seq) * tokens
    rc_flops = 0.0
    if recompute == "full":
        rc_flops = (cost.model.forward_flops_per_token(seq) - cost.head_fwd_flops_token) * tokens
    elif recompute in ("selective", "core_attn") or recompute.startswith("core_attn+"):
        rc_flops = cost.model.attention_flops_per_token(seq) * tokens
    # other op-level modes recompute element-wise ops (no FLOPs counted) or GEMMs whose share the
    # per-layer times carry; Eq. 3 counting applies to full and attention-core recomputation only
    slow = prof["slow"]
    axis_tier = {
        "tp": cost.tier(tp, 1).name, "cp": cost.tier(cp, tp).name, "ep": cost.tier(ep, etp).name,
        "pp": cost.tier(pp, dp * cp * tp).name if pp > 1 else "intra",
        "dp": d["tier"],
    }
    # per-micro-batch communication in the bubble is part of the bubble, not counted again here
    exposed_axis = {
        "tp": n_mb * slow["tp_s"], "cp": n_mb * slow["cp_s"], "ep": n_mb * slow["ep_s"],
        "pp": p2p, "dp": d["exposed_s"] - d["optimizer_s"],
    }
    total_axis = {
        "tp": n_mb * slow["tp_total_s"], "cp": n_mb * slow["cp_total_s"], "ep": n_mb * slow["ep_s"],
        "pp": p2p_total, "dp": d["total_s"],
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
    layout = cost.layout(cand)
    warnings = _warnings(cost, layout, exposed_axis, step, idle / (n_mb + idle) if idle else 0.0, fits)
    reason = None
    cap = cost.capacity / GIB
    where = "the device" if worst == "only" else f"the {worst} pipeline stage"
    if not fits and cost.states_floor(tp, cp, pp, dp, ep, zero, dp_shard, cand.param_dtype, cand.grad_dtype,
                                      cand.optim_dtype, etp, v, cost.holds_layers(zero, pp)) > cost.capacity:
        # the stage with the most model state (not necessarily the one with the highest peak)
        fullest, states = max(((k, sum(cost.state_parts(prof, cand, k).values())) for k in prof["stages"]),
                              key=lambda kv: kv[1])
        where = "the device" if fullest == "only" else f"the {fullest} pipeline stage"
        reason = (
            f"weights, gradients and optimizer states alone need {states / GIB:.1f} GiB of {cap:.1f} GiB on {where}"
            f" (with {d['reserved'] / GIB:.1f} GiB kept for the CUDA context, workspaces and NCCL buffers"
            f"{_headroom_words(cost)})"
            + ("" if zero == 3 else "; a higher ZeRO stage, more TP/PP or EP shard them")
        )
    elif not fits:
        reason = (
            f"needs {peak_int / GIB:.1f} GiB of {cap:.1f} GiB on {where}: activations of "
            f"{inflight:.3g} micro-batch{'es' if inflight != 1 else ''} in flight take {breakdown['activations'] / GIB:.1f} GiB"
            + ("" if recompute == "full" else " (recomputation would shrink them)")
        )
    return {
        "goal": "train",
        "layout": layout.to_dict(),
        "short": layout.short(),
        "fits": fits,
        "memory": {
            "peak_bytes": peak_int,
            "capacity_bytes": int(cost.capacity),
            "device_bytes": int(cost.device_memory),
            "headroom": cost.options.memory_headroom,
            "worst_stage": worst,
            "breakdown": breakdown,
            **({"offloaded_to_host_bytes": int(round(inflight * st_w["offloaded_bytes"]))}
               if cost.options.offload_layers else {}),
        },
        "time": {
            "step_s": step,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": (model_flops + rc_flops) / step / n_dev / 1e12,
            "mfu": model_flops / (step * n_dev * peak_dev),
            "compute_s": n_mb * slow["compute_s"],
            "recompute_s": n_mb * slow["recompute_s"],
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


def _headroom_words(cost: "TrainCost") -> str:
    r = cost.options.memory_headroom
    return f", and {r:.0%} of the device left free as headroom" if r else ""


def _warnings(cost: "TrainCost", layout: Layout, exposed: dict, step: float, bubble: float, fits: bool) -> list[str]:
    """Sentences about what this layout spends its step on, when it is worth saying."""
    cl = cost.cluster
    per_node = cl.fast_domain  # the NVLink domain: the node, or an NVL72 rack
    out = []
    nic = link_words(cl.inter_link.name)
    if layout.tp > per_node:
        out.append(
            f"tp={layout.tp} spans {layout.tp // per_node} nodes: its all-reduces over {nic} take "
            f"{exposed['tp'] / step:.0%} of the step"
        )
    if layout.cp > 1 and layout.cp * layout.tp > per_node:
        out.append(f"cp={layout.cp} crosses nodes: ring attention over {nic} exposes {exposed['cp'] / step:.0%} of the step")
    if layout.ep > 1 and layout.ep * layout.expert_tp > per_node:
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


def _gather_rule(lay: "Layout") -> str:
    """The rule of the ``zero3_gather_buffers`` part (``memory_sources``)."""
    from modelcarve.spec.support import fsdp_holds_gradients, fsdp_reshards_after_forward

    if lay.zero != 3:
        return f"none: ZeRO-{lay.zero} keeps whole parameters, nothing to gather"
    if not fsdp_holds_gradients(lay.pp):
        return ("ZeRO-3 / FSDP2: one layer's parameters gathered and the next prefetched (2 x param bytes) plus its "
                "unsharded gradient before the reduce-scatter (FSDP2's default forward prefetch of one unit, "
                "reshard_after_forward)")
    held = ("from its first forward (reshard_after_forward=False, spec/support.py fsdp_reshards_after_forward: "
            "torch's input step I lists the stage's parameters before its backward unshards them, so a resharded "
            "layer would miss the weight step W)" if not fsdp_reshards_after_forward(lay.pp, lay.schedule) else
            "from each backward to its next forward (resharded after forward; the peak counts them beside the "
            "micro-batches in flight: at most one micro-batch's activations high)")
    return (f"ZeRO-3 / FSDP2 under the {lay.schedule} pipeline: every unsharded gradient of the stage (grad bytes) "
            "from its first backward to the step's one reduce-scatter (spec/support.py fsdp_holds_gradients: torch's "
            "pipeline stage turns FSDP's gradient sync and reshard after backward off until perform_reduce_grad), "
            "the root unit (embedding / final norm / head) gathered from its first forward, and every decoder layer "
            f"gathered (param bytes) {held}; never less than the two-layer window")


def memory_sources(result: dict, options) -> dict[str, str]:
    """For each part of ``result``'s memory breakdown (an estimate of one layout), the rule that sized
    it and where the rule comes from, in words (``estimate`` prints them beside the bytes). ``options``:
    the cost model's TrainOptions."""
    from modelcarve.spec.layout import Layout

    lay = Layout(**result["layout"])
    p_dt, zero, m = lay.param_dtype, lay.zero, result["memory"]["worst_stage"]
    shard = {0: "whole", 1: "whole", 2: "whole", 3: "one 1/(dp x cp) shard"}[zero]
    stored, fp8w = param_storage(p_dt, zero, lay.dp * lay.cp, options)
    held = "bf16 parameters (2 B; FP8 recipes keep bf16 weights, Transformer Engine)" if p_dt in ("bf16", "fp8", "mxfp8") \
        else f"{p_dt} parameters"
    if fp8w:
        held = "bf16 parameters outside the linear layers (embedding, norms, router)"
    own_master = stored != p_dt
    if own_master:
        who = {"torch": "torchtitan's FSDP2 MixedPrecisionPolicy / DDP under autocast",
               "modelcarve": "modelcarve's runtime, spec/support.held_param_dtype"}[options.param_policy]
        held = f"fp32 parameters, their own master copy, {p_dt} compute ({who})"
    recompute = {
        "none": "nothing recomputed",
        "selective": "recompute=selective read as Megatron-LM's --recompute-granularity selective: the attention core "
                     "(softmax / flash) is not stored",
        "full": "recompute=full: each layer keeps its input only (2 s b h, Korthikanti et al. 2022 Sec. 4)",
        "ops": "recompute=ops read as torchtitan's op-level selective AC: matmul and attention outputs kept, "
               "element-wise ops recomputed",
    }.get(lay.recompute, f"recompute={lay.recompute}: the named modules' saved tensors recomputed (Megatron --recompute-modules)")
    sched = lay.schedule if lay.pp > 1 else "no pipeline"
    return {
        "weights": f"{held}, {shard} (ZeRO-3 / FSDP2 shard over dp x cp: Rajbhandari et al. 2020); the {m} stage's "
                   "layers by the runtime's split (spec/stages.py, Megatron's --account-for-embedding/loss-in-pipeline-split)"
                   + (f"; the last stage also holds {options.mtp_layers} multi-token-prediction depth(s): a decoder "
                      f"layer, a 2h x h projection and three norms each" if options.mtp_layers else "")
                   + ("; the linear weights are FP8 (--fp8-param-gather): the fp8 weight cache row" if fp8w else ""),
        "gradients": f"{lay.grad_dtype} gradients of the held parameters"
                     + (", reduce-scattered to the dp x cp shard (ZeRO-2/3)" if zero >= 2 else ", whole until the reduction"),
        "optimizer_states": (f"Adam: two {lay.optim_dtype} moments; the fp32 parameters are their own master (8 B a "
                             f"parameter)" if own_master else
                             f"Adam: two {lay.optim_dtype} moments + a {lay.optim_dtype} master copy when it differs from the "
                             f"parameters (12 B a parameter for bf16, Rajbhandari et al. 2020 K=12)")
                            + (", over the dp x cp shard (Megatron's distributed optimizer / ZeRO-1+)" if zero >= 1 else ""),
        "zero3_gather_buffers": _gather_rule(lay),
        "fp8_weight_cache": ("the linear weights themselves, FP8 row- and column-wise (2 B a linear parameter, MX "
                             "scales +1/32; Megatron --fp8-param-gather / TE fp8_model_init: no bf16 copy)" if fp8w else
                             "Transformer Engine's FP8 row- and column-wise copies of each linear weight for the step "
                             "(2 B a linear parameter, MX scales +1/32)") if p_dt in ("fp8", "mxfp8")
                            else f"none: {p_dt} GEMMs keep no FP8 weight copies",
        "activations": f"saved tensors per layer (plan/cost/activations.py: Korthikanti et al. 2022 Sec. 4 extended to "
                       f"GQA, SwiGLU, MoE, MLA, flash attention) x layers x micro-batches in flight ({sched}: "
                       f"plan/cost/schedule.py); {recompute}",
        "recompute_working_layer": "one layer's full activations rebuilt during its backward" if lay.recompute != "none"
                                   else "none: nothing is recomputed",
        "logits": {"materialized": "the last stage's logits: bf16 + the cross entropy's fp32 copy, softmax and "
                                   "gradient in place (6 B a logit, Megatron-Core's unfused loss)",
                   "fused": "Megatron's fused cross entropy, TE's kernel (--cross-entropy-loss-fusion, "
                            "--cross-entropy-fusion-impl te): bf16 logits, softmax gradient in place (2 B a logit)",
                   "chunked": "chunked cross entropy, torchtitan's ChunkedLossWrapper (" + (
                       f"{options.loss_chunks} chunks a micro-batch" if options.loss_chunks else
                       f"{options.loss_chunk} tokens a chunk") + (
                       ", 18 B a local chunk logit under TP's loss parallel, derived" if lay.tp > 1 else
                       ", 14 B a chunk logit, measured") + ") + the hidden states' chunk copies and their fp32 "
                       "gradient (6 B a token and hidden unit)",
                   "torch": ("DTensor's loss_parallel (torchtitan with TP, vocabulary-sharded logits): the "
                             "decomposed log-softmax backward holds the saved log-softmax, the NLL gradient, "
                             "exp(output) and the result (16 B a local logit, measured with torch's MemTracker)"
                             if lay.tp > 1 else
                             "torch's cross entropy on fp32 logits, bf16 logits freed before backward (torchtitan): "
                             "its backward holds the saved log-softmax, the NLL and log-softmax gradients (12 B a "
                             "logit, measured with torch's MemTracker)")}.get(options.loss, options.loss)
                  + (f"; x {1 + options.mtp_layers}: the {options.mtp_layers} multi-token-prediction depth(s)' logits "
                     f"held beside the main ones, with each depth's 2h-wide input (--mtp-layers)"
                     if options.mtp_layers and options.loss != "chunked" else "")
                  if m in ("last", "only") else "not on this stage",
        "comm_buffers": "pipeline send / receive buffers (2 per direction), the sequence-parallel gather, MoE dispatch "
                        "buffers, " + ("context parallelism's ring buffers (max(cp, 4) K+V chunks of one layer and a dQ "
                                       "buffer: Transformer Engine's p2p ring attention), " if lay.cp > 1 else "")
                        + "and two of Megatron's 40 MB gradient buckets in flight",
        "allocator_fragmentation": f"{options.fragmentation:.0%} of activations and buffers: PyTorch's caching allocator "
                                   "(expandable segments: 3-10% measured above allocated; fixed segments 20%, fitted to "
                                   "torchtitan's published Llama 3.1 8B peak)",
        "reserved_runtime": "CUDA context (600 MiB, nvidia-smi of an idle PyTorch + TE process) + cuBLAS / TE workspaces "
                            "(256 MiB) + NCCL buffers per communicator (128 MiB: NCCL_BUFFSIZE 4 MiB x 16 channels x 2)",
    }
