"""TIDE's analytic speedup model: when does speculating pay at this batch size?

Why this exists: speculation amortises one weight read over several tokens, which only helps
while decoding is memory-bound. As the batch grows, verifying ``b * (gamma + 1)`` tokens costs
visibly more than decoding ``b`` tokens, and a fixed-gamma engine loses throughput (TIDE
§4.1, Nightjar Fig. 2). Given a profile measured once per model/device/dtype, this
module predicts the speedup of every speculation length so a controller can pick one (or 0).

The model (TIDE eqs. 2-5), with ``T(n)`` the target latency to process ``n`` tokens in one
forward pass and ``D0`` the draft cost of one drafting step (TIDE treats it as batch-independent,
CPU launch overhead for small drafters; a drafter whose cost grows with the batch is profiled per
batch size, ``D0(b)``, see ``Profile.d0``)::

    E[l](alpha, gamma) = (1 - alpha**(gamma + 1)) / (1 - alpha)        # eq. 2, = gamma+1 at alpha=1
    beta(b, gamma)     = T(b * (gamma + 1)) / T(b)                     # verification / plain decode
    c(b)               = D0(b) / T(b)                                  # draft / plain decode
    speedup            = E[l] / (c(b) * gamma + beta(b, gamma))        # eq. 5

Worked example with TIDE's gpt-oss-120b profile (Table 5, milliseconds), b = 1, gamma = 3,
alpha = 0.7::

    E[l]  = (1 - 0.7**4) / 0.3             = 2.533
    beta  = T(4) / T(1) = 4.341 / 3.416    = 1.27078
    c     = 0.393 / 3.416                  = 0.115047
    speedup = 2.533 / (3 * 0.115047 + 1.27078) = 1.56754

At b = 512 the same alpha would need T(2048), far outside the table; at b = 128,
``beta = T(512) / T(128) = 21.50 / 11.79 = 1.824`` and the speedup falls to 1.35.

Drafters that stop early. A suffix or n-gram drafter proposes fewer than gamma tokens when its
match runs out (or is not confident), so eq. 5's verification of ``gamma + 1`` tokens overstates
its cost and eq. 2 its acceptance. We model the draft as continuing past each token with
probability ``rho`` (geometric, like acceptance): it proposes ``d = sum_{k=1..gamma} rho**k`` tokens
on average, token k is verified-and-accepted with probability ``(rho * alpha)**k``, and it pays for
the tokens it drafts, not for the gamma it was asked: an EAGLE-3 chain that stops where its head is
unsure runs one head step per draft (measured asked for 4 on the 2-core Xeon, w4a8 + compile: 1.36 /
2.30 / 3.54 / 3.98 ms for 1 / 2 / 3 / 4 drafts; charged 4 D0 each, the analytic policy kept EAGLE-3
at gamma 1 on code, where a static gamma 4 ran 1.15-1.19x as fast), and a drafter is called once per step even when
it proposes nothing::

    E[l]    = E[l](rho * alpha, gamma)
    d       = E[l](rho, gamma) - 1
    speedup = E[l] / (c(b) max(1, d) + T(b, 1 + d) / T(b))

which is eq. 5 exactly at rho = 1 (a drafter that always fills gamma). Example: alpha 0.8,
rho 0.75, gamma 4 at b = 1 on the gpt-oss profile below: E[l](0.6, 4) = 2.306, the draft averages
d = 2.051 tokens, so T(3.05 tokens) / T(1) = 1.202 and the speedup is 2.306 / (2.051 * 0.115 + 1.202)
= 1.604 — where eq. 5 with rho = 1 credits E[l] = 3.362 for 5 verified tokens (T(5) / T(1) = 1.336)
and predicts 1.871: a drafter that stops early gains less than its per-token acceptance suggests, and
charged for the whole gamma (4 * 0.115) it would read 1.387.

``T(n)`` between measured points is interpolated linearly over the running maximum of the
table (latency never decreases with more tokens, so measurement noise is flattened); beyond the
last point it is extrapolated along the last segment (the compute-bound regime is linear in n).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tidespec.errors import ConfigError

DEFAULT_DRAFTER = "default"
K = TypeVar("K", int, str)
PROFILE_FORMAT_VERSION = 1
MEMO_SIZE = 4096  # lookups a Profile remembers before it starts over


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation; clamp below ``xs[0]``, extend the last segment above."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        i = len(xs) - 1  # extrapolate along the last segment
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class Profile:
    """Profiled costs of one model on one device and dtype (all times in seconds).

    ``target_latency[n]``: one target forward pass over ``n`` new tokens in total (the batch's
    decode tokens, e.g. ``b * (gamma + 1)`` when verifying). ``draft_cost[name]``: D0 of one
    drafting step of drafter ``name``; ``draft_cost["default"]`` is required and used for
    unknown names. ``catchup[(tokens, batch)]``: time for a stateful drafter to re-ingest
    ``tokens`` lagging tokens for each of ``batch`` sequences after speculation was off
    (Nightjar's c_prefill(L_max, B), Table 1). ``draft_batch_cost[(name, b)]`` (optional): one
    drafting step of drafter ``name`` for ``b`` sequences at once, where it was measured per batch
    size (``d0`` interpolates it; without it ``draft_cost[name]`` holds at every batch size).
    """

    target_latency: dict[int, float]
    draft_cost: dict[str, float]
    catchup: dict[tuple[int, int], float] = field(default_factory=dict)
    key: str = ""  # model/device/dtype this profile was measured for
    # optional T(b, q): one forward with q new tokens for each of b sequences. On a CPU engine
    # that attends per sequence, b sequences x q tokens costs more than b*q tokens of one
    # sequence, so beta and c use this table when it is measured.
    verify_latency: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_batch_cost: dict[tuple[str, int], float] = field(default_factory=dict)
    _ts: list[float] = field(init=False, repr=False, compare=False)
    _tlat: list[float] = field(init=False, repr=False, compare=False)
    _rows: dict[int, tuple[list[float], list[float]]] = field(init=False, repr=False, compare=False)
    _vrows: dict[int, tuple[list[float], list[float]]] = field(init=False, repr=False, compare=False)
    _drows: dict[str, tuple[list[float], list[float]]] = field(init=False, repr=False, compare=False)
    # lookups already made, T(b, q) and D0(drafter, b): a policy prices the same few every step
    _verify_memo: dict[tuple[float, float], float] = field(init=False, repr=False, compare=False)
    _d0_memo: dict[tuple[str | None, float], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.target_latency:
            raise ValueError("target_latency must have at least one measured point")
        for n, t in self.target_latency.items():
            if n < 1 or not math.isfinite(t) or t <= 0:
                raise ValueError(f"target_latency needs n >= 1 and finite T > 0, got T({n}) = {t}")
        if DEFAULT_DRAFTER not in self.draft_cost:
            raise ValueError(f"draft_cost must contain the {DEFAULT_DRAFTER!r} drafter")
        for name, d in self.draft_cost.items():
            if not math.isfinite(d) or d < 0:
                raise ValueError(f"draft_cost[{name!r}] must be finite and >= 0, got {d}")
        for (tokens, batch), cost in self.catchup.items():
            if tokens < 0 or batch < 1 or not math.isfinite(cost) or cost < 0:
                raise ValueError(f"catchup needs tokens >= 0, batch >= 1, cost >= 0, got {(tokens, batch)}: {cost}")
        self._ts = [float(n) for n in sorted(self.target_latency)]
        envelope: list[float] = []
        for n in sorted(self.target_latency):
            envelope.append(max(self.target_latency[n], envelope[-1] if envelope else 0.0))
        self._tlat = envelope
        self._rows = _batch_rows(self.catchup)
        for (b, q), t in self.verify_latency.items():
            if b < 1 or q < 1 or not math.isfinite(t) or t <= 0:
                raise ValueError(f"verify_latency needs b, q >= 1 and finite T > 0, got T({b}, {q}) = {t}")
        self._vrows = _batch_rows({(q, b): t for (b, q), t in self.verify_latency.items()})
        for (name, b), d in self.draft_batch_cost.items():
            if b < 1 or not math.isfinite(d) or d < 0:
                raise ValueError(f"draft_batch_cost needs b >= 1 and a finite cost >= 0, got {(name, b)}: {d}")
        self._drows = _batch_rows({(b, name): d for (name, b), d in self.draft_batch_cost.items()})
        self._verify_memo, self._d0_memo = {}, {}

    # ---- lookups -------------------------------------------------------------------------
    def target(self, n: float) -> float:
        """T(n), seconds: interpolated over the monotone envelope of the measured table."""
        if n <= 0:
            raise ValueError(f"T(n) needs n > 0, got {n}")
        return _interp(self._ts, self._tlat, float(n))

    def d0(self, drafter: str | None = None, b: float = 1.0) -> float:
        """D0 of ``drafter`` (the default drafter's when None or unknown): seconds of one drafting step
        for a batch of ``b`` sequences. Where the drafter was profiled per batch size, linear between
        the measured sizes, the smallest one's below them and the last segment extended above (a
        batched drafter's cost grows with the rows it runs); else ``draft_cost``, the same at every b.

        Example: EAGLE-3 measured at 1.6 ms for b = 1 and 3.4 ms for b = 4 prices b = 2 at 2.2 ms and
        b = 8 at 5.8 ms; the suffix drafter, measured once at 0.05 ms, costs 0.05 ms at every b."""
        found = self._d0_memo.get((drafter, b))
        if found is None:
            name = drafter if drafter in self.draft_cost else DEFAULT_DRAFTER
            row = self._drows.get(name)
            found = self._d0_memo[drafter, b] = self.draft_cost[name] if row is None else max(0.0, _interp(*row, float(b)))
        return found

    def catchup_cost(self, tokens: int, batch: int) -> float:
        """Seconds to catch a stateful drafter up on ``tokens`` lagging tokens for ``batch`` seqs.

        Linear in tokens within each measured batch row (extended past the last point), linear
        between the two nearest batch rows, clamped to the outermost rows; 0 with no table.
        """
        if not self._rows or tokens <= 0:
            return 0.0
        return max(0.0, _row_interp(self._rows, float(tokens), batch))

    def verify(self, b: float, q: float) -> float:
        """T(b, q): b sequences with q new tokens each; T(b * q) when no 2-D table was measured."""
        found = self._verify_memo.get((b, q))
        if found is None:
            if len(self._verify_memo) >= MEMO_SIZE:  # q is often a measured mean draft length: keys keep coming
                self._verify_memo.clear()
            found = self._verify_memo[b, q] = _row_interp(self._vrows, float(q), b) if self._vrows else self.target(b * q)
        return found

    def baseline_tokens_per_s(self, b: int) -> float:
        """Plain-decode goodput at batch ``b``: b tokens every T(b, 1) seconds."""
        return b / self.verify(b, 1)

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_FORMAT_VERSION,
            "key": self.key,
            "target_latency_s": {str(n): t for n, t in sorted(self.target_latency.items())},
            "draft_cost_s": dict(sorted(self.draft_cost.items())),
            "catchup_s": [[tokens, batch, cost] for (tokens, batch), cost in sorted(self.catchup.items())],
            "verify_latency_s": [[b, q, t] for (b, q), t in sorted(self.verify_latency.items())],
            "draft_batch_cost_s": [[name, b, t] for (name, b), t in sorted(self.draft_batch_cost.items())],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_FORMAT_VERSION:
            raise ValueError(f"unsupported profile version {data.get('version')!r}, expected {PROFILE_FORMAT_VERSION}")
        return cls(
            target_latency={int(n): float(t) for n, t in data["target_latency_s"].items()},
            draft_cost={str(k): float(v) for k, v in data["draft_cost_s"].items()},
            catchup={(int(t), int(b)): float(c) for t, b, c in data.get("catchup_s", [])},
            key=str(data.get("key", "")),
            verify_latency={(int(b), int(q)): float(t) for b, q, t in data.get("verify_latency_s", [])},
            draft_batch_cost={(str(n), int(b)): float(t) for n, b, t in data.get("draft_batch_cost_s", [])},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        try:
            return cls.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # bad JSON, or JSON of another shape
            raise ConfigError(f"{path} is not a tidespec profile ({type(exc).__name__}: {exc}); "
                              f"write one with tidespec profile") from None


# ---- the model ---------------------------------------------------------------------------
def _batch_rows(table: dict[tuple[int, K], float]) -> dict[K, tuple[list[float], list[float]]]:
    """{(x, row): y} -> {row: (sorted xs, ys)}; a row is a batch size, or a drafter's name (D0 per batch size)."""
    rows: dict[K, dict[int, float]] = {}
    for (x, batch), y in table.items():
        rows.setdefault(batch, {})[x] = y
    return {b: ([float(t) for t in sorted(r)], [r[t] for t in sorted(r)]) for b, r in rows.items()}


def _row_interp(rows: dict[int, tuple[list[float], list[float]]], x: float, batch: float) -> float:
    """Linear in x within each batch row, linear between the two nearest rows, clamped outside."""
    batches = sorted(rows)
    if batch <= batches[0] or batch >= batches[-1]:
        row = batches[0] if batch <= batches[0] else batches[-1]
        return _interp(*rows[row], x)
    i = bisect.bisect_left(batches, batch)
    lo, hi = batches[i - 1], batches[i]
    y_lo, y_hi = _interp(*rows[lo], x), _interp(*rows[hi], x)
    return y_lo + (y_hi - y_lo) * (batch - lo) / (hi - lo)


def _check(alpha: float, gamma: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")


def expected_accept_length(alpha: float, gamma: float) -> float:
    """Eq. 2: expected tokens emitted per step (accepted drafts + the bonus/recovered token).

    ``expected_accept_length(0.7, 3) = (1 - 0.7**4) / 0.3 = 2.533``; at alpha = 1 every draft is
    accepted: gamma + 1. ``gamma`` may be fractional (a mean draft length).
    """
    _check(alpha, gamma)
    if alpha > 1.0 - 1e-12:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def alpha_from_accept_length(accept_length: float, gamma: float, tol: float = 1e-10) -> float:
    """Invert eq. 2: the per-token acceptance rate alpha with E[l](alpha, gamma) = accept_length.

    This is the moment estimator of alpha from observed steps: with gamma = 4 and 2.3616
    accepted drafts per sequence on average (accept_length 3.3616), alpha = 0.8; the naive
    ratio accepted / drafted = 2.3616 / 4 = 0.59 would underestimate it, because drafts after
    the first rejection are counted as drafted but can never be accepted.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0 to estimate alpha, got {gamma}")
    if accept_length <= 1.0:
        return 0.0
    if accept_length >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if expected_accept_length(mid, gamma) < accept_length:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def beta(profile: Profile, b: int, gamma: int) -> float:
    """beta(b) = T(b (gamma + 1)) / T(b): cost of verifying gamma drafts + 1 vs. one plain step."""
    return profile.verify(b, gamma + 1) / profile.verify(b, 1)


def c(profile: Profile, b: int, drafter: str | None = None) -> float:
    """c(b) = D0(b) / T(b): one drafting step relative to one plain decode step at batch b."""
    return profile.d0(drafter, b) / profile.verify(b, 1)


def expected_draft_length(rho: float, gamma: float) -> float:
    """Mean tokens a drafter proposes when asked for ``gamma`` and it continues past each token with
    probability ``rho``: sum_{k=1..gamma} rho**k. ``expected_draft_length(0.5, 4) = 0.9375``;
    ``expected_draft_length(1.0, 4) = 4``."""
    return expected_accept_length(rho, gamma) - 1.0


def practical_speedup(
    alpha: float, gamma: int, b: int, profile: Profile, drafter: str | None = None, rho: float = 1.0
) -> float:
    """Eq. 5: E[l] / (c(b) gamma + beta(b)); exactly 1.0 at gamma = 0 (plain decoding).

    ``rho`` < 1 is a drafter that stops early (module docstring): acceptance and verification
    length both shrink; rho = 1 is TIDE's eq. 5 as printed.
    """
    _check(alpha, gamma)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got {b}")
    if gamma == 0:
        return 1.0
    return speedup_of_lengths(expected_accept_length(alpha * rho, gamma), expected_draft_length(rho, gamma), gamma, b,
                              profile, drafter)


def speedup_of_lengths(accept_length: float, draft_length: float, gamma: int, b: float, profile: Profile,
                       drafter: str | None = None) -> float:
    """Eq. 5 with the acceptance length and the mean draft length given directly (measured per
    draft position, say, instead of from a geometric alpha): ``E[l] / (c(b) max(1, d) + T(b, 1 + d) /
    T(b, 1))``, the drafting charged for the ``d`` tokens drafted (module docstring; ``d`` is capped at
    ``gamma``); 1.0 at gamma = 0. Example (gpt-oss profile, b = 1, gamma 3, E[l] 2.533, d = 3):
    2.533 / (3 * 0.115 + 1.271) = 1.5675, eq. 5's value at alpha 0.7."""
    if gamma == 0:
        return 1.0
    if b < 1 or accept_length < 1.0 or draft_length < 0:
        raise ValueError(f"need b >= 1, accept_length >= 1, draft_length >= 0; got {b}, {accept_length}, {draft_length}")
    t1 = profile.verify(b, 1)
    drafted = max(1.0, min(float(gamma), draft_length))  # one drafting call at least, a step per draft
    return accept_length / (profile.d0(drafter, b) / t1 * drafted + profile.verify(b, 1.0 + draft_length) / t1)


def best_gamma(
    alpha: float, b: int, profile: Profile, gamma_max: int, drafter: str | None = None, rho: float = 1.0
) -> tuple[int, float]:
    """The gamma in 1..gamma_max with the highest eq.-5 speedup, or (0, 1.0) if none beats 1.0.

    Ties go to the shorter gamma (less KV reserved for the same predicted gain).
    """
    if gamma_max < 0:
        raise ValueError(f"gamma_max must be >= 0, got {gamma_max}")
    best, best_s = 0, 1.0
    for g in range(1, gamma_max + 1):
        s = practical_speedup(alpha, g, b, profile, drafter, rho)
        if s > best_s:
            best, best_s = g, s
    return best, best_s


def min_alpha_for_gain(
    b: int, gamma: int, profile: Profile, drafter: str | None = None, tol: float = 1e-9
) -> float:
    """Smallest alpha with practical_speedup(alpha) >= 1 (bisection; the speedup rises with alpha).

    Returns ``math.inf`` when even alpha = 1 gives no gain ((gamma + 1) <= c gamma + beta), and
    0.0 when any alpha gains (only possible with a non-monotone profile).
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if practical_speedup(1.0, gamma, b, profile, drafter) <= 1.0:
        return math.inf
    if practical_speedup(0.0, gamma, b, profile, drafter) >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if practical_speedup(mid, gamma, b, profile, drafter) >= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def min_accept_length_for_gain(b: int, gamma: int, profile: Profile, drafter: str | None = None) -> float:
    """TIDE §5.4's threshold: the acceptance length E[l] needed for any gain at batch b."""
    a = min_alpha_for_gain(b, gamma, profile, drafter)
    return math.inf if math.isinf(a) else expected_accept_length(a, gamma)
