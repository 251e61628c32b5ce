"""The configuration tree: dataclasses validated on construction, from which ``tidespec.flags`` derives the CLI.

Why this exists: flags, defaults and validation live in one place. Every field of a config
dataclass becomes a ``--flag`` whose help text is the field's ``metadata["help"]``; a field
that holds another config dataclass (``section``) contributes that section's flags, prefixed by
the section's ``prefix``; a field may name its flag outright (``opt(..., flag="--policy")``), so
nesting the tree never renamed a flag. ``flags.dataclass_from_args`` builds the tree back from parsed
flags and so re-runs every section's validation.

The tree::

    EngineConfig
      model      ModelConfig       --model --dtype --device --threads --quantization --quant-group-size
      cache      CacheConfig       --max-model-len --max-num-seqs --enable-prefix-caching --prefix-cache-mb
      scheduler  SchedulerConfig   --max-num-batched-tokens --max-waiting
      spec       SpecConfig        --drafter --num-speculative-tokens --tree --grammar-drafts --drafter-device
        vocab        DraftVocabConfig   --draft-vocab-mode --draft-vocab-core ...
        options      {drafter name: its own options dataclass}, declared by the drafter's module
                     (``DrafterKind(options=..., prefix=...)``) and made flags by ``speculative.registry``:
                     ngram --ngram-min ..., suffix --suffix-factor ..., draft-model --draft-layers ...,
                     eagle3 --eagle3-dir ..., a --drafter-modules plug-in's its own
      policy     PolicyConfig      --policy --profile --guard-kv-usage --guard-temperature
      online     OnlineTrainingConfig  --online-training --signal-dir ... --trainer-* --collect-prompt
        collect      CollectionConfig   --collect-force --collect-epsilon --collect-n-init ...
      structured StructuredConfig  --json-whitespace

Worked example (``tidespec.speculative.registry``, which adds the drafters' sections to ``tidespec.flags``)::

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                      # every flag above
    ns = parser.parse_args(["--drafter", "ngram", "--ngram-min", "2", "--policy", "hybrid"])
    cfg = engine_config_from_args(ns)            # cfg.spec.options["ngram"].min == 2, cfg.policy.name == "hybrid"
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tidespec.errors import ConfigError, check_at_least

T = TypeVar("T")


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field that ``add_dataclass_args`` turns into a ``--flag`` with this help.

    ``choices=`` restricts the values; ``flag="--name"`` names the flag outright (otherwise it is
    the section prefix plus the field name, underscores as dashes); ``min=`` and ``max=`` are
    bounds that a ``Section`` checks on construction."""
    return field(default=default, metadata={"help": help, **kw})


class Section:
    """Base of config sections whose fields declare bounds (``opt(..., min=8, max=64)``): every such
    field is checked on construction, so a section with no other rule needs no ``__post_init__``;
    one that has more rules calls ``super().__post_init__()`` first."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if "min" in f.metadata:
                check_at_least(f.metadata["min"], **{f.name: value})
            if "max" in f.metadata and value > f.metadata["max"]:
                raise ConfigError(f"{f.name} must be <= {f.metadata['max']}, got {value}")


def finite_float(text: str) -> float:
    """The argparse type of every float flag built from a config: a number, not nan or +-inf (which
    pass most range checks, ``nan <= 0`` being false, and then fail far from the flag).

    Example: ``finite_float("0.5")`` -> 0.5; ``finite_float("nan")`` raises
    ``argparse.ArgumentTypeError("must be a finite number, got 'nan'")``.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def output_dir(text: str) -> Path:
    """The argparse type of a command's ``--out`` directory: one that cannot be written is refused
    when the flags are read, not when a run of minutes is done and its results have nowhere to go.
    The check creates the missing directories and removes them again (the run creates them).

    Example: ``output_dir("runs/x")`` -> ``Path("runs/x")``; ``output_dir("README.md/x")`` raises
    ``argparse.ArgumentTypeError("cannot write to README.md/x: ... Not a directory ...")``.
    """
    path = Path(text)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        if not missing:
            if not path.is_dir():
                raise NotADirectoryError(f"{text} is not a directory")
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(f"{text} is not writable")
        else:
            path.mkdir(parents=True)
            for made in missing:  # deepest first
                made.rmdir()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write to {text}: {exc}") from None
    return path


