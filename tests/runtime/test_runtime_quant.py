"""Weight-only quantisation (runtime/engine/quant.py): PyTorch's CPU kernels compute what the stored
weights say; the quantisation error stays within its arithmetic bound; the resident bytes of a
quantised model's weights, single device and per tp2 rank (real gloo processes), are within 2%
of the planner's figure (plan/serve_memory.shard_facts); KV helpers round-trip within their bound."""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _spec():
    from modelcarve.spec.hf_config import spec_from_hf_config

    return spec_from_hf_config(CONFIG, name="quant-test")


def _weight(out=64, fan_in=256, seed=0):
    w = torch.randn(out, fan_in, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[3] *= 20  # an outlier channel: scales are per channel / group
    return w


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", 0)])
def test_kernel_equals_its_stored_weights_and_error_bound(kind, group):
    from modelcarve.runtime.engine.quant import QuantLinear

    w, b = _weight(), torch.randn(64) * 0.1
    layer = QuantLinear(w, b, kind, group or 128)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1))
    deq = layer.dequantize(torch.float32)
    want = x @ deq.t() + b
    got = layer(x)
    assert got.shape == (3, 5, 64)
    # fp32 sums of 256 products in another order: relative rounding ~ 256 x 2^-24 of sum |x||w|
    bound = 256 * 2.0**-24 * (x.abs() @ deq.abs().t()).max().item() * 4
    assert (got - want).abs().max().item() <= bound + 1e-6
    err = (deq - w).abs()
    if kind == "int8":
        assert (err <= layer.scale.float()[:, None] / 2 + 1e-7).all()
    elif kind == "int4":
        s = layer.scale.float().repeat_interleave(group, dim=1)
        assert (err <= 0.51 * s + 1e-7).all()
    else:  # e4m3: 3 mantissa bits, subnormals below 2^-6 step 2^-9 (times the scale)
        assert (err <= w.abs() / 16 + layer.scale[:, None] * 2.0**-9 + 1e-7).all()
    assert layer(x.bfloat16()).dtype == torch.bfloat16  # kernels take bf16 activations too


def test_resident_bytes_match_planner_single_device():
    from modelcarve.plan.serve.memory import shard_facts
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.engine.quant import QuantLinear, quantize_model, weight_bytes

    spec = _spec()
    measured = {}
    for kind in ("bf16", "int8", "int4", "fp8"):
        model = quantize_model(build_model(spec, dtype=torch.bfloat16), kind)
        if kind != "bf16":
            assert sum(isinstance(m, QuantLinear) for m in model.modules()) == spec.num_layers * 7
            assert not isinstance(model.output, QuantLinear)  # the head stays in bf16, as the planner says
        measured[kind] = weight_bytes(model)
        planned = shard_facts(spec, tp=1, weight_dtype=kind).weights_bytes
        assert abs(measured[kind] / planned - 1) <= 0.02, (kind, measured[kind], planned)
    assert measured["int4"] < measured["int8"] < measured["bf16"]
    # int4 with smaller groups: exactly 0.5 + 2.5 / group bytes per quantised weight
    matrices = spec.num_layers * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
    for group in (32, 64):
        model = quantize_model(build_model(spec, dtype=torch.bfloat16), "int4", group_size=group)
        assert weight_bytes(model) - measured["int4"] == pytest.approx(matrices * 2.5 * (1 / group - 1 / 128))


