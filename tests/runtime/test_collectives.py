"""collectives.CommLog: every collective counted once, with its axis, dtype, payload, wire bytes and tier.

One 4-rank gloo world (layout dp=2 x tp=2 for the axis names: ranks {0,1} and {2,3} are tp
groups, {0,2} and {1,3} dp groups), checks inside it:

* raw ops against hand-derived bytes: all-reduce of S on n ranks sends 2(n-1)/n S; all-gather
  (n-1)/n of the gathered size; reduce-scatter (n-1)/n of the input; an all-to-all with uneven
  splits sends exactly the rows bound for the other ranks; a message is counted once, at its
  sender (the receiver logs a recv with no bytes); a collective in an autograd backward is seen;
  a DTensor redistribute (functional collectives) is seen once;
* tiers under ``ranks_per_node=2``: the tp groups are intra-node, the dp groups inter-node;
* against torch's own counter (``CommDebugMode``, not ours): the same tp=2,sp,dp=2 training step
  gives the same number of calls per op, and the sequence-parallel reduce-scatters are counted;
* a pp=2 step: the sender's counted payload equals pipeline.py's own count of the tensors it
  handed to the schedule, and the receiver logs as many recvs as the sender sends;
* check_order accepts the sequences the four ranks really issued in both steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist.py
from dist import run_distributed  # noqa: E402


def _raw(out):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from modelcarve.runtime.distributed.collectives import CommLog
    from modelcarve.runtime.distributed.mesh import new_group
    from modelcarve.spec.layout import Layout

    layout = Layout.parse("dp=2,tp=2")
    me = dist.get_rank()
    tp_groups = [new_group([0, 1]), new_group([2, 3])]
    dp_groups = [new_group([0, 2]), new_group([1, 3])]
    tp, dp = tp_groups[me // 2], dp_groups[me % 2]
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    dx = distribute_tensor(x, mesh, [Shard(0)])
    with CommLog(layout, per_node=2) as log:
        dist.all_reduce(torch.ones(10), group=tp)  # 40 bytes, n=2: wire 40
        dist.all_reduce(torch.ones(6, dtype=torch.float64), group=dp)  # 48 bytes
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=tp)  # gathered 32, wire 16
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(12))  # world, input 48, wire 36
        dist.all_reduce(torch.ones(4))  # world all-reduce of 16 bytes: wire 2*3/4*16 = 24
        send = [me + 1, 3 - me, 2, 1][:4]  # rows for ranks 0..3, uneven
        recv_splits = torch.empty(4, dtype=torch.int64)
        dist.all_to_all_single(recv_splits, torch.tensor(send))
        rows = torch.ones(sum(send), 5)
        dist.all_to_all_single(torch.empty(int(recv_splits.sum()), 5), rows, recv_splits.tolist(), send)
        if me == 0:
            dist.send(torch.ones(7), 1)
        elif me == 1:
            dist.recv(torch.empty(7), 0)
        w = torch.ones(3, requires_grad=True)

        class Reduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                return a.clone()

            @staticmethod
            def backward(ctx, g):
                g = g.clone()
                dist.all_reduce(g, group=tp)
                return g

        Reduce.apply(w).sum().backward()
        full = dx.redistribute(mesh, [Replicate()]).to_local()
    assert torch.equal(full, x)
    out["events"] = [(e.op, e.axis, e.tier, e.dtype, e.payload, e.wire) for e in log.events]
    out["send"] = send


def _model_steps(out):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from modelcarve.runtime.checkpoint.hf_load import load_model
    from modelcarve.runtime.distributed.collectives import CommLog
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.parallel.parallelize import parallelize
    from modelcarve.runtime.train.trainer import TrainConfig, Trainer, make_data, seed_everything
    from modelcarve.spec.layout import Layout

    for name, text in (("tpsp", "tp=2,sp,dp=2,seq=16,gbs=2,mbs=1,param_dtype=fp32"),
                       ("pp", "pp=2,dp=2,seq=16,gbs=4,mbs=1,param_dtype=fp32")):
        layout = Layout.parse(text)
        seed_everything(0)
        mesh = build_mesh(layout)
        model, spec = load_model("tiny-llama", seed=0)
        trainer = Trainer(parallelize(model, layout, mesh), layout, mesh, TrainConfig())
        tokens, targets = make_data(None, spec.vocab_size, 0).batch(0, layout.global_batch, layout.seq)
        trainer.step(tokens, targets)
        with CommLog(layout) as log:
            trainer.step(tokens, targets)
        torch_counts = None
        if name == "tpsp":
            with CommDebugMode() as torch_mode:
                trainer.step(tokens, targets)
            torch_counts = {str(k): v for k, v in torch_mode.get_comm_counts().items()}
        sent = trainer.runner.sent_bytes if trainer.runner is not None else None
        out[name] = dict(events=[(e.op, e.axis, e.tier, e.dtype, e.payload) for e in log.events],
                         torch=torch_counts, pipeline_sent=sent, sequence=log.sequence())
        dist.barrier()


def _worker():
    out = {}
    _raw(out)
    _model_steps(out)
    return out


def _rows(events, op):
    return [e for e in events if e[0] == op]


def test_collectives_counted():
    results = run_distributed(_worker, 4, timeout=300)
    for me, res in enumerate(results):
        ev = res["events"]
        ar = _rows(ev, "all_reduce")
        assert ar[0] == ("all_reduce", "tp", "intra", "float32", 40, 40.0)
        assert ar[1] == ("all_reduce", "dp", "inter", "float64", 48, 48.0)
        assert ar[2] == ("all_reduce", "dp_tp", "inter", "float32", 16, 24.0)
        assert ar[3][:5] == ("all_reduce", "tp", "intra", "float32", 12)  # the backward one
        assert _rows(ev, "all_gather")[0] == ("all_gather", "tp", "intra", "float32", 32, 16.0)
        assert _rows(ev, "reduce_scatter")[0] == ("reduce_scatter", "dp_tp", "inter", "float32", 48, 36.0)
        a2a = _rows(ev, "all_to_all")
        assert a2a[0][4:] == (32, 24.0)  # 4 int64 counts, one stays home
        rows = sum(res["send"])
        assert a2a[1][4:] == (rows * 20, float((rows - res["send"][me]) * 20))
        # the DTensor redistribute: one functional all-gather of the [8, 4] tensor over every rank (axis dp_tp, never "world")
        gathers = _rows(ev, "all_gather")
        assert len(gathers) == 2 and gathers[1][1:5] == ("dp_tp", "inter", "float32", 128)
        if me == 0:
            assert _rows(ev, "send") == [("send", "tp", "intra", "float32", 28, 28.0)]
        if me == 1:
            assert [e[:5] for e in _rows(ev, "recv")] == [("recv", "tp", "intra", "float32", 28)]
        if me > 1:
            assert not _rows(ev, "send") and not _rows(ev, "recv")
    # the same step counted by torch's CommDebugMode: same calls per op
    tpsp = results[0]["tpsp"]
    ours: dict = {}
    for e in tpsp["events"]:
        ours[e[0]] = ours.get(e[0], 0) + 1
    theirs: dict = {}
    names = {"c10d.allreduce_": "all_reduce", "c10d.allgather_": "all_gather", "c10d._allgather_base_": "all_gather",
             "c10d._reduce_scatter_base_": "reduce_scatter", "c10d.reduce_scatter_": "reduce_scatter",
             "c10d.alltoall_base_": "all_to_all", "c10d.broadcast_": "broadcast",
             "_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_gather_into_tensor": "all_gather",
             "_c10d_functional.reduce_scatter_tensor": "reduce_scatter"}
    for k, v in tpsp["torch"].items():
        theirs[names[k]] = theirs.get(names[k], 0) + v
    assert ours == theirs, (ours, theirs, tpsp["torch"])
    assert any(e[0] == "reduce_scatter" and e[1] == "tp" for e in tpsp["events"])  # sequence parallelism
    # pipeline: rank 0 (stage 0) sends activations, rank 2 (stage 1) sends gradients back
    for sender, receiver in ((0, 2), (2, 0)):
        pp = results[sender]["pp"]
        sends = _rows(pp["events"], "send")
        assert sends and all(e[1] == "pp" for e in sends)
        assert sum(e[4] for e in sends) == pp["pipeline_sent"] > 0
        assert len(_rows(results[receiver]["pp"]["events"], "recv")) == len(sends)
    # the order check accepts what the runtime really issued (no false refusal)
    from modelcarve.runtime.distributed.collectives import check_order

    for name in ("tpsp", "pp"):
        check_order({rank: res[name]["sequence"] for rank, res in enumerate(results)})
