"""Nightjar's per-batch-size bandit over speculation lengths (Nightjar Algorithm 1, eq. 3).

Why this exists: the best speculation length depends on the batch size, the hardware and the
current acceptance rate, none of which a static gamma knows. Nightjar treats each batch size as
its own ADA-BINGREEDY bandit over the arms gamma in {0, ..., Gamma_max} (0 = speculation off),
rewarded by the goodput (tokens/s) the step achieved. Exploring keeps measuring arms that look
bad, so disabling speculation never deadlocks (a pure estimate-and-threshold controller that
turns speculation off stops seeing acceptance data).

Schedule (Algorithm 1, per batch size B; all counters start at j = H = b = tau = 1)::

    at the first round of a bin (tau == 1): the bin explores with probability 1/sqrt(b),
        else exploits                                               (line 8)
    explore: gamma ~ Uniform{0..Gamma_max};  exploit: gamma by eq. 3   (lines 11, 14)
    after playing: tau += 1; if tau > sqrt(H): next bin (b += 1, tau = 1);
        if b > sqrt(H): next block (j += 1, H = 2**(j-1), b = 1)     (lines 16-23)

Hand trace of the first 10 rounds of one batch size (bin length = number of taus with
tau <= sqrt(H); bins per block likewise)::

    round  1      block j=1 (H=1):  bin 1, 1 round       (explore prob 1/sqrt(1) = 1)
    round  2      block j=2 (H=2):  bin 1, 1 round       (explore prob 1)
    rounds 3-4    block j=3 (H=4):  bin 1, rounds 3, 4   (explore prob 1)
    rounds 5-6                      bin 2, rounds 5, 6   (explore prob 1/sqrt(2))
    rounds 7-8    block j=4 (H=8):  bin 1 (prob 1);  rounds 9-10: bin 2 (prob 1/sqrt(2))
    rounds 11-26  block j=5 (H=16): 4 bins of 4 rounds

Note that b restarts at 1 in every block (line 23), so each block's first bin explores
(probability 1); blocks grow as 2**(j-1), so that is a vanishing fraction of rounds.

Exploitation (eq. 3), with g~ the incremental mean goodput of arm gamma at this batch size::

    gamma* = argmin_gamma  1 / g~[gamma]  +  I(gamma_prev = 0 and gamma > 0) * c_prefill / gamma

An arm never observed has g~ = 0, i.e. an infinite objective; ties go to the shorter gamma.
c_prefill is the cost (seconds) of catching a stateful drafter up after speculation was off:
``switching_cost(lag_tokens, batch_size)``, where lag_tokens is Nightjar's L_max (the engine may
pass it; by default the number of consecutive gamma = 0 steps, i.e. tokens each running
sequence emitted without the drafter). gamma_prev is the arm actually played on the previous
engine step (any batch size: the drafter's state is global); before the first step there is no
previous arm and no switching cost.

Worked example of the switching term: after a gamma = 0 step with means g~ = [1000, 1100, 1200]
tokens/s and c_prefill = 0.002 s, the objectives are 1/1000 = 1.0e-3 for gamma = 0,
1/1100 + 0.002/1 = 2.91e-3 for gamma = 1 and 1/1200 + 0.002/2 = 1.83e-3 for gamma = 2: the bandit
stays at 0, although gamma = 2 wins by 20% once the drafter is warm.

Extensions used by the hybrid policy (both off by default, which is the paper's algorithm): a
``prior`` giving each arm a predicted goodput that counts as ``prior_count`` pseudo-observations,
and an ``explore_scale`` in (0, 1] multiplying the exploration probability of a bin.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SwitchingCost = Callable[[int, int], float]  # (lag_tokens, batch_size) -> seconds
Prior = Callable[[int], Sequence[float]]  # bucket -> predicted goodput per arm, tokens/s
ExploreScale = Callable[[int, Sequence[float]], float]  # (bucket, arm means) -> factor in (0, 1]


class Position(NamedTuple):
    """Where a batch size's next round falls in Algorithm 1's hierarchy."""

    block: int  # j_B
    block_size: int  # H_B
    bin: int  # b_B
    round: int  # tau_B


@dataclass
class _BucketState:
    """Algorithm 1's per-batch-size state plus the arm statistics."""

    num_arms: int
    j: int = 1
    H: int = 1
    b: int = 1
    tau: int = 1
    explore_bin: bool = False
    means: list[float] = field(default_factory=list)  # [num_arms] incremental mean goodput (data only)
    counts: list[int] = field(default_factory=list)  # [num_arms] observations per arm
    time_s: list[float] = field(default_factory=list)  # [num_arms] total step time per arm
    explore_steps: int = 0
    exploit_steps: int = 0
    last_choice: int = 0
    replay: int | None = None  # a forgotten arm to play (``NightjarBandit.forget``) ...
    replay_wait: int = 0  # ... after this many more selects

    def __post_init__(self) -> None:
        self.means = [0.0] * self.num_arms
        self.counts = [0] * self.num_arms
        self.time_s = [0.0] * self.num_arms

    def advance(self) -> None:
        """Algorithm 1 lines 16-23 (tau > sqrt(H) is tested exactly as tau**2 > H)."""
        self.tau += 1
        if self.tau * self.tau > self.H:
            self.b += 1
            self.tau = 1
            if self.b * self.b > self.H:
                self.j += 1
                self.H = 2 ** (self.j - 1)
                self.b = 1


