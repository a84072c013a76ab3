"""The serving planner on a probed device (``hardware --probe``'s cluster file): achieved rates are
used as they are (no GPU-fitted efficiency on top), the engine's measured per-step and per-layer
host costs are added to every engine step, the plan broadcast costs the link's alpha on several
ranks, and ``estimate`` costs the weight/KV dtypes the engine runs (param_dtype when unstated).

Every expected figure is derived by hand from the cluster's numbers and the model's shape (a
tiny llama: hidden 256, 4 layers, FFN 512, vocabulary 1000, untied); the planner's own
arithmetic is the same sums in another order, so equalities hold to rounding (rel 1e-9).
"""

from __future__ import annotations

import math

import pytest

from modelcarve.plan.serve.rates import gemm_efficiency
from modelcarve.plan.serve.time import serve_time
from modelcarve.spec.hardware import cluster_from_dict, parse_cluster
from modelcarve.spec.hf_config import spec_from_hf_config

H, L, F, V = 256, 4, 512, 1000
GEMM, GEMV, STEP, LAYER, ALPHA = 2e10, 1e10, 1.5e-3, 0.8e-3, 2.5e-4


def _model():
    return spec_from_hf_config(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
                                    intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=V, max_position_embeddings=512,
                                    tie_word_embeddings=False), name="tiny")


def _cluster(devices=1, step=STEP, layer=LAYER, efficiency=1.0, peer=0.0):
    device = dict(name="cpu-probed", memory_bytes=8 << 30, peak_flops=dict(fp32=GEMM, bf16=GEMM / 30, tf32=GEMM),
                  hbm_bytes_per_s=GEMV, gemm_efficiency=efficiency, step_overhead_s=step, layer_overhead_s=layer)
    link = dict(name="gloo", bytes_per_s=1e9, latency_s=ALPHA, peer_latency_s=peer)
    return cluster_from_dict(dict(nodes=1, devices_per_node=devices, device=device, intra_link=link,
                                  inter_link=dict(link), nics_per_node=1), "probed")


def _matmul_params():
    # per layer q, k, v, o (4 h^2) and gate, up, down (3 h F); the LM head h V (the input
    # embedding is a lookup, not a GEMM)
    return L * (4 * H * H + 3 * H * F) + H * V


def test_achieved_rates_get_no_efficiency_model():
    device = _cluster().device
    assert gemm_efficiency(device, 1, 4 * H, H, "fp32") == 1.0
    assert gemm_efficiency(device, 64, 4 * H, H, "fp32") == 1.0
    # a catalogue device keeps its fitted model (below 1; the same call)
    h100 = parse_cluster("H100").device
    assert gemm_efficiency(h100, 64, 4 * H, H, "bf16") < 0.5


def test_decode_step_is_weight_read_at_probed_rate_plus_measured_overheads():
    """tp=1, batch 1, fp32: the weights the step reads (all but the input embedding: 4 bytes x
    matmul params and norms) over the probed GEMV rate, plus L x layer + step; attention over a ~70-token
    context and activations are what remains (bounded below by 2% here: KV 4 x 2 x H x L x 72 bytes
    = 590 kB against 13.6 MB of weights, 4%; so compare the decode parts, which itemise them)."""
    t = serve_time(_model(), _cluster(), weight_dtype="fp32", kv_dtype="fp32", batch=1, input_len=64, output_len=16)
    parts = t.decode_parts
    # plus the 2L + 1 RMSNorm weight vectors of H values
    assert t.weights_read_bytes == pytest.approx(4 * (_matmul_params() + (2 * L + 1) * H), rel=1e-9)
    assert parts["overhead"] == pytest.approx(L * LAYER, rel=1e-9)
    assert parts["step"] == pytest.approx(STEP, rel=1e-9)  # one rank: no plan broadcast
    assert parts["memory"] >= 4 * _matmul_params() / GEMV
    assert t.decode_step_s == pytest.approx(parts["roofline"] + L * LAYER + STEP, rel=1e-9)
    # the step overhead is added once, exactly
    bare = serve_time(_model(), _cluster(step=0.0), weight_dtype="fp32", kv_dtype="fp32", batch=1, input_len=64,
                      output_len=16)
    assert t.tpot_s - bare.tpot_s == pytest.approx(STEP, rel=1e-6)


