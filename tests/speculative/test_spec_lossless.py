"""Greedy speculative decoding equals plain decoding, for every drafter, gamma, batch and shape."""

from __future__ import annotations

import pytest

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.drafters.draft_model import DraftModelOptions

V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def model():
    # sharp random model: it repeats itself, so n-gram/suffix drafters get real matches
    return tiny_llama(V, layers=3, seed=2, scale=3.0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def generate(model, tok, spec: SpecConfig, prompts: list[list[int]], slots: int, max_tokens: int = 24,
             drafter=None) -> tuple[list[list[int]], int, int]:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=slots), spec=spec)
    if drafter is None:
        drafter = build_drafter(spec, model, slots, 96)
    e = LLMEngine(model, tok, cfg, drafter=drafter)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [e.add_request(p, params) for p in prompts]
    done = run_to_completion(e)
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    accepted = sum(o.stats.num_accepted_tokens for o in done.values())
    return [done[i].token_ids for i in ids], drafted, accepted


def generate_in_batches(model, tok, spec: SpecConfig, batch: int) -> tuple[list[list[int]], int]:
    """PROMPTS run ``batch`` at a time (engines of ``batch`` slots) -> (outputs in order, draft tokens)."""
    got: list[list[int]] = []
    drafted = 0
    for start in range(0, len(PROMPTS), batch):
        outs, d, _ = generate(model, tok, spec, PROMPTS[start:start + batch], slots=batch)
        got.extend(outs)
        drafted += d
    return got, drafted


@pytest.fixture(scope="module")
def plain(model, tok):
    return generate(model, tok, SpecConfig(), PROMPTS, slots=4)[0]


CASES = [("ngram", False), ("suffix", False), ("suffix", True), ("draft-model", False), ("draft-model", True),
         ("medusa", False), ("medusa", True)]  # medusa: zero-initialised heads (trained: test_medusa.py)


@pytest.mark.parametrize("drafter,tree", CASES)
@pytest.mark.parametrize("gamma", [1, 3, 5, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain(model, tok, plain, drafter, tree, gamma, batch):
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=gamma, tree=tree,
                      options={"draft-model": DraftModelOptions(layers=1, tree_top_k=2)})
    got, drafted = generate_in_batches(model, tok, spec, batch)
    assert got == plain
    assert drafted > 0, "the drafter never proposed: the test would not exercise verification"


class FixedDrafter(DrafterBase):
    """Proposes a fixed continuation per sequence (correct or not) to hand-build mixed batches."""

    name = "fixed"

    def __init__(self, plan: dict[int, list[int]]) -> None:
        self.plan = plan  # seq_id -> tokens to propose (truncated to gamma)

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        return DraftProposal({i.seq_id: SeqDraft(self.plan[i.seq_id][:i.num_speculative_tokens])
                              for i in inputs if self.plan.get(i.seq_id)})

    def observe(self, observations: list[Observation]) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None


def test_mixed_gammas_in_one_step_equal_alone(model, tok, plain):
    """Sequences with gamma 0, 2 and 5 in the same steps give the same outputs as each alone."""
    spec = SpecConfig(drafter="ngram", num_speculative_tokens=5)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=3), spec=spec)
    # drafts: half right (the plain continuation with a wrong token spliced in) so both accept and reject paths run
    plan = {0: [], 1: plain[1][1:3], 2: plain[2][1:4] + [1, 2]}
    e = LLMEngine(model, tok, cfg, drafter=FixedDrafter(plan))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [e.add_request(PROMPTS[i], params, spec_tokens=g) for i, g in zip(range(3), (0, 2, 5))]
    seen_mixed = False
    done = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        if sorted(e.last_stats.spec_lens.values()) == [0, 2, 5]:
            seen_mixed = True
    assert seen_mixed
    assert [done[i] for i in ids] == plain[:3]


def test_step_stats_count_rejections_depth_and_short_drafts(model, tok, plain):
    """What the acceptance estimators read, on a hand-built first decode step: seq 0 asks for
    nothing; seq 1 asks for 3, proposes 2 right tokens (short, all accepted); seq 2 asks for 5,
    proposes 3 right then 2 wrong (full depth, cut by a rejection)."""
    spec = SpecConfig(drafter="ngram", num_speculative_tokens=5)
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=3), spec=spec)
    wrong = next(t for t in range(V) if t != plain[2][4])
    plan = {0: [], 1: plain[1][1:3], 2: plain[2][1:4] + [wrong, wrong]}
    e = LLMEngine(model, tok, cfg, drafter=FixedDrafter(plan))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i, g in zip(range(3), (0, 3, 5)):
        e.add_request(PROMPTS[i], params, spec_tokens=g)
    while not e.last_stats.spec_lens:
        e.step()
    s = e.last_stats
    assert sorted(s.spec_lens.values()) == [0, 3, 5]
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 7, 5)
    assert (s.num_rejected, s.num_draft_depth, s.num_short_drafts) == (1, 7, 1)


def synthetic_profile():
    """A memory-bound-looking profile: verifying a few tokens costs little more than one."""
    from tidespec.speculative.policy.speedup import Profile
    return Profile(target_latency={1: 0.010, 4: 0.011, 8: 0.012, 16: 0.016, 64: 0.05},
                   draft_cost={"default": 0.001})


@pytest.mark.parametrize("policy", ["static", "analytic", "bandit", "hybrid"])
def test_every_policy_keeps_greedy_outputs(model, tok, plain, policy):
    """Policies change only how far to speculate, never what is generated."""
    from tidespec.speculative.policy.factory import PolicyOptions, make_policy
    from tidespec.speculative.policy.guards import GuardConfig

    spec = SpecConfig(drafter="ngram", num_speculative_tokens=4)
    pol = make_policy(policy, PolicyOptions(gamma_max=4, profile=synthetic_profile(), seed=3,
                                            guards=GuardConfig(gamma_max=4)))
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    e = LLMEngine(model, tok, cfg, drafter=build_drafter(spec, model, 4, 96), policy=pol)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [e.add_request(p, params) for p in PROMPTS]
    done = {}
    gammas = set()
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        gammas.update(e.last_stats.spec_lens.values())
    assert [done[i] for i in ids] == plain
    assert max(gammas) > 0  # the policy did let the drafter speculate
