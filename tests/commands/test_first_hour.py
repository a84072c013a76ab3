"""What a new user meets in their first hour (issue 27 item 8), each fixed with a test."""

from __future__ import annotations

import json

import pytest

from modelcarve.cli import main


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


def test_no_abbreviated_flags(capsys):
    # argparse's abbreviations took `--output DIR` as --output-len DIR
    err = _one_line_error(capsys, ["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                                   "--output", "/tmp/x"])
    assert "unrecognized arguments: --output" in err
    # `--out` is --emit-launch's directory: alone it says so, not a silent success
    err = _one_line_error(capsys, ["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100",
                                   "--out", "/tmp/x"])
    assert "--out /tmp/x is where --emit-launch writes" in err


def test_a_hub_id_says_to_download_first(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    err = _one_line_error(capsys, ["models", "show", "meta-llama/Llama-3.1-8B"])
    assert "hub id" in err and "download" in err and "meta-llama/Llama-3.1-8B" in err
    err = _one_line_error(capsys, ["models", "show", "./no/such/dir"])  # a path is still a path
    assert "no such config file" in err


def test_models_prints_gib_as_plan_does(capsys):
    assert main(["models", "show", "llama-3.1-8b", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "llama-3.1-8b " in line)
    bf16 = 2 * spec["total_params"] / 2**30  # bf16 weights: 2 bytes per parameter, in GiB
    assert f"{bf16:,.1f} GiB" in row, (row, bf16)
    assert " GB" not in out


def test_goal_help_names_every_goal(capsys):
    assert main(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for goal in ("train", "serve-latency", "serve-throughput", "serve-disagg"):
        assert goal in out


def test_serving_plan_plot_draws_the_frontier(capsys, tmp_path):
    png = tmp_path / "serve.png"
    code = main(["plan", "--goal", "serve-latency", "--model", "qwen3-32b", "--cluster", "2xH100", "--top", "2",
                 "--plot", str(png)])
    captured = capsys.readouterr()
    assert code == 0 and f"wrote {png}" in captured.err and "training plans only" not in captured.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_why_not_rows_name_distinct_layouts_distinctly(capsys):
    """Two kinds' best layouts may share a short name (DP64-Z3 at mbs=4 with full recompute, and
    at mbs=1 with none): the table shows micro-batch and recomputation beside it."""
    assert main(["plan", "--goal", "train", "--model", "llama-3.1-70b", "--cluster", "8x8xH100", "--global-batch", "512",
                 "--seq", "4096", "--top", "5"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("why not the others"):out.index("rejected")]
    names = [line.split("│")[2].strip() for line in table.splitlines()
             if line.startswith("│") and line.split("│")[2].strip()]
    assert names and len(names) == len(set(names)), names
    assert all("mbs=" in n for n in names)


def test_serving_bound_column_is_a_word(capsys):
    """What bounds the decode step reads memory / compute / comms / launches, not "memo" or "comp"."""
    assert main(["plan", "--goal", "serve-throughput", "--model", "kimi-k2", "--cluster", "2x8xH200", "--ttft-ms", "2000",
                 "--tpot-ms", "50", "--top", "3"]) == 0
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    bounds = {r[9].strip() for r in rows if len(r) > 10}
    assert bounds and bounds <= {"memory", "compute", "comms", "launches"}, bounds


def test_plan_plot_legends_do_not_cover_the_bars(tmp_path, monkeypatch):
    """Each legend's box lies outside its axes (inside, it covered the last layouts' bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modelcarve.plan.search import search
    from modelcarve.report.figures import plot_plan
    from modelcarve.spec.catalog import get_model
    from modelcarve.spec.hardware import parse_cluster

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    result = search(get_model("llama-3.1-70b"), parse_cluster("8x8xH100"), "train", top=5, global_batch=512, seq=4096)
    plot_plan(result, tmp_path / "plan.png", title="t")
    (fig,) = kept
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= area.x1 - 1, (box, area)  # to the right of the plotting area
