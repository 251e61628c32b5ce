"""Per-sequence drafting (issue 80 item 1): each sequence of a batch gets its own drafter and length.

Why this exists: the controller's batch-level choice (``AnalyticPolicy.plan_drafters``) gives one
drafter to every sequence of a step, but the drafters' value differs per sequence far more than
per batch: the suffix drafter proposes nothing on a third to a half of chat steps and long, sure
drafts on a request that repeats its prompt, in the same batch. Snowflake's ArcticInference routes
per request (suffix when its match score reaches the speculation length, else the model drafter);
here each option is priced by the policy's own cost model instead of a fixed threshold:

- none: speedup 1.0;
- a model drafter (EAGLE-3, a draft model): its eq.-5 speedup at its best gamma, from its
  trackers at this batch size (the batch-level table: its acceptance is not known per sequence);
- a model-free drafter's actual draft for this sequence (an *offer*: the engine asks the
  model-free members before planning, which costs a few array operations per sequence): its
  own estimate of the tokens verification accepts (the suffix drafter's sum of path
  probabilities), times a calibration learnt from the offers it won, priced by
  ``speedup_of_lengths`` over the offer's length.

The highest wins (ties: the option drafting fewer tokens). Calibration: the suffix drafter's
probabilities come from counts and are over-confident on a single occurrence, so the router keeps,
per model-free drafter, an EMA of accepted / expected over the offers it routed (start 1.0).

Worked example (b = 1, T(1, q) flat at 10 ms, eagle3 D0 4 ms, its best gamma 3 at predicted 1.20x):
sequence A's suffix offer expects 3.2 of 4 tokens -> speedup (1 + 3.2) / (1 + 0) = 4.2 > 1.20:
suffix, gamma 4. Sequence B's suffix offer expects 0.3 of 1 token -> 1.3; eagle3 1.20 -> suffix
still (a free draft of one likely token beats a paid chain). Sequence C has no offer: eagle3, 3.
With calibration 0.5 (suffix's offers accepted half what they promised), B's offer prices at
1.15 and C's and B's both go to eagle3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidespec.speculative.policy.speedup import Profile, speedup_of_lengths

CALIBRATION_RANGE = (0.05, 1.5)  # accepted / expected kept in this range (one unlucky step cannot zero it)


@dataclass
class SequenceRouter:
    """Chooses (drafter, gamma) per sequence from the batch-level model-drafter table and each
    sequence's offers; learns each model-free drafter's calibration from the steps it was routed."""

    profile: Profile
    ema: float = 0.1
    calibration: dict[str, float] = field(default_factory=dict)  # model-free drafter -> accepted / expected
    _expected: dict[str, float] = field(default_factory=dict)  # this step's routed offers' expected tokens

    def choose(self, batch_size: int, models: dict[str, tuple[int, float]],
               offers: dict[str, tuple[float, int]]) -> tuple[str, int]:
        """``models``: model drafter -> (its best gamma, predicted speedup) at this batch size;
        ``offers``: model-free drafter -> (expected accepted tokens, draft length) of its draft for
        this sequence. Returns (drafter, gamma), ("", 0) for none. Records a routed offer's
        expectation for ``observe``."""
        best: tuple[float, int, str] = (1.0, 0, "")  # (speedup, -tokens, drafter): max wins
        for name, (gamma, speedup) in models.items():
            if gamma > 0:
                best = max(best, (speedup, -gamma, name))
        for name, (expected, length) in offers.items():
            if length > 0:
                accepted = min(float(length), max(0.0, expected) * self.calibration.get(name, 1.0))
                speedup = speedup_of_lengths(1.0 + accepted, float(length), length, batch_size, self.profile, name)
                best = max(best, (speedup, -length, name))
        _, neg_gamma, name = best
        if name in offers:
            self._expected[name] = self._expected.get(name, 0.0) + offers[name][0]
        return name, -neg_gamma

    def observe(self, drafter_outcomes: dict[str, list[tuple[int, int, int]]]) -> None:
        """The step that ran: each routed model-free drafter's accepted tokens against what its
        offers expected move its calibration (then this step's expectations are forgotten)."""
        lo, hi = CALIBRATION_RANGE
        for name, expected in self._expected.items():
            if expected <= 0:
                continue
            accepted = sum(a for _, _, a in drafter_outcomes.get(name, []))
            ratio = min(hi, max(lo, accepted / expected))
            old = self.calibration.get(name, 1.0)
            self.calibration[name] = (1.0 - self.ema) * old + self.ema * ratio
        self._expected = {}
