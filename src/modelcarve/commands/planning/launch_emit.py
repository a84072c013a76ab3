"""``--emit-launch`` and ``--engine`` on the commands: the search filtered to what an engine can
express, the one-line refusal before any output, and the launch files written after it.

    plan, ranking = ranked_search(args, model, cluster, "train", 5, options)   # plan --engine / --emit-launch
    launch_winner(args, model, cluster, plan, ranking)                        # refuses, or keeps the winner
    check_launch(args, model, cluster, layout)                                # estimate --emit-launch
    emit_launch(args, model, cluster, layout, max_batch=64)                   # writes launch.sh (and its files)

The mapping tables and the "can this engine express it" rule are ``commands/emit``; this module
is the commands' side of it, used by ``commands/plan.py`` and ``commands/planning/serving_plan.py``.
"""

from __future__ import annotations


def check_launch(args, model, cluster, layout) -> None:
    """``estimate --emit-launch``: refuse (one line, exit 2) before any output if the engine cannot
    express ``layout``; keep the layout to emit on ``args``."""
    from modelcarve.commands.emit import EngineRefusal, refusal
    from modelcarve.commands.planning.serve_goals import engine_dtypes, fill_replicas, is_serve_goal

    serving = is_serve_goal(args.goal)
    if serving:
        layout = fill_replicas(engine_dtypes(args.layout, layout), cluster)  # as run_serve_estimate costs it
    line = refusal(args.emit_launch, layout, model, serving=serving, ranking=None)
    if line:
        raise EngineRefusal(line)
    args._launch_layout = layout


def emit_launch(args, model, cluster, layout, *, max_batch: int | None = None, label: str = "",
                priced: dict | None = None) -> None:
    """Write ``--emit-launch``'s files for ``layout``; ``priced``: the training planner options the layout
    was priced with (a flag such as Megatron's ``--fp8-param-gather`` or ``--overlap-grad-reduce`` is
    emitted when it was priced so; an option not in ``priced`` was priced at its default)."""
    if not getattr(args, "emit_launch", None):
        return
    import sys

    from modelcarve.commands.emit import render, write
    from modelcarve.commands.planning.serve_goals import is_serve_goal

    files = render(args.emit_launch, layout, model, cluster, serving=is_serve_goal(args.goal), max_batch=max_batch,
                   label=label, planner_options=dict(priced or {}))
    written = write(files, args.out)
    if args.out:
        sys.stderr.write(f"modelcarve: wrote {', '.join(written)}\n")
    else:
        stream = sys.stderr if args.json else sys.stdout  # --json keeps stdout one JSON document
        stream.write("\n".join(written).rstrip("\n") + "\n")


def ranked_search(args, model, cluster, goal_name: str, top: int, options: dict) -> tuple[dict, list | None]:
    """The search, filtered to what ``--engine`` can express and deep enough to say where the nearest
    expressible layout of a refusal ranks: ``(result with the top layouts, the deeper ranking as
    Layouts)``. Without --engine/--emit-launch it is the plain search (ranking None)."""
    from modelcarve.plan.search import search
    from modelcarve.spec.layout import Layout

    if not (getattr(args, "engine", None) or getattr(args, "emit_launch", None)):
        return search(model, cluster, goal_name, top=top, **options), None
    from modelcarve.commands.emit import can_express
    from modelcarve.commands.planning.serve_goals import is_serve_goal

    depth = max(top, RANK_DEPTH)
    result = search(model, cluster, goal_name, top=depth, **options)
    ranking = [Layout.from_dict(item["layout"]) for item in result["layouts"]]
    if args.engine:
        serving = is_serve_goal(goal_name)
        kept = [item for item, lay in zip(result["layouts"], ranking) if can_express(args.engine, lay, model, serving=serving)]
        result["filtered_out"] = len(result["layouts"]) - len(kept)
        result["layouts"] = kept
    result["layouts"] = result["layouts"][:top]
    return result, ranking


RANK_DEPTH = 400
"""Layouts ranked when --engine filters or a refusal names the nearest layout's rank."""


def launch_winner(args, model, cluster, result: dict, ranking) -> None:
    """``plan --emit-launch``: refuse in one line if the engine cannot express the winner, else emit."""
    if not getattr(args, "emit_launch", None) or not result["layouts"]:
        return
    from modelcarve.commands.emit import EngineRefusal, refusal
    from modelcarve.commands.planning.serve_goals import is_serve_goal
    from modelcarve.spec.layout import Layout

    serving = is_serve_goal(args.goal)
    winner = result["layouts"][0]
    layout = Layout.from_dict(winner["layout"])
    line = refusal(args.emit_launch, layout, model, serving=serving, ranking=ranking)
    if line:
        raise EngineRefusal(line)
    args._launch = (layout, (winner.get("serve") or {}).get("batch"), f"{winner.get('name') or layout.short()}, rank 1")
