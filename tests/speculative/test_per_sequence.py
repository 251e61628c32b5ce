"""Per-sequence drafting (``speculative/policy/routing.py``): each sequence of a step gets its own
drafter and length, priced by the policy's cost model; the mixed verification stays lossless."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_drafter
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, Observation
from tidespec.speculative.drafters.multi import MultiDrafter, model_free_offers
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import PlanInput, SeqState
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.routing import RouteMeter, SequenceRouter
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
    router.calibration["suffix", 0] = 0.5  # offers below 0.5 tokens deliver half of it
    assert router.choose(1, models, {"suffix": (0.3, 1)}) == ("eagle3", 3)  # 1.15x < 1.20x
    assert router.choose(1, models, {"suffix": (3.2, 4)}) == ("suffix", 4)  # another band: 4.2x
    router.calibration["suffix", 3] = 0.5
    assert router.choose(1, models, {"suffix": (3.2, 4)}) == ("suffix", 4)  # 2.6x


def test_the_router_learns_how_much_of_its_offers_a_drafter_delivers_per_band_and_sequence() -> None:
    router = SequenceRouter(FLAT, ema=0.5)
    for _ in range(6):  # sure offers promise 4 tokens and deliver 1; unsure ones promise 0.4 and deliver 0.6
        router.choose(2, {}, {"suffix": (4.0, 4)}, seq_id=1)
        router.choose(2, {}, {"suffix": (0.4, 1)}, seq_id=2)
        router.observe({1: 1, 2: 1 if _ % 2 else 0, 3: 4})  # 3 was not routed to an offer: ignored
    assert router.calibration["suffix", 3] == pytest.approx(0.25, abs=0.02)
    assert 1.0 < router.calibration["suffix", 0] <= 1.5
    assert set(router.calibration) == {("suffix", 0), ("suffix", 3)}
    router.choose(1, {}, {"suffix": (2.0, 2)}, seq_id=1)
    router.observe({1: 0})  # routed but nothing accepted: clamped, not zeroed
    assert 0.05 < router.calibration["suffix", 3] < 0.25
    router.choose(1, {}, {"suffix": (0.7, 2)}, seq_id=4)
    router.observe({})  # a guard took the sequence's step: no outcome, nothing learnt
    assert ("suffix", 1) not in router.calibration


def _step(seconds: float, tokens: int, batch: int = 1, prefill: int = 0) -> StepStats:
    return StepStats(num_decode_seqs=batch, total_time=seconds, num_emitted_tokens=tokens, num_prefill_tokens=prefill)


def test_the_route_meter_prices_a_route_by_its_measured_speed_hand_traced() -> None:
    """The module docstring's example: T(1, 1) = 10 ms; eagle3 predicted 1.2 takes 15 ms for 1.3 tokens
    (g 0.72), none takes 11 ms for its token (g 0.91): eagle3's factor 0.79, its price 0.95."""
    meter = RouteMeter(FLAT, ema=0.1, min_steps=8)
    for _ in range(7):
        meter.record("eagle3", 1.2, _step(0.015, 1))
        meter.record("eagle3", 1.2, _step(0.015, 2))  # a rejected and an accepted draft: 1.5 tokens on average
    assert 1.0 / 1.8 < meter.g(1, "eagle3") < 2.0 / 1.8 and meter.g(1, "none") == 1.0
    meter = RouteMeter(FLAT, ema=0.1, min_steps=8)
    for _ in range(8):
        meter.record("eagle3", 1.2, _step(0.015, 1))
        assert meter.g(1, "none") == 1.0  # not measured: the profile's word
        meter.record("none", 1.0, _step(0.011, 1))
    meter.record("eagle3", 1.2, _step(0.015, 2))
    meter.record("eagle3", 1.2, _step(0.015, 1))
    g_eagle3 = meter.g(1, "eagle3")
    assert 1.0 / 1.8 < g_eagle3 < 2.0 / 1.8 and meter.g(1, "none") == pytest.approx(1 / 1.1)
    assert meter.factor(1, "eagle3") == pytest.approx(g_eagle3 * 1.1)
    assert meter.g(4, "eagle3") == 1.0  # another bucket: unmeasured
    meter.record("suffix", 2.0, _step(0.010, 3, prefill=16))  # a step with a prompt chunk is not a route's
    meter.record("suffix", 2.0, _step(0.0, 3))
    assert ("suffix" not in {r for _, r in meter.measured()}) and set(meter.measured()) == {(1, "eagle3"), (1, "none")}


