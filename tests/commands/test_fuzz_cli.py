"""Fuzzing the command line (issue 16 §5): layout strings and JSON, and whole argv lists.

Each case runs ``cli.main`` in-process (fuzz_support.check_main: exit 0/1/2, no exception, one line
per message). ``run``/``verify`` go through every pre-launch check with the launch itself replaced
by a recorder, so no rank starts; the recorder checks that what would launch is a valid layout.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz_support import FUZZ, JSONISH, check_main
from modelcarve.commands import run as run_cmd
from modelcarve.spec.layout import Layout

KEYS = ["tp", "pp", "dp", "cp", "ep", "etp", "sp", "zero", "fsdp", "hsdp", "dp_shard", "schedule", "virtual", "vpp",
        "mbs", "gbs", "batch", "seq", "recompute", "param_dtype", "precision", "grad_dtype", "optim_dtype",
        "weight_dtype", "kv_dtype", "fp8_scaling", "bogus", "TP", "micro-batch"]
VALUES = st.one_of(
    st.integers(-2, 9).map(str), st.sampled_from(["16", "64", "2048", "0", "-1", "99999999999", "1" * 60, "\uff12",
                                                  "1f1b", "interleaved", "gpipe", "zb", "full", "selective", "ops",
                                                  "core_attn+mlp", "bf16", "fp8", "fp32", "int4", "true", "nan", ""]),
    st.text(max_size=6),
)
ITEM = st.one_of(st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
                 st.sampled_from(KEYS), st.text(max_size=5))
LAYOUT_TEXT = st.lists(ITEM, max_size=6).map(",".join)
MODELS = ["tiny-llama", "tiny-moe", "small-llama", "gpt3-175b", "deepseek-v3", "nope-model"]


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    """Replace the launch by a check that the layout the ranks would get is one Layout.parse takes."""

    def launch(command, args, payload, per_node, under):
        Layout.parse(payload["layout"])
        assert isinstance(payload["steps"], int) and payload["steps"] >= 1
        return 0

    monkeypatch.setattr(run_cmd, "_launch", launch)


@settings(FUZZ, max_examples=250)
@given(LAYOUT_TEXT, st.sampled_from(MODELS + [None]), st.sampled_from([None, "1", "2", "8", "64", "0"]))
def test_layout_strings(text, model, world):
    argv = ["layout", text or ","]
    if model:
        argv += ["--model", model]
    if world:
        argv += ["--world-size", world]
    code, out, _ = check_main(argv)
    if code == 0:  # what was accepted prints the JSON the runtime reads, and reads back as the same layout
        short, _, rest = out.partition("\n")
        assert Layout.from_dict(json.loads(rest)).short() == short


@settings(FUZZ, max_examples=150)
@given(st.dictionaries(st.sampled_from(KEYS + ["layout"]), JSONISH, max_size=5))
def test_layout_json_objects(fields):
    check_main(["layout", json.dumps(fields), "--model", "tiny-moe"])


FLAGS = {
    "--model": st.sampled_from(MODELS + ["a" * 300, "/no/such/config.json", "", "-"]),
    "--cluster": st.sampled_from(["H100", "2xH100", "8xH100", "2x8xA100-80GB", "4xL4", "1x2xH900", "0xH100",
                                  "9223372036854775807xH100", "x.yaml", "a" * 300 + ".json", ""]),
    "--layout": LAYOUT_TEXT,
    "--goal": st.sampled_from(["train", "serve-latency", "serve-throughput", "fly"]),
    "--global-batch": VALUES, "--seq": VALUES, "--steps": VALUES, "--top": VALUES, "--world-size": VALUES,
    "--timeout": st.sampled_from(["30", "0", "-1", "nan", "inf", "1e400", "\uff13\uff10"]),
    "--lr": st.sampled_from(["1e-3", "nan", "-inf", "0"]),
    "--dtype": st.sampled_from(["fp32", "bf16", "fp8"]),
    "--data": st.sampled_from(["synthetic", "/no/such.npy", "a" * 300, "/"]),
    "--init": st.sampled_from(["checkpoint", "random", "zeros"]),
    "--emit": st.sampled_from(["/no/such/dir/x.json", "a" * 300, "/"]),
    "--plot": st.sampled_from(["/no/such/dir/x.png", "a" * 300]),
    "--nnodes": VALUES, "--nproc-per-node": VALUES, "--node-rank": VALUES, "--master-port": VALUES,
    "--precision": st.sampled_from(["bf16", "fp8", "mxfp8", "fp4"]),
    "--memory-headroom": st.sampled_from(["0.05", "0.7", "nan", "-0.1"]),
    "--input-len": VALUES, "--output-len": VALUES, "--ttft-ms": VALUES, "--batch": VALUES,
    "--checkpoint": st.sampled_from(["/no/such/ckpt", "a" * 300, "/", ""]),
    "--out": st.sampled_from(["/no/such/dir/out", "a" * 300]),
    "--json": st.just(None), "--reference": st.sampled_from(["ours", "transformers", "x"]),
}
COMMANDS = ["models", "hardware", "layout", "plan", "estimate", "run", "verify", "export", "frobnicate"]


@st.composite
def argvs(draw):
    argv = [draw(st.sampled_from(COMMANDS))]
    if argv[0] == "models":
        argv += draw(st.lists(st.sampled_from(["list", "show", "tiny-moe", "kimi-k2", "zz", "a" * 300]), max_size=2))
    if argv[0] == "layout":
        argv.append(draw(LAYOUT_TEXT))
    required = {"plan": ["--model", "--cluster"], "estimate": ["--model", "--cluster", "--layout"],
                "run": ["--model", "--layout"], "verify": ["--model", "--layout"]}.get(argv[0], [])
    if draw(st.integers(0, 9)):  # mostly past argparse's required flags, into the commands themselves
        for flag in required:
            argv += [flag, draw(st.sampled_from(["tiny-llama", "tiny-moe"]) if flag == "--model" else
                                st.sampled_from(["2xH100", "8xH100"]) if flag == "--cluster" else
                                st.sampled_from(["dp=2", "tp=2", "pp=2", "tp=2,pp=2", "dp=2,zero=3,seq=64"]))]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=4, unique=True)):
        value = draw(FLAGS[flag])
        argv += [flag] if value is None else [flag, value]
    return argv


@settings(FUZZ, max_examples=300)
@given(argvs())
def test_argv(argv):
    check_main(argv)