def test_moe_experts_quantised_bytes_match_planner():
    """Routed and shared experts are quantised as the planner counts them (router and head not)."""
    from modelcarve.plan.serve.memory import shard_facts
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.engine.quant import QuantExperts, quantize_model, weight_bytes
    from modelcarve.spec.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(CONFIG | dict(model_type="mixtral", intermediate_size=256, num_local_experts=4,
                                             num_experts_per_tok=2), name="quant-moe")
    x = torch.randn(10, 256, generator=torch.Generator().manual_seed(4))
    counts = [3, 0, 5, 2]  # rows grouped by expert, one expert without tokens
    for kind in ("int8", "int4", "fp8"):
        model = quantize_model(build_model(spec, dtype=torch.bfloat16, seed=1), kind)
        assert all(isinstance(b.feed_forward.experts, QuantExperts) for b in model.layers.values())
        planned = shard_facts(spec, tp=1, weight_dtype=kind).weights_bytes
        assert abs(weight_bytes(model) / planned - 1) <= 0.02, (kind, weight_bytes(model), planned)
        # the experts compute with exactly their stored weights (fp32 model)
        experts = quantize_model(build_model(spec, seed=1), kind).layers["0"].feed_forward.experts
        with torch.no_grad():
            got = experts(x, counts)
            want = []
            for e, rows in enumerate(torch.split(x, counts)):
                w1, w3, w2 = (getattr(experts, n)[e].dequantize() for n in ("w1", "w3", "w2"))
                want.append(torch.nn.functional.linear(experts.act(rows @ w1.t()) * (rows @ w3.t()), w2))
        want = torch.cat(want)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), kind


def test_bad_quantisation_requests_are_clear():
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.engine.quant import quantize_model
    from modelcarve.spec.errors import LayoutError

    with pytest.raises(LayoutError, match="int4 group size 96"):
        quantize_model(build_model(_spec()), "int4", group_size=96)
    with pytest.raises(LayoutError, match="cannot be executed"):
        quantize_model(build_model(_spec()), "nf4")


def test_kv_helpers_round_trip():
    from modelcarve.runtime.engine.quant import dequantize_kv, kv_bytes_per_element, quantize_kv

    k = torch.randn(2, 7, 4, 64, generator=torch.Generator().manual_seed(2))  # [b, s, heads, head_dim]
    k[0, 3] *= 50  # one loud token: its own scale
    for kind in ("int8", "fp8"):
        q, scale = quantize_kv(k, kind)
        assert q.element_size() == 1 and scale.shape == (2, 7, 4, 1) and scale.dtype == torch.float16
        back = dequantize_kv(q, scale, torch.float32)
        s = scale.float()
        bound = s / 2 + 1e-6 if kind == "int8" else k.abs() / 16 + s * 2.0**-9 + 1e-6
        assert ((back - k).abs() <= bound).all(), kind
    assert kv_bytes_per_element("int8", 128) == 1 + 2 / 128


def _tp_bytes():
    import torch.distributed as dist

    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.runtime.engine.quant import quantize_model, weight_bytes
    from modelcarve.runtime.parallel.tensor import full_vocab_logits
    from modelcarve.spec.layout import Layout

    spec = _spec()
    out = {}
    layout = Layout.parse("tp=2,seq=16,param_dtype=bf16")
    mesh = build_mesh(layout)
    for kind in ("bf16", "int8", "int4", "fp8"):
        chunk = parallelize(build_model(spec, dtype=torch.bfloat16), layout, mesh)[0]
        out[kind] = weight_bytes(quantize_model(chunk, kind))
    # int4 g128 groups align with the row-parallel split (128 | 256 / 2): the tp2 model computes
    # exactly what the single-device int4 model computes (fp32, up to summation order)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    fp32 = Layout.parse("tp=2,seq=16,param_dtype=fp32")
    chunk = quantize_model(parallelize(build_model(spec), fp32, build_mesh(fp32))[0], "int4")
    with torch.no_grad():
        got = full_vocab_logits(chunk(ids), chunk)
        want = quantize_model(build_model(spec), "int4")(ids)
    out["int4_logits_diff"] = (got - want).abs().max().item()
    out["rank"] = dist.get_rank()
    return out


def test_resident_bytes_match_planner_per_tp2_rank():
    from modelcarve.plan.serve.memory import shard_facts

    spec = _spec()
    for result in run_distributed(_tp_bytes, 2, timeout=300):
        for kind in ("bf16", "int8", "int4", "fp8"):
            planned = shard_facts(spec, tp=2, weight_dtype=kind).weights_bytes
            assert abs(result[kind] / planned - 1) <= 0.02, (result["rank"], kind, result[kind], planned)
        assert result["int4_logits_diff"] <= 1e-4, result