def test_plan_broadcast_on_two_ranks_costs_one_alpha():
    """tp=2: ModelRunner.broadcast sends a decode step's plan as one message (its length and bytes):
    ceil(log2 2) = 1 alpha; on 4 ranks a tree of ceil(log2 4) = 2."""
    t = serve_time(_model(), _cluster(devices=2), tp=2, weight_dtype="fp32", kv_dtype="fp32", batch=1,
                   input_len=64, output_len=16)
    assert t.decode_parts["step"] == pytest.approx(STEP + math.ceil(math.log2(2)) * ALPHA, rel=1e-9)
    from modelcarve.plan.serve.rates import engine_step_s

    assert engine_step_s(_cluster(devices=4), 2, 2, 1) == pytest.approx(STEP + 2 * ALPHA, rel=1e-9)
    # the two TP all-reduces per layer are the probed link's alpha-beta (n = 2: one-shot = 2 alpha +
    # h x 2 bytes / beta), and the logits all-gather on top: at least 2 L x 2 alpha
    assert t.decode_parts["tp"] >= 2 * L * 2 * ALPHA


def test_prefill_is_flops_over_achieved_rate_plus_one_step_of_overheads():
    """64-token prompt, one chunk: FLOPs per token 2 x matmul params (the LM head on the last row
    only) + causal attention 2 x (64/2) x (heads x 2 head_dim = 2H) x L, over the achieved fp32 rate,
    plus the chunk's weight read at the probed GEMV rate (a CPU core does both: they add); plus one
    engine step's overheads."""
    n = 64
    t = serve_time(_model(), _cluster(), weight_dtype="fp32", kv_dtype="fp32", batch=1, input_len=n, output_len=16)
    flops = n * (2 * (_matmul_params() - H * V) + 2 * (n / 2) * 2 * H * L) + 2 * H * V
    compute = flops / GEMM
    read = 4 * (_matmul_params() + (2 * L + 1) * H) / GEMV
    assert t.prefill_s == pytest.approx(compute + read + L * LAYER + STEP, rel=1e-9)
    assert t.ttft_s == t.prefill_s


def test_catalogue_devices_are_unchanged_by_the_new_terms():
    """No probed fields: step 0, prefill without host overheads (test_serve_time.py checks the figures)."""
    t = serve_time(_model(), parse_cluster("H100"), batch=1, input_len=64, output_len=16)
    assert t.decode_parts["step"] == 0.0


@pytest.mark.parametrize("text", ["tp=2", "tp=2,param_dtype=fp32", "pp=2,param_dtype=fp32,weight_dtype=int8",
                                  "param_dtype=fp16,kv_dtype=fp8", "tp=1,param_dtype=fp32,weight_dtype=bf16,kv_dtype=bf16"])
def test_estimate_resolves_dtypes_as_the_engine_does(text):
    """The oracle is the engine's own resolution (runtime/engine/engine.py resolve_layout)."""
    from modelcarve.commands.planning.serving_plan import engine_dtypes
    from modelcarve.runtime.engine.engine import resolve_layout
    from modelcarve.spec.layout import Layout

    _, weight, kv = resolve_layout(text)
    ours = engine_dtypes(text, Layout.parse(text))
    assert (ours.weight_dtype, ours.kv_dtype) == (weight, kv)


def test_tp_collectives_take_the_peer_latency_the_plan_broadcast_the_links():
    """tp=2 on a link with a peer latency P = 30 us (the engine's shared-memory all-reduce) beside
    its alpha 250 us (a gloo message): each of the 2L decode all-reduces of one token's hidden state
    (S = ACT_BYTES x H: the planner's activation width, 2) is the one-shot 2 P + S / bw (the ring
    would be 2 alpha + S / bw); the logits' gather (n - 1) P + (V x ACT_BYTES) / 2 / bw; the plan's
    broadcast stays one alpha on the step."""
    from modelcarve.plan.cost.comm import INTRA_EFFICIENCY
    from modelcarve.plan.serve.memory import ACT_BYTES

    bw = 1e9 * INTRA_EFFICIENCY
    peer = 30e-6
    t = serve_time(_model(), _cluster(devices=2, peer=peer), tp=2, weight_dtype="fp32", kv_dtype="fp32", batch=1,
                   input_len=64, output_len=16)
    one_shot = 2 * peer + ACT_BYTES * H / bw
    gather = peer + ACT_BYTES * V / 2 / bw
    assert t.decode_parts["tp"] == pytest.approx(2 * L * one_shot + gather, rel=1e-9)
    assert t.decode_parts["step"] == pytest.approx(STEP + ALPHA, rel=1e-9)
