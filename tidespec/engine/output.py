"""The output side of a step: append tokens with stop checks, detokenize, build ``RequestOutput``.

Why this exists: stop conditions (EOS, stop token ids, ``max_tokens``, the context, stop strings
that may straddle steps) and incremental detokenization are the same whether a step emitted one
token or a verified draft; keeping them apart from the step loop keeps the step readable and lets
the step finish sequences only after every sequence of the batch was emitted.

Worked example (stop string "\\n\\n", one step emits 3 tokens decoding to "ab", "\\n", "\\nc")::

    pending "ab\\n\\nc" -> the stop string starts at 2 -> delta "ab", finish_reason "stop"
    (a step that ended in "ab\\n" would emit "ab" and hold "\\n" back: it may start "\\n\\n")
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tidespec.engine.logits import TokenLogprob
from tidespec.engine.sequence import Sequence
from tidespec.stats import RequestStats


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text emitted so far (stop strings excluded)
    delta_text: str  # text new in this step
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # per output token so far, when the request asked
    delta_logprobs: list[TokenLogprob] | None = None  # those of delta_token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), when asked

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def emit(seq: Sequence, new_tokens: list[int], eos_ids: frozenset[int], max_model_len: int,
         logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append ``new_tokens`` to ``seq`` up to the first stop, detokenize, and return the output
    (with the log-probabilities of the appended tokens, ``logprobs`` [len(new_tokens)], when given).

    Sets ``seq.finish_reason`` when the sequence stops; freeing its slot is the caller's job.
    """
    now = time.perf_counter()
    if seq.stats.first_token_time is None:
        seq.stats.first_token_time = now
    seq.stats.num_steps += 1
    appended: list[int] = []
    reason: str | None = None
    p = seq.params
    for tok in new_tokens:
        seq.append(tok)
        appended.append(tok)
        if (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
            break
        if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= max_model_len:
            reason = "length"
            break
    seq.pending_text += seq.detok.add(appended)
    if reason is not None:
        seq.pending_text += seq.detok.flush()
    stop_hit = find_stop(seq.pending_text, p.stop)
    if stop_hit is not None:
        seq.pending_text = seq.pending_text[:stop_hit]
        reason = "stop"
        delta = seq.pending_text
        seq.pending_text = ""
    elif reason is not None:
        delta, seq.pending_text = seq.pending_text, ""
    else:
        hold = stop_prefix_len(seq.pending_text, p.stop)  # could still become a stop string
        cut = len(seq.pending_text) - hold
        delta, seq.pending_text = seq.pending_text[:cut], seq.pending_text[cut:]
    seq.emitted_text += delta
    seq.finish_reason = reason
    delta_logprobs = None
    if logprobs is not None:
        delta_logprobs = logprobs[:len(appended)]
        seq.logprobs.extend(delta_logprobs)
    return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.emitted_text, delta,
                         appended, reason is not None, reason, seq.stats,
                         list(seq.logprobs) if logprobs is not None else None, delta_logprobs, seq.prompt_logprobs)


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
