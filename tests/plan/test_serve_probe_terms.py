"""The terms that bring the serving planner to the server on a probed CPU (issue 31), each against a
figure derived by hand from the cluster's numbers and the model's shape:

* ``request_overhead_s`` (measured by ``hardware --probe`` on a served tiny model) is added once to
  a lone prompt's TTFT, not to TPOT, and not on catalogue devices;
* a tied LM head reads the embedding table every decode step (``vocab x hidden x 4`` bytes in fp32),
  though the table is held once;
* a prefill runs the LM head on each prompt's last row only (the one that samples);
* on a probed device a prefill chunk's weight read and its arithmetic add (one core does both);
* the probe's served fit: ``t(L) = step + L x layer`` through the served TPOTs, and the request path
  is the 1-layer TTFT less its step.

Model: a tiny llama (hidden 256, 4 layers, FFN 512, vocabulary 1000, 4 heads), fp32, tp=1, batch 1,
64-token prompts. Equalities hold to rounding (rel 1e-9): the planner sums the same terms.
"""

from __future__ import annotations

import pytest

from modelcarve.commands.probe.machine import cluster_dict
from modelcarve.commands.probe.served import overhead_from_steps
from modelcarve.commands.probe.served import engine_message_s
from modelcarve.plan.serve.time import serve_time
from modelcarve.spec.hardware import cluster_from_dict, parse_cluster
from modelcarve.spec.hf_config import spec_from_hf_config

H, L, F, V, N = 256, 4, 512, 1000, 64
GEMM, GEMV, STEP, LAYER, REQUEST = 2e10, 1e10, 1.5e-3, 0.8e-3, 3e-3


def _model(tied: bool):
    return spec_from_hf_config(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
                                    intermediate_size=F, num_hidden_layers=L, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=V, max_position_embeddings=512,
                                    tie_word_embeddings=tied), name="tiny")


def _cluster(request=REQUEST):
    device = dict(name="cpu-probed", memory_bytes=8 << 30, peak_flops=dict(fp32=GEMM, bf16=GEMM / 30, tf32=GEMM),
                  hbm_bytes_per_s=GEMV, gemm_efficiency=1.0, step_overhead_s=STEP, layer_overhead_s=LAYER,
                  request_overhead_s=request)
    link = dict(name="gloo", bytes_per_s=1e9, latency_s=2.5e-4)
    return cluster_from_dict(dict(nodes=1, devices_per_node=1, device=device, intra_link=link, inter_link=dict(link),
                                  nics_per_node=1), "probed")


LAYERS_P = L * (4 * H * H + 3 * H * F)  # q, k, v, o and gate, up, down
NORMS_P = (2 * L + 1) * H
HEAD_P = V * H


def _time(tied=False, request=REQUEST):
    return serve_time(_model(tied), _cluster(request), weight_dtype="fp32", kv_dtype="fp32", batch=1, input_len=N,
                      output_len=16)


def test_request_overhead_is_added_once_to_ttft_only():
    with_path, without = _time(), _time(request=0.0)
    assert with_path.ttft_s - without.ttft_s == pytest.approx(REQUEST, rel=1e-9)
    assert with_path.prefill_s - without.prefill_s == pytest.approx(REQUEST, rel=1e-9)
    assert with_path.tpot_s == without.tpot_s
    # a catalogue device has no request path (no field): its TTFT is its prefill
    h100 = serve_time(_model(False), parse_cluster("H100"), batch=1, input_len=N, output_len=16)
    assert h100.ttft_s == h100.prefill_s


def test_tied_head_reads_the_embedding_table_every_decode_step():
    """Untied: layers + norms + head (V x H) are read; tied: the same bytes, the head being the
    embedding table (held once, as the embedding, so weights_bytes has no head)."""
    untied, tied = _time(tied=False), _time(tied=True)
    assert untied.weights_read_bytes == pytest.approx(4 * (LAYERS_P + NORMS_P + HEAD_P), rel=1e-9)
    assert tied.weights_read_bytes == pytest.approx(4 * (LAYERS_P + NORMS_P + HEAD_P), rel=1e-9)
    # the step's memory side: those bytes (plus the KV and activations) at the probed GEMV rate
    assert tied.decode_parts["memory"] >= 4 * (LAYERS_P + NORMS_P + HEAD_P) / GEMV


def test_prefill_is_flops_plus_weight_read_with_the_head_on_the_last_row():
    """Prefill of one 64-token prompt, one chunk: FLOPs = 64 x (2 x layer params + causal attention
    2 x (64/2) x 2H x L) + 2 x V x H (the head, one row) over the GEMM rate; weight read = layers +
    norms + head at the GEMV rate (added: one core streams and computes); then L x layer + step;
    and the request path."""
    flops = N * (2 * LAYERS_P + 2 * (N / 2) * 2 * H * L) + 2 * HEAD_P
    read = 4 * (LAYERS_P + NORMS_P + HEAD_P) / GEMV
    expect = flops / GEMM + read + L * LAYER + STEP + REQUEST
    assert _time(tied=False).prefill_s == pytest.approx(expect, rel=1e-9)
    assert _time(tied=True).prefill_s == pytest.approx(expect, rel=1e-9)  # the tied head is read the same


