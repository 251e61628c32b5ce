"""The one base of every error a user can fix, and the configuration error every layer raises.

Why this exists: the command line, the server and the trainer process turn a user's mistake (a
missing path, a bad flag value, a prompt longer than the context) into one line — ``error: ...``
and exit code 2, or an HTTP 4xx — and everything else into a traceback. They can only do that
if every such error shares one base; each subsystem subclasses ``UserError`` (keeping the builtin
base it had, e.g. ``ValueError``, so ``except ValueError`` callers are unchanged).

Worked example::

    try:
        run_the_command()
    except UserError as exc:       # ConfigError, ModelLoadError, RequestError, QueueFullError, ...
        print(f"error: {exc}")      # one line, no traceback
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user asked for cannot be done as given; ``str(exc)`` is one line."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message is a single line."""
