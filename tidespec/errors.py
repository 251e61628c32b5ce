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


def check_at_least(minimum: float, **values: float) -> None:
    """Raise ``ConfigError("<name> must be >= <minimum>, got <value>")`` for the first value below ``minimum``.

    Example: ``check_at_least(1, max_num_seqs=4, max_model_len=0)`` raises
    ``ConfigError("max_model_len must be >= 1, got 0")``.
    """
    for name, value in values.items():
        if value < minimum:
            raise ConfigError(f"{name} must be >= {minimum}, got {value}")
