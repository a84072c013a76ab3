"""Dollars (plan/pricing.py, spec/prices.py, the cost flags of plan / estimate), against arithmetic
done by hand in each docstring."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.plan.pricing import serving_cost, training_cost
from modelcarve.spec.errors import SpecError
from modelcarve.spec.prices import device_price, parse_prices


def test_serving_cost_by_hand():
    """8 devices at $2.00/h cost $16/h = $0.0044444/s. 1,000 output tok/s per device at full load is
    8,000 tok/s, i.e. 32 requests/s of 250 output tokens. At 50% utilisation 16 req/s are served:
    $/request = 0.0044444 / 16 = 0.00027778; $/M output tokens = 0.0044444 / (16 x 250) x 1e6 =
    1.1111; $/M tokens in+out (1,000 in) = 0.0044444 / (16 x 1,250) x 1e6 = 0.22222.
    An API at $0.50 / $1.50 per M in / out charges (1,000 x 0.5 + 250 x 1.5) / 1e6 = $0.000875 a
    request: the cluster's $0.0044444/s is covered at 0.0044444 / 0.000875 = 5.0794 req/s, 15.87%
    of the 32 req/s capacity."""
    result = {"serve": {"tokens_per_s_per_device": 1000.0}}
    c = serving_cost(result, devices=8, usd_per_device_hour=2.0, input_len=1000, output_len=250, utilisation=0.5,
                     api_price=(0.5, 1.5))
    assert c["usd_per_hour"] == pytest.approx(16.0)
    assert c["capacity_rps"] == pytest.approx(32.0)
    assert c["usd_per_request"] == pytest.approx(16 / 3600 / 16)
    assert c["usd_per_m_output_tokens"] == pytest.approx(1.11111, rel=1e-5)
    assert c["usd_per_m_tokens"] == pytest.approx(0.222222, rel=1e-5)
    assert c["usd_per_m_output_tokens_full_load"] == pytest.approx(0.555556, rel=1e-5)
    api = c["api"]
    assert api["usd_per_request"] == pytest.approx(0.000875)
    assert api["break_even_rps"] == pytest.approx(5.07937, rel=1e-5)
    assert api["break_even_utilisation"] == pytest.approx(5.07937 / 32, rel=1e-5)
    assert api["self_hosting_can_win"] and api["cheaper_now"]  # 0.000278 < 0.000875 at 16 req/s


def test_serving_cost_at_a_rate_uses_the_rate():
    """With --rate the planner's queue says 8 req/s of a 32 req/s capacity: utilisation 0.25, so
    $/request = ($16/h / 3600) / 8 = 0.00055556."""
    result = {"serve": {"tokens_per_s_per_device": 250.0}, "queue": {"rate_rps": 8.0, "capacity_total_rps": 32.0}}
    c = serving_cost(result, devices=8, usd_per_device_hour=2.0, input_len=100, output_len=250)
    assert c["utilisation"] == pytest.approx(0.25)
    assert c["usd_per_request"] == pytest.approx(16 / 3600 / 8)


def test_training_cost_by_hand():
    """3.6e12 tokens at 1e6 tokens/s take 3.6e6 s = 1,000 h; with 10% lost to restarts 1,100 h; on
    100 devices 110,000 device-hours, at $2.00 $220,000; $/M tokens = 100 x 2 / 3600 / 1e6 x 1.1 x 1e6
    = 0.061111."""
    c = training_cost({"time": {"tokens_per_s": 1e6}}, devices=100, usd_per_device_hour=2.0, tokens=3.6e12, overhead=0.1)
    assert c["hours"] == pytest.approx(1100.0)
    assert c["device_hours"] == pytest.approx(110_000.0)
    assert c["usd"] == pytest.approx(220_000.0)
    assert c["usd_per_m_tokens"] == pytest.approx(0.0611111, rel=1e-5)


def test_prices_given_win_over_the_catalogue():
    assert device_price("H100")[0] > 0 and "list price" in device_price("H100")[1]
    assert device_price("H100", parse_prices(["H100=2.49"])) == (2.49, "given")
    assert device_price("B200", parse_prices(["7.5"])) == (7.5, "given")  # the cluster's device
    with pytest.raises(SpecError, match="--price B200=USD"):
        device_price("B200")
    for bad in (["H100=free"], ["-1"], ["=3"]):
        with pytest.raises(SpecError):
            parse_prices(bad)


def test_plan_json_carries_the_cost_of_every_layout(capsys):
    assert main(["plan", "--goal", "serve-throughput", "--model", "qwen3-32b", "--cluster", "1xH100", "--top", "3",
                 "--price", "H100=2.49", "--api-price", "0.10,0.30", "--utilisation", "0.4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for row in plan["layouts"]:
        cost = row["cost"]
        again = serving_cost(row, devices=1, usd_per_device_hour=2.49, input_len=2048, output_len=256, utilisation=0.4,
                             api_price=(0.10, 0.30))
        assert cost["usd_per_m_output_tokens"] == pytest.approx(again["usd_per_m_output_tokens"])
        assert cost["api"]["break_even_rps"] == pytest.approx(again["api"]["break_even_rps"])
        assert cost["price_source"] == "given"


def test_cost_flags_refuse_in_one_line(capsys):
    base = ["plan", "--goal", "train", "--model", "llama-3.1-8b", "--cluster", "8xB200", "--global-batch", "64",
            "--seq", "4096"]
    for argv, words in ((base + ["--train-tokens", "1e12"], "--price B200=USD"),
                        (base + ["--price", "5"], "--train-tokens"),
                        (["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100", "--rate", "1",
                          "--utilisation", "0.5", "--price", "2"], "give one"),
                        (["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                          "--api-price", "cheap"], "IN,OUT")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (argv, err)


def test_selfhost_puts_each_dtype_on_the_fewest_devices(capsys):
    """llama-3.1-70b: bf16 weights (141 GB) need more H100s than fp8 (71 GB) and int4 (37 GB); each
    row's device count is the smallest power of two with a qualifying layout (the half of it has
    none), and its dollars are plan/pricing.py's on that cluster."""
    from modelcarve.plan.search import search
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster

    assert main(["selfhost", "--model", "llama-3.1-70b", "--device", "H100", "--dtypes", "bf16,fp8,int4",
                 "--price", "H100=2.0", "--api-price", "0.5,1.5", "--json"]) == 0
    rows = {r["weight_dtype"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["bf16"]["devices"] > rows["fp8"]["devices"] >= rows["int4"]["devices"]
    model = get_model("llama-3.1-70b")
    for dtype, row in rows.items():
        n = row["devices"]
        if n > 1:
            smaller = search(model, parse_cluster(f"{n // 2}xH100"), "serve-throughput", top=1, weight_dtypes=dtype)
            assert not smaller["layouts"], (dtype, n)
        cost = row["cost"]
        assert cost["usd_per_hour"] == pytest.approx(2.0 * n)
        capacity = row["tokens_per_s_per_device"] * n / 256  # default output length 256
        assert cost["usd_per_request"] == pytest.approx(2.0 * n / 3600 / capacity)


def test_priced_front_by_hand(capsys, tmp_path):
    """A device at $3.60/h costs $0.001/s; serving 500 output tokens/s at 50% utilisation (250
    delivered) that is 0.001 / 250 x 1e6 = $4.00 per million output tokens."""
    from modelcarve.plan.pricing import price_front

    (p,) = price_front({"front": [{"tokens_per_s_per_device": 500.0}]}, usd_per_device_hour=3.6, utilisation=0.5)
    assert p["usd_per_m_output_tokens"] == pytest.approx(4.0)
    png = tmp_path / "front.png"
    assert main(["plan", "--goal", "serve-throughput", "--pareto", "--model", "qwen3-32b", "--cluster", "2xH100",
                 "--price", "H100=3.6", "--utilisation", "0.5", "--plot", str(png), "--json"]) == 0
    front = json.loads(capsys.readouterr().out)
    assert front["priced"] and png.read_bytes()[:4] == b"\x89PNG"
    for point in front["priced"]:
        assert point["usd_per_m_output_tokens"] == pytest.approx(0.001 / (0.5 * point["tokens_per_s_per_device"]) * 1e6)


def test_a_cluster_file_carries_its_own_price(tmp_path, capsys):
    """The cluster file's usd_per_hour prices its device; --price still wins over it."""
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 1\ndevices_per_node: 2\ndevice: {base: B200, usd_per_hour: 5.5}\n")
    argv = ["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", str(path), "--top", "1",
            "--utilisation", "0.5", "--json"]
    assert main(argv) == 0
    cost = json.loads(capsys.readouterr().out)["layouts"][0]["cost"]
    assert cost["usd_per_device_hour"] == 5.5 and cost["usd_per_hour"] == pytest.approx(11.0)
    assert main(argv + ["--price", "7"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["cost"]["usd_per_device_hour"] == 7.0
