"""What a rank receives when it is played alone under torch's ``fake`` process group.

The fake backend returns every collective at once and delivers nothing: a receive buffer keeps
its uninitialised contents, an all-gather's output too. A program that reads what it received
(the size of a pickled object, the split sizes of an MoE all-to-all) then reads garbage. The
dry runs (collective_order.py, rank_programs.py) install three things so a rank's program runs
to its end with the collectives a real launch would issue, in the same order:

* ``PlayLog`` (a collectives.CommLog): records every collective as CommLog does, then fills
  what the rank received under the **symmetric-program assumption** (the peers of a group run
  the same program as this rank, which is how the runtime is written and what the order check
  then verifies): an all-gather's every block is this rank's input; an all-to-all's block from
  each peer is the block this rank sends to itself (when the splits match; zeros otherwise);
  a point-to-point receive is zeros. This is only about the *values* a rank computes on; which
  collectives it issues, over which group, with which shapes, is recorded before the op runs.
* ``play_pipeline(runner, mailbox)``: torch.distributed.pipelining exchanges stage metadata
  (the shapes of activations and gradients) as pickled objects on the first step, which the
  fake backend cannot carry. Each stage's ``_send_meta`` still sends (recorded as torch sends
  it: a size and the bytes, via send_object_list) and leaves the object in ``mailbox`` under
  (sender stage, receiver stage, sender rank, receiver rank) and under (sender stage, receiver
  stage) alone, for a receiver whose own sender is not played; ``_recv_meta`` records a receive of the same two messages and
  takes the object from the mailbox. Ranks are played in rank order, so the forward metadata
  (stage s to s+1) was sent before it is received; the backward metadata (s+1 to s) is not:
  it is derived from this stage's forward outputs (the gradient of an output has its shape and
  dtype; torch's static mode derives it the same way, ``_derive_grad_metas``). An interleaved
  schedule's wrap-around (the last pipeline rank feeds the first rank's next chunk) is met by
  playing the waiting rank again once the sender has run (``play_in_passes``). The warm-up vote
  (two int32 send/recv, recorded) decides torch's DYNAMIC mode, as it does in a real run where
  no stage is given static shapes; on the meta device the vote's ``.item()`` cannot run, so its
  result is replaced by that decision.
* ``balanced_routing(chunks)``: every MoE router sends token ``t``'s choice ``j`` to expert
  ``(t k + j) mod E`` with weight ``1/k``: every rank routes the same counts to every expert,
  deterministically, so the split sizes it receives are the ones it sends (the assumption
  above) and the all-to-all shapes are what a balanced step would exchange. Real routing is
  data-dependent: the sizes differ step to step, the order and groups of the all-to-alls do not
  (expert.py issues the count exchange, the rows, the rows back, per MoE layer, whatever the
  counts are).
"""

from __future__ import annotations

import io
import pickle

import torch

from modelcarve.runtime.distributed.collectives import CommLog, Event, axis_of, tier_of


class PlayLog(CommLog):
    """CommLog that also fills received data under the symmetric-program assumption (module doc)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        spec = self._ops.get(func)
        if spec is not None and func.namespace == "c10d":
            with torch.no_grad():
                _fill(spec[0], args, self.me)
        return out

    def add_p2p(self, op: str, peer: int, tensors: list) -> None:
        """Record a point-to-point message issued outside the dispatcher's view (the metadata)."""
        self.events.append(Event(op=op, ranks=(self.me, peer), axis=axis_of((self.me, peer), self.layout),
                                 tier=tier_of([peer], self.per_node, self.me), dtype=str(tensors[0].dtype).removeprefix("torch."),
                                 shapes=tuple(tuple(t.shape) for t in tensors),
                                 payload=sum(t.numel() * t.element_size() for t in tensors),
                                 wire=0.0, peer=peer))


