"""Bandit-driven speculation policies: Nightjar's ``BanditPolicy`` and our ``HybridPolicy`` (the
bandit with TIDE's analytic model as prior and exploration governor).

Why this exists: both pick gamma with the per-batch-size bandit of ``bandit`` (which keeps the
algorithm), rewarded by goodput (tokens/s); this module puts it behind the
``SpeculationPolicy`` protocol and, for the hybrid, feeds it the analytic prior.

Feedback convention: ``StepStats.gamma`` is the arm that ran, i.e. the largest per-sequence
gamma of the step (0 when nothing was drafted); bandits credit the step's goodput
``num_emitted_tokens / total_time`` to that arm at batch size ``num_decode_seqs`` — on
decode-only steps. A step that also prefills a prompt chunk is not credited: its time is mostly
the chunk's, which no arm controls, and under load such steps are frequent, so crediting them
buries differences of a few per cent between arms in noise (measured in
docs/benchmarks/policies.md: the hybrid kept speculating at batch 16). Acceptance (alpha) is still learned from them.

Several drafters (``drafters``): the arms are (drafter, gamma) pairs, flattened by ``DrafterArms``
(arm 0 = off, then each drafter's gammas 1..gamma_max); the arm a step played is the gamma that
ran with the drafter most of its speculating sequences used (``StepStats.seq_drafters``); only the
arms of stateful drafters pay the switching cost. The hybrid's prior evaluates eq. 5 per drafter
with that drafter's own estimates (``tracking.DrafterTrackers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidespec.speculative.policy.api import PlanInput, bucket_of, check_gamma_max
from tidespec.speculative.policy.bandit import NightjarBandit, SwitchingCost
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.tracking import CHANGED_WEIGHT, DrafterTrackers, predicted_speedups
from tidespec.stats import StepStats


@dataclass(frozen=True)
class DrafterArms:
    """(drafter, gamma) arms as bandit indices: arm 0 is off, then ``gamma_max`` arms per drafter.

    Example: drafters ("suffix", "eagle3"), gamma_max 2, stateful {"eagle3"}: arms (suffix, 0),
    (suffix, 1), (suffix, 2), (eagle3, 1), (eagle3, 2); gammas (0, 1, 2, 1, 2); only the last two
    pay the switching cost. One drafter ``(None,)``: arm k is gamma k, as in Nightjar.
    """

    drafters: tuple[str | None, ...]
    gamma_max: int
    stateful: frozenset[str] = frozenset()

    @property
    def pairs(self) -> list[tuple[str | None, int]]:
        return [(self.drafters[0], 0)] + [(d, g) for d in self.drafters for g in range(1, self.gamma_max + 1)]

    @property
    def gammas(self) -> list[int]:
        return [g for _, g in self.pairs]

    @property
    def switching(self) -> list[bool] | None:
        """Arms that pay the switching cost (None: every speculating arm, one drafter)."""
        if len(self.drafters) == 1:
            return None
        return [g > 0 and d in self.stateful for d, g in self.pairs]

    def arm_of(self, step: StepStats) -> int:
        """The arm a step played: its gamma (capped) with its most used drafter; 0 when off."""
        gamma = min(step.gamma, self.gamma_max)
        if gamma == 0:
            return 0
        names = list(step.seq_drafters.values())
        drafter = max(set(names), key=names.count) if names and len(self.drafters) > 1 else self.drafters[0]
        if drafter not in self.drafters:
            drafter = self.drafters[0]
        return 1 + self.drafters.index(drafter) * self.gamma_max + gamma - 1

    def arms_of(self, drafter: str) -> list[int]:
        """The speculating arms that draft with ``drafter`` (all of them for the engine's only drafter,
        ``drafters == (None,)``); none for a drafter not among them. Example: drafters ("suffix", "eagle3"),
        gamma_max 2 -> arms_of("eagle3") == [3, 4]."""
        return [arm for arm, (d, g) in enumerate(self.pairs)
                if g > 0 and (d == drafter or self.drafters == (None,))]

    def plan(self, inp: PlanInput, arm: int) -> dict[int, tuple[str, int]]:
        """Every sequence gets ``arm``'s (drafter, gamma); off uses the engine's first drafter."""
        drafter, gamma = self.pairs[arm]
        name = drafter if drafter is not None and gamma > 0 else (inp.drafters[0] if inp.drafters else "")
        return {s.seq_id: (name, gamma) for s in inp.seqs}


def _bandit_stats(bandit: NightjarBandit) -> dict[str, float]:
    out = {"explore_steps": float(bandit.explore_steps), "exploit_steps": float(bandit.exploit_steps)}
    for key in bandit.buckets():
        for name, value in bandit.bucket_summary(key).items():
            out[f"{name}_b{key}"] = value
    return out


def _replay_due(bandit: NightjarBandit, arms: DrafterArms, batch_size: int, drafter: str) -> bool:
    """Whether ``bandit``'s next select at ``batch_size`` (the last plan's) replays one of ``drafter``'s arms."""
    return batch_size >= 1 and bandit.replay_due(batch_size, arms.arms_of(drafter))


