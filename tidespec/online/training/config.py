"""``TrainerConfig``, the flags of ``tidespec train-drafter``, and ``TrainerConfigError``.

Why this exists: the trainer's settings are read by the command line (``trainer.cli``), the process
entry point (``trainer.process.train_drafter``), the rounds (``trainer.rounds.DraftTrainer``) and
the benchmarks that drive a trainer in-process (``tidespec bench learn`` / ``bench shift``); one
validated dataclass, apart from the code that runs it, gives each the settings and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tidespec.config import ModelConfig, Section, field_of, opt, section
from tidespec.errors import ConfigError
from tidespec.models.eagle3.lora import ALL_TARGETS, TARGETS, AdapterError, check_targets


class TrainerConfigError(ConfigError):
    """A trainer setting is invalid; the message is one line."""


@dataclass
class LoraAlignConfig:
    """Flags ``--lora-*`` of ``tidespec train-drafter``: EvoSpec Table 5's rank, alpha, beta, temperature and
    buffer; our learning rate, steps and replay window (EvoSpec: lr 1e-5 over far more updates than a 2-core CPU
    runs, and a buffer cleared at every update)."""

    enabled: bool = opt(False, "between full rounds, align the newest head with LoRA adapters from the newest "
                               "signals (the signals must carry the target's hidden states: serve "
                               "with --online-lora)", flag="--lora")
    rank: int = opt(32, "adapter rank")
    targets: str = opt(",".join(TARGETS), "comma-separated linears of every draft layer that get adapters: "
                       + ", ".join(ALL_TARGETS) + " (default: query and value, as EvoSpec)")
    alpha: float = opt(32.0, "adapter scaling numerator (scaling = alpha / rank)")
    beta: float = opt(0.3, "curriculum: unroll step j of a row weighs exp(-beta * L_base * (j - 1))")
    temperature: float = opt(1.0, "distillation temperature of the top-k KL")
    topk: int = opt(20, "target top-k logits the KL runs over")
    kl_threshold: float = opt(0.5, "a row the drafter got right still joins the replay buffer if its draft/target "
                                   "KL exceeds this")
    buffer_rows: int = opt(32, "eligible rows in the replay buffer that trigger an update")
    anchor: float = opt(0.0, "rows the head already drafts well replayed beside the eligible ones, per eligible "
                             "row (0 = a buffer of misses only)")
    steps: int = opt(16, "optimizer steps per update (16 gained earlier than 8 after a shift)")
    lr: float = opt(5e-4, "adapter AdamW learning rate")
    min_rows: int = opt(64, "new signal rows the aligner waits for before it reads them")
    judge_rows: int = opt(256, "an update is judged on at least this many rows served after it (then trained on), "
                               "against the head served meanwhile")
    replay_rows: int = opt(2048, "eligible rows of earlier updates kept in a window and replayed beside the new "
                                 "ones, topping each step up to 8 segments (0 = a buffer cleared at each "
                                 "update)")
    extra_vocab: int = opt(0, "tokens outside the head's own vocabulary the adapters are trained and judged "
                              "on: the newest distinct ones the target emitted, drafted through calibrated rows "
                              "(a dynamic draft vocabulary's buffer; 0 = the head's own vocabulary only)")
    min_coverage: float = opt(0.7, "share of the new rows' next tokens inside the head's vocabulary (with the extra "
                                   "tokens) below which the aligner leaves them to the full rounds: adapters cannot "
                                   "add vocabulary, rounds widen it (measured inside: Arabic 13 %%, Chinese 34 %%, Russian 66 %%, "
                                   "English 86-96 %%; 0 = align on any traffic)")

    @property
    def target_modules(self) -> tuple[str, ...]:
        return check_targets([t.strip() for t in self.targets.split(",") if t.strip()])

    def __post_init__(self) -> None:
        for name in ("rank", "topk", "buffer_rows", "steps", "min_rows", "judge_rows"):
            if getattr(self, name) < 1:
                raise TrainerConfigError(f"lora_{name} must be >= 1, got {getattr(self, name)}")
        try:
            _ = self.target_modules
        except AdapterError as exc:
            raise TrainerConfigError(f"lora_targets: {exc}") from None
        if self.alpha <= 0 or self.temperature <= 0 or self.lr <= 0:
            raise TrainerConfigError("lora_alpha, lora_temperature and lora_lr must be > 0")
        if not 0.0 <= self.min_coverage <= 1.0:
            raise TrainerConfigError(f"lora_min_coverage must be in [0, 1], got {self.min_coverage}")
        if self.beta < 0 or self.kl_threshold < 0 or self.anchor < 0:
            raise TrainerConfigError("lora_beta, lora_kl_threshold and lora_anchor must be >= 0")
        if self.replay_rows < 0 or self.extra_vocab < 0:
            raise TrainerConfigError("lora_replay_rows and lora_extra_vocab must be >= 0")


@dataclass
class TargetOptions:
    """The target a training command loads: ``--model``, ``--dtype``, ``--device``, ``--threads``
    (``train-drafter`` and ``synth-prompts`` both inherit them), declared and checked as the engine's
    ``ModelConfig`` fields they are: same defaults, same bounds, one error message.

    Example: ``SynthPromptsConfig(out="q.jsonl", threads=2**64)`` raises ``ConfigError("threads must
    be <= 4096, got 18446744073709551616")``."""

    model: str | None = field_of(ModelConfig, "model")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = field_of(ModelConfig, "dtype")
    device: str = field_of(ModelConfig, "device", "torch device of the target (cpu, cuda, cuda:1); "
                                                  "train-drafter also trains there")
    threads: int = field_of(ModelConfig, "threads")

    def __post_init__(self) -> None:
        self.model_config()

    def model_config(self) -> ModelConfig:
        """These options as the engine's section (whose construction checks them)."""
        return ModelConfig(model=self.model, dtype=self.dtype, device=self.device, threads=self.threads)


@dataclass
class TrainerConfig(TargetOptions):
    """Flags of ``tidespec train-drafter`` (one field = one ``--flag``)."""

    signal_dir: str = opt("", "signal store directory to watch (written by the engine or --from-workload)")
    publish_root: str = opt("", "drafter publish root (v1/, v2/, LATEST); the engine's --eagle3-dir "
                                "(--medusa-dir with --drafter medusa)")
    medusa_lr: float = opt(1e-3, "AdamW learning rate of Medusa rounds (heads of one layer each fine-tune at the "
                                 "rate they trained at: on 64 Spanish requests, held-out tokens per step gained "
                                 "+0.21 at 1e-4 and +0.32 at 1e-3)")
    drafter: Literal["eagle3", "medusa"] = opt("eagle3", "what the rounds train: an EAGLE-3 head on the target's "
                                                         "taps, or Medusa heads on its final hidden states (rows "
                                                         "captured with them, as a medusa server captures)")
    draft_vocab: int = opt(0, "draft vocabulary of a fresh head, most frequent captured tokens (0 = full vocab)")
    init_from: str | None = opt(None, "exported EAGLE-3 checkpoint to start from when nothing is published")
    widen_vocab: int = opt(1024, "a round adds up to this many tokens of its new rows that the head's draft "
                                 "vocabulary lacks (seen at least twice), with calibrated rows, before it trains (0 = "
                                 "the vocabulary stays): a new script's answers are half outside a pruned head's "
                                 "vocabulary (docs/benchmarks/learning.md)")
    max_draft_vocab: int = opt(16384, "--widen-vocab never grows the draft vocabulary past this")
    carry_unpublished: bool = opt(True, "a round that was not published but beat the current head on average on its "
                                        "held-out rows is where the next round trains on from (its widened "
                                        "vocabulary too); --no-carry-unpublished: every round starts from the "
                                        "published head")
    min_signals: int = opt(16384, "new signal rows (positions) that trigger a training round")
    heldout_frac: float = opt(0.1, "fraction of sequences held out to compare candidate and current drafter")
    epochs: float = opt(2.0, "passes over the round's training segments")
    max_steps: int = opt(0, "optimizer steps per round (0 = from --epochs)")
    min_steps: int = opt(32, "with --max-steps 0, a round trains at least this many optimizer steps: a new domain's "
                             "first rounds hold a few hundred rows, which --epochs passes make 1-5 steps that "
                             "teach a head next to nothing (docs/benchmarks/learning.md)")
    batch_segments: int = opt(8, "segments per optimizer step (per rank)")
    max_segment_len: int = opt(256, "positions per training segment (longer runs are cut)")
    replay_rows: int = opt(4096, "also train on up to this many rows of earlier rounds (newest first), so a round "
                                "on a new domain does not erase the old one; 0 = new rows only")
    lr: float = opt(1e-3, "AdamW peak learning rate of a round that trains a fresh head")
    finetune_lr: float = opt(1e-4, "AdamW peak learning rate of rounds whose versions descend from a trained head "
                                   "(one published before the first round, e.g. the shipped head, or --init-from; a "
                                   "lineage started from a fresh head keeps --lr): 1e-3 lowered a shipped head's "
                                   "walked acceptance on new domains where 1e-4 raised it (docs/benchmarks/learning.md)")
    lr_schedule: Literal["constant", "cosine"] = opt("constant", "learning rate over a round's steps: constant, or "
                                                                  "cosine decay to 10 %% of --lr")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps at the start of each round")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    distill: Literal["soft", "top1"] = opt("soft", "signals with the target's top-k (--topk) train against its "
                                                   "distribution (soft) or its top-1 token (top1)")
    autocast: Literal["none", "bf16"] = opt("none", "training matmuls in bfloat16 (2-3x faster on CPUs with AMX "
                                                     "and on GPUs; weights and optimizer stay float32)")
    head_layers: int = opt(1, "decoder layers of a fresh head (deeper heads accept more and cost more per draft)")
    fusion: Literal["concat", "gated"] = opt("concat", "how a fresh head fuses the target's hidden with the token "
                                                        "embedding: concat (EAGLE-3) or gated (a learned gate mixes the two, as Dovetail)")
    init_from_target: Literal["none", "lm_head", "layer"] = opt(
        "none", "a fresh head starts from the target's weights: lm_head (its LM-head rows and final norm) or layer "
                "(also its last decoder layer, fc passing the highest tap through); none = random")
    ttt_steps: int = opt(3, "training-time-test unroll steps")
    gamma: int = opt(4, "draft length of the simulated-acceptance evaluation")
    min_gain: float = opt(0.0, "publish only if the walked acceptance length (tokens per drafting step) gains more "
                               "than this, at the lower end of its --judge-confidence interval")
    judge_confidence: float = opt(0.9, "both judgements (publish on held-out rows, keep or revert on served rows) "
                                       "compare two heads' walked acceptance on the same rows with a paired "
                                       "bootstrap interval of this confidence (0 = the point estimate)")
    judge_block_rows: int = opt(32, "the judgements walk rows in blocks of this many (each walk starts at its "
                                    "block's first row)")
    judge_min_sequences: int = opt(4, "a round holds out at least this many of its sequences (at most half of them), "
                                      "and the served and LoRA judgements wait for rows of this many: an interval "
                                      "needs two sequences at least (the bootstrap resamples whole sequences as "
                                      "well as blocks), and four judged the sign of a gain far more often than two "
                                      "(docs/benchmarks/learning.md)")
    served_judge_rows: int = opt(256, "after publishing, judge the new version against the one it replaced on this "
                                      "many rows captured after it (both heads' simulated acceptance on the same "
                                      "rows); a loser is reverted by publishing the replaced head again; no round "
                                      "trains meanwhile (0 = no served judgement)")
    served_margin: float = opt(0.02, "the served judgement reverts a version whose walked acceptance length is below "
                                     "the replaced one's by more than this fraction, at the upper end of its "
                                     "--judge-confidence interval")
    poll_s: float = opt(10.0, "seconds between checks of the signal store")
    max_rounds: int = opt(0, "stop after this many training rounds (0 = run until interrupted)")
    once: bool = opt(False, "run one round on the signals available now (at least one row) and exit")
    from_workload: str | None = opt(None, "bootstrap: generate from these comma-separated JSONL workloads, capture, "
                                          "train")
    exclude_workload: str = opt("", "bootstrap: drop prompts that appear in these comma-separated workloads (the "
                                    "ones a benchmark measures on)")
    capture_only: bool = opt(False, "bootstrap: fill --signal-dir from --from-workload and exit without training")
    workload_limit: int = opt(0, "bootstrap: first N records of each workload (0 = all)")
    max_tokens: int = opt(128, "bootstrap: tokens generated per prompt")
    samples: int = opt(1, "bootstrap: continuations per prompt (the first greedy, the others at --temperature)")
    temperature: float = opt(0.8, "bootstrap: sampling temperature of continuations after the first")
    topk: int = opt(0, "bootstrap: capture the target's top-k logits of every position by a teacher pass and "
                       "distil from them (0 = greedy capture while generating, hard labels)")
    budget_mb: int = opt(2048, "signal store byte budget in MiB (bootstrap writes; readers ignore it)")
    seed: int = opt(0, "seed of shuffling and of a fresh head's draft-vocabulary head")
    export_dir: str | None = opt(None, "at the end, write the newest published drafter to this directory as one "
                                      "EAGLE-3 checkpoint (the vLLM/SGLang layout; --bootstrap/--eagle3-dir take it)")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "dtype of the --export-dir weights")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "torch.distributed backend under torchrun")
    progress: bool = opt(True, "show progress bars (rank 0)")
    lora: LoraAlignConfig = section(LoraAlignConfig, "lora")

    def __post_init__(self) -> None:
        TargetOptions.__post_init__(self)
        if not self.signal_dir:
            raise TrainerConfigError("--signal-dir is required")
        if not self.publish_root and not self.capture_only:
            raise TrainerConfigError("--publish-root is required")
        for name in ("threads", "draft_vocab", "widen_vocab", "max_draft_vocab", "max_steps", "min_steps",
                     "max_rounds", "workload_limit", "replay_rows", "topk", "warmup_steps", "served_judge_rows"):
            if getattr(self, name) < 0:
                raise TrainerConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_signals", "batch_segments", "ttt_steps", "gamma", "max_tokens", "budget_mb", "samples",
                     "head_layers"):
            if getattr(self, name) < 1:
                raise TrainerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_segment_len < 2:
            raise TrainerConfigError(f"max_segment_len must be >= 2, got {self.max_segment_len}")
        if not 0.0 < self.heldout_frac < 1.0:
            raise TrainerConfigError(f"heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.epochs <= 0 or self.lr <= 0 or self.finetune_lr <= 0 or self.medusa_lr <= 0 or self.poll_s <= 0:
            raise TrainerConfigError("epochs, lr, finetune_lr, medusa_lr and poll_s must be > 0")
        if self.weight_decay < 0:
            raise TrainerConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.temperature < 0:
            raise TrainerConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.capture_only and not self.from_workload:
            raise TrainerConfigError("--capture-only needs --from-workload")
        if self.samples > 1 and not self.topk:
            raise TrainerConfigError("--samples > 1 needs --topk (sampled continuations are distilled, not imitated)")
        if not 0.0 <= self.served_margin < 1.0:
            raise TrainerConfigError(f"served_margin must be in [0, 1), got {self.served_margin}")
        if self.min_gain < 0:
            raise TrainerConfigError(f"min_gain must be >= 0, got {self.min_gain}")
        if not 0.0 <= self.judge_confidence < 1.0:
            raise TrainerConfigError(f"judge_confidence must be in [0, 1), got {self.judge_confidence}")
        if self.judge_block_rows < 1:
            raise TrainerConfigError(f"judge_block_rows must be >= 1, got {self.judge_block_rows}")
        if self.drafter == "medusa" and (self.lora.enabled or self.topk):
            raise TrainerConfigError("--drafter medusa trains on the target's tokens: no --lora, no --topk")
        if self.judge_min_sequences < 2:
            raise TrainerConfigError(f"judge_min_sequences must be >= 2 (one sample shows no spread), got "
                                     f"{self.judge_min_sequences}")


@dataclass
class PromptSourceConfig(Section):
    """Flags shared by the commands that write training prompts as a workload JSONL."""

    out: str = opt("", "workload JSONL to write (train-drafter --from-workload reads it)")
    count: int = opt(1000, "prompts to write", min=1)
    domain: str = opt("prompts", "domain label and id prefix of the written records")
    exclude_workload: str = opt("", "drop prompts sharing --exclusion-ngram words in a row with a prompt of these "
                                    "comma-separated workloads (the ones a benchmark measures on)")
    exclusion_ngram: int = opt(8, "words in a row that make a prompt overlap a held-out prompt", min=1)
    seed: int = opt(0, "seed of the prompts")
    progress: bool = opt(True, "show a progress bar")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.out:
            raise TrainerConfigError("--out is required")
        if not self.domain.strip():
            raise TrainerConfigError("--domain must not be empty")


@dataclass
class SynthPromptsConfig(PromptSourceConfig, TargetOptions):
    """Flags of ``tidespec synth-prompts`` (one field = one ``--flag``): Magpie self-instruct; query i
    is sampled with seed ``seed * 1000003 + i``."""

    domain: str = opt("self_instruct", "domain label and id prefix of the written records")
    system: str | None = opt(None, "system message before the user's turn (default: the chat template's own); "
                                   "steers the queries, e.g. 'You are a Python programming assistant.'")
    temperature: float = opt(1.0, "sampling temperature of the queries (Magpie: 1.0)")
    top_p: float = opt(1.0, "nucleus mass of the queries")
    max_query_tokens: int = opt(128, "a query that has not ended after this many tokens is dropped", min=1)
    min_words: int = opt(4, "shorter queries are dropped", min=1)
    max_attempts: int = opt(0, "stop after this many sampled queries (0 = 4 x --count)", min=0)
    max_num_seqs: int = opt(16, "queries sampled at once", min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        TargetOptions.__post_init__(self)
        if self.temperature <= 0:
            raise TrainerConfigError(f"temperature must be > 0 (greedy writes one query), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise TrainerConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def attempts(self) -> int:
        """Samples drawn at most: ``max_attempts``, or 4 x ``count`` when it is 0."""
        return self.max_attempts or 4 * self.count


@dataclass
class MinePromptsConfig(PromptSourceConfig):
    """Flags of ``tidespec mine-prompts`` (one field = one ``--flag``): code completion prompts from
    documented functions in Python sources, a sample of them seeded by ``seed``."""

    domain: str = opt("code_mined", "domain label and id prefix of the written records")
    source: str = opt("", "comma-separated directories or .py files to mine (default: the Python standard library)")
    min_doc_words: int = opt(5, "functions whose docstring is shorter are skipped", min=1)
    max_chars: int = opt(1200, "prompts (signature + docstring) longer than this are skipped", min=1)
