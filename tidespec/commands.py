"""Running a parsed ``tidespec`` sub-command: a user's mistake becomes one line, never a traceback.

Why this exists: ``tidespec`` and the sub-command modules that also run on their own as child
processes (``python -m tidespec.server.cli serve``, ``python -m tidespec.online.training.cli
train-drafter``, what ``bench serve --launch`` and ``serve --online-training`` start) share one
way to run a command. It lives below all of them, so none imports the top-level ``cli``.

Worked example::

    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))   # e.g. the serve command
    sys.exit(run_command(parser, ["serve", "--port", "-1"]))         # prints "error: ...", exits 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tidespec.errors import UserError

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``. A sub-command whose flags depend on its other flags sets an ``extend_parser``
    default (the engine's: a ``--drafter-modules`` plug-in declares flags of its own): it is called
    with a first reading, which ignores the flags not known yet, and may add them; then ``argv`` is
    parsed again, so a flag still unknown is the usual argparse error."""
    first, _ = parser.parse_known_args(argv)
    extend = getattr(first, "extend_parser", None)
    if extend is not None:
        extend(first)
    return parser.parse_args(argv)


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run; a ``UserError`` becomes one line ``error: ...`` and exit code 2."""
    try:
        ns = parse(parser, argv)
        return int(ns.func(ns) or 0)
    except UserError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def standalone_main(register: Registrar, argv: list[str] | None = None) -> int:
    """Entry of a sub-command module run on its own (``python -m tidespec.server.cli serve``)."""
    parser = argparse.ArgumentParser(prog="tidespec")
    register(parser.add_subparsers(dest="command", required=True))
    return run_command(parser, argv)
