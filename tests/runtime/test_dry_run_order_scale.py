"""runtime/dryrun/rank_programs.py: the collective-order check at full world size, one rank per
pipeline stage played on the meta device.

On tiny layouts (pipelines of every schedule, TP+SP, MoE with EP) its verdict and the number of
collectives it checks equal collective_order.py's, which plays every rank for real on CPU and
compares every pair: accepted as it is, refused with an extra world all-reduce on rank 1 and an
extra send on rank 0. Then the planner's full-scale layouts (tests/runtime/test_dry_run_bytes.py's):
Llama-3.1-405B on 2048x8 H100 (16,384 ranks, pp=16 zero-bubble, tp=4+sp, cp=8, 64 micro-batches)
and DeepSeek-V3 on 256x8 H100 (2,048 ranks, pp=32 zero-bubble, ep=8, cp=4, 960 micro-batches):
accepted, and refused naming the concrete rank whose program a hook changed. They run when
MODELCARVE_FULL_SCALE=1 (tests/conftest.py; reported as skipped otherwise): together 199 s under
pytest (Llama 61 s, DeepSeek-V3 137 s, load 1.0-1.8), too long for the default suite. Measured on the shared 2-core machine (load 1.7-3.9),
rank_programs playing micro-batches 0, 1 and the last of each stage for real and replaying the
others (ActionMemo): Llama accepted in 47 s (16 stages, ~1.5 s each after the first; the check over
16,384 ranks 13 s), the hooked rank 5 refused in 16 s (played for real, all 64 micro-batches);
DeepSeek-V3 accepted in 114 s (32 stages, ~3 s each after the first), the hooked rank 77 refused
in 29 s. Before the memo: Llama 212 s accepted (about 13 s per stage), DeepSeek-V3 about an hour
(each MoE stage 110-150 s), and it had never run to the end: its first complete run found two false
refusals, fixed in rank_programs (all_gather_object's padded bytes, rule 2's group labels).

The memo's own tests: its events equal the play of every micro-batch (tiny layouts of three
schedules), and a program whose collectives depend on the micro-batch index (micro-batch 1, or the
last) makes it fall back to playing every micro-batch.
"""

from __future__ import annotations

import pytest

from modelcarve.spec.errors import LayoutError
from modelcarve.spec.layout import Layout

from test_dry_run_order import _extra_collective_on_rank1, _extra_send_on_rank0


def _verdict(check):
    try:
        return "accepted", check()
    except LayoutError as err:
        return "refused", str(err).split(":")[0]


@pytest.mark.parametrize("model,layout", [
    ("tiny-llama", "tp=2,dp=2,sp,seq=16,gbs=2,mbs=1,param_dtype=fp32"),
    ("tiny-llama", "pp=2,tp=2,sp,seq=16,gbs=4,mbs=1,schedule=1f1b"),
    ("tiny-llama", "pp=2,seq=16,gbs=4,mbs=1,schedule=interleaved-1f1b,virtual_stages=2"),
    ("tiny-llama", "pp=2,seq=16,gbs=4,mbs=1,schedule=zero-bubble"),
    ("tiny-moe", "tp=2,dp=2,ep=2,sp,seq=16,gbs=4,mbs=1"),
    ("tiny-moe", "pp=2,dp=2,ep=2,seq=16,gbs=8,mbs=1"),
])
def test_classes_give_the_every_rank_verdict(model, layout):
    from modelcarve.runtime.dryrun.collective_order import check_layout_order
    from modelcarve.runtime.dryrun.rank_programs import check_layout_order_at_scale

    lay = Layout.parse(layout)
    for hook, ranks in ((None, ()), (_extra_collective_on_rank1, (1,)), (_extra_send_on_rank0, (0,))):
        every = _verdict(lambda: check_layout_order(model, lay, hook=hook))
        scale = _verdict(lambda: check_layout_order_at_scale(model, lay, hook=hook, hook_ranks=ranks))
        assert every[0] == scale[0], (hook, every, scale)
        if every[0] == "accepted":
            assert scale[1]["collectives"] == every[1]  # the same collectives, summed over every rank
            assert scale[1]["classes"] == lay.pp
        elif hook is _extra_collective_on_rank1:
            assert scale[1] == every[1] == "ranks 0 and 1 would deadlock"
        else:
            assert "rank 0 sends" in scale[1] and "rank 0 sends" in every[1]