def field_of(cls: type, name: str, help: str | None = None) -> Any:
    """A new field declared as ``cls``'s field ``name`` (default, help, flag, bounds), its help
    optionally reworded: a command that takes some of a section's flags declares them once.

    Example: ``threads: int = field_of(ModelConfig, "threads")`` -> ``--threads``, default 0, min 0,
    max ``MAX_THREADS``, ModelConfig's help.
    """
    f = cls.__dataclass_fields__[name]
    return field(default=f.default, metadata={**f.metadata, **({"help": help} if help is not None else {})})


def section(cls: type, prefix: str = "") -> Any:
    """A dataclass field holding the config section ``cls``; its flags are ``--<prefix>-<field>``."""
    return field(default_factory=cls, metadata={"section": True, "prefix": prefix})


QUANTIZATIONS = ("none", "int8", "int4", "w4a8", "w8a8", "gguf")
HEAD_QUANTIZATIONS = ("none", "int8", "int4", "w8a8")  # what an EAGLE-3 head can draft in (models.eagle3_head)
MAX_THREADS = 4096  # more than any CPU has; torch.set_num_threads overflows past a C int
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's CPU int4 kernel accepts


@dataclass
class ModelConfig(Section):
    model: str | None = opt(None, "HF checkpoint dir or GGUF file; default: embedded SmolLM2-135M-Instruct")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = opt("float32", "weights and activations dtype")
    device: str = opt("cpu", "torch device (cpu, cuda, cuda:1)")
    threads: int = opt(0, "torch intra-op threads (0 = torch default)", min=0, max=MAX_THREADS)
    quantization: Literal["none", "int8", "int4", "w4a8", "w8a8", "gguf"] = opt(
        "none", "quantization of the layers' projections and the LM head, CPU only. int8 (per output channel) / "
                "int4 (per group): weight-only, PyTorch's kernels' arithmetic on bfloat16 activations, LM head "
                "int8. w4a8 / w8a8: GGUF Q4_1 / Q8_0 blocks of 32 (LM head Q8_0) times activations quantized to "
                "int8 per block, integer dot products as llama.cpp does (AVX512-VNNI; the fastest on a CPU). "
                "gguf: a GGUF model's own blocks (Q4_0/1, Q5_0/1, Q8_0, Q3_K-Q6_K) on those kernels, as the file "
                "holds them (other types converted to Q8_0, said at start-up). The "
                "rest of the model keeps --dtype. Greedy speculation gives exactly the quantized model's plain "
                "decoding (README, Guarantees)")
    quant_group_size: int = opt(32, "int4: input weights per scale/zero group (32, 64, 128 or 256; 32 = GGUF Q4_1)")
    compile: bool = opt(False, "torch.compile (inductor) the decode step: plain and verification forwards of "
                               "decode batches run one compiled graph (at most four, compiled at start-up, cached "
                               "on disk); prefill chunks and trees run eager, except on a row-invariant CPU target "
                               "where every forward runs compiled (three graphs). On CUDA: the captured graphs' body "
                               "is compiled first, and so is the EAGLE-3 head's step")
    enforce_eager: bool = opt(False, "on CUDA, run every forward eagerly: no CUDA graphs (by default decode and "
                                     "verification forwards replay graphs captured at start-up)")
    row_invariant: bool = opt(True, "on the CPU, run kernels whose result for a row does not depend on the other "
                                    "rows of a forward (tidespec's exact attention, projection kernels measured "
                                    "row-invariant on this machine): greedy speculation and batching then give "
                                    "exactly plain decoding's tokens; on CUDA, replay graphs of one shape per "
                                    "batch size (8 rows a sequence, the whole key range), so that speculation "
                                    "does (README, Guarantees). --no-row-invariant: PyTorch's SDPA and the "
                                    "fastest kernel per row count, graphs of every row count and key bucket")
    cuda_invariance: Literal["fixed-shape", "row-attention"] = opt(
        "fixed-shape", "how row invariance is made on CUDA: fixed-shape (graphs of one shape per batch size: "
                       "speculation exact, measured on an H200) or row-attention (a Triton attention kernel with a "
                       "fixed reduction order and the usual graphs; experimental: not yet measured on a GPU)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quant_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"quant_group_size must be a power of two in [32, 256] (the int4 kernel's group "
                              f"sizes), got {self.quant_group_size}")
        if self.quantization != "none" and not self.device.startswith("cpu"):
            raise ConfigError(f"--quantization {self.quantization} needs --device cpu (PyTorch's CPU kernels), "
                              f"got {self.device!r}")
        if self.cuda_invariance not in CUDA_INVARIANCE:
            raise ConfigError(f"cuda_invariance must be one of {', '.join(CUDA_INVARIANCE)}, got {self.cuda_invariance!r}")

    @property
    def precision(self) -> str:
        """The dtype, plus the weight quantization if any: "float32", "float32 + int4-g32 weights"."""
        if self.quantization == "none":
            return self.dtype
        q = self.quantization + (f"-g{self.quant_group_size}" if self.quantization == "int4" else "")
        return f"{self.dtype} + {q} weights"


@dataclass
class CacheConfig(Section):
    max_model_len: int = opt(2048, "longest sequence (prompt + output) a request may reach, tokens", min=8)
    max_num_seqs: int = opt(32, "KV slots = most sequences running at once", min=1)
    kv_overcommit: bool = opt(False, "on the CPU, reserve a KV cache larger than the memory available (pages are "
                                     "committed only as sequences grow; the OOM killer ends the server if they "
                                     "all grow); by default such a cache is refused at start-up")
    enable_prefix_caching: bool = opt(True, "reuse the K/V of prompt prefixes computed before (full blocks of "
                                            "--block-size tokens, least recently used evicted); it stays off on a "
                                            "target that is not row-invariant, where a reused prefix could change "
                                            "greedy outputs at near-ties")
    prefix_cache_mb: int = opt(1024, "memory of the prefix cache's blocks beside a slot cache, MiB (on a CPU at "
                                     "most half the memory available at start-up); over the paged cache the "
                                     "cached blocks are the cache's own, shared", min=1)
    kv_cache_memory_mb: int = opt(0, "memory of the paged KV cache of a row-invariant CPU target, MiB: sequences "
                                     "hold blocks of it as they grow, are admitted while blocks are free and "
                                     "preempted (recomputed later) when they run out; 0 = room for --max-num-seqs "
                                     "x --max-model-len, within 90%% of the memory available (other targets "
                                     "reserve --max-model-len per sequence)", min=0)
    block_size: int = opt(16, "tokens per prefix-cache block; the paged KV cache's blocks are this rounded up to "
                              "a multiple of 16 (one of --max-model-len tokens: a slot per sequence)", min=1,
                          max=65536)


@dataclass
class SchedulerConfig(Section):
    max_num_batched_tokens: int = opt(512, "token budget of one engine step (decode + prefill chunks)", min=16)
    max_waiting: int = opt(0, "most requests waiting for a KV slot (free slots not counted); "
                              "0 = unbounded (the server sets a bound)", min=0)


JSON_WHITESPACE = ("compact", "flexible")  # StructuredConfig.json_whitespace


@dataclass
class StructuredConfig(Section):
    json_whitespace: str = opt("compact", "whitespace a JSON constraint (response_format, guided_json) allows: compact "
                                          "= one line, ', ' and ': ' between items, as json.dumps writes it (the grammar "
                                          "then forces keys and separators: free drafts; no runaway whitespace on small "
                                          "models); flexible = any whitespace (indented JSON)",
                               choices=JSON_WHITESPACE, flag="--json-whitespace")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.json_whitespace not in JSON_WHITESPACE:
            raise ConfigError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}, got {self.json_whitespace!r}")


DRAFTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a drafter's name (which exist: speculative.registry)
DEVICE_NAME = re.compile(r"|cpu|cuda(:[0-9]+)?")  # what --drafter-device accepts ("" = the target's device)
# guard defaults, shared with ``speculative.policy.guards.GuardConfig`` (defined once, here)
GUARD_KV_USAGE = 0.9
GUARD_TEMPERATURE = 2.0
POLICIES = ("static", "analytic", "bandit", "hybrid")
CUDA_INVARIANCE = ("fixed-shape", "row-attention")  # ModelConfig.cuda_invariance


DRAFT_VOCAB_MODES = ("off", "static", "dynamic")
# auto draft-vocabulary size for a 49k vocabulary: the shipped head's own 8,192 rows; the size sweep
# (docs/benchmarks/learning.md) found the core decides coverage and 8,192 covers >= 98 % per phase
AUTO_VOCAB_ROWS = 8192


@dataclass
class DraftVocabConfig(Section):
    """EvoSpec's draft vocabulary for the EAGLE-3 (else the draft-model) drafter: a frequency core,
    plus (dynamic) an ARC-managed buffer refilled off the step by HNSW + co-occurrence retrieval."""

    mode: str = opt("off", "draft vocabulary: off (the drafter's own), static (a frequency core only, "
                           "FR-Spec), dynamic (core + a buffer refilled from what the traffic needs)",
                    choices=DRAFT_VOCAB_MODES)
    core: int = opt(0, f"tokens in the static frequency core (0 = auto: V_t no larger than the drafter's own "
                       f"vocabulary or {AUTO_VOCAB_ROWS} tokens, whichever is smaller)", min=0)
    buffer: int = opt(512, "dynamic buffer capacity (ARC)", min=1)
    max_insert: int = opt(32, "dynamic: tokens admitted per out-of-vocabulary event at most", min=1)
    min_residency: int = opt(8, "dynamic: steps a token stays in the buffer before it may be evicted", min=0)
    corpus: str = opt("drafter_boot,code_extra", "workloads (names or .jsonl paths, comma-separated) whose "
                                                 "tokens give the core and seed the co-occurrence graph")

    def core_size(self, own: int) -> int:
        """The core for a drafter with ``own`` trained output rows: ``core``, or (auto) as many
        tokens as keep |V_t| = core + buffer within min(own, AUTO_VOCAB_ROWS), so the output
        layer never costs more than the drafter's own.

        Example: auto, own 8,192, buffer 512 -> dynamic 7,680, static 8,192; own 100 -> dynamic 50
        (at least half the rows stay in the core).
        """
        if self.core:
            return self.core
        rows = min(own, AUTO_VOCAB_ROWS)
        return max(rows - self.buffer, (rows + 1) // 2) if self.mode == "dynamic" else rows

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in DRAFT_VOCAB_MODES:
            raise ConfigError(f"draft vocabulary mode must be one of {', '.join(DRAFT_VOCAB_MODES)}, got {self.mode!r}")
        if not [c for c in self.corpus.split(",") if c.strip()]:
            raise ConfigError("the draft vocabulary corpus names no workload")


@dataclass
class SpecConfig:
    """What to speculate with: the drafter, how far (gamma), chain or tree, and each drafter's knobs."""

    drafter: str = opt("none", "speculative drafter: none, ngram, suffix, draft-model, eagle3, medusa or one a "
                               "--drafter-modules module defines; several joined by commas (e.g. suffix,eagle3) "
                               "for --policy analytic, bandit or hybrid to choose from per step")
    drafter_modules: str = opt("", "comma-separated importable modules that each define a drafter "
                                   "(DRAFTER = DrafterKind(...), see docs/architecture.md), usable by name in "
                                   "--drafter", flag="--drafter-modules")
    num_speculative_tokens: int = opt(4, "draft tokens per step (gamma)")
    tree: bool = opt(False, "allow tree-shaped proposals (drafters that support them)")
    grammar_drafts: bool = opt(True, "a constrained request's draft starts with the tokens its grammar forces (JSON "
                                     "keys, brackets, enum tails), then the drafter's own (--no-grammar-drafts: the "
                                     "drafter's alone)")
    prediction_tokens: int = opt(16, "most draft tokens per step of a request with a predicted output (OpenAI's "
                                     "prediction: the text it expects back; drafted with the request's prompt and "
                                     "output where the output's last tokens occur in them); "
                                     "0 = predictions are not drafted", min=0)
    drafter_device: str = opt("", "device the drafter runs on: cpu, cuda or cuda:N (empty = the target's --device). "
                                  "Only token ids and the target's taps cross devices; "
                                  "EAGLE-3 and the draft model get their own copies of the target weights they read "
                                  "(ngram and suffix run on the host anyway)", flag="--drafter-device")
    vocab: DraftVocabConfig = section(DraftVocabConfig, "draft-vocab")
    # each drafter's own options, keyed by drafter name: the options dataclass its ``DrafterKind`` declares
    # (``speculative.registry``), whose flags the registry adds beside these; a drafter absent here runs
    # on its defaults. Not a flag itself.
    options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        names = self.drafter_names
        bad = [n for n in names if not DRAFTER_NAME.fullmatch(n)]
        if bad or not names or (len(names) > 1 and "none" in names):
            raise ConfigError(f"drafter must be none, a drafter's name or several joined by commas (not none), "
                              f"got {self.drafter!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"drafter names a drafter twice: {self.drafter!r}")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ConfigError(f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}")
        if not 0 <= self.prediction_tokens <= 64:
            raise ConfigError(f"prediction_tokens must be in [0, 64], got {self.prediction_tokens}")
        if not DEVICE_NAME.fullmatch(self.drafter_device):
            raise ConfigError(f"drafter_device must be empty (the target's device), cpu, cuda or cuda:N, "
                              f"got {self.drafter_device!r}")
        bad = [n for n in self.options if not DRAFTER_NAME.fullmatch(n)]
        if bad:
            raise ConfigError(f"options are keyed by drafter name, got {bad[0]!r}")

    def options_for(self, name: str, default: Callable[[], T]) -> T:
        """Drafter ``name``'s options: those given, else ``default()`` (its defaults).

        Example: ``SpecConfig().options_for("ngram", NgramOptions)`` -> ``NgramOptions(min=1, max=4)``.
        """
        got = self.options.get(name)
        return default() if got is None else got

    def with_options(self, name: str, options: Any) -> SpecConfig:
        """A copy whose drafter ``name`` has ``options`` (the other drafters' unchanged)."""
        return dataclasses.replace(self, options={**self.options, name: options})

    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The drafters ``drafter`` names, in order: "suffix,eagle3" -> ("suffix", "eagle3")."""
        return tuple(n.strip() for n in self.drafter.split(",") if n.strip())

    @property
    def online_drafter(self) -> str | None:
        """The drafter ``--online-training`` trains: eagle3 when it is among the drafters, else medusa, else
        None. Example: "suffix,medusa" -> "medusa"."""
        return next((n for n in ("eagle3", "medusa") if n in self.drafter_names), None)

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.num_speculative_tokens > 0


@dataclass
class PolicyConfig:
    """How the speculation length is chosen per step, and when speculation is switched off outright."""

    name: str = opt("static", "speculation-length policy", choices=POLICIES, flag="--policy")
    profile: str | None = opt(None, "profile JSON for analytic/hybrid (default: measured at start-up, cached)")
    guard_kv_usage: float = opt(GUARD_KV_USAGE, "no speculation while KV usage is above this fraction")
    guard_temperature: float = opt(GUARD_TEMPERATURE, "no speculation for requests sampled above this temperature")
    per_sequence: bool = opt(False, "analytic with several drafters (one model-free): each sequence its own drafter "
                                    "and length every step, a model-free drafter's draft priced against the model "
                                    "drafter's estimate")
    trim_drafts: bool = opt(True, "analytic and hybrid: verify only the drafted tokens (across the batch) whose "
                                  "expected accepted share, calibrated per drafter, pays for their rows in the "
                                  "profiled forward; drafters without per-token probabilities are kept whole")
    measured_routes: bool = opt(False, "per-sequence drafting (experimental): scale the model drafter's price by its "
                                       "measured speed (its steps' tokens per second against plain decoding's in the "
                                       "same engine), so the costs the start-up profile leaves out count")
    gate_model_drafters: bool = opt(True, "per-sequence drafting: ask the model drafters only while the goodput "
                                          "measured in alternating epochs (with them, without them) says they pay "
                                          "beside the model-free drafters")

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if self.per_sequence and self.name != "analytic":
            raise ConfigError(f"--per-sequence needs --policy analytic, got {self.name!r}")
        if not 0.0 < self.guard_kv_usage <= 1.0:
            raise ConfigError(f"guard_kv_usage must be in (0, 1], got {self.guard_kv_usage}")
        if self.guard_temperature < 0:
            raise ConfigError(f"guard_temperature must be >= 0, got {self.guard_temperature}")


@dataclass
class CollectionConfig:
    """Inputs of TIDE's Algorithm 1 (selective signal collection) plus the two extensions.

    TIDE does not publish its values; the defaults are ours. A 0.9 short EMA averages roughly the
    last 10 requests and a 0.99 long EMA roughly the last 100, so a shift shows within ~10
    requests while the long average still remembers the old regime. eps=0.02 sits above the
    request-to-request noise of a 10-request mean of a per-request acceptance rate that already
    averages many steps. N_init=20 requests gives a stable starting mean. N_threshold=16384
    signals (~56 MB of bfloat16 taps for a 3x576-wide SmolLM2-135M tap) is a few minutes of
    serving on one GPU and enough for an epoch of a one-layer drafter.
    """

    force: bool = opt(False, "collect training signals all the time, not only after an acceptance drop")
    bootstrap: bool = opt(False, "collect from the start (automatic while nothing, or only a seeded head, is published)")
    epsilon: float = opt(0.02, "selective collection: short-vs-long EMA acceptance drop that means a shift")
    n_init: int = opt(20, "selective collection: requests averaged before shift detection starts")
    n_threshold: int = opt(512, "selective collection: new signal rows that trigger a full training round")
    lambda_short: float = opt(0.9, "selective collection: short EMA decay")
    lambda_long: float = opt(0.99, "selective collection: long EMA decay")

    def __post_init__(self) -> None:
        if not 0.0 <= self.lambda_short < self.lambda_long < 1.0:
            raise ConfigError(f"need 0 <= collect_lambda_short < collect_lambda_long < 1, got "
                              f"{self.lambda_short}, {self.lambda_long}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ConfigError(f"collect_epsilon must be in [0, 1), got {self.epsilon}")
        check_at_least(1, collect_n_init=self.n_init, collect_n_threshold=self.n_threshold)


@dataclass
class OnlineTrainingConfig:
    """Online drafter training while serving: signal capture, the trainer child process, collection."""

    enabled: bool = opt(False, "capture the target's hidden states while serving, train the EAGLE-3 head (or, "
                               "without eagle3 among the drafters, the Medusa heads) in a child process, swap "
                               "better versions in between steps (needs --eagle3-dir / --medusa-dir: the "
                               "publish root)", flag="--online-training")
    signal_dir: str | None = opt(None, "training-signal store directory (default: <publish root>/signals)")
    signal_budget_mb: int = opt(2048, "signal store byte budget in MiB (oldest shards evicted first)")
    poll_s: float = opt(2.0, "seconds between checks for a newly published drafter", flag="--online-poll-s")
    trainer_device: str | None = opt(None, "device of the trainer child process (default: --device)")
    trainer_args: str = opt("", "extra flags for the trainer child process, e.g. \"--threads 1 --epochs 3\"")
    trainer_nice: int = opt(0, "niceness added to the trainer child (e.g. 10): on a CPU shared with serving, the "
                               "engine then runs first and training takes what is left, so rounds take longer")
    trainer_share: float = opt(0.02, "on a CPU shared with serving: fraction of the time serving is busy that the "
                                     "trainer child may run, besides all of its idle time (default 0.02: a server "
                                     "that is never idle still learns, at a measured ~2 %% of its throughput; 0 = "
                                     "paused whenever requests are served; 1 = never paused); a trainer on another "
                                     "--trainer-device always runs")
    trainer_max_restarts: int = opt(5, "restarts in a row of a trainer child that dies within 5 minutes of its start "
                                       "before the server gives up on training (serving goes on)")
    trainer_backoff_max_s: float = opt(60.0, "longest wait before a dead trainer child is restarted (the waits "
                                             "double from 1 s)")
    rollback_min_drafts: int = opt(0, "after a drafter swap, drafts of the new version before its served speedup "
                                      "(the cost model's prediction from its measured acceptance) is compared with the "
                                      "previous version's over the steps before the swap; a loser is swapped back out. "
                                      "0 = off: the trainer already judges every version paired, on the rows captured "
                                      "after it (--served-judge-rows in --trainer-args); this check compares different "
                                      "requests, so a harder stretch of traffic can pass for a worse drafter")
    capture_prompt: bool = opt(False, "also capture prompt positions (labels are the user's text, not the "
                                      "target's outputs; repeated chat templates then dominate the trainer's "
                                      "held-out score)", flag="--collect-prompt")
    lora: bool = opt(True, "with --online-training: align the head with LoRA adapters, learning first (every few hundred rows, "
                           "each update judged on the rows served after it), the whole head later (full rounds); the capture "
                           "also keeps the target's final hidden states, from which full rounds distil its top-k "
                           "(--no-online-lora: full rounds only, on the target's tokens)",
                     flag="--online-lora")
    capture_idle_share: float = opt(0.25, "share of the decode steps that capture training signals while collection is on "
                                          "but no drafter pays (bursts of 16 steps, runs a round can train on): a drafter "
                                          "the policy parks on new traffic still gets the rows to learn it (measured: 22 "
                                          "rows in 64 Chinese requests without; 0 = capture only while speculating pays)")
    collect: CollectionConfig = section(CollectionConfig, "collect")

    def __post_init__(self) -> None:
        if not 0.0 <= self.capture_idle_share <= 1.0:
            raise ConfigError(f"capture_idle_share must be in [0, 1], got {self.capture_idle_share}")
        if self.signal_budget_mb < 1:
            raise ConfigError(f"signal_budget_mb must be >= 1, got {self.signal_budget_mb}")
        if self.poll_s <= 0:
            raise ConfigError(f"online_poll_s must be > 0, got {self.poll_s}")
        if not 0 <= self.trainer_nice <= 19:
            raise ConfigError(f"trainer_nice must be in [0, 19], got {self.trainer_nice}")
        check_at_least(0, rollback_min_drafts=self.rollback_min_drafts)
        if not 0.0 <= self.trainer_share <= 1.0:
            raise ConfigError(f"trainer_share must be in [0, 1], got {self.trainer_share}")
        check_at_least(0, trainer_max_restarts=self.trainer_max_restarts)
        if self.trainer_backoff_max_s <= 0:
            raise ConfigError(f"trainer_backoff_max_s must be > 0, got {self.trainer_backoff_max_s}")
        try:
            shlex.split(self.trainer_args)
        except ValueError as exc:
            raise ConfigError(f"trainer_args is not a valid command-line fragment: {exc}") from None


@dataclass
class EngineConfig:
    model: ModelConfig = section(ModelConfig)
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    spec: SpecConfig = section(SpecConfig)
    policy: PolicyConfig = section(PolicyConfig)
    online: OnlineTrainingConfig = section(OnlineTrainingConfig)
    structured: StructuredConfig = section(StructuredConfig)

    def __post_init__(self) -> None:
        # the rules that read a drafter's own options are that drafter's (``DrafterKind.check``, run by
        # ``speculative.registry.check_config`` before anything loads)
        if self.online.enabled and self.spec.online_drafter is None:
            raise ConfigError("--online-training needs a drafter it can train: eagle3 or medusa (--drafter eagle3, or "
                              "e.g. suffix,medusa)")
        need = self.cache.max_num_seqs * (self.spec.num_speculative_tokens + 1) + 16
        if self.scheduler.max_num_batched_tokens < need:
            # every running sequence must fit its verification tokens in one step, with room left
            # for prefill chunks so a full batch of decoders cannot starve new requests
            self.scheduler.max_num_batched_tokens = need
