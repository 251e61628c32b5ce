"""The command line built from the configuration tree: one ``--flag`` per config field, and back.

Why this exists: flags, defaults and validation are declared once, on the config dataclasses
(``tidespec.config``); this module is the one place the CLI is built from them, for every
command (serve, generate, bench, train-drafter, fleet). Nested sections contribute their flags,
prefixed by the section's ``prefix`` unless a field names its flag outright.

Sections this module cannot see (each drafter's options, declared with the drafter) are added by
the caller with the same two functions: ``speculative.registry.add_engine_args`` does so for the
engine's flags. A field with ``metadata["cli"] = False`` is set by code, never by a flag.

Worked example::

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, PolicyConfig)
    ns = parser.parse_args(["--policy", "hybrid", "--guard-kv-usage", "0.5"])
    cfg = dataclass_from_args(PolicyConfig, ns)  # cfg.name == "hybrid", cfg.guard_kv_usage == 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from tidespec.config import finite_float


def _base_type(tp: Any) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _flag(f: dataclasses.Field, prefix: str) -> str:
    """``--flag`` of a leaf field: its own ``flag=`` or the prefixed field name."""
    if "flag" in f.metadata:
        return str(f.metadata["flag"])
    return "--" + "-".join(p for p in (prefix, f.name.replace("_", "-")) if p)


def _sub_prefix(f: dataclasses.Field, prefix: str) -> str:
    return "-".join(p for p in (prefix, f.metadata.get("prefix", "")) if p)


def _is_section(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("section"))


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                       skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per leaf field of dataclass ``cls`` (sections recursively, one help group
    each), except the top-level fields named in ``skip``. A flag's ``dest`` is the flag name with
    underscores, so ``ns.ngram_min`` is ``--ngram-min``."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        if _is_section(f):
            add_dataclass_args(parser, _base_type(hints[f.name]), _sub_prefix(f, prefix))
            continue
        tp = _base_type(hints[f.name])
        flag = _flag(f, prefix)
        dest = flag[2:].replace("-", "_")
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_, dest=dest)
        elif get_origin(tp) is Literal:
            group.add_argument(flag, choices=list(get_args(tp)), default=default, help=help_, dest=dest)
        elif tp in (int, float, str):
            group.add_argument(flag, type=finite_float if tp is float else tp, default=default, help=help_,
                               choices=f.metadata.get("choices"), dest=dest)
        else:
            raise TypeError(f"unsupported config field type {tp!r} for {cls.__name__}.{f.name}")


def dataclass_from_args(cls: type, ns: argparse.Namespace, prefix: str = "") -> Any:
    """Build ``cls`` (sections recursively) from parsed flags; fields without a flag in ``ns`` keep
    their defaults. Construction re-runs every ``__post_init__`` validation."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        if _is_section(f):
            kw[f.name] = dataclass_from_args(_base_type(hints[f.name]), ns, _sub_prefix(f, prefix))
            continue
        dest = _flag(f, prefix)[2:].replace("-", "_")
        if hasattr(ns, dest):
            kw[f.name] = getattr(ns, dest)
    return cls(**kw)


def flag_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """``{--flag: default}`` of every leaf field of ``cls``, as the generated CLI has them; e.g.
    ``flag_defaults(PolicyConfig)["--policy"]`` is ``"static"``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, cls, prefix)
    return {a.option_strings[0]: a.default for a in parser._actions if a.option_strings}
