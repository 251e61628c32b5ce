"""Per-sequence drafting (``speculative/policy/routing.py``): each sequence of a step gets its own
drafter and length, priced by the policy's cost model; the mixed verification stays lossless."""

from __future__ import annotations

import pytest

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_drafter
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput
from tidespec.speculative.drafters.multi import MultiDrafter, model_free_offers
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import PlanInput, SeqState
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.routing import SequenceRouter
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

V = 48
FLAT = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0, "eagle3": 0.004})


def test_the_router_prices_each_offer_against_the_model_drafter_hand_traced() -> None:
    """The module docstring's example: T flat, eagle3 at gamma 3 predicted 1.20x."""
    router = SequenceRouter(FLAT)
    models = {"eagle3": (3, 1.20)}
    assert router.choose(1, models, {"suffix": (3.2, 4)}) == ("suffix", 4)  # 4.2x
    assert router.choose(1, models, {"suffix": (0.3, 1)}) == ("suffix", 1)  # 1.3x
    assert router.choose(1, models, {}) == ("eagle3", 3)
    assert router.choose(1, {"eagle3": (3, 0.9)}, {}) == ("", 0)  # nothing pays: none
    router.calibration["suffix"] = 0.5
    assert router.choose(1, models, {"suffix": (0.3, 1)}) == ("eagle3", 3)  # 1.15x < 1.20x
    assert router.choose(1, models, {"suffix": (3.2, 4)}) == ("suffix", 4)  # 2.6x


def test_the_router_learns_how_much_of_its_offers_a_drafter_delivers() -> None:
    router = SequenceRouter(FLAT, ema=0.5)
    for _ in range(6):  # suffix promises 4 tokens a step and delivers 1
        router.choose(1, {}, {"suffix": (4.0, 4)})
        router.observe({"suffix": [(4, 4, 1)]})
    assert router.calibration["suffix"] == pytest.approx(0.25, abs=0.02)
    router.choose(1, {}, {"suffix": (2.0, 2)})
    router.observe({})  # routed but nothing accepted: clamped, not zeroed
    assert 0.05 < router.calibration["suffix"] < 0.25


def test_one_step_routes_one_sequence_to_suffix_one_to_the_model_drafter_and_one_to_none() -> None:
    """The per-sequence choice in one step: a sure suffix draft, no suffix draft (the model drafter,
    measured to pay), and a request that opted out (none)."""
    inner = AnalyticPolicy(FLAT, 4, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}), per_sequence=True,
                           probe_every=0)
    policy = Guards(inner, GuardConfig(gamma_max=4))
    assert policy.wants_offers and inner.wants_offers
    for _ in range(30):  # eagle3 accepts 3 of 4; suffix's side drafts are poor on average
        policy.observe(StepStats(num_decode_seqs=3, drafter_outcomes={"eagle3": [(4, 4, 3)]},
                                 shadow_outcomes={"suffix": [(4, 4, 0)]}))
    seqs = [SeqState(1, 0.0, 100, offers={"suffix": (3.9, 4)}), SeqState(2, 0.0, 100),
            SeqState(3, 0.0, 100, override=0, offers={"suffix": (3.9, 4)})]
    out = policy.plan_drafters(PlanInput(3, 0.1, seqs, ("suffix", "eagle3")))
    assert out[1] == ("suffix", 4) and out[2][0] == "eagle3" and out[2][1] > 0 and out[3][1] == 0
    stats = inner.stats()
    assert stats["routed_suffix"] == 2.0 and stats["routed_eagle3"] == 1.0  # the guard turned 3 off after


def test_model_free_offers_are_the_suffix_drafters_own_drafts_with_its_score() -> None:
    model = tiny_llama(V, layers=2, seed=2)
    spec = SpecConfig(drafter="suffix,draft-model", num_speculative_tokens=4)
    drafter = build_drafter(spec, model, 2, 96)
    assert isinstance(drafter, MultiDrafter)
    inputs = [DraftInput(1, [5, 6, 7, 8, 5, 6, 7], 4, SamplingParams()), DraftInput(2, [9, 10, 11], 4, SamplingParams())]
    offers = model_free_offers(drafter, inputs)
    assert set(offers) == {1} and set(offers[1]) == {"suffix"}  # the model drafter offers nothing; 2 has no match
    expected, length = offers[1]["suffix"]
    assert length == 3 and expected == pytest.approx(3.0)  # [5, 6, 7] matched once: [8, 5, 6], each sure


def test_per_sequence_needs_the_analytic_policy() -> None:
    with pytest.raises(ConfigError, match="--per-sequence needs --policy analytic"):
        PolicyConfig(name="bandit", per_sequence=True)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 30, 17, 3]]


def _outputs(engine: LLMEngine, prompts: list[list[int]], opt_out: int = -1) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True), spec_tokens=0 if i == opt_out else None)
           for i, p in enumerate(prompts)]
    done = run_to_completion(engine)
    return [done[i].token_ids for i in ids]


def test_mixed_drafters_in_one_verification_give_plain_decodings_tokens_alone_and_batched() -> None:
    model = tiny_llama(V, layers=3, seed=2, scale=3.0)
    tok = tiny_tokenizer(V)
    cache = CacheConfig(max_model_len=96, max_num_seqs=4)
    plain = [_outputs(LLMEngine(model, tok, EngineConfig(cache=cache)), [p])[0] for p in PROMPTS]
    spec = SpecConfig(drafter="suffix,draft-model", num_speculative_tokens=3)
    profile = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "suffix": 0.0,
                                                                         "draft-model": 0.001})
    steps: list[StepStats] = []

    def engine() -> LLMEngine:
        drafter = build_drafter(spec, model, 4, 96)
        assert isinstance(drafter, MultiDrafter)
        policy = make_policy("analytic", PolicyOptions(
            gamma_max=3, profile=profile, guards=GuardConfig(gamma_max=3), drafters=tuple(drafter.members),
            shadowed=drafter.shadowed, per_sequence=True))
        e = LLMEngine(model, tok, EngineConfig(cache=cache, spec=spec), drafter=drafter, policy=policy)
        e.add_observer(Hooks(step_end=steps.append))
        return e

    assert [_outputs(engine(), [p])[0] for p in PROMPTS] == plain
    assert _outputs(engine(), PROMPTS, opt_out=3) == plain
    mixed = [s for s in steps if len(set(s.seq_drafters.values())) > 1]
    assert mixed, "no step verified drafts of two drafters at once"
    assert any(len(s.seq_drafters) < s.num_decode_seqs for s in mixed)  # and a sequence without a draft beside them
