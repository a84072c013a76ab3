"""Disaggregated prefill/decode (plan/serve/disagg.py) and the Pareto front (plan/serve/pareto.py):
the pool split against a hand-solved case, each phase against the colocated model's own pieces,
the KV hand-off against hand arithmetic, and the front's monotonicity."""

import json
import random

import pytest

from modelcarve.cli import main
from modelcarve.plan.serve.pareto import front_of, pareto_front
from modelcarve.plan.search import search
from modelcarve.plan.serve.layout_costs import layout_costs
from modelcarve.plan.serve.disagg import choose_pools, decode_unit, kv_transfer_s, phase_estimate, prefill_unit
from modelcarve.plan.serve.options import serve_options
from modelcarve.plan.serve.time import _ensure_prefill, _rates, decode_tpot_s
from modelcarve.spec.catalog import get_model
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout

SHAPE = dict(input_len=4096, output_len=512)


def test_pool_split_hand_solved():
    """Prefill units of 1 device at 2 req/s, decode units of 2 devices at 3 req/s, 8 devices.
    Balance wants x R_p = y R_d, x / y = 3 / 2: x = 3, y = 2 uses 7 devices and serves min(6, 6) = 6 req/s,
    6 / 7 = 0.857 req/s per device; the neighbours are worse (x=2,y=1: 3/4; x=4,y=2: 6/8; x=1,y=1: 2/3;
    x=2,y=2: 4/6; x=4,y=1: 3/6)."""
    p, d = {"devices": 1, "requests_per_s": 2.0}, {"devices": 2, "requests_per_s": 3.0}
    assert choose_pools(p, d, 8, output_len=100) == (3, 2)
    # At 5 req/s: the fewest units above it, 3 prefill (6 req/s) and 2 decode (6 req/s).
    assert choose_pools(p, d, 8, output_len=100, rate=5.0) == (3, 2)
    # 4 devices: x=2, y=1 (min(4, 3) / 4) beats x=1, y=1 (2 / 3).
    assert choose_pools(p, d, 4, output_len=100) == (2, 1)
    assert choose_pools(p, d, 2, output_len=100) is None


def test_each_phase_is_the_colocated_model_without_the_other():
    model, cl = get_model("llama-3.1-70b"), parse_cluster("8xH100")
    opts = serve_options(tpot_ms=30, **SHAPE)
    layout = Layout(tp=4, weight_dtype="fp8", kv_dtype="fp8")
    c = layout_costs(model, cl, 4, 1, 1, 1, "fp8", "fp8", 4096, 512)
    _ensure_prefill(c)
    p = prefill_unit(model, cl, layout, opts)
    assert p["prefill_s"] == c.prefill_s
    assert p["requests_per_s"] == pytest.approx(1.0 / (4096 * c.prefill_token_s), rel=1e-12)
    d = decode_unit(model, cl, layout, opts)
    # TPOT is the decode round alone: below the colocated TPOT at the same batch, which carries the
    # other requests' prefills; the batch is the largest within 30 ms.
    assert d["tpot_s"] == decode_tpot_s(c, d["batch"]) <= 0.030 < decode_tpot_s(c, d["batch"] + 1)
    assert d["tpot_s"] < _rates(c, d["batch"])[1]
    assert d["requests_per_s"] == pytest.approx(d["batch"] / d["tpot_s"] / 512, rel=1e-12)
    est = phase_estimate(model, cl, layout, "decode", tpot_ms=30, **SHAPE)
    assert est["unit"] == d and est["fits"] and est["reject_reason"] is None


def test_kv_hand_off_hand_derived():
    """Llama-3.1-70B, 4096 prompt tokens, fp8 KV: 4096 x 80 layers x (2 x 8 heads x 128) x 1 byte = 671,088,640 bytes."""
    model = get_model("llama-3.1-70b")
    nbytes = 4096 * 80 * 2 * 8 * 128
    assert nbytes == 671_088_640
    cl = parse_cluster("2x8xH100")
    # both units inside one 8-GPU node: NVLink4, 450 GB/s per device, the prefill unit's 2 devices
    s, link = kv_transfer_s(model, cl, Layout(tp=2, kv_dtype="fp8"), 4096, decode_devices=4)
    assert link == "nvlink4" and s == pytest.approx(3e-6 + nbytes / (2 * 450e9), rel=1e-12)
    # 8 + 8 devices: across nodes, each prefill device sends over its share of 8 NDR NICs per 8 GPUs
    s, link = kv_transfer_s(model, cl, Layout(tp=8, kv_dtype="fp8"), 4096, decode_devices=8)
    assert link == "ib-ndr" and s == pytest.approx(5e-6 + nbytes / (8 * 50e9), rel=1e-12)