def test_measured_routes_send_a_sequence_to_none_once_the_model_drafters_steps_cost_more_than_they_give() -> None:
    """Routed EAGLE-3 steps that are slow in practice (cold steps, taps, catch-up the profile leaves out)
    lose their sequences to plain decoding; a sure suffix offer still wins; only uniform steps count."""
    router = SequenceRouter(FLAT, meter=RouteMeter(FLAT, min_steps=4))
    models = {"eagle3": (3, 1.20)}
    for _ in range(4):
        router.start_step()
        assert router.choose(1, models, {}) == ("eagle3", 3)  # unmeasured: priced by the profile
        router.measure(_step(0.016, 1))  # 1 token in 16 ms where 1.2 x 1.6 = 1.92 were predicted
    for _ in range(4):
        router.start_step()
        router.planned("", 1.0, 1)
        router.measure(_step(0.010, 1))  # none runs at the profile's speed
    router.start_step()
    assert router.choose(1, models, {}) == ("", 0)  # 1.2 x 0.52 < 1
    assert router.choose(1, models, {"suffix": (3.2, 4)}) == ("suffix", 4)
    for _ in range(4):  # slow suffix steps: an offer's price is its calibration's, not scaled
        router.start_step()
        assert router.choose(1, models, {"suffix": (0.2, 1)}) == ("suffix", 1)
        router.measure(_step(0.030, 1))
    assert router.meter.g(1, "suffix") < 0.5  # type: ignore[union-attr]
    router.start_step()
    assert router.choose(1, models, {"suffix": (0.2, 1)}) == ("suffix", 1)
    router.measure(_step(0.010, 9, batch=2))  # mixed routes in one step: nobody's speed
    assert set(router.meter.measured()) == {(1, "eagle3"), (1, "none"), (1, "suffix")}  # type: ignore[union-attr]


def test_the_analytic_policy_measures_routes_from_its_steps_and_its_probes() -> None:
    """A policy whose EAGLE-3 accepts 3 of 4 but whose routed EAGLE-3 steps take 4 plain steps' time:
    sequences without a suffix offer go to none once measured; the policy's probes of EAGLE-3 (the
    suffix drafter's side drafts keep it the batch-level choice) still run and keep its speed measured."""
    inner = AnalyticPolicy(FLAT, 4, measured_routes=True, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}),
                           per_sequence=True, probe_every=6)
    for _ in range(30):
        inner.observe(StepStats(num_decode_seqs=1, drafter_outcomes={"eagle3": [(4, 4, 3)]},
                                shadow_outcomes={"suffix": [(4, 4, 4)]}))
    routed, probes = [], 0
    for _ in range(60):
        before = inner.num_probes
        name, gamma = inner.plan_drafters(PlanInput(1, 0.1, [SeqState(1, 0.0, 100)], ("suffix", "eagle3")))[1]
        if inner.num_probes == before:
            routed.append(name if gamma else "none")
        else:
            probes += 1
            assert name == "eagle3"
        inner.observe(StepStats(num_decode_seqs=1, total_time=0.040 if name == "eagle3" else 0.010,
                                num_emitted_tokens=1, spec_lens={1: gamma},
                                shadow_outcomes={"suffix": [(4, 4, 4)]}))
    assert routed[:3] == ["eagle3"] * 3 and set(routed[-20:]) == {"none"} and probes >= 5
    assert inner.stats()["routed_eagle3"] == routed.count("eagle3") + probes  # a probe's steps count too
    assert inner.stats()["route_speed_eagle3_b1"] < 0.5
    assert inner.priced_out("eagle3") and Guards(inner).priced_out("eagle3")  # its taps need not linger


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
    assert stats["mixed_steps"] == 1.0  # one step verified three routes


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