class NightjarBandit:
    """Per-batch-size ADA-BINGREEDY bandit over gamma in {0..gamma_max} (Nightjar Algorithm 1).

    Call ``select(batch_size)`` once per engine step before drafting and ``update(...)`` once
    after it with the arm actually played and the goodput it achieved. Deterministic given the
    seed (or an injected ``rng``).

    Arms. By default arm k is gamma = k. ``arm_gammas`` generalises that to any arm set, e.g.
    (drafter, gamma) pairs of several drafters flattened to indices: arm k speculates
    ``arm_gammas[k]`` tokens (0 = off), and pays the switching cost after an off step only when
    ``switch_arms[k]`` (a stateful drafter that must catch up; default: every arm with gamma > 0).
    Example: drafters (suffix, eagle3), gamma_max 2 -> arm_gammas (0, 1, 2, 1, 2), switch_arms
    (False, False, False, True, True).
    """

    def __init__(
        self,
        gamma_max: int,
        switching_cost: SwitchingCost | None = None,
        seed: int = 0,
        *,
        bucket: Callable[[int], int] | None = None,
        prior: Prior | None = None,
        prior_count: float = 0.0,
        explore_scale: ExploreScale | None = None,
        rng: random.Random | None = None,
        arm_gammas: Sequence[int] | None = None,
        switch_arms: Sequence[bool] | None = None,
    ) -> None:
        if gamma_max < 1:
            raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
        self.arm_gammas = tuple(arm_gammas) if arm_gammas is not None else tuple(range(gamma_max + 1))
        self.switch_arms = (tuple(switch_arms) if switch_arms is not None
                            else tuple(g > 0 for g in self.arm_gammas))
        if len(self.switch_arms) != len(self.arm_gammas) or not self.arm_gammas or \
                any(not 0 <= g <= gamma_max for g in self.arm_gammas):
            raise ValueError("arm_gammas must be in [0, gamma_max], with one switch_arms entry per arm")
        self.num_arms = len(self.arm_gammas)
        if prior_count < 0 or (prior_count > 0 and prior is None):
            raise ValueError(f"prior_count must be >= 0 and needs a prior, got {prior_count}")
        self.gamma_max = gamma_max
        self.switching_cost = switching_cost
        self.bucket = bucket or (lambda b: b)
        self.prior = prior
        self.prior_count = prior_count
        self.explore_scale = explore_scale
        self.rng = rng if rng is not None else random.Random(seed)
        self._states: dict[int, _BucketState] = {}
        self._last_arm: int | None = None  # arm played on the previous engine step
        self._zero_run = 0  # consecutive engine steps played with gamma = 0
        self.last_explored = False

    # ---- state ---------------------------------------------------------------------------
    def _state(self, batch_size: int) -> tuple[int, _BucketState]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        key = self.bucket(batch_size)
        if key not in self._states:
            self._states[key] = _BucketState(num_arms=self.num_arms)
        return key, self._states[key]

    def position(self, batch_size: int) -> Position:
        """Block, block size, bin and round the next ``select(batch_size)`` falls in."""
        _, st = self._state(batch_size)
        return Position(st.j, st.H, st.b, st.tau)

    def arm_means(self, batch_size: int) -> list[float]:
        """Mean goodput per arm as eq. 3 sees it: data blended with the prior's pseudo-counts."""
        key, st = self._state(batch_size)
        if self.prior is None or self.prior_count == 0:
            return list(st.means)
        prior = list(self.prior(key))
        if len(prior) != st.num_arms:
            raise ValueError(f"prior must give {st.num_arms} arm values, got {len(prior)}")
        n0 = self.prior_count
        return [(n0 * p + n * m) / (n0 + n) for p, m, n in zip(prior, st.means, st.counts)]

    def arm_counts(self, batch_size: int) -> list[int]:
        return list(self._state(batch_size)[1].counts)

    # ---- decisions -----------------------------------------------------------------------
    def objective(self, batch_size: int, lag_tokens: int | None = None) -> list[float]:
        """Eq. 3's value of every arm at this step (lower is better)."""
        means = self.arm_means(batch_size)
        switching = (self._last_arm is not None and self.arm_gammas[self._last_arm] == 0
                     and self.switching_cost is not None)
        cost = 0.0
        if switching and self.switching_cost is not None:
            lag = lag_tokens if lag_tokens is not None else self._zero_run
            cost = self.switching_cost(lag, batch_size)
        out = []
        for arm, g in enumerate(means):
            value = 1.0 / g if g > 0 else math.inf
            if switching and self.switch_arms[arm]:
                value += cost / self.arm_gammas[arm]
            out.append(value)
        return out

    def select(self, batch_size: int, lag_tokens: int | None = None) -> int:
        """Choose the arm (gamma, by default) for this engine step at ``batch_size`` (Algorithm 1
        lines 5-23)."""
        key, st = self._state(batch_size)
        if st.replay is not None and st.replay_wait == 0:  # a forgotten arm, replayed (``forget``)
            gamma, st.replay = st.replay, None
            st.explore_steps += 1
            st.last_choice = gamma
            self.last_explored = True
            return gamma
        st.replay_wait = max(0, st.replay_wait - 1)
        if st.tau == 1:
            p = 1.0 / math.sqrt(st.b)
            if self.explore_scale is not None:
                p *= min(1.0, max(0.0, self.explore_scale(key, self.arm_means(batch_size))))
            st.explore_bin = self.rng.random() < p
        if st.explore_bin:
            gamma = self.rng.randrange(self.num_arms)
            st.explore_steps += 1
        else:
            obj = self.objective(batch_size, lag_tokens)
            gamma = min(range(len(obj)), key=obj.__getitem__)
            st.exploit_steps += 1
        self.last_explored = st.explore_bin
        st.last_choice = gamma
        st.advance()
        return gamma

    def update(self, batch_size: int, gamma: int, goodput: float, step_time: float, credit: bool = True) -> None:
        """Record the reward of the arm actually played (incremental mean, Nightjar eq. 3 text).

        ``credit=False``: the arm was played (the switching-cost state follows it) but its reward
        says nothing about the arm — e.g. a step that also prefilled a prompt chunk, whose cost no
        arm controls — so the arm's mean and count stay as they were.
        """
        if not 0 <= gamma < self.num_arms:
            raise ValueError(f"arm must be in [0, {self.num_arms - 1}], got {gamma}")
        if not math.isfinite(goodput) or goodput < 0:
            raise ValueError(f"goodput must be finite and >= 0, got {goodput}")
        if not math.isfinite(step_time) or step_time < 0:
            raise ValueError(f"step_time must be finite and >= 0, got {step_time}")
        if credit:
            _, st = self._state(batch_size)
            st.counts[gamma] += 1
            st.means[gamma] += (goodput - st.means[gamma]) / st.counts[gamma]
            st.time_s[gamma] += step_time
        self._last_arm = gamma
        self._zero_run = self._zero_run + 1 if self.arm_gammas[gamma] == 0 else 0

    def forget(self, arms: Sequence[int]) -> None:
        """Drop what every batch size measured of ``arms`` (their means, counts and time): they play other
        weights now (a drafter swapped). Eq. 3 then sees the prior alone for them, and each batch size seen
        so far replays the deepest of them (largest gamma: its outcomes measure every draft position) at its
        second ``select`` from now, an exploration step outside the schedule, which goes on where it was. So
        the new weights are measured within two steps rather than at the next exploring bin, which in a late
        block can be hundreds of steps away; the step between lets a stateful drafter be warmed for the
        replay (``replay_due``: the engine computes the target's taps).

        Example: counts [30, 50, 4] and means [100, 90, 120] at b = 1, prior [100, 95, 130], prior_count
        4; forget([1, 2]) -> counts [30, 0, 0], means [100, 0, 0], the blended means the prior's 95 and 130
        for arms 1 and 2; the next select(1) is eq. 3's as usual, the one after plays arm 2 (gamma 2)
        whatever its mean.
        """
        for arm in arms:
            if not 0 <= arm < self.num_arms:
                raise ValueError(f"arm must be in [0, {self.num_arms - 1}], got {arm}")
        if not arms:
            return  # nothing forgotten: a replay already due stays due
        deepest = max(arms, key=lambda arm: (self.arm_gammas[arm], -arm))
        for st in self._states.values():
            for arm in arms:
                st.means[arm], st.counts[arm], st.time_s[arm] = 0.0, 0, 0.0
            st.replay, st.replay_wait = deepest, 1

    def replay_due(self, batch_size: int, arms: Sequence[int]) -> bool:
        """Whether batch size ``batch_size``'s next ``select`` replays one of ``arms`` (``forget``)."""
        key = self.bucket(batch_size)
        st = self._states.get(key)
        return st is not None and st.replay in arms and st.replay_wait == 0

    # ---- reporting -----------------------------------------------------------------------
    @property
    def explore_steps(self) -> int:
        return sum(st.explore_steps for st in self._states.values())

    @property
    def exploit_steps(self) -> int:
        return sum(st.exploit_steps for st in self._states.values())

    def buckets(self) -> list[int]:
        return sorted(self._states)

    def bucket_summary(self, key: int) -> dict[str, float]:
        """Counters of one bucket (keys as returned by ``buckets()``)."""
        st = self._states[key]
        return {
            "gamma": float(self.arm_gammas[st.last_choice]),
            "arm": float(st.last_choice),
            "explore_steps": float(st.explore_steps),
            "exploit_steps": float(st.exploit_steps),
            "block": float(st.j),
        }
