"""Several drafters at once: routing, shadow scoring, steps without taps, and losslessness while the
controller switches drafters mid-request."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ScriptedPolicy, capture, run_to_completion, switching_drafters, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, ConfigError, EngineConfig, PolicyConfig, SpecConfig
from tidespec.engine.engine import TAP_LINGER_STEPS, LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.llm import build_drafter, build_policy
from tidespec.models.eagle3.checkpoint import fresh_head
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation, SeqDraft
from tidespec.speculative.drafters.draft_model import DraftModelOptions
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.drafters.multi import MultiDrafter, _first_path, _Shadow, score_shadow
from tidespec.speculative.drafters.ngram import NgramDrafter
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import DrafterPolicy, PlanInput, SeqState, drafter_changed
from tidespec.speculative.policy.bandit_policies import DrafterArms, HybridPolicy
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.profiler import ProfilerConfig, measure_profile
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]
ALL = "suffix,eagle3,draft-model,ngram"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, layers=4, seed=2, scale=3.0)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(V)


def engine(model, tok, spec: SpecConfig, policy=None, slots: int = 4) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=slots), spec=spec)
    return LLMEngine(model, tok, cfg, drafter=build_drafter(spec, model, slots, 96), policy=policy)


def outputs(e: LLMEngine, prompts: list[list[int]], max_tokens: int = 40) -> list[list[int]]:
    ids = [e.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    done = run_to_completion(e)
    return [done[i].token_ids for i in ids]


def test_score_shadow_and_first_path_hand_traced() -> None:
    shadow = _Shadow(start=10, gamma=3, tokens=[5, 6, 7])
    ctx = list(range(10))
    assert score_shadow(shadow, ctx + [5, 9]) == (3, 3, 1)
    assert score_shadow(shadow, ctx + [5]) is None
    assert score_shadow(shadow, ctx + [5, 6, 7]) == (3, 3, 3)
    assert score_shadow(shadow, ctx + [4]) == (3, 3, 0)
    assert _first_path([10, 11, 12, 13], [-1, -1, 0, 2]) == [10, 12, 13]


def test_multi_drafter_validates_and_routes(model) -> None:
    ngram = NgramDrafter()
    with pytest.raises(ValueError, match="at least two"):
        MultiDrafter([ngram])
    with pytest.raises(ValueError, match="differ"):
        MultiDrafter([ngram, NgramDrafter()])
    spec = SpecConfig(drafter="ngram,suffix", num_speculative_tokens=3)
    multi = build_drafter(spec, model, 2, 96)
    assert isinstance(multi, MultiDrafter) and multi.name == "ngram+suffix" and multi.tap_layers == ()
    assert multi.shadowed == {"ngram", "suffix"}
    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    p = multi.propose([DraftInput(0, ctx, 2, SamplingParams(), drafter="suffix"),
                       DraftInput(1, ctx, 2, SamplingParams())])
    assert p.drafts[0].token_ids == [3, 1] and p.drafts[1].token_ids == [3, 1]
    with pytest.raises(ValueError, match="no drafter 'eagle3'"):
        multi.propose([DraftInput(0, ctx, 2, SamplingParams(), drafter="eagle3")])


class _Oracle(DrafterBase):
    """A model-free drafter (named like one) that knows the greedy continuation: it proposes its next
    ``right`` tokens and then one wrong token, so every scored draft is (gamma, right + 1, right)."""

    name = "suffix"
    model_free = True

    def __init__(self, continuation: dict[int, list[int]], right: int) -> None:
        self.continuation = continuation
        self.right = right

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        out = DraftProposal()
        for inp in inputs:
            full = next(c for c in self.continuation.values() if c[:len(inp.token_ids)] == inp.token_ids)
            true = full[len(inp.token_ids):len(inp.token_ids) + self.right]
            out.drafts[inp.seq_id] = SeqDraft(true + [(full[len(inp.token_ids) + self.right] + 1) % V])
        return out

    def observe(self, observations: list[Observation]) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None


def test_shadow_outcomes_score_what_verification_would_accept(model, tok) -> None:
    """Greedy: a shadow draft is scored against the tokens the target produced; an oracle that is
    right for exactly 2 tokens is scored (4, 3, 2) every time, while the engine decodes plainly."""
    plain = outputs(engine(model, tok, SpecConfig()), PROMPTS[:2], max_tokens=40)
    continuation = {i: PROMPTS[i] + plain[i] for i in range(2)}  # 10 tokens past what is generated below
    multi = MultiDrafter([NgramDrafter(), _Oracle(continuation, right=2)], shadow_gamma=4)
    policy = ScriptedPolicy(lambda step, i: ("ngram", 0))
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=2),
                       spec=SpecConfig(drafter="ngram,suffix", num_speculative_tokens=4))
    e = LLMEngine(model, tok, cfg, drafter=multi, policy=policy)
    assert outputs(e, PROMPTS[:2], max_tokens=30) == [p[:30] for p in plain]
    scored = [o for s in policy.seen for o in s.shadow_outcomes.get("suffix", [])]
    assert len(scored) >= 10 and set(scored) == {(4, 3, 2)}
    assert all("ngram" in s.shadow_outcomes or not s.shadow_outcomes for s in policy.seen)


def test_a_controller_switching_drafters_mid_request_keeps_greedy_outputs(model, tok) -> None:
    plain = outputs(engine(model, tok, SpecConfig()), PROMPTS, max_tokens=60)
    spec = SpecConfig(drafter=ALL, num_speculative_tokens=4, options={"draft-model": DraftModelOptions(layers=2)})
    policy = ScriptedPolicy(switching_drafters)
    e = engine(model, tok, spec, policy)
    assert outputs(e, PROMPTS, max_tokens=60) == plain
    ran = {name for s in policy.seen for name, outs in s.drafter_outcomes.items() if any(d for _, d, _ in outs)}
    assert ran == {"suffix", "eagle3", "draft-model", "ngram"}
    assert any(not s.taps for s in policy.seen) and any(s.taps for s in policy.seen)
    assert sum(s.num_cold_drafts for s in policy.seen) > 0  # eagle3 after a stretch without taps
    # the scripted (drafter, gamma) reached the engine: every drafted sequence names its drafter
    assert all(set(s.seq_drafters.values()) <= {"suffix", "eagle3", "draft-model", "ngram"} for s in policy.seen)


def test_true_off_computes_no_taps_and_eagle3_drafts_again_after_a_hole(model, tok) -> None:
    """An EAGLE-3 engine whose policy keeps gamma 0 runs plain decoding's forward (no taps) once
    ``TAP_LINGER_STEPS`` passed; when it drafts again the first step is cold, the next drafts."""
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=3)
    policy = ScriptedPolicy(lambda step, i: ("eagle3", 3 if step <= 5 or step >= 30 else 0))
    e = engine(model, tok, spec, policy, slots=1)
    plain = outputs(engine(model, tok, SpecConfig(), slots=1), PROMPTS[:1], max_tokens=50)
    assert outputs(e, PROMPTS[:1], max_tokens=50) == plain
    taps = [s.taps for s in policy.seen]
    assert taps[:5 + TAP_LINGER_STEPS] == [True] * (5 + TAP_LINGER_STEPS)
    assert not any(taps[5 + TAP_LINGER_STEPS + 1:29])
    assert policy.seen[29].num_cold_drafts == 1 and policy.seen[29].num_drafts == 0
    assert policy.seen[30].num_drafts == 1


class _PricedOut(ScriptedPolicy):
    """A scripted policy that says EAGLE-3 gets no sequence (``api.priced_out``) from step 3 on."""

    def priced_out(self, drafter: str) -> bool:
        return drafter == "eagle3" and self.num_steps >= 3


def test_taps_do_not_linger_after_eagle3_drafts_when_the_policy_priced_it_out(model, tok) -> None:
    """The per-sequence router priced EAGLE-3 out: the steps after its draft run plain decoding's forward
    (no taps) instead of ``TAP_LINGER_STEPS`` of taps; a step where it drafts (a probe) still has them."""
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=3)
    policy = _PricedOut(lambda step, i: ("eagle3", 3 if step <= 5 or step == 20 else 0))
    e = engine(model, tok, spec, policy, slots=1)
    plain = outputs(engine(model, tok, SpecConfig(), slots=1), PROMPTS[:1], max_tokens=40)
    assert outputs(e, PROMPTS[:1], max_tokens=40) == plain
    taps = [s.taps for s in policy.seen]
    assert all(taps[:5]) and not any(taps[5:19]) and taps[19]  # step 20 drafts (cold): taps again
    assert policy.seen[19].num_cold_drafts == 1


class _AnnouncedProbe(_PricedOut):
    """Off from step 6 on except a probe at step 20, which the plan of step 19 announces (``api.probe_due``)."""

    def probe_due(self, drafter: str) -> bool:
        return drafter == "eagle3" and self.num_steps == 19


def test_a_probe_the_policy_announced_finds_eagle3_warm(model, tok) -> None:
    """The step before an announced probe computes the taps, and only that one: the probe drafts instead of
    coming back cold (``AnalyticPolicy.probe_due``), and the output is plain decoding's."""
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=3)
    policy = _AnnouncedProbe(lambda step, i: ("eagle3", 3 if step <= 5 or step == 20 else 0))
    e = engine(model, tok, spec, policy, slots=1)
    plain = outputs(engine(model, tok, SpecConfig(), slots=1), PROMPTS[:1], max_tokens=40)
    assert outputs(e, PROMPTS[:1], max_tokens=40) == plain
    taps = [s.taps for s in policy.seen]
    assert all(taps[:5]) and not any(taps[5:18]) and taps[18] and taps[19] and not any(taps[20:])
    assert policy.seen[19].num_cold_drafts == 0 and policy.seen[19].num_drafts == 1


