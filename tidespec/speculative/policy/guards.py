"""Guards: the operational rules (``GuardConfig``, ``Guards``) wrapped around any speculation policy.

Why this exists: the field guide (paper 004) gives rules that beat any controller's choice — KV
pressure and high temperature switch speculation off, a per-request override wins over the
policy, and no sequence drafts past its remaining output budget; one wrapper applies them to
every policy, so no policy has to.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidespec.config import GUARD_KV_USAGE, GUARD_TEMPERATURE
from tidespec.errors import ConfigError
from tidespec.speculative.policy.api import (
    PlanInput,
    SpeculationPolicy,
    check_gamma_max,
    drafter_changed,
    plans_drafters,
    priced_out,
    probe_due,
    wants_offers,
)
from tidespec.stats import StepStats


@dataclass
class GuardConfig:
    """Operational limits; the defaults are the ``--guard-*`` flags' (``tidespec.config``)."""

    kv_threshold: float = GUARD_KV_USAGE  # KV usage above this -> no speculation (reservations x (gamma+1))
    temperature_threshold: float = GUARD_TEMPERATURE  # sampling temperature above this -> no speculation
    gamma_max: int = 8  # cap for per-request overrides

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ConfigError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if self.temperature_threshold < 0:
            raise ConfigError(f"temperature_threshold must be >= 0, got {self.temperature_threshold}")
        check_gamma_max(self.gamma_max)


class Guards:
    """Operational rules on top of any policy, applied per sequence in this order:

    1. override == 0 -> 0 (the request opted out);
    2. override > 0 -> min(override, gamma_max), otherwise the policy's gamma, set to 0 when
       temperature > temperature_threshold (an explicit override beats this heuristic);
    3. kv_usage > kv_threshold -> 0 for everyone (memory safety beats preferences);
    4. gamma <= remaining_tokens - 1 (a step emits up to gamma + 1 tokens).

    Example (kv_threshold 0.85, temperature_threshold 0.8, gamma_max 8, policy says 4):
    seq (t=0.0, remaining 100, None) -> 4; (t=1.0, 100, None) -> 0; (t=1.0, 100, 12) -> 8;
    (t=0.0, 3, None) -> 2; any seq at kv_usage 0.9 -> 0.
    The inner policy is always consulted and always observes, so its schedule and statistics
    see every step; bandits credit the arm that actually ran (``StepStats.gamma``).
    """

    def __init__(self, inner: SpeculationPolicy, config: GuardConfig | None = None) -> None:
        self.inner = inner
        self.config = config or GuardConfig()
        self.name = inner.name
        self._counts = {"kv": 0, "temperature": 0, "override": 0, "opt_out": 0, "remaining": 0}

    @property
    def wants_offers(self) -> bool:
        """The inner policy's (per-sequence drafting, ``routing.py``)."""
        return wants_offers(self.inner)

    def priced_out(self, drafter: str) -> bool:
        """The inner policy's (``api.priced_out``)."""
        return priced_out(self.inner, drafter)

    def probe_due(self, drafter: str) -> bool:
        """The inner policy's (``api.probe_due``)."""
        return probe_due(self.inner, drafter)

    def drafter_changed(self, drafter: str) -> None:
        """The inner policy's (``api.drafter_changed``)."""
        drafter_changed(self.inner, drafter)

    def plan(self, inp: PlanInput) -> dict[int, int]:
        return {sid: gamma for sid, (_, gamma) in self.plan_drafters(inp).items()}

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        """The inner policy's (drafter, gamma) per sequence with the rules applied to gamma; an
        inner policy that only picks gamma drafts with the first drafter (an override too)."""
        cfg = self.config
        default = inp.drafters[0] if inp.drafters else ""
        if plans_drafters(self.inner):
            raw = self.inner.plan_drafters(inp)
        else:
            raw = {sid: (default, g) for sid, g in self.inner.plan(inp).items()}
        kv_pressure = inp.kv_usage > cfg.kv_threshold
        if kv_pressure:
            self._counts["kv"] += 1
        out: dict[int, tuple[str, int]] = {}
        for s in inp.seqs:
            name, planned = raw.get(s.seq_id, (default, 0))
            if s.override == 0:
                gamma = 0
                self._counts["opt_out"] += 1
            elif s.override is not None:
                gamma = min(s.override, cfg.gamma_max)
                self._counts["override"] += 1
            elif s.temperature > cfg.temperature_threshold:
                gamma = 0
                self._counts["temperature"] += 1
            else:
                gamma = planned
            if kv_pressure:
                gamma = 0
            cap = max(0, s.remaining_tokens - 1)
            if gamma > cap:
                gamma = cap
                self._counts["remaining"] += 1
            out[s.seq_id] = (name if gamma > 0 else default, gamma)
        return out

    def observe(self, step: StepStats) -> None:
        self.inner.observe(step)

    def stats(self) -> dict[str, float]:
        out = dict(self.inner.stats())
        for name, n in self._counts.items():
            out[f"guard_{name}"] = float(n)
        return out
