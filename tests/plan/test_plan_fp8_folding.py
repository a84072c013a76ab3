"""FP8 training, MoE parallel folding, op-level recomputation, chunked loss and headroom, each
against figures derived by hand from the model's dimensions (issue 14)."""

import pytest

from modelcarve.plan.cost import efficiency
from modelcarve.plan.train.calibration import nemo_cases, torchtitan_memory_cases
from modelcarve.plan.cost.efficiency import HBM_EFFICIENCY, gemm_time_s
from modelcarve.plan.goals import get_goal
from modelcarve.plan.train.model import LOGITS_BYTES_PER_ELEM, TrainCostModel, TrainOptions
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout

LLAMA8 = get_model("llama-3.1-8b")  # h 4096, 32 heads x 128, 8 kv heads, ffn 14336, 32 layers, vocab 128256
H100 = parse_cluster("H100")


def _layer(dtype: str, recompute: str = "none", seq: int = 4096) -> dict:
    cost = TrainCostModel(LLAMA8, H100, TrainOptions(global_batch=1, seq=seq))
    return cost.profile(1, 1, 1, 1, 1, 1, False, recompute, seq, dtype)["dense"]


def test_fp8_layer_time_is_half_the_linear_gemms_plus_quantisation():
    T, h, kvd, f = 4096, 4096, 8 * 128, 14336
    dev = H100.device
    shapes = [(T, h + 2 * kvd, h), (T, h, h), (T, 2 * f, h), (T, h, f)]  # QKV, projection, gate+up, down
    lin_bf16 = sum(gemm_time_s(dev, *s, dtype="bf16") for s in shapes)
    lin_fp8 = sum(gemm_time_s(dev, *s, dtype="fp8") for s in shapes)
    # compute-bound shapes: the FP8 peak (1978.9 TFLOP/s, twice bf16) at FP8_PEAK_RATIO of the same efficiency
    ratio = dev.flops("fp8") / dev.flops("bf16")
    assert ratio == pytest.approx(2.0, rel=1e-4)
    assert lin_fp8 == pytest.approx(lin_bf16 / (ratio * efficiency.FP8_PEAK_RATIO), rel=1e-9)
    # delayed scaling reads bf16 and writes fp8 (3 bytes) for every linear input: QKV and MLP inputs
    # (h each), the projection's input (32 x 128 = h) and the down projection's input (f)
    q_fwd = 3.0 * T * (3 * h + f) / (dev.hbm_bytes_per_s * HBM_EFFICIENCY)
    bf16, fp8 = _layer("bf16"), _layer("fp8")
    assert bf16["fwd_s"] - fp8["fwd_s"] == pytest.approx(lin_bf16 - lin_fp8 - q_fwd, rel=1e-9)
    # current scaling reads each tensor once more for its amax (5 bytes)
    fp8cs = _layer("fp8cs")
    assert fp8cs["fwd_s"] - fp8["fwd_s"] == pytest.approx(2.0 * T * (3 * h + f) / (dev.hbm_bytes_per_s * HBM_EFFICIENCY), rel=1e-9)


def test_fp8_memory_bf16_weights_fp32_master_quantised_caches_and_fp8_saved_inputs():
    goal = get_goal("train")
    est = {p: goal.evaluate(LLAMA8, parse_cluster("8xH100"), Layout.parse(f"tp=8,sp,mbs=1,gbs=1,seq=4096,param_dtype={p}"))
           for p in ("bf16", "fp8")}
    b16, b8 = est["bf16"]["memory"]["breakdown"], est["fp8"]["memory"]["breakdown"]
    h, kvd, f, L, V, tp = 4096, 8 * 128, 14336, 32, 128256, 8
    linear = L * (h * (h + 2 * kvd) + h * h + 3 * h * f) / tp  # weights of the GEMMs, per TP rank
    params = linear + L * 2 * h + 2 * V * h / tp + h            # + norms, embedding and head, final norm
    assert b8["weights"] == pytest.approx(2 * params, abs=2) == b16["weights"]       # weights stay bf16
    assert b8["optimizer_states"] == pytest.approx(12 * params, abs=8)              # fp32 master + 2 moments
    assert b8["fp8_weight_cache"] == pytest.approx(2 * linear, abs=2) and b16["fp8_weight_cache"] == 0
    # saved linear inputs drop to 1 byte: QKV and MLP inputs (SP: h / tp each), projection input (h / tp),
    # down-projection input (f / tp) per token and layer
    T = 4096
    assert b16["activations"] - b8["activations"] == pytest.approx(L * T * (3 * h + f) / tp, abs=L)
    assert est["fp8"]["time"]["tokens_per_s"] > 1.1 * est["bf16"]["time"]["tokens_per_s"]  # TP8 all-reduces do not shrink
    # MXFP8 needs Blackwell; on GB200 it is priced at the FP8 peak with MX scale overheads
    mx = goal.evaluate(LLAMA8, parse_cluster("8xGB200"), Layout.parse("mbs=1,dp=8,gbs=8,seq=4096,zero=1,param_dtype=mxfp8"))
    assert mx["memory"]["breakdown"]["fp8_weight_cache"] == pytest.approx(2 * (1 + 1 / 32) * linear * tp, rel=1e-6)


