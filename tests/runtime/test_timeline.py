"""The pipeline timeline: measured records of real 2-rank gloo steps (runtime/measure/timeline.py), the
planner's model (plan/predict/timeline.py) against plan/cost/schedule.py's bubble formulas, and the PNG.

No timings are asserted: only what a schedule fixes (which actions, their order on each rank,
a send posted before the matching recv ends, a bubble in [0, 1]).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist import run_distributed
from modelcarve.plan.cost.schedule import bubble_fraction
from modelcarve.plan.predict.timeline import bubble, complete_comms, model_records
from modelcarve.spec.catalog import get_model
from modelcarve.spec.layout import Layout

CASES = ["pp=2,mbs=1,gbs=4,seq=16,schedule=1f1b", "pp=2,mbs=1,gbs=4,seq=16,schedule=gpipe",
         "pp=2,mbs=1,gbs=4,seq=16,schedule=zero-bubble", "pp=2,mbs=1,gbs=4,seq=16,schedule=interleaved-1f1b,v=2"]


def _loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _worker(cases):
    from modelcarve.runtime.distributed.mesh import build_mesh
    from modelcarve.runtime.model.transformer import build_model
    from modelcarve.runtime.parallel.pipeline import build_pipeline, split_model
    from modelcarve.runtime.measure.timeline import gather_records, local_records

    spec = dataclasses.replace(get_model("tiny-llama"), num_layers=4)
    out = {}
    for text in cases:
        layout = Layout.parse(text)
        mesh = build_mesh(layout)
        chunks = split_model(build_model(spec, seed=0), layout, mesh.get_local_rank("pp"))
        runner = build_pipeline(chunks, layout, mesh, _loss_fn)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.vocab_size, (layout.global_batch, layout.seq), generator=gen)
        runner.step(tokens, torch.roll(tokens, -1, 1))
        out[text] = gather_records(local_records(runner), runner)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_worker, 2, CASES, timeout=240)[0]  # rank 0 holds the records


def _compute(records, rank):
    return [(r["kind"], r["stage"], r["mb"]) for r in sorted(records, key=lambda r: r["start"])
            if r["rank"] == rank and r["kind"] in ("F", "B", "I", "W")]


@pytest.mark.parametrize("case", CASES)
def test_every_microbatch_has_one_forward_and_one_backward_per_stage(measured, case):
    layout = Layout.parse(case)
    recs = measured[case]
    stages = layout.pp * layout.virtual_stages
    for stage in range(stages):
        for mb in range(layout.num_microbatches):
            kinds = sorted(r["kind"] for r in recs if r["stage"] == stage and r["mb"] == mb and r["kind"] in "FBIW")
            # zero-bubble splits the backward into I (input grad) and W (weight grad); torch's
            # schedule runs the first stage's backward whole (B: it has no input gradient to send)
            assert kinds in (["B", "F"], ["F", "I", "W"]), (stage, mb, kinds)
            assert (layout.schedule == "zero-bubble") or kinds == ["B", "F"]
        assert {r["rank"] for r in recs if r["stage"] == stage} == {stage % layout.pp}


def test_1f1b_warms_up_then_alternates_and_gpipe_runs_all_forwards_first(measured):
    m = 4
    one = _compute(measured[CASES[0]], 0)
    # stage 0 of 1F1B (torch's Schedule1F1B, as plan/predict/timeline.py's model): the warm-up forwards
    # (p - rank = 2) before the first backward, then one backward, one forward, ...
    assert one == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2), ("B", 0, 3)]
    assert one == [(k, s, mb) for k, s, mb in _compute(model_records("1f1b", 2, m), 0)]
    for rank in (0, 1):
        gp = _compute(measured[CASES[1]], rank)
        assert [k for k, _, _ in gp] == ["F"] * m + ["B"] * m
        assert [mb for k, _, mb in gp if k == "F"] == list(range(m))


@pytest.mark.parametrize("case", CASES)
def test_sends_are_posted_before_the_matching_recv_ends(measured, case):
    recs = measured[case]
    sends = [r for r in recs if r["kind"] == "send"]
    recvs = {(r["dir"], r["peer"], r["stage"], r["mb"]): r for r in recs if r["kind"] == "recv"}
    layout = Layout.parse(case)
    stages = layout.pp * layout.virtual_stages
    # every activation crossing a stage boundary (F) and every input gradient back (B) moves once
    assert len(sends) == len(recvs) == 2 * (stages - 1) * layout.num_microbatches
    for s in sends:
        r = recvs[(s["dir"], s["stage"], s["peer"], s["mb"])]
        assert s["start"] <= r["end"] and r["start"] <= r["end"] and s["start"] <= s["end"]
        # the receiver's consumer (the forward / backward of that micro-batch) starts after it
        consumer = [c for c in recs if c["stage"] == r["stage"] and c["mb"] == r["mb"]
                    and c["kind"] in (("F",) if r["dir"] == "F" else ("B", "I"))]
        assert len(consumer) == 1 and consumer[0]["start"] == r["end"]


@pytest.mark.parametrize("case", CASES)
def test_measured_bubble_is_a_fraction(measured, case):
    got = bubble(measured[case])
    assert 0.0 <= got["overall"] <= 1.0
    assert all(0.0 <= b <= 1.0 for b in got["per_rank"].values())


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_model_bubble_is_the_schedule_formula(schedule, v, p, m):
    recs = model_records(schedule, p, m, v)
    # exact: list scheduling of integer/half-unit durations, compared as floats of small sums
    assert bubble(recs)["overall"] == pytest.approx(bubble_fraction(schedule, p, m, v), abs=1e-12)
    assert len([r for r in recs if r["kind"] == "F"]) == p * v * m


def test_hand_derived_bubble_p2_m4():
    # p=2, m=4, F=1, B=2: wall = m(F+B) + (p-1)(F+B) = 15, each rank busy 12 -> 1 - 24/30 = 1/5
    for schedule in ("gpipe", "1f1b"):
        got = bubble(model_records(schedule, 2, 4))
        assert got["wall"] == 15.0 and got["busy"] == {0: 12.0, 1: 12.0}
        assert got["overall"] == pytest.approx((2 - 1) / (4 + 2 - 1), abs=1e-12)


def test_complete_comms_ends_a_recv_at_its_consumer_and_a_send_at_its_recv():
    recs = [dict(rank=0, stage=0, mb=0, kind="send", dir="F", peer=1, start=1.0, end=1.0),
            dict(rank=1, stage=1, mb=0, kind="recv", dir="F", peer=0, start=0.5, end=0.5),
            dict(rank=1, stage=1, mb=0, kind="F", start=2.0, end=3.0)]
    out = {r["kind"]: r for r in complete_comms(recs)}
    assert out["recv"]["end"] == 2.0 and out["send"]["end"] == 2.0


def test_png_is_written_and_is_an_image(measured, tmp_path):
    import matplotlib.image

    from modelcarve.report.timeline import plot_timeline

    layout = Layout.parse(CASES[0])
    path = plot_timeline([("measured", measured[CASES[0]], "s", 0.2),
                          ("model", model_records("1f1b", layout.pp, layout.num_microbatches), "units", 0.2)],
                         tmp_path / "t.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_estimate_timeline_flag_draws_the_model_and_refuses_pp1(tmp_path, capsys):
    from modelcarve.cli import main

    png = tmp_path / "est.png"
    assert main(["estimate", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--layout",
                 "pp=4,dp=2,mbs=1,gbs=32,seq=2048", "--timeline", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["estimate", "--model", "llama-3.1-8b", "--cluster", "1x8xH100", "--layout",
                 "tp=8,mbs=1,gbs=32,seq=2048", "--timeline", str(tmp_path / "x.png")]) == 2
    assert "pp=1" in capsys.readouterr().err


def test_run_timeline_refuses_a_layout_without_a_pipeline_before_launch(tmp_path, capsys):
    from modelcarve.cli import main

    assert main(["run", "--model", "tiny-llama", "--init", "random", "--layout", "dp=2,gbs=2,seq=16",
                 "--timeline", str(tmp_path / "t.png")]) == 2
    assert "--timeline draws a pipeline" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()
