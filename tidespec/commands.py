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


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run; a ``UserError`` becomes one line ``error: ...`` and exit code 2."""
    ns = parser.parse_args(argv)
    try:
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
