"""The CLI: catalogue commands, and every bad input as one line on stderr with exit code 2."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelcarve.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_models_table_and_show_json(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "kimi-k2" in out and "deepseek-v3" in out
    code, out, _ = run(capsys, "models", "show", "kimi-k2", "--json")
    data = json.loads(out)
    assert code == 0
    assert {"name", "total_params", "active_params", "layers", "hidden", "experts", "top_k"} <= set(data)
    # the figure transformers counts for Kimi K2's published config.json (test_spec_oracle.py)
    assert data["total_params"] == 1_026_408_209_408 and data["experts"] == 384 and data["top_k"] == 8
    code, out, _ = run(capsys, "models", "--json")
    rows = json.loads(out)
    assert {r["name"] for r in rows} >= {"gpt3-175b", "llama-3.1-405b"}
    kimi = next(r for r in rows if r["name"] == "kimi-k2")
    assert kimi["weights_fp8_bytes"] == kimi["total_params"]


def test_hardware(capsys):
    code, out, _ = run(capsys, "hardware")
    assert code == 0 and "H200" in out and "nvlink4" in out
    code, out, _ = run(capsys, "hardware", "--cluster", "2x8xH200", "--json")
    assert json.loads(out)["num_devices"] == 16


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["models", "show", "nope"], "unknown model 'nope'"),
        (["models", "show"], "needs a NAME"),
        (["hardware", "--cluster", "2x8xH900"], "unknown device 'H900'"),
        (["hardware", "--cluster", "2by8"], "is not NODESxDEVICESxDEVICE"),
        (["layout", "tp=3", "--model", "llama-3.1-8b", "--world-size", "3"], "tp=3 does not divide 32 attention heads"),
        (["layout", "tp=,,"], "tp='' is not an integer"),
        (["layout", "tp=2", "--world-size", "4"], "uses 2 devices but 4 are given"),
        (["frobnicate"], "invalid choice"),
        (["models", "show", "qwen3-32b", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 2 or code is None
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0] and "Traceback" not in err


def test_malformed_config_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8}')
    code, _, err = run(capsys, "models", "show", str(tmp_path))
    assert code == 2 and "lacks required key 'hidden_size'" in err and len(err.strip().splitlines()) == 1


def _main_exit(argv):
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="tpdcezrosv=,0123456789-x_ ", max_size=30))
def test_hypothesis_layout_strings_never_traceback(capsys, text):
    code = _main_exit(["layout", text or "tp=", "--model", "tiny-llama"])
    _, err = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_real_process_exit_code_and_stderr():
    """The console script itself, as a user runs it: one stderr line, exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "modelcarve.cli", "layout", "tp=3", "--model", "llama-3.1-8b", "--world-size", "3"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("modelcarve: error: ")


def test_spec_plan_and_catalogue_commands_import_no_torch():
    code = (
        "import sys, io, contextlib, pkgutil, importlib\n"
        "import modelcarve.spec, modelcarve.plan\n"
        "for pkg in (modelcarve.spec, modelcarve.plan):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "from modelcarve.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['models']); main(['hardware']); main(['layout', 'tp=2'])\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_run_without_torch_is_one_line_with_the_fix(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    code, _, err = run(capsys, "run", "--model", "tiny-llama", "--layout", "tp=2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "need PyTorch" in err and "pip install torch==2.13.0" in err
