"""The published-accuracy sentence beside a training or serving estimate and plan (plan/accuracy.py): the
result's ``published`` field, and a warning when the shipped planner was off a run like it by more than 20%."""

from __future__ import annotations


def attach_published(result: dict, model, cluster, kind: str) -> dict | None:
    """Into ``result`` (an estimate or a plan of a ``kind`` of goal, 'train' or 'serve'): how the planner fared
    on the published runs of this model (``published``), and the warning in its ``warnings`` when it has one."""
    from modelcarve.plan.accuracy import accuracy_warning, published_accuracy

    seen = published_accuracy(model.name, cluster.device.name, kind=kind)
    result["published"] = seen
    warning = accuracy_warning(seen)
    if warning:
        result["warnings"] = [*result.get("warnings", []), warning]
    return seen


def print_published(out, result: dict, model, kind: str, warned: bool = True) -> None:
    """The accuracy sentence of a result: as its warning when it has one (unless ``warned``: the result's
    warnings, printed already, hold it), else as a note."""
    from modelcarve.plan.accuracy import accuracy_warning, accuracy_words

    if "published" not in result:
        return
    warning = accuracy_warning(result["published"])
    if warning and not warned:
        out.print(f"[yellow]warning:[/] {warning}")
    elif not warning:
        out.print(f"[dim]accuracy:[/] {accuracy_words(result['published'], model.name, kind)}")
