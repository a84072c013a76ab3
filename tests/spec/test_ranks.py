"""The one rank order (spec/ranks.py) and the places that read it.

The attention mesh's order is checked against torch's own ``DeviceMesh`` layout (the runtime
builds ``arange(world).reshape(pp, dp, cp, tp)``); the expert mesh against the formulas of
spec/layout.py's module doc, written out by hand here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from modelcarve.spec import ranks
from modelcarve.spec.layout import Layout

LAYOUTS = [
    "dp=1", "tp=2", "pp=2,tp=2", "dp=2,cp=2,tp=2", "pp=3,dp=2,tp=2", "pp=2,dp=4,cp=1,tp=1,ep=2",
    "pp=2,dp=2,cp=2,tp=2,ep=4", "tp=2,dp=4,ep=8,etp=1", "pp=2,tp=2,dp=2,ep=4,etp=1", "tp=4,dp=2,ep=2,etp=2",
]


@pytest.mark.parametrize("text", LAYOUTS)
def test_coords_are_torch_mesh_coordinates(text):
    layout = Layout.parse(text)
    grid = torch.arange(layout.world_size).reshape(layout.pp, layout.dp, layout.cp, layout.tp)
    for p, d, c, t in itertools.product(*(range(getattr(layout, a)) for a in ranks.MESH_AXES)):
        rank = int(grid[p, d, c, t])
        assert layout.rank_of(pp=p, dp=d, cp=c, tp=t) == rank
        assert layout.coords(rank) == {"pp": p, "dp": d, "cp": c, "tp": t}


@pytest.mark.parametrize("text", LAYOUTS)
def test_groups_along_an_axis_are_the_mesh_slices(text):
    layout = Layout.parse(text)
    grid = torch.arange(layout.world_size).reshape(layout.pp, layout.dp, layout.cp, layout.tp)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        index = [c[a] for a in ranks.MESH_AXES]
        for dim, axis in enumerate(ranks.MESH_AXES):
            index_all = list(index)
            index_all[dim] = slice(None)
            assert ranks.group_along(layout, rank, axis) == tuple(int(r) for r in grid[tuple(index_all)])
        # joined axes (the data-parallel group of a cp layout): the mesh slice over both dims
        dp_cp = [c["pp"], slice(None), slice(None), c["tp"]]
        assert ranks.group_along(layout, rank, "dp_cp") == tuple(int(r) for r in grid[tuple(dp_cp)].flatten())
        assert ranks.group_along(layout, rank, "world") == tuple(range(layout.world_size))


@pytest.mark.parametrize("text", [t for t in LAYOUTS if "ep=" in t])
def test_expert_mesh_matches_the_documented_formulas(text):
    layout = Layout.parse(text)
    S, etp, ep = layout.tp * layout.cp * layout.dp, layout.expert_tp, layout.ep
    for rank in range(layout.world_size):
        q = rank % S  # spec/layout.py: ETP innermost, then EP, then EDP, inside one pipeline stage
        want = {"pp": rank // S, "edp": q // (etp * ep), "ep": (q // etp) % ep, "etp": q % etp}
        assert ranks.expert_coords(layout, rank) == want
        assert ranks.expert_rank(layout, **want) == rank
        if not layout.folded:  # unfolded: EP is ep consecutive dp x cp indices at one tp rank
            c = layout.coords(rank)
            f = c["dp"] * layout.cp + c["cp"]
            assert (want["ep"], want["edp"], want["etp"]) == (f % ep, f // ep, c["tp"])
    sizes = {"etp": etp, "ep": ep, "edp": layout.expert_dp}
    for axis, size in sizes.items():
        groups = {ranks.expert_group_along(layout, r, axis) for r in range(layout.world_size)}
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))  # a partition


def test_hand_worked_ranks():
    # pp=2, dp=2, cp=2, tp=2: rank = ((pp*2 + dp)*2 + cp)*2 + tp
    layout = Layout.parse("pp=2,dp=2,cp=2,tp=2")
    assert layout.rank_of(pp=1, dp=0, cp=1, tp=1) == ((1 * 2 + 0) * 2 + 1) * 2 + 1 == 11
    assert layout.coords(11) == {"pp": 1, "dp": 0, "cp": 1, "tp": 1}
    assert ranks.group_along(layout, 11, "dp") == (11, 15)
    # tp=2, dp=4, ep=8, etp=1 (folding): the 8 ranks of the stage are one EP group
    folded = Layout.parse("tp=2,dp=4,ep=8,etp=1")
    assert ranks.expert_group_along(folded, 5, "ep") == tuple(range(8))
    with pytest.raises(ValueError, match="outside"):
        layout.coords(16)


def test_the_comm_log_and_the_planner_name_axes_by_the_same_order():
    from modelcarve.plan.predict import step_traffic
    from modelcarve.runtime.distributed.collectives import axis_of

    layout = Layout.parse("pp=2,dp=2,tp=2")
    for rank in range(layout.world_size):
        for axis in ("tp", "dp", "pp"):
            assert axis_of(step_traffic.group_along(layout, rank, axis), layout) == axis
