"""The settings of ``tidespec bench shift`` and the request trace they describe.

Why this exists: the flags (one ``ShiftBenchConfig`` field = one ``--flag``), their validation
and which prompts each phase of the trace takes are read by every other part of the benchmark —
the runs (``bench.shift.runs``), the side measurements (``bench.shift.measure``), the report
(``bench.shift.report``) and the command (``bench.shift.run``) — so they sit below all of them. The
online configuration's collection settings take their defaults from serving's
(``CollectionConfig`` and ``OnlineTrainingConfig`` in ``tidespec.config``), so the two cannot
drift apart; where the benchmark wants another value for its short trace, the flag's help says why.

Worked example::

    cfg = ShiftBenchConfig(workloads="code,chat:4,code", requests_per_phase=8)
    cfg.phase_specs    # [("code", 8), ("chat", 4), ("code", 8)]
    trace = build_trace(cfg, tokenizer)   # 20 items; the second code phase takes records 8..15
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidespec.config import (
    POLICIES,
    CollectionConfig,
    ConfigError,
    DraftVocabConfig,
    OnlineTrainingConfig,
    PolicyConfig,
    SpecConfig,
    opt,
)
from tidespec.speculative.drafters.eagle3_options import Eagle3Options
from tidespec.speculative.policy.factory import MULTI_DRAFTER_POLICIES
from tidespec.speculative.registry import kinds_for
from tidespec.workloads.loader import Prompt, load_prompts

# ngram, suffix: that drafter alone at a static gamma; vocab-*: the frozen EAGLE-3 drafter over a
# draft vocabulary (EvoSpec): a static frequency core of the dynamic one's full size (FR-Spec), the
# dynamic core + buffer, or the whole target vocabulary; vocab-*-lora: the same, aligned online by
# LoRA adapters (EvoSpec path B); no-learning: frozen's drafters with nothing carried across requests
# (the frozen head, and suffix over the request's own tokens: no tree of past outputs), the control
# that tells the learning a run shows from the prompts' own difficulty
CONFIGS = ("plain", "frozen", "online", "no-learning", "ngram", "suffix", "vocab-static", "vocab-dynamic",
           "vocab-full", "vocab-static-lora", "vocab-dynamic-lora")
ONLINE_CONFIGS = ("online", "vocab-static-lora", "vocab-dynamic-lora")  # each with its own trainer child
# a draft vocabulary of chosen sizes, for a size sweep in one run: vocab-static:CORE, vocab-dynamic:CORE:BUFFER
SIZED_VOCAB = re.compile(r"vocab-static:[1-9]\d*|vocab-dynamic:[1-9]\d*:[1-9]\d*")


@dataclass
class ShiftBenchConfig:
    """Flags of ``tidespec bench shift`` (one field = one ``--flag``)."""

    workloads: str = opt("code_unseen,chat,code_unseen", "phases of the trace: comma-separated workload JSONLs or "
                                                       "built-in names, each optionally NAME:N for N requests")
    requests_per_phase: int = opt(16, "requests of a phase that gives no :N")
    offset: int = opt(0, "skip the first N records of every workload (e.g. the ones a bootstrap drafter saw)")
    max_tokens: int = opt(128, "tokens generated per request (EOS ignored unless --no-ignore-eos)")
    ignore_eos: bool = opt(True, "every request generates --max-tokens tokens; --no-ignore-eos ends each at its EOS "
                                 "as a server does (acceptance then leaves out text past EOS, which serving never "
                                 "drafts and no drafter trained on)")
    gamma: int = opt(4, "speculation length of the speculating configurations (a chain's drafts, or a tree's token "
                          "budget with --tree; the most a policy may choose)")
    tree: bool = opt(False, "every speculating configuration proposes EAGLE-2-style trees of --gamma tokens "
                            "(serving's --tree; EAGLE-3 and suffix: several candidates per position, verified in "
                            "the same --gamma + 1 rows as a chain) instead of chains")
    concurrency: int = opt(4, "most requests in flight (closed loop; with --arrival-rate a client's cap)")
    max_model_len: int = opt(0, "every configuration's KV slots hold this many tokens (0 = just the trace's longest "
                                "prompt + --max-tokens + slack); a compiled step is compiled per cache shape, so "
                                "a caller sharing one compile across runs fixes it")
    compile: bool = opt(False, "every configuration's decode step compiled (the same compiled graphs for all, "
                               "compiled before the first turn); the flag is --compile, read with the target's "
                               "flags", cli=False)
    arrival_rate: float = opt(0.0, "open loop: requests arrive at this mean rate per second (Poisson, seeded by "
                                   "--seed) on each configuration's own clock, so serving has the gaps real "
                                   "traffic has and an online trainer gets them; 0 = closed loop")
    configs: str = opt("plain,frozen,online", "comma-separated subset of plain, frozen, online, no-learning (frozen "
                                             "with nothing carried across requests: suffix without its tree of "
                                             "past outputs), ngram, suffix (that "
                                             "drafter alone at --gamma, static), vocab-static / vocab-dynamic / "
                                             "vocab-full (draft vocabularies), vocab-static-lora / vocab-dynamic-lora "
                                             "(the same with online LoRA alignment), vocab-static:CORE / "
                                             "vocab-dynamic:CORE:BUFFER (chosen sizes: a sweep); 'none' runs only the "
                                             "capture-overhead and signals-vs-recompute measurements")
    drafter: str = opt("eagle3", "drafters of frozen and online: eagle3 or medusa (the learned drafter online "
                                 "trains), or several joined by commas that include one (e.g. suffix,eagle3: --policy "
                                 "analytic, bandit or hybrid chooses per step)")
    policy: str = opt("static", f"speculation policy of frozen and online: {', '.join(POLICIES)} (static: --gamma "
                                "every step)")
    per_sequence: bool = opt(PolicyConfig.per_sequence,
                             "frozen and online under --policy analytic with several drafters (one model-free): "
                             "each sequence its own drafter every step (serving's --per-sequence)")
    profile: str | None = opt(PolicyConfig.profile, "profile JSON of the analytic/hybrid policy of frozen and online "
                                                     "(default: measured at start-up, cached)")
    turn: int = opt(8, "requests per turn: the configurations take turns on slices of the trace, so each phase of "
                       "each is measured in the same minutes (0 = each runs the whole trace, one after another)")
    trainer_share: float = opt(OnlineTrainingConfig.trainer_share,
                               "online: fraction of its busy time the trainer child may run (0 = only while its "
                               "engine is idle; outside the online configuration's turns it is paused)")
    trainer_catchup_s: float = opt(0.0, "online: after each of its configuration's turns the trainer child runs "
                                        "alone this many seconds more, on no configuration's clock: a trainer on "
                                        "hardware of its own (TIDE's decoupled trainer) on a machine that has none "
                                        "to spare (0 = it only gets its share of the turns)")
    bootstrap: str | None = opt(None, "starting drafter: a publish root or an exported EAGLE-3 checkpoint, or "
                                     "a Medusa heads directory (default: a fresh random head; Medusa: the shipped "
                                     "heads on the embedded model, else zero heads)")
    draft_vocab: int = opt(8192, "draft vocabulary of a fresh head (0 = the target's)")
    eagle3_min_draft_prob: float = opt(Eagle3Options.min_draft_prob,
                                       "EAGLE-3 chains of frozen and online stop once their drafts' product of head "
                                       "probabilities is below this (serving's --eagle3-min-draft-prob); 0 = every "
                                       "chain --gamma long, what an acceptance length 'at gamma N' means")
    min_signals: int = opt(4096, "online: new signal rows that trigger a training round (serving's default: "
                                 f"{CollectionConfig.n_threshold})")
    collect_n_init: int = opt(8, "online: requests averaged before shift detection starts (serving's default, "
                                 f"{CollectionConfig.n_init}, would start it after the first shift of the default "
                                 "trace, whose phases are 16 requests)")
    collect_epsilon: float = opt(CollectionConfig.epsilon,
                                 "online: short-vs-long EMA acceptance drop that means a shift")
    collect_force: bool = opt(CollectionConfig.force,
                              "online: collect all the time, not only after a detected shift")
    capture_idle_share: float = opt(OnlineTrainingConfig.capture_idle_share,
                                    "online: share of the decode steps that capture while collection is on but no "
                                    "drafter pays (serving's --capture-idle-share; 0 = only while speculating pays)")
    capture_prompt: bool = opt(OnlineTrainingConfig.capture_prompt,
                               "online: also capture prompt positions (default: the target's outputs only)")
    online_lora: bool = opt(OnlineTrainingConfig.lora,
                            "online: also align the served head with LoRA adapters between full rounds (serving's "
                            "--online-lora: small updates every few dozen rows, each judged on the rows served after "
                            "it; the capture then keeps the target's final hidden states)")
    trainer_threads: int = opt(1, "online: torch threads of the trainer child process")
    trainer_epochs: float = opt(4.0, "online: passes over each round's signals")
    trainer_args: str = opt("", "online: extra train-drafter flags")
    vocab_core: int = opt(DraftVocabConfig.core, "vocab-dynamic: frequency core, 0 = auto (vocab-static gets core + buffer, "
                                                   "or the auto |V_t| bound)")
    vocab_buffer: int = opt(DraftVocabConfig.buffer, "vocab-dynamic: ARC buffer capacity")
    vocab_corpus: str = opt(DraftVocabConfig.corpus, "vocab-*: workloads whose tokens give the core and seed the "
                                                     "co-occurrence graph")
    window: int = opt(8, "requests per point of the acceptance curve")
    bin_s: float = opt(15.0, "seconds per point of the tokens/s curve")
    overhead_repeats: int = opt(2, "capture overhead: off/on pairs (0 = skip)")
    overhead_requests: int = opt(8, "capture overhead: requests per run")
    recompute_rows: int = opt(4096, "signals vs recompute: rows timed (0 = skip)")
    signal_dir: str | None = opt(None, "signals vs recompute: store to read (default: the online run's)")
    seed: int = opt(0, "seed of the trainer")

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("workloads must name at least one workload")
        Eagle3Options(min_draft_prob=self.eagle3_min_draft_prob)  # serving's check of the floor
        unknown = [c for c in self.config_names if c not in CONFIGS and not SIZED_VOCAB.fullmatch(c)]
        if unknown or not (self.config_names or self.configs.strip() == "none"):
            raise ConfigError(f"configs must be a subset of {', '.join(CONFIGS)} (or 'none': only the side "
                              f"measurements), got {self.configs!r}")
        for name in ("requests_per_phase", "max_tokens", "gamma", "concurrency", "min_signals", "collect_n_init",
                     "trainer_threads", "window", "vocab_buffer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("offset", "draft_vocab", "overhead_repeats", "overhead_requests", "recompute_rows", "vocab_core",
                     "max_model_len"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.arrival_rate < float("inf"):  # also refuses nan
            raise ConfigError(f"arrival_rate must be a finite number >= 0, got {self.arrival_rate}")
        if self.gamma > 16:
            raise ConfigError(f"gamma must be <= 16, got {self.gamma}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        PolicyConfig(name=self.policy, per_sequence=self.per_sequence)  # serving's check of --per-sequence
        names = tuple(kinds_for(SpecConfig(drafter=self.drafter)))  # validates the names
        if self.learned is None:
            raise ConfigError(f"drafter must include eagle3 or medusa (frozen and online run the learned drafter), "
                              f"got {self.drafter!r}")
        vocab = [c for c in self.config_names if c.startswith("vocab-")]
        if vocab and self.learned != "eagle3":
            raise ConfigError(f"{vocab[0]}: draft vocabularies are the EAGLE-3 head's (--drafter with eagle3)")
        if len(names) > 1 and self.policy not in MULTI_DRAFTER_POLICIES:
            raise ConfigError(f"several drafters ({self.drafter}) need a policy that chooses among them: "
                              f"--policy {', '.join(MULTI_DRAFTER_POLICIES)}")
        if not 0.0 <= self.capture_idle_share <= 1.0:
            raise ConfigError(f"capture_idle_share must be in [0, 1], got {self.capture_idle_share}")
        if self.turn < 0 or self.trainer_catchup_s < 0 or not 0.0 <= self.trainer_share <= 1.0:
            raise ConfigError("turn and trainer_catchup_s must be >= 0 and trainer_share in [0, 1]")
        if not 0.0 <= self.collect_epsilon < 1.0:
            raise ConfigError(f"collect_epsilon must be in [0, 1), got {self.collect_epsilon}")
        if self.trainer_epochs <= 0 or self.bin_s <= 0:
            raise ConfigError("trainer_epochs and bin_s must be > 0")
        for name in ("bootstrap", "signal_dir"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_dir():
                raise ConfigError(f"{name} {value} is not a directory")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ConfigError(f"profile {self.profile} is not a file")

    @property
    def learned(self) -> str | None:
        """The learned drafter frozen and online run (and online trains): eagle3, else medusa (serving's rule)."""
        return SpecConfig(drafter=self.drafter).online_drafter

    @property
    def phase_specs(self) -> list[tuple[str, int]]:
        """``[(workload, requests)]``; ``"chat:32"`` -> ``("chat", 32)``, ``"chat"`` -> ``("chat", requests_per_phase)``."""
        out = []
        for w in (w.strip() for w in self.workloads.split(",")):
            if not w:
                continue
            name, sep, count = w.rpartition(":")
            if sep and count.isdigit() and name:
                if int(count) < 1:
                    raise ConfigError(f"phase {w!r}: the request count must be >= 1")
                out.append((name, int(count)))
            else:
                out.append((w, self.requests_per_phase))
        return out

    @property
    def phases(self) -> list[str]:
        return [name for name, _ in self.phase_specs]

    @property
    def config_names(self) -> list[str]:
        return [c.strip() for c in self.configs.split(",") if c.strip() and c.strip() != "none"]


# ----------------------------------------------------------------------------------------------
# the trace
# ----------------------------------------------------------------------------------------------


@dataclass
class TraceItem:
    phase: int
    workload: str
    prompt: Prompt


def build_trace(cfg: ShiftBenchConfig, tokenizer: Any) -> list[TraceItem]:
    """Phase i takes the next N (its ``:N``, else ``requests_per_phase``) unused records of its workload (after
    ``offset``), so a workload that comes back (code -> chat -> code) brings new prompts.

    Example: workloads "code,chat:2,code", 4 per phase, offset 10 -> code 10..13, chat 10..11, code 14..17.
    """
    cursor: dict[str, int] = {}
    cache: dict[str, list[Prompt]] = {}
    items: list[TraceItem] = []
    specs = cfg.phase_specs
    for i, (name, n) in enumerate(specs):
        if name not in cache:
            need = cfg.offset + sum(k for w, k in specs if w == name)
            cache[name] = load_prompts(name, tokenizer, need)
        start = cfg.offset + cursor.get(name, 0)
        chunk = cache[name][start:start + n]
        if len(chunk) < n:
            raise ConfigError(f"workload {name} has {len(cache[name])} records; phase {i + 1} needs records "
                              f"{start}..{start + n - 1} (ask fewer requests of that phase, or a lower --offset)")
        cursor[name] = cursor.get(name, 0) + n
        items += [TraceItem(i, Path(name).stem, p) for p in chunk]
    return items


def served_label(version: int, adapter: int = 0) -> str:
    """The drafter serving: ``v2``, or ``v2+a3`` with its third LoRA adapter merged."""
    return f"v{version}" + (f"+a{adapter}" if adapter else "")
