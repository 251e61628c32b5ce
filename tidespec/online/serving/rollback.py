"""Deploy only what pays in service: after a drafter swap, the served check, and the rollback.

Why this exists: the trainer publishes a new EAGLE-3 version when its *held-out simulated*
acceptance beats the serving one's (TIDE §3.2's deploy rule). Held-out rows are not the
traffic being served: a version can win offline and lose in service (a stale held-out split, a
domain the trainer saw little of, a bad round). So after every swap the served version is checked
on what it actually does: its measured acceptance, turned into the speedup it gives at the batch
sizes being served (eq. 5 with the profile, ``speculative.policy.speedup``), against the same
estimate for the previous version over the steps before the swap. When the new version loses by
more than ``margin`` the previous one is swapped back (versions are kept; a rollback is a swap)
and the new one is refused until a newer one is published.

What is compared. Per version: alpha = accepted / (accepted + rejections) over the sequences it
drafted (the maximum-likelihood per-token acceptance, ``tracking.AlphaTracker``), and the batch
sizes of the steps it drafted in. The served speedup of a version is the mean over those batch
sizes of eq. 5 at its alpha with the best gamma >= 1 (not floored at plain decoding's 1.0, so two
versions that both lose to plain decoding still compare); both versions are scored on the
*new* version's batch-size mix, so a change of load between the two periods is not mistaken for
a change of drafter. Without a profile the acceptance length at the largest gamma is compared.

Worked example (margin 0.02, min_drafts 64): the old version accepted 300 of 300 + 200
rejections (alpha 0.6) in the 256 drafts before the swap; the new one 50 of 50 + 64 (alpha 0.44)
in its first 64 drafts, all at batch 1. Eq. 5 on the profile gives 1.31x at alpha 0.6 and 1.12x at
0.44: 1.12 < 1.31 x 0.98, so the previous version is swapped back after 64 drafts of the new one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from tidespec.engine.observer import EngineObserver
from tidespec.errors import ConfigError
from tidespec.models.eagle3.head import Eagle3Config
from tidespec.speculative.policy.speedup import Profile, expected_accept_length, practical_speedup
from tidespec.stats import StepStats

Verdict = Literal["keep", "rollback"]


@dataclass(frozen=True)
class RollbackConfig:
    """``min_drafts``: drafts of the new version before deciding; ``history``: drafts of the old
    version remembered; ``margin``: relative loss tolerated (noise); ``gamma_max``: eq. 5's range."""

    min_drafts: int = 64
    history: int = 256
    margin: float = 0.02
    gamma_max: int = 4

    def __post_init__(self) -> None:
        if self.min_drafts < 1 or self.history < 1 or self.gamma_max < 1 or not 0.0 <= self.margin < 1.0:
            raise ConfigError("need min_drafts, history, gamma_max >= 1 and margin in [0, 1)")


@dataclass
class _Record:
    """Drafts of one version: (batch size, depth, accepted) per drafted sequence, newest last."""

    drafts: deque[tuple[int, int, int]]

    def alpha(self) -> float:
        accepted = sum(a for _, _, a in self.drafts)
        rejected = sum(a < d for _, d, a in self.drafts)
        return accepted / (accepted + rejected) if accepted + rejected else 0.0


@dataclass
class Kept:
    """The version that served before the last swap: enough to swap it back."""

    version: int
    state_dict: dict[str, torch.Tensor]
    config: Eagle3Config
    record: _Record


@dataclass
class ServedCheck(EngineObserver):
    """The check after each swap (module docstring); fed every step, asked between steps."""

    profile: Profile | None
    config: RollbackConfig = field(default_factory=RollbackConfig)
    drafter_name: str = "eagle3"
    current: _Record = field(init=False)
    previous: Kept | None = field(default=None, init=False)
    rollbacks: int = field(default=0, init=False)
    last_verdict: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.current = _Record(deque(maxlen=self.config.history))

    def on_step_end(self, stats: StepStats) -> None:
        """The drafts the checked drafter made this step (an engine observer)."""
        outcomes = stats.drafter_outcomes.get(self.drafter_name)
        if outcomes is None and len(stats.drafter_outcomes) == 1:
            outcomes = next(iter(stats.drafter_outcomes.values()))  # the engine's only drafter
        for _gamma, depth, accepted in outcomes or ():
            if depth:
                self.current.drafts.append((stats.num_decode_seqs, depth, accepted))

    def swapped(self, old_version: int, old_state: dict[str, torch.Tensor], old_config: Eagle3Config) -> None:
        """A new version now serves; ``old_*`` is what served before (copied by the caller)."""
        self.previous = Kept(old_version, old_state, old_config, self.current)
        self.current = _Record(deque(maxlen=self.config.history))
        self.last_verdict = None

    def verdict(self) -> Verdict | None:
        """Once the new version drafted ``min_drafts`` times: keep it or roll back; None before
        (and when there is nothing to compare with)."""
        prev = self.previous
        if prev is None or len(self.current.drafts) < self.config.min_drafts or not prev.record.drafts:
            return None
        new, old = self.served_speedup(self.current), self.served_speedup(prev.record)
        verdict: Verdict = "rollback" if new < old * (1.0 - self.config.margin) else "keep"
        self.last_verdict = f"{verdict}: served speedup {new:.3f} vs {old:.3f} before the swap"
        return verdict

    def served_speedup(self, record: _Record) -> float:
        """Eq. 5 at ``record``'s alpha with the best gamma, averaged over the new version's batch
        sizes (so both versions are scored on the same load); acceptance length without a profile."""
        alpha = min(record.alpha(), 1.0 - 1e-9)
        if self.profile is None:
            return expected_accept_length(alpha, self.config.gamma_max)
        sizes = [b for b, _, _ in self.current.drafts] or [1]
        gammas = range(1, self.config.gamma_max + 1)
        return sum(max(practical_speedup(alpha, g, b, self.profile, self.drafter_name) for g in gammas)
                   for b in sizes) / len(sizes)

    def settled(self) -> None:
        """The verdict was acted on: nothing to compare with until the next swap."""
        self.previous = None
