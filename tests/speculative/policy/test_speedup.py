"""TIDE's analytic speedup model (eqs. 2-5) checked by hand and against the paper's claims."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tidespec.speculative.policy.speedup import (
    Profile,
    alpha_from_accept_length,
    best_gamma,
    beta,
    c,
    expected_accept_length,
    expected_draft_length,
    min_accept_length_for_gain,
    min_alpha_for_gain,
    practical_speedup,
)

# TIDE Appendix A.3, Table 5: T(n) in ms on H100 (TP), and D0 in ms.
TABLE5_N = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TABLE5_MS = {
    "gpt-oss-120b": [3.416, 3.844, 4.341, 5.236, 6.123, 7.637, 9.345, 11.79, 15.50, 21.50],
    "Qwen3-235B-A22B": [9.057, 10.07, 11.86, 14.68, 17.84, 23.47, 26.68, 31.46],
    "Llama-4-Scout-17B-16E": [6.461, 7.953, 8.932, 11.01, 13.61, 16.82, 19.58, 23.82, 27.89, 40.86],
    "Llama-3.3-70B-Instruct": [15.50, 16.00, 16.11, 16.36, 17.10, 18.45, 19.00, 21.38, 27.54, 64.76],
}
TABLE5_D0_MS = {"gpt-oss-120b": 0.393, "Qwen3-235B-A22B": 0.137, "Llama-4-Scout-17B-16E": 0.330,
                "Llama-3.3-70B-Instruct": 0.843}


def table5(model: str) -> Profile:
    ms = TABLE5_MS[model]
    return Profile(
        target_latency={n: t / 1e3 for n, t in zip(TABLE5_N, ms)},
        draft_cost={"default": TABLE5_D0_MS[model] / 1e3},
        key=model,
    )


# ---- eq. 2 ----
def test_expected_accept_length_hand_values() -> None:
    assert expected_accept_length(0.7, 3) == pytest.approx((1 - 0.7**4) / 0.3, abs=1e-12)
    assert expected_accept_length(0.7, 3) == pytest.approx(2.533, abs=1e-9)
    assert expected_accept_length(0.0, 5) == 1.0
    assert expected_accept_length(1.0, 4) == 5.0
    assert expected_accept_length(0.5, 0) == 1.0
    assert expected_accept_length(1.0 - 1e-9, 3) == pytest.approx(4.0, abs=1e-6)  # continuous at 1


def test_alpha_from_accept_length_inverts_eq2() -> None:
    # gamma 4 with 2.3616 accepted drafts per step is alpha 0.8 (the naive ratio would say 0.59)
    assert alpha_from_accept_length(3.3616, 4) == pytest.approx(0.8, abs=1e-7)
    assert alpha_from_accept_length(1.0, 3) == 0.0
    assert alpha_from_accept_length(4.0, 3) == 1.0
    for a in (0.1, 0.45, 0.93):
        assert alpha_from_accept_length(expected_accept_length(a, 3), 3) == pytest.approx(a, abs=1e-8)


@pytest.mark.parametrize("alpha,gamma", [(-0.1, 3), (1.1, 3), (0.5, -1)])
def test_invalid_inputs_rejected(alpha: float, gamma: int) -> None:
    with pytest.raises(ValueError):
        expected_accept_length(alpha, gamma)


# ---- eq. 5 by hand ----
def test_practical_speedup_hand_computed_gpt_oss() -> None:
    p = table5("gpt-oss-120b")
    # b = 1, gamma = 3: beta = T(4)/T(1), c = D0/T(1)
    assert beta(p, 1, 3) == pytest.approx(4.341 / 3.416, abs=1e-9)
    assert c(p, 1) == pytest.approx(0.393 / 3.416, abs=1e-9)
    expected = ((1 - 0.7**4) / 0.3) / (3 * 0.393 / 3.416 + 4.341 / 3.416)
    assert practical_speedup(0.7, 3, 1, p) == pytest.approx(expected, abs=1e-9)
    assert practical_speedup(0.7, 3, 1, p) == pytest.approx(1.567523188, abs=1e-6)
    # b = 128, gamma = 3: beta = T(512)/T(128) = 21.50/11.79
    assert practical_speedup(0.7, 3, 128, p) == pytest.approx(1.316815997, abs=1e-6)
    assert practical_speedup(0.7, 0, 128, p) == 1.0


def test_practical_speedup_with_a_drafter_that_stops_early() -> None:
    """The module docstring's example: alpha 0.8, rho 0.75, gamma 4, b = 1, gpt-oss profile; the drafting is
    charged for the d tokens drafted, at least one call."""
    p = table5("gpt-oss-120b")
    assert expected_draft_length(0.5, 4) == pytest.approx(0.9375) and expected_draft_length(1.0, 4) == 4.0
    d = expected_draft_length(0.75, 4)
    assert d == pytest.approx(2.0508, abs=1e-4)
    verify = p.target(1 + d) / p.target(1)
    assert verify == pytest.approx(1.2017, abs=1e-3)
    expected = expected_accept_length(0.6, 4) / (d * 0.393 / 3.416 + verify)
    assert practical_speedup(0.8, 4, 1, p, rho=0.75) == pytest.approx(expected, abs=1e-9)
    assert practical_speedup(0.8, 4, 1, p, rho=0.75) == pytest.approx(1.6037, abs=1e-4)
    assert practical_speedup(0.8, 4, 1, p, rho=1.0) == pytest.approx(1.8712, abs=1e-4)
    assert practical_speedup(0.8, 4, 1, p, rho=1.0) == practical_speedup(0.8, 4, 1, p)  # eq. 5 as printed
    # a drafter that mostly proposes nothing still pays one call: d = 0.94 is charged as 1
    short = expected_accept_length(0.25, 4) / (0.393 / 3.416 + p.target(1 + 0.9375) / p.target(1))
    assert practical_speedup(0.5, 4, 1, p, rho=0.5) == pytest.approx(short, abs=1e-9)
    with pytest.raises(ValueError, match="rho"):
        practical_speedup(0.5, 4, 1, p, rho=1.5)


def test_practical_speedup_interpolated_and_extrapolated_points() -> None:
    p = table5("gpt-oss-120b")
    # T(3) halfway between T(2) and T(4); T(6) halfway between T(4) and T(8)
    assert p.target(3) == pytest.approx((3.844 + 4.341) / 2 / 1e3, abs=1e-12)
    assert beta(p, 3, 1) == pytest.approx(((4.341 + 5.236) / 2) / ((3.844 + 4.341) / 2), abs=1e-9)
    # beyond the table: extend the last segment, T(1024) = 21.50 + 6.00 / 256 * 512
    assert p.target(1024) == pytest.approx(33.5 / 1e3, abs=1e-12)
    assert practical_speedup(0.9, 3, 256, p) == pytest.approx(
        expected_accept_length(0.9, 3) / (3 * 0.393 / 15.50 + 33.5 / 15.50), abs=1e-9
    )


def test_profile_interpolates_monotone_envelope() -> None:
    p = Profile({1: 1.0, 2: 0.9, 4: 2.0}, {"default": 0.0})  # a noisy dip at n = 2
    assert p.target(2) == 1.0
    assert p.target(3) == pytest.approx(1.5)
    assert p.target(0.5) == 1.0


def test_best_gamma_hand_computed() -> None:
    p = table5("gpt-oss-120b")
    gamma, s = best_gamma(0.7, 1, p, 8)
    assert gamma == 3 and s == pytest.approx(1.567523188, abs=1e-6)
    # gamma = 4 is worse by hand: T(5) = 4.341 + 0.895 / 4
    s4 = ((1 - 0.7**5) / 0.3) / (4 * 0.393 / 3.416 + (4.341 + 0.895 / 4) / 3.416)
    assert practical_speedup(0.7, 4, 1, p) == pytest.approx(s4, abs=1e-9)
    assert s4 < s
    # Llama-3.3-70B at b = 128 with alpha = 0.3: no gamma beats plain decoding (gamma 1: 1.3 / 1.328)
    assert best_gamma(0.3, 128, table5("Llama-3.3-70B-Instruct"), 8) == (0, 1.0)
    assert best_gamma(0.5, 128, table5("Llama-3.3-70B-Instruct"), 8)[0] == 1


def test_min_alpha_is_break_even() -> None:
    p = table5("Llama-3.3-70B-Instruct")
    a = min_alpha_for_gain(128, 3, p)
    assert practical_speedup(a, 3, 128, p) == pytest.approx(1.0, abs=1e-6)
    assert practical_speedup(a - 1e-3, 3, 128, p) < 1.0
    # gamma = 3 at alpha = 1: 4 / (3 c + beta) with beta = 64.76/21.38, c = 0.843/21.38
    assert practical_speedup(1.0, 3, 128, p) == pytest.approx(4 / (3 * 0.843 / 21.38 + 64.76 / 21.38), abs=1e-9)
    # a batch where even perfect acceptance cannot pay: verification 10x a plain step
    flat = Profile({1: 1.0, 8: 1.0, 16: 10.0}, {"default": 0.0})
    assert min_alpha_for_gain(8, 1, flat) == math.inf
    assert min_accept_length_for_gain(8, 1, flat) == math.inf


# ---- the paper's claims ----
@pytest.mark.parametrize("model", sorted(TABLE5_MS))
def test_beta_grows_and_c_falls_with_batch(model: str) -> None:
    """Section 4.1 / Figure 4: T(b(gamma+1))/T(b) grows with b; c(b) = D0/T(b) shrinks."""
    p = table5(model)
    n_max = TABLE5_N[len(TABLE5_MS[model]) - 1]
    bs = [b for b in TABLE5_N if 4 * b <= n_max]
    betas = [beta(p, b, 3) for b in bs]
    cs = [c(p, b) for b in bs]
    assert all(x >= 1.0 for x in betas)
    assert betas[-1] > betas[0]
    if n_max >= 512:  # tables reaching b = 128 show the compute-bound regime: "grows significantly"
        assert betas[-1] > betas[0] + 0.3
    assert all(c1 <= c0 for c0, c1 in zip(cs, cs[1:]))


def test_gpt_oss_beta_sequence_monotone() -> None:
    p = table5("gpt-oss-120b")
    betas = [beta(p, b, 3) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(b1 > b0 for b0, b1 in zip(betas, betas[1:]))
    assert betas[-1] == pytest.approx(21.50 / 11.79, abs=1e-9)


def test_table4_acceptance_lengths_predict_gain_at_every_batch() -> None:
    """Table 4 (A.2): EAGLE-3 at steps 2 and 3 (acceptance lengths ~2.35 and ~2.76) speeds up
    decoding at every batch size 1..64; eq. 5 on the gpt-oss-120b profile must agree, i.e. the
    minimum acceptance length for gain stays below the measured one."""
    p = table5("gpt-oss-120b")
    for gamma, accept_length in ((2, 2.35), (3, 2.76)):
        alpha = alpha_from_accept_length(accept_length, gamma)
        for b in (1, 4, 8, 16, 32, 64):
            assert practical_speedup(alpha, gamma, b, p) > 1.0
            assert min_accept_length_for_gain(b, gamma, p) < accept_length


def test_minimum_acceptance_rises_when_compute_bound() -> None:
    """Section 4.1/5.4: at large batch verification stops being free, so the acceptance needed
    for any gain rises: Llama-3.3-70B (gamma 3) needs alpha < 0.25 up to b = 32 but > 0.8 at 128."""
    p = table5("Llama-3.3-70B-Instruct")
    small = [min_alpha_for_gain(b, 3, p) for b in (1, 2, 4, 8, 16, 32)]
    assert max(small) < 0.25
    assert min_alpha_for_gain(128, 3, p) > 0.8
    g = table5("gpt-oss-120b")
    assert min_alpha_for_gain(128, 3, g) > min_alpha_for_gain(1, 3, g) + 0.1


# ---- profile tables and JSON ----
NIGHTJAR_TABLE1_MS = {(128, 32): 17.87, (128, 64): 28.53, (256, 32): 20.65, (256, 64): 22.33,
                      (512, 32): 24.30, (512, 64): 102.03}


def nightjar_profile() -> Profile:
    return Profile(
        target_latency={1: 0.01, 64: 0.02},
        draft_cost={"default": 0.001, "ngram": 0.0},
        catchup={k: v / 1e3 for k, v in NIGHTJAR_TABLE1_MS.items()},
        key="7b/rtx4090/fp16",
    )


def test_catchup_cost_lookup() -> None:
    p = nightjar_profile()
    assert p.catchup_cost(128, 32) == pytest.approx(17.87e-3)
    assert p.catchup_cost(192, 32) == pytest.approx((17.87 + 20.65) / 2e3)
    assert p.catchup_cost(128, 48) == pytest.approx((17.87 + 28.53) / 2e3)
    assert p.catchup_cost(192, 48) == pytest.approx(((17.87 + 20.65) / 2 + (28.53 + 22.33) / 2) / 2e3)
    assert p.catchup_cost(1024, 32) == pytest.approx((24.30 + 3.65 * 2) / 1e3)  # last segment extended
    assert p.catchup_cost(128, 8) == pytest.approx(17.87e-3)  # clamped to the smallest batch row
    assert p.catchup_cost(0, 32) == 0.0
    assert table5("gpt-oss-120b").catchup_cost(100, 4) == 0.0


def test_draft_cost_per_drafter() -> None:
    p = nightjar_profile()
    assert p.d0("ngram") == 0.0
    assert p.d0(None) == 0.001
    assert p.d0("eagle3") == 0.001
    assert c(p, 1, "ngram") == 0.0


def test_draft_cost_per_batch_size() -> None:
    """A drafter profiled per batch size (EAGLE-3 runs its head over every drafting sequence) is priced
    at the batch's own D0: linear between measured sizes, clamped below, the last segment extended
    above; a drafter without a batch row keeps its one D0; eq. 5 falls where drafting costs more."""
    flat = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "eagle3": 0.0016})
    rows = {("eagle3", 1): 0.0016, ("eagle3", 4): 0.0034, ("eagle3", 16): 0.0106}
    p = Profile(target_latency={1: 0.010, 64: 0.010}, draft_cost={"default": 0.0, "eagle3": 0.0016},
                draft_batch_cost=rows)
    assert p.d0("eagle3", 1) == pytest.approx(0.0016)
    assert p.d0("eagle3", 2) == pytest.approx(0.0022)
    assert p.d0("eagle3", 8) == pytest.approx(0.0034 + 4 * 0.0006)
    assert p.d0("eagle3", 32) == pytest.approx(0.0106 + 16 * 0.0006)
    assert p.d0("eagle3") == pytest.approx(0.0016)  # b = 1 unless told
    assert p.d0("suffix", 4) == 0.0 and p.d0(None, 16) == 0.0  # the default's flat D0
    assert c(p, 4, "eagle3") == pytest.approx(0.34)
    assert practical_speedup(0.7, 3, 1, p, "eagle3") == pytest.approx(practical_speedup(0.7, 3, 1, flat, "eagle3"))
    assert practical_speedup(0.7, 3, 4, p, "eagle3") < practical_speedup(0.7, 3, 4, flat, "eagle3")
    assert Profile.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="draft_batch_cost"):
        Profile(target_latency={1: 0.01}, draft_cost={"default": 0.0}, draft_batch_cost={("eagle3", 0): 0.001})


def test_json_round_trip(tmp_path: Path) -> None:
    p = nightjar_profile()
    q = Profile.from_json(p.to_json())
    assert q == p
    assert q.catchup_cost(192, 48) == p.catchup_cost(192, 48)
    path = tmp_path / "profile.json"
    p.save(path)
    assert Profile.load(path) == p


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_latency": {}, "draft_cost": {"default": 0.0}},
        {"target_latency": {0: 1.0}, "draft_cost": {"default": 0.0}},
        {"target_latency": {1: -1.0}, "draft_cost": {"default": 0.0}},
        {"target_latency": {1: 1.0}, "draft_cost": {"ngram": 0.0}},
        {"target_latency": {1: 1.0}, "draft_cost": {"default": 0.0}, "catchup": {(5, 0): 1.0}},
    ],
)
def test_profile_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Profile(**kwargs)
