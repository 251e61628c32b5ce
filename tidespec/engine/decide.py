"""Which tokens a sequence emits this step: its draft verified against the target's rows (or its next
token sampled when it did not draft), the log-probabilities of what it emits when asked, and the
counts of its draft's outcome.

Why this exists: plain decoding and verification must see the same numbers at each position. Both go
through ``target_rows``: the target's logits rows under a constrained request's grammar mask and its
bias and penalties (``engine/logits.py``), each row as plain decoding would see that position. A
request with none of these takes the forward's argmax as it is (no copy, nothing computed).

Worked example (greedy, a chain draft [5, 7], target rows' argmax [5, 2, 4])::

    decide(seq, fwd, lo, 3, draft)  # -> Decision(VerifyResult([0], [5, 2], False), logprobs=None)
    # with params.logprobs=1: logprobs of 5 at row 0 and of 2 at row 1, each with its row's top token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidespec.engine.logits import TokenLogprob, emitted_rows, token_logprobs
from tidespec.engine.runner import ForwardOutput
from tidespec.engine.sequence import Sequence
from tidespec.sampling import row_argmax, sample_from, seeded_draw, target_probs
from tidespec.speculative.api import SeqDraft
from tidespec.speculative.tree import row_paths
from tidespec.speculative.verify import VerifyResult, verify_greedy, verify_sampled, verify_seeded
from tidespec.stats import StepStats, add_per_position


@dataclass
class Decision:
    """A sequence's emitted tokens this step and, when its request asked, their log-probabilities."""

    result: VerifyResult
    logprobs: list[TokenLogprob] | None = None


def target_rows(seq: Sequence, fwd: ForwardOutput, lo: int, n: int,
                draft: SeqDraft | None) -> tuple[torch.Tensor | None, list[int]]:
    """A sequence's ``n`` logits rows from ``lo`` [n, V] as it chooses from them, and their argmax
    (only when greedy, where anything changed the rows): under its grammar's mask, then its bias,
    ``min_tokens`` and penalties at each row's position (the draft's path before it)."""
    if seq.grammar is None and seq.processing is None:
        return (fwd.logits[lo:lo + n] if fwd.logits is not None else None), fwd.argmax[lo:lo + n]
    assert fwd.logits is not None
    tokens, parents = (draft.token_ids, draft.parent_indices) if draft is not None else ([], None)
    logits = fwd.logits[lo:lo + n]  # [n, V]
    if seq.grammar is not None:
        logits = seq.grammar.constrain(logits, tokens, parents)
    if seq.processing is not None:
        logits = seq.processing.apply(logits, seq.output_ids, row_paths(tokens, parents))
    return logits, row_argmax(logits).tolist() if seq.params.greedy else []


def decide(seq: Sequence, fwd: ForwardOutput, lo: int, n: int, draft: SeqDraft | None) -> Decision:
    """Verify ``draft`` over the ``n`` rows from ``lo`` (a draft of ``n - 1`` tokens), or without a
    draft sample the next token at row ``lo``: argmax, the seeded race draw of the sequence's next
    output position (reproducible per seed), or a draw from the request's generator. Changes nothing
    but the request's random stream."""
    p = seq.params
    logits, argmax = target_rows(seq, fwd, lo, n, draft)
    if draft is None:
        result = VerifyResult([], [_sample(seq, logits, argmax)], True)
    elif p.greedy:
        result = verify_greedy(draft, argmax)
    else:
        assert logits is not None
        if p.seed is not None:
            result = verify_seeded(draft, logits, p, p.seed, len(seq.output_ids))
        else:
            result = verify_sampled(draft, logits, p, seq.generator)
    if p.logprobs is None:
        return Decision(result)
    assert logits is not None
    return Decision(result, token_logprobs(logits, emitted_rows(result.accepted), result.token_ids, p.logprobs))


def _sample(seq: Sequence, logits: torch.Tensor | None, argmax: list[int]) -> int:
    if seq.params.greedy:
        return argmax[0]
    assert logits is not None
    probs = target_probs(logits[:1], seq.params)[0]  # [V]
    if seq.params.seed is not None:
        return seeded_draw(probs, seq.params.seed, len(seq.output_ids))
    return sample_from(probs, seq.generator)


