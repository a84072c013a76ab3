"""The fused grouped MoE MLP in the frameworks' words: Megatron-LM's ``--use-transformer-engine-op-fuser``
and Megatron-Bridge's ``model.use_transformer_engine_op_fuser`` (which its ``cutedsl_fused_grouped_mlp``
performance presets set) read as the planner's ``moe_fused_mlp``, priced as ``estimate --moe-fused-mlp``
prices it, and written back by ``--emit-launch megatron``."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_options

FLAGS = ("--expert-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
         "--micro-batch-size 1 --global-batch-size 512 --seq-length 4096 --fp8-format e4m3 --fp8-recipe mxfp8")
OURS = "dp=64,ep=8,zero=1,mbs=1,gbs=512,seq=4096,param_dtype=mxfp8"
MODEL, CLUSTER = "qwen3-30b-a3b", "8x8xB200"


def _estimate(capsys, *extra: str) -> dict:
    code = main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_megatron_and_bridge_spellings_read_as_moe_fused_mlp():
    assert read_options("megatron", FLAGS + " --use-transformer-engine-op-fuser")["moe_fused_mlp"] is True
    assert not read_options("megatron", FLAGS).get("moe_fused_mlp")
    bridge = read_options("megatron-bridge", "model.expert_model_parallel_size=8 "
                                             "model.use_transformer_engine_op_fuser=true train.micro_batch_size=1")
    assert bridge["moe_fused_mlp"] is True


def test_megatron_flag_prices_what_the_cli_option_prices(capsys):
    plain = _estimate(capsys, "--layout", OURS)
    cli = _estimate(capsys, "--layout", OURS, "--moe-fused-mlp")
    megatron = _estimate(capsys, "--framework", "megatron", "--layout", FLAGS + " --use-transformer-engine-op-fuser")
    assert megatron["time"]["step_s"] == pytest.approx(cli["time"]["step_s"], rel=1e-12)
    assert cli["time"]["step_s"] < plain["time"]["step_s"]  # the activation and its quantisation passes are gone
    assert cli["memory"]["peak_bytes"] == pytest.approx(plain["memory"]["peak_bytes"], rel=1e-12)


def test_launch_carries_the_op_fuser_back(capsys):
    main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--layout", OURS, "--moe-fused-mlp",
          "--emit-launch", "megatron"])
    command = capsys.readouterr().out.split("pretrain_gpt.py", 1)[1]
    assert "--use-transformer-engine-op-fuser" in command
    main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--layout", OURS, "--emit-launch", "megatron"])
    assert "--use-transformer-engine-op-fuser" not in capsys.readouterr().out
