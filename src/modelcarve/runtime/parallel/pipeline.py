"""Pipeline parallelism: run the chunks of ``pipeline_split.split_model`` under a schedule.

Uses ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``); all four run on
CPU/gloo (checked in tests/runtime/test_runtime_pipeline.py). What is ours: the split (pipeline_split.py),
the loss normalisation, the tied-embedding gradient sum, the loss broadcast and clear errors,
plus two measurements torch does not give: each rank's timed list of compute actions per step
(``runner.actions``, ``runner.gather_actions()``; its sends/recvs with the time each was posted in
``runner.actions.comms``: the data of runtime/measure/timeline.py's figure) and
the point-to-point bytes it sent (``runner.sent_bytes``).

Usage (the order parallelize.py / train.py use)::

    chunks = split_model(model, layout, pp_rank=mesh.get_local_rank("pp"))
    # ... TP / EP / CP / DP applied to each chunk ...
    runner = build_pipeline(chunks, layout, mesh, loss_fn)
    loss = runner.step(tokens, targets)      # forward + backward over all micro-batches
    optimizer.step(); optimizer.zero_grad()

Schedules (``layout.schedule``): ``gpipe`` (all forwards, then all backwards), ``1f1b``
(one-forward-one-backward after a warm-up; needs micro-batches >= pp), ``interleaved-1f1b``
(``virtual_stages`` chunks per rank, Megatron's interleaving; micro-batches a multiple of pp),
``zero-bubble`` (ZB-H1 style: backward split into input-gradient I and weight-gradient W,
torch's ``ScheduleInterleavedZeroBubble``).

Loss normalisation (the runtime contract): ``loss_fn(logits, targets)`` returns the mean token
cross-entropy of one micro-batch; every micro-batch has ``mbs x seq`` tokens, so the mean over
micro-batches is the mean over this pipeline's batch, and torch's ``scale_grads`` divides the
accumulated gradients by the micro-batch count to match. ``step`` returns that mean, broadcast
from the last stage to every pipeline rank, then averaged over the ``dp`` and ``cp`` mesh axes
(equal token counts per rank), i.e. the global-batch mean token cross-entropy on every rank.
Gradients are this pipeline's; reducing them over dp stays with data_parallel.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.microbatch import _Replicate
from torch.distributed.tensor import DTensor

from modelcarve.runtime.distributed.mesh import new_group
from modelcarve.runtime.parallel.pipeline_split import balance_layers, num_stages, split_model, stage_ids
from modelcarve.runtime.distributed.shards import tied_copy_names, unwrap
from modelcarve.spec.errors import LayoutError, ModelcarveError
from modelcarve.spec.layout import Layout
from modelcarve.spec.support import pipeline_problems

__all__ = ["Action", "PipelineRunner", "build_pipeline", "split_model", "balance_layers", "stage_ids", "tied_copy_names"]

_MULTI_STAGE = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}
_SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class Action:
    """One compute action a rank ran: F (forward), B (full backward), I (input-gradient
    backward), W (weight-gradient backward) of ``microbatch`` on ``stage``, with its measured
    start and end in seconds since the step began (waits for peers fall between actions)."""

    stage: int
    microbatch: int
    kind: str
    start_s: float = 0.0
    end_s: float = 0.0


class _ActionLog(list):
    """The actions of one step, in order; ``t0`` is the step's start (perf_counter);
    ``sent_bytes`` the activation and gradient bytes this rank sent to other stages."""

    t0 = 0.0
    sent_bytes = 0
    t0_wall = 0.0  # time.time() at t0: lines up the ranks' clocks in runtime/measure/timeline.py
    end_s = 0.0  # when the schedule's step returned, seconds since t0
    comms: list  # (kind "send"/"recv", dir "F"/"B", stage, peer stage, microbatch, issued_s)

    def timed(self, stage: int, microbatch: int, kind: str, run):
        start = time.perf_counter()
        result = run()
        self.append(Action(stage, microbatch, kind, start - self.t0, time.perf_counter() - self.t0))
        return result


class _RecordingStage(PipelineStage):
    """A PipelineStage that logs every compute action it runs, with its time (for the pipeline
    timeline figure and the schedule tests)."""

    def __init__(self, *args, log: _ActionLog, **kwargs):
        super().__init__(*args, **kwargs)
        self._log = log

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        parent = super().forward_one_chunk
        return self._log.timed(self.stage_index, fwd_chunk_id, "F", lambda: parent(fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        parent = super().backward_one_chunk
        return self._log.timed(
            self.stage_index, bwd_chunk_id, "B" if full_backward else "I",
            lambda: parent(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward),
        )

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        parent = super().backward_weight_one_chunk
        return self._log.timed(self.stage_index, bwd_chunk_id, "W", lambda: parent(bwd_chunk_id, last_backward=last_backward))

    # Sends are counted here: the schedules call isend directly (not through a function a
    # wrapper around torch.distributed could see, metrics.CommCounter).
    # Each send/recv is logged when the schedule asks for its ops (when it is posted).
    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._count(self._posted("send", "F", fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id)))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._count(self._posted("send", "B", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id)))

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._posted("recv", "F", fwd_chunk_id, super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._posted("recv", "B", bwd_chunk_id, super().get_bwd_recv_ops(bwd_chunk_id))

    def _posted(self, kind: str, direction: str, chunk: int, ops):
        if ops:
            peer = self.stage_index + (1 if (kind == "send") == (direction == "F") else -1)
            self._log.comms.append((kind, direction, self.stage_index, peer, chunk, time.perf_counter() - self._log.t0))
        return ops

    def _count(self, ops):
        self._log.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops


class PipelineRunner:
    """Runs one training step's forward and backward over all micro-batches of a pipeline."""

    def __init__(self, chunks, stages, schedule, layout: Layout, mesh, tied_group, log: _ActionLog):
        self.chunks, self.stages, self.schedule, self.layout, self.mesh = chunks, stages, schedule, layout, mesh
        self.pp_group = mesh.get_group("pp")
        self.pp_rank = mesh.get_local_rank("pp")
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._tied_group = tied_group
        # (chunk, parameter FQN) pairs whose gradients are summed with the other end's copy.
        self._tied_params: list[tuple[nn.Module, str]] = []
        if tied_group is not None:
            for chunk in chunks:
                if unwrap(chunk).stage_index == 0:
                    self._tied_params.append((chunk, "tok_embeddings.weight"))
                self._tied_params += [(chunk, name) for name in tied_copy_names(chunk)]
        self.actions = log
        """Compute actions this rank ran during the last ``step``, in order (``Action``)."""

    @property
    def sent_bytes(self) -> int:
        """Bytes of activations (forward) and input gradients (backward) this rank sent to
        other pipeline stages in the last ``step`` (payload, point-to-point)."""
        return self.actions.sent_bytes

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward + backward of ``tokens``/``targets`` [num_microbatches x mbs, seq] (this
        pipeline's batch; every rank passes it, each stage uses what it needs). Gradients
        accumulate into ``.grad``. Returns the global-batch mean loss (fp32 scalar) on every rank."""
        n = self.layout.num_microbatches
        if tokens.shape[0] % n:
            raise LayoutError(
                f"the batch has {tokens.shape[0]} sequences, not divisible into {n} micro-batches; "
                f"pass num_microbatches x mbs = {n * self.layout.mbs} sequences"
            )
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        self._start_log()
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        try:
            self.schedule.step(
                *args,
                target=targets if self.has_last else None,
                losses=losses,
                return_outputs=False,
                positions=positions,
            )
        except RuntimeError as err:
            raise self._step_error(err) from err
        self.actions.end_s = time.perf_counter() - self.actions.t0
        self._sync_tied_grads()
        return self._reduce_loss(losses, tokens.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only (no loss, no gradients) of ``tokens`` through the schedule: the logits
        [batch, seq, V(/tp)] on the rank holding the last stage, None on the others."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        self._start_log()
        args = (tokens,) if self.has_first else ()
        try:
            # the schedule evaluates loss_fn on the last stage: the ids serve as stand-in targets
            logits = self.schedule.eval(*args, target=tokens if self.has_last else None, positions=positions)
        except RuntimeError as err:
            raise self._step_error(err) from err
        return logits if self.has_last else None

    def _start_log(self) -> None:
        self.actions.clear()
        self.actions.comms = []
        self.actions.t0, self.actions.t0_wall = time.perf_counter(), time.time()
        self.actions.sent_bytes = 0
        self.actions.end_s = 0.0

    def gather_actions(self) -> dict[int, list[Action]]:
        """Every pipeline rank's actions of the last step, ``{pp_rank: [Action, ...]}`` (for the
        timeline figure). Collective over the pp group: all its ranks must call it."""
        parts: list = [None] * self.layout.pp
        dist.all_gather_object(parts, list(self.actions), group=self.pp_group)
        return dict(enumerate(parts))

    def _step_error(self, err: RuntimeError) -> ModelcarveError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        stages = [s.stage_index for s in self.stages]
        hint = ""
        if any(word in first.lower() for word in ("timed out", "timeout", "connection", "closed by peer", "reset by peer")):
            hint = "; a neighbouring pipeline rank died or stopped answering (see its log), the step was aborted"
        return ModelcarveError(f"pipeline step failed on pp rank {self.pp_rank} (stages {stages}): {first}{hint}")

    def _reduce_loss(self, losses: list[torch.Tensor], device) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=device)
        if self.has_last:
            loss = torch.stack([_local(x).detach().float() for x in losses]).mean()
        last_rank = self.stages[0].stage_index_to_group_rank[num_stages(self.layout) - 1]
        dist.broadcast(loss, group=self.pp_group, group_src=last_rank)
        for axis in ("dp", "cp"):
            if axis in (self.mesh.mesh_dim_names or ()) and self.mesh.size(self.mesh.mesh_dim_names.index(axis)) > 1:
                dist.all_reduce(loss, group=self.mesh.get_group(axis))
                loss /= self.mesh.size(self.mesh.mesh_dim_names.index(axis))
        return loss

    @torch.no_grad()
    def _sync_tied_grads(self) -> None:
        """Sum the gradients of the embedding (first stage) and of its copy in the head (last
        stage) over the tied group, so both hold the full gradient of the tied weight."""
        for chunk, name in self._tied_params:
            param = unwrap(chunk).get_parameter(name)
            if param.grad is None:  # e.g. the weight got no gradient in this step
                param.grad = torch.zeros_like(param)
            dist.all_reduce(_local(param.grad), group=self._tied_group)


def build_pipeline(
    chunks: list[nn.Module],
    layout: Layout,
    mesh,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineRunner:
    """A runner for this rank's ``chunks`` (from ``split_model``, possibly wrapped by TP/DP)
    over the ``pp`` axis of ``mesh`` with ``layout.schedule``."""
    pp_rank, pp_size = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
    if pp_size != layout.pp:
        raise LayoutError(f"the mesh has pp={pp_size} but the layout says pp={layout.pp}; build the mesh from this layout")
    expected = stage_ids(layout, pp_rank)
    got = [getattr(unwrap(c), "stage_index", None) for c in chunks]
    if got != expected:
        raise LayoutError(
            f"pipeline rank {pp_rank} should hold stages {expected} but was given chunks for {got}; "
            f"pass the chunks split_model(model, layout, pp_rank={pp_rank}) returned"
        )
    n, stages_total = layout.num_microbatches, num_stages(layout)
    problems = pipeline_problems(layout, stages_total)  # layer counts were checked by split_model
    if problems:
        raise LayoutError("; ".join(problems))
    group = mesh.get_group("pp")
    device = _device_of(chunks[0])
    log = _ActionLog()
    log.comms = []
    stages = [
        _RecordingStage(chunk, stage, stages_total, device, group=group, log=log)
        for chunk, stage in zip(chunks, expected)
    ]
    kwargs = dict(loss_fn=loss_fn, kwargs_chunk_spec={"positions": _Replicate}, scale_grads=True)
    try:
        if layout.schedule in _SINGLE_STAGE:
            schedule = _SINGLE_STAGE[layout.schedule](stages[0], n, **kwargs)
        else:
            schedule = _MULTI_STAGE[layout.schedule](stages, n, **kwargs)
    except ValueError as err:  # torch's own schedule checks, e.g. micro-batch counts
        raise LayoutError(f"schedule {layout.schedule} with pp={layout.pp}, {n} micro-batches: {err}") from None
    return PipelineRunner(chunks, stages, schedule, layout, mesh, _tied_group(chunks, layout, mesh), log)


TIED_GROUP = "_mc_tied_group"
"""Where ``create_tied_group`` keeps this rank's tied-embedding group on the mesh object."""