def prompt_logprobs(seq: Sequence, fwd: ForwardOutput, lo: int, start: int, num: int) -> None:
    """Record the log-probabilities of the prompt tokens a prefill chunk predicts: the chunk's rows
    ``lo ..`` (positions ``start .. start + num - 1``) give those of tokens ``start + 1 ..`` that are
    in the prompt, from the target's logits as they are (no penalty applies to a prompt). The
    prompt's first token has none (``None``), as OpenAI's ``echo`` reports it."""
    assert fwd.logits is not None and seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
    prompt = seq.prompt_ids
    k = min(num, len(prompt) - 1 - start)  # rows whose next token is a prompt token
    if k <= 0:
        return
    got = token_logprobs(fwd.logits[lo:lo + k], list(range(k)), prompt[start + 1:start + 1 + k],
                         seq.params.prompt_logprobs)
    seq.prompt_logprobs[start + 1:start + 1 + k] = got


def count_prediction(stats: StepStats, seq: Sequence, drafted: int, accepted: int) -> None:
    """A predicted output's draft of ``drafted`` tokens, ``accepted`` kept: the request's and the step's
    counts; prediction tokens only where it came from the prediction (not from the request's prompt or
    output, ``speculative/prediction.py``)."""
    assert seq.prediction is not None
    seq.stats.add_accepted(drafted, accepted)
    pred_drafted, pred_accepted = seq.prediction.count(drafted, accepted)
    seq.stats.num_accepted_prediction_tokens += pred_accepted
    seq.stats.num_rejected_prediction_tokens += pred_drafted - pred_accepted
    stats.num_prediction_tokens += pred_drafted
    stats.num_accepted_prediction_tokens += pred_accepted


def count_draft(stats: StepStats, seq: Sequence, gamma: int, drafter: str | None, draft: SeqDraft | None,
                res: VerifyResult) -> None:
    """A drafter's draft and its outcome: the request's and the step's counts, the policy's outcomes."""
    depth = draft.depth if draft is not None else 0
    stats.num_short_drafts += int(0 < gamma and depth < gamma)
    if gamma > 0:
        outcome = (gamma, depth, res.num_accepted if depth else 0)
        stats.seq_outcomes.append(outcome)
        stats.seq_accepted[seq.seq_id] = outcome[2]
        stats.drafter_outcomes.setdefault(drafter or "", []).append(outcome)
    if draft is None or not draft.num_tokens:
        return
    seq.stats.add_accepted(draft.num_tokens, res.num_accepted, drafter or "")
    stats.num_drafts += 1
    stats.num_draft_tokens += draft.num_tokens
    stats.num_accepted_tokens += res.num_accepted
    stats.num_draft_depth += depth
    stats.num_rejected += int(res.num_accepted < depth)
    add_per_position(stats.accepted_per_pos, res.num_accepted)


def predicted_drafts(decode: list[Sequence], gammas: dict[int, int], chosen: dict[int, str], cap: int,
                     max_model_len: int) -> dict[int, list[int]]:
    """The drafts of the sequences whose predicted output (``speculative/prediction.py``) offers some this
    step, up to ``cap`` tokens (``--prediction-tokens``) and never past max_tokens or the context: they
    replace the planned drafter's where they are at least as long (``gammas`` and ``chosen`` are updated);
    a request that opted out of speculation has none. Example: a prediction offering 6 tokens, gamma 4
    planned for suffix -> its 6 tokens, gamma 6, no drafter."""
    out: dict[int, list[int]] = {}
    for s in decode:
        if s.prediction is None or s.spec_override == 0 or not cap:
            continue
        room = min(s.remaining_tokens, max_model_len - len(s.token_ids)) - 1
        draft = s.prediction.draft(min(cap, room))
        # a drafter planned for as many tokens or more keeps the step (it may match longer)
        if draft and len(draft) >= gammas.get(s.seq_id, 0):
            out[s.seq_id] = draft
            gammas[s.seq_id] = len(draft)
            chosen.pop(s.seq_id, None)
    return out
