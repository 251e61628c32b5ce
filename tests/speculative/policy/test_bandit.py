"""Nightjar Algorithm 1, hand-traced: block/bin schedule, exploration draws, eq. 3."""

from __future__ import annotations

import math
import random

import pytest

from tidespec.speculative.policy.bandit import NightjarBandit, Position


class ScriptedRandom(random.Random):
    """random() and randrange() return scripted values and log every call."""

    def __init__(self, uniforms: list[float], arms: list[int] | None = None) -> None:
        super().__init__(0)
        self.uniforms = list(uniforms)
        self.arms = list(arms or [])
        self.calls: list[str] = []

    def random(self) -> float:
        self.calls.append("random")
        return self.uniforms.pop(0)

    def randrange(self, *args: int, **kwargs: int) -> int:  # type: ignore[override]
        self.calls.append("randrange")
        return self.arms.pop(0)


# (block j, block size H, bin b, round tau) of rounds 1..26 of one batch size, traced by hand
# from Algorithm 1 lines 16-23: bins last while tau <= sqrt(H), blocks while b <= sqrt(H).
EXPECTED_SCHEDULE = (
    [(1, 1, 1, 1)]
    + [(2, 2, 1, 1)]
    + [(3, 4, 1, 1), (3, 4, 1, 2), (3, 4, 2, 1), (3, 4, 2, 2)]
    + [(4, 8, 1, 1), (4, 8, 1, 2), (4, 8, 2, 1), (4, 8, 2, 2)]
    + [(5, 16, b, t) for b in (1, 2, 3, 4) for t in (1, 2, 3, 4)]
    + [(6, 32, 1, 1)]
)


def test_block_bin_schedule_hand_traced() -> None:
    bandit = NightjarBandit(gamma_max=3, seed=0)
    seen = []
    for _ in EXPECTED_SCHEDULE:
        seen.append(tuple(bandit.position(batch_size=4)))
        bandit.select(4)
    assert seen == EXPECTED_SCHEDULE
    assert bandit.position(4) == Position(block=6, block_size=32, bin=1, round=2)


def test_block_sizes_grow_as_powers_of_two() -> None:
    bandit = NightjarBandit(gamma_max=2, seed=1)
    rounds_per_block: dict[int, int] = {}
    for _ in range(1 + 1 + 4 + 4 + 16 + 25 + 64):
        j = bandit.position(1).block
        rounds_per_block[j] = rounds_per_block.get(j, 0) + 1
        bandit.select(1)
    # H = 2**(j-1); a block has floor(sqrt(H))**2 rounds
    assert rounds_per_block == {1: 1, 2: 1, 3: 4, 4: 4, 5: 16, 6: 25, 7: 64}


def test_exploration_drawn_once_per_bin_with_prob_one_over_sqrt_bin() -> None:
    # rounds 1-4 sit in bins with b = 1 (probability 1: any draw explores);
    # round 5 starts block 3's bin 2 (probability 1/sqrt(2) = 0.7071)
    rng = ScriptedRandom(uniforms=[0.99, 0.99, 0.99, 0.70, 0.71], arms=[3, 1, 2, 0, 2])
    bandit = NightjarBandit(gamma_max=3, rng=rng)
    picks = [bandit.select(2) for _ in range(4)]
    assert picks == [3, 1, 2, 0]  # rounds 1-4 all explore (uniform arm draws)
    assert rng.calls == ["random", "randrange", "random", "randrange", "random", "randrange", "randrange"]
    assert bandit.explore_steps == 4
    # round 5: 0.70 < 0.7071 -> the whole bin (rounds 5 and 6) explores
    assert bandit.select(2) == 2 and bandit.last_explored
    assert rng.calls[-2:] == ["random", "randrange"]
    # round 6 is the same bin: no new bin draw, one arm draw
    rng.arms.append(1)
    assert bandit.select(2) == 1
    assert rng.calls[-1] == "randrange" and rng.calls[-2] == "randrange"
    # a fresh bandit whose round-5 draw is 0.71 >= 0.7071 exploits
    rng2 = ScriptedRandom(uniforms=[0.99, 0.99, 0.99, 0.71])
    b2 = NightjarBandit(gamma_max=3, rng=rng2)
    rng2.arms = [0, 0, 0, 0]
    for _ in range(4):
        b2.select(2)
    b2.update(2, 0, 100.0, 0.01)
    assert b2.select(2) == 0 and not b2.last_explored  # 0.71 >= 0.7071: exploitation bin
    assert b2.exploit_steps == 1 and b2.explore_steps == 4


