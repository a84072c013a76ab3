"""Mesh and harness: rank -> axis coordinates, group timeouts, a dead rank fails the others fast."""

import time

import pytest

from dist import DistError, run_distributed


def _mesh_worker(layout_text):
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.mesh import axis_group, axis_rank, axis_size, build_mesh, merged_mesh
    from modelcarve.spec.layout import Layout

    layout = Layout.parse(layout_text)
    mesh = build_mesh(layout)
    coords = {a: axis_rank(mesh, a) for a in ("pp", "dp", "cp", "tp")}
    sizes = {a: axis_size(mesh, a) for a in ("pp", "dp", "cp", "tp")}
    # a collective on the tp group sums the tp ranks holding our (pp, dp, cp) coordinate
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=axis_group(mesh, "tp"))
    dpcp = merged_mesh(mesh, "dp_cp")
    hsdp = merged_mesh(mesh, "dp", hsdp_shard=1) if layout.dp > 1 else None
    return dict(
        rank=dist.get_rank(), coords=coords, sizes=sizes, tp_sum=t.item(),
        dpcp=(dpcp.size(0), dpcp.get_local_rank(0)),
        hsdp=None if hsdp is None else tuple(hsdp.shape),
    )


def test_mesh_order_tp_innermost():
    out = run_distributed(_mesh_worker, 8, "tp=2,dp=2,pp=2", timeout=120)
    for r, res in enumerate(out):
        pp_i, rem = divmod(r, 4)
        dp_i, tp_i = divmod(rem, 2)
        assert res["coords"] == dict(pp=pp_i, dp=dp_i, cp=0, tp=tp_i)
        assert res["sizes"] == dict(pp=2, dp=2, cp=1, tp=2)
        base = r - tp_i
        assert res["tp_sum"] == base + base + 1
        assert res["dpcp"] == (2, dp_i)
        assert res["hsdp"] == (2, 1)


def _dies(kill_rank):
    import os

    import torch
    import torch.distributed as dist

    from modelcarve.runtime.mesh import axis_group, build_mesh
    from modelcarve.spec.layout import Layout

    mesh = build_mesh(Layout.parse("tp=2"))
    if dist.get_rank() == kill_rank:
        os._exit(3)  # a crash, no goodbye
    t = torch.ones(4)
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=axis_group(mesh, "tp"))
    except Exception as err:  # noqa: BLE001
        raise RuntimeError(f"collective failed after {time.monotonic() - start:.1f}s: {type(err).__name__}") from None
    return "no error"


def test_dead_rank_fails_others_within_timeout():
    start = time.monotonic()
    with pytest.raises(DistError) as info:
        run_distributed(_dies, 2, 1, timeout=90, collective_s=5, grace_s=40)
    elapsed = time.monotonic() - start
    errors = info.value.errors
    assert "exit code 3" in errors[1]
    assert "collective failed after" in errors[0], errors[0]
    assert elapsed < 60
