"""plan/accuracy.py: what an estimate says of the planner's error on the published runs of its model.

The choice of runs (same model and device family first, else the model on any device, else nothing), the
spans of the errors and the warning threshold are checked on a hand-made table; the shipped table
(plan/data/published_accuracy.csv, written by benchmarks/calibrate_training.py) is checked against the
cost model as it is now, so a change to the model that moves a published run's prediction fails here until
the calibration is re-run; and the two commands print it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from modelcarve.plan.accuracy import ACCURACY_WARN, _rows, accuracy_warning, accuracy_words, published_accuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _row(model, device, code, oos, source="S1"):
    return {"case": f"{model} on {device}", "source": source, "model": model, "device": device, "gpus": "8",
            "layout": "DP8", "metric": "tokens_per_s", "code_error": str(code), "out_of_sample_error": str(oos)}


TABLE = (
    _row("m", "H100", 0.10, 0.05),
    _row("m", "H100-96GB-HBM2e", -0.30, -0.20, "S2"),
    _row("m", "GB200", 0.50, 0.40),
    _row("other", "H100", 0.0, 0.0),
)


def test_runs_of_the_same_model_and_device_family_come_first():
    seen = published_accuracy("m", "H100", TABLE)
    # the two H100 runs (the 96 GB variant is an H100), not the GB200 one
    assert seen["same_device"] and seen["runs"] == 2 and seen["sources"] == ["S1", "S2"]
    assert seen["code_constants"] == {"low": -0.30, "high": 0.10, "mean_abs": pytest.approx(0.20, abs=1e-12)}
    assert seen["out_of_sample"] == {"low": -0.20, "high": 0.05, "mean_abs": pytest.approx(0.125, abs=1e-12)}


def test_a_device_no_run_used_falls_back_to_every_run_of_the_model():
    seen = published_accuracy("m", "B200", TABLE)
    assert not seen["same_device"] and seen["device"] == "any" and seen["runs"] == 3
    assert (seen["code_constants"]["low"], seen["code_constants"]["high"]) == (-0.30, 0.50)
    assert "none on this device" in accuracy_words(seen, "m")


def test_a_model_no_published_run_used_gets_no_figure():
    assert published_accuracy("unseen", "H100", TABLE) is None
    assert accuracy_warning(None) is None
    assert "no published run of unseen was checked" in accuracy_words(None, "unseen")


def test_the_warning_is_the_shipped_planners_error_past_the_threshold():
    # flagged by the code-constant error (what the user's estimate is made with), not the refitted one
    inside = published_accuracy("m", "GB200", (_row("m", "GB200", ACCURACY_WARN, 0.9),))
    assert accuracy_warning(inside) is None
    past = published_accuracy("m", "GB200", (_row("m", "GB200", -0.21, 0.0),))
    words = accuracy_warning(past)
    assert words.startswith("published runs of m on GB200: 1 checked, this planner -21% to -21% off them")


def test_the_shipped_table_is_the_cost_model_as_it_is():
    import calibrate_training as ct
    from modelcarve.plan.train.calibration import korthikanti2022, megatron_table1, moe_cases, nemo_cases

    rows = _rows()
    answered = [c for c in megatron_table1() + moe_cases() + korthikanti2022() + nemo_cases() if not c.unanswered]
    assert sorted(r["case"] for r in rows) == sorted(c.name for c in answered)  # every answered published run, once
    by_name: dict[str, list] = {}
    for c in answered:  # a name can recur (two presets of one release and system): in the table's order
        by_name.setdefault(c.name, []).append(c)
    errors = ct.joint_errors([by_name[r["case"]].pop(0) for r in rows], ct.joint_constants())
    for r, e in zip(rows, errors):
        assert float(r["code_error"]) == pytest.approx(e, abs=5.1e-5), (
            f"{r['case']}: the table says {r['code_error']}, the planner now {e:+.4f}: run python benchmarks/calibrate_training.py")


def test_estimate_and_plan_say_it(capsys):
    from modelcarve.cli import main

    layout = "dp=64,ep=64,mbs=4,gbs=1280,seq=4096,recompute=layernorm+mlp_act"
    assert main(["estimate", "--model", "gpt-oss-120b", "--cluster", "16x4xGB200", "--layout", layout, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    seen = result["published"]
    assert seen["model"] == "gpt-oss-120b" and seen["same_device"] and seen["runs"] >= 5
    # every GB200 run of it was predicted too fast (+19% to +45%), the worst past the warning threshold
    assert seen["code_constants"]["low"] > 0 and seen["code_constants"]["high"] > ACCURACY_WARN
    assert any(w.startswith("published runs of gpt-oss-120b on GB200") for w in result["warnings"])
    assert main(["plan", "--model", "qwen2.5-72b", "--cluster", "4x8xH100", "--global-batch", "64", "--seq", "4096",
                 "--top", "1"]) == 0
    assert "accuracy: no published run of qwen2.5-72b was checked" in " ".join(capsys.readouterr().out.split())


def test_the_shipped_serving_table_is_the_planner_as_it_is():
    import calibrate_serving as cs
    from modelcarve.plan.serve.calibration import load_published

    rows = _rows("serve")
    used = [r for r in load_published(cs.DATA) if (r.get("role") or "check") != "excluded"]
    assert len(rows) == len(used)  # every published serving run the calibration uses, once
    errors: dict[tuple, list] = {}
    for r, e in zip(used, cs.serve_errors(used, cs.serve_constants())):
        errors.setdefault((r["source"], cs._row_name(r)), []).append(e)
    for r in rows:
        e = errors[(r["source"], r["case"])].pop(0)
        tol = 5.1e-5  # the table's 4 decimals
        if r["metric"] == "tpot_ms":  # the table states a time's error as the rate it implies, from a rounded one
            e, tol = 1.0 / (1.0 + e) - 1.0, 1.1e-4
        assert float(r["code_error"]) == pytest.approx(e, abs=tol), (
            f"{r['case']}: the table says {r['code_error']}, the planner now {e:+.4f}: run python benchmarks/calibrate_serving.py")


def test_serving_estimate_and_plan_say_it(capsys):
    from modelcarve.cli import main

    assert main(["estimate", "--model", "llama-4-maverick", "--cluster", "8xH100", "--goal", "serve-throughput",
                 "--layout", "tp=8,weight_dtype=fp8,kv_dtype=fp8", "--input-len", "1000", "--output-len", "1000",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    seen = result["published"]
    assert seen["kind"] == "serve" and seen["same_device"] and seen["code_constants"]["high"] > ACCURACY_WARN
    assert any(w.startswith("published runs of llama-4-maverick on H100") for w in result["warnings"])
    assert main(["plan", "--model", "qwen2.5-72b", "--cluster", "8xH100", "--goal", "serve-throughput", "--top", "1"]) == 0
    assert "accuracy: no published run of qwen2.5-72b was checked" in " ".join(capsys.readouterr().out.split())
