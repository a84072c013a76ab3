"""``estimate --framework ENGINE``: a layout in a framework's own words read into ours, through the
same per-engine tables ``--emit-launch`` writes (commands/emit/vocab.py).

* The words: torchtitan's ``recompute=selective`` is op-level SAC (our ``ops``), Megatron's is the
  attention-core recompute (our ``selective``); each gives that meaning's documented memory (the
  estimate of our own spelling, to the byte) and the two differ.
* The flags: every layout the two training frameworks can express, emitted with --emit-launch's
  own argv and read back, is the same layout (Megatron's implicit data parallelism from the
  cluster's devices; torchtitan's replicate x shard degrees as FSDP / HSDP).
"""

from __future__ import annotations

import json
import shlex

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit import argv, can_express
from modelcarve.commands.emit.vocab import read_layout, read_options
from modelcarve.spec.catalog import get_model
from modelcarve.spec.errors import ModelcarveError
from modelcarve.spec.hardware import parse_cluster
from modelcarve.spec.layout import Layout
from modelcarve.spec.stages import megatron_layout

BASE = "gbs=64,mbs=1,seq=4096"


def _estimate(capsys, layout: str, *extra: str) -> dict:
    code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "64xH100", "--layout", layout, "--json", *extra])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_selective_means_what_the_framework_means(capsys):
    layout = f"tp=8,pp=4,dp=2,{BASE},recompute=selective"
    titan = _estimate(capsys, layout, "--framework", "torchtitan")
    megatron = _estimate(capsys, layout, "--framework", "megatron")
    ops = _estimate(capsys, f"tp=8,pp=4,dp=2,{BASE},recompute=ops")
    selective = _estimate(capsys, layout)
    assert titan["layout"]["recompute"] == "ops" and megatron["layout"]["recompute"] == "selective"
    assert megatron["memory"] == selective["memory"]
    acts = ("activations", "recompute_working_layer", "logits")
    assert {k: titan["memory"]["breakdown"][k] for k in acts} == {k: ops["memory"]["breakdown"][k] for k in acts}
    assert titan["memory"]["breakdown"]["activations"] != megatron["memory"]["breakdown"]["activations"]
    assert any("op-level selective activation checkpointing" in n for n in titan["read_as"])
    assert any("attention core" in n for n in megatron["read_as"])


def test_each_framework_computes_its_own_loss(capsys):
    """torchtitan 0.3.0's recipes compute the loss with ``ChunkedLossWrapper`` (8 chunks a
    micro-batch): ``--framework torchtitan`` prices it as measured (14 B a chunk logit + 6 B a token
    and hidden unit, plan/train/profile.py); without a framework the planner prices Megatron-Core's
    unfused loss (6 B a logit);
    a ``--loss`` the user states wins over the framework's. Llama 3.1 8B, FSDP over 8 H100, one
    stage (it holds the logits), micro-batch 2 x 8,192 tokens."""
    model = get_model("llama-3.1-8b")
    T, V, h = 2 * 8192, model.vocab_size, model.hidden_size
    layout = "dp=8,zero=3,mbs=2,gbs=16,seq=8192"

    def logits(*extra: str) -> float:
        code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--layout", layout, "--json", *extra])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)["memory"]["breakdown"]["logits"]

    assert logits("--framework", "torchtitan") == pytest.approx(14 * (T / 8) * V + 6 * T * h, abs=1)
    assert logits() == pytest.approx(6 * T * V, abs=1)  # the planner's default: Megatron-Core's unfused loss
    assert logits("--framework", "torchtitan", "--loss", "torch") == pytest.approx(12 * T * V, abs=1)


