"""Training data: synthetic batches and token files (.npy, .bin uint16, text read bytewise)."""

import numpy as np
import pytest
import torch

from modelcarve.runtime.train.trainer import SyntheticData, TokenFile, make_data
from modelcarve.spec.errors import ModelcarveError


def test_synthetic_is_deterministic_and_shifted():
    a, b = SyntheticData(256, seed=3), SyntheticData(256, seed=3)
    x, y = a.batch(5, 4, 16)
    x2, y2 = b.batch(5, 4, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(x, a.batch(6, 4, 16)[0])


@pytest.mark.parametrize("suffix", [".npy", ".bin", ".txt"])
def test_token_files(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".npy":
        tokens = np.arange(1000, dtype=np.int32) % 200
        np.save(path, tokens)
    elif suffix == ".bin":
        tokens = (np.arange(1000) % 200).astype(np.uint16)
        tokens.tofile(path)
    else:
        text = "modelcarve reads a text file byte by byte. " * 30
        path.write_text(text)
        tokens = np.frombuffer(text.encode(), dtype=np.uint8)
    data = make_data(str(path), 256, seed=1)
    assert isinstance(data, TokenFile)
    x, y = data.batch(0, 3, 32)
    assert x.shape == (3, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a window of the file
    flat = tokens.astype(np.int64)
    for row in x.numpy():
        starts = np.flatnonzero(flat[: len(flat) - 32] == row[0])
        assert any(np.array_equal(flat[s : s + 32], row) for s in starts)


def test_token_file_errors(tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, np.array([1, 2, 300]))
    with pytest.raises(ModelcarveError, match="token id 300 >= the model's vocabulary 256"):
        TokenFile(path, 256)
    with pytest.raises(ModelcarveError, match="does not exist"):
        TokenFile(tmp_path / "nope.bin", 256)