def test_disagg_plan_meets_its_bounds_and_accounts_its_devices():
    model, cl = get_model("llama-3.1-70b"), parse_cluster("2x8xH100")
    bounds = dict(ttft_ms=2000, tpot_ms=30, **SHAPE)
    plan = search(model, cl, "serve-disagg", top=5, **bounds)
    assert plan["layouts"]
    for r in plan["layouts"]:
        s, p, d = r["serve"], r["prefill"], r["decode"]
        assert s["prefill_units"] * p["devices"] + s["decode_units"] * d["devices"] == s["devices"] <= 16
        served = min(s["prefill_units"] * p["requests_per_s"], s["decode_units"] * d["requests_per_s"])
        assert s["tokens_per_s_per_device"] == pytest.approx(served * 512 / s["devices"], rel=1e-12)
        assert s["ttft_s"] <= 2.0 and s["tpot_s"] <= 0.030
    # Decode without prefill interference beats the colocated winner at the same bounds here.
    colocated = search(model, cl, "serve-throughput", top=1, **bounds)["layouts"][0]
    assert plan["layouts"][0]["serve"]["tokens_per_s_per_device"] > colocated["serve"]["tokens_per_s_per_device"]
    # With a request rate the pools are the fewest units that sustain it, queue wait included in TTFT.
    at_rate = search(model, cl, "serve-disagg", top=1, rate=4.0, **bounds)["layouts"][0]
    assert at_rate["serve"]["requests_per_s"] == 4.0 and at_rate["serve"]["capacity_rps"] > 4.0
    assert at_rate["serve"]["queue_wait_s"] > 0 and at_rate["serve"]["ttft_s"] <= 2.0