def test_batch_sizes_keep_independent_schedules() -> None:
    bandit = NightjarBandit(gamma_max=2, seed=3)
    for _ in range(6):
        bandit.select(8)
    assert bandit.position(8) == Position(4, 8, 1, 1)
    assert bandit.position(1) == Position(1, 1, 1, 1)


def test_incremental_mean_goodput() -> None:
    bandit = NightjarBandit(gamma_max=2, seed=0)
    for g in (10.0, 20.0, 60.0):
        bandit.update(4, 1, g, 0.01)
    assert bandit.arm_means(4) == [0.0, 30.0, 0.0]
    assert bandit.arm_counts(4) == [0, 3, 0]


def test_eq3_objective_by_hand_and_switching_cost_flips_decision() -> None:
    costs: list[tuple[int, int]] = []

    def switching_cost(lag: int, batch: int) -> float:
        costs.append((lag, batch))
        return 0.002

    rng = ScriptedRandom(uniforms=[0.0] * 3 + [0.99], arms=[0, 0, 0, 0])
    bandit = NightjarBandit(gamma_max=2, switching_cost=switching_cost, rng=rng)
    for _ in range(4):  # rounds 1-4 explore; their rewards are fed below instead
        bandit.select(4)
    bandit.update(4, 1, 1100.0, 0.01)
    bandit.update(4, 2, 1200.0, 0.01)
    bandit.update(4, 0, 1000.0, 0.01)  # previous engine step ran gamma = 0
    obj = bandit.objective(4)
    assert obj[0] == pytest.approx(1 / 1000)
    assert obj[1] == pytest.approx(1 / 1100 + 0.002 / 1)
    assert obj[2] == pytest.approx(1 / 1200 + 0.002 / 2)
    assert costs[-1] == (1, 4)  # lag = one gamma-0 step, batch 4
    # round 5: 0.99 >= 1/sqrt(2) -> exploit; the switching cost keeps speculation off
    assert bandit.select(4) == 0 and not bandit.last_explored
    # once the drafter is warm (previous step gamma = 2) there is no cost: gamma 2 wins
    bandit.update(4, 2, 1200.0, 0.01)
    assert bandit.objective(4) == pytest.approx([1 / 1000, 1 / 1100, 1 / 1200])
    assert bandit.select(4) == 2  # round 6: same exploitation bin


def test_switching_cost_lag_counts_zero_steps_or_uses_engine_value() -> None:
    seen: list[tuple[int, int]] = []
    bandit = NightjarBandit(gamma_max=2, switching_cost=lambda lag, b: seen.append((lag, b)) or 0.0)
    bandit.objective(3)
    assert seen == []  # no previous step: no switching cost
    bandit.update(3, 0, 10.0, 0.1)
    bandit.update(5, 0, 10.0, 0.1)
    bandit.objective(3)
    assert seen[-1] == (2, 3)
    bandit.objective(3, lag_tokens=57)
    assert seen[-1] == (57, 3)
    bandit.update(3, 1, 10.0, 0.1)
    n = len(seen)
    bandit.objective(3)
    assert len(seen) == n  # previous arm > 0: indicator off, cost not queried


