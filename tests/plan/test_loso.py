"""benchmarks/loso.py: the leave-one-source-out machinery of the calibration scripts.

A fold never fits on the source it holds out (checked on the rows handed to the fit), every row is
predicted once by the fold that held it out, a constant no fitted row moves is reported as
unconstrained and keeps the code's value, and the real joint fits (training's nine constants,
serving's four) restore the module constants afterwards, also when the fit raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import loso  # noqa: E402

GRID = {"k": [1.0, 1.5, 2.0, 2.5, 3.0], "unused": [1.0, 2.0, 7.0]}
CODE = {"k": 2.0, "unused": 7.0}


def _rows():
    # sources A and B: y = 2x (one row each); C: y = 3x (three rows); an excluded C row
    rows = [{"source": "A", "name": "a0", "x": 1.0, "y": 2.0}, {"source": "B", "name": "b0", "x": 2.0, "y": 4.0}]
    rows += [{"source": "C", "name": f"c{i}", "x": float(i + 1), "y": 3.0 * (i + 1)} for i in range(3)]
    excluded = [({"source": "C", "name": "cx", "x": 1.0, "y": 3.0}, "shown, not used")]
    return rows, excluded


def _errors(rows, values):
    return [values["k"] * r["x"] / r["y"] - 1.0 for r in rows]


def test_coordinate_descent_reaches_the_grid_minimum_and_flags_a_constant_nothing_moves():
    grids = {"a": [0.0, 1.0, 2.0, 3.0], "b": [10.0, 20.0], "c": [0.5, 1.5]}
    result = loso.coordinate_descent(lambda v: (v["a"] - 2.0) ** 2 + abs(v["c"] - 1.5), grids, {"a": 0.0, "b": 99.0, "c": 0.5})
    assert result["values"] == {"a": 2.0, "b": 99.0, "c": 1.5}
    assert result["unconstrained"] == ["b"]
    assert result["converged"] and result["score"] == 0.0


def test_each_fold_fits_on_the_other_sources_only_and_predicts_its_own():
    rows, excluded = _rows()
    calls = []

    def fit(fit_rows):
        calls.append([r["name"] for r in fit_rows])
        return loso.coordinate_descent(lambda v: loso.mean_abs_log(_errors(fit_rows, v)), GRID, CODE)

    report = loso.leave_one_source_out(rows, source=lambda r: r["source"], name=lambda r: r["name"], fit=fit,
                                       errors=_errors, code=CODE, excluded=excluded)
    assert report["sources"] == ["A", "B", "C"]
    assert calls[0] == ["a0", "b0", "c0", "c1", "c2"]  # in-sample: every used row, never the excluded one
    assert len(calls) == 4
    for fold, fitted_on in zip(report["folds"], calls[1:]):
        held = {r["name"] for r in rows if r["source"] == fold["held_out"]}
        assert set(fitted_on) == {r["name"] for r in rows} - held
        assert fold["rows"] == len(held) and fold["fitted_on_rows"] == len(fitted_on)
        assert "unused" in fold["unconstrained"] and fold["constants"]["unused"] == 7.0
    a, b, c = report["folds"]
    # C's three rows pull every fit that sees them to k = 3; without C the fit is k = 2
    assert a["constants"]["k"] == 3.0 and a["worst"] == 0.5
    assert c["constants"]["k"] == 2.0 and c["worst"] == pytest.approx(-1 / 3, abs=1e-4) and c["mape"] == pytest.approx(1 / 3, abs=1e-4)
    assert c["excluded"] == [{"case": "cx", "reason": "shown, not used", "error": pytest.approx(-1 / 3, abs=1e-4)}]
    assert report["overall"]["rows"] == 5 and report["overall"]["mape"] == pytest.approx(0.4, abs=1e-4)
    assert report["in_sample"]["constants"]["k"] == 3.0 and report["in_sample"]["mape"] == pytest.approx(0.2, abs=1e-4)
    assert report["code_constants"]["mape"] == pytest.approx(0.2, abs=1e-4)  # k = 2: C's rows off by -1/3


def _training():
    import calibrate_training

    return calibrate_training


def test_training_shipped_fit_restores_the_constants_and_leaves_unconstrained_ones_alone():
    ct = _training()
    from modelcarve.plan.cost import efficiency
    from modelcarve.plan.train.calibration import megatron_table1

    before, blackwell = ct.joint_constants(), efficiency.BLACKWELL_PEAK_FRACTION
    result = ct.shipped_fit(megatron_table1()[:2], rounds=1)
    assert ct.joint_constants() == before and efficiency.BLACKWELL_PEAK_FRACTION is blackwell
    # two Table 1 rows (A100, GPT, TFLOP/s) constrain the ramp and the A100 fraction (stage 1), nothing else:
    # no framework row, so stage 2 does not run and its seven constants keep the code's values
    assert set(result["unconstrained"]) == set(ct.JOINT_GRID) - {"ramp_dim", "a100_peak_fraction"}
    assert all(result["values"][n] == before[n] for n in result["unconstrained"])
    # stage 1 is an exhaustive grid: its pair is the best of every pair on the grid for these two rows
    rows = megatron_table1()[:2]
    best = min(ct.mean_abs_log(ct.joint_errors(rows, dict(before, ramp_dim=r, a100_peak_fraction=a)))
               for r in ct.JOINT_GRID["ramp_dim"] for a in ct.JOINT_GRID["a100_peak_fraction"])
    assert ct.mean_abs_log(ct.joint_errors(rows, result["values"])) == pytest.approx(best, abs=1e-12)


def test_training_shipped_fit_leaves_the_a100_constants_to_a100_rows():
    ct = _training()
    from modelcarve.plan.train.calibration import nemo_cases

    rows = [c for c in nemo_cases() if c.source == "NEMO-24.07" and not c.unanswered][:2]  # H100 framework rows
    before = ct.joint_constants()
    result = ct.shipped_fit(rows, rounds=1)
    assert ct.joint_constants() == before
    # no A100 row: stage 1 leaves the ramp and the A100 fraction at the code's values, unconstrained
    assert {"ramp_dim", "a100_peak_fraction"} <= set(result["unconstrained"])
    assert result["values"]["ramp_dim"] == before["ramp_dim"]
    assert result["values"]["a100_peak_fraction"] == before["a100_peak_fraction"]
    # the Blackwell fractions price no H100 row either
    assert {"b200_peak_fraction", "gb200_peak_fraction", "gb300_peak_fraction"} <= set(result["unconstrained"])


def test_training_shipped_fit_restores_the_constants_when_it_raises(monkeypatch):
    ct = _training()
    from modelcarve.plan.train.calibration import megatron_table1

    before = ct.joint_constants()
    seen = []

    def failing(case, values):
        if ct.joint_constants() != before:
            seen.append(ct.joint_constants())
            raise RuntimeError("failed mid-fit")
        return 0.0

    monkeypatch.setattr(ct, "_joint_error", failing)
    with pytest.raises(RuntimeError):
        ct.shipped_fit(megatron_table1()[:1], rounds=1)
    assert seen and seen[0] != before  # it did fail with other constants set
    assert ct.joint_constants() == before


def test_serving_joint_fit_restores_the_constants_and_leaves_fp4_unconstrained_without_fp4_rows():
    import calibrate_serving as cs

    from modelcarve.plan.serve.calibration import load_published

    rows = [r for r in load_published(cs.DATA) if r["source"] == "gpt-fast" and r["role"] == "fit"][:2]
    assert len(rows) == 2 and all(r["weight_dtype"] == "bf16" for r in rows)
    before = cs.serve_constants()
    result = cs.serve_fit(rows, rounds=1)
    assert cs.serve_constants() == before
    assert "FP4_GEMM_FRACTION" in result["unconstrained"] and result["values"]["FP4_GEMM_FRACTION"] == before["FP4_GEMM_FRACTION"]
    assert "DECODE_HBM_EFFICIENCY" not in result["unconstrained"]


def test_release_drift_groups_the_same_run_across_releases():
    """Rows of two releases with the same model, precision, system, devices, layout, micro-batch, global
    batch and sequence form one run; a run seen in one release, another layout, or a non-Bridge source
    does not; spreads are max / min - 1 of the published and of the predicted figures."""
    import dataclasses

    ct = _training()
    from modelcarve.plan.train.calibration import nemo_cases

    cases = [c for c in nemo_cases() if not c.unanswered]
    base = [c for c in cases if c.name == "qwen3-30b-a3b mxfp8 8xGB200 (MB-26.04.01)"][0]
    other = dataclasses.replace(base, source="MB-26.06", name=base.name.replace("26.04.01", "26.06"))
    moved = dataclasses.replace(base, source="MB-26.08", layout=base.layout.replace(mbs=2))
    nemo = dataclasses.replace(base, source="NEMO-25.04")
    rows = [{"case": c.name, "published_tokens_per_gpu": p, "predicted_tokens_per_gpu": q, "error": q / p - 1}
            for c, p, q in ((base, 100.0, 120.0), (other, 150.0, 120.0), (moved, 90.0, 90.0), (nemo, 80.0, 80.0))]
    drift = ct.release_drift([base, other, moved, nemo], rows)
    assert len(drift) == 1
    assert [r["source"] for r in drift[0]["releases"]] == ["MB-26.04.01", "MB-26.06"]
    assert drift[0]["published_spread"] == pytest.approx(0.5) and drift[0]["predicted_spread"] == 0.0


def test_the_code_constants_are_the_shipped_fit_on_every_published_row():
    """The nine training constants in the code are what ``shipped_fit`` gives on every answered published
    row (the LOSO table's in-sample column), so the out-of-sample figures describe the procedure that made
    the shipped constants. A data or cost-model change that moves the optimum fails here until the constants
    are set from ``python benchmarks/calibrate_training.py`` (its "shipped fit" line)."""
    ct = _training()
    from modelcarve.plan.train.calibration import korthikanti2022, megatron_table1, moe_cases, nemo_cases

    cases = [c for c in megatron_table1() + moe_cases() + korthikanti2022() + nemo_cases() if not c.unanswered]
    result = ct.shipped_fit(cases)
    assert result["converged"] and result["unconstrained"] == []
    assert result["values"] == pytest.approx(ct.joint_constants(), abs=1e-9)
