"""Who issues the expert kernels, in the frameworks' words: Megatron-LM's ``--cuda-graph-impl full_iteration``
(and Megatron-Bridge's ``model.cuda_graph_impl``) read as ``cuda_graph='full_iteration'``, which lifts the
experts' host-issue bound, priced as ``estimate --cuda-graph full_iteration`` prices it and written back by
``--emit-launch megatron``; torchtitan's one grouped GEMM (``moe_expert_kernels='grouped'``) as its default."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_options

# Qwen3-30B-A3B at FP8 current scaling on 16 H100, EP16, micro-batch 1: the Megatron-Bridge 26.04.01 layout whose
# small expert layers the host's kernel issue bounds
FLAGS = ("--expert-model-parallel-size 16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
         "--micro-batch-size 1 --global-batch-size 1024 --seq-length 4096 --fp8-format hybrid --fp8-recipe tensorwise")
OURS = "dp=16,ep=16,zero=1,mbs=1,gbs=1024,seq=4096,param_dtype=fp8,fp8_scaling=current"
MODEL, CLUSTER = "qwen3-30b-a3b", "2x8xH100"


def _estimate(capsys, *extra: str) -> dict:
    code = main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_spellings_read_as_cuda_graph():
    assert read_options("megatron", FLAGS + " --cuda-graph-impl full_iteration")["cuda_graph"] == "full_iteration"
    assert "cuda_graph" not in read_options("megatron", FLAGS + " --cuda-graph-impl transformer_engine")
    assert "cuda_graph" not in read_options("megatron", FLAGS)
    bridge = read_options("megatron-bridge", "model.expert_model_parallel_size=16 model.cuda_graph_impl=full_iteration "
                                             "train.micro_batch_size=1")
    assert bridge["cuda_graph"] == "full_iteration"


def test_full_iteration_graph_lifts_the_host_issue_bound(capsys):
    eager = _estimate(capsys, "--layout", OURS)
    graph = _estimate(capsys, "--layout", OURS, "--cuda-graph", "full_iteration")
    megatron = _estimate(capsys, "--framework", "megatron", "--layout", FLAGS + " --cuda-graph-impl full_iteration")
    assert megatron["time"]["step_s"] == pytest.approx(graph["time"]["step_s"], rel=1e-12)
    assert graph["time"]["step_s"] < eager["time"]["step_s"]  # 8 local experts' FP8-CS kernels outlast their GPU work
    # layer-wise graphs leave dropless experts eager: priced as without
    partial = _estimate(capsys, "--layout", OURS, "--cuda-graph", "partial")
    assert partial["time"]["step_s"] == eager["time"]["step_s"]
    # one grouped GEMM for all local experts: the host issues one set of kernels, not eight
    grouped = _estimate(capsys, "--layout", OURS, "--moe-expert-kernels", "grouped")
    assert graph["time"]["step_s"] <= grouped["time"]["step_s"] < eager["time"]["step_s"]


def test_launch_carries_the_full_iteration_graph_back(capsys):
    main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--layout", OURS, "--cuda-graph", "full_iteration",
          "--emit-launch", "megatron"])
    command = capsys.readouterr().out.split("pretrain_gpt.py", 1)[1]
    assert "--cuda-graph-impl full_iteration" in command
    main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--layout", OURS, "--emit-launch", "megatron"])
    assert "--cuda-graph-impl" not in capsys.readouterr().out


def test_bad_value_is_one_line(capsys):
    code = main(["estimate", "--model", MODEL, "--cluster", CLUSTER, "--layout", OURS, "--cuda-graph", "always"])
    err = capsys.readouterr().err
    assert code == 2 and "--cuda-graph" in err and "Traceback" not in err
