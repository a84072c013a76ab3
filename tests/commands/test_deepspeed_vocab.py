"""``estimate --framework deepspeed``: a run described by its DeepSpeed config, read into modelcarve's
layout (commands/emit/deepspeed_vocab.py), checked against DeepSpeed's OWN config parser.

The oracle: DeepSpeed 0.18.3's ``deepspeed.runtime.config.DeepSpeedConfig``, in its own venv
(tests/engine_venvs.py; created on first use, the test skips with the reason when it cannot be
installed), given each config and the data-parallel size our reader derived (through a minimal mpu
object, as Megatron-DeepSpeed passes its mpu): its train batch size, micro batch, gradient
accumulation steps, ZeRO stage, bf16 / fp16 and MiCS shard size must be what our layout holds
(gbs, mbs, gbs / (mbs dp), zero, param_dtype, dp_shard), and a config whose batch sizes disagree
must be refused by both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_layout
from modelcarve.spec.errors import ModelcarveError
from modelcarve.spec.layout import Layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from engine_venvs import engine_python  # noqa: E402

DEVICES = 64
CASES = [
    # (config, added in our words, the layout we expect)
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "mics_shard_size": 8},
      "bf16": {"enabled": True}}, "", "dp=64,mbs=2,gbs=256,zero=3,dp_shard=8,param_dtype=bf16"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "fp16": {"enabled": True},
      "zero_optimization": {"stage": 2, "overlap_comm": True}}, "tp=4", "tp=4,dp=16,mbs=4,gbs=512,zero=2,param_dtype=fp16"),
    ({"train_batch_size": 128, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}},
      "pp=2,recompute=full", "pp=2,dp=32,mbs=2,gbs=128,zero=1,param_dtype=fp32,recompute=full"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
      "tensor_parallel": {"autotp_size": 2}, "bf16": {"enabled": True}}, "",
     "tp=2,dp=32,mbs=1,gbs=64,param_dtype=bf16"),
]
BAD_BATCH = {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}

DRIVER = r'''
import json, logging, sys
import deepspeed.comm
from deepspeed.utils import logger
logger.setLevel(logging.ERROR)
# the parser asks deepspeed.comm for this process's rank (no process group is needed to parse a
# config; starting one makes DeepSpeed JIT-build its CPU shared-memory op): rank 0 of the world
deepspeed.comm.get_rank = lambda *args, **kwargs: 0
from deepspeed.runtime.config import DeepSpeedConfig

class MPU:  # what Megatron-DeepSpeed hands DeepSpeed: the data-parallel world
    def __init__(self, dp): self.dp = dp
    def get_data_parallel_world_size(self): return self.dp
    def get_data_parallel_rank(self): return 0
    def get_model_parallel_world_size(self): return 1
    def get_model_parallel_rank(self): return 0

out = []
for case in json.load(sys.stdin):
    try:
        c = DeepSpeedConfig(case["config"], mpu=MPU(case["dp"]))
        out.append(dict(gbs=c.train_batch_size, mbs=c.train_micro_batch_size_per_gpu, gas=c.gradient_accumulation_steps,
                        zero=c.zero_optimization_stage, bf16=bool(c.bfloat16_config.enabled),
                        fp16=bool(c.float16_config.enabled), mics=c.mics_shard_size))
    except Exception as e:
        out.append(dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
print("RESULT " + json.dumps(out))
'''


def _layout(text: str) -> Layout:
    return Layout.parse(text)


@pytest.mark.parametrize("config,ours,want", CASES)
def test_reads_the_config(config, ours, want):
    got, notes = read_layout("deepspeed", json.dumps(config) + ("," + ours if ours else ""), devices=DEVICES)
    assert _layout(got) == _layout(want)
    assert notes and all(n.startswith("DeepSpeed 0.18.3") for n in notes)


def test_deepspeeds_own_parser_agrees():
    python, why = engine_python("deepspeed")
    if python is None:
        pytest.skip(why)
    cases, layouts = [], []
    for config, ours, _want in CASES:
        layout = _layout(read_layout("deepspeed", json.dumps(config) + ("," + ours if ours else ""), devices=DEVICES)[0])
        layouts.append(layout)
        cases.append({"config": config, "dp": layout.dp})
    cases.append({"config": BAD_BATCH, "dp": DEVICES})
    run = subprocess.run([str(python), "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-2000:]
    theirs = json.loads(lines[-1][len("RESULT "):])
    for layout, t in zip(layouts, theirs):
        assert "error" not in t, t
        assert (t["gbs"], t["mbs"], t["gas"]) == (layout.global_batch, layout.mbs, layout.global_batch // (layout.mbs * layout.dp))
        assert t["zero"] == layout.zero
        assert (t["bf16"], t["fp16"]) == (layout.param_dtype == "bf16", layout.param_dtype == "fp16")
        assert (t["mics"] if t["mics"] > 0 else 0) == (layout.dp_shard or 0)
    assert "train_batch_size is not equal to micro_batch_per_gpu" in theirs[-1]["error"]
    with pytest.raises(ModelcarveError, match="DeepSpeed refuses it too"):
        read_layout("deepspeed", json.dumps(BAD_BATCH), devices=DEVICES)


@pytest.mark.parametrize("config,match", [
    ({"train_batch_size": 64, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "ZeRO-Offload"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "hierarchical partitioning"),
    ({"train_batch_size": 64, "sequence_parallel_size": 4}, "Ulysses"),
    ({"train_batch_size": "auto"}, "'auto'"),
    ({"train_batch_size": 64, "pipeline": {"stages": 2}}, "not read by modelcarve"),
    ({"train_batch_size": 64, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
])
def test_refused_in_one_line(config, match):
    with pytest.raises(ModelcarveError, match=match) as err:
        read_layout("deepspeed", json.dumps(config), devices=DEVICES)
    assert "\n" not in str(err.value)


def test_cli_prints_the_meaning_used(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CASES[0][0]))
    code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8x8xH100", "--framework", "deepspeed",
                 "--layout", f"{path},seq=4096,recompute=full", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert result["layout"]["zero"] == 3 and result["layout"]["dp_shard"] == 8 and result["layout"]["recompute"] == "full"
    assert any("MiCS" in n for n in result["read_as"]) and any("recompute=none" not in n for n in result["read_as"])
    code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8x8xH100", "--framework", "deepspeed",
                 "--layout", str(tmp_path / "missing.json")])
    assert code != 0
    assert "ds_config.json path or its JSON text" in capsys.readouterr().err
