"""``estimate --framework megatron-bridge``: a run described as a Megatron-Bridge recipe's overrides
(commands/emit/bridge_vocab.py), read as Megatron-LM's flags of the same Megatron-Core fields and
then through the one Megatron reader.

* The published Megatron-Bridge 25.11 performance rows (data/training_published.csv), written as the
  overrides their recipes take, read back to the very layout and planner options the calibration
  prices them with (plan/train/calibration.py ``nemo_cases``, ``BRIDGE_RECIPE``): FP8 presets set
  fp8_param_gather, the performance scripts' mixed_precision.grad_reduce_in_fp32=false is bf16 gradients.
* Megatron-Bridge's own precedence: the mixed-precision config overwrites ddp's field of the same name,
  so a lone ddp.grad_reduce_in_fp32=false under a preset leaves fp32 gradients (and says so).
* The estimate of the overrides equals, to the byte, the estimate of our spelling with the option.
* Bad words are refused in one line.
"""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit.vocab import read_layout, read_options
from modelcarve.spec.errors import ModelcarveError
from modelcarve.plan.train.options import TrainOptions
from modelcarve.spec.layout import Layout

OVERLAPS = ("overlap_grad_reduce", "overlap_param_gather", "tp_overlap", "overlap_p2p", "moe_a2a_overlap")

PRESET = {"bf16": "bf16_mixed", "fp8-cs": "bf16_with_fp8_current_scaling_mixed",
          "fp8-ds": "bf16_with_fp8_delayed_scaling_mixed", "mxfp8": "bf16_with_mxfp8_mixed"}


def _overrides(row: dict) -> str:
    """A published row as the overrides of its recipe (scripts/performance sets the gradient field in both)."""
    words = [f"model.tensor_model_parallel_size={row['tp']}", f"model.pipeline_model_parallel_size={row['pp']}",
             f"model.context_parallel_size={row['cp']}", f"model.sequence_parallel={'true' if int(row['tp']) > 1 else 'false'}",
             f"model.virtual_pipeline_model_parallel_size={row['vp'] if int(row['vp']) > 1 else 'null'}",
             f"train.micro_batch_size={row['mbs']}", f"train.global_batch_size={row['gbs']}",
             f"model.seq_length={row['seq']}", f"dataset.seq_length={row['seq']}",
             f"mixed_precision={PRESET[row['precision']]}", "mixed_precision.grad_reduce_in_fp32=false",
             "ddp.grad_reduce_in_fp32=false", "model.recompute_granularity=null", "optimizer.lr=3e-4",
             "train.train_iters=50"]
    if int(row["ep"]) > 1:
        words.append(f"model.expert_model_parallel_size={row['ep']}")
    # the performance configs' CommOverlapConfig: TE's TP overlap where TP > 1, the MoE all-to-all overlap where the
    # preset sets moe_a2a_overlap (scripts/performance/utils/overrides.py), the rest its own choice
    words.append(f"comm_overlap.tp_comm_overlap={'true' if int(row['tp']) > 1 else 'false'}")
    if row.get("a2a_overlap") == "1":
        words.append("comm_overlap.overlap_moe_expert_parallel_comm=true")
    if row["fsdp"] == "1":
        words += ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
    else:
        words.append("ddp.use_distributed_optimizer=true")
    return " ".join(words)


def test_published_bridge_rows_read_as_the_calibration_prices_them():
    import csv
    import io

    from modelcarve.plan.train.calibration import BRIDGE_RECIPE, REPO_DATA, nemo_cases

    text = (REPO_DATA / "training_published.csv").read_text()
    rows = list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))
    cases = nemo_cases()
    read = 0
    for row, case in zip(rows, cases):
        if not row["source"].startswith("MB-") or case.layout is None:
            continue
        got, notes = read_layout("megatron-bridge", _overrides(row), devices=case.cluster.num_devices)
        assert Layout.parse(got) == case.layout.replace(recompute="none"), (case.name, got)
        fp8 = row["precision"] != "bf16"
        options = read_options("megatron-bridge", _overrides(row))
        assert options.get("fp8_param_gather", False) == fp8, case.name
        priced = TrainOptions(**{k: v for k, v in options.items() if k != "fp8_param_gather"})
        for name in OVERLAPS:  # the overlaps the calibration prices (MODERN, TP_COMM_OVERLAP, a2a_overlap)
            assert getattr(priced, name) == getattr(case.options, name), (case.name, name)
        assert case.options.fp8_param_gather == BRIDGE_RECIPE["fp8_param_gather"]
        assert any("optimizer.lr, train.train_iters" in n for n in notes)
        read += 1
    assert read >= 114  # 25.11 (32), 26.02.01 (27), 26.04.01 (29), 26.06 (18) and 26.08 (8)