def test_catalogue_prefill_keeps_the_head_on_every_row_and_the_roofline_max():
    """GPU devices keep the accounting their constants were fitted with: the head's FLOPs on every
    prompt token, and max(compute, read) (tests/plan/test_serve_time.py derives the figure)."""
    h100 = parse_cluster("H100")
    a = serve_time(_model(False), h100, batch=1, input_len=N, output_len=16)
    b = serve_time(_model(True), h100, batch=1, input_len=N, output_len=16)
    assert b.weights_read_bytes < a.weights_read_bytes  # no tied-head read on catalogue devices


def test_probe_served_fit_and_request_path():
    """Served TPOTs 0.5 ms (1 layer) and 1.6 ms (8 layers): layer = 1.1 / 7 ms, step = 0.5 ms - layer;
    TTFT of the 1-layer model 4.3 ms: the request path is 4.3 - 0.5 = 3.8 ms. The cluster file takes
    the served figures over the bare engine's."""
    served = overhead_from_steps(0.5e-3, 1.6e-3, 1, 8)
    assert served["layer_overhead_s"] == pytest.approx(1.1e-3 / 7)
    assert served["step_overhead_s"] == pytest.approx(0.5e-3 - 1.1e-3 / 7)
    served["request_overhead_s"] = 4.3e-3 - 0.5e-3
    probe = dict(ranks=2, threads_per_rank=1, host="h", gemm_flops=dict(fp32=2e11, bf16=1e11), gemv_bytes_per_s=1e10,
                 links=dict(all_reduce=dict(latency_s=1e-4, bus_bytes_per_s=1e9)),
                 engine=overhead_from_steps(0.3e-3, 1.3e-3, 1, 8), served=served)
    device = cluster_dict(probe)["device"]
    assert device["step_overhead_s"] == pytest.approx(served["step_overhead_s"])
    assert device["layer_overhead_s"] == pytest.approx(served["layer_overhead_s"])
    assert device["request_overhead_s"] == pytest.approx(3.8e-3)
    # and it reads back as a cluster file
    cluster = cluster_from_dict(cluster_dict(probe), "probed")
    assert cluster.device.request_overhead_s == pytest.approx(3.8e-3)


def test_link_latencies_are_the_served_engines():
    """Served per-layer cost 0.15 ms at tp=1 and 3.25 ms at tp=2: two all-reduces per layer, so one
    costs (3.25 - 0.15) / 2 = 1.55 ms, over a one-shot's 2 steps: peer_latency_s = 0.775 ms. The
    served step's fixed cost: tp=1 0.5 - 0.15 = 0.35 ms, tp=2 5.7 - 3.25 = 2.45 ms; the 2.1 ms more is
    one gloo message (the plan broadcast) and two more all-reduces (embedding, logits), so a
    message costs 2.1 - 2 x 1.55 < 0: clamped to 1 us; with tp=2's step at 7.575 ms (fixed
    4.325 ms) it is 3.975 - 3.1 = 0.875 ms: latency_s (not the back-to-back gloo loop's 0.1 ms).
    Without a served tp run: the loop's alpha and no peer latency."""
    served = overhead_from_steps(0.5e-3, 1.55e-3, 1, 8)
    probe = dict(ranks=2, threads_per_rank=1, host="h", gemm_flops=dict(fp32=2e11, bf16=1e11), gemv_bytes_per_s=1e10,
                 links=dict(all_reduce=dict(latency_s=1e-4, bus_bytes_per_s=1e9)), served=served)
    served.update(request_overhead_s=3e-3)
    for t1, message in ((5.7e-3, 1e-6), (7.575e-3, 0.875e-3)):
        tp = overhead_from_steps(t1, t1 + 7 * 3.25e-3, 1, 8)
        ar = (tp["layer_overhead_s"] - served["layer_overhead_s"]) / 2
        assert ar == pytest.approx(1.55e-3)
        tp.update(tp=2, engine_all_reduce_s=ar, engine_message_s=engine_message_s(served, tp, ar))
        served["tp"] = tp
        link = cluster_dict(probe)["intra_link"]
        assert link["peer_latency_s"] == pytest.approx(0.775e-3)
        assert link["latency_s"] == pytest.approx(message)
        cluster = cluster_from_dict(cluster_dict(probe), "probed")  # the field reads back
        assert cluster.intra_link.peer_latency_s == pytest.approx(0.775e-3)
    del served["tp"]
    link = cluster_dict(probe)["intra_link"]
    assert link["latency_s"] == pytest.approx(1e-4) and "peer_latency_s" not in link


def test_serving_tp_all_reduce_takes_the_peer_latency():
    """A 3,072-byte all-reduce over 2 ranks on a link of 1 GB/s (x INTRA_EFFICIENCY), gloo alpha
    1 ms, peer alpha 20 us: the one-shot all-reduce costs 2 x 20 us + 3,072 B / bw, not the ring's
    2 x 1 ms; with no peer latency the one-shot takes the link's alpha (2 ms + the bytes)."""
    from modelcarve.plan.cost import comm
    from modelcarve.plan.serve.rates import tp_all_reduce_s

    bw = 1e9 * comm.INTRA_EFFICIENCY
    with_peer = comm.Tier(name="intra", bytes_per_s=bw, latency_s=1e-3, peer_latency_s=20e-6)
    assert tp_all_reduce_s(3072, 2, with_peer) == pytest.approx(2 * 20e-6 + 3072 / bw)
    without = comm.Tier(name="intra", bytes_per_s=bw, latency_s=1e-3)
    assert tp_all_reduce_s(3072, 2, without) == pytest.approx(2 * 1e-3 + 3072 / bw)