def test_each_framework_holds_the_parameters_its_own_way(capsys):
    # Llama 3.1 8B, FSDP over 8 GPUs (one stage holds every parameter): torchtitan's FSDP2 keeps fp32
    # parameters that are their own master (4 + 4 + 8 = 16 B a parameter, sharded over 8); Megatron and
    # DeepSpeed bf16 weights, fp32 gradients and an fp32 master + moments (2 + 4 + 12 = 18 B); modelcarve's
    # runtime as FSDP2, and under its distributed optimizer (ZeRO-1 over 8 replicas) as Megatron
    model = get_model("llama-3.1-8b")
    P = model.total_params

    def states(layout: str, *extra: str) -> float:
        code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--layout", layout, "--json", *extra])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        bd = json.loads(out)["memory"]["breakdown"]
        return bd["weights"] + bd["gradients"] + bd["optimizer_states"]

    fsdp = "dp=8,fsdp,mbs=1,gbs=8,seq=4096"
    assert states(fsdp, "--framework", "torchtitan") == pytest.approx(16 * P / 8, rel=1e-9)
    assert states(fsdp, "--framework", "modelcarve") == pytest.approx(16 * P / 8, rel=1e-9)
    assert states(fsdp, "--framework", "megatron") == pytest.approx(18 * P / 8, rel=1e-9)
    assert states(fsdp) == pytest.approx(18 * P / 8, rel=1e-9)  # without --framework: Megatron's
    zero1 = "dp=8,zero=1,mbs=1,gbs=8,seq=4096"
    assert states(zero1, "--framework", "modelcarve") == pytest.approx((2 + 4) * P + 12 * P / 8, rel=1e-9)
    ddp = "dp=8,mbs=1,gbs=8,seq=4096"
    assert states(ddp, "--framework", "modelcarve") == pytest.approx(16 * P, rel=1e-9)


def test_each_framework_keeps_its_own_moe_combine(capsys):
    # Megatron-Core 0.13+ multiplies the router's weights into the expert activation (the combine keeps
    # nothing); torchtitan (score_before_experts) and modelcarve's runtime (it weighs the experts' outputs)
    # keep one more bf16 copy of the routed tokens: the same memory as --moe-probs-on-combine says
    def acts(*extra: str) -> tuple[float, list]:
        code = main(["estimate", "--model", "qwen3-30b-a3b", "--cluster", "1x8xH100", "--layout",
                     "dp=8,ep=8,fsdp,mbs=1,gbs=8,seq=4096", "--json", *extra])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        d = json.loads(out)
        return d["memory"]["breakdown"]["activations"], d.get("read_as", [])

    plain, _ = acts()
    combine, _ = acts("--moe-probs-on-combine")
    assert combine > plain
    assert acts("--framework", "megatron")[0] == plain
    for engine in ("torchtitan", "modelcarve"):
        got, notes = acts("--framework", engine)
        assert got == combine and any("one more bf16 copy" in n for n in notes), engine


