"""``run --data corpus.txt`` tokenises with the checkpoint's tokenizer (issue 27, item 1).

A tiny llama checkpoint with a 2,000-token byte-level BPE (serve_fixtures.build_checkpoint): the
token ids the ranks are handed are exactly the tokenizer's encoding of the text, windows of it,
ids above 255 among them; a model without a tokenizer reads the text's bytes, and says so on
one line of stderr. One real run checks the ranks train on the tokenised file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from serve_fixtures import REPO, build_checkpoint

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("bpe") / "ckpt", vocab=2000, max_position=128)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((REPO / "ARCHITECTURE.md").read_text()[:6000])
    return path


def _payload(monkeypatch, capsys, argv):
    """What ``modelcarve run`` hands its ranks (the launch itself replaced)."""
    from modelcarve.cli import main
    from modelcarve.commands import run as run_cmd

    seen = {}
    monkeypatch.setattr(run_cmd, "_launch", lambda command, args, payload, *rest: seen.update(payload) or 0)
    assert main(argv) == 0
    return seen, capsys.readouterr().err


def test_text_data_is_the_checkpoints_tokenisation(ckpt, corpus, monkeypatch, capsys, tmp_path):
    from modelcarve.runtime.engine.tokenizer import load_tokenizer
    from modelcarve.runtime.train.trainer import make_data

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    payload, err = _payload(monkeypatch, capsys, ["run", "--model", ckpt, "--layout", "gbs=4,seq=32,param_dtype=fp32",
                                                  "--steps", "1", "--data", str(corpus)])
    want = np.asarray(load_tokenizer(ckpt).encode(corpus.read_text()), dtype=np.int64)
    assert want.max() > 255  # a real BPE, not bytes
    lines = [line for line in err.splitlines() if "--data" in line]
    assert len(lines) == 1 and "tokenizer" in lines[0] and f"{len(want)} tokens" in lines[0], err
    data = make_data(payload["data"], 2000, seed=0)
    assert np.array_equal(np.asarray(data.data, dtype=np.int64), want)
    x, y = data.batch(0, 4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in x.numpy():  # every row the model is fed is a window of the encoding
        starts = np.flatnonzero(want[: len(want) - 32] == row[0])
        assert any(np.array_equal(want[s : s + 32], row) for s in starts)
    # the same text and tokenizer: the same file name (a resume compares the data source)
    again, _ = _payload(monkeypatch, capsys, ["run", "--model", ckpt, "--layout", "gbs=4,seq=32,param_dtype=fp32",
                                              "--steps", "1", "--data", str(corpus)])
    assert again["data"] == payload["data"]


def test_no_tokenizer_reads_bytes_and_says_so(corpus, monkeypatch, capsys):
    payload, err = _payload(monkeypatch, capsys, ["run", "--model", "tiny-llama", "--layout", "gbs=4,seq=32",
                                                  "--steps", "1", "--data", str(corpus)])
    assert payload["data"] == str(corpus)
    lines = [line for line in err.splitlines() if "--data" in line]
    assert len(lines) == 1 and "bytes" in lines[0] and "no tokenizer" in lines[0], err


def test_run_trains_on_the_tokenised_text(ckpt, corpus, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "modelcarve.cli", "run", "--model", ckpt, "--layout",
                           "dp=2,gbs=4,seq=32,param_dtype=fp32", "--steps", "2", "--data", str(corpus), "--json"],
                          capture_output=True, text=True, env=ENV | {"TMPDIR": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sum("tokens by" in line for line in proc.stderr.splitlines()) == 1, proc.stderr
    history = json.loads(proc.stdout)["history"]
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