def test_the_mixed_precision_config_decides_the_gradients():
    base = "model.tensor_model_parallel_size=2 train.micro_batch_size=1 train.global_batch_size=16 model.seq_length=4096"
    got, notes = read_layout("megatron-bridge", base + " ddp.grad_reduce_in_fp32=false", devices=16)
    assert "grad_dtype" not in got  # bf16_mixed's grad_reduce_in_fp32=True overwrites ddp's
    assert any("is overwritten by the mixed-precision config's grad_reduce_in_fp32=true" in n for n in notes)
    assert any("mixed_precision not given: read as the recipes' bf16_mixed" in n for n in notes)
    got, _ = read_layout("megatron-bridge", base + " mixed_precision=bf16-mixed mixed_precision.grad_reduce_in_fp32=false", devices=16)
    assert Layout.parse(got).grad_dtype == "bf16" and Layout.parse(got).dp == 8
    got, _ = read_layout("megatron-bridge", base + " mixed_precision=bf16_with_mxfp8_mixed mixed_precision.fp8_param_gather=false", devices=16)
    assert Layout.parse(got).param_dtype == "mxfp8"
    assert "fp8_param_gather" not in read_options(
        "megatron-bridge", base + " mixed_precision=bf16_with_mxfp8_mixed mixed_precision.fp8_param_gather=false")


def test_dispatcher_kernels_and_the_mxfp8_buffer_rule():
    """An MoE recipe's overrides as users pass them: the dispatcher is the planner's option; kernel and
    fusion fields are skipped with a note; fp8_param_gather under MXFP8 without the reused gradient
    buffer is what Megatron-Bridge itself refuses (MixedPrecisionConfig.finalize), and so is it here."""
    base = ("model.tensor_model_parallel_size=1 model.expert_model_parallel_size=8 train.micro_batch_size=1 "
            "train.global_batch_size=64 model.seq_length=4096 ddp.use_distributed_optimizer=true "
            "mixed_precision=bf16_with_mxfp8_mixed model.moe_router_padding_for_fp8=true "
            "model.moe_flex_dispatcher_backend=null model.moe_permute_fusion=true")
    got, notes = read_layout("megatron-bridge", base + " model.moe_token_dispatcher_type=alltoall", devices=8)
    assert Layout.parse(got).ep == 8 and Layout.parse(got).param_dtype == "mxfp8"
    assert any("skipped: model.moe_flex_dispatcher_backend, model.moe_permute_fusion, model.moe_router_padding_for_fp8"
               in n for n in notes)
    dp_overlap = {"overlap_grad_reduce": True, "overlap_param_gather": True}  # not given: the planner's default
    assert read_options("megatron-bridge", base + " model.moe_token_dispatcher_type=alltoall") == {
        "fp8_param_gather": True, "moe_dispatcher": "alltoall", **dp_overlap}
    assert read_options("megatron-bridge", base + " model.moe_token_dispatcher_type=flex")["moe_dispatcher"] == "fused"
    off = " mixed_precision.fp8_param_gather=false mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"
    assert read_options("megatron-bridge", base + off) == dp_overlap
    with pytest.raises(ModelcarveError, match="needs reuse_grad_buf_for_mxfp8_param_ag=true"):
        read_layout("megatron-bridge", base + " mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false", devices=8)
    with pytest.raises(ModelcarveError, match="moe_token_dispatcher_type=allgather is not modelled"):
        read_layout("megatron-bridge", base + " model.moe_token_dispatcher_type=allgather", devices=8)


