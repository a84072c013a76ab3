"""The one entry point: ``modelcarve {models, hardware, layout, plan, estimate, run, verify, export, generate, serve, bench-serve}``.

Each command lives in its own module under ``modelcarve.commands`` and registers its
sub-parser through ``register(subparsers)``; the module is imported only when its command
runs, so ``modelcarve models`` never imports torch. Every ModelcarveError (bad model, bad
layout, bad cluster, malformed file) is printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from modelcarve.spec.errors import ModelcarveError

# command name -> module under modelcarve.commands that implements it
COMMANDS = {
    "models": "catalog",
    "hardware": "catalog",
    "layout": "layout",
    "plan": "plan",
    "estimate": "plan",
    "run": "run",
    "verify": "run",
    "export": "export",
    "generate": "generate",
    "serve": "serve",
    "bench-serve": "bench_serve",
    "selfhost": "selfhost",
}


def one_line(text: str) -> str:
    """``text`` on one line: whitespace runs become one space, other control characters their escapes
    (a user's ``\r`` or ANSI escape echoed back must not break or repaint the line)."""
    text = " ".join(text.split())
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2 (its own convention), and
    takes no abbreviations: ``plan ... --out DIR`` must not be read as ``--output-len DIR``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        sys.stderr.write(f"modelcarve: error: {one_line(message)} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="modelcarve", description="Plan, run and verify how a transformer is split across devices.")
    from modelcarve import __version__

    parser.add_argument("--version", action="version", version=f"modelcarve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = dict.fromkeys(COMMANDS.values()) if only is None else [COMMANDS[only]]
    for module in modules:
        importlib.import_module(f"modelcarve.commands.{module}").register(sub)
    from modelcarve.commands.argtypes import harden

    return harden(parser)  # strict numbers: ASCII digits, finite floats, each flag's range


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command if command in COMMANDS else None)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # argparse: --help (0) or a usage error already printed (2)
            return int(exit_.code or 0)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except ModelcarveError as err:
        sys.stderr.write(f"modelcarve: error: {one_line(str(err))}\n")
        return 2
    except OSError as err:  # a path the user gave that the OS refuses (spec/files.py catches the usual ones)
        name = f" {str(err.filename)[:80]!r}" if err.filename else ""
        sys.stderr.write(f"modelcarve: error: cannot use{name}: {err.strerror or err}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("modelcarve: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
