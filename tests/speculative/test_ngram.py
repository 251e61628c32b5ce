"""Hand-traced tests for the prompt-lookup drafter (tidespec/speculative/drafters/ngram.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tidespec.sampling import SamplingParams
from tidespec.speculative.api import Drafter, DraftInput, Observation
from tidespec.speculative.drafters.ngram import NgramDrafter, find_ngram_match


def draft(drafter: NgramDrafter, tokens: list[int], gamma: int) -> list[int]:
    proposal = drafter.propose([DraftInput(seq_id=7, token_ids=tokens, num_speculative_tokens=gamma, params=SamplingParams())])
    seq = proposal.drafts[7]
    assert seq.parent_indices is None and seq.draft_probs is None
    return seq.token_ids


def reference(tokens: list[int], min_n: int, max_n: int, num: int) -> list[int]:
    """Plain-loop restatement of the rule: longest n, most recent earlier occurrence, overlapping copy."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                seq = list(tokens)
                for t in range(num):
                    seq.append(seq[end + 1 + t])
                return seq[length:]
    return []


def test_readme_example() -> None:
    d = NgramDrafter(min_n=1, max_n=2)
    assert draft(d, [1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert draft(d, [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # past the end of the context the copied span repeats (period [3, 4, 1, 2])
    assert draft(d, [1, 2, 3, 4, 1, 2], 6) == [3, 4, 1, 2, 3, 4]
    assert find_ngram_match(np.array([1, 2, 3, 4, 1, 2]), 1, 2) == (2, 1)


def test_longest_n_wins_over_more_recent_shorter_match() -> None:
    #         0  1  2  3  4  5  6  7  8
    tokens = [7, 1, 2, 9, 5, 2, 8, 1, 2]
    # n=2: [1, 2] ended at index 2 -> copy from index 3
    assert draft(NgramDrafter(1, 2), tokens, 2) == [9, 5]
    # n=1 only: [2] most recently ended at index 5 -> copy from index 6
    assert draft(NgramDrafter(1, 1), tokens, 2) == [8, 1]


def test_most_recent_occurrence_breaks_ties() -> None:
    # [1] occurs earlier at 0 (followed by 5) and at 2 (followed by 6): the most recent wins
    assert draft(NgramDrafter(1, 3), [1, 5, 1, 6, 1], 1) == [6]


def test_min_n_forbids_short_matches() -> None:
    assert draft(NgramDrafter(1, 3), [5, 6, 7, 6], 2) == [7, 6]
    assert draft(NgramDrafter(2, 3), [5, 6, 7, 6], 2) == []


def test_no_match_gives_empty_draft() -> None:
    d = NgramDrafter()
    assert draft(d, [1, 2, 3], 4) == []
    assert draft(d, [1], 4) == []
    assert draft(d, [], 4) == []


def test_gamma_and_max_proposal_cap() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert draft(NgramDrafter(), tokens, 1) == [2]
    assert draft(NgramDrafter(), tokens, 5) == [2, 3, 4, 5, 6]
    assert draft(NgramDrafter(max_proposal=3), tokens, 5) == [2, 3, 4]


def test_repeated_token_run_keeps_proposing() -> None:
    assert draft(NgramDrafter(1, 4), [9, 5, 5, 5], 4) == [5, 5, 5, 5]


def test_matches_reference_on_random_contexts() -> None:
    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        gamma = rng.randrange(1, 8)
        assert draft(NgramDrafter(min_n, max_n), tokens, gamma) == reference(tokens, min_n, max_n, gamma), (
            tokens,
            min_n,
            max_n,
            gamma,
        )


def test_protocol_and_batch() -> None:
    d = NgramDrafter()
    assert isinstance(d, Drafter)
    assert d.name == "ngram" and d.tap_layers == ()
    inputs = [
        DraftInput(seq_id=1, token_ids=[1, 2, 1], num_speculative_tokens=2, params=SamplingParams()),
        DraftInput(seq_id=2, token_ids=[3, 4], num_speculative_tokens=2, params=SamplingParams()),
    ]
    proposal = d.propose(inputs)
    assert proposal.drafts[1].token_ids == [2, 1]
    assert proposal.drafts[2].token_ids == []
    assert proposal.num_draft_tokens == 2
    d.observe([Observation(seq_id=1, token_ids=[1, 2, 1, 2], num_new_cached=1)])
    d.release(1)
    assert d.propose(inputs).drafts[1].token_ids == [2, 1]


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(min_n=0)
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NgramDrafter(max_proposal=0)
