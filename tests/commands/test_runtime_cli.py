"""modelcarve run / verify end to end through torchrun, refusal before launch, data files, seeds."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli(*argv, timeout=240):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True,
                          env=ENV, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    "layout, extra, fragment",
    [
        ("tp=3", [], "tp=3 does not divide 4 attention heads; valid tp: 1, 2, 4"),
        ("tp=2", ["--nproc-per-node", "4"], "use --nproc-per-node 2"),
        ("dp=2,param_dtype=fp16", [], "param_dtype=fp16 is not implemented by the runtime"),
        ("dp=2,sp", [], "sequence parallelism (sp) needs tp > 1"),
        ("dp=2,grad_dtype=bf16", [], "grad_dtype=bf16 is not implemented by the runtime"),
    ],
)
def test_bad_layout_refused_before_any_process(layout, extra, fragment):
    code, out, err, seconds = cli("run", "--model", "tiny-llama", "--layout", layout, *extra)
    assert code == 2 and fragment in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "torch.distributed.run" not in err


def test_run_token_file_deterministic_and_layout_json(tmp_path):
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, 5000, dtype=np.int32))
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"dp": 2, "zero": 1, "seq": 32, "gbs": 4, "param_dtype": "fp32"}))
    runs = []
    for _ in range(2):
        code, out, err, _ = cli("run", "--model", "tiny-llama", "--layout", str(layout), "--steps", "3",
                                "--data", str(data), "--json")
        assert code == 0, err
        runs.append(json.loads(out))
    losses = [[h["loss"] for h in r["history"]] for r in runs]
    assert losses[0] == losses[1]  # same seed, same data, same layout: bit-identical
    assert runs[0]["layout"] == "DP2-Z1" and len(runs[0]["memory"]) == 2
    assert all(m["optim_bytes"] > 0 for m in runs[0]["memory"])
    assert runs[0]["tokens_per_s"] > 0
    # the last step counts collectives and memory (slowed by its hooks): not timed, so no figure,
    # not the previous step's repeated
    speeds = [h["tokens_per_s"] for h in runs[0]["history"]]
    assert speeds[-1] is None and all(s > 0 for s in speeds[:-1]) and speeds[0] != speeds[1]


def test_verify_exit_code_on_failure(monkeypatch, capsys):
    """A failing comparison makes ``verify`` exit 1 (the launch is replaced by a failing report)."""
    from modelcarve.cli import main
    from modelcarve.commands import run as run_cmd
    from modelcarve.verify.reference import compare

    bad = compare("param/norm.weight", __import__("torch").ones(3), __import__("torch").zeros(3), 1e-4)
    assert not bad.passed

    def fake_launch(command, args, payload, per_node, under):
        report = dict(model="tiny-llama", layout="TP2", world_size=2, steps=1, dtype="fp32", passed=False,
                      checks=[bad.to_dict()])
        with open(payload["report"], "w") as f:
            json.dump(report, f)
        return 0

    monkeypatch.setattr(run_cmd, "_launch", fake_launch)
    assert main(["verify", "--model", "tiny-llama", "--layout", "tp=2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_two_nodes_through_torchrun_flags(tmp_path):
    """verify end to end (JSON report); --nnodes/--node-rank/--master-addr/--master-port reach torchrun: two 'nodes' (two CLI
    processes on this machine, one rank each) run one tp=2 verify together."""
    from dist import free_port

    port = str(free_port())
    args = ["verify", "--model", "tiny-llama", "--layout", "tp=2,seq=16,gbs=2", "--dtype", "fp32", "--steps", "1",
            "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    other = subprocess.Popen([sys.executable, "-m", "modelcarve.cli", *args, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    code, out, err, _ = cli(*args, "--node-rank", "0", "--json")
    other_out, other_err = other.communicate(timeout=120)
    assert code == 0, err
    assert other.returncode == 0, other_err
    report = json.loads(out)
    assert report["passed"] and report["world_size"] == 2 and report["layout"] == "TP2" and report["steps"] == 1
    kinds = {c["name"].split("/")[0] for c in report["checks"]}
    assert {"logits", "loss", "grad_norm", "grad", "param"} <= kinds
