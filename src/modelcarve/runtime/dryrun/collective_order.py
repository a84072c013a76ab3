"""The collectives every rank of a layout would issue, recorded without a real process group.

``collective_sequences(model, layout)`` plays each rank in turn in this one process under
torch's fake process group (the ``fake`` backend of the full world size: every collective
returns at once and exchanges nothing): build the mesh, the model, ``parallelize``, one training
step, recorded by collectives.CommLog. ``check_layout_order`` hands the sequences to
collectives.check_order, which refuses (LayoutError, naming the two ranks and the first
collective where they disagree) a layout whose ranks would deadlock. The step runs on real
CPU tensors of the model, so this is for small models (the tiny test models, a smoke check
before a long launch); rank_programs.py checks full-scale layouts on the meta device.

What the fake backend cannot carry is supplied by fake_transport.py (its module doc): received
values under the symmetric-program assumption (``PlayLog``), torch.distributed.pipelining's
pickled stage metadata through a mailbox (``play_pipeline``: pipelines, every schedule the
runtime has), and a deterministic balanced MoE routing (``balanced_routing``), so the split
sizes of the all-to-alls are known to every rank. Every rank is still played for real, one
after the other, and every pair is compared.

``hook(rank, trainer)`` (tests) is called on each rank after ``parallelize`` and may change what that
rank issues, e.g. to inject a deliberately mismatched collective.
"""

from __future__ import annotations

import torch.distributed as dist

from modelcarve.spec.errors import LayoutError


def collective_sequences(model_name: str, layout, seed: int = 0, hook=None) -> dict:
    """rank -> CommLog.sequence() of one training step of ``layout`` (see the module doc)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from modelcarve.runtime.distributed.mesh import build_mesh, destroy, init_distributed
    from modelcarve.runtime.build import build_chunks
    from modelcarve.runtime.dryrun.fake_transport import PlayLog, balanced_routing, play_in_passes, play_pipeline
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data, seed_everything

    if dist.is_initialized():
        raise LayoutError("the dry run needs a process without a process group (it plays every rank itself)")
    sequences, mailbox = {}, {}

    def play(rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            init_distributed()
            seed_everything(seed)
            mesh = build_mesh(layout)
            chunks, spec = build_chunks(model_name, layout, mesh, seed=seed, sharded=False)
            balanced_routing(chunks)
            trainer = Trainer(chunks, layout, mesh, TrainConfig(seed=seed))
            log = PlayLog(layout)
            play_pipeline(trainer.runner, mailbox, log)
            if hook is not None:
                hook(rank, trainer)
            tokens, targets = make_data(None, spec.vocab_size, seed).batch(0, layout.global_batch, layout.seq)
            with log:
                trainer.step(tokens, targets)
            sequences[rank] = log.sequence()
        finally:
            destroy()

    play_in_passes(range(layout.world_size), play, mailbox)
    return dict(sorted(sequences.items()))


def check_layout_order(model_name: str, layout, seed: int = 0, hook=None) -> int:
    """Raise LayoutError if the ranks of ``layout`` would issue collectives in different orders;
    returns the number of collectives checked."""
    from modelcarve.runtime.distributed.collectives import check_order

    sequences = collective_sequences(model_name, layout, seed, hook)
    check_order(sequences)
    return sum(len(s) for s in sequences.values())
