"""Seeded sampling is reproducible per request with every drafter.

A seeded request draws each output token by the exponential race of (seed, output position)
(``sampling.seeded_draw``), so its text depends on the seed alone: not on how drafts went, on
the suffix drafter's tree grown by earlier requests, or on the gamma a policy picked. Before, the
verifier consumed the request's generator a draft-dependent number of times and the same seeded
request gave a different text each time it was sent to a suffix-drafter engine.
The distribution of race draws is tested by chi-squared in ``test_spec_sampling.py``.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.sampling import SamplingParams, position_seed, seeded_draw
from tidespec.speculative.drafters.draft_model import DraftModelOptions

V = 64
PROMPT = [5, 9, 12, 5, 9, 13, 5, 9, 12, 5, 9]
DRAFTERS = [("none", False), ("ngram", False), ("suffix", False), ("suffix", True), ("draft-model", False),
            ("draft-model", True), ("eagle3", False)]


def test_positions_of_one_request_never_share_noise() -> None:
    for seed in (0, 1, -5, 2**64 - 1, 123456789):
        keys = {position_seed(seed, p) for p in range(20_000)}
        assert len(keys) == 20_000


def test_race_draw_is_exact() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    n = 6_000
    draws = [seeded_draw(p, seed, 3) for seed in range(n)]
    assert 3 not in draws  # a zero-probability token never wins
    counts = [draws.count(i) for i in range(3)]
    assert chisquare(counts, [n * 0.5, n * 0.3, n * 0.2]).pvalue > 0.01
    # a draw depends on (seed, position) alone, not on what was drawn before: any order, same draws
    forward = [seeded_draw(p, 11, k) for k in range(40)]
    assert forward == [seeded_draw(p, 11, k) for k in reversed(range(40))][::-1]
    assert len(set(forward)) > 1  # and the positions do not share one noise


def test_race_over_a_sub_vocabulary_reads_the_target_noise() -> None:
    """A drafter over a subset of the vocabulary (EAGLE-3's draft vocab) draws with the target's
    noise: on the same distribution it picks the very token the target's race picks."""
    vocab = 50
    ids = torch.tensor([2, 5, 7, 30, 49])
    for seed in range(40):
        q = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        q = q / q.sum()
        p = torch.zeros(vocab, dtype=torch.float64)
        p[ids] = q
        assert int(ids[seeded_draw(q, seed, 4, ids, vocab)]) == seeded_draw(p, seed, 4)
    with pytest.raises(ValueError, match="vocabulary size"):
        seeded_draw(q, 0, 0, ids)


def _engine(drafter: str, tree: bool) -> LLMEngine:
    model = tiny_llama(V, layers=4, seed=3, scale=1.5)
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 3, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    cfg = EngineConfig(cache=CacheConfig(max_model_len=160, max_num_seqs=4), spec=spec)
    return LLMEngine(model, tiny_tokenizer(V), cfg, drafter=build_drafter(spec, model, 4, 160))


def _generate(engine: LLMEngine, params: SamplingParams, rid: str) -> list[int]:
    engine.add_request(PROMPT, params, request_id=rid)
    return run_to_completion(engine)[rid].token_ids


# top-p's truncated distribution in make test; the full one in make test-slow
@pytest.mark.parametrize("temperature,top_p", [pytest.param(1.0, 1.0, marks=pytest.mark.slow), (0.7, 0.9)])
def test_same_seed_same_text_five_times_with_every_drafter(temperature: float, top_p: float) -> None:
    """Five identical seeded requests in a row give one text per drafter, although the requests in
    between (other seeds, greedy) grow the suffix tree and move the drafters' state; in float64 the
    text is also the one plain decoding gives (speculation changes no draw)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=2024, max_tokens=40, ignore_eos=True)
    texts: dict[str, list[int]] = {}
    for drafter, tree in DRAFTERS:
        engine = _engine(drafter, tree)
        runs = []
        for i in range(5):
            runs.append(_generate(engine, params, f"r{i}"))
            other = SamplingParams(temperature=temperature, seed=i, max_tokens=30, ignore_eos=True)
            _generate(engine, other, f"other{i}")
            _generate(engine, SamplingParams(max_tokens=20, ignore_eos=True), f"greedy{i}")
        assert all(r == runs[0] for r in runs), f"{drafter} (tree={tree}): seeded texts differ between runs"
        texts[f"{drafter}{'-tree' if tree else ''}"] = runs[0]
    assert all(t == texts["none"] for t in texts.values()), texts


def test_seeded_request_is_independent_of_its_batch_neighbours() -> None:
    """A seeded request sent alone and sent together with others gives the same text (the race
    keys on the request's own seed and positions, not on a stream shared with the step)."""
    engine = _engine("suffix", False)
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=32, ignore_eos=True)
    alone = _generate(engine, params, "alone")
    engine.add_request(PROMPT, params, request_id="together")
    for i in range(3):
        engine.add_request(PROMPT[: 4 + i], SamplingParams(temperature=1.0, seed=i, max_tokens=24), request_id=f"n{i}")
    assert run_to_completion(engine)["together"].token_ids == alone
