"""Speculation policies: guards by hand, static, analytic (TIDE), bandit (Nightjar), hybrid."""

from __future__ import annotations

import itertools
import random

import pytest

from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import (
    DrafterPolicy,
    PlanInput,
    SeqState,
    SpeculationPolicy,
    bucket_of,
    plans_drafters,
)
from tidespec.speculative.policy.bandit_policies import BanditPolicy, HybridPolicy
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.speedup import (
    Profile,
    alpha_from_accept_length,
    best_gamma,
    expected_accept_length,
    practical_speedup,
)
from tidespec.speculative.policy.static import StaticPolicy
from tidespec.speculative.policy.tracking import AlphaTracker, position_counts
from tidespec.stats import StepStats

D0 = 0.0005


def synthetic_profile() -> Profile:
    """Memory-bound up to 16 tokens (10 ms), then compute-bound: 10 ms per 16 tokens."""
    return Profile(
        target_latency={1: 0.010, 16: 0.010, 32: 0.020, 64: 0.040, 128: 0.080, 256: 0.160, 512: 0.320},
        draft_cost={"default": D0},
        catchup={(1, 1): 0.001, (100, 1): 0.01},
        key="synthetic",
    )


def plan_input(batch: int, kv: float = 0.1, temperature: float = 0.0) -> PlanInput:
    return PlanInput(batch, kv, [SeqState(i, temperature, 100, None) for i in range(batch)])


def step_stats(batch_size: int, gamma: int, num_seqs_speculated: int, num_draft_tokens: int,
               num_accepted_tokens: int, num_emitted_tokens: int, step_time: float, draft_time: float,
               verify_time: float, *, num_prefill_tokens: int = 0, num_rejected: int | None = None,
               num_draft_depth: int | None = None, num_short_drafts: int = 0,
               seq_outcomes: list[tuple[int, int, int]] | None = None) -> StepStats:
    """The engine's record of a decode step with ``batch_size`` decode sequences, each asked for
    ``gamma`` (the arm that ran). Not given, the draft depth is the drafted tokens (chains) and
    every speculating sequence counts as rejected unless all drafted tokens were accepted."""
    if num_draft_depth is None:
        num_draft_depth = num_draft_tokens
    if num_rejected is None:
        num_rejected = 0 if num_accepted_tokens >= num_draft_depth else num_seqs_speculated
    return StepStats(
        batch_size=batch_size + (1 if num_prefill_tokens else 0),  # a prefill chunk is one more sequence
        num_decode_seqs=batch_size,
        num_prefill_tokens=num_prefill_tokens,
        num_drafts=num_seqs_speculated,
        num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens,
        num_rejected=num_rejected,
        num_draft_depth=num_draft_depth,
        num_short_drafts=num_short_drafts,
        num_emitted_tokens=num_emitted_tokens,
        spec_lens={i: gamma for i in range(batch_size)},
        seq_outcomes=list(seq_outcomes or []),
        draft_time=draft_time,
        verify_time=verify_time,
        other_time=step_time - draft_time - verify_time,
        total_time=step_time,
    )


def feedback(batch: int, gamma: int, alpha: float, slowdown: float = 1.0,
             rng: random.Random | None = None) -> StepStats:
    """One step of a world that follows eq. 2 and the synthetic profile: expected counts rounded,
    or, with ``rng``, each sequence's acceptance drawn (token by token, stop at a rejection)."""
    p = synthetic_profile()
    if rng is not None:
        runs = []
        for _ in range(batch if gamma else 0):
            a = 0
            while a < gamma and rng.random() < alpha:
                a += 1
            runs.append(a)
        accepted, rejected = sum(runs), sum(a < gamma for a in runs)
        outcomes = [(gamma, gamma, a) for a in runs]
    else:
        accepted = round(batch * (expected_accept_length(alpha, gamma) - 1.0)) if gamma else 0
        rejected = round(batch * (1.0 - alpha**gamma)) if gamma else 0
        outcomes = []
    draft_time = gamma * D0
    verify_time = p.target(batch * (gamma + 1))
    return step_stats(
        batch_size=batch,
        gamma=gamma,
        num_seqs_speculated=batch if gamma else 0,
        num_draft_tokens=batch * gamma,
        num_accepted_tokens=accepted,
        num_emitted_tokens=batch + accepted,
        step_time=(draft_time + verify_time) * slowdown,
        draft_time=draft_time * slowdown,
        verify_time=verify_time * slowdown,
        num_rejected=rejected,
        seq_outcomes=outcomes,
    )


