"""Mesh and harness: rank -> axis coordinates; a rank that dies or stalls makes the others exit
with one clear line within the collective timeout (set short here), never hang."""

import time

import pytest

from dist import DistError, run_distributed


def _mesh_worker(layouts):
    import torch
    import torch.distributed as dist

    from modelcarve.runtime.distributed.mesh import axis_group, axis_rank, axis_size, build_mesh, merged_mesh
    from modelcarve.spec.layout import Layout

    out = []
    for text in layouts:
        layout = Layout.parse(text)
        mesh = build_mesh(layout)
        coords = {a: axis_rank(mesh, a) for a in ("pp", "dp", "cp", "tp")}
        sizes = {a: axis_size(mesh, a) for a in ("pp", "dp", "cp", "tp")}
        # a collective on each axis group sums the ranks that share our other coordinates
        sums = {}
        for axis in ("pp", "dp", "tp"):
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=axis_group(mesh, axis))
            sums[axis] = t.item()
        dpcp = merged_mesh(mesh, "dp_cp")
        hsdp = merged_mesh(mesh, "dp", hsdp_shard=1) if layout.dp > 1 else None
        out.append(dict(coords=coords, sizes=sizes, sums=sums, dpcp=(dpcp.size(0), dpcp.get_local_rank(0)),
                        hsdp=None if hsdp is None else tuple(hsdp.shape)))
    return out


LAYOUTS = {"tp=2,dp=2": (1, 2, 2), "tp=2,pp=2": (2, 1, 2), "dp=2,pp=2": (2, 2, 1)}


def test_mesh_order_tp_innermost():
    """rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i, as spec/layout.py states."""
    results = run_distributed(_mesh_worker, 4, list(LAYOUTS), timeout=120)
    for i, (text, (pp, dp, tp)) in enumerate(LAYOUTS.items()):
        for r, per_rank in enumerate(results):
            res = per_rank[i]
            pp_i, rem = divmod(r, dp * tp)
            dp_i, tp_i = divmod(rem, tp)
            assert res["coords"] == dict(pp=pp_i, dp=dp_i, cp=0, tp=tp_i), text
            assert res["sizes"] == dict(pp=pp, dp=dp, cp=1, tp=tp), text
            rank_of = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731
            assert res["sums"]["tp"] == sum(rank_of(pp_i, dp_i, t) for t in range(tp)), text
            assert res["sums"]["dp"] == sum(rank_of(pp_i, d, tp_i) for d in range(dp)), text
            assert res["sums"]["pp"] == sum(rank_of(p, dp_i, tp_i) for p in range(pp)), text
            assert res["dpcp"] == (dp, dp_i), text
            assert res["hsdp"] == (None if dp == 1 else (dp, 1)), text


def _fault_during_run(tmp, bad_rank, mode):
    import json
    import os
    import sys

    rank = int(os.environ["RANK"])
    sys.stderr = open(f"{tmp}/err{rank}.txt", "w", buffering=1)
    if rank == bad_rank:
        # from the third training step on, the bad rank crashes ("die") or stops taking part
        # ("stall": its main thread sleeps). Counted in steps, not seconds: a timer could fire
        # before the process group exists on a loaded machine, which is another failure.
        import modelcarve.runtime.train.trainer as train

        original = train.Trainer.step
        calls = {"n": 0}

        def step(self, *a, **k):
            calls["n"] += 1
            if calls["n"] > 2:
                if mode == "die":
                    os._exit(3)
                time.sleep(1e6)
            return original(self, *a, **k)

        train.Trainer.step = step
    from modelcarve.runtime.train.launch import main

    payload = dict(model="tiny-llama", layout="tp=2,seq=32,gbs=2", steps=100000, quiet=True, timeout_s=5)
    return main(["run", json.dumps(payload)])


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_launch_exits_with_clear_error_when_a_rank_fails(tmp_path, mode):
    with pytest.raises(DistError) as info:
        run_distributed(_fault_during_run, 2, str(tmp_path), 1, mode, timeout=120, collective_s=5, grace_s=8)
    # the healthy rank left on its own, with code 1 (a stalled rank is killed by the harness, and
    # so would a hung healthy rank be, with another code): no wall-clock assertion needed
    assert "exit code 1" in info.value.errors[0]
    line = (tmp_path / "err0.txt").read_text().strip().splitlines()[-1]
    assert line.startswith("modelcarve: rank 0: lost contact with another rank"), line