def test_estimate_of_bridge_words_equals_ours(capsys):
    words = ("model.tensor_model_parallel_size=8 model.sequence_parallel=true ddp.use_distributed_optimizer=true "
             "train.micro_batch_size=1 train.global_batch_size=64 model.seq_length=4096 "
             "mixed_precision=bf16_with_fp8_current_scaling_mixed mixed_precision.grad_reduce_in_fp32=false "
             "model.recompute_granularity=selective model.recompute_modules=[core_attn,mlp]")
    ours = ("tp=8,sp,zero=1,dp=8,gbs=64,mbs=1,seq=4096,param_dtype=fp8,fp8_scaling=current,grad_dtype=bf16,"
            "recompute=core_attn+mlp")
    out = {}
    for name, args in (("bridge", ["--layout", words, "--framework", "megatron-bridge"]),
                       ("ours", ["--layout", ours, "--fp8-param-gather"])):
        code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "64xH100", "--json", *args])
        out[name] = json.loads(capsys.readouterr().out)
        assert code in (0, 1)
    assert out["bridge"]["layout"] == out["ours"]["layout"] and out["bridge"]["memory"] == out["ours"]["memory"]
    assert out["bridge"]["time"] == out["ours"]["time"]


@pytest.mark.parametrize("words,match", [
    ("model.tensor_model_parallel_size", "is not an override; give section.field=value"),
    ("model.num_layers=80", "model.num_layers is not a field modelcarve reads"),
    ("mixed_precision=fp16_mixed", "mixed_precision=fp16_mixed is not a preset modelcarve reads"),
    ("mixed_precision.fp4=nvfp4", "mixed_precision.fp4 is not a field modelcarve reads"),
    ("model.seq_length=4096 dataset.seq_length=8192", "model.seq_length and dataset.seq_length disagree"),
])
def test_bad_words_refused_in_one_line(words, match):
    with pytest.raises(ModelcarveError, match=match) as err:
        read_layout("megatron-bridge", words, devices=8)
    assert "\n" not in str(err.value)


def test_plan_for_megatron_bridge(capsys):
    """``plan --engine megatron-bridge`` ranks what Megatron-LM expresses (Megatron-Core underneath), FP8
    layouts priced as its presets hold them: the linear weights are the FP8 tensors with no bf16 copy,
    so each layout's weights are Megatron's less the FP8 cache row it already counts; the launch is
    Megatron-LM's, with --fp8-param-gather; another engine's launch is refused in one line."""
    from modelcarve.commands.emit import can_express
    from modelcarve.spec.catalog import get_model

    common = ["plan", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--global-batch", "512", "--seq", "8192",
              "--precision", "fp8", "--top", "3", "--json"]
    out = {}
    for engine in ("megatron", "megatron-bridge"):
        assert main(common + ["--engine", engine]) == 0
        out[engine] = json.loads(capsys.readouterr().out)["layouts"]
    model = get_model("llama-3.1-70b")
    by_short = {i["short"]: i for i in out["megatron"]}
    shared = [i for i in out["megatron-bridge"] if i["short"] in by_short]
    assert shared, "no layout ranked by both"
    for item in out["megatron-bridge"]:
        assert can_express("megatron", Layout.from_dict(item["layout"]), model, serving=False)
    for item in shared:
        bridge, plain = item["memory"]["breakdown"], by_short[item["short"]]["memory"]["breakdown"]
        assert plain["weights"] - bridge["weights"] == pytest.approx(plain["fp8_weight_cache"], rel=1e-12)
    assert main(common[:-1] + ["--top", "1", "--engine", "megatron-bridge", "--emit-launch", "megatron"]) == 0
    assert "--fp8-param-gather" in capsys.readouterr().out
    assert main(common + ["--engine", "megatron-bridge", "--emit-launch", "torchtitan"]) == 2
    assert "--engine megatron-bridge and --emit-launch torchtitan disagree" in capsys.readouterr().err


