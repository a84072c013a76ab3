"""``--timeline PNG`` of ``run`` and ``estimate``: the pipeline's Gantt chart, measured and modelled.

    modelcarve run --model tiny-llama --layout "pp=2,mbs=1,gbs=8,schedule=1f1b" --steps 3 --timeline t.png
    modelcarve estimate --model llama-3.1-8b --cluster 1x8xH100 --layout "pp=4,dp=2,gbs=32,seq=2048" --timeline t.png

``run``: rank 0 draws its pipeline's last unmeasured step (runtime/measure/timeline.py's records) above
the planner's model of the same layout (plan/predict/timeline.py), each with its bubble and plan/cost/schedule.py's
predicted one in the title; that model has no cluster, so its stages are alike (F = 1, B = 2 units).
``estimate``: the planner's model alone, in seconds on the cluster: every stage's own forward and
backward, the sends and the host time per action (plan/train/pipeline_costs.py).
"""

from __future__ import annotations

import json
import os

from modelcarve.spec.errors import LayoutError


def check(path: str | None, layout) -> dict:
    """Refuse a bad ``--timeline`` before any work; the payload entry for the ranks."""
    if not path:
        return {}
    from modelcarve.spec import files

    files.output_path(path, "--timeline")
    if layout.pp < 2:
        raise LayoutError(f"--timeline draws a pipeline; layout {layout.short()} has pp={layout.pp} (use pp >= 2)")
    return dict(timeline=True)


def model_panel(layout, model=None, cluster=None) -> tuple:
    """The planner's timeline panel: priced on ``cluster`` when given, else in units."""
    from modelcarve.plan.cost.schedule import bubble_fraction
    from modelcarve.plan.predict.timeline import model_records

    p, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
    predicted = bubble_fraction(layout.schedule, p, m, v)
    if model is not None and cluster is not None:
        from modelcarve.plan.train.pipeline_costs import schedule_costs

        records = model_records(layout.schedule, p, m, v, **schedule_costs(model, cluster, layout))
        return (f"planner's model ({layout.schedule}, each stage's F and B on {cluster.device.name}, sends, host)",
                records, "s", predicted)
    records = model_records(layout.schedule, p, m, v)
    return (f"planner's model ({layout.schedule}, F=1, B=2, no comm)", records, "units of one stage's forward", predicted)


def draw_run(path: str | None, layout, report_path: str) -> None:
    """After ``run``: draw the measured step from the run report beside the planner's model."""
    if not path or not os.path.exists(report_path):
        return
    from modelcarve.report.timeline import plot_timeline

    report = json.load(open(report_path))
    if "timeline" not in report:
        return
    name, model, unit, predicted = model_panel(layout)
    panels = [(f"measured, rank 0's pipeline, step {report['steps'] - 1 if report['steps'] > 1 else 1}",
               report["timeline"], "s", predicted), (name, model, unit, predicted)]
    title = f"{report['model']} {layout.short()} schedule={layout.schedule} pp={layout.pp} m={layout.num_microbatches}"
    plot_timeline(panels, path, title=title)


def draw_estimate(path: str | None, layout, model=None, cluster=None) -> None:
    if not path:
        return
    from modelcarve.report.timeline import plot_timeline

    check(path, layout)
    plot_timeline([model_panel(layout, model, cluster)], path,
                  title=f"{layout.short()} schedule={layout.schedule} pp={layout.pp} m={layout.num_microbatches}")
