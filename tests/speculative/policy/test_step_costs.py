"""Measured step costs (``speculative/policy/step_costs.py``): the analytic policy prices a speculating
step by what it measures against a plain one, not by the start-up profile alone."""

from __future__ import annotations

import math

import pytest

from tests.speculative.policy.test_policy import D0, feedback, plan_input, synthetic_profile
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import PlanInput, SeqState
from tidespec.speculative.policy.routing import SequenceRouter
from tidespec.speculative.policy.step_costs import StepCosts
from tidespec.stats import StepStats


def measured(batch: int, gamma: int, alpha: float, slowdown: float) -> StepStats:
    """``feedback``'s step (its time is the synthetic profile's exactly) with speculating steps
    ``slowdown`` times dearer than the profile says, and the drafter named as the engine names it."""
    step = feedback(batch, gamma, alpha)
    if gamma:
        step.total_time *= slowdown
        step.seq_drafters = {i: "default" for i in range(batch)}
    return step


def test_the_worked_example_factor() -> None:
    costs = StepCosts(synthetic_profile(), ema=1.0)  # ema 1: the last sample
    plain = measured(4, 0, 0.5, 1.0)
    plain.total_time = 0.011  # T(4 tokens) = 10 ms: 1.1
    spec = measured(4, 3, 0.5, 1.0)
    spec.total_time = 1.5 * (0.010 + 3 * D0)  # T(16 tokens) + 3 D0, measured 1.5x
    costs.observe(spec)
    assert costs.factor(4) == 1.0 and costs.wants_plain(4), "no plain step measured yet: ask for one"
    for _ in range(3):
        costs.observe(plain)
    assert costs.factor(4) == pytest.approx(1.5 / 1.1) and not costs.wants_plain(4)
    assert costs.factor(1) == 1.0 and not costs.wants_plain(1), "another bucket knows nothing yet"
    assert costs.stats() == {"cost_factor_b4": pytest.approx(1.5 / 1.1)}


def test_prefill_steps_and_outliers_do_not_move_it() -> None:
    costs = StepCosts(synthetic_profile(), ema=0.5)
    for _ in range(3):
        costs.observe(measured(4, 0, 0.5, 1.0))
    costs.observe(measured(4, 2, 0.5, 1.2))
    mixed = measured(4, 2, 0.5, 10.0)
    mixed.num_prefill_tokens, mixed.batch_size = 100, 5
    costs.observe(mixed)
    assert costs.factor(4) == pytest.approx(1.2)
    costs.observe(measured(4, 2, 0.5, 1000.0))  # a compile or a GC pause: counted as 3x at most
    assert costs.factor(4) == pytest.approx(math.exp(0.5 * math.log(1.2) + 0.5 * math.log(3.0)))


def run(policy: AnalyticPolicy, batch: int, slowdown: float, steps: int) -> list[int]:
    gammas = []
    for _ in range(steps):
        gamma = max(policy.plan(plan_input(batch)).values())
        policy.observe(measured(batch, gamma, 0.5, slowdown))
        gammas.append(gamma)
    return gammas


def test_the_policy_stops_speculating_where_it_measures_dearer_than_the_profile() -> None:
    """alpha 0.5 at b = 4: the profile predicts 1.63x at gamma 3; speculating steps that really cost
    twice the profile's make it 0.82x, so the policy decodes plain but for its probes; where they
    cost what the profile says it keeps speculating, and without measured costs it never learns."""
    dear = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.2, prior_alpha=0.5)
    gammas = run(dear, 4, 2.0, 300)
    assert gammas[0] == 3 and gammas[1:4] == [0, 0, 0], "a plain step is measured first (three samples)"
    tail = gammas[-100:]
    assert sum(g > 0 for g in tail) <= 10, tail
    assert dear.stats()["cost_factor_b4"] == pytest.approx(2.0, rel=0.05)
    fair = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.2, prior_alpha=0.5)
    tail = run(fair, 4, 1.0, 300)[-100:]
    assert sum(g > 0 for g in tail) >= 98, "a plain step every 128 speculating ones, no more"
    blind = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=0.2, prior_alpha=0.5, measured_costs=False)
    assert all(g > 0 for g in run(blind, 4, 2.0, 300)) and "cost_factor_b4" not in blind.stats()


def test_the_router_prices_offers_with_the_factor() -> None:
    """An offer of one likely token (0.9 expected) beats none at the profile's price and loses to it
    when speculating steps measure twice as dear; the per-sequence policy passes the factor on."""
    router = SequenceRouter(synthetic_profile())
    offer = {"suffix": (0.9, 1)}
    assert router.choose(4, {}, offer) == ("suffix", 1)
    assert router.choose(4, {}, offer, cost_factor=2.0) == ("", 0)
    seqs = [SeqState(i, 0.0, 100, None, {"suffix": (0.9, 1)}) for i in range(4)]
    for measured_costs, want in ((False, {("suffix", 1)}), (True, {("eagle3", 0)})):
        # eagle3 at prior alpha 0.3: 1.24x at gamma 1 by the profile, 0.62x at twice its price
        policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, ema=1.0, prior_alpha=0.3, probe_every=0,
                                drafters=("eagle3", "suffix"), shadowed=frozenset({"suffix"}), per_sequence=True,
                                measured_costs=measured_costs)
        for step in [measured(4, 2, 0.5, 2.0)] + [measured(4, 0, 0.5, 1.0)] * 3:
            policy.observe(step)
        plans = policy.plan_drafters(PlanInput(4, 0.1, seqs, ("eagle3", "suffix")))
        assert set(plans.values()) == want
