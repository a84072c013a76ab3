"""Placeholder registration until the plan commands land (see the open issues)."""

from modelcarve.spec.errors import ModelcarveError


def _pending(args):
    raise ModelcarveError(f"'modelcarve {args.command}' is not implemented yet")


def register(sub) -> None:
    for name in ("plan", "estimate"):
        p = sub.add_parser(name, help="(not implemented yet)")
        p.set_defaults(func=_pending)
