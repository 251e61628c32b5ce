"""The drafter registry: which drafters exist and how each is built, found rather than listed.

Why this exists: adding a drafter must be one new file. A module of ``tidespec.speculative.drafters``
(or any importable module named in ``--drafter-modules``) that defines ``DRAFTER = DrafterKind(...)``
is a drafter: its name, the ``SpecConfig`` section that holds its options, the class (whose
``model_free`` / ``stateful`` traits the policies read) and ``build(ctx)``. The configuration's
list of names, the builder, the model-free set a controller scores on the side and the stateful
set whose catch-up the profiler measures are all derived from what is found here; the engine and
the server see only the ``Drafter`` protocol.

Worked example::

    kinds = drafter_kinds()                  # {"draft-model": .., "eagle3": .., "ngram": .., "suffix": ..}
    kinds["suffix"].model_free               # True: scored on the side beside EAGLE-3
    drafter_kinds(("my_pkg.toy",))["toy"]    # a drafter defined outside the package
    build_drafter(SpecConfig(drafter="suffix,eagle3"), target, 8, 2048)   # a MultiDrafter of both
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidespec.config import SpecConfig
from tidespec.errors import ConfigError
from tidespec.models.execution import placement
from tidespec.models.target import TargetModel
from tidespec.speculative.api import Drafter
from tidespec.speculative.drafters.multi import MultiDrafter

BUILTIN_PACKAGE = "tidespec.speculative.drafters"


@dataclass(frozen=True)
class BuildContext:
    """What a drafter's ``build`` may use: its options (``spec``, with its own section), the target,
    where a model drafter runs, and the engine's bounds (its KV slots and their length)."""

    spec: SpecConfig
    target: TargetModel
    device: torch.device  # --drafter-device resolved ("" = the target's device)
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool = False  # no CUDA graphs for a drafter on a GPU
    compile: bool = False  # a drafter that compiles its step (EAGLE-3 on a GPU) does so


@dataclass(frozen=True)
class DrafterKind:
    """One drafter as its module declares it: ``DRAFTER = DrafterKind("suffix", SuffixDrafter, build,
    section="suffix")``. ``section`` names the ``SpecConfig`` field with its options (None = none);
    the traits are the class's."""

    name: str
    cls: type
    build: Callable[[BuildContext], Drafter]
    section: str | None = None
    summary: str = ""  # one line: what it drafts from

    def __post_init__(self) -> None:
        if not self.name or "," in self.name or self.name == "none" or self.name != self.name.strip():
            raise ValueError(f"a drafter's name must be a non-empty word other than 'none', got {self.name!r}")
        if self.section is not None and self.section not in SpecConfig.__dataclass_fields__:
            raise ValueError(f"drafter {self.name!r}: SpecConfig has no section {self.section!r}")

    @property
    def model_free(self) -> bool:
        return bool(getattr(self.cls, "model_free", False))

    @property
    def stateful(self) -> bool:
        return bool(getattr(self.cls, "stateful", False))


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


def plugin_modules(spec: SpecConfig) -> tuple[str, ...]:
    """The module names ``--drafter-modules`` gives: "a.b, c" -> ("a.b", "c")."""
    return tuple(m.strip() for m in spec.drafter_modules.split(",") if m.strip())


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
    drafters = [kind.build(ctx) for kind in kinds.values()]
    if len(drafters) == 1:
        return drafters[0]
    return MultiDrafter(drafters, shadow_gamma=spec.num_speculative_tokens)


def stateful_names(drafter: Drafter | None) -> frozenset[str]:
    """The members of ``drafter`` that keep per-sequence model state (their catch-up has a cost)."""
    return frozenset(n for n, d in drafter.members.items() if d.stateful) if drafter is not None else frozenset()
