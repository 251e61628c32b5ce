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
probabilities come from counts, over-confident on a long draft seen once and under-confident on a
short unsure one, so the router keeps, per model-free drafter and band of the offer's expected tokens
(``CALIBRATION_BANDS``: below 0.5, 0.5-1, 1-2, 2 and more), an EMA of accepted / expected over the
offers it routed, each sequence's own (start 1.0, trusting the drafter). The bands deliver different
shares of their promise (SmolLM2 on sql_help, batch 1: 0.23 / 0.46 / 0.20 / 0.59 from the lowest band
up), so one ratio (0.54), learnt mostly from the frequent sure offers, priced the unsure ones at more
than twice what they delivered.

Worked example (b = 1, T(1, q) flat at 10 ms, eagle3 D0 4 ms, its best gamma 3 at predicted 1.20x):
sequence A's suffix offer expects 3.2 of 4 tokens -> speedup (1 + 3.2) / (1 + 0) = 4.2 > 1.20:
suffix, gamma 4. Sequence B's suffix offer expects 0.3 of 1 token -> 1.3; eagle3 1.20 -> suffix
still (a free draft of one likely token beats a paid chain). Sequence C has no offer: eagle3, 3.
With calibration 0.5 in band 0 (suffix's offers below 0.5 tokens accepted half what they
promised), B's offer prices at 1.15 and C's and B's both go to eagle3; A's, in band 3, keeps 4.2.