def test_bucket_of() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    with pytest.raises(ValueError):
        bucket_of(0)


def _lengths_per_gamma(tracker: AlphaTracker, bucket: int, gamma: int) -> tuple[float, float]:
    """The per-position sums of ``_Counts.lengths`` for one gamma, written out on their own (the reference
    ``all_lengths`` must equal)."""
    c = tracker.per_bucket.get(bucket, tracker.overall)
    alpha, rho = c.alpha(), c.rho()
    accept_len, draft_len, acc_prev, draft_prev = 1.0, 0.0, 1.0, 1.0
    for k in range(1, gamma + 1):
        geo_acc, geo_draft = (alpha * rho) ** k, rho ** k
        if k <= len(c.positions) and c.positions[k - 1][0] + tracker.pseudo > 0:
            asked, reached, acc = c.positions[k - 1]
            geo_acc = (acc + tracker.pseudo * geo_acc) / (asked + tracker.pseudo)
            geo_draft = (reached + tracker.pseudo * geo_draft) / (asked + tracker.pseudo)
        draft_prev = min(draft_prev, geo_draft)
        acc_prev = min(acc_prev, geo_acc, draft_prev)
        accept_len += acc_prev
        draft_len += draft_prev
    return accept_len, draft_len


def test_position_counts_and_all_lengths_in_one_pass() -> None:
    """The per-position counts of position_counts' docstring, and all_lengths equal, bit for bit, to the
    per-gamma sums at every gamma over random outcome histories (one pass computes the same prefix sums)."""
    assert position_counts([(4, 4, 4), (4, 2, 1), (2, 0, 0)]) == [(3, 2, 2), (3, 2, 1), (2, 1, 1), (2, 1, 1)]
    assert position_counts([]) == []
    rng = random.Random(0)
    for pseudo in (0.0, 1.0):
        tracker = AlphaTracker(prior_alpha=0.6, ema=0.1, pseudo=pseudo)
        for _ in range(50):
            outcomes = []
            for _ in range(rng.randint(1, 4)):
                gamma = rng.randint(1, 5)
                depth = rng.randint(0, gamma)
                outcomes.append((gamma, depth, rng.randint(0, depth)))
            tracker.update_outcomes(rng.choice((1, 4)), outcomes)
            for bucket in (1, 4, 16):
                assert tracker.all_lengths(bucket, 7) == [_lengths_per_gamma(tracker, bucket, g) for g in range(8)]


def test_tracker_worked_example_alpha_and_rho() -> None:
    """The AlphaTracker docstring: gamma 4, drafts of 4, 2 and 0 tokens, accepting 4 and 1."""
    tracker = AlphaTracker(prior_alpha=0.7, ema=1.0)
    assert tracker.alpha(4) == pytest.approx(0.7) and tracker.rho(4) == 1.0  # the priors
    fb = step_stats(3, 4, 2, 6, 5, 7, 0.02, 0.001, 0.019, num_rejected=1, num_draft_depth=6, num_short_drafts=2,
                    seq_outcomes=[(4, 4, 4), (4, 2, 1), (4, 0, 0)])
    tracker.update(4, fb)
    assert tracker.alpha(4) == pytest.approx(5 / 6) and tracker.rho(4) == pytest.approx(6 / 8)
    exact = AlphaTracker(prior_alpha=0.7, ema=1.0, pseudo=0.0)
    exact.update(4, fb)
    assert exact.lengths(4, 4) == pytest.approx((1 + 5 / 3, 2.0))
    assert exact.lengths(4, 1) == pytest.approx((1 + 2 / 3, 2 / 3))
    # position 5 was never asked for: the geometric model (alpha rho)**5, rho**5 extends the sums
    assert exact.lengths(4, 5) == pytest.approx((1 + 5 / 3 + (5 / 6 * 0.75) ** 5, 2.0 + 0.75**5))
    # pseudo = 1 shrinks position 1 towards the model: (2 + 0.625) / (3 + 1) accepted
    assert tracker.lengths(4, 1) == pytest.approx((1 + (2 + 5 / 6 * 0.75) / 4, (2 + 0.75) / 4))
    assert tracker.alpha(64) == pytest.approx(5 / 6)  # unseen bucket: all steps' estimate
    tracker.update(4, step_stats(3, 0, 0, 0, 0, 3, 0.01, 0.0, 0.01))  # nothing asked: no change
    assert tracker.alpha(4) == pytest.approx(5 / 6) and tracker.rho(4) == pytest.approx(0.75)