def _goodput(step: StepStats) -> float:
    return step.num_emitted_tokens / step.total_time if step.total_time > 0 else 0.0


class BanditPolicy:
    """Nightjar: one bandit per batch size (``bucketed=True``: per power-of-two bucket), over gamma
    or, with several ``drafters``, over (drafter, gamma) arms (``DrafterArms``)."""

    def __init__(
        self,
        gamma_max: int,
        seed: int = 0,
        switching_cost: SwitchingCost | None = None,
        bucketed: bool = False,
        profile: Profile | None = None,
        drafters: tuple[str, ...] = (),
        stateful: frozenset[str] = frozenset(),
    ) -> None:
        check_gamma_max(gamma_max)
        self.name = "bandit"
        self.gamma_max = gamma_max
        self.profile = profile  # not used to decide; kept so metrics can check speedup against it
        self.arms = DrafterArms(drafters or (None,), gamma_max, stateful)
        self.last_batch = 0  # the batch size of the last plan (``probe_due``)
        self.bandit = NightjarBandit(
            gamma_max, switching_cost, seed, bucket=bucket_of if bucketed else None,
            arm_gammas=self.arms.gammas, switch_arms=self.arms.switching,
        )

    def plan(self, inp: PlanInput) -> dict[int, int]:
        return {sid: gamma for sid, (_, gamma) in self.plan_drafters(inp).items()}

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        if not inp.seqs:
            return {}
        self.last_batch = inp.batch_size
        return self.arms.plan(inp, self.bandit.select(inp.batch_size))

    def observe(self, step: StepStats) -> None:
        batch = step.num_decode_seqs
        if batch >= 1 and step.total_time > 0:
            self.bandit.update(batch, self.arms.arm_of(step), _goodput(step), step.total_time,
                               credit=not step.num_prefill_tokens)

    def drafter_changed(self, drafter: str) -> None:
        """``drafter`` drafts with other weights from now on (``api.drafter_changed``): its arms' goodputs were
        measured of the old ones and are dropped (``NightjarBandit.forget``): unmeasured again, the deepest
        replayed two plans on."""
        self.bandit.forget(self.arms.arms_of(drafter))

    def probe_due(self, drafter: str) -> bool:
        """Whether the next plan replays an arm of ``drafter`` (``api.probe_due``: the engine warms it)."""
        return _replay_due(self.bandit, self.arms, self.last_batch, drafter)

    def stats(self) -> dict[str, float]:
        return _bandit_stats(self.bandit)


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

    def __init__(self, profile: Profile, gamma_max: int, seed: int = 0, prior_count: float = 4.0,
                 prior_alpha: float = 0.7, ema: float = 0.1, regret_wide: float = 0.15, explore_floor: float = 0.25,
                 use_switching_cost: bool = True, bucketed: bool = False, drafter: str | None = None,
                 drafters: tuple[str, ...] = (), stateful: frozenset[str] = frozenset()) -> None:
        check_gamma_max(gamma_max)
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
        self.arms = DrafterArms(drafters or (drafter,), gamma_max, stateful)
        self.trackers = DrafterTrackers(self.arms.drafters, prior_alpha, ema)
        self.alphas = self.trackers[self.arms.drafters[0]]  # the (first) drafter's estimates
        self.ema = ema
        self.kappa = 1.0
        self._bucket: Callable[[int], int] = bucket_of if bucketed else (lambda b: b)
        self._scale_sum = 0.0
        self._scale_n = 0
        self.last_predicted_speedup = 1.0
        self.last_batch = 0  # the batch size of the last plan (``probe_due``)
        self.bandit = NightjarBandit(
            gamma_max,
            profile.catchup_cost if use_switching_cost else None,
            seed,
            bucket=self._bucket,
            prior=self.predicted_goodputs,
            prior_count=prior_count,
            explore_scale=self.explore_scale,
            arm_gammas=self.arms.gammas,
            switch_arms=self.arms.switching,
        )

    def predicted_goodputs(self, key: int) -> list[float]:
        """g_pred for every arm of bucket ``key`` (tokens/s), calibrated by kappa; eq. 5 of each arm's
        drafter with that drafter's estimates."""
        base = self.kappa * self.profile.baseline_tokens_per_s(key)
        speedups = {d: predicted_speedups(self.trackers[d], key, self.profile, self.gamma_max, d)
                    for d in self.arms.drafters}
        return [base * speedups[d][g] for d, g in self.arms.pairs]

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
        return {sid: gamma for sid, (_, gamma) in self.plan_drafters(inp).items()}

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        if not inp.seqs:
            return {}
        key = self._bucket(inp.batch_size)
        self.last_batch = inp.batch_size
        arm = self.bandit.select(inp.batch_size)
        drafter, gamma = self.arms.pairs[arm]
        self.last_predicted_speedup = predicted_speedups(self.trackers[drafter], key, self.profile, self.gamma_max,
                                                          drafter)[gamma]
        return self.arms.plan(inp, arm)

    def observe(self, step: StepStats) -> None:
        batch = step.num_decode_seqs
        if batch < 1 or step.total_time <= 0:
            return
        arm = self.arms.arm_of(step)
        goodput = _goodput(step)
        key = self._bucket(batch)
        credit = not step.num_prefill_tokens  # see the module docstring
        predicted = self.predicted_goodputs(key)[arm] / self.kappa
        if credit and predicted > 0 and goodput > 0:
            self.kappa += self.ema * (goodput / predicted - self.kappa)
        self.bandit.update(batch, arm, goodput, step.total_time, credit=credit)
        self.trackers.update(bucket_of(key), step)

    def drafter_changed(self, drafter: str) -> None:
        """``drafter`` drafts with other weights from now on (``api.drafter_changed``). Its arms' measured
        goodputs are dropped (``NightjarBandit.forget``), so eq. 3 sees the prior alone for them, and its
        acceptance estimates keep their values with at most ``CHANGED_WEIGHT`` counts behind them
        (``AlphaTracker.discount``); its deepest arm is replayed two plans on (the engine warms the drafter
        for it: ``probe_due``), and that one step's outcomes move the prior of every arm of the drafter.
        Why: the old weights' means, backed by tens of steps, outvoted every exploration step of the new
        ones (an incremental mean moves 1/n per step), and in a late block an exploring bin can be hundreds
        of steps away. Example: an EAGLE-3 arm measured at 80 tokens/s over 40 steps; the new head replayed
        once at 150 -> its data mean is 150 (it was 81.7)."""
        arms = self.arms.arms_of(drafter)
        if not arms:
            return  # not one of this policy's drafters
        self.bandit.forget(arms)
        self.trackers[self.arms.drafters[0] if self.arms.drafters == (None,) else drafter].discount(CHANGED_WEIGHT)

    def probe_due(self, drafter: str) -> bool:
        """Whether the next plan replays an arm of ``drafter`` (``api.probe_due``: the engine warms it)."""
        return _replay_due(self.bandit, self.arms, self.last_batch, drafter)

    def stats(self) -> dict[str, float]:
        out = _bandit_stats(self.bandit)
        out["predicted_speedup"] = self.last_predicted_speedup
        out["calibration"] = self.kappa
        out["alpha"] = self.alphas.global_alpha
        out["rho"] = self.alphas.overall.rho()
        for key in sorted(self.alphas.per_bucket):
            out[f"alpha_b{key}"] = self.alphas.alpha(key)
            out[f"rho_b{key}"] = self.alphas.rho(key)
        out["explore_scale_mean"] = self._scale_sum / self._scale_n if self._scale_n else 1.0
        return out