def test_megatron_precision_flags_read_into_layout_and_options(capsys):
    # --grad-reduce-in-bf16 is a layout field (grad_dtype), --fp8-param-gather a planner option: the estimate
    # of Megatron's flags equals, to the byte, the one of our spelling with the option given directly
    flags = ("--tensor-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer --micro-batch-size 1 "
             "--global-batch-size 64 --seq-length 4096 --bf16 --fp8-format hybrid --fp8-recipe tensorwise")
    ours = f"tp=8,sp,zero=1,dp=8,{BASE},param_dtype=fp8,fp8_scaling=current"
    read = _estimate(capsys, flags + " --fp8-param-gather --grad-reduce-in-bf16", "--framework", "megatron")
    direct = _estimate(capsys, ours + ",grad_dtype=bf16", "--fp8-param-gather")
    plain = _estimate(capsys, ours)
    assert read["layout"] == direct["layout"] and read["memory"] == direct["memory"]
    assert any("--fp8-param-gather read as the planner option fp8_param_gather" in n for n in read["read_as"])
    bd, pb = read["memory"]["breakdown"], plain["memory"]["breakdown"]
    assert bd["gradients"] == pytest.approx(pb["gradients"] / 2)  # bf16 gradient buffer
    assert pb["weights"] - bd["weights"] == pytest.approx(pb["fp8_weight_cache"])  # no bf16 copy of the linears
    # emitted back: the layout's field always, the planner option when the plan was priced with it (and
    # Megatron accepts it: an FP8 layout with the distributed optimizer), and both read back
    layout = Layout.parse(ours + ",grad_dtype=bf16")
    model, cluster = get_model("llama-3.1-70b"), parse_cluster("8x8xH100")
    cmd = argv("megatron", layout, model, cluster, serving=False)
    assert "--grad-reduce-in-bf16" in cmd and "--fp8-param-gather" not in cmd
    cmd = argv("megatron", layout, model, cluster, serving=False, planner_options={"fp8_param_gather": True})
    assert "--fp8-param-gather" in cmd
    flags = shlex.join(cmd[cmd.index("pretrain_gpt.py") + 1:])
    # the overlaps priced at the planner's default are in the launch too (Megatron's are off unless given)
    assert read_options("megatron", flags) == {"fp8_param_gather": True, "overlap_grad_reduce": True,
                                               "overlap_param_gather": True}
    assert Layout.parse(read_layout("megatron", flags, devices=64)[0]) == layout
    for other in (layout.replace(param_dtype="bf16"), layout.replace(zero=0)):  # Megatron would refuse the flag
        assert "--fp8-param-gather" not in argv("megatron", other, model, cluster, serving=False,
                                                planner_options={"fp8_param_gather": True})


def test_launch_carries_what_the_estimate_was_priced_with(capsys):
    """Megatron's --fp8-param-gather read from the framework's own flags prices the estimate, so its
    --emit-launch megatron writes it back (the launch follows the options priced, not only the CLI's)."""
    flags = ("--tensor-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer --micro-batch-size 1 "
             "--global-batch-size 64 --seq-length 4096 --bf16 --fp8-format hybrid --fp8-recipe tensorwise")
    for extra, emitted in (("", False), (" --fp8-param-gather", True)):
        code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--layout", flags + extra,
                     "--framework", "megatron", "--emit-launch", "megatron"])
        out = capsys.readouterr().out
        assert code in (0, 1) and "pretrain_gpt.py" in out
        assert ("--fp8-param-gather" in out.split("pretrain_gpt.py", 1)[1]) == emitted