def test_tracker_memory_counts_drafts_not_steps() -> None:
    """The AlphaTracker docstring's memory in drafts (ema 0.1, span 4: a draft's weight falls 0.9 ** 0.25 per later
    draft): 40 rejected then 4 accepted drafts, one per step at batch 1, weigh as the same drafts four per step at
    batch 4 (within the spread of weights inside a step); forgetting per step, batch 1 forgot four times faster."""
    rejected, accepted = (4, 4, 0), (4, 4, 4)
    one, four = AlphaTracker(prior_alpha=0.7, ema=0.1), AlphaTracker(prior_alpha=0.7, ema=0.1)
    for _ in range(40):
        one.update_outcomes(1, [rejected])
    for _ in range(10):
        four.update_outcomes(4, [rejected] * 4)
    for _ in range(4):
        one.update_outcomes(1, [accepted])
    four.update_outcomes(4, [accepted] * 4)
    k = 0.9**0.25
    acc = 0.7 * k**44 + sum(4 * k**i for i in range(4))  # the prior, then the accepted drafts (4 tokens each)
    rej = k**4 * (0.3 * k**40 + sum(k**i for i in range(40)))
    assert one.alpha(1) == pytest.approx(acc / (acc + rej))
    assert one.alpha(1) == pytest.approx(four.alpha(4), rel=0.05) and one.alpha(1) < 0.45
    per_step = AlphaTracker(prior_alpha=0.7, ema=0.1, span=1)  # the memory before: 0.9 per step at any batch size
    for outcome in [rejected] * 40 + [accepted] * 4:
        per_step.update_outcomes(1, [outcome])
    assert per_step.alpha(1) > 0.55  # four accepted drafts outweighed forty rejected ones
    with pytest.raises(ValueError, match="span"):
        AlphaTracker(span=0)


def test_tracker_is_unbiased_at_batch_one_where_averaging_step_estimates_is_not() -> None:
    """Batch 1, gamma 4, true alpha 0.45: averaging per-step inversions of eq. 2 lands near 0.30
    (0.2965 exactly), below the ~0.33 where eq. 5 turns speculation on at batch 1 on the
    runs/load6 profile; the tracker's ratio of counts lands at 0.45."""
    rng = random.Random(7)
    tracker = AlphaTracker(prior_alpha=0.7, ema=0.01)
    per_step: list[float] = []
    for _ in range(4000):
        fb = feedback(1, 4, 0.45, rng=rng)
        tracker.update(1, fb)
        per_step.append(alpha_from_accept_length(1.0 + fb.num_accepted_tokens, 4))
    assert sum(per_step) / len(per_step) == pytest.approx(0.2965, abs=0.02)
    assert tracker.alpha(1) == pytest.approx(0.45, abs=0.04)


def test_analytic_policy_prices_the_draft_a_stopping_drafter_really_proposes() -> None:
    """Asked for gamma 4, the drafter proposes one token (accepted) and stops: rho falls to ~0.5
    and the policy decides with eq. 5 at that rho (speedup.practical_speedup's rho), not at 1."""
    p = synthetic_profile()
    policy = AnalyticPolicy(p, gamma_max=4, ema=0.5, prior_alpha=0.9)
    for _ in range(20):
        policy.observe(step_stats(1, 4, 1, 1, 1, 2, 0.011, 0.0, 0.011, num_rejected=0, num_draft_depth=1,
                                  num_short_drafts=1))
    alpha, rho = policy.alphas.alpha(1), policy.alphas.rho(1)
    assert rho == pytest.approx(0.5, abs=0.01) and alpha > 0.95
    gamma, speedup = policy.decide(1)
    assert (gamma, speedup) == best_gamma(alpha, 1, p, 4, None, rho)
    assert speedup < best_gamma(alpha, 1, p, 4)[1] - 0.5  # rho = 1 would promise far more
    policy.plan(plan_input(1))
    s = policy.stats()
    assert s["rho_b1"] == pytest.approx(rho) and s["alpha_b1"] == pytest.approx(alpha)


