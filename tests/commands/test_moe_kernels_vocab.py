"""How the MoE experts' kernels run, in the frameworks' words, read as the planner's options, priced as the
planner's own flags price them, and written back by ``--emit-launch megatron``:

* the fused grouped MLP: Megatron-LM's ``--use-transformer-engine-op-fuser`` and Megatron-Bridge's
  ``model.use_transformer_engine_op_fuser`` (which its ``cutedsl_fused_grouped_mlp`` performance presets set) as
  ``moe_fused_mlp`` (``estimate --moe-fused-mlp``);
* who issues them: Megatron-LM's ``--cuda-graph-impl full_iteration`` (and Megatron-Bridge's
  ``model.cuda_graph_impl``) as ``cuda_graph='full_iteration'``, which lifts the experts' host-issue bound
  (``estimate --cuda-graph``), and one grouped GEMM (``--moe-expert-kernels grouped``, torchtitan's default)."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_options

FUSED = ("qwen3-30b-a3b", "8x8xB200")
FUSED_FLAGS = ("--expert-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
               "--micro-batch-size 1 --global-batch-size 512 --seq-length 4096 --fp8-format e4m3 --fp8-recipe mxfp8")
FUSED_OURS = "dp=64,ep=8,zero=1,mbs=1,gbs=512,seq=4096,param_dtype=mxfp8"
# Qwen3-30B-A3B at FP8 current scaling on 16 H100, EP16, micro-batch 1: the Megatron-Bridge 26.04.01 layout whose
# small expert layers the host's kernel issue bounds
HOST = ("qwen3-30b-a3b", "2x8xH100")
HOST_FLAGS = ("--expert-model-parallel-size 16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
              "--micro-batch-size 1 --global-batch-size 1024 --seq-length 4096 --fp8-format hybrid --fp8-recipe tensorwise")
HOST_OURS = "dp=16,ep=16,zero=1,mbs=1,gbs=1024,seq=4096,param_dtype=fp8,fp8_scaling=current"


def _estimate(capsys, where: tuple, *extra: str) -> dict:
    code = main(["estimate", "--model", where[0], "--cluster", where[1], "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_megatron_and_bridge_spellings_read_as_moe_fused_mlp():
    assert read_options("megatron", FUSED_FLAGS + " --use-transformer-engine-op-fuser")["moe_fused_mlp"] is True
    assert not read_options("megatron", FUSED_FLAGS).get("moe_fused_mlp")
    bridge = read_options("megatron-bridge", "model.expert_model_parallel_size=8 "
                                             "model.use_transformer_engine_op_fuser=true train.micro_batch_size=1")
    assert bridge["moe_fused_mlp"] is True


def test_op_fuser_flag_prices_what_the_cli_option_prices(capsys):
    plain = _estimate(capsys, FUSED, "--layout", FUSED_OURS)
    cli = _estimate(capsys, FUSED, "--layout", FUSED_OURS, "--moe-fused-mlp")
    megatron = _estimate(capsys, FUSED, "--framework", "megatron", "--layout", FUSED_FLAGS + " --use-transformer-engine-op-fuser")
    assert megatron["time"]["step_s"] == pytest.approx(cli["time"]["step_s"], rel=1e-12)
    assert cli["time"]["step_s"] < plain["time"]["step_s"]  # the activation and its quantisation passes are gone
    assert cli["memory"]["peak_bytes"] == pytest.approx(plain["memory"]["peak_bytes"], rel=1e-12)


def test_spellings_read_as_cuda_graph():
    assert read_options("megatron", HOST_FLAGS + " --cuda-graph-impl full_iteration")["cuda_graph"] == "full_iteration"
    assert "cuda_graph" not in read_options("megatron", HOST_FLAGS + " --cuda-graph-impl transformer_engine")
    assert "cuda_graph" not in read_options("megatron", HOST_FLAGS)
    bridge = read_options("megatron-bridge", "model.expert_model_parallel_size=16 model.cuda_graph_impl=full_iteration "
                                             "train.micro_batch_size=1")
    assert bridge["cuda_graph"] == "full_iteration"


def test_full_iteration_graph_lifts_the_host_issue_bound(capsys):
    eager = _estimate(capsys, HOST, "--layout", HOST_OURS)
    graph = _estimate(capsys, HOST, "--layout", HOST_OURS, "--cuda-graph", "full_iteration")
    megatron = _estimate(capsys, HOST, "--framework", "megatron", "--layout", HOST_FLAGS + " --cuda-graph-impl full_iteration")
    assert megatron["time"]["step_s"] == pytest.approx(graph["time"]["step_s"], rel=1e-12)
    assert graph["time"]["step_s"] < eager["time"]["step_s"]  # 8 local experts' FP8-CS kernels outlast their GPU work
    # layer-wise graphs leave dropless experts eager: priced as without
    partial = _estimate(capsys, HOST, "--layout", HOST_OURS, "--cuda-graph", "partial")
    assert partial["time"]["step_s"] == eager["time"]["step_s"]
    # one grouped GEMM for all local experts: the host issues one set of kernels, not eight
    grouped = _estimate(capsys, HOST, "--layout", HOST_OURS, "--moe-expert-kernels", "grouped")
    assert graph["time"]["step_s"] <= grouped["time"]["step_s"] < eager["time"]["step_s"]


@pytest.mark.parametrize("where, ours, option, flag", [
    (FUSED, FUSED_OURS, ["--moe-fused-mlp"], "--use-transformer-engine-op-fuser"),
    (HOST, HOST_OURS, ["--cuda-graph", "full_iteration"], "--cuda-graph-impl full_iteration"),
])
def test_launch_carries_it_back(capsys, where, ours, option, flag):
    main(["estimate", "--model", where[0], "--cluster", where[1], "--layout", ours, *option, "--emit-launch", "megatron"])
    command = capsys.readouterr().out.split("pretrain_gpt.py", 1)[1]
    assert flag in command
    main(["estimate", "--model", where[0], "--cluster", where[1], "--layout", ours, "--emit-launch", "megatron"])
    assert flag.split()[0] not in capsys.readouterr().out


def test_bad_value_is_one_line(capsys):
    code = main(["estimate", "--model", HOST[0], "--cluster", HOST[1], "--layout", HOST_OURS, "--cuda-graph", "always"])
    err = capsys.readouterr().err
    assert code == 2 and "--cuda-graph" in err and "Traceback" not in err
