"""Every dense layout against the single-device reference (tests/dist.py: real gloo processes).

One spawned group per world size runs every layout of that size (starting ranks costs seconds).
Each case is ``modelcarve verify``'s own worker: logits, loss, per-parameter gradients and
parameters after 3 AdamW steps, each within its tolerance (verify.TOLERANCES; fp32: loss 1e-5
relative, gradients and parameters 1e-4 absolute). Other engineers append rows to LAYOUTS.
"""

import pytest

from dist import run_distributed

COMMON = "seq=16,mbs=1,param_dtype=fp32"

# Models beyond the catalogue, written as config.json into a temp dir ("@name" in LAYOUTS):
# qwen3 with biases and tied embeddings exercises the partial-gradient paths of TP (q/k norms,
# the row-parallel bias under sp) and the vocab-parallel tied head; a dense MLA model
# (deepseek_v3 without routed experts) exercises MLA's TP split.
CONFIGS = {
    "qwen3-tied": dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                       tie_word_embeddings=True, max_position_embeddings=64),
    "mla-dense": dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=0,
                      moe_intermediate_size=16, num_experts_per_tok=0, max_position_embeddings=64),
}

# world size -> [(model, layout)]; the pipeline / MoE / CP engineers add their rows here.
LAYOUTS = {
    2: [
        ("tiny-llama", f"dp=2,gbs=4,{COMMON}"),
        ("tiny-llama", f"dp=2,zero=1,gbs=4,{COMMON}"),
        ("tiny-llama", f"dp=2,fsdp,gbs=4,{COMMON}"),
        ("tiny-llama", f"tp=2,gbs=2,{COMMON}"),
        ("tiny-llama", f"tp=2,sp,gbs=2,{COMMON}"),
        ("tiny-llama", "tp=2,sp,gbs=2,seq=16,mbs=1,param_dtype=bf16"),
        ("tiny-llama", "dp=2,fsdp,gbs=4,seq=16,mbs=1,param_dtype=bf16"),
        ("tiny-llama", "dp=2,zero=1,gbs=4,seq=16,mbs=1,param_dtype=bf16"),  # bf16 params, fp32 master (issue 26)
        ("@qwen3-tied", f"tp=2,sp,gbs=2,{COMMON}"),
        ("@mla-dense", f"tp=2,gbs=2,{COMMON}"),
        ("tiny-llama", f"dp=2,fsdp,recompute=full,gbs=4,{COMMON}"),
        ("tiny-llama", f"tp=2,sp,recompute=selective,gbs=2,{COMMON}"),
    ],
    4: [
        ("tiny-llama", f"dp=4,hsdp=2,gbs=8,{COMMON}"),
        ("tiny-llama", f"tp=2,dp=2,gbs=4,{COMMON}"),
        ("tiny-llama", f"tp=2,sp,dp=2,zero=1,gbs=4,{COMMON}"),
        ("@qwen3-tied", f"tp=2,dp=2,fsdp,gbs=4,{COMMON}"),
        ("tiny-llama", f"dp=4,dp_shard=2,zero=1,gbs=4,{COMMON}"),
        ("tiny-llama", "tp=2,sp,dp=2,zero=1,gbs=4,seq=16,mbs=1,param_dtype=bf16"),
        ("tiny-llama", "pp=2,dp=2,zero=2,gbs=8,seq=16,mbs=1,param_dtype=bf16"),
        ("tiny-llama", f"tp=4,sp,gbs=2,{COMMON}"),  # 2 kv heads: each replicated over 2 ranks
        ("@qwen3-tied", f"tp=4,gbs=2,{COMMON}"),
    ],
}


def _run_cases(cases):
    import torch.distributed as dist

    from modelcarve.verify.reference import verify_worker

    out = []
    for model, layout in cases:
        report = verify_worker(model, layout, steps=3)
        out.append(report)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("configs")
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def reports(request, model_dirs):
    world = request.param
    return world, _cached(world, model_dirs)


@pytest.fixture(scope="module")
def two_rank_reports(model_dirs):
    return _cached(2, model_dirs)


_CACHE: dict = {}


def _cached(world, model_dirs):
    if world not in _CACHE:
        cases = [(str(model_dirs / m[1:]) if m.startswith("@") else m, layout) for m, layout in LAYOUTS[world]]
        _CACHE[world] = run_distributed(_run_cases, world, cases, timeout=400)[0]
    return _CACHE[world]


def test_layouts_match_reference(reports):
    world, rank0 = reports
    failures = []
    for (model, layout), report in zip(LAYOUTS[world], rank0):
        bad = [c for c in report["checks"] if not c["passed"]]
        kinds = {c["name"].split("/")[0] for c in report["checks"]}
        assert {"loss", "grad", "param"} <= kinds, (layout, kinds)
        if bad:
            failures.append((layout, bad[:5]))
    assert not failures, failures


def test_sharding_shrinks_what_each_rank_holds(two_rank_reports):
    """ZeRO-1 halves the optimiser state per rank, FSDP the parameters, TP the parameters."""
    world, rank0 = 2, two_rank_reports
    by = {layout.split(",gbs")[0]: r["memory"] for (model, layout), r in zip(LAYOUTS[world], rank0) if model == "tiny-llama" and "fp32" in layout}
    plain, zero1, fsdp, tp = by["dp=2"], by["dp=2,zero=1"], by["dp=2,fsdp"], by["tp=2"]
    for rank in range(2):
        # AdamW: two moments per parameter (plus a 4-byte step counter per tensor)
        assert abs(plain[rank]["optim_bytes"] / (2 * plain[rank]["param_bytes"]) - 1) < 0.01
        assert 0.3 < zero1[rank]["optim_bytes"] / plain[rank]["optim_bytes"] < 0.7
        assert 0.45 < fsdp[rank]["param_bytes"] / plain[rank]["param_bytes"] < 0.55
        assert 0.45 < tp[rank]["param_bytes"] / plain[rank]["param_bytes"] < 0.6  # norms stay whole
    assert abs(sum(z["optim_bytes"] for z in zero1) / plain[0]["optim_bytes"] - 1) < 0.01