Measured routes (``RouteMeter``, opt-in: ``--measured-routes``). Both prices come from the
start-up profile, which times the forward and each drafter alone; a routed step costs what the profile
leaves out: a model drafter asked for a sequence whose context it lost while another drafter ran (a
cold step: no draft, and the taps it needs), the taps lingering after it drafted, its catch-up, the
offers and shadows. Measured on the compiled w4a8 path at batch 1 (sql_help), EAGLE-3's routed steps
emitted 1.31 tokens in 12.9 ms where a plain step took 8.6 ms: a loss the profile priced as a gain.
So the meter compares, per batch-size bucket and route (a drafter, or none), the tokens a step of that
route emitted with the tokens its predicted speedup would have emitted in the same seconds at the
profile's plain speed (``g``: 1.0 when the profile is right), over the steps where every sequence took
the same route (each step at batch 1); a model drafter's price is then multiplied by
``g(route) / g(none)``: its realised speed relative to plain decoding's in the same engine. A route
with fewer than ``min_steps`` measured steps keeps g = 1 (the profile's word). The analytic policy's
probes of a model drafter feed its meter too, so a drafter priced out is measured again. An offer is
not scaled: its band's calibration already learns what it delivers, and its cost is a verification
of its length, which the profile times (scaled too, the same shortfall was counted twice: on sql_help
g(suffix) 0.86 against g(none) 0.97 priced the unsure offers, which paid, below none).

Why opt-in: measured on four domains (docs/benchmarks/policies.md, 2026-12-05) it helped where EAGLE-3's
routed steps lost (sql_help) and hurt where they paid (chat): once priced out, the drafter's taps stop
lingering (``AnalyticPolicy.priced_out``), so its probes run cold and measure slow, and it stays priced out.

Worked example (T(1, 1) = 10 ms): eagle3 predicted 1.2, its steps take 15 ms and emit 1.3 tokens: the
prediction would have emitted 1.2 x 15 / 10 = 1.8 tokens, g(eagle3) = 1.3 / 1.8 = 0.72; none steps
take 11 ms for their token: g(none) = 1 / 1.1 = 0.91; eagle3 is priced 1.2 x 0.72 / 0.91 = 0.95:
below none, so a sequence without a suffix offer decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidespec.speculative.policy.api import bucket_of, measures_decoding
from tidespec.speculative.policy.speedup import Profile, speedup_of_lengths
from tidespec.stats import StepStats

CALIBRATION_RANGE = (0.05, 1.5)  # accepted / expected kept in this range (one unlucky step cannot zero it)
CALIBRATION_BANDS = (0.5, 1.0, 2.0)  # an offer's expected tokens: band i is below edge i (the last: above all)
NONE = "none"  # the route of a sequence that decodes without a draft


@dataclass
class _RouteSpeed:
    """EMAs over one route's uniform steps at one bucket: tokens emitted, and the tokens its predicted
    speedup would have emitted in the same seconds at the profile's plain speed."""

    tokens: float = 0.0
    predicted: float = 0.0
    steps: int = 0

    def g(self, min_steps: int) -> float | None:
        """tokens / predicted once ``min_steps`` steps were measured, else None."""
        return self.tokens / self.predicted if self.steps >= min_steps and self.predicted > 0 else None


@dataclass
class RouteMeter:
    """Realised speed of each route against its prediction (module docstring, "Measured routes")."""

    profile: Profile
    ema: float = 0.1
    min_steps: int = 8
    _speeds: dict[tuple[int, str], _RouteSpeed] = field(default_factory=dict)

    def g(self, batch_size: int, route: str) -> float:
        """Tokens emitted / tokens predicted for ``route`` at this bucket; 1.0 until ``min_steps`` measured."""
        speed = self._speeds.get((bucket_of(batch_size), route))
        g = speed.g(self.min_steps) if speed is not None else None
        return 1.0 if g is None else g

    def measured(self) -> dict[tuple[int, str], float]:
        """(bucket, route) -> g, for the routes measured on ``min_steps`` steps or more."""
        return {key: g for key, speed in sorted(self._speeds.items()) if (g := speed.g(self.min_steps)) is not None}

    def factor(self, batch_size: int, route: str) -> float:
        """What a price of ``route`` is multiplied by: its realised speed relative to none's."""
        return self.g(batch_size, route) / self.g(batch_size, NONE)

    def record(self, route: str, predicted: float, step: StepStats) -> None:
        """One decode step in which every sequence took ``route``, priced ``predicted`` (raw, before
        ``factor``)."""
        if not measures_decoding(step):
            return
        b = step.num_decode_seqs
        expected = predicted * self.profile.baseline_tokens_per_s(b) * step.total_time
        speed = self._speeds.setdefault((bucket_of(b), route), _RouteSpeed())
        if speed.steps == 0:
            speed.tokens, speed.predicted = float(step.num_emitted_tokens), expected
        else:
            speed.tokens = (1.0 - self.ema) * speed.tokens + self.ema * step.num_emitted_tokens
            speed.predicted = (1.0 - self.ema) * speed.predicted + self.ema * expected
        speed.steps += 1


@dataclass
class SequenceRouter:
    """Chooses (drafter, gamma) per sequence from the batch-level model-drafter table and each
    sequence's offers; learns each model-free drafter's calibration from the steps it was routed."""

    profile: Profile
    ema: float = 0.1
    meter: RouteMeter | None = None  # measured routes: prices scaled by their realised speed
    # (model-free drafter, band of the offer's expected tokens) -> accepted / expected
    calibration: dict[tuple[str, int], float] = field(default_factory=dict)
    _expected: dict[int, tuple[str, float]] = field(default_factory=dict)  # this step's routed offers per sequence
    _routes: list[tuple[str, float]] = field(default_factory=list)  # this step's (route, raw price) per sequence

    def start_step(self) -> None:
        """Forget the last plan's routes (a plan is about to be made)."""
        self._routes = []

    def planned(self, route: str, speedup: float, num_seqs: int) -> None:
        """A step planned without ``choose`` (the policy's probe: every sequence on ``route``)."""
        self._routes = [(route or NONE, speedup)] * num_seqs

    def choose(self, batch_size: int, models: dict[str, tuple[int, float]],
               offers: dict[str, tuple[float, int]], seq_id: int = -1) -> tuple[str, int]:
        """``models``: model drafter -> (its best gamma, predicted speedup) at this batch size;
        ``offers``: model-free drafter -> (expected accepted tokens, draft length) of its draft for
        sequence ``seq_id``. Returns (drafter, gamma), ("", 0) for none. Records a routed offer's
        expectation for ``observe``."""
        best: tuple[float, int, str] = (1.0, 0, "")  # (speedup, -tokens, drafter): max wins
        raw = {"": 1.0}  # drafter -> its price before the meter's factor
        for name, (gamma, speedup) in models.items():
            if gamma > 0:
                raw[name] = speedup
                best = max(best, (speedup * self._factor(batch_size, name), -gamma, name))
        for name, (expected, length) in offers.items():
            if length > 0:
                accepted = min(float(length), max(0.0, expected) * self.calibration.get((name, band(expected)), 1.0))
                speedup = speedup_of_lengths(1.0 + accepted, float(length), length, batch_size, self.profile, name)
                raw[name] = speedup  # its band's calibration learnt the benefit; the profile times its verification
                best = max(best, (speedup, -length, name))
        _, neg_gamma, name = best
        if name in offers:
            self._expected[seq_id] = (name, offers[name][0])
        self._routes.append((name or NONE, raw[name]))
        return name, -neg_gamma

    def _factor(self, batch_size: int, name: str) -> float:
        return self.meter.factor(batch_size, name) if self.meter is not None else 1.0

    def measure(self, step: StepStats) -> None:
        """The step that ran: with a meter, a step whose sequences all took one route updates that
        route's speed (a cold model drafter's step counts as its route: its cost is the switch's)."""
        routes, self._routes = self._routes, []
        if self.meter is None or not routes or len(routes) != step.num_decode_seqs:
            return
        names = {name for name, _ in routes}
        if len(names) == 1:
            self.meter.record(routes[0][0], sum(p for _, p in routes) / len(routes), step)

    def observe(self, seq_accepted: dict[int, int]) -> None:
        """The step that ran (``StepStats.seq_accepted``: sequence -> tokens its draft got accepted): each
        routed offer's accepted tokens against its expectation move its drafter's and band's calibration
        (then this step's expectations are forgotten). A routed sequence with no outcome (a guard or a
        predicted output took its step) teaches nothing."""
        lo, hi = CALIBRATION_RANGE
        for sid, (name, expected) in self._expected.items():
            if expected <= 0 or sid not in seq_accepted:
                continue
            key = (name, band(expected))
            ratio = min(hi, max(lo, seq_accepted[sid] / expected))
            self.calibration[key] = (1.0 - self.ema) * self.calibration.get(key, 1.0) + self.ema * ratio
        self._expected = {}


def band(expected: float) -> int:
    """The calibration band of an offer expecting ``expected`` tokens: 0.3 -> 0, 0.5 -> 1, 1.5 -> 2, 3.2 -> 3."""
    return next((i for i, edge in enumerate(CALIBRATION_BANDS) if expected < edge), len(CALIBRATION_BANDS))