# ---- guards ----
def test_guards_hand_cases() -> None:
    guards = Guards(StaticPolicy(4), GuardConfig(kv_threshold=0.85, temperature_threshold=0.8, gamma_max=8))
    seqs = [
        SeqState(1, 0.0, 100, None),  # policy: 4
        SeqState(2, 1.0, 100, None),  # hot: 0
        SeqState(3, 1.0, 100, 12),  # override beats temperature, capped at gamma_max: 8
        SeqState(4, 0.0, 3, None),  # 3 tokens left: at most 2 drafts
        SeqState(5, 0.0, 100, 0),  # opted out: 0
        SeqState(6, 0.5, 100, 2),  # override: 2
        SeqState(7, 0.0, 1, None),  # last token: plain decode
        SeqState(8, 0.8, 100, None),  # at the threshold (not above): 4
    ]
    assert guards.plan(PlanInput(8, 0.5, seqs)) == {1: 4, 2: 0, 3: 8, 4: 2, 5: 0, 6: 2, 7: 0, 8: 4}
    assert guards.plan(PlanInput(8, 0.9, seqs)) == {i: 0 for i in range(1, 9)}  # KV pressure
    s = guards.stats()
    assert s["guard_kv"] == 1 and s["guard_temperature"] == 2 and s["guard_opt_out"] == 2
    assert s["guard_override"] == 4 and s["guard_remaining"] == 2
    assert s["gamma"] == 4 and s["steps"] == 2


def test_guards_forward_feedback_to_inner() -> None:
    inner = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.9)
    guards = Guards(inner)
    guards.plan(plan_input(2))
    guards.observe(feedback(2, 3, 0.2))
    assert inner.alphas.alpha(2) < 0.9


def test_guard_config_validation() -> None:
    with pytest.raises(ValueError):
        GuardConfig(kv_threshold=0.0)
    with pytest.raises(ValueError):
        GuardConfig(temperature_threshold=-1.0)


# ---- static ----
def test_static_policy() -> None:
    policy = StaticPolicy(3)
    assert policy.plan(plan_input(3)) == {0: 3, 1: 3, 2: 3}
    policy.observe(feedback(3, 3, 0.5))
    assert policy.stats() == {"gamma": 3.0, "steps": 1.0}
    assert isinstance(policy, SpeculationPolicy)
    with pytest.raises(ValueError):
        StaticPolicy(-1)


def test_plans_drafters_agrees_with_the_protocol_check() -> None:
    """The cheap check the step makes answers as ``isinstance(policy, DrafterPolicy)`` does."""
    policies: list[SpeculationPolicy] = [StaticPolicy(3), Guards(StaticPolicy(3)),
                                         AnalyticPolicy(synthetic_profile(), gamma_max=4)]
    assert [plans_drafters(p) for p in policies] == [isinstance(p, DrafterPolicy) for p in policies] == [False, True, True]


# ---- analytic ----
def test_analytic_speculates_at_batch_one_high_alpha_and_stops_at_large_batch_low_alpha() -> None:
    p = synthetic_profile()
    policy = AnalyticPolicy(p, gamma_max=4, ema=0.05, prior_alpha=0.7)
    # before any data: the prior alpha 0.7 at b = 1 (beta = 1, c = 0.05) favours the longest gamma
    assert policy.plan(plan_input(1)) == {0: 4}
    rng = random.Random(3)
    for _ in range(200):
        policy.observe(feedback(1, 4, 0.9, rng=rng))
        policy.observe(feedback(64, 2, 0.3))
    assert policy.alphas.alpha(1) == pytest.approx(0.9, abs=0.05)
    assert policy.alphas.alpha(64) == pytest.approx(0.3, abs=0.03)
    assert policy.plan(plan_input(1)) == {0: 4}
    s = policy.stats()
    # hand check: E[l] / (4 * 0.05 + 1), E[l] measured per position: near eq. 2's at the fitted alpha
    accept_len, draft_len = policy.alphas.lengths(1, 4)
    assert draft_len == 4.0 and s["speedup_b1"] == pytest.approx(accept_len / 1.2, abs=1e-9)
    assert accept_len == pytest.approx(expected_accept_length(policy.alphas.alpha(1), 4), abs=0.1)
    # b = 64, alpha 0.3: gamma 1 verifies 128 tokens in 80 ms vs 40 ms: 1.3 / (2 + 0.0125) < 1
    assert set(policy.plan(plan_input(64)).values()) == {0}
    s = policy.stats()
    assert s["gamma_b64"] == 0 and s["speedup_b64"] == 1.0 and s["gamma_b1"] == 4


