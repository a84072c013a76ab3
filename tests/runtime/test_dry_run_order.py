"""collectives.check_order refuses, without any device or real process group, a program whose
ranks would issue collectives in different orders (a deadlock), and accepts a consistent one.

Each rank's program runs in this one process under torch's fake process group (the ``fake``
backend: collectives return at once, nothing is exchanged), recorded by collectives.CommLog;
the recorded sequences go to ``check_order``. The mismatched program is a classic hang: rank 1
all-reduces over the world before its tp group's all-reduce, the others after.
"""

from __future__ import annotations

import pytest


def _record(program, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelcarve.runtime.distributed.collectives import CommLog

    sequences = {}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            with CommLog() as log:
                program(rank, groups[rank // 2])
            sequences[rank] = log.sequence()
        finally:
            dist.destroy_process_group()
    return sequences


def _consistent(rank, tp):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4), group=tp)
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        dist.send(torch.ones(3), 2)
    if rank == 2:
        dist.recv(torch.empty(3), 0)


def _swapped(rank, tp):
    import torch
    import torch.distributed as dist

    if rank == 1:  # the deliberate mismatch
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(4), group=tp)
    else:
        dist.all_reduce(torch.ones(4), group=tp)
        dist.all_reduce(torch.ones(2))


def _unpaired(rank, tp):
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.send(torch.ones(3), 2)
        dist.send(torch.ones(3), 2)
    if rank == 2:
        dist.recv(torch.empty(3), 0)


def test_order_check():
    from modelcarve.runtime.distributed.collectives import check_order
    from modelcarve.spec.errors import LayoutError

    check_order(_record(_consistent, 4))
    with pytest.raises(LayoutError, match=r"ranks 0 and 1 would deadlock: their collective #1 in common differs"):
        check_order(_record(_swapped, 4))
    with pytest.raises(LayoutError, match=r"rank 0 sends 2 messages to rank 2 which receives 1"):
        check_order(_record(_unpaired, 4))


def _extra_collective_on_rank1(rank, trainer):
    """The deliberate mismatch in a real layout: rank 1 all-reduces once more, over the world,
    before its step; every other rank goes straight to its tp all-gathers."""
    if rank != 1:
        return
    import torch
    import torch.distributed as dist

    step = trainer.forward_backward

    def forward_backward(tokens, targets):
        dist.all_reduce(torch.zeros(1))
        return step(tokens, targets)

    trainer.forward_backward = forward_backward


def test_layout_dry_run_order():
    """A tp=2 x sp x dp=2 step of tiny-llama played rank by rank under the fake process group:
    its real order is accepted; with the extra collective on rank 1 it is refused, naming ranks
    0 and 1 and the first collective (rank 1's all-reduce over the world) before any launch."""
    from modelcarve.runtime.dryrun.collective_order import check_layout_order
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.layout import Layout

    layout = Layout.parse("tp=2,dp=2,sp,seq=16,gbs=2,mbs=1,param_dtype=fp32")
    assert check_layout_order("tiny-llama", layout) > 0
    with pytest.raises(LayoutError, match=r"ranks 0 and 1 would deadlock: their collective #1 in common differs.*"
                                          r"rank 1: all_reduce over ranks \[0, 1, 2, 3\]"):
        check_layout_order("tiny-llama", layout, hook=_extra_collective_on_rank1)



def _extra_send_on_rank0(rank, trainer):
    """A pipeline mismatch: rank 0 (stage 0) sends one activation more than stage 1 receives."""
    if rank != 0:
        return
    import torch
    import torch.distributed as dist

    step = trainer.forward_backward

    def forward_backward(tokens, targets):
        dist.send(torch.zeros(1, 16, 64), 1)
        return step(tokens, targets)

    trainer.forward_backward = forward_backward


@pytest.mark.parametrize("layout", [
    "pp=2,seq=16,gbs=4,mbs=1,schedule=1f1b",
    "pp=2,tp=2,sp,seq=16,gbs=4,mbs=1,schedule=1f1b",
    "pp=2,seq=16,gbs=4,mbs=1,schedule=interleaved-1f1b,virtual_stages=2",
    "pp=2,seq=16,gbs=4,mbs=1,schedule=zero-bubble",
])
def test_pipeline_dry_run_order(layout):
    """Pipelines played rank by rank (fake_transport.py carries torch's stage metadata): every
    schedule's sends and receives pair and the groups agree; an extra send on rank 0 is refused
    naming the two ranks, and so is rank 1's extra all-reduce over the world."""
    from modelcarve.runtime.dryrun.collective_order import check_layout_order, collective_sequences
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.layout import Layout

    lay = Layout.parse(layout)
    sequences = collective_sequences("tiny-llama", lay)
    assert all(any(e[0] == "send" for e in s) and any(e[0] == "recv" for e in s) for s in sequences.values())
    assert check_layout_order("tiny-llama", lay) > 0
    with pytest.raises(LayoutError, match=r"rank 0 sends \d+ messages to rank 1 which receives \d+"):
        check_layout_order("tiny-llama", lay, hook=_extra_send_on_rank0)
    with pytest.raises(LayoutError, match=r"ranks 0 and 1 would deadlock.*rank 1: all_reduce over ranks \[0, 1"):
        check_layout_order("tiny-llama", lay, hook=_extra_collective_on_rank1)


@pytest.mark.parametrize("layout", ["dp=2,ep=2,seq=16,gbs=4,mbs=1", "tp=2,dp=2,ep=2,sp,seq=16,gbs=4,mbs=1",
                                    "pp=2,dp=2,ep=2,seq=16,gbs=8,mbs=1"])
def test_moe_dry_run_order(layout):
    """MoE layouts under the balanced dry-run routing (fake_transport.balanced_routing): the EP
    all-to-alls are recorded on every rank and agree; rank 1's extra all-reduce is refused."""
    from modelcarve.runtime.dryrun.collective_order import check_layout_order, collective_sequences
    from modelcarve.spec.errors import LayoutError
    from modelcarve.spec.layout import Layout

    lay = Layout.parse(layout)
    sequences = collective_sequences("tiny-moe", lay)
    assert all(sum(e[0] == "all_to_all" for e in s) >= 6 for s in sequences.values())
    assert check_layout_order("tiny-moe", lay) > 0
    with pytest.raises(LayoutError, match=r"ranks 0 and 1 would deadlock.*rank 1: all_reduce over ranks \[0, 1"):
        check_layout_order("tiny-moe", lay, hook=_extra_collective_on_rank1)
