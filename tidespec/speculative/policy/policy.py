"""Speculation policies: how many draft tokens each sequence gets this engine step.

Why this exists: the engine asks one question per step (``plan``) and reports what happened
(``observe``); which controller answers is a configuration choice. Four controllers share the
``SpeculationPolicy`` protocol:

- ``StaticPolicy``: a fixed gamma (the classic engine).
- ``AnalyticPolicy``: TIDE eq. 5 on a profiled T(n)/D0 with alpha estimated online per
  batch-size bucket; picks the gamma with the best predicted speedup, 0 if none beats 1.0.
- ``BanditPolicy``: Nightjar's per-batch-size bandit rewarded by goodput (tokens/s).
- ``HybridPolicy`` (ours): the bandit with the analytic model as its prior (see its docstring).

``Guards`` wraps any of them with the operational rules of the field guide (paper 004): KV
pressure and high temperature switch speculation off, a per-request override wins over the
policy, and no sequence drafts past its remaining output budget. ``make_policy`` builds one by
name.

Feedback convention: ``StepFeedback.gamma`` is the arm that ran, i.e. the largest per-sequence
gamma of the step (0 when nothing was drafted); bandits credit the step's goodput
``num_emitted_tokens / step_time`` to that arm — on decode-only steps. A step that also prefills
a prompt chunk is not credited: its time is mostly the chunk's, which no arm controls, and under
load such steps are frequent, so crediting them buries differences of a few per cent between arms
in noise (measured in docs/benchmarks.md section 5c: the hybrid kept speculating at batch 16).
Acceptance (alpha) is still learned from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from tidespec.speculative.policy.bandit import NightjarBandit, SwitchingCost
from tidespec.speculative.policy.speedup import (
    Profile,
    speedup_of_lengths,
)


# ---- contracts ---------------------------------------------------------------------------
@dataclass
class SeqState:
    """What a policy may know about one running sequence."""

    seq_id: int
    temperature: float
    remaining_tokens: int  # output tokens this sequence may still emit (max_tokens - emitted)
    override: int | None = None  # per-request gamma from the API: 0 = opt out, None = policy decides


@dataclass
class PlanInput:
    batch_size: int  # running decode sequences this step
    kv_usage: float  # fraction of KV slots/blocks in use, [0, 1]
    seqs: list[SeqState]


@dataclass
class StepFeedback:
    batch_size: int
    gamma: int  # the arm that ran: largest per-sequence gamma this step (0 = no drafting)
    num_seqs_speculated: int  # sequences that drafted at least one token
    num_draft_tokens: int  # drafted tokens, summed over sequences
    num_accepted_tokens: int  # accepted drafted tokens (bonus/recovered not included)
    num_emitted_tokens: int  # tokens appended to outputs: accepted + one bonus/recovered per seq
    step_time: float  # seconds, whole step
    draft_time: float  # seconds spent drafting
    verify_time: float  # seconds spent in the target forward
    num_prefill_tokens: int = 0  # prompt tokens prefilled in the same step (chunked prefill)
    # For the acceptance estimators (AlphaTracker); -1 = not reported (hand-built feedback), then
    # approximated in __post_init__ from the totals above.
    num_rejected: int = -1  # speculating sequences whose draft was cut by a rejected token
    num_draft_depth: int = -1  # sum over speculating sequences of the draft's depth (= its length for chains)
    num_short_drafts: int = 0  # sequences given gamma > 0 whose draft was shallower than gamma (incl. empty)
    # (gamma asked, draft depth, accepted) of every sequence asked for gamma > 0; empty = not reported
    seq_outcomes: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_draft_depth < 0:
            self.num_draft_depth = self.num_draft_tokens
        if self.num_rejected < 0:  # every speculating sequence that did not accept all its draft
            self.num_rejected = 0 if self.num_accepted_tokens >= self.num_draft_depth else self.num_seqs_speculated


@runtime_checkable
class SpeculationPolicy(Protocol):
    name: str

    def plan(self, inp: PlanInput) -> dict[int, int]:
        """seq_id -> gamma (0 = plain decode) for every sequence in ``inp.seqs``."""
        ...

    def observe(self, fb: StepFeedback) -> None: ...

    def stats(self) -> dict[str, float]: ...


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket (rounding up): 1 -> 1, 2 -> 2, 3 -> 4, 5 -> 8, 33 -> 64."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def _check_gamma_max(gamma_max: int) -> None:
    if not 1 <= gamma_max <= 64:
        raise ValueError(f"gamma_max must be in [1, 64], got {gamma_max}")


# ---- static ------------------------------------------------------------------------------
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

    def observe(self, fb: StepFeedback) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"gamma": float(self.gamma), "steps": float(self._steps)}


# ---- acceptance tracking -----------------------------------------------------------------
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

    def add_positions(self, keep: float, outcomes: Sequence[tuple[int, int, int]]) -> None:
        """Fold in (gamma asked, draft depth, accepted) of each sequence; positions nobody was
        asked for this step keep their counts."""
        deepest = max((g for g, _, _ in outcomes), default=0)
        while len(self.positions) < deepest:
            self.positions.append([0.0, 0.0, 0.0])
        for k in range(1, deepest + 1):
            row = self.positions[k - 1]
            row[0] = keep * row[0] + sum(g >= k for g, _, _ in outcomes)
            row[1] = keep * row[1] + sum(d >= k for g, d, _ in outcomes if g >= k)
            row[2] = keep * row[2] + sum(a >= k for g, _, a in outcomes if g >= k)

    def lengths(self, gamma: int, pseudo: float) -> tuple[float, float]:
        """(E[l], mean draft length) when asking for ``gamma``: per position k, the measured
        share of sequences whose draft reached k and that accepted >= k, each shrunk towards the
        geometric model ((alpha rho)**k and rho**k) by ``pseudo`` sequences — the model alone
        where position k was never asked for."""
        alpha, rho = self.alpha(), self.rho()
        accept_len, draft_len = 1.0, 0.0
        acc_prev = draft_prev = 1.0
        for k in range(1, gamma + 1):
            geo_acc, geo_draft = (alpha * rho) ** k, rho ** k
            if k <= len(self.positions) and self.positions[k - 1][0] + pseudo > 0:
                asked, reached, acc = self.positions[k - 1]
                geo_acc = (acc + pseudo * geo_acc) / (asked + pseudo)
                geo_draft = (reached + pseudo * geo_draft) / (asked + pseudo)
            draft_prev = min(draft_prev, geo_draft)  # reaching k implies reaching k - 1
            acc_prev = min(acc_prev, geo_acc, draft_prev)  # accepting k implies accepting k - 1 and reaching k
            accept_len += acc_prev
            draft_len += draft_prev
        return accept_len, draft_len

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
    profile, so the analytic policy switched itself off at batch 1 (docs/benchmarks.md section
    5b's open question; section 5a re-measures with this estimator).

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
    """

    prior_alpha: float = 0.7
    ema: float = 0.1  # 1 - the factor by which a step's weight falls per later step
    pseudo: float = 1.0  # sequences' worth of the geometric model in each per-position estimate
    overall: _Counts = field(init=False)
    per_bucket: dict[int, _Counts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if self.pseudo < 0:
            raise ValueError(f"pseudo must be >= 0, got {self.pseudo}")
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

    def update(self, bucket: int, fb: StepFeedback) -> None:
        """Fold in one step's counts; a step that asked for no drafts changes nothing."""
        asked = fb.num_seqs_speculated + fb.num_short_drafts
        if asked <= 0:
            return
        if bucket not in self.per_bucket:  # a new bucket starts from what all steps say
            self.per_bucket[bucket] = self.overall.copy()
        counts = (float(fb.num_accepted_tokens), float(fb.num_rejected), float(fb.num_draft_depth),
                  float(fb.num_short_drafts))
        keep = 1.0 - self.ema
        for c in (self.per_bucket[bucket], self.overall):
            c.add(keep, *counts)
            if fb.seq_outcomes:
                c.add_positions(keep, fb.seq_outcomes)


def predicted_speedups(tracker: AlphaTracker, batch_size: int, profile: Profile, gamma_max: int,
                       drafter: str | None = None) -> list[float]:
    """Eq. 5 for every gamma 0..gamma_max at this batch size, with the acceptance and draft
    lengths the tracker measured for the batch size's bucket (``AlphaTracker.lengths``)."""
    key = bucket_of(batch_size)
    out = [1.0]
    for g in range(1, gamma_max + 1):
        accept_len, draft_len = tracker.lengths(key, g)
        out.append(speedup_of_lengths(accept_len, draft_len, g, batch_size, profile, drafter))
    return out


def _argmax(speedups: list[float], start: int) -> int:
    """Index >= ``start`` of the highest speedup, ties to the smaller index (shorter gamma)."""
    return max(range(start, len(speedups)), key=lambda g: (speedups[g], -g))


# ---- analytic (TIDE) ---------------------------------------------------------------------
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

    def __init__(
        self,
        profile: Profile,
        gamma_max: int,
        ema: float = 0.1,
        prior_alpha: float = 0.7,
        drafter: str | None = None,
        probe_every: int = 64,
        probe_budget: float = 0.02,
    ) -> None:
        _check_gamma_max(gamma_max)
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

    def observe(self, fb: StepFeedback) -> None:
        if fb.batch_size >= 1:
            self.alphas.update(bucket_of(fb.batch_size), fb)

    def stats(self) -> dict[str, float]:
        out = {"predicted_speedup": self._last_speedup, "alpha": self.alphas.global_alpha,
               "rho": self.alphas.overall.rho(), "probe_steps": float(self.num_probes)}
        for key in sorted(self._chosen):
            out[f"gamma_b{key}"] = float(self._chosen[key])
            out[f"speedup_b{key}"] = self._speedup[key]
            out[f"alpha_b{key}"] = self.alphas.alpha(key)
            out[f"rho_b{key}"] = self.alphas.rho(key)
        return out


# ---- bandit (Nightjar) -------------------------------------------------------------------
def _bandit_stats(bandit: NightjarBandit) -> dict[str, float]:
    out = {"explore_steps": float(bandit.explore_steps), "exploit_steps": float(bandit.exploit_steps)}
    for key in bandit.buckets():
        for name, value in bandit.bucket_summary(key).items():
            out[f"{name}_b{key}"] = value
    return out


def _goodput(fb: StepFeedback) -> float:
    return fb.num_emitted_tokens / fb.step_time if fb.step_time > 0 else 0.0


class BanditPolicy:
    """Nightjar: one bandit per batch size (``bucketed=True``: per power-of-two bucket)."""

    def __init__(
        self,
        gamma_max: int,
        seed: int = 0,
        switching_cost: SwitchingCost | None = None,
        bucketed: bool = False,
        profile: Profile | None = None,
    ) -> None:
        _check_gamma_max(gamma_max)
        self.name = "bandit"
        self.gamma_max = gamma_max
        self.profile = profile  # not used to decide; kept so metrics can check speedup against it
        self.bandit = NightjarBandit(
            gamma_max, switching_cost, seed, bucket=bucket_of if bucketed else None
        )

    def plan(self, inp: PlanInput) -> dict[int, int]:
        if not inp.seqs:
            return {}
        gamma = self.bandit.select(inp.batch_size)
        return {s.seq_id: gamma for s in inp.seqs}

    def observe(self, fb: StepFeedback) -> None:
        if fb.batch_size >= 1 and fb.step_time > 0:
            self.bandit.update(fb.batch_size, min(fb.gamma, self.gamma_max), _goodput(fb), fb.step_time,
                               credit=not fb.num_prefill_tokens)

    def stats(self) -> dict[str, float]:
        return _bandit_stats(self.bandit)


# ---- hybrid (ours) -----------------------------------------------------------------------
class HybridPolicy:
    """Nightjar's bandit with TIDE's analytic model as prior and exploration governor.

    Prior. Every arm gamma of bucket B carries the predicted goodput

        g_pred(B, gamma) = kappa * speedup(B, gamma) * B / T(B)

    with speedup(B, gamma) eq. 5 at bucket B's measured acceptance (``predicted_speedups``;
    with the geometric model alone it is ``practical_speedup(alpha_B, gamma, B)``)

    worth ``prior_count`` pseudo-observations: eq. 3 sees (n0 g_pred + n g_data) / (n0 + n),
    so data overrides the prior after a few steps. The prior is evaluated live, not frozen at
    bucket creation: alpha_B is the AnalyticPolicy-style EMA of alpha (per power-of-two bucket,
    global fallback) and kappa an EMA of observed / predicted goodput over all steps (engine
    overheads the profile does not see), so a bucket reached late starts from what was learned
    elsewhere. Example: b = 1 on a 10 ms profile with D0 = 0.5 ms, alpha 0.6, kappa 1:
    g_pred(1, 2) = 100 tokens/s * 1.96 / 1.1 = 178.2 tokens/s.

    Exploration. Nightjar explores blindly at probability 1/sqrt(b) per bin. Where the model
    (blended with data) says an exploration step is expensive, the hybrid explores less; the
    expected relative loss of one uniform exploration step is

        regret = 1 - mean(m) / max(m)          (m: the bucket's blended arm means)
        scale  = max(floor, 1 - (1 - floor) * min(1, regret / regret_wide))

    and the bin explores with probability scale / sqrt(b). The floor keeps exploring, so a
    wrong prior is still corrected (no deadlock), and since m blends in data, exploration
    returns towards Nightjar's rate when measurements flatten the arms.

    Worked example (gpt-oss-120b profile of TIDE Table 5, gamma_max 4, floor 0.25,
    regret_wide 0.15, kappa 1):
    B = 64, alpha = 0.3: m = [6849, 6829, 6165, 5437, 4911] tokens/s, mean 6038, regret 0.118,
    scale = 1 - 0.75 * 0.118 / 0.15 = 0.408: a block's first bin explores with probability
    0.41 instead of 1.
    B = 1, alpha = 0.8: m = [293, 425, 500, 535, 548], regret 0.160 >= 0.15, scale = 0.25.
    B = 32, alpha = 0.5: m = [4190, 4929, 4932, 4626, 4339], regret 0.067, scale = 0.67.
    """

    def __init__(
        self,
        profile: Profile,
        gamma_max: int,
        seed: int = 0,
        prior_count: float = 4.0,
        prior_alpha: float = 0.7,
        ema: float = 0.1,
        regret_wide: float = 0.15,
        explore_floor: float = 0.25,
        use_switching_cost: bool = True,
        bucketed: bool = False,
        drafter: str | None = None,
    ) -> None:
        _check_gamma_max(gamma_max)
        if prior_count <= 0:
            raise ValueError(f"prior_count must be > 0, got {prior_count}")
        if regret_wide <= 0:
            raise ValueError(f"regret_wide must be > 0, got {regret_wide}")
        if not 0.0 < explore_floor <= 1.0:
            raise ValueError(f"explore_floor must be in (0, 1], got {explore_floor}")
        self.name = "hybrid"
        self.gamma_max = gamma_max
        self.profile = profile
        self.drafter = drafter
        self.regret_wide = regret_wide
        self.explore_floor = explore_floor
        self.alphas = AlphaTracker(prior_alpha=prior_alpha, ema=ema)
        self.ema = ema
        self.kappa = 1.0
        self._bucket: Callable[[int], int] = bucket_of if bucketed else (lambda b: b)
        self._scale_sum = 0.0
        self._scale_n = 0
        self._last_predicted_speedup = 1.0
        self.bandit = NightjarBandit(
            gamma_max,
            profile.catchup_cost if use_switching_cost else None,
            seed,
            bucket=self._bucket,
            prior=self.predicted_goodputs,
            prior_count=prior_count,
            explore_scale=self.explore_scale,
        )

    def predicted_goodputs(self, key: int) -> list[float]:
        """g_pred for every arm of bucket ``key`` (tokens/s), calibrated by kappa."""
        base = self.kappa * self.profile.baseline_tokens_per_s(key)
        return [base * s for s in predicted_speedups(self.alphas, key, self.profile, self.gamma_max, self.drafter)]

    def explore_scale(self, key: int, means: Sequence[float]) -> float:
        """The factor on 1/sqrt(b) described in the class docstring."""
        best = max(means)
        scale = 1.0
        if best > 0:
            regret = 1.0 - sum(means) / len(means) / best
            scale = max(self.explore_floor, 1.0 - (1.0 - self.explore_floor) * min(1.0, regret / self.regret_wide))
        self._scale_sum += scale
        self._scale_n += 1
        return scale

    def plan(self, inp: PlanInput) -> dict[int, int]:
        if not inp.seqs:
            return {}
        key = self._bucket(inp.batch_size)
        gamma = self.bandit.select(inp.batch_size)
        self._last_predicted_speedup = predicted_speedups(self.alphas, key, self.profile, self.gamma_max,
                                                          self.drafter)[gamma]
        return {s.seq_id: gamma for s in inp.seqs}

    def observe(self, fb: StepFeedback) -> None:
        if fb.batch_size < 1 or fb.step_time <= 0:
            return
        gamma = min(fb.gamma, self.gamma_max)
        goodput = _goodput(fb)
        key = self._bucket(fb.batch_size)
        credit = not fb.num_prefill_tokens  # see the module docstring
        predicted = self.predicted_goodputs(key)[gamma] / self.kappa
        if credit and predicted > 0 and goodput > 0:
            self.kappa += self.ema * (goodput / predicted - self.kappa)
        self.bandit.update(fb.batch_size, gamma, goodput, fb.step_time, credit=credit)
        self.alphas.update(bucket_of(key), fb)

    def stats(self) -> dict[str, float]:
        out = _bandit_stats(self.bandit)
        out["predicted_speedup"] = self._last_predicted_speedup
        out["calibration"] = self.kappa
        out["alpha"] = self.alphas.global_alpha
        out["rho"] = self.alphas.overall.rho()
        for key in sorted(self.alphas.per_bucket):
            out[f"alpha_b{key}"] = self.alphas.alpha(key)
            out[f"rho_b{key}"] = self.alphas.rho(key)
        out["explore_scale_mean"] = self._scale_sum / self._scale_n if self._scale_n else 1.0
        return out


# ---- guards ------------------------------------------------------------------------------
@dataclass
class GuardConfig:
    """Operational limits (defaults from the field guide, paper 004)."""

    kv_threshold: float = 0.85  # KV usage above this -> no speculation (reservations x (gamma+1))
    temperature_threshold: float = 0.8  # sampling temperature above this -> no speculation
    gamma_max: int = 8  # cap for per-request overrides

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if self.temperature_threshold < 0:
            raise ValueError(f"temperature_threshold must be >= 0, got {self.temperature_threshold}")
        _check_gamma_max(self.gamma_max)


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
    see every step; bandits credit the arm that actually ran (``StepFeedback.gamma``).
    """

    def __init__(self, inner: SpeculationPolicy, config: GuardConfig | None = None) -> None:
        self.inner = inner
        self.config = config or GuardConfig()
        self.name = inner.name
        self._counts = {"kv": 0, "temperature": 0, "override": 0, "opt_out": 0, "remaining": 0}

    def plan(self, inp: PlanInput) -> dict[int, int]:
        cfg = self.config
        raw = self.inner.plan(inp)
        kv_pressure = inp.kv_usage > cfg.kv_threshold
        if kv_pressure:
            self._counts["kv"] += 1
        out: dict[int, int] = {}
        for s in inp.seqs:
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
                gamma = raw.get(s.seq_id, 0)
            if kv_pressure:
                gamma = 0
            cap = max(0, s.remaining_tokens - 1)
            if gamma > cap:
                gamma = cap
                self._counts["remaining"] += 1
            out[s.seq_id] = gamma
        return out

    def observe(self, fb: StepFeedback) -> None:
        self.inner.observe(fb)

    def stats(self) -> dict[str, float]:
        out = dict(self.inner.stats())
        for name, n in self._counts.items():
            out[f"guard_{name}"] = float(n)
        return out


# ---- factory -----------------------------------------------------------------------------
@dataclass
class PolicyOptions:
    """Everything ``make_policy`` may need; fields a policy does not use are ignored."""

    gamma_max: int = 4
    static_gamma: int | None = None  # static: defaults to gamma_max
    profile: Profile | None = None  # analytic / hybrid (bandit: switching cost)
    seed: int = 0
    ema: float = 0.1
    prior_alpha: float = 0.7
    bucketed: bool = False  # bandit / hybrid: power-of-two buckets instead of exact batch sizes
    guards: GuardConfig | None = None  # None: no guards

    def __post_init__(self) -> None:
        _check_gamma_max(self.gamma_max)
        if self.static_gamma is not None and not 0 <= self.static_gamma <= 64:
            raise ValueError(f"static_gamma must be in [0, 64], got {self.static_gamma}")


def _need_profile(opts: PolicyOptions, name: str) -> Profile:
    if opts.profile is None:
        raise ValueError(f"policy {name!r} needs a profile")
    return opts.profile


def _static(o: PolicyOptions) -> SpeculationPolicy:
    return StaticPolicy(o.gamma_max if o.static_gamma is None else o.static_gamma, profile=o.profile)


def _analytic(o: PolicyOptions) -> SpeculationPolicy:
    return AnalyticPolicy(_need_profile(o, "analytic"), o.gamma_max, ema=o.ema, prior_alpha=o.prior_alpha)


def _bandit(o: PolicyOptions) -> SpeculationPolicy:
    cost = o.profile.catchup_cost if o.profile is not None else None
    return BanditPolicy(o.gamma_max, seed=o.seed, switching_cost=cost, bucketed=o.bucketed, profile=o.profile)


def _hybrid(o: PolicyOptions) -> SpeculationPolicy:
    return HybridPolicy(
        _need_profile(o, "hybrid"), o.gamma_max, seed=o.seed, prior_alpha=o.prior_alpha, ema=o.ema, bucketed=o.bucketed
    )


POLICIES: Mapping[str, Callable[[PolicyOptions], SpeculationPolicy]] = MappingProxyType(
    {"static": _static, "analytic": _analytic, "bandit": _bandit, "hybrid": _hybrid}
)


def make_policy(name: str, options: PolicyOptions | None = None) -> SpeculationPolicy:
    """Build policy ``name`` (static, analytic, bandit, hybrid), wrapped in Guards if configured."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    opts = options or PolicyOptions()
    policy = POLICIES[name](opts)
    return Guards(policy, opts.guards) if opts.guards is not None else policy


def policy_profile(policy: SpeculationPolicy) -> Profile | None:
    """The profile a policy (or the policy inside ``Guards``) holds — analytic and hybrid plan with it,
    static and bandit keep it for the metrics; None when it was built without one."""
    inner = policy.inner if isinstance(policy, Guards) else policy
    profile = getattr(inner, "profile", None)
    return profile if isinstance(profile, Profile) else None


__all__ = [
    "AlphaTracker",
    "AnalyticPolicy",
    "BanditPolicy",
    "GuardConfig",
    "Guards",
    "HybridPolicy",
    "PlanInput",
    "PolicyOptions",
    "POLICIES",
    "SeqState",
    "SpeculationPolicy",
    "StaticPolicy",
    "StepFeedback",
    "bucket_of",
    "make_policy",
    "policy_profile",
]
