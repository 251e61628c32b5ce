"""SelectiveCollector (TIDE Algorithm 1): hand-traced EMAs, shift detection, round decisions, modes."""

from __future__ import annotations

import pytest

from tidespec.config import CollectionConfig
from tidespec.errors import ConfigError
from tidespec.online.collection import Decision, SelectiveCollector


def small() -> SelectiveCollector:
    return SelectiveCollector(CollectionConfig(lambda_short=0.5, lambda_long=0.75, epsilon=0.1, n_init=2,
                                               n_threshold=100))


def test_init_phase_uses_mean_of_first_n_init() -> None:
    c = small()
    c.observe_request(0.6)
    assert c.state()["alpha_short"] is None and not c.state()["initialized"]
    c.observe_request(0.8)
    st = c.state()
    assert st["alpha_short"] == pytest.approx(0.7) and st["alpha_long"] == pytest.approx(0.7)
    assert st["initialized"] and not c.collection_enabled


def test_hand_traced_ema_and_shift_at_request_6() -> None:
    # lambda_s = 0.5, lambda_l = 0.75, eps = 0.1; init mean of (0.6, 0.8) = 0.7
    # req 3 alpha .7: short = .5*.7 + .5*.7 = .7     long = .75*.7 + .25*.7 = .7
    # req 4 alpha .5: short = .35 + .25 = .6          long = .525 + .125 = .65      .6  < .55?     no
    # req 5 alpha .5: short = .3 + .25 = .55          long = .4875 + .125 = .6125   .55 < .5125?   no
    # req 6 alpha .3: short = .275 + .15 = .425       long = .459375 + .075 = .534375  .425 < .434375 yes
    c = small()
    trace = [(0.6, None, None), (0.8, 0.7, 0.7), (0.7, 0.7, 0.7), (0.5, 0.6, 0.65),
             (0.5, 0.55, 0.6125), (0.3, 0.425, 0.534375)]
    for i, (alpha, short, long) in enumerate(trace, start=1):
        c.observe_request(alpha)
        st = c.state()
        if short is not None:
            assert st["alpha_short"] == pytest.approx(short) and st["alpha_long"] == pytest.approx(long), i
        assert c.collection_enabled == (i == 6), i
    assert c.state()["last_shift_request"] == 6 and c.state()["shifts_detected"] == 1


def test_default_config_detects_a_drop_at_the_expected_request() -> None:
    # defaults: lambda_s .9, lambda_l .99, eps .02, N_init 20; 20 requests at .8 -> both .8
    # req 21 alpha .65: short = .72 + .065 = .785   long = .792 + .0065 = .7985       .785 < .7785? no
    # req 22 alpha .65: short = .7065 + .065 = .7715 long = .790515 + .0065 = .797015  .7715 < .777015 yes
    c = SelectiveCollector()
    for _ in range(20):
        c.observe_request(0.8)
    c.observe_request(0.65)
    assert c.state()["alpha_short"] == pytest.approx(0.785) and c.state()["alpha_long"] == pytest.approx(0.7985)
    assert not c.collection_enabled
    c.observe_request(0.65)
    assert c.state()["alpha_short"] == pytest.approx(0.7715) and c.state()["alpha_long"] == pytest.approx(0.797015)
    assert c.collection_enabled and c.state()["last_shift_request"] == 22


def test_rising_acceptance_never_enables_and_recovery_never_disables() -> None:
    c = small()
    for alpha in (0.2, 0.2, 0.5, 0.9, 1.0, 1.0):
        c.observe_request(alpha)
    assert not c.collection_enabled
    for alpha in (0.1, 0.1):
        c.observe_request(alpha)
    assert c.collection_enabled
    for alpha in (1.0,) * 10:  # only a non-improving training round switches collection off
        c.observe_request(alpha)
    assert c.collection_enabled


def test_rounds_deploy_keep_disable_then_next_shift_reenables() -> None:
    c = small()
    for alpha in (0.7, 0.7, 0.7, 0.2):
        c.observe_request(alpha)
    assert c.collection_enabled
    assert not c.should_train(99) and c.should_train(100)
    assert c.report_training(alpha_train=0.5, alpha_eval=0.6) is Decision.DEPLOY
    assert c.collection_enabled  # deploying keeps collecting (acceptance may still be climbing)
    assert c.report_training(alpha_train=0.6, alpha_eval=0.6) is Decision.KEEP
    assert c.collection_enabled
    assert c.report_training(alpha_train=0.6, alpha_eval=0.55) is Decision.DISABLE
    assert not c.collection_enabled
    st = c.state()
    assert (st["rounds"], st["deployments"], st["last_decision"]) == (3, 1, "disable_collection")
    # after req 4 short = .45, long = .575; req 5 alpha 0: short = .225 < long .43125 - .1 -> a new shift
    c.observe_request(0.0)
    assert c.collection_enabled and c.state()["shifts_detected"] == 2


def test_force_mode_collects_always() -> None:
    c = SelectiveCollector(CollectionConfig(force=True))
    assert c.collection_enabled
    assert c.report_training(alpha_train=0.7, alpha_eval=0.5) is Decision.DISABLE
    assert c.collection_enabled and c.state()["forced"]


def test_bootstrap_collects_until_first_non_improving_round() -> None:
    c = SelectiveCollector(CollectionConfig(bootstrap=True, lambda_short=0.5, lambda_long=0.75, epsilon=0.1,
                                            n_init=2))
    assert c.collection_enabled
    for alpha in (0.0, 0.0, 0.0):  # no drafter yet: nothing to accept
        c.observe_request(alpha)
    assert c.collection_enabled and c.state()["shifts_detected"] == 0
    assert c.report_training(alpha_train=0.0, alpha_eval=0.4) is Decision.DEPLOY
    assert c.collection_enabled
    assert c.report_training(alpha_train=0.45, alpha_eval=0.4) is Decision.DISABLE
    assert not c.collection_enabled


def test_docstring_worked_example() -> None:
    c = SelectiveCollector(CollectionConfig(lambda_short=0.5, lambda_long=0.9, epsilon=0.05, n_init=2))
    c.observe_request(0.8)
    c.observe_request(0.6)
    c.observe_request(0.5)
    assert c.state()["alpha_short"] == pytest.approx(0.6) and c.state()["alpha_long"] == pytest.approx(0.68)
    assert c.collection_enabled


@pytest.mark.parametrize("kwargs", [
    {"lambda_short": 1.0}, {"lambda_long": -0.1}, {"lambda_short": 0.99, "lambda_long": 0.9},
    {"epsilon": -0.01}, {"n_init": 0}, {"n_threshold": 0},
])
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CollectionConfig(**kwargs)  # type: ignore[arg-type]


def test_alpha_validation() -> None:
    c = SelectiveCollector()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            c.observe_request(bad)
    with pytest.raises(ValueError):
        c.report_training(alpha_train=0.5, alpha_eval=2.0)
    assert c.state()["num_requests"] == 0 and c.state()["rounds"] == 0
