"""Multi-token prediction in the frameworks' words: Megatron-LM's ``--mtp-num-layers N`` and
Megatron-Bridge's ``model.mtp_num_layers`` read as the planner's ``mtp_layers``, priced as
``plan/estimate --mtp-layers`` price it, and written back by ``--emit-launch megatron``."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_options

FLAGS = ("--pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer "
         "--overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 --global-batch-size 2048 --seq-length 4096 "
         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
OURS = "pp=4,dp=64,ep=8,zero=1,mbs=1,gbs=2048,seq=4096,recompute=full"


def _estimate(capsys, *extra: str) -> dict:
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xB200", "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_megatron_and_bridge_spellings_read_as_mtp_layers():
    assert read_options("megatron", FLAGS + " --mtp-num-layers 1")["mtp_layers"] == 1
    assert "mtp_layers" not in read_options("megatron", FLAGS)
    bridge = read_options("megatron-bridge", "model.pipeline_model_parallel_size=4 model.mtp_num_layers=1 "
                                             "train.micro_batch_size=1 train.global_batch_size=2048")
    assert bridge["mtp_layers"] == 1


def test_megatron_flag_prices_what_the_cli_option_prices(capsys):
    """The same estimate from Megatron's flag and from ``--mtp-layers``; the last stage holds more
    (the depth's layer, projection and second logits) than without it."""
    plain = _estimate(capsys, "--layout", OURS)
    cli = _estimate(capsys, "--layout", OURS, "--mtp-layers", "1")
    megatron = _estimate(capsys, "--framework", "megatron", "--layout", FLAGS + " --mtp-num-layers 1")
    assert megatron["time"]["step_s"] == pytest.approx(cli["time"]["step_s"], rel=1e-12)
    assert megatron["memory"]["peak_bytes"] == pytest.approx(cli["memory"]["peak_bytes"], rel=1e-12)
    assert cli["time"]["step_s"] > plain["time"]["step_s"]  # the runtime's split does not make room for it


def test_launch_carries_mtp_back(capsys):
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xB200", "--layout", OURS, "--mtp-layers", "1",
                 "--emit-launch", "megatron"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    command = out.split("pretrain_gpt.py", 1)[1]
    assert "--mtp-num-layers 1" in command
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xB200", "--layout", OURS,
                 "--emit-launch", "megatron"])
    assert "--mtp-num-layers" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["--mtp-num-layers x", "--mtp-num-layers"])
def test_bad_mtp_flag_is_one_line(capsys, bad):
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xB200", "--framework", "megatron",
                 "--layout", FLAGS + " " + bad])
    err = capsys.readouterr().err
    assert code == 2 and "--mtp-num-layers needs a whole number" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


BRIDGE_LAYOUT = "Et*4|(t*4|)*14tmL"
"""Megatron-Bridge's DeepSeek-V3 GB300 preset layout (scripts/performance/configs/deepseek/
deepseek_workload_base_configs.py at v0.3.1 / v0.4.2: pp=2, 16 stages)."""


def test_megatrons_pipeline_layout_read_and_priced_as_stated(capsys):
    """``--pipeline-model-parallel-layout`` sets the virtual stages (16 stages over pp=2: v=8) and the
    stages each rank holds; the recipe's string names exactly the split ``--mtp-layers 1
    --no-split-embedding`` gives, so the two estimates are the same."""
    flags = ("--pipeline-model-parallel-size 2 --expert-model-parallel-size 32 --use-distributed-optimizer "
             "--overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 --global-batch-size 4096 "
             f"--seq-length 4096 --mtp-num-layers 1 --pipeline-model-parallel-layout '{BRIDGE_LAYOUT}'")
    assert read_options("megatron", flags)["pipeline_layout"] == BRIDGE_LAYOUT
    def est(*extra):
        code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xGB300", "--json", *extra])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)
    megatron = est("--framework", "megatron", "--layout", flags)
    ours = est("--layout", "pp=2,dp=128,ep=32,zero=1,mbs=1,gbs=4096,seq=4096,schedule=interleaved-1f1b,virtual_stages=8",
               "--mtp-layers", "1", "--no-split-embedding")
    assert megatron["layout"]["virtual_stages"] == 8
    assert megatron["time"]["step_s"] == pytest.approx(ours["time"]["step_s"], rel=1e-12)
    assert megatron["memory"]["peak_bytes"] == pytest.approx(ours["memory"]["peak_bytes"], rel=1e-12)


