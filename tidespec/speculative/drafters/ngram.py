"""Prompt-lookup (n-gram) drafter: propose what followed the last occurrence of the current suffix.

Why this exists: on self-repetitive workloads (RAG answers quoting the context, code with
repeated identifiers, edits of a given text) the next tokens are often a copy of an earlier
span. Looking that span up costs microseconds, needs no model and no memory, and is the
baseline every model-based drafter must beat (vLLM ``[ngram]``, HF ``prompt_lookup_num_tokens``).

Rule (hand-traceable): let ``s`` be the longest suffix of the context, of length n in
``[min_n, max_n]``, that also occurs *earlier* (its occurrence ends before the last token).
Among its earlier occurrences take the **most recent** one (the field guide's description of
prompt lookup; vLLM takes the earliest instead — recency tracks the local topic better) and
propose the tokens that followed it, up to ``min(gamma, max_proposal)``. When the copy runs into
the end of the context the source overlaps the text being predicted, so it continues LZ77-style:
the span from the occurrence to the end repeats (period ``len - 1 - end_of_occurrence``).

Worked example, ``max_n = 2``, context ``[1, 2, 3, 4, 1, 2]``, gamma 3: the suffix ``[1, 2]``
occurred ending at index 1, so the proposal is the tokens from index 2: ``[3, 4, 1]``; with
gamma 6 it is ``[3, 4, 1, 2, 3, 4]`` (the period ``[3, 4, 1, 2]`` repeats).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidespec.config import opt
from tidespec.errors import ConfigError, check_at_least
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.registry import BuildContext, DrafterKind


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """Longest n in ``[min_n, max_n]`` whose length-n context suffix occurs earlier, and the end
    index of its most recent earlier occurrence; ``(0, -1)`` when nothing matches.

    ``tokens`` is ``[L]``. One vectorised pass per n: ``ok[e]`` stays True while the k tokens
    ending at e equal the k tokens ending at ``L - 1``; the sets shrink as n grows, so the scan
    stops at the first n with no match. Cost O(max_n * L).

    Example: ``find_ngram_match(np.array([1, 2, 3, 4, 1, 2]), 1, 2) == (2, 1)``.
    """
    length = int(tokens.shape[0])
    if length < 2:
        return 0, -1
    ok = tokens[:-1] == tokens[-1]  # [L - 1] candidate end positions e < L - 1
    best_n, best_end = 0, -1
    for n in range(1, max_n + 1):
        if n > 1:
            k = n - 1
            if k >= length - 1:
                break
            ok[k:] &= tokens[: length - 1 - k] == tokens[length - 1 - k]
            ok[:k] = False
        hits = np.flatnonzero(ok)
        if hits.size == 0:
            break
        if n >= min_n:
            best_n, best_end = n, int(hits[-1])
    return best_n, best_end


def copy_continuation(tokens: np.ndarray, end: int, num: int) -> list[int]:
    """The ``num`` tokens after index ``end``, continuing periodically past the end of ``tokens``.

    Example: ``copy_continuation(np.array([1, 2, 3, 4, 1, 2]), 1, 6) == [3, 4, 1, 2, 3, 4]``.
    """
    period = tokens[end + 1 :]  # [P], P >= 1 because end < L - 1
    reps = -(-num // int(period.shape[0]))
    return np.tile(period, reps)[:num].tolist()


class NgramDrafter(DrafterBase):
    """Stateless prompt-lookup drafter (point-mass chains). See the module docstring for the rule."""

    name: str = "ngram"
    model_free = True

    def __init__(self, min_n: int = 1, max_n: int = 4, max_proposal: int = 64) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        check_at_least(1, max_proposal=max_proposal)
        self.min_n = min_n
        self.max_n = max_n
        self.max_proposal = max_proposal

    def draft_one(self, token_ids: list[int], gamma: int) -> list[int]:
        """Proposal for one context (empty when nothing matches or gamma <= 0)."""
        num = min(gamma, self.max_proposal)
        if num <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        n, end = find_ngram_match(tokens, self.min_n, self.max_n)
        if n == 0:
            return []
        return copy_continuation(tokens, end, num)

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        return DraftProposal(
            drafts={inp.seq_id: SeqDraft(self.draft_one(inp.token_ids, inp.num_speculative_tokens)) for inp in inputs}
        )

    def observe(self, observations: list[Observation]) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None


@dataclass
class NgramOptions:
    min: int = opt(1, "n-gram drafter: shortest suffix to match")
    max: int = opt(4, "n-gram drafter: longest suffix to match")

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.min}, {self.max}")


def _build(ctx: BuildContext) -> NgramDrafter:
    o: NgramOptions = ctx.options
    return NgramDrafter(min_n=o.min, max_n=o.max)


DRAFTER = DrafterKind("ngram", NgramDrafter, _build, options=NgramOptions, prefix="ngram",
                      summary="prompt lookup: the continuation of the context's last n-gram")
