"""What the analytic policy's probes cost (``speculative/policy/probes.py``), how often they come when they keep
confirming the choice, and that a probed drafter is warm: the budget a policy that decided to decode plainly
spends is the one it says."""

from __future__ import annotations

import pytest

from tests.speculative.policy.test_policy import feedback, plan_input, synthetic_profile
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import priced_out, probe_due
from tidespec.speculative.policy.guards import Guards
from tidespec.speculative.policy.probes import ProbeMeter
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

T9 = Profile(target_latency={1: 0.009, 64: 0.009}, draft_cost={"default": 0.0})


def _step(seconds: float, tokens: int, batch: int = 4, drafts: int = 0, prefill: int = 0, cold: int = 0) -> StepStats:
    return StepStats(num_decode_seqs=batch, total_time=seconds, num_emitted_tokens=tokens, num_drafts=drafts,
                     num_prefill_tokens=prefill, num_cold_drafts=cold)


def test_the_probe_meter_measures_a_probe_against_this_engines_plain_steps_hand_traced() -> None:
    """The module docstring's example: plain steps at 9.3 ms where the profile says 9 ms; a probe of four
    sequences emitting 4.13 tokens in 13.6 ms realises 0.706."""
    meter = ProbeMeter(T9, ema=0.2, min_probes=3, min_steps=8)
    assert meter.plain_seconds(4) == pytest.approx(0.009)  # nothing measured: the profile's
    for _ in range(8):
        meter.record(_step(0.0093, 4), "eagle3", probed=False)
    meter.record(_step(0.020, 4, drafts=4), "eagle3", probed=False)  # a drafted step is not a plain one
    meter.record(_step(0.020, 4, prefill=64), "eagle3", probed=False)  # nor one with a prompt chunk
    meter.record(_step(0.020, 4, cold=2), "eagle3", probed=False)  # nor one that asked a cold drafter
    assert meter.plain_seconds(4) == pytest.approx(0.0093)
    for _ in range(2):
        meter.record(_step(0.0136, 413 / 100, drafts=4), "eagle3", probed=True)  # type: ignore[arg-type]
    assert meter.speedup("eagle3", 4) is None  # two probes: not yet
    meter.record(_step(0.0136, 413 / 100, drafts=4), "eagle3", probed=True)  # type: ignore[arg-type]
    assert meter.speedup("eagle3", 4) == pytest.approx((4.13 / 4) / (13.6 / 9.3))
    assert meter.speedup("eagle3", 1) is None and meter.speedup("medusa", 4) is None
    assert set(meter.measured()) == {"probe_speedup_eagle3_b4"}


def test_a_probe_is_priced_at_what_the_drafters_probes_realised_when_that_is_lower() -> None:
    """alpha 0: eq. 5 prices a probe at b = 4 at 0.952 (every 3rd step); probes measured at 0.5 of a plain
    step's speed cost 0.5, so the next one waits 25 steps (then doubles, as it confirmed the choice)."""
    policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.0, probe_budget=0.02)
    for _ in range(8):
        policy.probes.record(_step(0.010, 4), None, probed=False)
    for _ in range(3):
        policy.probes.record(_step(0.040, 8, drafts=4), None, probed=True)
    assert policy.probes.speedup(None, 4) == pytest.approx(0.5)
    plans = [policy.plan(plan_input(4))[0] for _ in range(25)]
    assert plans == [0] * 24 + [1]
    assert policy.stats()["probe_speedup_default_b4"] == pytest.approx(0.5)


def test_a_probe_that_switches_the_policy_on_resets_the_backoff() -> None:
    """A drafter that got better: the probe's outcome turns it on, and the next probes (when it is off
    again) are priced as at the start."""
    policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.0, probe_budget=0.02, ema=1.0)
    gammas = [policy.plan(plan_input(4))[0] for _ in range(8)]
    assert gammas == [0, 0, 1, 0, 0, 0, 0, 1] and policy._backoff[4] == 2
    policy.observe(feedback(4, 1, 1.0))  # the probe: every draft accepted
    assert policy.plan(plan_input(4))[0] > 0 and policy._backoff[4] == 1


def test_a_policy_that_decodes_plainly_announces_its_next_probe() -> None:
    """Off (alpha 0), ``probe_due`` says so in the ``warm_steps`` steps before each probe (through the guards
    too), so the engine computes the taps a tap-reading drafter needs to draft from a context in the probe."""
    for warm, due in ((1, [False, True, False, False, False, False, True, False]),
                      (8, [True, True, False, True, True, True, True, False])):
        policy = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.0, probe_budget=0.02, warm_steps=warm)
        guarded = Guards(policy)
        seen = [(guarded.plan(plan_input(4))[0], probe_due(guarded, "eagle3")) for _ in range(8)]
        assert [g for g, _ in seen] == [0, 0, 1, 0, 0, 0, 0, 1]
        assert [d for _, d in seen] == due
    on = AnalyticPolicy(synthetic_profile(), gamma_max=4, prior_alpha=0.9)
    on.plan(plan_input(4))
    assert not probe_due(on, "eagle3") and not priced_out(on, "eagle3")
    with pytest.raises(ValueError, match="warm_steps"):
        AnalyticPolicy(synthetic_profile(), gamma_max=4, warm_steps=-1)
