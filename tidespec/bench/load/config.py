"""``tidespec bench load``'s configuration: its settings, the server flags of each configuration, one run's result.

Why this exists: the running (``bench.load.run``), the analysis (``bench.load.analysis``) and the
report (``bench.load.report``) all read these types; kept below all three, each can import them
without a cycle. Configuration names: ``plain`` (no drafter), ``static-G`` (the drafter at fixed
gamma G), ``analytic`` / ``bandit`` / ``hybrid`` (the drafter with gamma_max ``--gamma-max``).
A name may say its drafters first and ask for online training last: ``eagle3:static-2``,
``suffix+eagle3:analytic`` (both drafters, the controller chooses), ``suffix+eagle3:analytic:online``
(EAGLE-3 learning online in a fresh publish root seeded from ``eagle3_dir``, its trainer child
yielding to serving).

Worked example::

    cfg = LoadBenchConfig(rates=(0.4, 1.5), configs=("plain", "static-2", "hybrid"))
    server_args("static-2", cfg)   # "--drafter suffix --policy static --num-speculative-tokens 2 --threads 2 ..."
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from tidespec.config import MAX_THREADS, POLICIES, ConfigError, SpecConfig
from tidespec.speculative.registry import kinds_for

ADAPTIVE = ("analytic", "bandit", "hybrid")
# (start second, req/s): idle, a ramp to saturation, a burst, back to idle (Nightjar Fig. 9's shape)
DYNAMIC_TRACE: tuple[tuple[float, float], ...] = (
    (0.0, 0.1), (15.0, 0.5), (30.0, 1.5), (45.0, 0.1), (55.0, 3.0), (58.0, 0.1), (70.0, 0.0))


@dataclass
class LoadBenchConfig:
    workload: str = "code"
    model: str | None = None  # checkpoint for every server (None: the embedded model)
    rates: tuple[float, ...] = (0.1, 0.4, 1.5)
    duration: float = 25.0  # seconds of arrivals per rate
    trace: tuple[tuple[float, float], ...] | None = DYNAMIC_TRACE  # None: no trace run
    configs: tuple[str, ...] = ("plain", "static-1", "static-2", "static-3", "static-4", "static-5", *ADAPTIVE)
    drafter: str = "suffix"  # drafters of names that name none (several joined by commas)
    eagle3_dir: str | None = None  # EAGLE-3 checkpoint or publish root for configurations with eagle3
    gamma_max: int = 5
    max_tokens: int = 64
    max_num_seqs: int = 16
    threads: int = 2
    max_concurrency: int = 64
    timeout: float = 300.0
    seed: int = 0
    profile: str | None = None  # profile JSON; None: measure once into the output directory
    extra_server_args: str = ""
    fresh_prompts: bool = True  # each server walks one shuffled pass of the workload: no prompt is sent twice
    min_steps: int = 20  # model check: buckets with fewer decode steps (either server) are left out
    repeats: int = 1  # rounds over all configurations (fresh servers each); the verdict uses the means

    def __post_init__(self) -> None:
        if not self.rates or any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ConfigError(f"rates must be finite and > 0, got {self.rates}")
        self.rates = tuple(sorted(self.rates))
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ConfigError(f"duration must be finite and > 0, got {self.duration}")
        if not self.configs:
            raise ConfigError("configs must not be empty")
        for name in self.configs:
            server_args(name, self, "<root>")  # raises on an unknown name
        if not 1 <= self.gamma_max <= 16:
            raise ConfigError(f"gamma_max must be in [1, 16], got {self.gamma_max}")
        if self.drafter == "none":
            raise ConfigError("drafter must be a real drafter (plain decoding is the 'plain' configuration)")
        if self.max_tokens < 1 or self.max_num_seqs < 1 or self.max_concurrency < 1:
            raise ConfigError("max_tokens, max_num_seqs and max_concurrency must be >= 1")
        if self.min_steps < 1 or self.repeats < 1:
            raise ConfigError(f"min_steps and repeats must be >= 1, got {self.min_steps}, {self.repeats}")
        if not 1 <= self.threads <= MAX_THREADS:  # the servers' --threads, and the profile's
            raise ConfigError(f"threads must be in [1, {MAX_THREADS}], got {self.threads}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"timeout must be finite and > 0, got {self.timeout}")


@dataclass(frozen=True)
class ConfigName:
    """A configuration name taken apart: ``[drafters:]policy[:online]`` (module docstring).

    Example: ``ConfigName.parse("suffix+eagle3:analytic:online", "suffix")`` ->
    drafter "suffix,eagle3", policy "analytic", online True.
    """

    drafter: str
    policy: str
    online: bool

    @classmethod
    def parse(cls, name: str, default_drafter: str) -> ConfigName:
        parts = name.split(":")
        online = parts[-1] == "online" and len(parts) > 1
        if online:
            parts = parts[:-1]
        if len(parts) > 2 or not parts[-1]:
            raise ConfigError(f"bad configuration {name!r}: use [drafters:]policy[:online], "
                              "e.g. suffix+eagle3:analytic")
        drafter = parts[0].replace("+", ",") if len(parts) == 2 else default_drafter
        return cls(drafter, parts[-1], online)


def is_adaptive(name: str) -> bool:
    """Whether configuration ``name`` runs an adaptive policy: ``hybrid``, ``suffix+eagle3:analytic:online``."""
    return ConfigName.parse(name, "").policy in ADAPTIVE


def server_args(name: str, cfg: LoadBenchConfig, eagle3_root: str | None = None) -> str:
    """Engine flags of configuration ``name``: ``plain``, ``static-G`` or an adaptive policy, with
    the drafters the name gives (``ConfigName``); ``eagle3_root``: the publish root of an online one.

    Example: ``server_args("static-3", LoadBenchConfig())`` ->
    ``"--drafter suffix --policy static --num-speculative-tokens 3"`` (+ the common flags).
    """
    parsed = ConfigName.parse(name, cfg.drafter)
    drafters = tuple(kinds_for(SpecConfig(drafter=parsed.drafter)))  # validates them
    name = parsed.policy
    if len(drafters) > 1 and name not in ADAPTIVE and name != "plain":
        raise ConfigError(f"bad configuration {parsed.policy!r} with drafters {parsed.drafter}: several drafters "
                          f"need one of {', '.join(ADAPTIVE)}")
    if name == "plain":
        spec = "--drafter none"
    elif name.startswith("static-"):
        try:
            gamma = int(name.removeprefix("static-"))
        except ValueError:
            raise ConfigError(f"bad configuration {name!r}: static-G needs an integer G") from None
        if not 1 <= gamma <= 16:
            raise ConfigError(f"bad configuration {name!r}: G must be in [1, 16]")
        spec = f"--drafter {parsed.drafter} --policy static --num-speculative-tokens {gamma}"
    elif name in POLICIES and name != "static":
        spec = f"--drafter {parsed.drafter} --policy {name} --num-speculative-tokens {cfg.gamma_max}"
    else:
        raise ConfigError(f"unknown configuration {name!r}; use plain, static-G or one of {', '.join(ADAPTIVE)}")
    if parsed.online:
        if "eagle3" not in drafters or eagle3_root is None:
            raise ConfigError(f"configuration {parsed!r}: online training needs eagle3 among its drafters")
        spec += f" --eagle3-dir {shlex.quote(eagle3_root)} --online-training"
    elif "eagle3" in drafters and cfg.eagle3_dir and name != "plain":
        spec += f" --eagle3-dir {shlex.quote(cfg.eagle3_dir)}"
    common = f"--threads {cfg.threads} --max-num-seqs {cfg.max_num_seqs} --max-waiting 1024"
    profile = f" --profile {shlex.quote(cfg.profile)}" if cfg.profile else ""
    model = f" --model {shlex.quote(cfg.model)}" if cfg.model else ""
    extra = f" {cfg.extra_server_args}" if cfg.extra_server_args else ""
    return f"{spec} {common}{model}{profile}{extra}"


@dataclass
class RunResult:
    config: str
    kind: str  # "rate" or "trace"
    rate: float | None
    summary: dict[str, Any]
    speedup: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> {measured, predicted, gamma}
    records: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> decode-step counters of this run
    repeat: int = 0  # which round over the configurations (--repeats)
    policy: dict[str, float] = field(default_factory=dict)  # the policy's stats() at the end of the run