def test_analytic_probes_a_bucket_stuck_off_and_recovers() -> None:
    """b = 4 with alpha 0: drafting costs c > 0 for nothing, so the model says off; every 3rd off
    step probes gamma 1. Probes that see alpha 0.95 pull the bucket's EMA up until the model turns
    speculation back on (5 verified tokens per sequence cost no more than 1 at b = 4 here)."""
    policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.5, prior_alpha=0.0, probe_every=3)
    gammas = [policy.plan(plan_input(4))[0] for _ in range(6)]
    assert gammas == [0, 0, 1, 0, 0, 1] and policy.stats()["probe_steps"] == 2
    for _ in range(12):
        g = policy.plan(plan_input(4))[0]
        policy.observe(feedback(4, g, 0.95) if g else feedback(4, 0, 0.0))
    assert policy.plan(plan_input(4))[0] >= 1 and policy.alphas.alpha(4) > 0.8
    never = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.0, probe_every=0)
    assert {never.plan(plan_input(4))[0] for _ in range(200)} == {0}
    with pytest.raises(ValueError, match="probe_every"):
        AnalyticPolicy(synthetic_profile(), gamma_max=4, probe_every=-1)


def test_a_drafter_whose_weights_changed_is_probed_within_warm_steps_and_judged_on_its_new_drafts() -> None:
    """Parked at b = 4 with alpha 0, the probes back off to one every ``probe_every`` plans. Told its drafter's
    weights changed (online training swapped a head in), the policy probes within ``warm_steps`` plans, and
    one probe of the new weights accepting all (alpha 0.95's expected counts) turns speculation on; its twin,
    not told, keeps the old evidence: the same probe comes much later and leaves it off."""
    told, twin = (AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.02, prior_alpha=0.0, probe_every=64)
                  for _ in range(2))
    for policy in (told, twin):
        for _ in range(600):
            g = policy.plan(plan_input(4))[0]
            policy.observe(feedback(4, g, 0.0))
    assert told.stats()["probe_steps"] == twin.stats()["probe_steps"]
    told.drafter_changed("eagle3")  # the engine's only drafter
    assert told.alphas.alpha(4) == 0.0 and told.alphas.per_bucket[4].rejected == pytest.approx(2.0)
    gammas: dict[str, list[int]] = {"told": [], "twin": []}
    for name, policy in (("told", told), ("twin", twin)):
        for _ in range(told.warm_steps + 1):
            g = policy.plan(plan_input(4))[0]
            gammas[name].append(g)
            policy.observe(feedback(4, g, 0.95 if g else 0.0))
    assert any(gammas["told"]) and not any(gammas["twin"])
    assert told.plan(plan_input(4))[0] >= 1 and told.alphas.alpha(4) > 0.6
    twin.drafter_changed("medusa")  # not this policy's drafter name, but its only one: the same reset
    assert twin.alphas.per_bucket[4].rejected == pytest.approx(2.0)
    several = AnalyticPolicy(synthetic_profile(), gamma_max=4, drafters=("suffix", "eagle3"),
                             shadowed=frozenset({"suffix"}))
    several.drafter_changed("draft-model")  # not one of its drafters: nothing
    several.drafter_changed("suffix")  # model-free: nothing to forget


def test_analytic_probes_more_often_where_a_probe_is_cheap() -> None:
    """The class docstring's rule with alpha 0 (the model says off everywhere): at b = 4 the
    best probe (gamma 1) is predicted at 1 / 1.05 = 0.952, so it costs 0.048 of a step and comes
    every 3rd step; at b = 64 gamma 1 verifies 128 tokens (T = 80 ms vs 40 ms): s = 1 / 2.0125,
    cost 0.503 -> the 26th off step (26 x 0.02 = 0.52). Each probe that leaves the choice as it was
    doubles the next one's price (0.096 -> the 5th step, 0.19 -> the 10th; at b = 64 1.006 -> the 51st)."""
    policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.0, probe_budget=0.02)
    assert policy.predicted(4)[1] == pytest.approx(1 / 1.05)
    assert [policy.plan(plan_input(4))[0] for _ in range(18)] == [0, 0, 1] + [0] * 4 + [1] + [0] * 9 + [1]
    assert policy.predicted(64)[1] == pytest.approx(1 / 2.0125)
    assert [policy.plan(plan_input(64))[0] for _ in range(77)] == [0] * 25 + [1] + [0] * 50 + [1]
    with pytest.raises(ValueError, match="probe_budget"):
        AnalyticPolicy(synthetic_profile(), gamma_max=4, probe_budget=1.5)


