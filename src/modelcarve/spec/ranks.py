"""The one rank order: a global rank <-> its coordinates on a layout's meshes, for the planner and the runtime alike.

The attention mesh is ``("pp", "dp", "cp", "tp")``, PP outermost and TP innermost (neighbouring
ranks, one node)::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

The expert mesh (MoE; spec/layout.py's module doc) covers the same ``S = tp x cp x dp`` ranks of
each pipeline stage as ``("edp", "ep", "etp")``, ETP innermost::

    rank = pp_i * S + (edp_i * ep + ep_i) * etp + etp_i

With ``etp = tp`` (the unfolded layout: EP carved out of ``dp x cp``) this is the same order as
the attention mesh's, the EP group being ``ep`` consecutive ``dp x cp`` indices at one ``tp_i``.

Everything that maps ranks to axes reads these functions: the runtime's device mesh
(runtime/distributed/mesh.py builds ``arange(world).reshape(pp, dp, cp, tp)``, which is this
order; tests/spec/test_ranks.py checks it), the expert-parallel groups (runtime/parallel/expert.py), the
engine's replicas (runtime/engine/model_runner.py), the comm log's axis names
(runtime/distributed/collectives.py) and the planner's per-rank traffic forecast
(plan/predict/step_traffic.py). Pure Python: no torch.
"""

from __future__ import annotations

from itertools import product
from typing import Protocol


class Layout(Protocol):
    """What these functions read of a ``spec.layout.Layout`` (no import: Layout's methods call here)."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int

    @property
    def world_size(self) -> int: ...
    @property
    def expert_tp(self) -> int: ...
    @property
    def expert_dp(self) -> int: ...
    def short(self) -> str: ...

MESH_AXES = ("pp", "dp", "cp", "tp")
"""The attention mesh's axes, outermost first."""
EXPERT_AXES = ("edp", "ep", "etp")
"""The expert mesh's axes inside one pipeline stage, outermost first."""


def coords(layout: "Layout", rank: int) -> dict[str, int]:
    """``{"pp", "dp", "cp", "tp"}`` coordinates of global ``rank``."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside 0..{layout.world_size - 1} for {layout.short()}")
    out = {}
    for axis in reversed(MESH_AXES):
        size = getattr(layout, axis)
        out[axis] = rank % size
        rank //= size
    return {axis: out[axis] for axis in MESH_AXES}


def rank_of(layout: "Layout", pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """The global rank at these attention-mesh coordinates (the inverse of :func:`coords`)."""
    return ((pp * layout.dp + dp) * layout.cp + cp) * layout.tp + tp


def group_along(layout: "Layout", rank: int, axis: str) -> tuple[int, ...]:
    """Global ranks of ``rank``'s group along one mesh axis (``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``),
    along several joined by ``_`` in mesh order (``"dp_cp"``: the data-parallel group of a
    context-parallel layout, the runtime's merged ``dp_cp`` mesh), or every rank for ``"world"``;
    in axis order (ascending for axes given in mesh order)."""
    if axis == "world":
        return tuple(range(layout.world_size))
    c = coords(layout, rank)
    names = axis.split("_")
    return tuple(rank_of(layout, **(c | dict(zip(names, index))))
                 for index in product(*(range(getattr(layout, name)) for name in names)))


def stage_size(layout: "Layout") -> int:
    """Ranks of one pipeline stage: ``tp x cp x dp``."""
    return layout.tp * layout.cp * layout.dp


def expert_coords(layout: "Layout", rank: int) -> dict[str, int]:
    """``{"pp", "edp", "ep", "etp"}`` coordinates of global ``rank`` on the expert mesh."""
    per_stage, etp, ep = stage_size(layout), layout.expert_tp, layout.ep
    q = rank % per_stage
    return {"pp": rank // per_stage, "edp": q // (etp * ep), "ep": (q // etp) % ep, "etp": q % etp}


def expert_rank(layout: "Layout", pp: int = 0, edp: int = 0, ep: int = 0, etp: int = 0) -> int:
    """The global rank at these expert-mesh coordinates (the inverse of :func:`expert_coords`)."""
    return pp * stage_size(layout) + (edp * layout.ep + ep) * layout.expert_tp + etp


def expert_group_along(layout: "Layout", rank: int, axis: str) -> tuple[int, ...]:
    """Global ranks of ``rank``'s expert-mesh group along ``"etp"``, ``"ep"`` or ``"edp"``."""
    c = expert_coords(layout, rank)
    size = {"etp": layout.expert_tp, "ep": layout.ep, "edp": layout.expert_dp}[axis]
    return tuple(expert_rank(layout, **(c | {axis: i})) for i in range(size))
