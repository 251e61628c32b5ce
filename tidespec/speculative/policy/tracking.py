"""Acceptance tracking: per-bucket estimates of what a drafter delivers (``AlphaTracker``) and the
eq.-5 speedups they predict for every gamma (``predicted_speedups``).

Why this exists: the analytic and the hybrid policy both plan from the acceptance (alpha), the
draft continuation (rho) and the per-position outcomes measured at the batch size's bucket; one
tracker and one prediction serve both, so they read the same estimates. The estimator, why it
counts instead of averaging per-step estimates, and a worked example are in ``AlphaTracker``'s
docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidespec.speculative.policy.api import bucket_of
from tidespec.speculative.policy.speedup import Profile, speedup_of_lengths
from tidespec.stats import StepStats


@dataclass
class _Counts:
    """Exponentially forgotten counts of one bucket (or of all steps): sums in which a step
    ``n`` steps old weighs ``keep**n``."""

    accepted: float  # accepted draft tokens
    rejected: float  # drafts cut by a rejection
    proposed: float  # draft depth proposed
    stopped: float  # drafts shallower than the gamma asked for
    # per draft position k = 1, 2, ... (index k - 1): [sequences asked for >= k tokens,
    # of those whose draft reached depth k, of those that accepted >= k tokens]
    positions: list[list[float]] = field(default_factory=list)

    def alpha(self) -> float:
        n = self.accepted + self.rejected
        return self.accepted / n if n > 0 else 0.0

    def rho(self) -> float:
        n = self.proposed + self.stopped
        return self.proposed / n if n > 0 else 1.0

    def add(self, keep: float, accepted: float, rejected: float, proposed: float, stopped: float) -> None:
        self.accepted = keep * self.accepted + accepted
        self.rejected = keep * self.rejected + rejected
        self.proposed = keep * self.proposed + proposed
        self.stopped = keep * self.stopped + stopped

    def add_positions(self, keep: float, counts: Sequence[tuple[int, int, int]]) -> None:
        """Fold in one step's per-position counts (``position_counts``); positions nobody was asked for
        this step keep their counts."""
        while len(self.positions) < len(counts):
            self.positions.append([0.0, 0.0, 0.0])
        for row, (asked, reached, accepted) in zip(self.positions, counts):
            row[0] = keep * row[0] + asked
            row[1] = keep * row[1] + reached
            row[2] = keep * row[2] + accepted

    def lengths(self, gamma: int, pseudo: float) -> tuple[float, float]:
        """(E[l], mean draft length) when asking for ``gamma``: per position k, the measured
        share of sequences whose draft reached k and that accepted >= k, each shrunk towards the
        geometric model ((alpha rho)**k and rho**k) by ``pseudo`` sequences — the model alone
        where position k was never asked for."""
        return self.all_lengths(gamma, pseudo)[gamma]

    def all_lengths(self, gamma_max: int, pseudo: float) -> list[tuple[float, float]]:
        """``lengths`` of every gamma 0..gamma_max in one pass (the sums over positions 1..gamma are
        prefixes of one another: entry g is exactly ``lengths(g)``). Example: alpha 1, rho 1, nothing
        measured -> [(1, 0), (2, 1), (3, 2)] for gamma_max 2."""
        alpha, rho = self.alpha(), self.rho()
        accept_len, draft_len = 1.0, 0.0
        acc_prev = draft_prev = 1.0
        out = [(accept_len, draft_len)]
        for k in range(1, gamma_max + 1):
            geo_acc, geo_draft = (alpha * rho) ** k, rho ** k
            if k <= len(self.positions) and self.positions[k - 1][0] + pseudo > 0:
                asked, reached, acc = self.positions[k - 1]
                geo_acc = (acc + pseudo * geo_acc) / (asked + pseudo)
                geo_draft = (reached + pseudo * geo_draft) / (asked + pseudo)
            draft_prev = min(draft_prev, geo_draft)  # reaching k implies reaching k - 1
            acc_prev = min(acc_prev, geo_acc, draft_prev)  # accepting k implies accepting k - 1 and reaching k
            accept_len += acc_prev
            draft_len += draft_prev
            out.append((accept_len, draft_len))
        return out

    def scale(self, factor: float) -> None:
        """Every count times ``factor``: the same estimates, worth ``factor`` of the evidence."""
        self.accepted, self.rejected = factor * self.accepted, factor * self.rejected
        self.proposed, self.stopped = factor * self.proposed, factor * self.stopped
        self.positions = [[factor * x for x in row] for row in self.positions]

    def copy(self) -> _Counts:
        return _Counts(self.accepted, self.rejected, self.proposed, self.stopped, [list(r) for r in self.positions])


@dataclass
class AlphaTracker:
    """Per-bucket estimates of what a drafter delivers — alpha (per-token acceptance), rho (draft
    continuation) and per draft position the share of sequences that reach and accept it —
    falling back to all steps' estimates for a bucket without data, then to the priors.

    Estimator. Under eq. 2's model a sequence whose draft is ``d`` tokens deep accepts ``a`` of
    them with likelihood alpha**a (1 - alpha)**[a < d], so the maximum-likelihood alpha over
    many sequences is ``sum a / (sum a + number of rejections)``; likewise a drafter asked for
    gamma that continues past each token with probability rho gives ``rho = sum d / (sum d +
    number of drafts shallower than gamma)``. The tracker keeps exponentially forgotten *counts*
    (a step's weight falls by ``1 - ema`` per later step that drafted) and divides them, which
    stays unbiased however few sequences a step has. Averaging a per-step estimate instead (eq. 2
    inverted at each step's acceptance length, as this policy once did) is biased low at small
    batches: at batch 1, gamma 4 and true alpha 0.45,
    a step that rejects the first token says alpha = 0 and one that accepts one token says 0.52
    — their mean is 0.30, below the 0.33 that made eq. 5 speculate at batch 1 on this machine's
    profile, so the analytic policy switched itself off at batch 1 (re-measured with this
    estimator in docs/benchmarks/policies.md).

    Geometric alpha and rho assume every position alike. Suffix and n-gram drafters are not: once
    a match holds it tends to hold, so later positions are accepted more often than alpha**k says,
    and long gammas pay more than eq. 5 predicts. ``lengths`` therefore uses the per-position
    counts where a position was asked for, shrunk towards the geometric model by ``pseudo``
    sequences, and the model beyond.

    Worked example (ema 1.0, i.e. the last step only): 3 sequences asked for gamma 4 drafted
    4, 2 and 0 tokens; the first accepted all 4, the second 1 (then a rejection):
    alpha = 5 / (5 + 1) = 0.833, rho = 6 / (6 + 2) = 0.75; per position k = 1..4 the shares
    reaching k are 2/3, 2/3, 1/3, 1/3 and accepting k 2/3, 1/3, 1/3, 1/3, so with pseudo = 0
    E[l] = 1 + 5/3 = 2.667 and the mean draft is 2.0 tokens.

    The priors enter as one pseudo-observation (``prior_alpha`` accepted-vs-rejected, a drafter
    that always fills gamma), so the first real steps replace them.

    Memory in drafts, not steps. A step's counts fall by ``(1 - ema) ** (n / span)`` per later fold of ``n``
    sequences' drafts, so the estimate remembers about ``span / ema`` drafts at every batch size: a step of
    ``span`` (4) drafts forgets by ``1 - ema`` as each step did before, a batch-1 step by a quarter of that.
    Forgetting per step gave a batch-1 estimate a fourth of batch 4's evidence, and a few rejected drafts in a
    row turned off a drafter that pays: at batch 1 with the per-step memory, suffix alone under the analytic policy
    ran 1.7 % (chat) and 3.5 % (sql_help) slower, EAGLE-3 alone 6.2 % on code (docs/benchmarks/policies.md,
    2026-12-07). Example (ema 0.1, span 4): after
    a fold of 1 draft, the older counts keep 0.9 ** 0.25 = 0.974 of their weight; after one of 4 drafts, 0.9.
    """

    prior_alpha: float = 0.7
    ema: float = 0.1  # 1 - the factor by which a draft's weight falls per ``span`` later drafts
    span: int = 4  # drafts over which weights fall by 1 - ema: ema is the per-step rate at batch ``span``
    pseudo: float = 1.0  # sequences' worth of the geometric model in each per-position estimate
    overall: _Counts = field(init=False)
    per_bucket: dict[int, _Counts] = field(default_factory=dict)
    revision: int = 0  # bumped by every fold: a policy's table computed from these estimates is stale

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if self.pseudo < 0:
            raise ValueError(f"pseudo must be >= 0, got {self.pseudo}")
        if self.span < 1:
            raise ValueError(f"span must be >= 1, got {self.span}")
        self.overall = _Counts(self.prior_alpha, 1.0 - self.prior_alpha, 1.0, 0.0)

    @property
    def global_alpha(self) -> float:
        return self.overall.alpha()

    def _counts(self, bucket: int) -> _Counts:
        return self.per_bucket.get(bucket, self.overall)

    def alpha(self, bucket: int) -> float:
        return self._counts(bucket).alpha()

    def rho(self, bucket: int) -> float:
        return self._counts(bucket).rho()

    def lengths(self, bucket: int, gamma: int) -> tuple[float, float]:
        """(E[l], mean draft length) of asking for ``gamma`` in this bucket (``_Counts.lengths``)."""
        return self._counts(bucket).lengths(gamma, self.pseudo)

    def all_lengths(self, bucket: int, gamma_max: int) -> list[tuple[float, float]]:
        """``lengths`` of every gamma 0..gamma_max in this bucket, in one pass (``_Counts.all_lengths``)."""
        return self._counts(bucket).all_lengths(gamma_max, self.pseudo)

    def update(self, bucket: int, step: StepStats) -> None:
        """Fold in one step's counts (accepted, rejected, draft depth, short drafts and the
        per-sequence outcomes); a step that asked for no drafts changes nothing."""
        if step.num_drafts + step.num_short_drafts <= 0:
            return
        drafts = len(step.seq_outcomes) or max(step.num_drafts, step.num_short_drafts)  # the sequences asked
        self._fold(bucket, (float(step.num_accepted_tokens), float(step.num_rejected), float(step.num_draft_depth),
                            float(step.num_short_drafts)), step.seq_outcomes, drafts)

    def update_outcomes(self, bucket: int, outcomes: Sequence[tuple[int, int, int]]) -> None:
        """Fold in (gamma asked, draft depth, accepted) per sequence — one drafter's share of a step,
        or drafts scored on the side — counted as ``update`` counts a step. Example: [(4, 4, 4),
        (4, 2, 1), (4, 0, 0)] adds accepted 5, rejected 1, depth 6, short drafts 2."""
        if not outcomes:
            return
        self._fold(bucket, (float(sum(a for _, _, a in outcomes)), float(sum(a < d for _, d, a in outcomes)),
                            float(sum(d for _, d, _ in outcomes)), float(sum(d < g for g, d, _ in outcomes))),
                   outcomes, len(outcomes))

    def discount(self, weight: float) -> None:
        """Keep the estimates, each (per bucket and overall) backed by at most ``weight`` counts of
        accepted tokens plus rejections (the prior is one): after the drafter's weights changed, a few
        drafts of the new weights move them. Example: 40 accepted and 60 rejected, discount(2) -> 0.8
        and 1.2 (alpha still 0.4; one probe that accepts 4 of 4 then says 4.8 / 6 = 0.8)."""
        self.revision += 1
        for c in (*self.per_bucket.values(), self.overall):
            n = c.accepted + c.rejected
            if n > weight:
                c.scale(weight / n)

    def _fold(self, bucket: int, counts: tuple[float, float, float, float],
              outcomes: Sequence[tuple[int, int, int]], drafts: int) -> None:
        self.revision += 1
        if bucket not in self.per_bucket:  # a new bucket starts from what all steps say
            self.per_bucket[bucket] = self.overall.copy()
        keep = (1.0 - self.ema) ** (drafts / self.span)  # memory in drafts (class docstring)
        positions = position_counts(outcomes)  # once: both counts fold the same step
        for c in (self.per_bucket[bucket], self.overall):
            c.add(keep, *counts)
            c.add_positions(keep, positions)


def position_counts(outcomes: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Per draft position k = 1 .. the deepest gamma asked, of the (gamma asked, draft depth, accepted)
    ``outcomes``: (sequences asked for >= k tokens, of those whose draft reached depth k, of those that
    accepted >= k). Example: [(4, 4, 4), (4, 2, 1), (2, 0, 0)] -> [(3, 2, 2), (3, 2, 1), (2, 1, 1), (2, 1, 1)]."""
    deepest = max((g for g, _, _ in outcomes), default=0)
    return [(sum(g >= k for g, _, _ in outcomes), sum(d >= k for g, d, _ in outcomes if g >= k),
             sum(a >= k for g, _, a in outcomes if g >= k)) for k in range(1, deepest + 1)]


CHANGED_WEIGHT = 2.0  # counts left behind a drafter's estimates when its weights change (``api.drafter_changed``)


class DrafterTrackers:
    """One ``AlphaTracker`` per drafter a policy chooses among. With one drafter it learns from
    whole steps (``AlphaTracker.update``); with several, each from its own outcomes
    (``StepStats.drafter_outcomes``) and the outcomes scored on the side for the model-free ones
    (``StepStats.shadow_outcomes``). Drafter ``None`` stands for "the engine's only drafter"."""

    def __init__(self, drafters: Sequence[str | None], prior_alpha: float = 0.7, ema: float = 0.1) -> None:
        if not drafters or len(set(drafters)) != len(drafters):
            raise ValueError(f"need distinct drafter names, got {list(drafters)}")
        self.names = tuple(drafters)
        self.trackers = {d: AlphaTracker(prior_alpha=prior_alpha, ema=ema) for d in self.names}

    def __getitem__(self, drafter: str | None) -> AlphaTracker:
        return self.trackers[drafter]

    def update(self, bucket: int, step: StepStats) -> None:
        if len(self.names) == 1:
            self.trackers[self.names[0]].update(bucket, step)
            return
        for outcomes in (step.drafter_outcomes, step.shadow_outcomes):
            for name, outs in outcomes.items():
                tracker = self.trackers.get(name)
                if tracker is not None:
                    tracker.update_outcomes(bucket, outs)


def predicted_speedups(tracker: AlphaTracker, batch_size: int, profile: Profile, gamma_max: int,
                       drafter: str | None = None) -> list[float]:
    """Eq. 5 for every gamma 0..gamma_max at this batch size, with the acceptance and draft
    lengths the tracker measured for the batch size's bucket (``AlphaTracker.all_lengths``: every gamma in one pass)."""
    lengths = tracker.all_lengths(bucket_of(batch_size), gamma_max)
    return [1.0] + [speedup_of_lengths(accept_len, draft_len, g, batch_size, profile, drafter)
                    for g, (accept_len, draft_len) in enumerate(lengths) if g > 0]