def _chain_step(gamma: int, accepted: int) -> StepStats:
    """A batch-1 step that asked for ``gamma``, drafted it whole and accepted ``accepted`` of it."""
    return step_stats(1, gamma, 1, gamma, accepted, accepted + 1, 0.012, 0.001, 0.011,
                      num_rejected=int(accepted < gamma), seq_outcomes=[(gamma, gamma, accepted)])


def test_analytic_depth_probes_refresh_positions_a_short_gamma_never_asks() -> None:
    """Positions 2-4 measured bad once (one request), then the policy sits at gamma 1, where nothing
    asks for them again. A depth probe asks for gamma_max within the budget (its price: s(1) - s(4));
    once the deep positions accept, the policy moves to gamma 4. Where they stay bad, each depth probe
    that leaves gamma 1 as it was doubles the next one's price: the gaps grow."""
    profile = Profile(target_latency={1: 0.010, 2: 0.012, 5: 0.018, 16: 0.050}, draft_cost={"default": 0.0005})
    def stale() -> AnalyticPolicy:
        policy = AnalyticPolicy(profile, gamma_max=4, ema=0.1, prior_alpha=0.9, probe_budget=0.02)
        for _ in range(10):
            policy.observe(_chain_step(4, 1))
        for _ in range(30):
            policy.observe(_chain_step(1, 1))
        return policy
    policy = stale()
    s = policy.predicted(1)
    assert policy.decide(1)[0] == 1 and s[1] - s[4] > 0.2  # the stale second position keeps gamma 1 best
    gammas = []
    for _ in range(200):  # the deep positions accept now
        g = policy.plan(plan_input(1))[0]
        gammas.append(g)
        policy.observe(_chain_step(g, g))
    first = gammas.index(4)
    assert 0 < first <= (s[1] - s[4]) / 0.02 + 1  # the first depth probe, once the budget covers its price
    assert gammas[-20:] == [4] * 20 and policy.decide(1)[0] == 4 and policy.stats()["depth_probe_steps"] >= 1
    still = stale()
    probes = []
    for i in range(400):  # the deep positions stay bad: gamma 1 stays, the depth probes thin out
        g = still.plan(plan_input(1))[0]
        if g == 4:
            probes.append(i)
        still.observe(_chain_step(g, 1))
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    assert still.decide(1)[0] == 1
    never = stale()
    never.probe_every = 0
    assert {never.plan(plan_input(1))[0] for _ in range(100)} == {1}


def test_analytic_unseen_bucket_uses_global_alpha() -> None:
    policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.5, prior_alpha=0.7)
    policy.observe(feedback(1, 4, 0.0))
    # one draft, a quarter of span 4: the prior keeps 0.5 ** 0.25 of its weight; accepted 0.7 keep, rejected 0.3 keep + 1
    keep = 0.5**0.25
    assert policy.alphas.alpha(1) == pytest.approx(0.7 * keep / (keep + 1))
    assert policy.alphas.alpha(32) == pytest.approx(0.7 * keep / (keep + 1))  # no data at 32: all steps' estimate


# ---- bandit ----
BEST_GOODPUT = [1000.0, 1300.0, 1500.0, 1400.0, 1200.0]  # tokens/s per arm at batch 8


def noisy_feedback(rng: random.Random, gamma: int, batch: int = 8) -> StepStats:
    g = BEST_GOODPUT[gamma] * (1.0 + rng.uniform(-0.05, 0.05))
    return step_stats(batch, gamma, batch if gamma else 0, batch * gamma, 0, 100, 100.0 / g, 0.0, 100.0 / g)


def test_bandit_converges_to_best_arm() -> None:
    policy = BanditPolicy(gamma_max=4, seed=11)
    world = random.Random(5)
    late_exploit: list[int] = []
    counts = [0] * 5
    for t in range(3000):
        gamma = policy.plan(plan_input(8))[0]
        counts[gamma] += 1
        if t >= 2000 and not policy.bandit.last_explored:
            late_exploit.append(gamma)
        policy.observe(noisy_feedback(world, gamma))
    means = policy.bandit.arm_means(8)
    assert max(range(5), key=means.__getitem__) == 2
    assert means[2] == pytest.approx(1500.0, rel=0.02)
    assert late_exploit.count(2) / len(late_exploit) > 0.95
    assert counts[2] == max(counts) and counts[2] > 0.5 * sum(counts)
    s = policy.stats()
    assert s["explore_steps"] + s["exploit_steps"] == 3000
    assert s["explore_steps_b8"] == s["explore_steps"]