def test_the_loss_fusion_read_with_its_kernel():
    """``model.cross_entropy_loss_fusion`` is on by default (``GPTProvider``); with
    ``model.cross_entropy_fusion_impl=te`` it is TE's kernel, the planner's ``loss=fused``; without the
    impl the provider's default decides, priced as Megatron-Core's native path (the unfused loss),
    said in a note; fusion off is the unfused loss whatever the impl."""
    base = "train.micro_batch_size=1 train.global_batch_size=64"
    assert read_options("megatron-bridge", f"{base} model.cross_entropy_fusion_impl=te")["loss"] == "fused"
    assert "loss" not in read_options("megatron-bridge", base)
    assert "loss" not in read_options("megatron-bridge",
                                      f"{base} model.cross_entropy_loss_fusion=false model.cross_entropy_fusion_impl=te")
    _, notes = read_layout("megatron-bridge", base, devices=8)
    assert any("cross_entropy_fusion_impl not given" in n for n in notes)
    with pytest.raises(ModelcarveError, match="cross_entropy_fusion_impl=triton"):
        read_options("megatron-bridge", f"{base} model.cross_entropy_fusion_impl=triton")


# --- communication overlap (bridge_vocab.py module doc: comm_overlap.py @ v0.3.1) -------------------------------
DENSE = ("model.tensor_model_parallel_size=4 model.sequence_parallel=true ddp.use_distributed_optimizer=true "
         "train.micro_batch_size=1 train.global_batch_size=64 model.seq_length=4096")
"""llama-3.1-70b on 64 H100: tp=4 with SP, dp=16 with the distributed optimizer."""


def _overlaps(words: str) -> dict:
    """The planner's overlap options the overrides price (the defaults where they say nothing)."""
    options = read_options("megatron-bridge", words)
    priced = TrainOptions(**{k: v for k, v in options.items() if k in OVERLAPS})
    return {name: getattr(priced, name) for name in OVERLAPS}


def test_each_overlap_override_reads_as_megatron_bridge_applies_it():
    from modelcarve.plan.train.calibration import TP_COMM_OVERLAP

    default = {"overlap_grad_reduce": True, "overlap_param_gather": True, "tp_overlap": 0.0, "overlap_p2p": True,
               "moe_a2a_overlap": False}
    # nothing said: the recipe decides; priced at the planner's defaults, as before, and said
    assert _overlaps(DENSE) == default
    _, notes = read_layout("megatron-bridge", DENSE, devices=64)
    assert any("ddp.overlap_grad_reduce not given: the recipe's setting decides" in n for n in notes)
    assert any("comm_overlap.tp_comm_overlap not given" in n for n in notes)
    # ddp's own fields, without a comm_overlap config
    assert _overlaps(DENSE + " ddp.overlap_grad_reduce=false") == {**default, "overlap_grad_reduce": False}
    assert _overlaps(DENSE + " ddp.overlap_param_gather=false") == {**default, "overlap_param_gather": False}
    # a comm_overlap config: TP overlap as given (where TP >= 2 with SP), DP overlap on with the distributed
    # optimizer over ddp's (said), the pipeline and MoE overlaps as given
    assert _overlaps(DENSE + " comm_overlap.tp_comm_overlap=true") == {**default, "tp_overlap": TP_COMM_OVERLAP}
    words = DENSE.replace("model.sequence_parallel=true", "model.sequence_parallel=false") + " comm_overlap.tp_comm_overlap=true"
    assert _overlaps(words)["tp_overlap"] == 0.0
    assert any("turned off by Megatron-Bridge (sequence_parallel=false)" in n
               for n in read_layout("megatron-bridge", words, devices=64)[1])
    words = DENSE + " comm_overlap.tp_comm_overlap=false ddp.overlap_grad_reduce=false"
    assert _overlaps(words) == default
    assert any("ddp.overlap_grad_reduce=false is overwritten by the comm_overlap config's overlap_grad_reduce=true" in n
               for n in read_layout("megatron-bridge", words, devices=64)[1])
    assert _overlaps(DENSE + " comm_overlap.tp_comm_overlap=false comm_overlap.overlap_grad_reduce=false "
                             "comm_overlap.overlap_param_gather=false") == {
        **default, "overlap_grad_reduce": False, "overlap_param_gather": False}
    assert _overlaps(DENSE + " comm_overlap.overlap_p2p_comm=false") == {**default, "overlap_p2p": False}
    words = DENSE.replace("ddp.use_distributed_optimizer=true ", "") + " comm_overlap.overlap_grad_reduce=false"
    assert _overlaps(words)["overlap_grad_reduce"] is True  # no distributed optimizer: ddp's (not given) decides
    assert any("applies only with ddp.use_distributed_optimizer" in n
               for n in read_layout("megatron-bridge", words, devices=64)[1])
    # the MoE all-to-all: the comm_overlap config's over the model's
    moe = "model.expert_model_parallel_size=8 ddp.use_distributed_optimizer=true train.micro_batch_size=1"
    assert _overlaps(moe + " comm_overlap.overlap_moe_expert_parallel_comm=true")["moe_a2a_overlap"] is True
    assert _overlaps(moe + " model.overlap_moe_expert_parallel_comm=true")["moe_a2a_overlap"] is True
    words = moe + " model.overlap_moe_expert_parallel_comm=true comm_overlap.tp_comm_overlap=false"
    assert _overlaps(words)["moe_a2a_overlap"] is False
    assert any("model.overlap_moe_expert_parallel_comm=true is overwritten" in n
               for n in read_layout("megatron-bridge", words, devices=8)[1])
    # tuning fields are skipped, said
    _, notes = read_layout("megatron-bridge", DENSE + " comm_overlap.bucket_size=134217728 "
                                                      "comm_overlap.delay_wgrad_compute=false", devices=64)
    assert any("not price, skipped: comm_overlap.bucket_size, comm_overlap.delay_wgrad_compute" in n for n in notes)