MIXTRAL = get_model("mixtral-8x7b")  # h 4096, 32 heads x 128, 8 kv heads, 8 experts of 3 x 4096 x 14336, top 2, vocab 32000


def test_folded_layout_tp2_dp4_ep8_on_8_ranks_matches_hand_derived_bytes():
    layout = Layout.parse("tp=2,sp,dp=4,ep=8,zero=1,mbs=1,gbs=8,seq=4096")
    assert (layout.expert_tp, layout.expert_dp, layout.folded) == (1, 1, True)
    est = get_goal("train").evaluate(MIXTRAL, parse_cluster("8xH100"), layout, load_imbalance=1.0)
    h, L, V, E, fe, k, tp, T = 4096, 32, 32000, 8, 14336, 2, 2, 4096
    attn = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h
    dense = L * (attn / tp + 2 * h + E * h) + 2 * V * h / tp + h  # router replicated over the TP ranks
    expert = L * (E // 8) * 3 * h * fe                              # one whole expert per rank and layer (ETP 1)
    mem = est["memory"]["breakdown"]
    assert mem["weights"] == pytest.approx(2 * (dense + expert), abs=4)
    assert mem["gradients"] == pytest.approx(4 * (dense + expert), abs=8)
    # distributed optimizer: dense state over the 4 data-parallel ranks, experts over EDP = 1
    assert mem["optimizer_states"] == pytest.approx(12 * (dense / 4 + expert), abs=16)
    n_mb = 8 // (1 * 4)
    # all-to-all: dispatch + combine forward and backward, each rank sending 7/8 of its T/tp tokens x k copies
    a2a = n_mb * L * 4 * (7 / 8) * 2.0 * T * k * h / tp
    comm = est["comm"]
    assert comm["bytes_per_step_by_axis"]["ep"] == pytest.approx(a2a, rel=1e-9)
    assert comm["link_by_axis"]["ep"] == "intra"
    # gradients: ZeRO-1 reduce-scatter of fp32 dense grads and all-gather of bf16 params over dp=4; experts: none
    assert comm["bytes_per_step_by_axis"]["dp"] == pytest.approx(0.75 * (4 + 2) * dense, rel=1e-9)
    # the unfolded mesh (EP inside dp, expert TP = TP) holds the same expert bytes but splits each expert
    unfolded = get_goal("train").evaluate(MIXTRAL, parse_cluster("8xH100"), Layout.parse("tp=2,sp,dp=4,ep=4,zero=1,mbs=1,gbs=8,seq=4096"),
                                          load_imbalance=1.0)
    assert unfolded["memory"]["breakdown"]["weights"] == mem["weights"]
    assert unfolded["comm"]["bytes_per_step_by_axis"]["ep"] == pytest.approx(n_mb * L * 4 * (3 / 4) * 2.0 * T * k * h / tp, rel=1e-9)


def test_op_level_recomputation_terms_by_hand():
    T, h, kvd, f, heads = 4096, 4096, 8 * 128, 14336, 32
    none = _layer("bf16")["act_bytes"]
    # tp=1, flash, no dropout: norm inputs 4Th, attention input 2Th, q k v 2T(h + 2 kvd), lse 4 T heads,
    # projection input 2Th, MLP input 2Th, SwiGLU gate, up and product 6Tf
    assert none == pytest.approx(4 * T * h + 2 * T * h + 2 * T * (h + 2 * kvd) + 4 * T * heads + 2 * T * h + 2 * T * h + 6 * T * f)
    assert _layer("bf16", "mlp_act")["act_bytes"] == pytest.approx(none - 2 * T * f)
    assert _layer("bf16", "layernorm")["act_bytes"] == pytest.approx(none - 4 * T * h)
    assert _layer("bf16", "core_attn")["act_bytes"] == pytest.approx(none - 4 * T * heads)
    assert _layer("bf16", "selective")["act_bytes"] == _layer("bf16", "core_attn")["act_bytes"]
    # torchtitan op-level SAC: block input, q and v, attention output + lse, the gate projection and
    # the down projection's output (every second matmul recomputed: k, o, up)
    ops = _layer("bf16", "ops")
    assert ops["act_bytes"] == pytest.approx(2 * T * h + 2 * T * (h + kvd) + 2 * T * h + 4 * T * heads + 2 * T * f + 2 * T * h)
    assert ops["act_bytes"] < 0.5 * none
    dev = H100.device
    recomputed = gemm_time_s(dev, T, kvd, h) + gemm_time_s(dev, T, h, h) + gemm_time_s(dev, T, f, h)
    assert ops["recompute_s"] > recomputed  # plus the element-wise ops
    assert ops["recompute_s"] < _layer("bf16", "full")["recompute_s"]


def test_chunked_and_fused_loss_logits_by_hand():
    layout = Layout.parse("mbs=2,gbs=2,seq=8192")
    T, V, h = 2 * 8192, 128256, 4096
    goal = get_goal("train")
    cl = parse_cluster("H200")
    logits = {loss: goal.evaluate(LLAMA8, cl, layout, loss=loss)["memory"]["breakdown"]["logits"]
              for loss in ("materialized", "fused", "chunked")}
    # Megatron-Core's unfused loss: bf16 logits + one fp32 copy (softmax, then gradient, in place)
    assert logits["materialized"] == pytest.approx(LOGITS_BYTES_PER_ELEM * T * V, abs=1)
    assert LOGITS_BYTES_PER_ELEM == 6.0  # 6 x 16,384 x 128,256 = 12.61e9 B, ~11.7 GiB
    assert logits["fused"] == pytest.approx(2 * T * V, abs=1)
    # torchtitan's ChunkedLossWrapper: one 1,024-token chunk at 14 B a logit (its bf16 logits beside the
    # torch loss's 12 B backward) = 1.839e9, + 6 B a token and hidden unit (the hidden states' bf16 chunk
    # copies and their fp32 gradient accumulator) = 0.403e9: 2.241e9, 17.8% of the materialized 12.61e9
    assert logits["chunked"] == pytest.approx(14 * 1024 * V + 6 * T * h, abs=1)
    assert 0.17 * logits["materialized"] < logits["chunked"] < 0.18 * logits["materialized"]
    # torchtitan counts chunks a micro-batch (loss_chunks=8: 2,048 tokens each); under TP2 the chunk's
    # logits are vocabulary-sharded and priced at 18 B a local logit (loss_parallel's 16 + the bf16 chunk)
    by_count = goal.evaluate(LLAMA8, cl, layout, loss="chunked", loss_chunks=8)["memory"]["breakdown"]["logits"]
    assert by_count == pytest.approx(14 * (T / 8) * V + 6 * T * h, abs=1)
    tp2_chunked = goal.evaluate(LLAMA8, parse_cluster("1x2xH200"), Layout.parse("tp=2,mbs=2,gbs=2,seq=8192"),
                                loss="chunked", loss_chunks=8)["memory"]["breakdown"]["logits"]
    assert tp2_chunked == pytest.approx(18 * (T / 8) * V / 2 + 6 * T * h, abs=1)
    # torch's cross entropy as torchtitan runs it: 12 B a logit, 16 B a local logit under TP's loss_parallel
    assert goal.evaluate(LLAMA8, cl, layout, loss="torch")["memory"]["breakdown"]["logits"] == pytest.approx(
        12 * T * V, abs=1)
    tp2 = goal.evaluate(LLAMA8, parse_cluster("1x2xH200"), Layout.parse("tp=2,mbs=2,gbs=2,seq=8192"), loss="torch")
    assert tp2["memory"]["breakdown"]["logits"] == pytest.approx(16 * T * V / 2, abs=1)


def test_memory_headroom_and_explicit_runtime_reserve():
    goal = get_goal("train")
    layout = Layout.parse("tp=8,pp=2,dp=4,mbs=1,gbs=64,seq=4096,zero=1")
    est = goal.evaluate(LLAMA8, parse_cluster("8x8xH100"), layout)
    mem = est["memory"]
    assert mem["headroom"] == 0.05 and mem["capacity_bytes"] == int(0.95 * mem["device_bytes"])
    # CUDA context 600 MiB + workspaces 256 MiB + 128 MiB per communicator (tp, dp, two pipeline neighbours)
    assert mem["breakdown"]["reserved_runtime"] == (600 + 256 + 4 * 128) * 2**20
    assert mem["breakdown"]["allocator_fragmentation"] > 0
    tight = goal.evaluate(LLAMA8, parse_cluster("8x8xH100"), layout, memory_headroom=0.0)
    assert tight["memory"]["capacity_bytes"] == tight["memory"]["device_bytes"]


def test_every_published_nemo_and_bridge_row_is_answered():
    cases = nemo_cases()
    assert len(cases) >= 40
    assert [c.name for c in cases if c.unanswered] == []
    systems = {c.cluster.device.name for c in cases}
    assert {"H100", "B200", "GB200", "GB300"} <= systems
    assert {c.layout.param_dtype for c in cases} == {"bf16", "fp8", "mxfp8"}
    assert any(c.layout.folded for c in cases)  # Qwen3-235B on GB200: TP2 x EP64 over 64 ranks


def test_memory_model_against_torchtitan_published_peaks():
    # reserved memory of Llama 3.1 8B runs that ran on 96 GB H100s (op-level SAC, full AC with CP up to 8)
    # and of Llama 3.1 70B on 256 (TP 8 x FSDP 32, full AC)
    cases = torchtitan_memory_cases()
    assert len(cases) == 7
    for case in cases:
        est = TrainCostModel(case.model, case.cluster, case.options).estimate(case.layout)
        assert est["fits"], case.name
        assert est["memory"]["peak_bytes"] == pytest.approx(case.published_bytes, rel=0.08), case.name
    # the op-SAC run as attention-core-only "selective" would not have fitted the device it ran on
    first = cases[0]
    sel = TrainCostModel(first.model, first.cluster, first.options).estimate(first.layout.replace(recompute="selective"))
    assert not sel["fits"] and sel["memory"]["peak_bytes"] > 1.3 * first.published_bytes
