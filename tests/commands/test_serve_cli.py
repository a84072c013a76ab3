"""``modelcarve plan`` / ``estimate`` with the serving goals: flags, JSON shape, one-line errors."""

import json

import pytest

from modelcarve.cli import main
from modelcarve.spec.errors import ModelcarveError


def test_plan_serve_latency_json(capsys):
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "H100",
                 "--input-len", "2048", "--output-len", "256", "--weight-dtypes", "fp8", "--json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) >= {"layouts", "rejected", "evaluated", "why"}
    best = plan["layouts"][0]
    assert best["layout"]["tp"] == 1 and best["layout"]["weight_dtype"] == "fp8"
    assert set(best["serve"]) >= {"ttft_s", "tpot_s", "batch", "tokens_per_s", "tokens_per_s_per_device"}


def test_plan_serve_throughput_text_shows_quality_and_reasons(capsys):
    code = main(["plan", "--goal", "serve-throughput", "--model", "qwen3-32b", "--cluster", "2x8xH100",
                 "--ttft-ms", "2000", "--tpot-ms", "50", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "quality" in out and "Why not another shape" in out and "TP across nodes" in out


def test_estimate_serve_layout(capsys):
    code = main(["estimate", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                 "--layout", "tp=2,weight_dtype=fp8,kv_dtype=fp8", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and result["layout"]["tp"] == 2 and result["serve"]["batch"] == 1


def test_nothing_fits_is_one_line_with_the_reason(capsys):
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "H100",
                 "--input-len", "126976", "--output-len", "4096", "--weight-dtypes", "bf16"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "need at least 2 x H100" in err


def test_bad_serving_flag_is_one_line(capsys):
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "H100", "--weight-dtypes", "fp6"])
    err = capsys.readouterr().err
    assert code == 2 and "weight dtype 'fp6' unknown" in err


def test_emit_writes_a_layout_the_runtime_reads(tmp_path, capsys):
    from modelcarve.spec.layout import Layout

    path = tmp_path / "serve.json"
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                 "--weight-dtypes", "bf16", "--emit", str(path)])
    assert code == 0
    layout = Layout.parse(str(path))
    assert layout.tp * layout.pp * layout.dp == 2 and layout.weight_dtype == "bf16"


