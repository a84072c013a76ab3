"""Every collective a rank issues, seen in one place and counted: op, axis, group, dtype, bytes, tier.

All of torch.distributed's traffic reaches the dispatcher as one of a few ops: ``c10d.*`` for
the eager API (our own ``dist.all_reduce`` / ``all_to_all_single`` / ``reduce_scatter_tensor``
calls however they were bound, FSDP2's all-gathers and reduce-scatters, ZeRO-1's broadcasts,
pipelining's and ring attention's ``send`` / ``recv_``) and ``_c10d_functional.*`` for DTensor
and functional collectives. ``CommLog`` is a ``TorchDispatchMode`` that records each of them
once, in the forward and in the backward (the autograd engine carries the mode into backward),
before the op runs; the op itself is then executed unchanged. Operations on tensor subclasses
(DTensor) are handed back to the subclass (``NotImplemented``), which re-dispatches the plain
collectives it issues, so nothing is counted twice.

One event (``Event``) per op: ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all,
broadcast, send, recv), the group's global ranks, ``axis`` (named from the layout's varying axes,
``axis_of``; never ``world``),
``dtype``, ``payload`` bytes and ``wire`` bytes this rank sends under the algorithm
(plan/cost/comm.py's formulas: ring all-reduce ``2(n-1)/n S``; all-gather ``(n-1)/n S`` of the gathered
size; reduce-scatter ``(n-1)/n S`` of the input; all-to-all the rows bound for other ranks,
exactly, from the splits; broadcast ``(n-1)/n S`` (a chain, averaged over ranks); a send ``S``),
and ``tier``: ``intra`` when every member sits on this rank's node under ``ranks_per_node``
(rank r on node ``r // ranks_per_node``), else ``inter``. A point-to-point message is counted
once, by its sender (``recv`` events carry ``payload`` for the order check but no bytes in the
totals).

``ranks_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE`` (one node); ``configure`` sets it
(``modelcarve run --ranks-per-node K``) so a one-machine run accounts as K ranks per node would.

Usage::

    with CommLog(layout) as log:
        trainer.step(tokens, targets)
    log.table()     # {"all_reduce/dp_cp/intra": {"calls", "payload", "wire"}, ...}
    log.sequence()  # [(op, group ranks, shapes, dtype), ...] in issue order (order checks)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from modelcarve.plan.cost.comm import all_gather_bytes, reduce_scatter_bytes, ring_all_reduce_bytes
from modelcarve.spec.ranks import MESH_AXES, coords, expert_group_along

_state: dict = {"ranks_per_node": None}

AXES = MESH_AXES


def configure(ranks_per_node: int | None = None) -> None:
    """Account traffic as ``ranks_per_node`` ranks per node (None: torchrun's local world size)."""
    _state["ranks_per_node"] = int(ranks_per_node) if ranks_per_node else None


def ranks_per_node() -> int:
    if _state["ranks_per_node"]:
        return _state["ranks_per_node"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def tier_of(ranks, per_node: int, me: int | None = None) -> str:
    """'intra' when every rank of ``ranks`` (and ``me``) is on one node of ``per_node`` ranks."""
    nodes = {r // per_node for r in ranks} | ({me // per_node} if me is not None else set())
    return "intra" if len(nodes) <= 1 else "inter"


def axis_of(ranks, layout) -> str:
    """The layout axes a group spans, named by the mesh axes whose coordinate varies over it, in
    mesh order joined by '_': 'tp', 'pp', 'dp', 'dp_cp', 'pp_dp_cp_tp', ...; 'etp', 'ep', 'edp' for a
    group of the expert mesh that is no whole attention axis (spec/ranks.py ``expert_group_along``),
    'dp_cp_shard' / 'dp_cp_replicate' for the other sub-groups of the dp x cp ranks, '<axes>_sub' for
    another sub-group (e.g. a tied embedding's first and last stage when pp > 2), 'self' for one
    rank. Never 'world': a group over every rank is named by what varies over it (on ``tp=2``
    over 2 ranks the world is the tp group, 'tp'; the gradient norm's all-reduce on ``pp=2,tp=2``
    is 'pp_tp'), so a row says which parallelism moved its bytes."""
    ranks = sorted(ranks)
    if layout is None:
        return "?"
    if len(ranks) == 1:
        return "self"
    cs = [coords(layout, r) for r in ranks]
    varying = [a for a in AXES if len({c[a] for c in cs}) > 1]
    full = 1
    for a in varying:
        full *= getattr(layout, a)
    name = "_".join(varying)
    if len(ranks) == full:
        return name
    if layout.ep > 1:  # a group of the expert mesh (spec/ranks.py: EDP x EP x ETP per stage), by its own axes
        for axis in ("etp", "ep", "edp"):
            if sorted(expert_group_along(layout, ranks[0], axis)) == ranks:
                return axis
    if set(varying) <= {"dp", "cp"}:  # another sub-group of the dp x cp ranks (HSDP's shard / replicate)
        return "dp_cp_shard" if _consecutive_f(cs, layout) else "dp_cp_replicate"
    return name + "_sub"


def _consecutive_f(cs, layout) -> bool:
    f = sorted(c["dp"] * layout.cp + c["cp"] for c in cs)
    return f == list(range(f[0], f[0] + len(f)))


@dataclass
class Event:
    op: str
    ranks: tuple
    axis: str
    tier: str
    dtype: str
    shapes: tuple
    payload: int
    wire: float
    peer: int | None = None


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _flat(t) -> list:
    if isinstance(t, torch.Tensor):
        return [t]
    if isinstance(t, (list, tuple)):
        return [y for x in t for y in _flat(x)]
    return []


_RANKS: dict = {}


def _group_ranks(pg) -> tuple:
    if isinstance(pg, str):  # functional collectives name their group
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(pg)
    elif not isinstance(pg, dist.ProcessGroup):
        pg = dist.ProcessGroup.unbox(pg)
    key = id(pg)
    if key not in _RANKS:
        _RANKS[key] = (pg, tuple(dist.get_process_group_ranks(pg)))
    return _RANKS[key][1]


def _ops() -> dict:
    """dispatcher op -> (name, index of the group argument, how to read the payload)."""
    c, f = torch.ops.c10d, torch.ops._c10d_functional
    table = {
        "allreduce_": ("all_reduce", 1, "arg0"),
        "allreduce_coalesced_": ("all_reduce", 1, "arg0"),
        "_allgather_base_": ("all_gather", 2, "arg0"),
        "allgather_": ("all_gather", 2, "arg0"),
        "allgather_into_tensor_coalesced_": ("all_gather", 2, "arg0"),
        "allgather_coalesced_": ("all_gather", 2, "arg0"),
        "_reduce_scatter_base_": ("reduce_scatter", 2, "arg1"),
        "reduce_scatter_": ("reduce_scatter", 2, "arg1"),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, "arg1"),
        "alltoall_base_": ("all_to_all", 2, "a2a_base"),
        "alltoall_": ("all_to_all", 2, "a2a_list"),
        "broadcast_": ("broadcast", 1, "arg0"),
        "send": ("send", 1, "arg0"),
        "recv_": ("recv", 1, "arg0"),
    }
    ops = {}
    for name, spec in table.items():
        op = getattr(c, name, None)
        if op is not None:
            ops[op.default] = spec
    functional = {
        "all_reduce": ("all_reduce", 2, "arg0"),
        "all_reduce_coalesced": ("all_reduce", 2, "arg0"),
        "all_gather_into_tensor": ("all_gather", 2, "gather"),
        "all_gather_into_tensor_coalesced": ("all_gather", 2, "gather"),
        "reduce_scatter_tensor": ("reduce_scatter", 3, "arg0"),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3, "arg0"),
        "all_to_all_single": ("all_to_all", 3, "a2a_func"),
        "broadcast": ("broadcast", 2, "arg0"),
    }
    for name, spec in functional.items():
        op = getattr(f, name, None)
        if op is not None:
            ops[op.default] = spec
    return ops


def _wire(op: str, payload: int, n: int, sent_to_others: int | None) -> float:
    if op == "all_reduce":
        return ring_all_reduce_bytes(payload, n)
    if op == "all_gather":
        return all_gather_bytes(payload, n)
    if op in ("reduce_scatter", "broadcast"):
        return reduce_scatter_bytes(payload, n)
    if op == "all_to_all":
        return float(sent_to_others)
    if op == "send":
        return float(payload)
    return 0.0


def _own_dispatch(cls) -> bool:
    """A tensor subclass with its own ``__torch_dispatch__`` (DTensor, AsyncCollectiveTensor);
    not ``nn.Parameter``, which has none, nor the FakeTensor of a sharding propagation."""
    from torch._subclasses.fake_tensor import FakeTensor

    if issubclass(cls, FakeTensor):  # DTensor's sharding propagation: shapes only, no collective
        return False
    impl = getattr(cls, "__torch_dispatch__", None)
    return impl is not None and getattr(impl, "__func__", impl) is not torch._C._disabled_torch_dispatch_impl


class CommLog(TorchDispatchMode):
    """Records every collective issued while active (see the module doc)."""

    def __init__(self, layout=None, per_node: int | None = None):
        super().__init__()
        self.layout = layout
        self.per_node = per_node
        self.events: list[Event] = []
        self._ops = _ops()

    def __enter__(self):
        self.per_node = self.per_node or ranks_per_node()
        self.me = dist.get_rank() if dist.is_initialized() else 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_own_dispatch(t) for t in types):
            return NotImplemented  # DTensor & co: they re-dispatch their plain collectives
        spec = self._ops.get(func)
        if spec is not None:
            self._record(spec, args)
        return func(*args, **kwargs)

    def _record(self, spec, args) -> None:
        op, group_at, how = spec
        ranks = _group_ranks(args[group_at])
        n = len(ranks)
        sent_to_others = None
        if how == "arg1":
            payload, tensors = _nbytes(args[1]), _flat(args[1])
        elif how == "gather":  # functional all-gather: the input times the group size
            payload, tensors = _nbytes(args[0]) * int(args[1]), _flat(args[0])
        elif how in ("a2a_base", "a2a_func"):
            x = args[1] if how == "a2a_base" else args[0]
            in_splits = args[4] if how == "a2a_base" else args[2]
            payload, tensors = _nbytes(x), [x]
            row = _nbytes(x) // max(1, x.shape[0]) if x.dim() else 0
            mine = ranks.index(self.me) if self.me in ranks else 0
            own = in_splits[mine] * row if in_splits else payload // n
            sent_to_others = payload - own
        elif how == "a2a_list":
            inputs = list(args[1])
            payload, tensors = _nbytes(inputs), inputs
            mine = ranks.index(self.me) if self.me in ranks else 0
            sent_to_others = payload - _nbytes(inputs[mine])
        else:
            payload, tensors = _nbytes(args[0]), _flat(args[0])
        peer = None
        if op in ("send", "recv"):
            peer = ranks[int(args[2])]
            group_ranks = (self.me, peer)
            tier = tier_of([peer], self.per_node, self.me)
        else:
            group_ranks = ranks
            tier = tier_of(ranks, self.per_node)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "?"
        self.events.append(Event(
            op=op, ranks=tuple(group_ranks), axis=axis_of(group_ranks, self.layout), tier=tier, dtype=dtype,
            shapes=tuple(tuple(t.shape) for t in tensors), payload=payload,
            wire=_wire(op, payload, n, sent_to_others), peer=peer))

    # --- summaries ------------------------------------------------------------------------

    def table(self) -> dict:
        """{"op/axis/tier": {"calls", "payload", "wire"}} (recv: calls only, its bytes are the sender's)."""
        out: dict = {}
        for e in self.events:
            row = out.setdefault(f"{e.op}/{e.axis}/{e.tier}", {"calls": 0, "payload": 0, "wire": 0.0})
            row["calls"] += 1
            if e.op != "recv":
                row["payload"] += e.payload
                row["wire"] += e.wire
        return dict(sorted(out.items()))

    def by(self, key: str) -> dict:
        """Payload bytes summed by one field: 'op', 'axis', 'tier' or 'dtype' (recv excluded)."""
        out: dict = {}
        for e in self.events:
            if e.op != "recv":
                out[getattr(e, key)] = out.get(getattr(e, key), 0) + e.payload
        return out

    @property
    def payload(self) -> int:
        return sum(e.payload for e in self.events if e.op != "recv")

    @property
    def wire(self) -> float:
        return sum(e.wire for e in self.events if e.op != "recv")

    def sequence(self) -> list[tuple]:
        """(op, group ranks, shapes, dtype) in issue order: what the order check compares."""
        return [(e.op, e.ranks, e.shapes, e.dtype) for e in self.events]