def test_bandit_policy_goodput_is_emitted_over_step_time() -> None:
    policy = BanditPolicy(gamma_max=2, seed=0)
    policy.plan(plan_input(2))
    policy.observe(step_stats(2, 1, 2, 2, 1, 3, 0.01, 0.001, 0.009))
    assert policy.bandit.arm_means(2) == pytest.approx([0.0, 300.0, 0.0])


def test_steps_with_prefill_are_not_credited_to_an_arm() -> None:
    """A step that also prefilled 64 prompt tokens (slow for reasons no arm controls) leaves the
    arm's mean and count alone, but the switching-cost state still follows the arm played; the
    hybrid's calibration ignores it too, and still learns alpha from it."""
    policy = BanditPolicy(gamma_max=2, seed=0)
    policy.plan(plan_input(2))
    policy.observe(step_stats(2, 1, 2, 2, 1, 3, 0.01, 0.001, 0.009))
    policy.plan(plan_input(2))
    policy.observe(step_stats(2, 0, 0, 0, 0, 2, 0.2, 0.0, 0.19, num_prefill_tokens=64))
    assert policy.bandit.arm_means(2) == pytest.approx([0.0, 300.0, 0.0])
    assert policy.bandit.arm_counts(2) == [0, 1, 0]
    assert policy.bandit._last_arm == 0 and policy.bandit._zero_run == 1
    hybrid = HybridPolicy(synthetic_profile(), gamma_max=2, prior_alpha=0.6)
    hybrid.plan(plan_input(1))
    hybrid.observe(step_stats(1, 2, 1, 2, 0, 1, 0.5, 0.001, 0.4, num_prefill_tokens=64))
    assert hybrid.kappa == 1.0 and hybrid.bandit.arm_counts(1) == [0, 0, 0]
    assert hybrid.alphas.global_alpha < 0.6  # nothing of 2 drafts accepted: alpha went down


# ---- hybrid ----
def test_hybrid_prior_is_analytic_goodput() -> None:
    p = synthetic_profile()
    policy = HybridPolicy(p, gamma_max=3, prior_alpha=0.6)
    means = policy.bandit.arm_means(1)
    # b = 1: baseline 1 / T(1) = 100 tokens/s, times eq. 5
    assert means == pytest.approx([100.0 * practical_speedup(0.6, g, 1, p) for g in range(4)], abs=1e-9)
    assert means[2] == pytest.approx(100.0 * (1 + 0.6 + 0.36) / (2 * 0.05 + 1.0), abs=1e-9)


def test_hybrid_explore_scale_rule() -> None:
    policy = HybridPolicy(synthetic_profile(), gamma_max=3, regret_wide=0.2, explore_floor=0.25)
    assert policy.explore_scale(1, [100.0, 100.0, 100.0, 100.0]) == 1.0  # flat: full exploration
    # mean 77.5 of best 100: regret 0.225 >= regret_wide -> floor
    assert policy.explore_scale(1, [100.0, 70.0, 70.0, 70.0]) == pytest.approx(0.25)
    # regret 0.1: half way -> 1 - 0.75 * 0.5
    assert policy.explore_scale(1, [100.0, 90.0, 90.0, 80.0]) == pytest.approx(0.625)


def run_world(policy: SpeculationPolicy, steps: int, batch: int, alpha: float) -> list[int]:
    chosen = []
    for _ in range(steps):
        gamma = policy.plan(plan_input(batch))[0]
        chosen.append(gamma)
        policy.observe(feedback(batch, gamma, alpha, slowdown=1.25))
    return chosen


def test_hybrid_explores_less_than_bandit_when_prior_is_confident() -> None:
    # b = 64, alpha = 0.3 on the synthetic profile: plain decoding wins by far (gamma 1 halves
    # goodput), and the engine is 25% slower than the profile (calibration kappa -> 0.8)
    p = synthetic_profile()
    bandit = BanditPolicy(gamma_max=4, seed=2)
    hybrid = HybridPolicy(p, gamma_max=4, seed=2, prior_alpha=0.3)
    b_choices = run_world(bandit, 1500, 64, 0.3)
    h_choices = run_world(hybrid, 1500, 64, 0.3)
    b_explore = bandit.stats()["explore_steps"]
    h_explore = hybrid.stats()["explore_steps"]
    assert h_explore < 0.5 * b_explore
    assert h_choices.count(0) > b_choices.count(0)
    assert hybrid.stats()["calibration"] == pytest.approx(0.8, abs=0.02)
    assert hybrid.stats()["explore_scale_mean"] == pytest.approx(0.25)