def test_unvisited_arms_never_exploited_and_ties_go_short() -> None:
    bandit = NightjarBandit(gamma_max=3, seed=0)
    assert bandit.objective(2) == [math.inf] * 4
    bandit.update(2, 2, 50.0, 0.1)
    bandit.update(2, 3, 50.0, 0.1)
    obj = bandit.objective(2)
    assert min(range(4), key=obj.__getitem__) == 2


def test_prior_counts_as_pseudo_observations() -> None:
    bandit = NightjarBandit(gamma_max=1, seed=0, prior=lambda key: [100.0, 200.0], prior_count=2.0)
    assert bandit.arm_means(7) == [100.0, 200.0]
    bandit.update(7, 0, 400.0, 0.1)
    assert bandit.arm_means(7) == pytest.approx([(2 * 100 + 400) / 3, 200.0])


def test_explore_scale_zero_never_explores() -> None:
    bandit = NightjarBandit(gamma_max=3, seed=0, explore_scale=lambda key, means: 0.0)
    bandit.update(1, 2, 10.0, 0.1)
    assert [bandit.select(1) for _ in range(30)] == [2] * 30
    assert bandit.explore_steps == 0


def test_forgotten_arms_lose_their_data_and_the_deepest_is_replayed() -> None:
    """``forget``'s docstring example: arms 1 and 2 lose their data, their blended means are the prior's,
    the next select is eq. 3's (``replay_due`` says the one after replays arm 2) and the one after plays
    arm 2 outside the schedule (which stays where it was); a batch size never seen has nothing to forget."""
    bandit = NightjarBandit(gamma_max=2, seed=0, prior=lambda key: [100.0, 95.0, 130.0], prior_count=4.0,
                            explore_scale=lambda key, means: 0.0)
    for arm, (n, mean) in enumerate([(30, 100.0), (50, 90.0), (4, 60.0)]):
        for _ in range(n):
            bandit.update(1, arm, mean, 0.01)
    assert bandit.arm_means(1)[2] == pytest.approx(95.0) and bandit.select(1) == 0
    bandit.forget([1, 2])
    assert bandit.arm_counts(1) == [30, 0, 0] and bandit.arm_means(1) == pytest.approx([100.0, 95.0, 130.0])
    assert not bandit.replay_due(1, [1, 2])
    assert bandit.select(1) == 2 and not bandit.last_explored  # eq. 3: the prior's 130 now wins
    assert bandit.replay_due(1, [1, 2]) and not bandit.replay_due(1, [0])
    position = bandit.position(1)
    assert bandit.select(1) == 2 and bandit.last_explored and bandit.position(1) == position
    assert not bandit.replay_due(1, [1, 2])
    for _ in range(3):  # the new weights measure worse: (4 x 130 + 3 x 40) / 7 = 91.4, below arm 0's 100
        bandit.update(1, 2, 40.0, 0.01)
    assert bandit.select(1) == 0 and not bandit.last_explored
    assert not bandit.replay_due(5, [1, 2]) and bandit.select(5) == 2  # a new batch size: eq. 3 alone
    bandit.forget([1, 2])
    bandit.select(1)
    bandit.forget([])  # nothing to forget (a drafter not among the arms): the replay due stays due
    assert bandit.replay_due(1, [1, 2]) and bandit.select(1) == 2
    with pytest.raises(ValueError):
        bandit.forget([3])


def test_seeded_runs_are_deterministic() -> None:
    def run(seed: int) -> list[int]:
        bandit = NightjarBandit(gamma_max=4, seed=seed)
        out = []
        for t in range(200):
            b = 1 + t % 3
            g = bandit.select(b)
            bandit.update(b, g, 100.0 + 10 * g - 3 * g * b, 0.01)
            out.append(g)
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        NightjarBandit(gamma_max=0)
    bandit = NightjarBandit(gamma_max=2)
    with pytest.raises(ValueError):
        bandit.update(1, 3, 1.0, 0.1)
    with pytest.raises(ValueError):
        bandit.update(1, 1, -1.0, 0.1)
    with pytest.raises(ValueError):
        bandit.select(0)
