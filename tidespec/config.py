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
import shlex
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from tidespec.errors import ConfigError


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field that ``add_dataclass_args`` turns into ``--flag`` with this help (and
    ``choices=`` when given): every config dataclass declares its CLI this way."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    model: str | None = opt(None, "HF checkpoint dir or GGUF file; default: embedded SmolLM2-135M-Instruct")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = opt("float32", "weights and activations dtype")
    device: str = opt("cpu", "torch device (cpu, cuda, cuda:1)")
    threads: int = opt(0, "torch intra-op threads (0 = torch default)")

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")


@dataclass
class CacheConfig:
    max_model_len: int = opt(2048, "longest sequence (prompt + output) a request may reach, tokens")
    max_num_seqs: int = opt(32, "KV slots = most sequences running at once")

    def __post_init__(self) -> None:
        if self.max_model_len < 8:
            raise ConfigError(f"max_model_len must be >= 8, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = opt(512, "token budget of one engine step (decode + prefill chunks)")
    max_waiting: int = opt(0, "bounded waiting queue; 0 = unbounded (the server sets a bound)")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 16:
            raise ConfigError(f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")


DRAFTERS = ("none", "ngram", "suffix", "draft-model", "eagle3")
POLICIES = ("static", "analytic", "bandit", "hybrid")


@dataclass
class SpecConfig:
    drafter: str = opt("none", "speculative drafter", choices=DRAFTERS)
    num_speculative_tokens: int = opt(4, "draft tokens per step (gamma)")
    tree: bool = opt(False, "allow tree-shaped proposals (drafters that support them)")
    ngram_min: int = opt(1, "n-gram drafter: shortest suffix to match")
    ngram_max: int = opt(4, "n-gram drafter: longest suffix to match")
    suffix_max_tree_tokens: int = opt(20000, "suffix drafter: global tree budget (tokens), oldest evicted first")
    suffix_min_prob: float = opt(0.1, "suffix drafter: prune candidates below this empirical probability")
    suffix_factor: float = opt(1.0, "suffix drafter: speculation length per matched token")
    draft_model: str | None = opt(None, "draft model path (same tokenizer); default: the target truncated")
    draft_layers: int = opt(0, "draft model: use the target's first k layers (0 = use --draft-model)")
    tree_top_k: int = opt(2, "draft model trees: children per node")
    policy: str = opt("static", "speculation-length policy", choices=POLICIES)
    profile: str | None = opt(None, "profile JSON for analytic/hybrid (default: measured at start-up, cached)")
    guard_kv_usage: float = opt(0.9, "no speculation while KV usage is above this fraction")
    guard_temperature: float = opt(2.0, "no speculation for requests sampled above this temperature")
    # --- EAGLE-3 (tidespec.online.online) ---
    eagle3_dir: str | None = opt(None, "EAGLE-3: publish root (v1/, v2/, LATEST: the newest valid version is served) "
                                "or one exported checkpoint dir; none = a fresh random head (still lossless)")
    eagle3_draft_vocab: int = opt(0, "EAGLE-3: draft vocabulary of a fresh head (0 = the target's vocabulary)")
    eagle3_tree_depth: int = opt(5, "EAGLE-3 trees (--tree): expansion depth")
    eagle3_tree_top_k: int = opt(4, "EAGLE-3 trees (--tree): children per expanded node and frontier width")
    online_training: bool = opt(False, "EAGLE-3: capture the target's hidden states while serving, train in a child "
                               "process, swap better drafters in between steps (needs --eagle3-dir)")
    signal_dir: str | None = opt(None, "training-signal store directory (default: <eagle3-dir>/signals)")
    signal_budget_mb: int = opt(2048, "signal store byte budget in MiB (oldest shards evicted first)")
    online_poll_s: float = opt(2.0, "seconds between checks for a newly published drafter")
    trainer_device: str | None = opt(None, "device of the trainer child process (default: --device)")
    trainer_args: str = opt("", "extra flags for the trainer child process, e.g. \"--threads 1 --epochs 3\"")
    trainer_nice: int = opt(0, "niceness added to the trainer child (e.g. 10): on a CPU shared with serving, the "
                               "engine then runs first and training takes what is left, so rounds take longer")
    collect_force: bool = opt(False, "collect training signals all the time, not only after an acceptance drop")
    collect_prompt: bool = opt(False, "also capture prompt positions (labels are the user's text, not the target's "
                                     "outputs; repeated chat templates then dominate the trainer's held-out score)")
    collect_bootstrap: bool = opt(False, "collect from the start (automatic while nothing is published)")
    collect_epsilon: float = opt(0.02, "selective collection: short-vs-long EMA acceptance drop that means a shift")
    collect_n_init: int = opt(20, "selective collection: requests averaged before shift detection starts")
    collect_n_threshold: int = opt(16384, "selective collection: new signal rows that trigger a training round")
    collect_lambda_short: float = opt(0.9, "selective collection: short EMA decay")
    collect_lambda_long: float = opt(0.99, "selective collection: long EMA decay")

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
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 < self.guard_kv_usage <= 1.0:
            raise ConfigError(f"guard_kv_usage must be in (0, 1], got {self.guard_kv_usage}")
        if self.guard_temperature < 0:
            raise ConfigError(f"guard_temperature must be >= 0, got {self.guard_temperature}")
        if self.eagle3_draft_vocab < 0:
            raise ConfigError(f"eagle3_draft_vocab must be >= 0, got {self.eagle3_draft_vocab}")
        if self.eagle3_tree_depth < 1 or self.eagle3_tree_top_k < 1:
            raise ConfigError(f"eagle3_tree_depth and eagle3_tree_top_k must be >= 1, got "
                              f"{self.eagle3_tree_depth}, {self.eagle3_tree_top_k}")
        if self.signal_budget_mb < 1:
            raise ConfigError(f"signal_budget_mb must be >= 1, got {self.signal_budget_mb}")
        if self.online_poll_s <= 0:
            raise ConfigError(f"online_poll_s must be > 0, got {self.online_poll_s}")
        if not 0.0 <= self.collect_lambda_short < self.collect_lambda_long < 1.0:
            raise ConfigError(f"need 0 <= collect_lambda_short < collect_lambda_long < 1, got "
                              f"{self.collect_lambda_short}, {self.collect_lambda_long}")
        if not 0.0 <= self.collect_epsilon < 1.0:
            raise ConfigError(f"collect_epsilon must be in [0, 1), got {self.collect_epsilon}")
        if self.collect_n_init < 1 or self.collect_n_threshold < 1:
            raise ConfigError(f"collect_n_init and collect_n_threshold must be >= 1, got "
                              f"{self.collect_n_init}, {self.collect_n_threshold}")
        if not 0 <= self.trainer_nice <= 19:
            raise ConfigError(f"trainer_nice must be in [0, 19], got {self.trainer_nice}")
        try:
            shlex.split(self.trainer_args)
        except ValueError as exc:
            raise ConfigError(f"trainer_args is not a valid command-line fragment: {exc}") from None
        if self.online_training and self.drafter != "eagle3":
            raise ConfigError("--online-training needs --drafter eagle3")
        if self.online_training and not self.eagle3_dir:
            raise ConfigError("--online-training needs --eagle3-dir (the directory drafters are published to)")

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
        need = self.cache.max_num_seqs * (self.spec.num_speculative_tokens + 1) + 16
        if self.scheduler.max_num_batched_tokens < need:
            # every running sequence must fit its verification tokens in one step, with room left
            # for prefill chunks so a full batch of decoders cannot starve new requests
            self.scheduler.max_num_batched_tokens = need


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
            group.add_argument(flag, type=tp, default=default, help=help_, choices=f.metadata.get("choices"),
                               dest=f.name)
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
