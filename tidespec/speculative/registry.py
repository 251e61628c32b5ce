"""The drafter registry: which drafters exist, how each is built and which options it takes, found rather than listed.

Why this exists: adding a drafter must be one new file. A module of ``tidespec.speculative.drafters``
(or any importable module named in ``--drafter-modules``) that defines ``DRAFTER = DrafterKind(...)``
is a drafter: its name, the class (whose ``model_free`` / ``stateful`` traits the policies read),
``build(ctx)``, and its own options dataclass with the prefix of its flags. The configuration's
list of names, the builder, the drafters' flags (``add_engine_args``: the config tree's flags plus
every drafter's, a plug-in's included), the model-free set a controller scores on the side and the
stateful set whose catch-up the profiler measures are all derived from what is found here; the
engine and the server see only the ``Drafter`` protocol.

Worked example::

    kinds = drafter_kinds()                  # {"draft-model": .., "eagle3": .., "ngram": .., "suffix": ..}
    kinds["suffix"].model_free               # True: scored on the side beside EAGLE-3
    kinds["ngram"].options_of(SpecConfig())  # NgramOptions(min=1, max=4): its flags --ngram-min/--ngram-max
    drafter_kinds(("my_pkg.toy",))["toy"]    # a drafter defined outside the package
    build_drafter(SpecConfig(drafter="suffix,eagle3"), target, 8, 2048)   # a MultiDrafter of both

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                  # every engine flag, the drafters' among them
    cfg = engine_config_from_args(parser.parse_args(["--drafter", "ngram", "--ngram-min", "2"]))
    cfg.spec.options["ngram"].min            # 2
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidespec.config import EngineConfig, SpecConfig
from tidespec.errors import ConfigError
from tidespec.flags import add_dataclass_args, dataclass_from_args
from tidespec.models.execution import placement
from tidespec.models.target import TargetModel
from tidespec.speculative.api import Drafter
from tidespec.speculative.drafters.multi import MultiDrafter

BUILTIN_PACKAGE = "tidespec.speculative.drafters"


@dataclass(frozen=True)
class BuildContext:
    """What a drafter's ``build`` may use: its own options (``options``: an instance of its kind's
    options dataclass, None when it declares none), the whole ``spec``, the target, where a model
    drafter runs, and the engine's bounds (its KV slots and their length)."""

    spec: SpecConfig
    target: TargetModel
    device: torch.device  # --drafter-device resolved ("" = the target's device)
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool = False  # no CUDA graphs for a drafter on a GPU
    compile: bool = False  # a drafter that compiles its step (EAGLE-3 on a GPU) does so
    options: Any = None  # this drafter's options (``DrafterKind.options_of``)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter as its module declares it: ``DRAFTER = DrafterKind("suffix", SuffixDrafter, build,
    options=SuffixOptions, prefix="suffix")``. ``options`` is the drafter's own options dataclass (None =
    it has none): each field becomes a flag ``--<prefix>-<field>`` (or the field's own ``flag=``), built
    by the same machinery as the config tree's (``tidespec.flags``), validated on construction.
    ``check(config, options)`` holds the rules that read other sections too (e.g. a head's device
    against the target's), run by ``check_config`` before anything loads. The traits are the class's."""

    name: str
    cls: type
    build: Callable[[BuildContext], Drafter]
    options: type | None = None
    prefix: str = ""
    summary: str = ""  # one line: what it drafts from
    check: Callable[[EngineConfig, Any], None] | None = None

    def __post_init__(self) -> None:
        if not self.name or "," in self.name or self.name == "none" or self.name != self.name.strip():
            raise ValueError(f"a drafter's name must be a non-empty word other than 'none', got {self.name!r}")
        if self.options is not None and not dataclasses.is_dataclass(self.options):
            raise ValueError(f"drafter {self.name!r}: options must be a dataclass, got {self.options!r}")

    @property
    def model_free(self) -> bool:
        return bool(getattr(self.cls, "model_free", False))

    @property
    def stateful(self) -> bool:
        return bool(getattr(self.cls, "stateful", False))

    def options_of(self, spec: SpecConfig) -> Any:
        """Its options in ``spec`` (its defaults when ``spec`` has none for it); options of another
        type are a ``ConfigError``. Example: ``DRAFTER.options_of(SpecConfig())`` -> ``SuffixOptions()``."""
        if self.options is None:
            return None
        got = spec.options_for(self.name, self.options)
        if not isinstance(got, self.options):
            raise ConfigError(f"drafter {self.name!r} takes {self.options.__name__} options, got {type(got).__name__}")
        return got


def _modules(extra: tuple[str, ...]) -> list[str]:
    """The built-in drafter modules (every module of the drafters package), then ``extra``."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    builtin = sorted(f"{BUILTIN_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(package.__path__))
    return builtin + [m for m in extra if m not in builtin]


def drafter_kinds(modules: tuple[str, ...] = ()) -> dict[str, DrafterKind]:
    """Every drafter found: the built-in modules' ``DRAFTER`` declarations, then those of ``modules``
    (importable module names). Two declarations of one name are an error; a module that cannot be
    imported is a ``ConfigError`` naming it.

    Example: ``sorted(drafter_kinds())`` -> ``["draft-model", "eagle3", "ngram", "suffix"]``.
    """
    kinds: dict[str, DrafterKind] = {}
    for name in _modules(modules):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"--drafter-modules: cannot import {name!r}: {exc}") from exc
        kind = getattr(module, "DRAFTER", None)
        if kind is None:
            if name in modules:
                raise ConfigError(f"--drafter-modules: {name!r} defines no DRAFTER = DrafterKind(...)")
            continue
        if not isinstance(kind, DrafterKind):
            raise ConfigError(f"{name}.DRAFTER is a {type(kind).__name__}, not a DrafterKind")
        if kind.name in kinds:
            raise ConfigError(f"two drafters named {kind.name!r} ({name} and an earlier module)")
        kinds[kind.name] = kind
    return kinds


def module_names(text: str) -> tuple[str, ...]:
    """The module names of a ``--drafter-modules`` value: "a.b, c" -> ("a.b", "c")."""
    return tuple(m.strip() for m in text.split(",") if m.strip())


def plugin_modules(spec: SpecConfig) -> tuple[str, ...]:
    """The module names ``spec``'s ``--drafter-modules`` gives."""
    return module_names(spec.drafter_modules)


def kinds_for(spec: SpecConfig) -> dict[str, DrafterKind]:
    """The drafters ``spec`` names, in its order; an unknown name is a one-line ``ConfigError``
    listing the known ones (built in and from ``--drafter-modules``)."""
    known = drafter_kinds(plugin_modules(spec))
    names = [n for n in spec.drafter_names if n != "none"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown drafter {unknown[0]!r}: drafter must be one of none, "
                          f"{', '.join(sorted(known))}, or several of them joined by commas "
                          f"(more from --drafter-modules)")
    return {n: known[n] for n in names}


def build_drafter(spec: SpecConfig, target: TargetModel, max_num_seqs: int, max_model_len: int,
                  enforce_eager: bool = False, compile: bool = False) -> Drafter | None:
    """The drafter ``spec.drafter`` names (None for "none"); several names give a ``MultiDrafter``
    whose model-free members are scored on the side at gamma = ``num_speculative_tokens``. Model
    drafters run on ``spec.drafter_device`` ("" = the target's device); an EAGLE-3 head on a GPU
    drafts through CUDA graphs unless ``enforce_eager``, of its inductor-compiled step with ``compile``."""
    kinds = kinds_for(spec)
    if not kinds:
        return None
    ctx = BuildContext(spec, target, placement.resolve_device(spec.drafter_device, target.device), max_num_seqs,
                       max_model_len, enforce_eager, compile)
    drafters = [kind.build(dataclasses.replace(ctx, options=kind.options_of(spec))) for kind in kinds.values()]
    if len(drafters) == 1:
        return drafters[0]
    return MultiDrafter(drafters, shadow_gamma=spec.num_speculative_tokens)


def stateful_names(drafter: Drafter | None) -> frozenset[str]:
    """The members of ``drafter`` that keep per-sequence model state (their catch-up has a cost)."""
    return frozenset(n for n, d in drafter.members.items() if d.stateful) if drafter is not None else frozenset()


def check_config(config: EngineConfig) -> None:
    """Refuse, before anything loads, what the drafters ``config`` names cannot run: an unknown name,
    options of the wrong type, or a drafter's own ``check`` (one-line ``ConfigError``s)."""
    for kind in kinds_for(config.spec).values():
        options = kind.options_of(config.spec)
        if kind.check is not None:
            kind.check(config, options)


def _add_options(parser: argparse.ArgumentParser, kinds: dict[str, DrafterKind]) -> None:
    """Each drafter's options as flags of ``parser``, one help group each; a drafter whose flags the
    parser has already is skipped (the plug-ins are added on a second look, ``add_engine_args``)."""
    known = set(parser._option_string_actions)
    for kind in kinds.values():
        if kind.options is None:
            continue
        probe = argparse.ArgumentParser(add_help=False)
        add_dataclass_args(probe, kind.options, kind.prefix)
        if not known.intersection(probe._option_string_actions):
            add_dataclass_args(parser, kind.options, kind.prefix)


def _plugin_flags_later(parser: argparse.ArgumentParser) -> None:
    """Have ``commands.parse`` add a ``--drafter-modules`` plug-in's flags once that flag is read."""

    def extend(ns: argparse.Namespace) -> None:
        modules = module_names(getattr(ns, "drafter_modules", "") or "")
        if modules:
            _add_options(parser, drafter_kinds(modules))

    parser.set_defaults(extend_parser=extend)


def _with_options(spec: SpecConfig, ns: argparse.Namespace) -> SpecConfig:
    """``spec`` with every drafter's options from the flags (its defaults where it has none)."""
    kinds = drafter_kinds(plugin_modules(spec))
    return dataclasses.replace(spec, options={
        n: dataclass_from_args(k.options, ns, k.prefix) for n, k in kinds.items() if k.options is not None})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine flag: the config tree's (``tidespec.flags``) and every built-in drafter's options.
    A ``--drafter-modules`` plug-in's flags are added once that flag is read: the parser's
    ``extend_parser`` default does it (``commands.parse`` calls it, then parses again)."""
    add_dataclass_args(parser, EngineConfig)
    _add_options(parser, drafter_kinds())
    _plugin_flags_later(parser)


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags give, each drafter's options (its flags, else its defaults) in
    ``spec.options``; construction re-runs every section's validation."""
    config: EngineConfig = dataclass_from_args(EngineConfig, ns)
    return dataclasses.replace(config, spec=_with_options(config.spec, ns))


def add_spec_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """``SpecConfig``'s flags but ``skip`` (a bench that sweeps the drafter itself) and every drafter's options."""
    add_dataclass_args(parser, SpecConfig, skip=skip)
    _add_options(parser, drafter_kinds())
    _plugin_flags_later(parser)


def spec_config_from_args(ns: argparse.Namespace) -> SpecConfig:
    """The ``SpecConfig`` of ``add_spec_args``' flags, every drafter's options in ``options``."""
    return _with_options(dataclass_from_args(SpecConfig, ns), ns)
