"""The engine's native kernels (runtime/engine/native.py, native_kernels.cpp): the bf16 and fp32 GEMMs against
``F.linear``, the decode attention against the engine's gathered SDPA path.

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
@pytest.mark.parametrize("rows", [1, 4, 7])
@pytest.mark.parametrize("n, k", [(80, 96), (130, 63), (768, 768)])
def test_native_fp32_equals_f_linear(rows, n, k):
    """The fp32 twin (``mc_gemm_f32``): the same bound without the bf16 rounding (fp32 out)."""
    gen = torch.Generator().manual_seed(rows + n)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    got = native.NativeWeight(w)(x, b)
    ref = F.linear(x.double(), w.double(), b.double())
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - ref).abs() <= (k + 2) * U32 * mag).all()


@needs_native
def test_pack_weight_picks_native():
    from modelcarve.runtime.engine.fused import pack_weight, packed_linear

    x, w, b = _case(3, 48, 32, True, seed=1)
    for dtype in (torch.bfloat16, torch.float32):
        packed = pack_weight(w.to(dtype))
        assert type(packed) is native.NativeWeight
        assert torch.equal(packed_linear(x.to(dtype), packed, b.to(dtype)), native.NativeWeight(w.to(dtype))(x.to(dtype), b.to(dtype)))
    assert type(pack_weight(torch.zeros(4, 3, dtype=torch.bfloat16))) is torch.Tensor  # odd k: oneDNN


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


# --- decode attention ----------------------------------------------------------------------------
# Reference: the engine's own path on the same cache, the keys gathered through the block tables and
# masked (StepContext's rule), then ``_attend`` (SDPA; fp32 for bf16 inputs, rounded once). Both
# compute softmax(q k^T * scale) v in fp32 over the same L keys, in different orders: the scores
# differ by at most ~2 d 2^-24 sum|q k| scale (each an fp32 dot of d products), the exponentials
# and the normalising sum by a few 2^-24 relative, so each output differs by at most
# (2 d + 2 L + 8) 2^-24 max_j |v_j| (first order; |softmax weights| sum to 1) plus, for bf16, one
# rounding of each side (2^-8 |value| each).


def _paged_case(dtype, seqs, heads, kv_heads, d, bs, seed):
    from modelcarve.runtime.engine.paged_attention import StepContext

    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-c // bs) for c in seqs) + 3
    k_cache = torch.randn(blocks * bs, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks * bs, kv_heads, d, generator=gen).to(dtype)
    free = torch.randperm(blocks - 1, generator=gen).add(1).tolist()   # shuffled: tables not consecutive
    tables = []
    for c in seqs:
        tables.append([free.pop() for _ in range(-(-c // bs))])
    ctx = StepContext([(c - 1, 1, t) for c, t in zip(seqs, tables)], bs)
    q = torch.randn(len(seqs), heads, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, ctx


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("d", [32, 64])
def test_decode_attention_equals_the_gathered_path(dtype, window, heads, kv_heads, d):
    from modelcarve.runtime.engine.paged_attention import _attend

    bs, scale = 4, 0.3
    seqs = [1, 7, 13, 4, 9]
    q, kc, vc, ctx = _paged_case(dtype, seqs, heads, kv_heads, d, bs, seed=heads * 10 + kv_heads + d)
    got = native.decode_attention(q, kc, vc, ctx.tables, ctx.ctx_lens, bs, window, scale).view(len(seqs), heads, d)
    n = len(seqs)
    keys = kc.view(-1, bs * kv_heads * d).index_select(0, ctx.block_index).view(n, -1, kv_heads, d).permute(0, 2, 1, 3)
    values = vc.view(-1, bs * kv_heads * d).index_select(0, ctx.block_index).view(n, -1, kv_heads, d).permute(0, 2, 1, 3)
    k_pos = torch.arange(keys.shape[2])
    p = ctx.ctx_lens[:, None] - 1
    mask = k_pos[None] <= p
    if window is not None:
        mask = mask & (k_pos[None] > p - window)
    ref = _attend(q[:, :, None], keys, values, mask[:, None, None], scale)[:, :, 0]
    vmax = values.float().abs().amax(dim=(2, 3))[:, :, None].repeat_interleave(heads // kv_heads, dim=1)
    tol = (2 * d + 2 * keys.shape[2] + 8) * U32 * vmax
    if dtype == torch.bfloat16:
        tol = tol + U_BF16 * (got.float().abs() + ref.float().abs())
    assert got.dtype == dtype
    assert ((got.float() - ref.float()).abs() <= tol).all(), (got.float() - ref.float()).abs().max()


@needs_native
def test_engine_decodes_through_the_native_attention(tmp_path, monkeypatch):
    """An fp32 engine calls the kernel on its decode steps, and its greedy tokens equal those with the
    kernel turned off (the gathered SDPA path), as the engine's other fast paths are held to."""
    from engine_cases import drive, greedy
    from hf_tiny import save_hf

    from modelcarve.runtime.engine import paged_attention
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path / "llama", tie_word_embeddings=True, head_dim=16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        engine = Engine(EngineConfig(model=str(tmp_path / "llama"), layout="tp=1,param_dtype=fp32",
                                     kv_cache_bytes=1 << 21))
        return drive(engine, prompts, greedy())

    tokens = run()
    assert calls
    monkeypatch.setattr(paged_attention.native, "attention_fits", lambda *a: False)
    calls.clear()
    assert run() == tokens and not calls