def create_tied_group(mesh, layout: Layout, spec) -> None:
    """Create, on every rank and in one order, the groups joining the first- and last-stage ranks
    of each (dp, cp, tp) position, when the model ties its embeddings over several stages (the
    last stage then holds a copy of the embedding: pipeline_split.py); keeps this rank's group
    (None on a rank of neither stage) on the mesh. Called by ``parallelize.create_groups``."""
    if TIED_GROUP in mesh.__dict__:
        return
    mine = None
    if spec.tied_embeddings and num_stages(layout) > 1:
        first_rank, last_rank = 0, (num_stages(layout) - 1) % layout.pp
        if layout.pp == 2:
            mine = mesh.get_group("pp")
        else:
            # One column per (dp, cp, tp) position: the ranks of one pipeline.
            grid = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).reshape(layout.pp, -1)
            for col in range(grid.shape[1]):
                ranks = [int(grid[first_rank, col]), int(grid[last_rank, col])]
                group = new_group(ranks)  # carries the collective timeout
                if dist.get_rank() in ranks:
                    mine = group
    mesh.__dict__[TIED_GROUP] = mine


def _tied_group(chunks, layout: Layout, mesh):
    """This rank's tied-embedding group, made up front by ``create_tied_group`` (made here when the
    chunks were split without ``parallelize``, as the pipeline tests do: every rank calls this)."""
    if TIED_GROUP not in mesh.__dict__:
        create_tied_group(mesh, layout, chunks[0].spec)
    mine = mesh.__dict__[TIED_GROUP]
    if mine is None and any(tied_copy_names(c) for c in chunks):
        raise ModelcarveError("this rank holds a tied embedding copy but create_tied_group made no group for it")
    return mine


def _device_of(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
