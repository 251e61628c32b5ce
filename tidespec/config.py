"""The configuration tree: dataclasses validated on construction, and the CLI flags derived from them.

Why this exists: flags, defaults and validation live in one place. Every field of a config
dataclass becomes a ``--flag`` (underscores -> dashes) whose help text is the field's
``metadata["help"]``; ``from_args`` builds the dataclass back and so re-runs validation.

Worked example::

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, SpecConfig)      # adds --drafter, --num-speculative-tokens, ...
    ns = parser.parse_args(["--drafter", "ngram"])
    spec = dataclass_from_args(SpecConfig, ns)  # SpecConfig(drafter="ngram", ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A configuration value is invalid; the message is a single line."""


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    model: str | None = _f(None, "HF checkpoint dir or GGUF file; default: embedded SmolLM2-135M-Instruct")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = _f("float32", "weights and activations dtype")
    device: str = _f("cpu", "torch device (cpu, cuda, cuda:1)")
    threads: int = _f(0, "torch intra-op threads (0 = torch default)")

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")


@dataclass
class CacheConfig:
    max_model_len: int = _f(2048, "longest sequence (prompt + output) a request may reach, tokens")
    max_num_seqs: int = _f(32, "KV slots = most sequences running at once")

    def __post_init__(self) -> None:
        if self.max_model_len < 8:
            raise ConfigError(f"max_model_len must be >= 8, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = _f(512, "token budget of one engine step (decode + prefill chunks)")
    max_waiting: int = _f(0, "bounded waiting queue; 0 = unbounded (the server sets a bound)")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 16:
            raise ConfigError(f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")


DRAFTERS = ("none", "ngram", "suffix", "draft-model")


@dataclass
class SpecConfig:
    drafter: str = _f("none", "speculative drafter", choices=DRAFTERS)
    num_speculative_tokens: int = _f(4, "draft tokens per step (gamma)")
    tree: bool = _f(False, "allow tree-shaped proposals (drafters that support them)")
    ngram_min: int = _f(1, "n-gram drafter: shortest suffix to match")
    ngram_max: int = _f(4, "n-gram drafter: longest suffix to match")
    suffix_max_tree_tokens: int = _f(20000, "suffix drafter: global tree budget (tokens), oldest evicted first")
    suffix_min_prob: float = _f(0.1, "suffix drafter: prune candidates below this empirical probability")
    suffix_factor: float = _f(1.0, "suffix drafter: speculation length per matched token")
    draft_model: str | None = _f(None, "draft model path (same tokenizer); default: the target truncated")
    draft_layers: int = _f(0, "draft model: use the target's first k layers (0 = use --draft-model)")
    tree_top_k: int = _f(2, "draft model trees: children per node")

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ConfigError(f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0.0 <= self.suffix_min_prob < 1.0:
            raise ConfigError(f"suffix_min_prob must be in [0, 1), got {self.suffix_min_prob}")
        if self.draft_layers < 0:
            raise ConfigError(f"draft_layers must be >= 0, got {self.draft_layers}")
        if self.tree_top_k < 1:
            raise ConfigError(f"tree_top_k must be >= 1, got {self.tree_top_k}")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.num_speculative_tokens > 0


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.scheduler.max_num_batched_tokens < self.cache.max_num_seqs * (self.spec.num_speculative_tokens + 1):
            # every running sequence must fit its verification tokens in one step
            self.scheduler.max_num_batched_tokens = self.cache.max_num_seqs * (self.spec.num_speculative_tokens + 1)


ENGINE_SECTIONS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, SpecConfig)


def _base_type(tp: Any) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=help_, dest=f.name)
        elif get_origin(tp) is Literal:
            group.add_argument(flag, choices=list(get_args(tp)), default=default, help=help_, dest=f.name)
        elif tp in (int, float, str):
            group.add_argument(flag, type=tp, default=default, help=f"{help_} (default: {default})",
                               choices=f.metadata.get("choices"), dest=f.name)
        else:
            raise TypeError(f"unsupported config field type {tp!r} for {cls.__name__}.{f.name}")


def dataclass_from_args(cls: type, ns: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls in ENGINE_SECTIONS:
        add_dataclass_args(parser, cls)


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=dataclass_from_args(ModelConfig, ns),
        cache=dataclass_from_args(CacheConfig, ns),
        scheduler=dataclass_from_args(SchedulerConfig, ns),
        spec=dataclass_from_args(SpecConfig, ns),
    )
