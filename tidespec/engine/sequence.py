"""Per-request state: tokens, KV ownership, sampling generator, streaming text, statistics.

Why this exists: the scheduler, runner and verifier all act on a request; keeping its state in
one dataclass (and nothing in globals) makes continuous batching and abort easy to reason about.

Token bookkeeping: ``token_ids = prompt_ids + output_ids``; ``num_cached`` tokens have final K/V
in the target cache. While decoding, exactly one token (the last output) is not yet cached. A
sequence preempted for lack of KV blocks (``engine/scheduler.py``) loses its cache and is
prefilled again later: over every token but that last one (``prefill_len``), then decodes on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tidespec.engine.detok import IncrementalDetokenizer
from tidespec.engine.logits import LogitsProcessing, TokenLogprob
from tidespec.sampling import SamplingParams
from tidespec.speculative.prediction import PredictionDraft
from tidespec.stats import RequestStats
from tidespec.structured.grammar import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity equality: queues remove sequences by identity, never by field values
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    spec_override: int | None = None  # per-request gamma (0 = opt out), None = policy decides
    label: str | None = None  # route/domain label for bucketed metrics
    grammar: GrammarMatcher | None = None  # a constrained request's position in its grammar (committed tokens)
    processing: LogitsProcessing | None = None  # its bias, min_tokens and penalties (None: the logits as they are)
    prediction: PredictionDraft | None = None  # where its output stands in its predicted output (Predicted Outputs)
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in sync
    num_cached: int = 0
    slot: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    pending_text: str = ""  # detokenized text held back while it could start a stop string
    emitted_text: str = ""  # text already given to the client
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), when asked

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prefill computes the logits of every prompt row: the first prefill of a request
        that asked for the prompt's log-probabilities (after a preemption they are known)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill computes: the prompt, or after a preemption every token but the last output."""
        return len(self.token_ids) - 1 if self.output_ids else len(self.prompt_ids)

    def prefill_tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of its prefill: the prompt's, or after a preemption its tokens so far."""
        return (self.token_ids if self.output_ids else self.prompt_ids)[start:end]

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_len

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def append(self, tok: int) -> None:
        self.output_ids.append(tok)
        self.token_ids.append(tok)
