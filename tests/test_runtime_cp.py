"""Context parallelism on the dense tiny model against the single-device reference (fp32).

One spawned gloo group per world size (2 and 4) loops over the layouts of that size. For each
layout every rank builds the same reference model, the parallel model, and the same batches;
the parallel run reports loss, per-parameter gradients and the parameters after 3 AdamW steps,
each compared with the reference: loss <= 1e-5 relative; gradients <= 1e-4 (max abs difference
relative to the gradient's max abs value); parameters after the steps <= 1e-4 max abs difference.

"verify" cases run the whole runtime (parallelize -> Trainer -> verify.py, clipping included)
with verify.TOLERANCES (a bf16 case with its looser ones). ``_manual_step`` drives CP with nothing but context.py (shard_batch, apply_context_parallel)
and a sum over the cp group, to check the CP pieces on their own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed

SEQ, BATCH, STEPS, LR = 32, 2, 3, 1e-3
LOSS_RTOL, GRAD_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-4


def _batches(spec, layout):
    gen = torch.Generator().manual_seed(1234)
    gbs = layout.global_batch
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (gbs, layout.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _reference(spec, layout):
    """Loss and grads at step 0, and parameters after STEPS AdamW steps, on one device."""
    from modelcarve.runtime.model import build_model

    model = build_model(spec, seed=0)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for tokens, targets in _batches(spec, layout):
        opt.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    # the steps must move the weights, or comparing parameters after them proves nothing
    assert min((p.detach() - init[n]).abs().max().item() for n, p in model.named_parameters()) > 10 * PARAM_ATOL
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _manual_step(spec, layout, mesh):
    """CP (and plain DP, tp=pp=1) with nothing but context.py: each rank takes its dp share of
    the sequences and its zig-zag piece of each, divides its token-loss sum by the global token
    count, and gradients are SUMMED over the dp x cp ranks."""
    import torch.distributed as dist

    from modelcarve.runtime.context import apply_context_parallel, shard_batch
    from modelcarve.runtime.mesh import axis_group, axis_rank
    from modelcarve.runtime.model import build_model

    group = axis_group(mesh, "dp_cp") if layout.dp > 1 else axis_group(mesh, "cp")
    share = layout.global_batch // layout.dp
    dp_rank = axis_rank(mesh, "dp")
    model = apply_context_parallel(build_model(spec, seed=0), mesh, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for tokens, targets in _batches(spec, layout):
        opt.zero_grad()
        num_tokens = targets.numel()  # every target token of the global batch
        tokens, targets = (t[dp_rank * share : (dp_rank + 1) * share] for t in (tokens, targets))
        tokens, targets, positions = shard_batch(tokens, targets, mesh, layout)
        logits = model(tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / num_tokens
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare(ref, got) -> dict:
    (ref_losses, ref_grads, ref_params), (losses, grads, params) = ref, got
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad": max((_rel(grads[n], g), n) for n, g in ref_grads.items()),
        "param": max(((params[n] - p).abs().max().item(), n) for n, p in ref_params.items()),
    }


def _worker(cases: list[tuple[str, str]]) -> dict:
    """Each case is (layout, driver): "manual" (context.py alone, above) or "verify" (the whole
    runtime: parallelize -> Trainer -> verify.py's gathering and comparison, clipping included)."""
    import torch.distributed as dist

    from modelcarve.runtime.mesh import build_mesh
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.layout import Layout
    from modelcarve.verify import verify_worker

    spec = get_model("tiny-llama")
    results = {}
    for text, driver in cases:
        if driver == "verify":
            dtype = "bf16" if "bf16" in text else "fp32"
            text_ = text.replace(",bf16", "")
            model = "tiny-moe" if "moe" in text else "tiny-llama"
            text_ = text_.replace(",moe", "")
            report = verify_worker(model, f"{text_},seq={SEQ},mbs=1", steps=STEPS, lr=LR, dtype=dtype)
            results[(text, driver)] = report
            dist.barrier()
            continue
        layout = Layout.parse(text).replace(seq=SEQ, param_dtype="fp32")
        layout = layout.replace(gbs=layout.gbs or BATCH * layout.dp)
        layout.validate(spec, world_size=layout.world_size)
        mesh = build_mesh(layout)
        results[(text, driver)] = _compare(_reference(spec, layout), _manual_step(spec, layout, mesh))
    return results


WORLDS = {
    2: [
        ("cp=2", "manual"),
        ("cp=2,gbs=2", "verify"),
        ("cp=2,gbs=2,bf16", "verify"),
        ("cp=2,ep=2,gbs=2,moe", "verify"),  # tiny-moe: experts sharded over the cp ranks
    ],
    4: [
        ("cp=2,dp=2", "manual"),
        ("cp=4,gbs=2", "verify"),
        ("cp=2,tp=2,gbs=2", "verify"),
        ("cp=2,tp=2,sp,gbs=2", "verify"),
        ("cp=2,dp=2,gbs=4", "verify"),
        ("cp=2,pp=2,gbs=2", "verify"),  # logits not compared under pp (verify.py)
    ],
}


@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_context_parallel_matches_reference(world_size):
    per_rank = run_distributed(_worker, world_size, WORLDS[world_size], timeout=400)
    for case, err in per_rank[0].items():
        if case[1] == "verify":
            kinds = {c["name"].split("/")[0] for c in err["checks"]}
            assert {"loss", "grad", "param"} | (set() if "pp=" in case[0] else {"logits"}) <= kinds, (case, kinds)
            worst = {k: max((c for c in err["checks"] if c["name"].split("/")[0] == k), key=lambda c: c["max_abs"] if c["metric"] == "abs" else c["max_rel"]) for k in kinds}
            for k, c in sorted(worst.items()):
                print(f"{case}: {k} worst {c['name']} abs {c['max_abs']:.2e} rel {c['max_rel']:.2e} (tol {c['tol']:.0e} {c['metric']})")
            bad = [c for c in err["checks"] if not c["passed"]]
            assert not bad, (case, bad[:5])
            continue
        print(f"{case}: loss rel {err['loss']:.2e}, grad rel {err['grad'][0]:.2e} ({err['grad'][1]}), "
              f"param abs {err['param'][0]:.2e} ({err['param'][1]})")
        assert err["loss"] <= LOSS_RTOL, (case, err)
        assert err["grad"][0] <= GRAD_RTOL, (case, err)
        assert err["param"][0] <= PARAM_ATOL, (case, err)