# --- the collective-order check ------------------------------------------------------------


def _describe(event: tuple) -> str:
    op, ranks, shapes, dtype = event
    return f"{op} over ranks {list(ranks)} of {dtype} {[list(s) for s in shapes]}"


def check_order(sequences: dict) -> None:
    """Refuse (LayoutError) a program whose ranks would not issue their collectives in one order.

    ``sequences``: rank -> ``CommLog.sequence()`` of that rank (e.g. recorded under torch's fake
    process group, no devices). Blocking collectives deadlock unless every two ranks issue the
    collectives of the groups they share in the same order with the same shapes; so for each
    pair of ranks the events over groups holding both must be equal, one by one. A message must
    meet its receive: rank i's sends to j and j's receives from i agree in number and shape.
    The error names the two ranks and the first collective where they disagree."""
    from modelcarve.spec.errors import LayoutError

    ranks = sorted(sequences)
    for a_i, a in enumerate(ranks):
        for b in ranks[a_i + 1:]:
            both = [[e for e in sequences[r] if e[0] not in ("send", "recv") and a in e[1] and b in e[1]]
                    for r in (a, b)]
            for i in range(max(len(both[0]), len(both[1]))):
                ea = both[0][i] if i < len(both[0]) else None
                eb = both[1][i] if i < len(both[1]) else None
                if ea != eb:
                    raise LayoutError(
                        f"ranks {a} and {b} would deadlock: their collective #{i + 1} in common differs "
                        f"(rank {a}: {_describe(ea) if ea else 'nothing'}; rank {b}: {_describe(eb) if eb else 'nothing'}); "
                        f"the layout's groups are used in a different order on different ranks")
            for src, dst in ((a, b), (b, a)):
                sent = [e[2] for e in sequences[src] if e[0] == "send" and e[1] == (src, dst)]
                got = [e[2] for e in sequences[dst] if e[0] == "recv" and e[1] == (dst, src)]
                if sent != got:
                    raise LayoutError(
                        f"rank {src} sends {len(sent)} messages to rank {dst} which receives {len(got)} "
                        f"(shapes {sent[:3]} vs {got[:3]}): the pipeline's sends and receives do not pair")
