"""The static speculation policy (``StaticPolicy``): the same gamma for every sequence, every step.

Why this exists: it is the classic engine (a fixed gamma, or 0 for plain decoding) behind the
``SpeculationPolicy`` protocol, and the baseline the adaptive policies are measured against.
"""

from __future__ import annotations

from tidespec.speculative.policy.api import PlanInput
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats


class StaticPolicy:
    """Always the same gamma (0 = never speculate)."""

    def __init__(self, gamma: int, profile: Profile | None = None) -> None:
        if not 0 <= gamma <= 64:
            raise ValueError(f"gamma must be in [0, 64], got {gamma}")
        self.name = "static"
        self.gamma = gamma
        self.profile = profile  # not used to decide; kept so metrics can check speedup against it
        self._steps = 0

    def plan(self, inp: PlanInput) -> dict[int, int]:
        self._steps += 1
        return {s.seq_id: self.gamma for s in inp.seqs}

    def observe(self, step: StepStats) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"gamma": float(self.gamma), "steps": float(self._steps)}
