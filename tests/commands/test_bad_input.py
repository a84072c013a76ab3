"""Issue 16 §4: every reproducer found by fuzzing the CLI is one line on stderr, exit 2, no traceback.

Each reproducer (numbered as in the issue) is its own test, in-process through ``cli.main``; a few
are repeated in a real ``python -m modelcarve.cli`` process, where a traceback would show.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from modelcarve.cli import main

LONG = "a" * 300
TINY_CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
QWEN3_MOE = dict(TINY_CONFIG, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def one_line_error(capsys, argv, fragment, code=2):
    """``main(argv)`` exits ``code`` with exactly one stderr line, containing ``fragment``."""
    assert main(list(argv)) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelcarve: error:"), err
    assert fragment in lines[0], lines[0]
    return lines[0]


def write_config(tmp_path, name, config, raw=None):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    return str(folder)


# --- 1. path arguments over 255 bytes -------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["models", "show", LONG],
    ["estimate", "--model", LONG, "--cluster", "H100", "--layout", "dp=1"],
    ["layout", LONG + ".json"],
    ["hardware", "--cluster", LONG + ".yaml"],
    ["layout", "dp=1", "--emit", LONG],
    ["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4", "--emit", LONG],
    ["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4", "--plot", LONG + ".png"],
])
def test_1_path_over_255_bytes(capsys, argv):
    one_line_error(capsys, argv, "over the 255-byte limit")


# --- 2. --emit / --plot into a folder that does not exist ---------------------------------------------

@pytest.mark.parametrize("argv", [
    ["layout", "dp=1", "--emit", "/nonexistent-dir/l.json"],
    ["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4", "--emit", "/nonexistent-dir/l.json"],
    ["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4", "--plot", "/nonexistent-dir/p.png"],
])
def test_2_output_into_missing_folder(capsys, argv):
    one_line_error(capsys, argv, "folder '/nonexistent-dir' does not exist")


# --- 3. config.json values of the wrong type --------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    ({"model_type": ["llama"]}, "model_type must be a string, got array"),
    ({"model_type": {}}, "model_type must be a string, got object"),
    ({"rope_parameters": 3}, "rope_parameters must be an object"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 is outside the accepted range 1..65,536"),
])
def test_3_config_wrong_types(capsys, tmp_path, change, fragment):
    one_line_error(capsys, ["models", "show", write_config(tmp_path, "m", TINY_CONFIG | change)], fragment)


# --- 4. huge integers, deep nesting, non-UTF-8 --------------------------------------------------------

def test_4_huge_integer_in_config_and_layout(capsys, tmp_path):
    raw = json.dumps(TINY_CONFIG).replace('"vocab_size": 128', '"vocab_size": ' + "7" * 5000)
    one_line_error(capsys, ["models", "show", write_config(tmp_path, "m", None, raw)], "an integer of 5000 digits")
    layout = tmp_path / "l.json"
    layout.write_text('{"tp": ' + "1" * 5000 + "}")
    one_line_error(capsys, ["layout", str(layout)], "an integer of 5000 digits")


def test_4_deep_nesting_in_config_and_layout(capsys, tmp_path):
    one_line_error(capsys, ["models", "show", write_config(tmp_path, "m", None, "[" * 100_000)], "nested too deeply")
    layout = tmp_path / "l.json"
    layout.write_text('{"tp": ' + "[" * 100_000)
    one_line_error(capsys, ["layout", str(layout)], "nested too deeply")


def test_4_non_utf8_cluster_and_layout(capsys, tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_bytes(b"nodes: 2\ndevice: H\xff100\n")
    one_line_error(capsys, ["hardware", "--cluster", str(cluster)], "not UTF-8 text (byte 0xff at offset 18)")
    layout = tmp_path / "l.json"
    layout.write_bytes(b'{"tp": "\xfe"}')
    one_line_error(capsys, ["layout", str(layout)], "not UTF-8 text")


# --- 5. cluster files with wrong-typed device fields ---------------------------------------------------

@pytest.mark.parametrize("device, fragment", [
    ("{base: H100, memory_bytes: {}}", "device.memory_bytes must be an integer >= 1"),
    ("{base: H100, memory_bytes: {bf16: -1}}", "device.memory_bytes must be an integer"),
    ("{base: H100, hbm_bytes_per_s: null}", "device.hbm_bytes_per_s must be a number > 0"),
    ("{base: H100, hbm_bytes_per_s: nvlink4}", "device.hbm_bytes_per_s must be a number > 0 and <= 1e+18, got string"),
    ("{base: H100, peak_flops: nope}", "device.peak_flops must be a mapping of dtype to FLOP/s"),
    ("{base: H100, name: 1000000}", "device.name must be a non-empty string, got integer"),
    ("{name: X, memory_bytes: 8.0e10, peak_flops: {bf16: 1.0e15}}", "device lacks hbm_bytes_per_s"),
])
def test_5_cluster_file_fields_named(capsys, tmp_path, device, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(f"nodes: 2\ndevice: {device}\n")
    one_line_error(capsys, ["hardware", "--cluster", str(path)], fragment)


def test_5_yaml_float_without_exponent_sign_is_the_number(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("device: {base: H100, hbm_bytes_per_s: 4.0e12}\n")  # YAML 1.1: the string '4.0e12'
    assert main(["hardware", "--cluster", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"]["hbm_bytes_per_s"] == 4.0e12


# --- 6. counts near 2^63 -------------------------------------------------------------------------------

def test_6_huge_device_counts_capped(capsys, tmp_path):
    one_line_error(capsys, ["plan", "--model", "tiny-llama", "--cluster", "9223372036854775807xH100",
                            "--goal", "serve-throughput"], "more than the 1,048,576 devices")
    path = tmp_path / "c.yaml"
    path.write_text("device: H100\ndevices_per_node: 9223372036854775807\n")
    one_line_error(capsys, ["plan", "--model", "tiny-llama", "--cluster", str(path), "--goal", "serve-throughput"],
                   "devices_per_node=9223372036854775807 is outside the accepted range (>= 1 and <= 4,096)")
    assert main(["hardware", "--cluster", "1000x1000xH100"]) == 0  # 10^6 devices: under the 2^20 cap
    capsys.readouterr()
    one_line_error(capsys, ["hardware", "--cluster", "1100x1000xH100"], "1,100,000 devices is more than the 1,048,576")


# --- 7. values accepted before but wrong ------------------------------------------------------------------

@pytest.mark.parametrize("config, fragment", [
    (QWEN3_MOE | {"decoder_sparse_step": math.nan}, "decoder_sparse_step must be an integer in 1..65,536, got number nan"),
    (TINY_CONFIG | {"rope_theta": math.nan}, "rope_theta=nan is outside the accepted range (0, 1e+12]"),
    (TINY_CONFIG | {"rms_norm_eps": 1.5}, "rms_norm_eps=1.5 is outside the accepted range (0, 0.1]"),
    (TINY_CONFIG | {"tie_word_embeddings": [64]}, "tie_word_embeddings must be true or false, got array"),
    (TINY_CONFIG | {"max_position_embeddings": "x"}, "max_position_embeddings must be an integer in 1..2,147,483,648"),
    (TINY_CONFIG | {"head_dim": 7}, "head_dim=7 is odd; rotary embeddings rotate pairs"),
])
def test_7_wrong_values_refused_with_range(capsys, tmp_path, config, fragment):
    one_line_error(capsys, ["models", "show", write_config(tmp_path, "m", config)], fragment)


def test_7_full_width_digit_on_the_command_line(capsys):
    line = one_line_error(capsys, ["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4",
                                   "--seq", "\uff12"], "argument --seq:")
    assert "not an integer (ASCII digits) in 1..2,147,483,648" in line
    one_line_error(capsys, ["run", "--model", "tiny-llama", "--layout", "dp=1", "--timeout", "nan"],
                   "argument --timeout: 'nan' is not a finite number")


# --- the same in real processes (a traceback would reach stderr) -------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["models", "show", LONG], "over the 255-byte limit"),
    (["hardware", "--cluster", "9223372036854775807xH100"], "more than the 1,048,576 devices"),
    (["plan", "--model", "tiny-llama", "--cluster", "2xH100", "--global-batch", "4", "--seq", "\uff12"], "--seq"),
])
def test_reproducers_in_a_real_process(argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert fragment in proc.stderr


def test_found_by_the_fuzz_suite_control_characters_stay_on_one_line(capsys):
    """A carriage return or ANSI escape the user typed, echoed back by argparse or our own message,
    must not break or repaint the line (found by tests/commands/test_fuzz_cli.py)."""
    line = one_line_error(capsys, ["hardware", "--batch", "\r"], "unrecognized arguments")
    assert "\r" not in line
    line = one_line_error(capsys, ["models", "show", "x\x1b[2Jy\nz"], "unknown model")
    assert "\x1b" not in line and "\\x1b" in line


def test_probe_emit_into_missing_folder_refused_before_measuring(capsys, monkeypatch):
    from modelcarve.commands.probe import machine as probe

    monkeypatch.setattr(probe, "measure", lambda ranks: pytest.fail("measured before checking --emit"))
    one_line_error(capsys, ["hardware", "--probe", "--emit", "/nonexistent-dir/c.yaml"], "folder '/nonexistent-dir'")


def test_export_paths_over_the_limit(capsys):
    one_line_error(capsys, ["export", "--checkpoint", LONG, "--out", "x"], "File name too long")


def test_zero_experts_per_token_only_for_a_dense_config(tmp_path):
    """num_experts_per_tok=0 is how a dense config of an MoE family (deepseek_v3 with no routed
    experts) says it has none; with routed experts it is refused, naming both keys."""
    import json

    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.errors import SpecError

    dense = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=0,
                 moe_intermediate_size=16, num_experts_per_tok=0, max_position_embeddings=64)
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(dense))
    assert not get_model(str(tmp_path / "dense")).moe_layers
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(dict(dense, n_routed_experts=4)))
    with pytest.raises(SpecError, match="num_experts_per_tok=0 with 4 routed experts"):
        get_model(str(tmp_path / "moe"))
