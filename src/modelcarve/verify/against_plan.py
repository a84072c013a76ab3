"""verify --against-plan: one training step's measured bytes and memory beside the planner's.

``AgainstPlan(trainer, spec, layout)`` wraps the first training step of ``verify_worker``:
``forward_backward`` and ``optimizer_step`` run under runtime/distributed/collectives.py's ``CommLog`` (the
gathers verify does for its own comparisons fall outside it) and runtime/measure/memory_report.py's
saved-activation hooks; ``rows()`` then sets, for this rank, every quantity of
plan/predict/step_traffic.py's prediction beside the measured one:

* ``payload:<op>`` and ``wire:<op>`` per axis x tier (unit ``bytes``): must be equal, to the
  byte (wire to 1e-6 relative: the ring formulas divide); torch pipelining's shape-metadata
  messages (integer dtypes) are reported as ``payload:send_meta``, not judged;
* ``params``, ``grads``, ``optimizer``, ``comm_buffers`` equal to the byte; ``activations``
  within 10% (plan/predict/activations.py against the peak saved-for-backward bytes), and
  ``activations_fused`` (plan/cost/activations.py's production-stack figure) beside it, not judged;
* MoE models go to plan/predict/moe_traffic.py (``forecast_rank``); under expert parallelism it is
  given the routing each rank's EP dispatchers sent during the step (``_RecordRouting``, gathered
  by ``gather_routing``), and ``payload:all_to_all_apriori`` (uniform routing x the planner's load
  imbalance) is reported beside the measured all-to-all bytes, not judged;
* a quantity the per-op model does not cover (biases in MoE / MLA layers, LayerNorm or biases under zero-bubble with full recomputation,
  ...) gets ``predicted`` None and ``ok`` None, never a guess, and one
  ``model`` row says why. Such a row is NOT a pass: ``unjudged(rows)`` lists the reasons,
  ``passed`` is False while there is one, and ``verify --against-plan`` exits 2 with the reason
  (commands/run.py). Only ``activations_fused`` and ``payload/wire:send_meta`` are reported
  without a verdict by design (``REPORTED_ONLY``: a comparison figure and torch's shape messages).

Rows: ``{"quantity", "axis", "tier", "rank", "unit", "predicted", "measured", "ok", "why"}``;
``why`` is None on a judged row, ``"reported only"`` on a row of ``REPORTED_ONLY``, else
``"not modelled: ..."``.
"""

from __future__ import annotations

import torch.distributed as dist

from modelcarve.plan.predict.activations import recompute_unchecked
from modelcarve.plan.predict.moe_traffic import forecast_rank
from modelcarve.plan.predict.step_traffic import NotModelled
from modelcarve.runtime.distributed import collectives
from modelcarve.runtime.measure.memory_report import SavedActivations, held_grads, optimizer_bytes, param_bytes

ACTIVATION_TOLERANCE = 0.10
EXACT = ("params", "grads", "optimizer", "comm_buffers")
_META = {"int32", "int64", "uint8", "bool"}
REPORTED_ONLY = "reported only"


class AgainstPlan:
    def __init__(self, trainer, spec, layout):
        self.trainer, self.spec, self.layout = trainer, spec, layout
        self.events: list = []
        self.mem: dict = {}
        self.routing: list = []
        """Rows per global expert this rank's router sent, per EP dispatcher call (moe_traffic.py)."""

    def forward_backward(self, tokens, targets):
        with collectives.CommLog(self.layout) as log, SavedActivations(self.trainer.chunks) as acts, \
                _RecordRouting(self.trainer.chunks, self.routing):
            loss = self.trainer.forward_backward(tokens, targets)
        self.events += log.events
        self.mem["activations"] = acts.peak
        self.mem["grads"] = held_grads(self.trainer.chunks, self.trainer.optimizer)
        runner = getattr(self.trainer, "runner", None)
        if runner is not None and not hasattr(self, "order"):  # the schedule's executed actions, first step
            self.order = [(a.kind, a.stage, a.microbatch) for a in runner.actions]
        return loss

    def optimizer_step(self):
        with collectives.CommLog(self.layout) as log:
            norm = self.trainer.optimizer_step()
        self.events += log.events
        self.mem["params"] = param_bytes(self.trainer.chunks)
        self.mem["optimizer"] = optimizer_bytes(self.trainer.optimizer)
        self.mem["comm_buffers"] = max((e.payload for e in self.events if e.op != "recv"), default=0)
        return norm

    def stage_layers(self) -> int:
        return sum(len(c.layers) for c in self.trainer.chunks if getattr(c, "layers", None) is not None)

    def rows(self) -> list[dict]:
        rank, per_node = dist.get_rank(), collectives.ranks_per_node()
        measured = measured_bytes(self.events)
        routing = gather_routing(self.routing) if self.spec.is_moe and self.layout.ep > 1 else None
        try:
            pred = forecast_rank(self.spec, self.layout, rank, stage_layers=self.stage_layers(), routing=routing,
                                 order=getattr(self, "order", None))
            why = "not modelled: the per-op model predicts no figure for this quantity"
        except NotModelled as exc:
            pred, why = None, str(exc)
        predicted = predicted_bytes(pred.messages, self.layout, rank, per_node) if pred else {}
        out = []
        for key in sorted(set(measured) | set(predicted)):
            quantity, axis, tier = key
            p, m = predicted.get(key, 0 if pred else None), measured.get(key, 0)
            if quantity.endswith("send_meta"):  # torch's shape messages: reported, never predicted
                out.append(_row(quantity, axis, tier, rank, p, m, None, REPORTED_ONLY))
                continue
            ok = (abs(p - m) <= 1e-6 * max(abs(m), 1.0)) if p is not None else None
            out.append(_row(quantity, axis, tier, rank, p, m, ok, None if ok is not None else why))
        for name in ("params", "grads", "optimizer", "activations", "comm_buffers"):
            p, m = (pred.memory[name] if pred else None), self.mem.get(name, 0)
            ok = None
            if p is not None and m is not None:
                ok = (p == m) if name in EXACT else abs(p - m) <= ACTIVATION_TOLERANCE * max(m, 1)
            if ok is None and pred is not None and name == "activations":
                unchecked = recompute_unchecked(self.spec, self.layout)
                why_here = (f"not modelled: saved activations with {unchecked}" if unchecked
                            else "not modelled: saved activations under the zero-bubble schedule" if self.layout.schedule == "zero-bubble"
                            else "not modelled: saved activations of this layer kind")
            else:
                why_here = why
            out.append(_row(name, "-", "-", rank, p, m, ok, None if ok is not None else why_here))
        if pred is not None:  # the training planner's production-stack estimate, for comparison only
            out.append(_row("activations_fused", "-", "-", rank, pred.memory["activations_fused"], self.mem.get("activations"),
                            None, REPORTED_ONLY))
        if pred is not None and "all_to_all_apriori" in pred.memory:  # uniform routing x the planner's imbalance
            measured_a2a = sum(v for (q, _, _), v in measured.items() if q == "payload:all_to_all")
            out.append(_row("payload:all_to_all_apriori", "-", "-", rank, pred.memory["all_to_all_apriori"],
                            measured_a2a, None, REPORTED_ONLY))
        if pred is None:
            out.append(_row("model", why, "-", rank, None, None, None, why, unit="-"))
        return out


