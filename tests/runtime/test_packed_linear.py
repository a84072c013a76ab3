"""The engine's CPU fast paths (issue 31) against the plain arithmetic they replace.

* ``PackedLinear`` (runtime/engine/model_runner.py: a oneDNN-packed weight copy made at load)
  equals ``F.linear`` within what the dtypes' rounding allows. Both accumulate ``K`` products in
  fp32, in different orders: each result is within ``K * 2^-24 * sum_k |x_k w_k|`` of the exact
  dot product (the standard summation bound, first order), so the two are within twice that; a
  bf16 result is then rounded once to 8 significant bits, which moves each by at most
  ``2^-8 * |value|`` (round to nearest); the two roundings add ``2^-8 * (|a| + |b|)``.
* ``_attend`` (paged_attention.py) in bf16 on the CPU computes in fp32 and rounds once: equal to
  fp32 SDPA over the same (bf16) values within the bf16 unit roundoff, ``2^-8 * |ref|``.
* A bf16 engine gets the packed linears (where oneDNN has bf16 kernels) and generates the same
  greedy tokens as one without them on a tiny checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelcarve.runtime.engine.model_runner import PackedLinear, packable_dtypes
from modelcarve.runtime.engine.paged_attention import _attend

U32 = 2.0**-24
U_BF16 = 2.0**-8
"""bf16 unit roundoff: 8 significant bits, round to nearest moves a value by at most 2^-8 of it."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_packed_linear_equals_f_linear(dtype, rows):
    if dtype not in packable_dtypes():
        pytest.skip(f"oneDNN has no {dtype} kernels here")
    gen = torch.Generator().manual_seed(rows)
    k, n = 96, 80
    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        lin.bias.copy_(torch.randn(n, generator=gen))
    lin = lin.to(dtype).requires_grad_(False)
    x = torch.randn(1, rows, k, generator=gen).to(dtype)
    got = PackedLinear(lin)(x).float()
    ref = F.linear(x, lin.weight, lin.bias).float()
    assert got.shape == ref.shape == (1, rows, n)
    mag = x.float().abs() @ lin.weight.float().abs().T + lin.bias.float().abs()  # sum_k |x_k w_k| (+ |b|)
    tol = 2 * (k + 1) * U32 * mag
    if dtype == torch.bfloat16:
        tol = tol + U_BF16 * (got.abs() + ref.abs())
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()


@pytest.mark.parametrize("mask", [False, True])
def test_attend_bf16_is_fp32_rounded_once(mask):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 5, 16, generator=gen).bfloat16()
    k = torch.randn(3, 2, 12, 16, generator=gen).bfloat16()
    v = torch.randn(3, 2, 12, 16, generator=gen).bfloat16()
    m = (torch.arange(12)[None, :] <= torch.arange(5)[:, None] + 7)[None, None].expand(3, 1, 5, 12) if mask else None
    got = _attend(q, k, v, m, 0.25)
    assert got.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=0.25, enable_gqa=True)
    assert ((got.float() - ref).abs() <= U_BF16 * ref.abs()).all()


def test_bf16_engine_packs_and_keeps_its_tokens(tmp_path, monkeypatch):
    if torch.bfloat16 not in packable_dtypes():
        pytest.skip("oneDNN has no bf16 kernels here")
    from engine_cases import drive, greedy
    from hf_tiny import save_hf

    from modelcarve.runtime.engine import model_runner
    from modelcarve.runtime.engine.engine import Engine, EngineConfig

    save_hf("LlamaConfig", "LlamaForCausalLM", tmp_path / "llama", tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 17, 30)]

    def run():
        engine = Engine(EngineConfig(model=str(tmp_path / "llama"), layout="tp=1,param_dtype=bf16",
                                     kv_cache_bytes=1 << 21))
        packed = sum(isinstance(m, PackedLinear) for m in engine.runner.chunk.modules())
        return packed, drive(engine, prompts, greedy())

    packed, tokens = run()
    assert packed > 0
    monkeypatch.setattr(model_runner, "packable_dtypes", lambda: (torch.float32,))
    unpacked, plain = run()
    assert unpacked == 0
    assert tokens == plain


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_packed_linear_pads_few_rows_to_the_min_rows_kernel(rows):
    """Fewer than ``MIN_ROWS`` rows run as ``MIN_ROWS`` (zero rows appended, their outputs dropped):
    bit for bit the first rows of the ``MIN_ROWS``-row product, and only ``rows`` rows come back."""
    from modelcarve.runtime.engine.fused import MIN_ROWS, packed_linear

    if torch.float32 not in packable_dtypes():
        pytest.skip("oneDNN has no fp32 kernels here")
    assert MIN_ROWS == 4  # the default (MODELCARVE_ENGINE_MIN_ROWS unset in the suite)
    gen = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 80).requires_grad_(False)
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight, None)  # oneDNN's layout (pack_weight's fallback)
    x = torch.randn(rows, 96, generator=gen)
    full = torch.zeros(MIN_ROWS, 96)
    full[:rows] = x
    got = packed_linear(x, packed, lin.bias)
    assert got.shape == (rows, 80)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(full, packed, lin.bias, "none", [], "")[:rows])
