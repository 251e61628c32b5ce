"""Predicted Outputs: a request's expected output drafted where its output follows it, never changing it.

The output with any prediction (the output itself, an edit of it, a shuffled or unrelated one) is
plain decoding's, greedy and seeded, alone, batched and beside a drafter; an edit is found again
after an insertion or a deletion; a prediction that matches nothing wastes at most one draft a step
(it is never drafted from); drafts from the request's prompt and output are not prediction tokens.
"""

from __future__ import annotations

import random

import pytest

from tests.helpers import run_to_completion, spec_drafter
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.output import RequestOutput
from tidespec.sampling import SamplingParams
from tidespec.speculative.prediction import PredictionDraft

MAX_TOKENS = 48
MAX_LEN = 256
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef ", "the cat sat on the mat and the ", "1, 2, 3, 4, 5, 6, "]


def run(model, tok, prompts: list[list[int]], params: list[SamplingParams], slots: int = 1,
        spec: SpecConfig | None = None) -> tuple[list[RequestOutput], LLMEngine]:
    spec = spec or SpecConfig()
    cfg = EngineConfig(cache=CacheConfig(max_model_len=MAX_LEN, max_num_seqs=slots), spec=spec)
    e = LLMEngine(model, tok, cfg, drafter=spec_drafter(spec, model, slots, MAX_LEN))
    ids = [e.add_request(p, q) for p, q in zip(prompts, params)]
    done = run_to_completion(e)
    return [done[i] for i in ids], e


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(model, tok, prompts) -> list[list[int]]:
    outs, _ = run(model, tok, prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts))
    return [o.token_ids for o in outs]


def edit(ids: list[int], seed: int) -> list[int]:
    """An edit of ``ids``: a token replaced, a few inserted, a few deleted (as a code edit would)."""
    rng = random.Random(seed)
    out = list(ids)
    out[len(out) // 4] = 200
    i = len(out) // 2
    out[i:i] = [201, 202, 203]
    j = 3 * len(out) // 4
    del out[j:j + 3]
    rng.shuffle(out[-2:])
    return out


def predicted(outs: list[RequestOutput]) -> tuple[int, int]:
    return (sum(o.stats.num_accepted_prediction_tokens for o in outs),
            sum(o.stats.num_rejected_prediction_tokens for o in outs))


@pytest.mark.parametrize("slots", [1, 3])
def test_an_edited_prediction_leaves_the_output_and_is_mostly_accepted(model, tok, prompts, plain, slots) -> None:
    total = sum(map(len, plain))
    # (the prediction, the least share of the output accepted from it, the most steps per output token):
    # the output itself, then an edit of it (four changes in 30-48 tokens, each costing a ramp-up)
    for make, share, steps_per_token in ((lambda ids, i: list(ids), 0.8, 0.25), (edit, 0.45, 0.6)):
        params = [SamplingParams(max_tokens=MAX_TOKENS, prediction=make(ids, i)) for i, ids in enumerate(plain)]
        outs, _ = run(model, tok, prompts, params, slots=slots)
        assert [o.token_ids for o in outs] == plain
        accepted, _ = predicted(outs)
        assert accepted >= share * total, "the prediction was not followed (through the edits)"
        steps = sum(o.stats.num_steps for o in outs)
        assert steps <= steps_per_token * total, "drafts many tokens a step where they keep being accepted"


def test_a_prediction_that_matches_nothing_wastes_at_most_one_draft_a_step(model, tok, prompts, plain) -> None:
    seen = {t for ids in plain for t in ids}
    unrelated = [[t for t in range(1, len(tok)) if t not in seen][:40]] * len(prompts)  # tokens no output has
    outs, e = run(model, tok, prompts, [SamplingParams(max_tokens=MAX_TOKENS, prediction=u) for u in unrelated])
    assert [o.token_ids for o in outs] == plain
    for s in e.history:
        assert s.num_prediction_tokens - s.num_accepted_prediction_tokens <= s.num_decode_seqs
    accepted, rejected = predicted(outs)
    assert accepted == 0 and rejected <= len(prompts), "at most one probe each at the start, then nothing once lost"


def test_predictions_beside_a_drafter_and_seeded_sampling_stay_exact(model, tok, prompts, plain) -> None:
    spec = SpecConfig(drafter="suffix", num_speculative_tokens=4)
    mixed = [SamplingParams(max_tokens=MAX_TOKENS, prediction=edit(plain[0], 0)), SamplingParams(max_tokens=MAX_TOKENS),
             SamplingParams(max_tokens=MAX_TOKENS, prediction=list(reversed(plain[2])))]
    outs, e = run(model, tok, prompts, mixed, slots=3, spec=spec)
    assert [o.token_ids for o in outs] == plain
    assert sum(s.num_draft_tokens for s in e.history) > 0 and predicted(outs)[0] > 0
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3 + i) for i in range(len(prompts))]
    want, _ = run(model, tok, prompts, seeded)
    with_pred = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3 + i,
                                prediction=edit(w.token_ids, i)) for i, w in enumerate(want)]
    got, _ = run(model, tok, prompts, with_pred, slots=3, spec=spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert predicted(got)[0] > 0


def test_the_longest_match_drafts_and_only_the_predictions_drafts_count() -> None:
    """The module's worked example; then the output repeating itself and the prompt: drafted (twice the
    match, never past its text), and not counted as prediction tokens."""
    pd = PredictionDraft([1, 2, 3, 4, 5, 6], cap=8, prompt=[7, 8, 10, 11])
    assert pd.draft(16) == []  # no output yet
    pd.advance([1])
    assert pd.draft(16) == [2, 3] and pd.from_prediction  # the output is the prediction's start
    pd.advance([2, 9])
    assert pd.draft(16) == []  # (2, 9) occurs nowhere before
    pd.advance([4, 5])
    assert pd.draft(16) == [6] and pd.from_prediction  # (4, 5) in the prediction, to its end
    assert pd.count(1, 1) == (1, 1) and (pd.accepted, pd.rejected) == (1, 0)
    pd.advance([6, 30, 31, 32, 33, 30, 31])
    assert pd.draft(16) == [32, 33, 30, 31] and not pd.from_prediction  # the output's own (30, 31), twice 2
    assert pd.draft(2) == [32, 33]  # the limit
    assert pd.count(4, 2) == (0, 0) and (pd.accepted, pd.rejected) == (1, 0)
    pd.advance([40, 7, 8])
    assert pd.draft(16) == [10, 11] and not pd.from_prediction  # the prompt's (7, 8), up to its end
    pd.advance([1, 2])
    assert pd.draft(16) == [3, 4, 5, 6] and pd.from_prediction  # (1, 2): the output's own and the prediction's


def test_a_long_match_in_the_prediction_drafts_up_to_the_cap() -> None:
    pred = list(range(100, 140))
    pd = PredictionDraft(pred, cap=16)
    pd.advance(pred[:3])
    assert pd.draft(64) == pred[3:9]  # twice the match of 3
    pd.advance(pred[3:20])
    assert pd.draft(64) == pred[20:36] and pd.draft(5) == pred[20:25]  # the cap, then the limit