def test_estimate_fills_the_cluster_with_replicas(capsys):
    code = main(["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-8b", "--cluster", "8xH100",
                 "--layout", "tp=2,weight_dtype=fp8", "--tpot-ms", "30", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layout"]["dp"] == 4
    assert result["serve"]["tokens_per_s_cluster"] == pytest.approx(4 * result["serve"]["tokens_per_s_per_device"] * 2)


def test_piped_plan_table_keeps_its_width(capsys, monkeypatch):
    """Not a terminal (a pipe, capsys): the table is laid out at a readable width, not squeezed
    into 80 columns with wrapped headers."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                 "--input-len", "2048", "--output-len", "256", "--weight-dtypes", "bf16,fp8,int8,int4"])
    out = capsys.readouterr().out
    assert code == 0
    header = next(line for line in out.splitlines() if "layout w/kv" in line)
    assert "crosses nodes" in header and "tok/s/dev" in header and len(header) > 80
    assert any("TP2 int4/fp8" in line and "noticeable" in line for line in out.splitlines())



def _estimate_memory(capsys, *extra):
    code = main(["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-70b", "--cluster", "2xH100",
                 "--layout", "tp=2,weight_dtype=fp8,kv_dtype=bf16", "--input-len", "2048", "--output-len", "2048",
                 "--json", *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out)["memory"]


def test_the_kv_memory_rule_flags(capsys):
    """vLLM's rule by default (0.9 of the device holds weights, workspace and KV); ``--kv-memory free`` prices
    TensorRT-LLM's (0.9 of what the weights, runtime and workspace leave), so the same layout holds more
    sequences, and ``--memory-fraction`` moves either."""
    device = _estimate_memory(capsys)
    free = _estimate_memory(capsys, "--kv-memory", "free")
    free95 = _estimate_memory(capsys, "--kv-memory", "free", "--memory-fraction", "0.95")
    assert device["budget_gib"] == pytest.approx(0.9 * 80)
    # budget = fixed + 0.9 (80 GiB - fixed), so fixed = (budget - 72) / 0.1, and the 0.95 budget follows from it
    fixed = (free["budget_gib"] - 0.9 * 80) / 0.1
    assert fixed > device["weights_gib"] + device["runtime_gib"]  # weights, runtime and one chunk's activations
    assert free95["budget_gib"] == pytest.approx(fixed + 0.95 * (80 - fixed))
    assert device["max_sequences"] < free["max_sequences"] < free95["max_sequences"]


def test_the_engine_names_its_kv_memory_rule():
    """``--engine`` / ``--framework`` / ``--emit-launch`` trtllm price TensorRT-LLM's rule unless a flag states one."""
    import argparse

    from modelcarve.commands.planning.serving_plan import serve_options_from_args

    def opts(**flags):
        return serve_options_from_args(argparse.Namespace(**flags))

    assert opts(engine="trtllm") == {"kv_memory": "free", "memory_fraction": 0.9}
    assert opts(emit_launch="trtllm", memory_fraction=0.95) == {"kv_memory": "free", "memory_fraction": 0.95}
    assert opts(engine="vllm") == {"kv_memory": "device", "memory_fraction": 0.9}
    assert opts(engine="sglang") == {} and opts() == {} and opts(kv_memory="free") == {"kv_memory": "free"}
    # a rule the engine does not have is refused in one line rather than priced and launched otherwise
    for engine, rule in (("trtllm", "device"), ("vllm", "free"), ("sglang", "free")):
        with pytest.raises(ModelcarveError, match=f"--kv-memory {rule} is not how {engine} sizes its KV cache"):
            opts(engine=engine, kv_memory=rule)


def test_the_launch_runs_at_the_memory_fraction_the_plan_priced(tmp_path, capsys):
    """``--emit-launch`` writes the memory fraction the plan was priced with: vLLM's --gpu-memory-utilization,
    SGLang's --mem-fraction-static (only when stated: its default depends on the GPU), TensorRT-LLM's
    kv_cache_config.free_gpu_memory_fraction."""
    def emit(engine, *extra):
        out = tmp_path / engine
        code = main(["estimate", "--goal", "serve-throughput", "--model", "qwen3-32b", "--cluster", "2xH100",
                     "--layout", "tp=2,weight_dtype=fp8,kv_dtype=fp8", "--emit-launch", engine, "--out", str(out), *extra])
        assert code == 0, capsys.readouterr().err
        capsys.readouterr()
        return out

    def flag(out, name):
        words = (out / "launch.sh").read_text().split()
        return words[words.index(name) + 1] if name in words else None

    assert flag(emit("vllm"), "--gpu-memory-utilization") == "0.9"
    assert flag(emit("sglang"), "--mem-fraction-static") is None
    assert flag(emit("sglang", "--memory-fraction", "0.85"), "--mem-fraction-static") == "0.85"
    yaml = (emit("trtllm", "--memory-fraction", "0.95") / "extra_llm_api_options.yaml").read_text()
    assert "kv_cache_config:" in yaml and "free_gpu_memory_fraction: 0.95" in yaml


@pytest.mark.parametrize("flags, words", [
    (["--kv-memory", "half"], "invalid choice"),
    (["--memory-fraction", "1.5"], "--memory-fraction 1.5 must be in (0, 1]"),
])
def test_bad_kv_memory_flags_are_one_line(capsys, flags, words):
    code = main(["plan", "--goal", "serve-throughput", "--model", "qwen3-32b", "--cluster", "H100", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err