def test_bridge_overlap_overrides_move_the_exposed_time(capsys):
    """ddp.overlap_grad_reduce=false exposes more data-parallel time than true; TE's TP overlap leaves
    1 - TP_COMM_OVERLAP of the TP time exposed; the overrides' estimate equals Megatron-LM's flags' one."""
    from modelcarve.plan.train.calibration import TP_COMM_OVERLAP

    def estimate(*args: str) -> dict:
        code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--json", *args])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)

    bridge = {value: estimate("--framework", "megatron-bridge", "--layout", f"{DENSE} ddp.overlap_grad_reduce={value}")
              for value in ("true", "false")}
    on, off = (bridge[v]["comm"]["exposed_s_by_axis"] for v in ("true", "false"))
    assert off["dp"] > on["dp"] and bridge["false"]["time"]["step_s"] > bridge["true"]["time"]["step_s"]
    tp = estimate("--framework", "megatron-bridge", "--layout", f"{DENSE} comm_overlap.tp_comm_overlap=true")
    assert tp["comm"]["exposed_s_by_axis"]["tp"] == pytest.approx((1 - TP_COMM_OVERLAP) * on["tp"], rel=1e-12)
    flags = ("--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer --micro-batch-size 1 "
             "--global-batch-size 64 --seq-length 4096 --cross-entropy-loss-fusion --overlap-grad-reduce "
             "--overlap-param-gather --tp-comm-overlap")
    megatron = estimate("--framework", "megatron", "--layout", flags)
    assert megatron["time"] == tp["time"] and megatron["comm"] == tp["comm"]


@pytest.mark.parametrize("words,match", [
    ("comm_overlap.tp_comm_overlap=maybe", "comm_overlap.tp_comm_overlap=maybe is not a boolean; give true or false"),
    ("ddp.overlap_grad_reduce=1", "ddp.overlap_grad_reduce=1 is not a boolean"),
    ("comm_overlap.overlap_everything=true", "comm_overlap.overlap_everything is not a field modelcarve reads"),
    ("model.moe_a2a_overlap=true", "model.moe_a2a_overlap is not a field"),
    ("comm_overlap.overlap_moe_expert_parallel_comm=true",
     "overlap_moe_expert_parallel_comm needs model.expert_model_parallel_size > 1"),
])
def test_bad_overlap_overrides_refused_in_one_line(capsys, words, match):
    with pytest.raises(ModelcarveError, match=match) as err:
        read_layout("megatron-bridge", words, devices=8)
    assert "\n" not in str(err.value)
    code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--framework", "megatron-bridge",
                 "--layout", f"train.micro_batch_size=1 train.global_batch_size=8 {words}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("modelcarve: error:")
