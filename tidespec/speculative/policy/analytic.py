"""TIDE's analytic speculation policy (``AnalyticPolicy``): the best eq.-5 gamma at this batch size.

Why this exists: TIDE eq. 5 on a profiled T(n)/D0, with alpha estimated online per batch-size
bucket (``tracking.AlphaTracker``), predicts the speedup of every gamma; this policy picks the
gamma with the best predicted speedup, 0 if none beats 1.0, and while off probes at a bounded
cost so it never deadlocks (worked example in the class docstring).
"""

from __future__ import annotations

from tidespec.speculative.policy.api import PlanInput, bucket_of, check_gamma_max
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.tracking import AlphaTracker, predicted_speedups
from tidespec.stats import StepStats


def _argmax(speedups: list[float], start: int) -> int:
    """Index >= ``start`` of the highest speedup, ties to the smaller index (shorter gamma)."""
    return max(range(start, len(speedups)), key=lambda g: (speedups[g], -g))


class AnalyticPolicy:
    """TIDE's adaptive drafter: best eq.-5 gamma at this batch size and the bucket's alpha.

    It starts from ``prior_alpha`` (optimistic by default so it speculates and measures), then
    follows the bucket's estimates (``AlphaTracker``: alpha and the drafter's continuation rho).
    A bucket whose model says "off" would never measure alpha again (the "decision deadlock"
    Nightjar points out; with every bucket off it stays off for good), so while off it probes:
    one step at the gamma the model rates best (its predicted speedup s < 1), which refreshes the
    bucket's estimates (our addition to TIDE). A probe is predicted to cost 1 - s of a step, so
    the policy saves ``probe_budget`` of a step per off step and probes once the savings cover
    that cost — and at the latest after ``probe_every`` off steps (0 disables probing). Near
    break-even (s = 0.95) it probes every 3rd step, so a noisy dip of the estimate below the
    threshold is corrected within a few steps; where speculating is hopeless (s = 0.3) every 35th
    step, spending about ``probe_budget`` of the time either way.

    Worked example (probe_budget 0.02, probe_every 64; the model says off with the best gamma 1
    predicted at s = 0.952, so a probe costs 0.048): gammas 0, 0, 1, 0, 0, 1, ... (savings 0.02,
    0.04, 0.06 >= 0.048 -> probe, start over). At s = 0.2: 0 x 39, then 1 (cost 0.8 = 40 x 0.02).
    """

    def __init__(self, profile: Profile, gamma_max: int, ema: float = 0.1, prior_alpha: float = 0.7,
                 drafter: str | None = None, probe_every: int = 64, probe_budget: float = 0.02) -> None:
        check_gamma_max(gamma_max)
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {probe_every}")
        if not 0.0 <= probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in [0, 1], got {probe_budget}")
        self.name = "analytic"
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.num_probes = 0
        self._off_steps: dict[int, int] = {}  # bucket -> consecutive off steps since the last probe
        self.profile = profile
        self.gamma_max = gamma_max
        self.drafter = drafter
        self.alphas = AlphaTracker(prior_alpha=prior_alpha, ema=ema)
        self._chosen: dict[int, int] = {}
        self._speedup: dict[int, float] = {}
        self._last_speedup = 1.0

    def predicted(self, batch_size: int) -> list[float]:
        """Eq.-5 speedup of every gamma 0..gamma_max at this batch size (``predicted_speedups``)."""
        return predicted_speedups(self.alphas, batch_size, self.profile, self.gamma_max, self.drafter)

    def decide(self, batch_size: int) -> tuple[int, float]:
        """(gamma, predicted speedup) for this batch size now: the best gamma, 0 if none beats 1.0
        (ties to the shorter gamma, as ``speedup.best_gamma``)."""
        s = self.predicted(batch_size)
        gamma = _argmax(s, 0)
        return gamma, s[gamma]

    def plan(self, inp: PlanInput) -> dict[int, int]:
        if not inp.seqs:
            return {}
        s = self.predicted(inp.batch_size)
        gamma = _argmax(s, 0)
        speedup = s[gamma]
        key = bucket_of(inp.batch_size)
        if gamma == 0 and self.probe_every:
            off = self._off_steps.get(key, 0) + 1
            probe = _argmax(s, 1)
            if off >= self.probe_every or off * self.probe_budget >= 1.0 - s[probe]:
                gamma, off = probe, 0
                self.num_probes += 1
            self._off_steps[key] = off
        else:
            self._off_steps[key] = 0
        self._chosen[key] = gamma
        self._speedup[key] = speedup
        self._last_speedup = speedup
        return {s.seq_id: gamma for s in inp.seqs}

    def observe(self, step: StepStats) -> None:
        if step.num_decode_seqs >= 1:
            self.alphas.update(bucket_of(step.num_decode_seqs), step)

    def stats(self) -> dict[str, float]:
        out = {"predicted_speedup": self._last_speedup, "alpha": self.alphas.global_alpha,
               "rho": self.alphas.overall.rho(), "probe_steps": float(self.num_probes)}
        for key in sorted(self._chosen):
            out[f"gamma_b{key}"] = float(self._chosen[key])
            out[f"speedup_b{key}"] = self._speedup[key]
            out[f"alpha_b{key}"] = self.alphas.alpha(key)
            out[f"rho_b{key}"] = self.alphas.rho(key)
        return out
