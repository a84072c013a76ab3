"""``modelcarve hardware --probe``: what it writes is a cluster file the planner reads back, with
figures derived from the measurements by plan/cost/comm.py's own conventions; and a port in use is a
one-line refusal of ``serve`` before any rank starts.

The conversion is checked on hand-made timings (no wall-clock assertion); one real probe on two
gloo ranks checks that every figure is positive and that the file parses as a ClusterSpec
(``--probe-quick``: every measurement, the served models on fewer requests).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modelcarve.commands.probe.machine import cluster_dict, summarise
from modelcarve.commands.probe.served import overhead_from_steps
from modelcarve.plan.cost.comm import INTRA_EFFICIENCY

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _rank(r, ar_small, ar_large):
    return dict(rank=r, gemm_flops=dict(fp32=2e10, bf16=1e9), copy_bytes_per_s=4e9, gemv_bytes_per_s=3e9,
                comm=dict(all_reduce_small_s=ar_small, all_reduce_large_s=ar_large, all_to_all_small_s=1e-4,
                          all_to_all_large_s=0.01, send_recv_small_s=5e-5, send_recv_large_s=0.008,
                          small_bytes=8, large_bytes=16 << 20))


def test_summary_follows_plan_comm_conventions():
    # 4 ranks: all-reduce has 2(n-1) = 6 steps and moves 2(n-1)/n = 1.5 x the buffer per device
    probe = summarise([_rank(r, 6e-4, 0.03) for r in range(4)], ranks=4, threads=1)
    ar = probe["links"]["all_reduce"]
    assert ar["latency_s"] == pytest.approx(6e-4 / 6)
    assert ar["bus_bytes_per_s"] == pytest.approx(1.5 * (16 << 20) / 0.03)
    assert probe["links"]["all_to_all"]["latency_s"] == pytest.approx(1e-4 / 3)
    assert probe["links"]["send_recv"]["bus_bytes_per_s"] == pytest.approx((16 << 20) / 0.008)
    cluster = cluster_dict(probe)
    assert cluster["intra_link"]["bytes_per_s"] == pytest.approx(ar["bus_bytes_per_s"] / INTRA_EFFICIENCY)
    # achieved rates, marked so (efficiency 1): the GEMM rate and the GEMV weight-streaming rate
    assert cluster["device"]["peak_flops"]["fp32"] == 2e10 and cluster["device"]["hbm_bytes_per_s"] == 3e9
    assert cluster["device"]["gemm_efficiency"] == 1.0
    probe["engine"] = overhead_from_steps(3e-3, 10e-3, 1, 8)
    device = cluster_dict(probe)["device"]
    assert device["layer_overhead_s"] == pytest.approx(1e-3) and device["step_overhead_s"] == pytest.approx(2e-3)
    assert "pipeline_action_s" not in device  # no rank measured a pipeline gap


def test_pipeline_action_is_the_median_gap_over_the_ranks():
    # the first rank's forward gaps and the last rank's backward gaps, pooled: median of 5 values
    ranks = [_rank(r, 6e-4, 0.03) for r in range(2)]
    ranks[0]["pipeline_gaps"], ranks[1]["pipeline_gaps"] = [1e-4, 3e-4, 9e-3], [2e-4, 4e-4]
    probe = summarise(ranks, ranks=2, threads=1)
    assert probe["pipeline_action_s"] == pytest.approx(3e-4)
    assert cluster_dict(probe)["device"]["pipeline_action_s"] == pytest.approx(3e-4)


def test_engine_overhead_is_the_affine_fit_of_two_step_times():
    # t(L) = step + L x layer through (1, 3 ms) and (8, 10 ms): layer = 7 ms / 7 = 1 ms, step = 2 ms
    fit = overhead_from_steps(3e-3, 10e-3, 1, 8)
    assert fit["layer_overhead_s"] == pytest.approx(1e-3) and fit["step_overhead_s"] == pytest.approx(2e-3)
    # a noisy pair (the longer model measured faster) gives no negative cost
    fit = overhead_from_steps(3e-3, 2e-3, 1, 8)
    assert fit["layer_overhead_s"] == 1e-6 and fit["step_overhead_s"] == pytest.approx(3e-3 - 1e-6)


def test_probe_writes_a_cluster_file_the_planner_reads(tmp_path):
    from modelcarve.spec.hardware import parse_cluster

    out = tmp_path / "probed.yaml"
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", "hardware", "--probe", "--probe-quick", "--emit",
                           str(out), "--json"],
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cluster = parse_cluster(str(out))
    assert cluster.num_devices == 2
    assert cluster.device.peak_flops["fp32"] > 0 and cluster.device.hbm_bytes_per_s > 0
    assert cluster.intra_link.bytes_per_s > 0 and cluster.intra_link.latency_s > 0
    assert cluster.device.gemm_efficiency == 1.0
    assert cluster.device.step_overhead_s > 0 and cluster.device.layer_overhead_s > 0
    assert cluster.device.pipeline_action_s > 0  # the runtime's own pp=2 GPipe on the two ranks
    served = json.loads(proc.stdout)["probe"]["served"]
    # the client's TTFT span holds the server's: the HTTP share of each tp=1 pass (one per model) is > 0
    assert len(served["http_passes_s"]) == 2 and all(h > 0 for h in served["http_passes_s"])
    assert served["http_s"] == pytest.approx(sum(served["http_passes_s"]) / 2)


def test_server_histogram_means_read_back_from_metrics():
    from modelcarve.serve.metrics import ServerMetrics, histogram_mean, server_ttft_tpot_means

    m = ServerMetrics("probe")
    assert server_ttft_tpot_means(m.render().decode()) == {"ttft": (0.0, 0.0), "tpot": (0.0, 0.0)}
    m.finished(reason="stop", prompt_tokens=3, generated=5, ttft_s=0.25, e2e_s=1.25)  # TPOT (1.25 - 0.25) / 4
    m.finished(reason="length", prompt_tokens=3, generated=3, ttft_s=0.5, e2e_s=1.5)  # TPOT 0.5
    got = server_ttft_tpot_means(m.render().decode())
    assert got == {"ttft": (0.75, 2.0), "tpot": (0.75, 2.0)}
    m.finished(reason="stop", prompt_tokens=3, generated=2, ttft_s=0.125, e2e_s=0.375)  # TPOT 0.25
    later = server_ttft_tpot_means(m.render().decode())
    assert histogram_mean(got, later, "ttft") == 0.125 and histogram_mean(got, later, "tpot") == 0.25
    assert histogram_mean(later, later, "ttft") is None  # nothing observed between the two reads


def test_serve_refuses_a_port_in_use_before_any_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", "serve", "--model", "tiny-llama", "--layout",
                               "tp=2", "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], proc.stderr


def test_a_probe_server_that_dies_says_why():
    """A served probe model that dies before answering is refused in one line that quotes the server's
    own last words (its output goes to a log the probe reads), and the log is removed."""
    from modelcarve.commands.probe.served import _Served
    from modelcarve.spec.errors import ModelcarveError

    served = _Served("/nonexistent/tiny-1.json", 1, tp=1)
    with pytest.raises(ModelcarveError, match=r"\(tp=1\) failed \(exit code 1\): .*no such config file"):
        with served:
            pass
    assert served.log is None
