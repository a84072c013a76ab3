"""Memory per device against hand derivations: ZeRO model states (Rajbhandari et al. 2020),
activations per layer (Korthikanti et al. 2022), micro-batches in flight per schedule."""

import pytest

from modelcarve.plan.cost.activations import layer_activation_bytes
from modelcarve.plan.train.calibration import megatron_gpt
from modelcarve.plan.cost.schedule import in_flight_microbatches
from modelcarve.plan.train.model import TrainCostModel, TrainOptions, model_state_bytes_per_param
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout


@pytest.mark.parametrize("n", [1, 2, 8, 64, 1000])
def test_mixed_precision_adam_bytes_per_parameter_by_zero_stage(n):
    # fp16/bf16 weights and gradients, fp32 master + two moments: 2 + 2 + 12 (ZeRO paper, Fig. 1)
    kw = dict(param_dtype="bf16", grad_dtype="bf16", optim_dtype="fp32")
    assert model_state_bytes_per_param(0, n, **kw) == pytest.approx(16)
    assert model_state_bytes_per_param(1, n, **kw) == pytest.approx(4 + 12 / n)
    assert model_state_bytes_per_param(2, n, **kw) == pytest.approx(2 + 14 / n)
    assert model_state_bytes_per_param(3, n, **kw) == pytest.approx(16 / n)


def test_fp32_gradients_and_pure_fp32():
    # Megatron keeps fp32 main gradients: 2 + 4 + 12; pure fp32 training has no separate master copy
    assert model_state_bytes_per_param(0, 1, "bf16", "fp32", "fp32") == 18
    assert model_state_bytes_per_param(0, 1, "fp32", "fp32", "fp32") == 16


GPT = megatron_gpt(hidden=12288, layers=96, heads=96)  # GPT-3 175B shape
s, b, h, a = 2048, 1, 12288, 96


def act(**kw):
    base = dict(tokens=s * b, seq_ctx=s, attention="materialized", dropout=True)
    base.update(kw)
    return layer_activation_bytes(GPT, **base)