def _play_stages(model, lay, memo, hook=None):
    from modelcarve.runtime.dryrun.rank_programs import play_rank

    mailbox, out = {}, []
    for p in range(lay.pp):
        stats: dict = {}
        events = play_rank(model, lay, p * lay.world_size // lay.pp, mailbox, hook=hook, memo=memo, stats=stats)
        out.append((events, stats))
    return out


@pytest.mark.parametrize("model,layout", [
    ("tiny-llama", "pp=2,tp=2,sp,seq=16,gbs=8,mbs=1,schedule=1f1b"),
    ("tiny-llama", "pp=2,seq=16,gbs=6,mbs=1,schedule=gpipe"),
    ("tiny-moe", "pp=2,dp=2,ep=2,seq=16,gbs=16,mbs=1,schedule=zero-bubble"),
])
def test_replayed_micro_batches_record_the_played_events(model, layout):
    """ActionMemo (module doc): the memoised play records exactly the events of the play that runs
    every micro-batch, and did replay the middle micro-batches."""
    lay = Layout.parse(layout)
    real, memo = _play_stages(model, lay, False), _play_stages(model, lay, True)
    for (a, _), (b, stats) in zip(real, memo):
        assert a == b
        assert stats["fallback"] is None and stats["replayed"] > 0 and stats["played"] > 0


def _extra_all_reduce_at(fire):
    """A hook: the stage's model issues an extra all-reduce in the forward of the micro-batches
    ``fire(micro_batch)`` picks (a program whose collectives depend on the micro-batch index)."""
    def hook(rank, trainer):
        import torch
        import torch.distributed as dist

        stage = trainer.runner.stages[0]
        forward_one_chunk, forward, now = stage.forward_one_chunk, stage.submod.forward, [None]

        def chunk(mb, *args, **kwargs):
            now[0] = mb
            try:
                return forward_one_chunk(mb, *args, **kwargs)
            finally:
                now[0] = None

        def model(*args, **kwargs):
            if now[0] is not None and fire(now[0]):
                dist.all_reduce(torch.zeros(2))
            return forward(*args, **kwargs)

        stage.forward_one_chunk, stage.submod.forward = chunk, model
    return hook


@pytest.mark.parametrize("fire,why", [
    (lambda mb: mb % 2 == 1, "micro-batches 0 and 1"),
    (lambda mb: mb == 7, "the last micro-batch"),  # of 8
])
def test_memo_falls_back_to_playing_every_micro_batch(fire, why):
    """Micro-batches 0 and 1 that differ, or a last one that differs from the memo: the rank is
    played again with every micro-batch real, and records what that play records."""
    lay = Layout.parse("pp=2,dp=2,ep=2,seq=16,gbs=16,mbs=1,schedule=zero-bubble")
    hook = _extra_all_reduce_at(fire)
    real, memo = _play_stages("tiny-moe", lay, False, hook), _play_stages("tiny-moe", lay, True, hook)
    for (a, _), (b, stats) in zip(real, memo):
        assert a == b
        assert why in stats["fallback"] and stats["replayed"] == 0


DSV3 = ("deepseek-v3", "256x8xH100", dict(cp=4, dp=16, ep=8, pp=32, tp=1, zero=1, mbs=1, gbs=15360, seq=4096,
                                           schedule="zero-bubble", grad_dtype="fp32", optim_dtype="fp32"))
L405 = ("llama-3.1-405b", "2048x8xH100", dict(cp=8, dp=32, ep=1, pp=16, tp=4, sp=True, zero=1, mbs=1, gbs=2048,
                                               seq=8192, schedule="zero-bubble", grad_dtype="fp32", optim_dtype="fp32"))


def _world_all_reduce_first(rank, trainer):
    """The one deviating rank: an all-reduce over the world before its step."""
    import torch
    import torch.distributed as dist

    step = trainer.forward_backward

    def forward_backward(tokens, targets):
        dist.all_reduce(torch.zeros(1))
        return step(tokens, targets)

    trainer.forward_backward = forward_backward


@pytest.mark.full_scale
@pytest.mark.parametrize("case,deviant", [
    pytest.param(L405, 5, marks=pytest.mark.timeout(900)),
    pytest.param(DSV3, 77, marks=pytest.mark.timeout(900)),
], ids=["llama-405b-2048x8", "deepseek-v3-256x8"])
def test_full_scale_order(case, deviant):
    """Accepted at 16,384 / 2,048 ranks; a hook changing one rank's program (rank 5: tp 1 of
    stage 0; rank 77: stage 1, ep 5) is refused before launch, naming it."""
    from modelcarve.runtime.dryrun.rank_programs import check_layout_order_at_scale
    from modelcarve.spec.hardware import parse_cluster

    model, cluster, fields = case
    layout, cl = Layout(**fields), parse_cluster(cluster)
    report = check_layout_order_at_scale(model, layout, cl)
    assert report["world_size"] == cl.num_devices and report["classes"] == layout.pp
    assert report["collectives"] > layout.world_size * layout.global_batch // (layout.dp * layout.mbs)
    with pytest.raises(LayoutError, match=rf"ranks \d+ and {deviant} would deadlock.*rank {deviant}: all_reduce of float32 \[\[1\]\]"):
        check_layout_order_at_scale(model, layout, cl, hook=_world_all_reduce_first, hook_ranks=(deviant,))


def test_cli_dry_run_checks_the_order(tmp_path):
    """``run --dry-run --cluster --check-order`` checks the order at the full world size before the
    bytes and reports it (the refusal is rank_programs' LayoutError, exit 2: tested above)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"tp": 2, "dp": 2, "pp": 2, "zero": 1, "gbs": 8, "seq": 64}))
    out = subprocess.run([sys.executable, "-m", "modelcarve.cli", "run", "--dry-run", "--check-order", "--model",
                          "tiny-llama", "--layout", str(layout), "--cluster", "8xH100", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    order = json.loads(out.stdout)["order"]
    assert order["world_size"] == 8 and order["ranks_played"] == [0, 4] and order["collectives"] > 0


def test_object_all_gather_bytes_compare_without_their_size():
    """all_gather_object pads every rank's bytes to the largest in a real launch; a rank played
    alone pads to its own, so rank_programs compares those bytes as op, group and dtype (module doc).
    A uint8 all-gather that does not follow the byte counts keeps its shapes."""
    from modelcarve.runtime.distributed.collectives import Event
    from modelcarve.runtime.dryrun.rank_programs import OBJECT_BYTES, program_of

    lay = Layout.parse("dp=2,seq=16,gbs=2,mbs=1")

    def gather(dtype, n):
        return Event(op="all_gather", ranks=(0, 1), axis="dp", tier="intra", dtype=dtype, shapes=((n,), (n,)),
                     payload=2 * n, wire=0.0)

    seqs = [program_of([gather("int64", 1), gather("uint8", n), gather("uint8", n)], 0, lay).by_rule[0] for n in (5, 132)]
    assert seqs[0][:2] == seqs[1][:2] and seqs[0][1][1] == OBJECT_BYTES
    assert seqs[0][2] != seqs[1][2]  # not after the counts: compared with its shapes


def test_classes_meeting_groups_in_another_order_interleave_alike():
    """Rule 2 compares how two concrete groups interleave by the groups, not by the rule indices
    each class numbered its groups with: stage 1 meets its dp group first, so its pp and world
    groups get other indices than stage 0's, and the layout is still accepted; swapping stage 1's
    pp and world collectives is refused."""
    from modelcarve.runtime.distributed.collectives import Event
    from modelcarve.runtime.dryrun.rank_programs import check_programs, program_of
    from modelcarve.spec.ranks import rank_of

    lay = Layout.parse("pp=2,dp=2,seq=16,gbs=4,mbs=1")

    def ev(ranks):
        return Event(op="all_reduce", ranks=tuple(sorted(ranks)), axis="?", tier="intra", dtype="float32",
                     shapes=((1,),), payload=4, wire=0.0)

    world = range(lay.world_size)

    def program(stage, swap=False):
        rank = rank_of(lay, pp=stage, dp=0, cp=0, tp=0)
        pp = [rank_of(lay, pp=p, dp=0, cp=0, tp=0) for p in range(2)]
        dp = [rank_of(lay, pp=stage, dp=d, cp=0, tp=0) for d in range(2)]
        events = ([ev(dp)] if stage == 1 else []) + ([ev(world), ev(pp)] if swap else [ev(pp), ev(world)])
        return program_of(events, rank, lay)

    def class_of(rank):
        return ("stage", rank // (lay.world_size // lay.pp))

    check_programs({("stage", 0): program(0), ("stage", 1): program(1)}, class_of, lay)
    with pytest.raises(LayoutError, match="order their collectives"):
        check_programs({("stage", 0): program(0), ("stage", 1): program(1, swap=True)}, class_of, lay)
