"""The engine's native bf16 GEMM (runtime/engine/native.py, native_gemm.cpp) against ``F.linear``.

Bound, as tests/runtime/test_packed_linear.py derives it: both sides sum ``K`` products (and the
bias) in fp32, in different orders, so each is within ``(K + 1) 2^-24 sum_k |x_k w_k| (+ |b|)`` of
the exact value (first order) and the two within twice that; each is then rounded once to bf16
(``2^-8 |value|`` at most), which adds ``2^-8 (|a| + |b|)``. The reference here is computed in
fp32 (no final rounding), so only ``got``'s rounding is added. bf16 x bf16 products are exact in
fp32 (8 + 8 significant bits), so ``VDPBF16PS`` adds no product rounding. Shapes cover the kernel's
tails: rows not a multiple of its 6-row tile, outputs not a multiple of 16 or of its 64-row group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelcarve.runtime.engine import native

U32 = 2.0**-24
U_BF16 = 2.0**-8

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel not built here: {native.reason()}")


def _case(rows: int, n: int, k: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    return x, w, b


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 64])
@pytest.mark.parametrize("n, k, bias", [(80, 96, True), (130, 64, False), (768, 768, True), (1280, 2048, False)])
def test_native_equals_f_linear(rows, n, k, bias):
    x, w, b = _case(rows, n, k, bias, seed=rows * 7 + n)
    got = native.NativeWeight(w)(x, b).float()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (rows, n)
    mag = x.float().abs() @ w.float().abs().T + (0.0 if b is None else b.float().abs())
    tol = 2 * (k + 1) * U32 * mag + U_BF16 * got.abs()
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()


@needs_native
def test_native_reads_strided_rows_and_threads_agree(monkeypatch):
    """A row-strided ``x`` (a column slice) is read in place; two threads split the 64-row groups
    and compute each output exactly as one thread does (same order per output): bit-equal."""
    x, w, b = _case(9, 200, 128, True, seed=3)
    wide = torch.cat([x, torch.ones(9, 32).bfloat16()], dim=1)[:, :128]
    assert wide.stride(0) == 160
    nw = native.NativeWeight(w)
    one = nw(wide, b)
    assert torch.equal(one, nw(x, b))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(nw(x, b), one)


@needs_native
def test_pack_weight_picks_native_for_bf16_only():
    from modelcarve.runtime.engine.fused import pack_weight, packed_linear

    x, w, b = _case(3, 48, 32, True, seed=1)
    packed = pack_weight(w)
    assert type(packed) is native.NativeWeight
    assert torch.equal(packed_linear(x, packed, b), native.NativeWeight(w)(x, b))
    assert type(pack_weight(w.float())) is torch.Tensor  # fp32 stays on oneDNN


def test_native_turned_off_says_why(monkeypatch):
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_REASON", None)
    monkeypatch.setenv("MODELCARVE_ENGINE_NATIVE", "0")
    assert not native.available()
    assert native.reason() == "turned off (MODELCARVE_ENGINE_NATIVE=0)"
    with pytest.raises(RuntimeError, match="not available: turned off"):
        native.NativeWeight(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_a_failed_build_falls_back_with_its_reason(monkeypatch, tmp_path):
    """No compiler: nothing is loaded, ``reason`` names it, and ``pack_weight`` keeps oneDNN."""
    from modelcarve.runtime.engine.fused import pack_weight, packable_dtypes

    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_REASON", None)
    monkeypatch.setattr(native, "_cpu_has_bf16", lambda: True)
    monkeypatch.setenv("MODELCARVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not native.available()
    assert native.reason().startswith("build failed")
    if torch.bfloat16 in packable_dtypes():
        assert type(pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16))) is torch.Tensor