def test_activations_per_layer_no_parallelism_is_sbh_34_plus_5as_over_h():
    assert act() == pytest.approx(s * b * h * (34 + 5 * a * s / h))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_activations_with_tensor_parallelism(t):
    # Korthikanti et al. 2022, Eq. 2: sbh (10 + 24/t + 5as/(ht))
    assert act(tp=t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


@pytest.mark.parametrize("t", [2, 8])
def test_activations_with_sequence_parallelism_and_recomputation(t):
    # Eq. 4: sbh/t (34 + 5as/h); selective recomputation drops the 5as/h term; full keeps 2sbh
    assert act(tp=t, sp=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert act(tp=t, sp=True, recompute="selective") == pytest.approx(s * b * h * 34 / t)
    assert act(tp=t, recompute="full") == pytest.approx(2 * s * b * h)
    assert act(tp=t, sp=True, recompute="full") == pytest.approx(2 * s * b * h / t)


def test_flash_attention_without_dropout_has_no_s_squared_term():
    flash = act(tp=8, sp=True, attention="flash", dropout=False)
    # 34 - 2 (dropout masks) = 32 sbh/t, plus the fp32 log-sum-exp per query and head
    assert flash == pytest.approx(s * b * h * 32 / 8 + 4 * s * b * a / 8)


def test_micro_batches_in_flight_by_schedule():
    assert in_flight_microbatches("1f1b", p=8, m=64) == 8
    assert in_flight_microbatches("1f1b", p=8, m=4) == 4
    assert in_flight_microbatches("gpipe", p=8, m=64) == 64
    assert in_flight_microbatches("interleaved-1f1b", p=8, m=64, v=2) == pytest.approx(8 + 7 / 2)
    assert in_flight_microbatches("1f1b", p=8, m=64, stage=7) == 1


def test_estimate_model_states_match_hand_count():
    # GPT-3 175B, TP8 PP8 DP16 ZeRO-1, bf16 params, fp32 grads, fp32 Adam
    cluster = parse_cluster("128x8xA100-80GB")
    layout = Layout.parse("tp=8,pp=8,dp=16,zero=1,mbs=1,gbs=1536,seq=2048,recompute=full")
    est = TrainCostModel(GPT, cluster, TrainOptions(global_batch=1536, seq=2048)).estimate(layout)
    # 1F1B: the first stage holds p micro-batches of activations and the embedding: the worst
    assert est["memory"]["worst_stage"] == "first"
    # its parameters: 12 layers split over TP but for the LayerNorms, the vocab-parallel
    # embedding and the (replicated) learned position table
    layer = GPT.dense_layer_params
    norms = 2 * 2 * h  # two LayerNorms, replicated over TP
    first = 12 * (layer - norms) / 8 + 12 * norms + 51200 * h / 8 + 2048 * h
    bd = est["memory"]["breakdown"]
    assert bd["weights"] == pytest.approx(2 * first, rel=1e-6)
    assert bd["gradients"] == pytest.approx(4 * first, rel=1e-6)
    assert bd["optimizer_states"] == pytest.approx(12 * first / 16, rel=1e-6)
    # activations: 8 micro-batches in flight x 12 layers x 2sbh (full recomputation, no SP)
    assert bd["activations"] == pytest.approx(8 * 12 * 2 * s * b * h, rel=1e-6)
    assert est["memory"]["peak_bytes"] == sum(bd.values())
    assert est["fits"] == (est["memory"]["peak_bytes"] <= est["memory"]["capacity_bytes"])


def test_moe_expert_weights_shard_over_ep_and_expert_data_parallel_group():
    # Mixtral 8x7B, PP4 TP1 DP16 EP8, ZeRO-1 over dp=16: experts split 8 ways, their optimizer
    # state over the expert-data-parallel group of 16/8 = 2; dense weights' state over 16
    from modelcarve.spec.catalog import get_model

    model = get_model("mixtral-8x7b")
    cluster = parse_cluster("8x8xH100")
    layout = Layout.parse("pp=4,dp=16,ep=8,zero=1,mbs=1,gbs=256,seq=4096,schedule=interleaved,v=8")
    est = TrainCostModel(model, cluster, TrainOptions(global_batch=256, seq=4096)).estimate(layout)
    h, V = model.hidden_size, model.vocab_size
    per_layer_dense = model.attention_params + model.router_params + 2 * h  # two RMSNorms
    experts = 8 * model.expert_params / 8  # one expert per rank
    stage = est["memory"]["worst_stage"]
    dense = 8 * per_layer_dense + {"first": V * h, "last": V * h + h, "middle": 0}[stage]
    bd = est["memory"]["breakdown"]
    assert bd["weights"] == pytest.approx(2 * (dense + 8 * experts), rel=1e-9)
    assert bd["gradients"] == pytest.approx(4 * (dense + 8 * experts), rel=1e-9)
    assert bd["optimizer_states"] == pytest.approx(12 * (dense / 16 + 8 * experts / 2), rel=1e-9)


def test_zero3_shards_over_dp_times_cp_and_hsdp_over_its_shard_group():
    cluster = parse_cluster("8x8xA100-80GB")
    cost = TrainCostModel(GPT, cluster, TrainOptions(global_batch=64, seq=4096))
    total = GPT.total_params
    fsdp = cost.estimate(Layout.parse("dp=32,cp=2,zero=3,mbs=1,gbs=64,seq=4096,recompute=full"))
    # pp=1: one stage holds every parameter; ZeRO-3 shards all 16+2 bytes over dp x cp = 64
    bd = fsdp["memory"]["breakdown"]
    assert bd["weights"] + bd["gradients"] + bd["optimizer_states"] == pytest.approx(18 * total / 64, rel=1e-9)
    hsdp = cost.estimate(Layout.parse("dp=32,cp=2,hsdp=8,mbs=1,gbs=64,seq=4096,recompute=full"))
    # 8 replicas of a 4-way shard group (x cp = 8)
    bd = hsdp["memory"]["breakdown"]
    assert bd["weights"] + bd["gradients"] + bd["optimizer_states"] == pytest.approx(18 * total / 8, rel=1e-9)
    assert hsdp["comm"]["link_by_axis"]["dp"] == "inter"


def test_mla_moe_layer_activations_by_hand():
    # Kimi K2 (MLA + 384 experts, 8 routed + 1 shared), one MoE layer, tp=1, flash, no dropout
    from modelcarve.spec.catalog import get_model

    m = get_model("kimi-k2")
    T, imb = 4096, 1.25
    h, nh = m.hidden_size, m.num_heads
    dqk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    expected = (
        4 * T * h                                             # two norm inputs
        + 2 * T * h                                           # attention input
        + 4 * T * (m.q_lora_rank + m.kv_lora_rank) + 2 * T * m.qk_rope_head_dim  # latents and their norms
        + 2 * T * nh * (2 * dqk + dv)                         # per-head Q, K, V
        + 4 * T * nh                                          # flash log-sum-exp (fp32)
        + 2 * T * nh * dv                                     # output projection input
        + 2 * T * h                                           # MoE input
        + 4 * T * m.num_experts                               # fp32 router logits
        + 2 * T * m.top_k * imb * h                           # token copies sent to the experts (fc1 input)
        + 6 * T * m.top_k * imb * m.expert_ffn_size           # routed SwiGLU intermediates
        + 6 * T * m.num_shared_experts * m.expert_ffn_size    # shared expert
    )
    kw = dict(tokens=T, seq_ctx=T, tp=1, moe=True, attention="flash", dropout=False, expert_tokens_factor=imb)
    # Megatron-Core 0.13+: the router's weights multiply the expert activation, the combine keeps nothing
    assert layer_activation_bytes(m, **kw) == pytest.approx(expected)
    # before 0.13 (and torchtitan's score-before-experts): the combine keeps the experts' outputs too
    old = layer_activation_bytes(m, probs_on_combine=True, **kw)
    assert old - layer_activation_bytes(m, **kw) == pytest.approx(2 * T * m.top_k * imb * h)


def test_fp8_param_gather_holds_fp8_weights_and_no_bf16_copy():
    # GPT-3 175B TP8 PP8 DP16 ZeRO-1, FP8 with current scaling, bf16 gradient buffers (Megatron-Bridge's
    # performance presets: fp8_param_gather, grad_reduce_in_fp32=False): on the first stage the 12
    # layers' linear weights are FP8 row- + column-wise (2 B) with no bf16 copy beside them, the rest
    # (norms, biases, embedding, position table) stays bf16
    cluster = parse_cluster("128x8xH100")
    text = "tp=8,pp=8,dp=16,zero=1,mbs=1,gbs=1536,seq=2048,recompute=full,param_dtype=fp8,fp8_scaling=current"
    layout = Layout.parse(text + ",grad_dtype=bf16")
    base = TrainCostModel(GPT, cluster, TrainOptions(global_batch=1536, seq=2048))
    fp8w = TrainCostModel(GPT, cluster, TrainOptions(global_batch=1536, seq=2048, fp8_param_gather=True))
    norms = 2 * 2 * h
    est, ref = fp8w.estimate(layout), base.estimate(layout)
    assert est["memory"]["worst_stage"] == ref["memory"]["worst_stage"] == "first"
    first = 12 * (GPT.dense_layer_params - norms) / 8 + 12 * norms + 51200 * h / 8 + 2048 * h
    bd, rb = est["memory"]["breakdown"], ref["memory"]["breakdown"]
    lin = rb["fp8_weight_cache"] / 2.0  # TE's cache: 2 B a linear parameter (bf16 weights beside it)
    assert rb["weights"] == pytest.approx(2 * first, rel=1e-9)
    assert bd["weights"] == pytest.approx(2 * (first - lin), rel=1e-9)
    assert bd["fp8_weight_cache"] == rb["fp8_weight_cache"]
    assert bd["gradients"] == rb["gradients"] == pytest.approx(2 * first, rel=1e-9)  # bf16 gradient buffer
    assert bd["optimizer_states"] == rb["optimizer_states"] == pytest.approx(12 * first / 16, rel=1e-9)
    # the distributed optimizer all-gathers the FP8 data (1 B) of the linear weights, bf16 of the rest
    # (ring all-gather over 16 ranks: each sends 15/16 of the gathered bytes): 1 B less a linear parameter
    saved = ref["comm"]["bytes_per_step_by_axis"]["dp"] - est["comm"]["bytes_per_step_by_axis"]["dp"]
    assert saved == pytest.approx(lin * 15 / 16, abs=2)
    # ZeRO-3 (Megatron-FSDP) is not modelled under FP8 weights: unchanged
    z3 = Layout.parse(text.replace("zero=1", "zero=3"))
    assert fp8w.estimate(z3)["memory"]["breakdown"] == base.estimate(z3)["memory"]["breakdown"]


def test_context_parallel_ring_buffers_by_hand():
    # Transformer Engine's p2p ring attention holds, for one layer, every K+V chunk the forward receives
    # (cp of them) or, in the backward, two send / receive buffers of a K+V chunk and its gradient plus a
    # dQ buffer: the larger. DeepSeek-V3 (MLA: 128 heads, q/k 192, v 128), CP4 of 4,096 tokens, tp=1
    from modelcarve.plan.train.profile import cp_ring_bytes
    from modelcarve.spec.catalog import get_model

    ds = get_model("deepseek-v3")
    T = 4096 / 4
    kv = 2 * T * 128 * (192 + 128)          # bf16 K and V of the local chunk: 80 MiB
    q = 2 * T * 128 * 192
    assert cp_ring_bytes(ds, T, 1, 4) == max(4 * kv, 4 * kv + q) == 385_875_968
    # GQA shares its 8 KV heads: Llama 3.1 70B at TP8 keeps one, CP2 of 8,192 tokens
    llama = get_model("llama-3.1-70b")
    kv, q = 2 * 4096 * 1 * (128 + 128), 2 * 4096 * 64 / 8 * 128
    assert cp_ring_bytes(llama, 4096, 8, 2) == max(2 * kv, 4 * kv + q)
    # the estimate's comm buffers carry it, beside the pipeline / MoE buffers and the gradient buckets
    cluster = parse_cluster("16x8xH100")
    cost = TrainCostModel(ds, cluster, TrainOptions(global_batch=960, seq=4096))
    est = cost.estimate(Layout.parse("cp=4,pp=16,dp=2,ep=8,zero=1,mbs=1,gbs=960,seq=4096"))
    with_ring, without = cost.screen_buffers(T, 1, 16, 8, False, 4, 1)[1], cost.screen_buffers(T, 1, 16, 8, False, 1, 1)[1]
    assert with_ring - without == cp_ring_bytes(ds, T, 1, 4)
    assert est["memory"]["breakdown"]["comm_buffers"] == pytest.approx(with_ring + 2 * 40e6, rel=1e-12)


def test_moe_dispatch_buffers_hold_the_tokens_the_expert_shards_see():
    # Mixtral 8x7B at TP2 with EP4: expert TP 2 (each expert split like the dense layers) all-gathers the
    # received tokens over the expert-TP group, so a device's dispatch buffers hold T k etp / tp routed
    # tokens, sent and combined back in bf16 (x the load imbalance), as the expert activations count them
    from modelcarve.spec.catalog import get_model

    m = get_model("mixtral-8x7b")
    cost = TrainCostModel(m, parse_cluster("2x8xH100"), TrainOptions(global_batch=64, seq=4096))
    T, h, k, imb = 4096.0, m.hidden_size, m.top_k, cost.options.load_imbalance
    base = cost.screen_buffers(T, 2, 1, 1, True, 1, 2)[1]  # no EP: no dispatch buffers
    for etp in (1, 2):
        got = cost.screen_buffers(T, 2, 1, 4, True, 1, etp)[1] - base
        assert got == pytest.approx(2 * 2 * T * k * etp / 2 * h * imb, rel=1e-12)