def test_hybrid_learns_when_prior_is_wrong() -> None:
    # prior says alpha = 0.05 (speculation useless) but the world has alpha = 0.95 at b = 1
    hybrid = HybridPolicy(synthetic_profile(), gamma_max=4, seed=4, prior_alpha=0.05)
    assert hybrid.plan(plan_input(1))[0] in range(5)
    chosen = run_world(hybrid, 1500, 1, 0.95)
    assert sum(g == 4 for g in chosen[-300:]) > 250


def test_hybrid_told_of_new_weights_measures_them_at_once() -> None:
    """A drafter that accepted 5 % for 600 steps (the hybrid settled on plain decoding, exploring rarely in
    its late blocks) is swapped for one that accepts 95 %. Told (``drafter_changed``), the policy drops the
    old arms' goodputs and discounts the acceptance estimate, plays the new weights at its next step and
    speculates at gamma 4 from then on; the twin not told is still mostly off 100 steps later (seeds where
    it happens to explore sooner exist; these two do not). The bandit-only policy drops the same arms."""
    for seed in (2, 4):
        told, twin = (HybridPolicy(synthetic_profile(), gamma_max=4, seed=seed, prior_alpha=0.5) for _ in "ab")
        for policy in (told, twin):
            run_world(policy, 600, 1, 0.05)
        told.drafter_changed("eagle3")  # the engine's only drafter, whatever its name
        assert told.bandit.arm_counts(1)[1:] == [0] * 4 and twin.bandit.arm_counts(1)[0] > 0
        assert told.plan(plan_input(1))[0] == 0 and told.probe_due("eagle3") and not twin.probe_due("eagle3")
        told.observe(feedback(1, 0, 0.95, slowdown=1.25))
        assert told.plan(plan_input(1))[0] == 4 and not told.probe_due("eagle3")  # the replay, warmed
        told.observe(feedback(1, 4, 0.95, slowdown=1.25))
        told_gammas, twin_gammas = run_world(told, 100, 1, 0.95), run_world(twin, 100, 1, 0.95)
        assert told_gammas.count(4) >= 90 and twin_gammas.count(4) < 10
    several = HybridPolicy(synthetic_profile(), gamma_max=2, drafters=("suffix", "eagle3"),
                           stateful=frozenset({"eagle3"}))
    run_world(several, 50, 1, 0.5)
    counts = several.bandit.arm_counts(1)
    several.drafter_changed("medusa")  # not one of its drafters: nothing
    assert several.bandit.arm_counts(1) == counts
    several.drafter_changed("eagle3")
    assert several.bandit.arm_counts(1) == counts[:3] + [0, 0]
    bandit = BanditPolicy(gamma_max=2, seed=0)
    run_world(bandit, 50, 1, 0.5)
    bandit.drafter_changed("eagle3")
    assert bandit.bandit.arm_counts(1)[1:] == [0, 0]
    bandit.plan(plan_input(1))
    assert bandit.probe_due("eagle3") and bandit.plan(plan_input(1))[0] == 2  # the deepest, replayed


# ---- factory ----
def test_make_policy() -> None:
    p = synthetic_profile()
    opts = PolicyOptions(gamma_max=4, profile=p, seed=1)
    assert isinstance(make_policy("static", opts), StaticPolicy)
    assert isinstance(make_policy("analytic", opts), AnalyticPolicy)
    assert isinstance(make_policy("bandit", opts), BanditPolicy)
    assert isinstance(make_policy("hybrid", opts), HybridPolicy)
    guarded = make_policy("bandit", PolicyOptions(gamma_max=4, guards=GuardConfig(gamma_max=4)))
    assert isinstance(guarded, Guards) and guarded.name == "bandit"
    assert make_policy("static", PolicyOptions(gamma_max=4, static_gamma=0)).plan(plan_input(2)) == {0: 0, 1: 0}
    with pytest.raises(ValueError):
        make_policy("oracle", opts)
    with pytest.raises(ValueError):
        make_policy("analytic", PolicyOptions(gamma_max=4))
    for name in ("static", "analytic", "bandit", "hybrid"):
        policy = make_policy(name, opts)
        assert isinstance(policy, SpeculationPolicy)
        assert policy.plan(PlanInput(0, 0.0, [])) == {}