def test_disagg_cli(capsys):
    args = ["plan", "--goal", "serve-disagg", "--model", "llama-3.1-8b", "--cluster", "8xH100",
            "--input-len", "2048", "--output-len", "256", "--tpot-ms", "20", "--top", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prefill pool + decode pool" in out and "colocated best" in out
    assert main(["estimate", "--goal", "serve-throughput", "--phase", "prefill", "--model", "llama-3.1-8b",
                 "--cluster", "8xH100", "--layout", "tp=1,weight_dtype=fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unit"]["phase"] == "prefill"


def test_front_of_is_exactly_the_non_dominated_points():
    rng = random.Random(3)
    pts = [{"tokens_per_s_per_user": rng.uniform(1, 100), "tokens_per_s_per_device": rng.uniform(1, 1000)} for _ in range(300)]

    def dominated(p):
        return any(q["tokens_per_s_per_user"] >= p["tokens_per_s_per_user"] and q["tokens_per_s_per_device"] >=
                   p["tokens_per_s_per_device"] and q is not p for q in pts)

    front = front_of(pts)
    assert {id(p) for p in front} == {id(p) for p in pts if not dominated(p)}


def test_pareto_front_is_monotone_and_ends_at_the_throughput_winner(tmp_path, capsys):
    model, cl = get_model("llama-3.1-70b"), parse_cluster("8xH100")
    shape = dict(input_len=2048, output_len=256)
    front = pareto_front(model, cl, **shape)["front"]
    users = [p["tokens_per_s_per_user"] for p in front]
    devs = [p["tokens_per_s_per_device"] for p in front]
    assert users == sorted(users) and all(a > b for a, b in zip(devs, devs[1:]))
    best = search(model, cl, "serve-throughput", top=1, **shape)["layouts"][0]
    assert devs[0] == pytest.approx(best["serve"]["tokens_per_s_per_device"], rel=1e-9)
    # the latency end: batch 1 of the fastest layout, as serve-latency finds it
    fastest = search(model, cl, "serve-latency", top=1, **shape)["layouts"][0]
    assert users[-1] == pytest.approx(1 / fastest["serve"]["tpot_s"], rel=1e-9)
    png = tmp_path / "front.png"
    assert main(["plan", "--goal", "serve-throughput", "--pareto", "--plot", str(png), "--model", "llama-3.1-70b",
                 "--cluster", "8xH100", "--input-len", "2048", "--output-len", "256"]) == 0
    assert "Pareto front" in capsys.readouterr().out and png.stat().st_size > 10_000


# DeepEP README, low-latency kernels (H800, CX7 InfiniBand 400 Gb/s, 128 tokens per rank, hidden 7168,
# top-8, FP8 dispatch, BF16 combine): EP size -> (dispatch us, combine us).
DEEPEP_LOW_LATENCY = {16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}


@pytest.mark.parametrize("ep", sorted(DEEPEP_LOW_LATENCY))
def test_wide_ep_exchange_against_deepep(ep):
    """plan/serve/ep.py against DeepEP's published kernel times, no constant fitted: bytes bound for other
    nodes over the rank's NIC share (50 GB/s x NCCL's 0.86) plus one network latency. The model has no
    kernel launch / completion-signal time, so it is low, by 3-23% on these rows; 25% bounds that."""
    from modelcarve.plan.cost import comm
    from modelcarve.plan.serve.ep import ep_exchange_s

    model = get_model("deepseek-v3")  # hidden 7168, top-8
    tier = comm.group_tier(parse_cluster(f"{ep // 8}x8xH800"), ep, 1)
    dispatch, combine = ep_exchange_s(128, model, ep, tier)
    # hand: 128 tokens x 8 x 7168 x (ep - 8) / ep crossing, 1.03 bytes (fp8 + scale) / 2 bytes (bf16)
    crossing = 128 * 8 * 7168 * (ep - 8) / ep
    assert dispatch == pytest.approx(5e-6 + crossing * (1 + 4 / 128) / (50e9 * 0.86), rel=1e-12)
    assert combine == pytest.approx(5e-6 + crossing * 2 / (50e9 * 0.86), rel=1e-12)
    published_d, published_c = DEEPEP_LOW_LATENCY[ep]
    assert dispatch * 1e6 == pytest.approx(published_d, rel=0.25)
    assert combine * 1e6 == pytest.approx(published_c, rel=0.25)


def test_windowed_layers_cap_the_kv_cache():
    """Gemma 3 27B (5 local layers of 1024 tokens per global one: 52 sliding, 10 full of 62) and gpt-oss-120b
    (18 of 36 layers with a 128-token window): a sequence's KV by hand, bf16, one device."""
    from modelcarve.plan.serve.memory import memory_from_facts, shard_facts

    gemma = shard_facts(get_model("gemma-3-27b"), tp=1)
    per_layer = 2 * 16 * 128 * 2  # k and v, 16 kv heads of 128, bf16
    assert gemma.kv_bytes_per_token == 62 * per_layer  # per token (the engine's figure) unchanged
    mem = memory_from_facts(gemma, 141e9, batch=3, context=32768)
    assert mem.kv_bytes == 3 * per_layer * (10 * 32768 + 52 * 1024)
    short = memory_from_facts(gemma, 141e9, batch=1, context=512)  # inside the window: every layer holds it all
    assert short.kv_bytes == 62 * per_layer * 512
    oss = shard_facts(get_model("gpt-oss-120b"), tp=1)
    per_layer = 2 * 8 * 64 * 2
    assert memory_from_facts(oss, 141e9, batch=1, context=8192).kv_bytes == per_layer * (18 * 8192 + 18 * 128)


def test_mla_serves_with_dp_attention_and_ep_experts():
    """DeepSeek-V3's MLA latent (512 + 64 per token per layer) has no head axis: TP replicates it on every
    rank, so a TP8 group holds 8 copies of each sequence's KV; DP attention (tp=1) holds one, and the
    experts are sharded over the EP ranks. The throughput plan picks that arrangement on 4 x 8 H200."""
    from modelcarve.plan.serve.memory import shard_facts

    model = get_model("deepseek-v3")
    latent = 61 * (512 + 64) * 1  # fp8 KV, all 61 layers
    assert shard_facts(model, tp=8, kv_dtype="fp8").kv_bytes_per_token == latent
    assert shard_facts(model, tp=1, ep=32, kv_dtype="fp8").kv_bytes_per_token == latent
    best = search(model, parse_cluster("4x8xH200"), "serve-throughput", top=1, input_len=2048, output_len=512,
                  tpot_ms=50)["layouts"][0]["layout"]
    assert best["tp"] == 1 and best["ep"] >= 8 and best["dp"] == 32
