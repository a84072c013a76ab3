"""bench-serve's arithmetic and refusals, without a server (the run against a real server is in
tests/serve/test_serve_api.py: all requests succeed, counts equal the server's counters).

Percentiles are checked against numpy's default (linear interpolation), the oracle we did not
write; TPOT against its definition on hand-made timings; goodput against a hand count.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from modelcarve.serve.bench import BenchConfig, RequestResult, make_prompts, percentile, summarise

REPO_SRC = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "src")


def test_percentile_equals_numpy():
    import numpy as np

    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) is None


def test_summary_tpot_goodput_and_throughput():
    # request 1: first token at 0.1 s, 5 tokens, ends at 0.5 s -> TPOT (0.5 - 0.1) / 4 = 0.1 s
    # request 2: first token at 0.3 s, 3 tokens, ends at 0.5 s -> TPOT 0.1 s
    a = RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1] * 4)
    b = RequestResult(ok=True, prompt_len=4, output_tokens=3, ttft_s=0.3, e2e_s=0.5, itl_s=[0.1] * 2)
    c = RequestResult(ok=False, prompt_len=4, error="HTTP 429")
    cfg = BenchConfig(url="http://x", num_prompts=3, input_len=4, output_len=5, ttft_ms=200, tpot_ms=150)
    s = summarise([a, b, c], 2.0, cfg)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 429"]
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # midway between 100 and 300 ms
    assert s["itl_ms"]["n"] == 6
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_throughput"] == pytest.approx(4.0)
    assert s["sla"]["good_requests"] == 1 and s["sla"]["goodput"] == pytest.approx(0.5)  # only a meets TTFT <= 200 ms
    json.dumps(s)


def test_prompts_random_and_jsonl(tmp_path):
    cfg = BenchConfig(url="http://x", num_prompts=3, input_len=5, output_len=2, vocab_size=7, seed=1)
    prompts = make_prompts(cfg)
    assert len(prompts) == 3 and all(len(p) == 5 and max(p) < 7 and n == 5 and o == 2 for p, n, o in prompts)
    assert make_prompts(cfg) == prompts  # seeded
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n\n{"prompt_token_ids": [1, 2, 3], "output_len": 9}\n')
    rows = make_prompts(BenchConfig(url="http://x", num_prompts=3, output_len=4, prompts_file=str(f)))
    assert rows == [("hello", -1, 4), ([1, 2, 3], 3, 9), ("hello", -1, 4)]
    f.write_text("{oops\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        make_prompts(BenchConfig(url="http://x", prompts_file=str(f)))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "modelcarve.cli", "bench-serve", *args], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": REPO_SRC, "PATH": "/usr/bin:/bin"})


def test_bad_flags_and_no_server_are_one_line():
    from serve_fixtures import free_port

    for args, needle in ((["--num-prompts", "0"], "--num-prompts"), (["--rate", "-1"], "--rate"),
                         (["--url", "localhost:8000"], "http://"),
                         (["--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"], "is the server running")):
        proc = _cli(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