def _row(quantity, axis, tier, rank, predicted, measured, ok, why=None, unit="bytes") -> dict:
    return dict(quantity=quantity, axis=axis, tier=tier, rank=rank, unit=unit, predicted=predicted,
                measured=measured, ok=ok, why=why)


def measured_bytes(events) -> dict:
    """{(quantity, axis, tier): bytes} from CommLog events (receives carry no bytes)."""
    out: dict = {}
    for e in events:
        if e.op == "recv":
            continue
        op = "send_meta" if e.op == "send" and e.dtype in _META else e.op
        for kind, value in (("payload", e.payload), ("wire", e.wire)):
            key = (f"{kind}:{op}", e.axis, e.tier)
            out[key] = out.get(key, 0) + value
    return out


def predicted_bytes(messages, layout, rank: int, per_node: int) -> dict:
    """The planner's messages keyed as :func:`measured_bytes` keys the runtime's (same axis
    names and tiers: collectives.axis_of / tier_of of the predicted group)."""
    out: dict = {}
    for msg in messages:
        if msg.op == "send":
            peer = msg.group[1]
            axis, tier = collectives.axis_of((rank, peer), layout), collectives.tier_of([peer], per_node, rank)
        else:
            axis, tier = collectives.axis_of(msg.group, layout), collectives.tier_of(msg.group, per_node)
        for kind, value in (("payload", msg.payload * msg.calls), ("wire", msg.wire())):
            key = (f"{kind}:{msg.op}", axis, tier)
            out[key] = out.get(key, 0) + value
    return out


class _RecordRouting:
    """Context manager: every EP dispatcher of ``chunks`` wrapped to append the ``[E]`` row counts
    its router sends (``counts`` of runtime/parallel/expert.py's ``AllToAllDispatcher``) to
    ``calls``, once per forward (not again in a recomputation); unwrapped on exit. Reads only."""

    def __init__(self, chunks, calls: list):
        self.chunks, self.calls, self.saved = chunks, calls, []

    def __enter__(self):
        from modelcarve.runtime.model.moe import in_backward
        from modelcarve.runtime.parallel.expert import moe_blocks

        for chunk in self.chunks:
            for _, moe in moe_blocks(chunk):
                if moe.dispatcher is None:
                    continue
                inner = moe.dispatcher
                self.saved.append((moe, inner))

                def recording(x_sorted, counts, experts, __inner=inner):
                    if not in_backward():
                        self.calls.append([int(c) for c in counts.tolist()])
                    return __inner(x_sorted, counts, experts)

                moe.dispatcher = recording
        return self

    def __exit__(self, *exc):
        for moe, inner in self.saved:
            moe.dispatcher = inner
        return False


def gather_routing(calls: list) -> dict:
    """``{global rank: its recorded dispatcher counts}`` on every rank (collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, calls)
    return dict(enumerate(everyone))


def gather_rows(rows: list[dict]) -> list[dict] | None:
    """Every rank's rows on rank 0 (None elsewhere)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    return [r for part in everyone for r in part] if dist.get_rank() == 0 else None


def unjudged(rows: list[dict]) -> list[str]:
    """The distinct reasons rows could not be judged (a row with no verdict that is not reported
    only by design); empty when every row got a verdict."""
    out: list[str] = []
    for r in rows:
        if r["ok"] is None and r.get("why") != REPORTED_ONLY:
            reason = r.get("why") or f"not modelled: {r['quantity']}"
            if reason not in out:
                out.append(reason)
    return out


def passed(rows: list[dict]) -> bool:
    """Every row within its bound and every row judged: a row that cannot be judged is no pass."""
    return all(r["ok"] is not False for r in rows) and not unjudged(rows)