def test_megatron_loss_flags_priced_and_carried_back(capsys):
    """Megatron-LM's ``--cross-entropy-loss-fusion`` with ``--cross-entropy-fusion-impl te`` is TE's
    fused kernel, the planner's ``loss=fused`` (2 B a logit); the fusion alone (Megatron-Core's native
    path) or ``native`` is priced as the unfused loss (6 B a logit, measured eager), said in a note;
    a plan priced with ``--loss fused`` launches with both flags, and they read back as it."""
    model = get_model("llama-3.1-8b")
    T, V = 2 * 8192, model.vocab_size
    flags = "--micro-batch-size 2 --global-batch-size 16 --seq-length 8192 --use-distributed-optimizer"

    def estimate(extra: str) -> dict:
        code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--framework", "megatron",
                     "--layout", f"{flags} {extra}", "--json"])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)

    te = estimate("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
    assert te["memory"]["breakdown"]["logits"] == pytest.approx(2 * T * V, abs=1)
    for extra in ("--cross-entropy-loss-fusion", "--cross-entropy-loss-fusion --cross-entropy-fusion-impl native",
                  "--cross-entropy-fusion-impl te"):
        got = estimate(extra)
        assert got["memory"]["breakdown"]["logits"] == pytest.approx(6 * T * V, abs=1), extra
        assert any("not the planner option loss=fused" in n and "unfused loss" in n for n in got["read_as"]), extra
    assert read_options("megatron", f"{flags} --cross-entropy-fusion-impl te --cross-entropy-loss-fusion") == {
        "loss": "fused", "overlap_grad_reduce": False, "overlap_param_gather": False}  # Megatron's overlap defaults
    for loss, emitted in (("fused", True), ("materialized", False)):
        code = main(["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--layout",
                     "dp=8,zero=1,mbs=2,gbs=16,seq=8192", "--loss", loss, "--emit-launch", "megatron"])
        out = capsys.readouterr().out
        assert code in (0, 1) and "pretrain_gpt.py" in out
        launch = " ".join(shlex.split(out.split("pretrain_gpt.py", 1)[1].replace("\\\n", " ")))
        assert ("--cross-entropy-loss-fusion" in launch and "--cross-entropy-fusion-impl te" in launch) == emitted
        overlaps = {"overlap_grad_reduce": True, "overlap_param_gather": True}  # priced at the default, launched so
        assert read_options("megatron", launch) == ({"loss": "fused", **overlaps} if emitted else overlaps)


def test_moe_a2a_overlap_from_the_cli_and_megatrons_flag(capsys):
    """``--moe-a2a-overlap`` and Megatron's ``--overlap-moe-expert-parallel-comm`` price the same
    estimate (the EP exchange hidden behind the paired compute: less exposed EP time), and the
    launch carries the flag back."""
    def estimate(*extra: str) -> dict:
        code = main(["estimate", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--json", *extra])
        out = capsys.readouterr().out
        assert code in (0, 1), out
        return json.loads(out)

    ours = "pp=2,dp=8,ep=8,zero=1,mbs=2,gbs=512,seq=4096"
    flags = ("--pipeline-model-parallel-size 2 --expert-model-parallel-size 8 --use-distributed-optimizer "
             "--micro-batch-size 2 --global-batch-size 512 --seq-length 4096")
    plain = estimate("--layout", ours)
    cli = estimate("--layout", ours, "--moe-a2a-overlap")
    megatron = estimate("--framework", "megatron", "--layout", flags + " --overlap-moe-expert-parallel-comm")
    assert cli["comm"]["exposed_s_by_axis"]["ep"] < plain["comm"]["exposed_s_by_axis"]["ep"]
    assert megatron["comm"]["exposed_s_by_axis"]["ep"] == pytest.approx(cli["comm"]["exposed_s_by_axis"]["ep"], rel=1e-12)
    code = main(["estimate", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--layout", ours, "--moe-a2a-overlap",
                 "--emit-launch", "megatron"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "--overlap-moe-expert-parallel-comm" in out.split("pretrain_gpt.py", 1)[1]


def test_plan_for_torchtitan_prices_its_parameters(capsys):
    code = main(["plan", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--global-batch", "32", "--seq", "4096",
                 "--engine", "torchtitan", "--top", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    P = get_model("llama-3.1-8b").total_params
    for item in json.loads(out)["layouts"]:
        lay, bd = item["layout"], item["memory"]["breakdown"]
        if lay["zero"] == 3 and lay["pp"] == 1 and lay["tp"] == 1:
            n = (lay["dp_shard"] or lay["dp"]) * lay["cp"]
            assert bd["weights"] + bd["gradients"] + bd["optimizer_states"] == pytest.approx(16 * P / n, rel=1e-9)
            break
    else:
        pytest.fail("no FSDP layout without TP / PP among torchtitan's top 3")


LAYOUTS = [
    "tp=8,pp=4,dp=2,sp,zero=1", "tp=8,pp=4,dp=2,sp,zero=1,schedule=interleaved-1f1b,virtual_stages=2",
    "tp=4,pp=2,cp=2,dp=4,zero=1,recompute=full", "tp=8,dp=8,zero=1,param_dtype=fp8", "tp=2,dp=32,zero=3",
    "tp=8,pp=2,dp=4", "tp=2,pp=2,dp=16,zero=3,dp_shard=8,recompute=ops", "dp=64,zero=3", "tp=8,cp=2,dp=4,zero=3",
    "tp=4,pp=4,dp=4,schedule=gpipe", "tp=8,pp=4,dp=2,zero=1,recompute=core_attn+mlp_act",
    "tp=8,pp=2,dp=4,zero=1,grad_dtype=bf16", "tp=2,dp=32,zero=3,grad_dtype=bf16",
]


@pytest.mark.parametrize("engine,cut", [("megatron", "pretrain_gpt.py"), ("torchtitan", "--config")])
def test_emitted_flags_read_back_to_the_same_layout(engine, cut):
    model, cluster = get_model("llama-3.1-70b"), parse_cluster("8x8xH100")
    read = 0
    for text in LAYOUTS:
        layout = Layout.parse(f"{text},{BASE}")
        if not can_express(engine, layout, model, serving=False):
            continue
        cmd = argv(engine, layout, model, cluster, serving=False)
        flags = cmd[cmd.index(cut) + (2 if cut.startswith("--") else 1):]
        got, notes = read_layout(engine, shlex.join(flags), devices=cluster.num_devices)
        assert Layout.parse(got) == layout, (engine, text, got)
        read += 1
    assert read >= 5, f"only {read} of the layouts are expressible in {engine}"


def test_megatron_recompute_method_read_for_what_it_is():
    """``--recompute-method uniform --recompute-num-layers 1`` is our full recompute; ``uniform`` over
    chunks of N > 1 layers is read as it too, with a note of the difference; ``block`` (only the first N
    layers of each stage) is not a policy the planner models, so it is refused, not read as full."""
    flags = "--tensor-model-parallel-size 8 --recompute-granularity full --recompute-method uniform"
    got, notes = read_layout("megatron", flags + " --recompute-num-layers 1", devices=64)
    assert Layout.parse(got).recompute == "full" and not any("chunks of" in n for n in notes)
    got, notes = read_layout("megatron", flags + " --recompute-num-layers 2", devices=64)
    assert Layout.parse(got).recompute == "full" and any("--recompute-num-layers 2 (chunks of 2 layers" in n for n in notes)
    with pytest.raises(ModelcarveError, match="--recompute-method block recomputes only the first"):
        read_layout("megatron", flags.replace("uniform", "block") + " --recompute-num-layers 4", devices=64)


def test_unknown_words_and_flags_are_refused_in_one_line():
    with pytest.raises(ModelcarveError, match="has no recompute=sometimes"):
        read_layout("torchtitan", "tp=2,recompute=sometimes")
    with pytest.raises(ModelcarveError, match="--no-such-flag is not a flag modelcarve reads"):
        read_layout("megatron", "--tensor-model-parallel-size 8 --no-such-flag 3", devices=64)
    with pytest.raises(ModelcarveError, match="does not divide the cluster's 64 devices"):
        read_layout("megatron", "--tensor-model-parallel-size 3", devices=64)


def test_plan_in_a_frameworks_terms(capsys):
    """``plan --framework torchtitan`` ranks only what torchtitan can run: no Megatron-style
    selective recompute (torchtitan's "selective" is op-level SAC), no ZeRO-1/2."""
    code = main(["plan", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--global-batch", "256", "--top", "5",
                 "--framework", "torchtitan", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["layouts"]
    model = get_model("llama-3.1-70b")
    for item in out["layouts"]:
        layout = Layout.from_dict(item["layout"])
        assert can_express("torchtitan", layout, model, serving=False), layout.short()
        assert layout.recompute != "selective" and layout.zero not in (1, 2)


def test_plan_with_bf16_gradients(capsys):
    """``plan --grad-dtype bf16`` (Megatron's --grad-reduce-in-bf16, every Megatron-Bridge recipe's
    setting): every layout ranked holds bf16 gradients, so with bf16 weights and ZeRO below 2 the
    gradient buffer is the weights' bytes (2 B a parameter each, the same parameters) where fp32
    gradients are twice them; Megatron's launch carries the flag back; torchtitan, which reduces
    in float32 only, is refused in one line that says so, not with an empty ranking."""
    common = ["plan", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--global-batch", "512", "--seq", "8192",
              "--top", "5", "--json"]
    by_dtype = {}
    for dtype in ("fp32", "bf16"):
        assert main(common + ["--grad-dtype", dtype]) == 0
        by_dtype[dtype] = json.loads(capsys.readouterr().out)
    for dtype, result in by_dtype.items():
        assert result["layouts"]
        for item in result["layouts"]:
            lay, bd = item["layout"], item["memory"]["breakdown"]
            assert lay["grad_dtype"] == dtype and item["short"].endswith("-BF16G") == (dtype == "bf16")
            if lay["zero"] < 2 and lay["param_dtype"] == "bf16":
                assert bd["gradients"] == pytest.approx(bd["weights"] * (2 if dtype == "fp32" else 1), rel=1e-12)
    assert main(common[:-1] + ["--grad-dtype", "bf16", "--emit-launch", "megatron"]) == 0
    assert "--grad-reduce-in-bf16" in capsys.readouterr().out
    assert main(common + ["--grad-dtype", "bf16", "--engine", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "torchtitan can express: it refuses the best found" in err and "mixed_precision_reduce" in err


def test_search_refuses_an_unknown_gradient_dtype():
    from modelcarve.plan.search import search
    from modelcarve.spec.errors import LayoutError

    with pytest.raises(LayoutError, match="--grad-dtype fp16: gradients are held in fp32 or bf16"):
        search(get_model("llama-3.1-8b"), parse_cluster("1x8xH100"), "train", top=1, global_batch=8, grad_dtype="fp16")


def test_plan_for_modelcarve_ranks_only_what_run_executes(capsys):
    """``plan --engine modelcarve`` asks the runtime's own check (spec/support.training_problems,
    the one ``modelcarve run`` refuses with), not a copy: every layout ranked runs, and a setting
    the runtime lacks (bf16 gradients) is refused in one line with the runtime's reason."""
    from modelcarve.spec.support import training_problems

    common = ["plan", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--global-batch", "256", "--seq", "4096",
              "--top", "5", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)["layouts"]
    assert main(common + ["--engine", "modelcarve"]) == 0
    ranked = json.loads(capsys.readouterr().out)["layouts"]
    model = get_model("qwen3-30b-a3b")
    assert ranked and all(not training_problems(Layout.from_dict(i["layout"]), model) for i in ranked)
    assert all(i["runtime"]["runs"] for i in ranked)
    assert plain
    # FP8 GEMMs: the plain plan ranks layouts run refuses (marked, not dropped); the engine's plan refuses
    assert main(common + ["--precision", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)["layouts"]
    assert fp8 and not any(i["runtime"]["runs"] for i in fp8)
    for extra, why in ((["--precision", "fp8"], "param_dtype=fp8 is not implemented by the runtime"),
                       (["--grad-dtype", "bf16"], "grad_dtype=bf16 is not implemented by the runtime")):
        assert main(common + ["--engine", "modelcarve", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err


# --- communication overlap (Megatron-LM's flags; commands/emit/vocab.py module doc) ---------------------------
OVERLAP_FLAGS = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                 "--sequence-parallel --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 64 "
                 "--seq-length 4096")
"""llama-3.1-70b on 8x8 H100: tp=8, pp=2 interleaved (v=2), dp=4 with the distributed optimizer."""


def _megatron(capsys, extra: str, *more: str) -> dict:
    code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--framework", "megatron",
                 "--layout", OVERLAP_FLAGS + extra, "--json", *more])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)


def test_megatron_overlap_flags_read_as_megatron_runs_them():
    """Each spelling gives the value Megatron-LM (arguments.py @ core_v0.19.0) runs: the DP overlaps are
    store_true flags off by default, so an absent one reads False (and says so); --tp-comm-overlap is the
    calibrated TE overlap; --no-overlap-p2p-communication turns the (default) interleaved overlap off."""
    from modelcarve.plan.train.calibration import TP_COMM_OVERLAP

    assert read_options("megatron", OVERLAP_FLAGS) == {"overlap_grad_reduce": False, "overlap_param_gather": False}
    _, notes = read_layout("megatron", OVERLAP_FLAGS, devices=64)
    assert any("--overlap-grad-reduce not given: Megatron reduces the gradients after the backward" in n for n in notes)
    assert any("--overlap-param-gather not given" in n for n in notes)
    assert read_options("megatron", OVERLAP_FLAGS + " --overlap-grad-reduce") == {
        "overlap_grad_reduce": True, "overlap_param_gather": False}
    both = read_options("megatron", OVERLAP_FLAGS + " --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap")
    assert both == {"overlap_grad_reduce": True, "overlap_param_gather": True, "tp_overlap": TP_COMM_OVERLAP}
    _, notes = read_layout("megatron", OVERLAP_FLAGS + " --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap",
                           devices=64)
    assert not any("not given" in n for n in notes)
    assert any(f"--tp-comm-overlap read as the planner option tp_overlap={TP_COMM_OVERLAP}" in n for n in notes)
    assert read_options("megatron", OVERLAP_FLAGS + " --no-overlap-p2p-communication")["overlap_p2p"] is False
    assert "overlap_p2p" not in read_options("megatron", OVERLAP_FLAGS)  # on by default, as the planner's
    # ZeRO-0: there is no parameter gather to overlap, and no note about one
    _, notes = read_layout("megatron", "--tensor-model-parallel-size 8 --sequence-parallel", devices=64)
    assert not any("--overlap-param-gather" in n for n in notes)
    # the words form (our keys) carries no overlap: the planner's defaults stand, as before
    assert read_options("megatron", "tp=8,sp,zero=1") == {}


def test_megatron_overlap_flags_move_the_exposed_time(capsys):
    """Hand-derived directions: without the DP flags every DP second is exposed (Megatron reduces after the
    backward and gathers before the forward); each flag hides some; --tp-comm-overlap leaves exactly
    1 - TP_COMM_OVERLAP of the TP time exposed (layer.py prices the hidden fraction as gone); turning the
    interleaved schedule's p2p overlap off exposes more pipeline time. With both DP flags the estimate equals,
    to the byte, our spelling of the layout at the planner's defaults."""
    from modelcarve.plan.train.calibration import TP_COMM_OVERLAP

    off = _megatron(capsys, "")
    grad = _megatron(capsys, " --overlap-grad-reduce")
    both = _megatron(capsys, " --overlap-grad-reduce --overlap-param-gather")
    tp = _megatron(capsys, " --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap")
    p2p = _megatron(capsys, " --overlap-grad-reduce --overlap-param-gather --no-overlap-p2p-communication")
    exposed = {name: d["comm"]["exposed_s_by_axis"] for name, d in
               (("off", off), ("grad", grad), ("both", both), ("tp", tp), ("p2p", p2p))}
    assert off["comm"]["hidden_s_by_axis"]["dp"] == 0.0
    assert exposed["off"]["dp"] == pytest.approx(off["comm"]["total_s_by_axis"]["dp"], rel=1e-12)
    assert exposed["off"]["dp"] > exposed["grad"]["dp"] > exposed["both"]["dp"] > 0
    assert off["time"]["step_s"] > grad["time"]["step_s"] > both["time"]["step_s"]
    assert exposed["tp"]["tp"] == pytest.approx((1 - TP_COMM_OVERLAP) * exposed["both"]["tp"], rel=1e-12)
    assert exposed["p2p"]["pp"] > exposed["both"]["pp"] and exposed["p2p"]["dp"] == exposed["both"]["dp"]
    code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--json", "--layout",
                 f"tp=8,pp=2,dp=4,sp,zero=1,schedule=interleaved-1f1b,virtual_stages=2,{BASE}"])
    ours = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert both["layout"] == ours["layout"] and both["time"] == ours["time"] and both["comm"] == ours["comm"]


def test_megatron_overlap_flags_carried_back_by_the_launch(capsys):
    """--emit-launch megatron writes each overlap flag when the estimate was priced with it, and the launch
    reads back to the same planner options (the emitted command is Megatron's spelling of the priced run)."""
    for extra in ("", " --overlap-grad-reduce", " --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap",
                  " --overlap-grad-reduce --overlap-param-gather --no-overlap-p2p-communication"):
        code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--framework", "megatron",
                     "--layout", OVERLAP_FLAGS + extra, "--emit-launch", "megatron"])
        out = capsys.readouterr().out
        assert code in (0, 1) and "pretrain_gpt.py" in out, out
        launch = " ".join(shlex.split(out.split("pretrain_gpt.py", 1)[1].replace("\\\n", " ")))
        # the launch also states the stages the plan priced (Megatron's layout string of the planner's split)
        back = read_options("megatron", launch)
        assert back.pop("pipeline_layout") == megatron_layout(80, 2, 2)
        assert back == read_options("megatron", OVERLAP_FLAGS + extra), extra
        for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                     "--no-overlap-p2p-communication"):
            assert (flag in launch.split()) == (flag in extra.split()), (extra, flag)
    # a plan at the planner's defaults launches with Megatron's DP overlaps on (the gather with ZeRO-1 only),
    # TP overlap off (tp_overlap=0), and the pipeline overlap left at Megatron's default
    model, cluster = get_model("llama-3.1-70b"), parse_cluster("8x8xH100")
    layout = Layout.parse(f"tp=8,pp=2,dp=4,sp,zero=1,schedule=interleaved-1f1b,virtual_stages=2,{BASE}")
    cmd = argv("megatron", layout, model, cluster, serving=False)
    assert "--overlap-grad-reduce" in cmd and "--overlap-param-gather" in cmd
    assert "--tp-comm-overlap" not in cmd and "--no-overlap-p2p-communication" not in cmd
    cmd = argv("megatron", layout.replace(zero=0), model, cluster, serving=False)
    assert "--overlap-grad-reduce" in cmd and "--overlap-param-gather" not in cmd
    cmd = argv("megatron", layout, model, cluster, serving=False, planner_options={"overlap_grad_reduce": False})
    assert "--overlap-grad-reduce" not in cmd and "--overlap-param-gather" not in cmd  # Megatron needs both
    cmd = argv("megatron", layout.replace(sp=False), model, cluster, serving=False, planner_options={"tp_overlap": 0.75})
    assert "--tp-comm-overlap" not in cmd  # Megatron asserts sequence parallelism for it


@pytest.mark.parametrize("extra,match", [
    (" --tp-comm-overlap", "--tp-comm-overlap needs --sequence-parallel"),
    (" --overlap-param-gather", "--overlap-param-gather needs --overlap-grad-reduce and the distributed optimizer"),
    (" --overlap-p2p-communication", "--overlap-p2p-communication is not a flag modelcarve reads"),
])
def test_bad_megatron_overlap_flags_refused_in_one_line(capsys, extra, match):
    flags = OVERLAP_FLAGS.replace("--sequence-parallel ", "") if "tp-comm" in extra else OVERLAP_FLAGS
    with pytest.raises(ModelcarveError, match=match) as err:
        read_layout("megatron", flags + extra, devices=64)
    assert "\n" not in str(err.value)
    code = main(["estimate", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--framework", "megatron",
                 "--layout", flags + extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("modelcarve: error:") and match in lines[0]
    with pytest.raises(ModelcarveError, match="--overlap-param-gather needs"):  # without the distributed optimizer
        read_layout("megatron", "--tensor-model-parallel-size 8 --overlap-grad-reduce --overlap-param-gather", devices=64)