class _RecordingHybrid(HybridPolicy):
    """The hybrid policy, every step it observes kept in ``seen``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[StepStats] = []

    def observe(self, step: StepStats) -> None:
        self.seen.append(step)
        super().observe(step)


@pytest.mark.parametrize("announced", [True, False])
def test_the_hybrids_replay_of_a_swapped_drafter_finds_it_warm(model, tok, announced: bool) -> None:
    """A random EAGLE-3 head under the hybrid policy settles off (no taps once ``TAP_LINGER_STEPS`` passed); told
    that its weights changed (``api.drafter_changed``), the policy replays its deepest arm at the second plan, and
    the plan before says so (``probe_due``): that step computes the taps and the replay drafts. Without the
    announcement (``announced`` False) the replay comes back cold and runs as an undrafted step: what the first
    version did."""
    profile = Profile(target_latency={1: 0.010, 16: 0.010}, draft_cost={"default": 0.002}, key="t")
    policy = _RecordingHybrid(profile, gamma_max=3, seed=0, prior_alpha=0.3)
    if not announced:
        policy.probe_due = lambda drafter: False  # type: ignore[method-assign]
    e = engine(model, tok, SpecConfig(drafter="eagle3", num_speculative_tokens=3), policy, slots=1)
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=85, ignore_eos=True))
    told = 0
    while e.has_unfinished_requests():
        e.step()
        quiet = policy.seen[-(TAP_LINGER_STEPS + 2):]
        if not told and len(quiet) == TAP_LINGER_STEPS + 2 and not any(s.gamma or s.taps for s in quiet[1:]):
            drafter_changed(e.policy, "eagle3")
            told = len(policy.seen)
    assert told, "the hybrid never settled off"
    before, replay = policy.seen[told], policy.seen[told + 1]
    assert before.gamma == 0 and before.taps == announced
    assert (replay.gamma, replay.num_drafts, replay.num_cold_drafts) == ((3, 1, 0) if announced else (0, 0, 1))


def test_eagle3_restarts_its_context_after_a_hole_in_the_taps() -> None:
    """After a hole the head drafts exactly as a fresh head that only ever saw the later window."""
    target = tiny_llama(V, layers=4, seed=3)
    head = fresh_head(target.cfg, None, target.dtype, target.device)
    ids = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    taps = capture(target, ids, head.cfg.tap_layers)
    cfg = Eagle3DrafterConfig(max_num_seqs=2, max_model_len=64)
    a = Eagle3Drafter(head, target.embed_tokens, cfg)
    a.observe([Observation(0, ids[:11], 10, taps[:10], 0)])
    a.observe([Observation(0, ids[:16], 5, None, 10)])  # five positions without taps
    a.observe([Observation(0, ids[:19], 3, taps[15:18], 15)])
    assert a.propose([DraftInput(0, ids[:20], 3, SamplingParams())]).cold == {0}  # position 18's tap missing
    got = a.propose([DraftInput(0, ids[:19], 3, SamplingParams())]).drafts[0].token_ids
    b = Eagle3Drafter(head, target.embed_tokens, cfg)
    b.observe([Observation(0, ids[15:19], 3, taps[15:18], 0)])
    assert got == b.propose([DraftInput(0, ids[15:19], 3, SamplingParams())]).drafts[0].token_ids


def _profile() -> Profile:
    return Profile(target_latency={1: 0.010, 8: 0.012, 64: 0.05}, draft_cost={"default": 0.0, "suffix": 0.0002,
                                                                              "eagle3": 0.004})


def test_analytic_policy_chooses_the_drafter_and_probes_the_unmeasured_one() -> None:
    pol = AnalyticPolicy(_profile(), 4, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}))
    assert isinstance(pol, DrafterPolicy)
    inp = PlanInput(1, 0.1, [SeqState(7, 0.0, 100)], ("suffix", "eagle3"))
    good, bad = [(4, 4, 4)] * 4, [(4, 1, 0)] * 4
    for _ in range(30):  # suffix (scored on the side) is perfect, eagle3 never accepts
        pol.observe(StepStats(num_decode_seqs=1, shadow_outcomes={"suffix": good}, drafter_outcomes={"eagle3": bad}))
    choices = [pol.plan_drafters(inp)[7] for _ in range(200)]
    assert choices.count(("suffix", 4)) > 150
    probes = [c for c in choices if c[0] == "eagle3"]
    assert 3 <= len(probes) <= 8  # bounded: at most every probe_every (64) steps, sooner when cheap
    for _ in range(30):  # the tables turn
        pol.observe(StepStats(num_decode_seqs=1, shadow_outcomes={"suffix": [(4, 0, 0)] * 4},
                              drafter_outcomes={"eagle3": good}))
    assert pol.plan_drafters(inp)[7] == ("eagle3", 4)
    assert pol.stats()["drafter_b1"] == 1.0 and pol.choices() == {1: ("eagle3", 4)}


def test_analytic_policy_prices_a_model_drafter_at_its_batch_sizes_own_drafting_cost() -> None:
    """EAGLE-3 runs its head over every drafting sequence, so its step costs more at batch 4 than at 1.
    With one D0 for every batch size the controller chose it at both; profiled per batch size, it keeps
    it at batch 1 and decodes plainly at batch 4, where drafting costs twice a plain step."""
    latency = {1: 0.010, 4: 0.011, 16: 0.016, 64: 0.05}
    flat = Profile(target_latency=latency, draft_cost={"default": 0.0, "suffix": 0.0, "eagle3": 0.002})
    rows = {("eagle3", 1): 0.002, ("eagle3", 4): 0.020, ("suffix", 1): 0.0, ("suffix", 4): 0.0}
    per_batch = Profile(target_latency=latency, draft_cost=dict(flat.draft_cost), draft_batch_cost=rows)
    choices = {}
    for name, profile in (("flat", flat), ("per batch", per_batch)):
        pol = AnalyticPolicy(profile, 4, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}),
                             probe_every=10_000)
        for b in (1, 4):
            for _ in range(30):  # eagle3 gets 2 of 4 accepted, suffix (scored on the side) nothing
                pol.observe(StepStats(num_decode_seqs=b, shadow_outcomes={"suffix": [(4, 4, 0)] * b},
                                      drafter_outcomes={"eagle3": [(4, 4, 2)] * b}))
        choices[name] = [pol.plan_drafters(PlanInput(b, 0.1, [SeqState(i, 0.0, 100) for i in range(b)],
                                                     ("suffix", "eagle3")))[0] for b in (1, 4)]
    assert [d for d, _ in choices["flat"]] == ["eagle3", "eagle3"] and choices["per batch"][0] == choices["flat"][0]
    assert choices["per batch"][1] == ("suffix", 0)  # no speculation at batch 4


def test_analytic_policy_reprobes_after_a_cold_probe_and_goes_off() -> None:
    pol = AnalyticPolicy(_profile(), 2, drafters=("suffix", "eagle3"), shadowed=frozenset({"suffix"}),
                         probe_every=16)
    inp = PlanInput(1, 0.1, [SeqState(1, 0.0, 100)], ("suffix", "eagle3"))
    for _ in range(40):
        pol.observe(StepStats(num_decode_seqs=1, shadow_outcomes={"suffix": [(2, 0, 0)]},
                              drafter_outcomes={"eagle3": [(2, 1, 0)]}))
    plans = []
    while not plans or plans[-1][0] != "eagle3":
        plans.append(pol.plan_drafters(inp)[1])
    assert 5 < len(plans) <= 16 and set(plans[:-1]) == {("suffix", 0)}  # off, probing within probe_every
    pol.observe(StepStats(num_decode_seqs=1, num_cold_drafts=1))
    assert pol.plan_drafters(inp)[1][0] == "eagle3"  # the cold probe is repeated at once
    assert pol.plan_drafters(inp)[1] == ("suffix", 0)


def test_guards_keep_the_drafter_and_apply_their_rules() -> None:
    pol = Guards(ScriptedPolicy(lambda step, i: ("eagle3", 3)), GuardConfig(gamma_max=4))
    seqs = [SeqState(1, 0.0, 100), SeqState(2, 0.0, 100, override=0), SeqState(3, 5.0, 100), SeqState(4, 0.0, 2)]
    out = pol.plan_drafters(PlanInput(4, 0.1, seqs, ("suffix", "eagle3")))
    assert out == {1: ("eagle3", 3), 2: ("suffix", 0), 3: ("suffix", 0), 4: ("eagle3", 1)}
    assert pol.plan(PlanInput(4, 0.95, seqs, ("suffix", "eagle3"))) == {1: 0, 2: 0, 3: 0, 4: 0}


def test_config_parses_drafter_lists_and_policies_refuse_what_they_cannot_choose(model) -> None:
    assert SpecConfig(drafter="suffix, eagle3").drafter_names == ("suffix", "eagle3")
    for bad in ("none,suffix", "suffix,suffix", ",", "suffix,a b"):
        with pytest.raises(ConfigError):
            SpecConfig(drafter=bad)
    with pytest.raises(ConfigError, match="unknown drafter 'bogus': drafter must be one of none, draft-model, eagle3"):
        build_drafter(SpecConfig(drafter="suffix,bogus"), model, 2, 96)  # a well-formed name no module defines
    cfg = EngineConfig(spec=SpecConfig(drafter="ngram,suffix"), policy=PolicyConfig(name="static"))
    with pytest.raises(ConfigError, match="analytic"):
        build_policy(cfg, model, build_drafter(cfg.spec, model, 2, 96))


def test_drafter_arms_hand_traced() -> None:
    arms = DrafterArms(("suffix", "eagle3"), 2, frozenset({"eagle3"}))
    assert arms.pairs == [("suffix", 0), ("suffix", 1), ("suffix", 2), ("eagle3", 1), ("eagle3", 2)]
    assert arms.gammas == [0, 1, 2, 1, 2] and arms.switching == [False, False, False, True, True]
    step = StepStats(spec_lens={1: 2, 2: 2, 3: 1}, seq_drafters={1: "eagle3", 2: "eagle3", 3: "suffix"})
    assert arms.arm_of(step) == 4 and arms.arm_of(StepStats(spec_lens={1: 0})) == 0
    single = DrafterArms((None,), 3)
    assert single.gammas == [0, 1, 2, 3] and single.switching is None


@pytest.mark.parametrize("name", ["bandit", "hybrid"])
def test_bandits_over_drafter_gamma_arms_find_the_best_drafter(name: str) -> None:
    """A synthetic world: suffix at gamma 2 gives 150 tokens/s, every other arm 100 or less; the
    bandit over (drafter, gamma) arms exploits (suffix, 2) in most late steps."""
    profile = _profile()
    pol = make_policy(name, PolicyOptions(gamma_max=2, profile=profile, seed=1, drafters=("suffix", "eagle3"),
                                          shadowed=frozenset({"suffix"})))
    assert isinstance(pol, DrafterPolicy)
    inp = PlanInput(1, 0.1, [SeqState(1, 0.0, 100)], ("suffix", "eagle3"))
    goodput = {("suffix", 0): 100.0, ("suffix", 1): 110.0, ("suffix", 2): 150.0, ("eagle3", 1): 90.0,
               ("eagle3", 2): 80.0}
    late = []
    for k in range(1500):
        drafter, gamma = pol.plan_drafters(inp)[1]
        key = (drafter if gamma else "suffix", gamma)
        outcome = (gamma, gamma, gamma if key == ("suffix", 2) else 0)
        pol.observe(StepStats(num_decode_seqs=1, num_emitted_tokens=int(goodput[key] / 10), total_time=0.1,
                              spec_lens={1: gamma}, seq_drafters={1: drafter} if gamma else {},
                              drafter_outcomes={drafter: [outcome]} if gamma else {},
                              num_drafts=int(gamma > 0), num_accepted_tokens=outcome[2], num_draft_depth=gamma,
                              num_rejected=int(gamma > 0 and outcome[2] < gamma),
                              seq_outcomes=[outcome] if gamma else []))
        if k >= 1000:
            late.append(key)
    assert late.count(("suffix", 2)) > 0.7 * len(late)


@pytest.mark.parametrize("name", ["analytic", "bandit", "hybrid"])
def test_every_drafter_choosing_policy_keeps_greedy_outputs(model, tok, name: str) -> None:
    plain = outputs(engine(model, tok, SpecConfig()), PROMPTS, max_tokens=40)
    spec = SpecConfig(drafter="suffix,eagle3", num_speculative_tokens=3)
    drafter = build_drafter(spec, model, 4, 96)
    assert isinstance(drafter, MultiDrafter)
    policy = make_policy(name, PolicyOptions(gamma_max=3, profile=_profile(), seed=2, guards=GuardConfig(gamma_max=3),
                                             drafters=tuple(drafter.members), shadowed=drafter.shadowed))
    cfg = EngineConfig(cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=spec)
    e = LLMEngine(model, tok, cfg, drafter=drafter, policy=policy)
    seen: list[StepStats] = []
    e.add_observer(Hooks(step_end=seen.append))
    assert outputs(e, PROMPTS, max_tokens=40) == plain
    assert {n for s in seen for n in s.seq_drafters.values()} >= {"suffix"}


def test_profiler_prices_every_drafter_of_a_multi_drafter(model) -> None:
    spec = SpecConfig(drafter="ngram,eagle3", num_speculative_tokens=2)
    multi = build_drafter(spec, model, 2, 96)
    prof = measure_profile(model, multi, ProfilerConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 3),
                                                        single_seq_tokens=(1, 4), catchup_tokens=(1, 4),
                                                        catchup_batches=(1,), context=16, target_s=0.01, passes=1))
    assert set(prof.draft_cost) == {"default", "ngram", "eagle3"}
    assert prof.draft_cost["default"] == prof.draft_cost["ngram"] and prof.draft_cost["eagle3"] > 0
    assert prof.catchup  # eagle3 is stateful: its catch-up was measured