@pytest.mark.parametrize("layout,match", [
    ("Et*4|(t*4|)*14tL", "places 0 MTP depth"),       # --mtp-num-layers 1 given, no m
    ("Et*4|(t*4|)*13tmL", "not a multiple of pp=2"),  # 15 stages
    ("Ex*4|t", "use E (embedding)"),
])
def test_bad_pipeline_layout_is_one_line(capsys, layout, match):
    flags = ("--pipeline-model-parallel-size 2 --expert-model-parallel-size 32 --micro-batch-size 1 "
             f"--global-batch-size 4096 --seq-length 4096 --mtp-num-layers 1 --pipeline-model-parallel-layout '{layout}'")
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xGB300", "--framework", "megatron",
                 "--layout", flags])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_launch_states_the_planned_stages(capsys):
    """A pipelined plan launches with the layout string of the split it priced (Megatron's own split
    needs the layers to divide evenly: 61 over 4 does not), read back to the same stages."""
    code = main(["estimate", "--model", "deepseek-v3", "--cluster", "32x8xB200", "--layout", OURS, "--mtp-layers", "1",
                 "--no-split-embedding", "--emit-launch", "megatron"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "--pipeline-model-parallel-layout 'Et*16|t*16|t*16|t*13mL'" in out  # Megatron-Bridge's (4, 1) layout


def test_megatrons_split_flags_are_read_and_the_split_priced_is_said():
    """``--account-for-embedding/loss-in-pipeline-split`` are Megatron's flags for the split the planner
    prices by default (read, not refused); without both (or a layout string) Megatron splits evenly, and
    a note says which split was priced."""
    from modelcarve.commands.emit.vocab import read_layout

    base = "--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 64 --seq-length 4096"
    both = " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    say = "priced with the planner's balanced split"
    assert not [n for n in read_layout("megatron", base + both, devices=32)[1] if say in n]
    assert [n for n in read_layout("megatron", base, devices=32)[1] if say in n and "evenly" in n]
    only = read_layout("megatron", base + " --account-for-loss-in-pipeline-split", devices=32)[1]
    assert [n for n in only if say in n and "only --account-for-loss-in-pipeline-split" in n]
    stated = read_layout("megatron", base + " --pipeline-model-parallel-layout 'Et*2|t*2|t*2|t*2L'", devices=32)[1]
    assert not [n for n in stated if say in n]
    assert read_layout("megatron", base + both, devices=32)[0] == read_layout("megatron", base, devices=32)[0]


def test_megatrons_uneven_split_flags_priced_as_the_layout_they_give(capsys):
    """``--decoder-first/last-pipeline-num-layers`` (Megatron's uneven split: the first and last ranks' layers,
    the middle ranks the rest evenly) price the same as the layout string they give; where Megatron raises
    (the rest does not divide) the estimate says so in one line."""
    base = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel "
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 "
            "--global-batch-size 512 --seq-length 8192")
    def est(flags):
        code = main(["estimate", "--model", "llama-3.1-405b", "--cluster", "64x8xH100", "--json", "--framework",
                     "megatron", "--layout", flags])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)
    uneven = est(base + " --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7")
    stated = est(base + " --pipeline-model-parallel-layout 'Et*7|(t*8|)*14t*7L'")
    assert uneven["time"]["step_s"] == pytest.approx(stated["time"]["step_s"], rel=1e-12)
    assert uneven["memory"]["peak_bytes"] == pytest.approx(stated["memory"]["peak_bytes"], rel=1e-12)
    code = main(["estimate", "--model", "llama-3.1-405b", "--cluster", "64x8xH100", "--framework", "megatron",
                 "--layout", base + " --decoder-first-pipeline-num-layers 5"])
    err = capsys.readouterr().err
    assert code == 2 and "divide evenly" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_launch_of_an_uneven_megatron_split_states_that_split(capsys):
    """An estimate of Megatron's uneven split launches with the stages it priced (one rule, spec/stages.py
    ``planned_layout``, for the planner and the launch), not the balanced split."""
    base = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --sequence-parallel "
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --micro-batch-size 1 "
            "--global-batch-size 512 --seq-length 8192 --decoder-first-pipeline-num-layers 6")
    code = main(["estimate", "--model", "llama-3.1-405b", "--cluster", "64x8xH100", "--framework", "megatron",
                 "--layout", base, "--emit-launch", "megatron"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "--pipeline-model-parallel-layout 'Et*6|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8L'" in out