def _real(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta"


def _fill(op: str, args, me: int) -> None:
    if op == "recv":
        for t in args[0]:
            if _real(t):
                t.zero_()
    elif op == "all_gather":
        outs, ins = args[0], args[1]
        if isinstance(outs, torch.Tensor) and _real(outs):  # _allgather_base_(out, in)
            outs.view(-1, *ins.shape).copy_(ins.unsqueeze(0).expand(outs.numel() // max(1, ins.numel()), *ins.shape))
        elif isinstance(outs, (list, tuple)):  # allgather_([[out per rank]], [in])
            for group_outs, x in zip(outs, ins):
                for o in group_outs:
                    if _real(o) and o.shape == x.shape:
                        o.copy_(x)
    elif op == "all_to_all" and isinstance(args[0], torch.Tensor) and _real(args[0]):
        from torch.distributed import ProcessGroup, get_process_group_ranks

        out, x, out_splits, in_splits = args[0], args[1], list(args[3]), list(args[4])
        pg = args[2] if isinstance(args[2], ProcessGroup) else ProcessGroup.unbox(args[2])
        members = get_process_group_ranks(pg)
        n, mine = len(members), members.index(me)
        out_splits = out_splits or [out.shape[0] // n] * n
        in_splits = in_splits or [x.shape[0] // n] * n
        lo = sum(in_splits[:mine])
        block = x[lo:lo + in_splits[mine]]
        if all(s == in_splits[mine] for s in out_splits):
            out.copy_(block.repeat(n, *([1] * (x.dim() - 1))))
        else:
            out.zero_()


# --- pipelines ---------------------------------------------------------------------------


class MissingMetadata(Exception):
    """A stage's forward metadata comes from a rank not played yet (an interleaved schedule's
    wrap-around: the last pipeline rank feeds the first rank's second chunk); the caller plays
    this rank again after the others (``play_in_passes``). Not a RuntimeError: the pipeline
    runner's error wrapping lets it through."""


def play_in_passes(ranks, play, mailbox: dict) -> None:
    """``play(rank)`` every rank; a rank that raised MissingMetadata is played again after the
    rest, until all have run (each pass leaves more stages' metadata in ``mailbox``)."""
    pending = list(ranks)
    while pending:
        missed, known = [], len(mailbox)
        for rank in pending:
            try:
                play(rank)
            except MissingMetadata as err:
                missed.append(rank)
                why = err
        if missed and len(mailbox) == known:
            raise RuntimeError(f"no rank of {missed[:8]} can get its stage metadata: {why}")
        pending = missed


def _object_messages(obj) -> list[torch.Tensor]:
    """The two tensors send_object_list sends for ``obj``: its byte count, then its bytes."""
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    data = buf.getvalue()
    return [torch.empty(1, dtype=torch.long), torch.empty(len(data), dtype=torch.uint8)]


def play_pipeline(runner, mailbox: dict, log: PlayLog) -> None:
    """Install the metadata mailbox and the vote decision on ``runner``'s stages (module doc)."""
    if runner is None:
        return
    from torch.distributed.pipelining._utils import _derive_grad_metas
    from torch.distributed.pipelining.stage import _StageBackwardMeta

    for stage in runner.stages:
        def send_meta(meta, dst_stage, __stage=stage):
            me, peer = _global(__stage, __stage.stage_index), _global(__stage, dst_stage)
            mailbox[(__stage.stage_index, dst_stage, me, peer)] = mailbox[(__stage.stage_index, dst_stage)] = meta
            log.add_p2p("send", peer, _object_messages(meta))

        def recv_meta(src_stage, __stage=stage):
            me, peer = _global(__stage, __stage.stage_index), _global(__stage, src_stage)
            if src_stage > __stage.stage_index:  # backward metadata: derived (module doc)
                meta = _StageBackwardMeta(backward_metas=_derive_grad_metas(__stage._stage_meta.outputs))
            else:
                # a peer not played (rank_programs.py plays one rank of a class): its stage's message
                meta = mailbox.get((src_stage, __stage.stage_index, peer, me),
                                   mailbox.get((src_stage, __stage.stage_index)))
                if meta is None:
                    raise MissingMetadata(f"stage {__stage.stage_index} waits for stage {src_stage}'s metadata")
            log.add_p2p("recv", peer, _object_messages(meta))
            return meta

        def vote_result(received_result=None, __stage=stage, __orig=stage._warmup_backward_result):
            __orig(received_result=received_result if received_result is None or _real(received_result)
                   else torch.zeros(1, dtype=torch.int32, device=__stage.device))
            return torch.zeros(1, dtype=torch.int32)  # DYNAMIC: no stage is given static shapes

        stage._send_meta, stage._recv_meta, stage._warmup_backward_result = send_meta, recv_meta, vote_result


def _global(stage, stage_index: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(stage.group, stage.stage_index_to_group_rank[stage_index])


# --- MoE ---------------------------------------------------------------------------------


def balanced_routing(chunks) -> None:
    """Replace every MoE router's forward by the deterministic balanced routing (module doc)."""
    from modelcarve.runtime.model.moe import MoE

    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, MoE):
                mod.router.forward = _balanced(mod.router, mod.num_experts, mod.top_k)
                mod.meta_counts = _balanced_counts(mod.num_experts, mod.top_k)


def _balanced_counts(num_experts: int, top_k: int):
    """Rows per expert of the balanced routing of ``tokens`` tokens, on the host (for a meta
    routing): assignment ``a = t k + j`` goes to ``a mod E``, so expert ``e`` gets
    ``floor(N / E)`` rows, plus one when ``e < N mod E`` (``N = tokens k``)."""
    def counts(tokens: int) -> torch.Tensor:
        n = tokens * top_k
        host = torch.device("cpu")  # also under a torch.device("meta") context (pipelining's shape inference)
        return (torch.full((num_experts,), n // num_experts, dtype=torch.int64, device=host)
                + (torch.arange(num_experts, device=host) < n % num_experts))
    return counts


def _balanced(router, num_experts: int, top_k: int):
    def forward(x: torch.Tensor):
        tokens = x.shape[0]
        ids = torch.arange(tokens * top_k, device=x.device).view(tokens, top_k) % num_experts
        weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=x.device)
        # the scores keep their dependence on the router weight (its gradient, its collectives)
        scores = torch.softmax(torch.nn.functional.linear(x.float(), router.weight.float()), dim=-1)
        return ids, weights + 0 * scores.sum(-1, keepdim=True), scores
    return forward
