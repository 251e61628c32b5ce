"""The trainer's paired judgement: walks in blocks (hand-traced), the paired bootstrap's interval
(over blocks and over sequences), the publish / revert rules, and two heads judged on the same rows (a head
against itself, a trained head against a fresh one, both ways, and on one sequence cut into pieces)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.online.test_distill import VOCAB, _distill_segments, trained_head
from tests.speculative.test_eagle3 import tiny_target
from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head
from tidespec.online.training.eagle3_train import acceptance_stats, walk_chains
from tidespec.online.training.judge import (
    PairedJudgement,
    bootstrap_interval,
    count_sequences,
    gain_interval,
    judge_pair,
    paired_bootstrap,
    walk_head,
)


def test_walk_chains_in_blocks_hand_traced() -> None:
    lead, judged = [2, 0, 0, 1, 0, 0], [True] * 5 + [False]
    assert walk_chains(lead, judged, 2, 4) == (2, 3)  # steps at rows 2 (1 token) and 3 (2 tokens)
    assert walk_chains(lead, judged, 0, 2) == (1, 3)  # row 0's chain reaches past the block
    assert walk_chains(lead, judged, 4, 6) == (1, 1)  # row 4: 1 token (the text ends), row 5 not judged
    assert walk_chains(lead, judged, 0, None) == walk_chains(lead, judged) == (2, 5)


def test_paired_bootstrap_worked_example_and_edges() -> None:
    base, cand = [(10, 18), (9, 17), (11, 19)], [(8, 18), (8, 17), (9, 19)]
    point = 54 / 25 - 54 / 30
    low, high = paired_bootstrap(base, cand, 0.9)
    assert 0.2 < low < point < high < 0.5
    assert paired_bootstrap(base, cand, 0.9) == (low, high)  # seeded: a judgement is reproducible
    assert paired_bootstrap(base, cand, 0.0) == pytest.approx((point, point))
    assert paired_bootstrap(base[:1], cand[:1], 0.9) == (-math.inf, math.inf)  # one block shows no spread
    assert paired_bootstrap(base, base, 0.9) == (0.0, 0.0)  # the same walk in every resample
    with pytest.raises(ValueError, match="differ in number"):
        paired_bootstrap(base, cand[:2], 0.9)
    # with sequences: blocks of one sequence are one sample; no interval from one sequence, else the
    # interval spans the one over blocks and the one over sequences
    assert paired_bootstrap(base, cand, 0.9, groups=[5, 5, 5]) == (-math.inf, math.inf)
    two = paired_bootstrap(base, cand, 0.9, groups=[5, 5, 9])  # sequences (19, 35) / (16, 35) and (11, 19) / (9, 19)
    seqs = bootstrap_interval(torch.tensor([[19.0, 35.0], [11.0, 19.0]], dtype=torch.float64),
                              torch.tensor([[16.0, 35.0], [9.0, 19.0]], dtype=torch.float64), 0.9)
    assert two == (min(low, seqs[0]), max(high, seqs[1])) and 0.0 < two[0] < point < two[1]
    assert paired_bootstrap(base, cand, 0.9, groups=[0, 1, 2], min_groups=4) == (-math.inf, math.inf)
    assert paired_bootstrap(base, cand, 0.9, groups=[0, 1, 2], min_groups=3) == (low, high)
    assert paired_bootstrap(base, cand, 0.0, groups=[5, 5, 5]) == pytest.approx((point, point))
    with pytest.raises(ValueError, match="groups"):
        paired_bootstrap(base, cand, 0.9, groups=[0, 1])


def _judgement(base: float, cand: float, low: float, high: float) -> PairedJudgement:
    return PairedJudgement(rows=100, blocks=4, sequences=4, base=base, cand=cand, row_base=base, row_cand=cand, low=low,
                           high=high, confidence=0.9)


def test_publish_and_revert_rules() -> None:
    assert _judgement(1.8, 2.0, 0.05, 0.35).better(0.0)
    assert not _judgement(1.8, 2.0, -0.05, 0.35).better(0.0)  # a win inside the noise publishes nothing
    assert not _judgement(1.8, 2.0, 0.05, 0.35).better(0.1)  # min_gain applies to the lower end
    assert _judgement(math.nan, 1.5, -math.inf, math.inf).better(0.0)  # nothing to walk for the old head
    assert not _judgement(1.8, math.nan, -math.inf, math.inf).better(0.0)
    assert _judgement(2.0, 1.8, -0.35, -0.05).worse(0.02)  # -0.05 < -0.02 x 2.0
    assert not _judgement(2.0, 1.8, -0.35, -0.03).worse(0.02)  # could be within the margin
    assert _judgement(2.0, math.nan, -math.inf, math.inf).worse(0.02)
    assert not _judgement(math.nan, 1.8, -math.inf, math.inf).worse(0.02)


@pytest.fixture(scope="module")
def heads() -> tuple[torch.nn.Module, Eagle3Head, Eagle3Head, list]:
    """(target, fresh head, trained head, held-out segments) on a tiny float64 target."""
    target = tiny_target(torch.float64, seed=0, vocab=VOCAB)
    train = _distill_segments(target, 8, 32, seed=0)
    held = _distill_segments(target, 4, 40, seed=5)
    torch.manual_seed(1)
    fresh = Eagle3Head(Eagle3Config.for_target(target.cfg)).to(torch.float64).eval()
    trained = Eagle3Head(Eagle3Config.for_target(target.cfg)).to(torch.float64)
    trained.load_state_dict(fresh.state_dict())
    return target, fresh, trained_head(target, trained, train), held


def test_blocks_add_up_to_the_walk_when_a_block_spans_the_segment(heads) -> None:
    target, _, trained, held = heads
    whole = acceptance_stats(trained, target.embed_tokens, held, 3)
    one = acceptance_stats(trained, target.embed_tokens, held, 3, block_rows=40)
    assert len(one.blocks) == len(held)  # one block per segment of 40 rows
    assert (sum(b[0] for b in one.blocks), sum(b[1] for b in one.blocks)) == (whole.walk_steps, whole.walk_tokens)
    cut = acceptance_stats(trained, target.embed_tokens, held, 3, block_rows=8)
    assert len(cut.blocks) == 5 * len(held)  # 40 rows each, blocks of 8
    assert sum(b[0] for b in cut.blocks) >= whole.walk_steps  # every block restarts its walk at its first row


def test_judge_pair_on_the_same_rows(heads) -> None:
    target, fresh, trained, held = heads
    same = judge_pair(trained, trained, target.embed_tokens, held, 3, block_rows=8)
    assert same.gain == 0.0 and (same.low, same.high) == (0.0, 0.0)
    assert not same.better(0.0) and not same.worse(0.0)
    up = judge_pair(fresh, trained, target.embed_tokens, held, 3, block_rows=8)
    assert up.blocks == 20 and up.rows == 160
    assert up.cand > up.base and up.low > 0.0 and up.better(0.0), up
    assert up.row_cand > up.row_base  # the per-row score recorded beside the walk
    down = judge_pair(trained, fresh, target.embed_tokens, held, 3, block_rows=8)
    assert down.worse(0.02) and not down.better(0.0)
    assert down.gain == pytest.approx(-up.gain)
    doc = up.to_json()
    assert doc["walk_accept_len"] == up.cand and doc["judged_blocks"] == 20 and doc["confidence"] == 0.9
    assert up.sequences == doc["judged_sequences"] == 4  # segments without a seq_id: a sequence each

    assert gain_interval(doc) == f" (gain {up.low:+.2f} .. {up.high:+.2f} at 90 % over 4 sequences)"
    assert gain_interval({**doc, "judged_sequences": None}) == f" (gain {up.low:+.2f} .. {up.high:+.2f} at 90 %)"
    assert gain_interval({"confidence": 0.9, "gain_low": None, "gain_high": None}) == " (gain -inf .. +inf at 90 %)"
    assert gain_interval({"accept_len": 1.5}) == gain_interval(None) == ""  # records from before intervals


def test_a_judgement_samples_sequences_not_blocks(heads) -> None:
    """The same rows as four sequences, as one, and as two: one sequence shows no spread, however
    many blocks it is walked in; below ``min_sequences`` the interval is unbounded."""
    target, fresh, trained, held = heads
    four = judge_pair(fresh, trained, target.embed_tokens, held, 3, block_rows=8)
    assert four.better(0.0)
    one_seq = [dataclasses.replace(s, seq_id=7) for s in held]
    assert count_sequences(one_seq) == 1 and count_sequences(held) == 4
    one = judge_pair(fresh, trained, target.embed_tokens, one_seq, 3, block_rows=8)
    assert (one.blocks, one.sequences) == (20, 1) and (one.base, one.cand) == (four.base, four.cand)
    assert (one.low, one.high) == (-math.inf, math.inf) and not one.better(0.0) and not one.worse(0.0)
    pairs = [dataclasses.replace(s, seq_id=i // 2) for i, s in enumerate(held)]
    walk = walk_head(trained, target.embed_tokens, pairs, 3, block_rows=8)
    assert walk.groups == [0] * 10 + [1] * 10 and walk.sequences == 2
    two = judge_pair(fresh, trained, target.embed_tokens, pairs, 3, block_rows=8)
    assert two.sequences == 2 and math.isfinite(two.low)
    assert judge_pair(fresh, trained, target.embed_tokens, pairs, 3, block_rows=8, min_sequences=3).low == -math.inf
    assert judge_pair(fresh, trained, target.embed_tokens, held, 3, block_rows=8, min_sequences=4).better(0.0)