def test_a_model_free_members_draft_of_a_context_is_proposed_once_for_offer_route_and_shadow() -> None:
    """The shadow drafted after a step is the next step's offer, and the offer the routed draft: the
    suffix drafter proposes each context once; a grown context or a longer gamma is drafted anew."""
    model = tiny_llama(V, layers=2, seed=2)
    drafter = build_drafter(SpecConfig(drafter="suffix,draft-model", num_speculative_tokens=4), model, 2, 96)
    assert isinstance(drafter, MultiDrafter)
    suffix = drafter.members["suffix"]
    calls: list[list[int]] = []
    original = suffix.propose

    def counted(inputs: list[DraftInput]) -> Any:
        calls.append([inp.seq_id for inp in inputs])
        return original(inputs)

    suffix.propose = counted  # type: ignore[method-assign]
    ctx = [5, 6, 7, 8, 5, 6, 7]
    offers = model_free_offers(drafter, [DraftInput(1, ctx, 4, SamplingParams())])
    assert offers[1]["suffix"][1] == 3 and len(calls) == 1
    routed = drafter.propose([DraftInput(1, ctx, 3, SamplingParams(), drafter="suffix")])
    assert routed.drafts[1].token_ids == [8, 5, 6] and len(calls) == 1  # the offer's draft, not proposed again
    drafter.propose([DraftInput(1, ctx, 2, SamplingParams(), drafter="suffix")])
    assert len(calls) == 2  # gamma 2 < the draft's 3 tokens: drafted anew
    grown = [*ctx, 8]
    drafter.observe([Observation(1, grown, 1, None)])  # the shadow drafts the grown context (seq 1 ran suffix: no)
    model_free_offers(drafter, [DraftInput(2, grown, 4, SamplingParams())])
    calls.clear()
    drafter.observe([Observation(2, [*grown, 5], 1, None)])  # 2 did not run suffix: its shadow is drafted
    assert calls == [[2]]
    model_free_offers(drafter, [DraftInput(2, [*grown, 5], 4, SamplingParams())])
    assert calls == [[2]]  # the shadow is the offer
    drafter.release(2)
    model_free_offers(drafter, [DraftInput(2, [*grown, 5], 4, SamplingParams())])
    assert calls == [[2], [2]]  # released: nothing kept


def test_a_cold_draft_the_router_chose_is_not_probed_again_but_a_cold_probe_is() -> None:
    """A sequence routed to a model drafter that lost its context drafts nothing (cold); that step was the
    router's, not a probe, so the next step is planned as usual. A probe that comes back cold is repeated."""
    inner = AnalyticPolicy(FLAT, 4, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}), per_sequence=True,
                           probe_every=1000, probe_budget=0.0)
    seq = [SeqState(1, 0.0, 100)]
    for _ in range(30):  # eagle3 looks good: the router sends the offer-less sequence to it
        inner.observe(StepStats(num_decode_seqs=1, drafter_outcomes={"eagle3": [(4, 4, 3)]}))
    assert inner.plan_drafters(PlanInput(1, 0.1, seq, ("suffix", "eagle3")))[1][0] == "eagle3"
    inner.observe(StepStats(num_decode_seqs=1, num_cold_drafts=1))
    probes = inner.num_probes
    inner.plan_drafters(PlanInput(1, 0.1, seq, ("suffix", "eagle3")))
    assert inner.num_probes == probes  # no probe forced by the router's cold step
    for _ in range(30):  # suffix's side drafts now beat eagle3 at the batch level: eagle3 is probed
        inner.observe(StepStats(num_decode_seqs=1, shadow_outcomes={"suffix": [(4, 4, 4)]}))
    inner.probe_every = 1
    inner.plan_drafters(PlanInput(1, 0.1, seq, ("suffix", "eagle3")))
    assert inner.num_probes == probes + 1
    inner.probe_every = 1000
    inner.observe(StepStats(num_decode_seqs=1, num_cold_drafts=1))  # the probe drafted nothing
    assert inner.plan_drafters(PlanInput(1, 0.1, seq, ("suffix", "eagle3")))[1][0] == "eagle3"
    assert inner.num_probes == probes + 2


def test_measured_routes_price_a_probe_at_the_drafters_measured_speed() -> None:
    inner = AnalyticPolicy(FLAT, 4, measured_routes=True, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}),
                           per_sequence=True, probe_every=1000)
    for _ in range(30):
        inner.observe(StepStats(num_decode_seqs=1, drafter_outcomes={"eagle3": [(4, 4, 2)]},
                                shadow_outcomes={"suffix": [(4, 4, 3)]}))
    table = {d: inner.predicted(1, d) for d in inner.drafters}
    best = {d: max(range(1, 5), key=lambda g, d=d: table[d][g]) for d in inner.drafters}
    assert inner._probe_speedup(1, "eagle3", table, best) == table["eagle3"][best["eagle3"]]  # unmeasured
    assert inner.router is not None and inner.router.meter is not None
    for _ in range(8):
        inner.router.meter.record("eagle3", 2.0, StepStats(num_decode_seqs=1, total_time=0.040, num_emitted_tokens=2))
    assert inner._probe_speedup(1, "eagle3", table, best) == pytest.approx(table["eagle3"][best["eagle3"]] * 0.25)
