"""Selective training-signal collection: TIDE's Algorithm 1 (Adaptive Training Control).

Why this exists: capturing and training on every request wastes storage and trainer time and can
overfit the drafter, and acceptance saturates once the drafter has adapted (TIDE Sec. 4.2,
Fig. 5). The collector decides *when* the engine should capture signals and *whether* a freshly
trained drafter should be deployed, from per-request acceptance rates alone:

    alpha_1..alpha_Ninit           -> alpha_short = alpha_long = their mean     (initialisation)
    per later request alpha:  alpha_short <- l_s * alpha_short + (1 - l_s) * alpha
                              alpha_long  <- l_l * alpha_long  + (1 - l_l) * alpha
                              if alpha_short < alpha_long - eps: collection on  (distribution shift)
    once |stored| >= N_threshold: train on D_train, evaluate on D_eval and compare
        alpha_eval (new drafter on D_eval) with alpha_train (mean alpha the *deployed* drafter
        achieved on the requests in D_train, i.e. the alpha stored next to each signal):
        alpha_eval > alpha_train -> deploy;  alpha_eval < alpha_train -> collection off;  equal -> keep.

Collection is switched *on* only by a detected shift and *off* only by a non-improving round,
exactly as in Algorithm 1 (the EMAs never switch it off). The collector owns no data: the caller
stores signals while ``collection_enabled`` holds, calls ``should_train`` with the number of
stored signals not yet used by a training round, and reports each round's two alphas.

Two extensions, both off by default:
* ``force``: collection is always on and never disabled (benchmarks that measure capture cost or
  learning curves). Decisions are still computed and reported.
* ``bootstrap``: collection starts on. Deviation from TIDE, which always starts from a trained
  drafter: with no drafter at all there is nothing to detect a shift on, so the engine collects
  from the start until the first non-improving round switches collection off.

Worked example (lambda_short=0.5, lambda_long=0.9, eps=0.05, N_init=2)::

    c = SelectiveCollector(CollectionConfig(lambda_short=0.5, lambda_long=0.9, epsilon=0.05, n_init=2))
    c.observe_request(0.8); c.observe_request(0.6)   # init: short = long = 0.7
    c.observe_request(0.5)   # short = 0.6, long = 0.68;  0.6 < 0.63 -> collection on
    c.report_training(alpha_train=0.5, alpha_eval=0.6)   # -> Decision.DEPLOY
    c.report_training(alpha_train=0.6, alpha_eval=0.55)  # -> Decision.DISABLE (collection off)
"""

from __future__ import annotations

import enum
import math
import threading

from tidespec.config import CollectionConfig


class Decision(str, enum.Enum):
    """Outcome of one training round."""

    DEPLOY = "deploy"  # alpha_eval > alpha_train: swap the new drafter in
    DISABLE = "disable_collection"  # alpha_eval < alpha_train: keep the old drafter, stop collecting
    KEEP = "keep"  # equal: keep the old drafter, leave collection as it is


class SelectiveCollector:
    """Algorithm 1's state machine. Thread-safe: the engine observes, a trainer thread reports."""

    def __init__(self, config: CollectionConfig | None = None) -> None:
        self.config = config or CollectionConfig()
        self._lock = threading.Lock()
        self._init_alphas: list[float] = []
        self._alpha_short: float | None = None
        self._alpha_long: float | None = None
        self._enabled = self.config.force or self.config.bootstrap
        self._num_requests = 0
        self._rounds = 0
        self._deployments = 0
        self._shifts = 0
        self._last_shift_request: int | None = None  # 1-based index of the request that switched collection on
        self._last_decision: Decision | None = None

    def observe_request(self, alpha: float) -> None:
        """Feed the acceptance rate (accepted / proposed draft tokens, in [0, 1]) of one finished request."""
        if not (0.0 <= alpha <= 1.0) or math.isnan(alpha):
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        cfg = self.config
        with self._lock:
            self._num_requests += 1
            if self._alpha_short is None or self._alpha_long is None:
                self._init_alphas.append(alpha)
                if len(self._init_alphas) == cfg.n_init:
                    mean = sum(self._init_alphas) / cfg.n_init
                    self._alpha_short = self._alpha_long = mean
                    self._init_alphas.clear()
                return
            self._alpha_short = cfg.lambda_short * self._alpha_short + (1.0 - cfg.lambda_short) * alpha
            self._alpha_long = cfg.lambda_long * self._alpha_long + (1.0 - cfg.lambda_long) * alpha
            if self._alpha_short < self._alpha_long - cfg.epsilon and not self._enabled:
                self._enabled = True
                self._shifts += 1
                self._last_shift_request = self._num_requests

    @property
    def collection_enabled(self) -> bool:
        """Whether the engine should capture training signals now."""
        return self._enabled

    def should_train(self, num_stored: int) -> bool:
        """True once ``num_stored`` (signals stored and not yet used by a round) reaches N_threshold."""
        return num_stored >= self.config.n_threshold

    def report_training(self, alpha_train: float, alpha_eval: float) -> Decision:
        """Record one training round and say what to do with the new drafter.

        ``alpha_train``: mean acceptance of the deployed drafter on the requests whose signals form
        D_train (measured while serving, before training). ``alpha_eval``: acceptance of the new
        drafter estimated on the held-out D_eval. Algorithm 1 compares these two numbers as they
        are, although they come from different splits and different measurements (served vs.
        estimated); a caller that wants a like-for-like comparison may pass the old drafter's
        estimate on D_eval as ``alpha_train``.
        """
        for name, value in (("alpha_train", alpha_train), ("alpha_eval", alpha_eval)):
            if not (0.0 <= value <= 1.0) or math.isnan(value):
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        with self._lock:
            self._rounds += 1
            if alpha_eval > alpha_train:
                decision = Decision.DEPLOY
                self._deployments += 1
            elif alpha_eval < alpha_train:
                decision = Decision.DISABLE
                if not self.config.force:
                    self._enabled = False
            else:
                decision = Decision.KEEP
            self._last_decision = decision
            return decision

    def state(self) -> dict[str, float | int | bool | str | None]:
        """Snapshot for metrics; the alphas are None until N_init requests were observed."""
        with self._lock:
            return {
                "alpha_short": self._alpha_short,
                "alpha_long": self._alpha_long,
                "collection_enabled": self._enabled,
                "initialized": self._alpha_short is not None,
                "num_requests": self._num_requests,
                "rounds": self._rounds,
                "deployments": self._deployments,
                "shifts_detected": self._shifts,
                "last_shift_request": self._last_shift_request,
                "last_decision": self._last_decision.value if self._last_decision else None,
                "forced": self.config.force,
            }
