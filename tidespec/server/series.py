"""Per-second time series of the serving numbers, for the ``/dashboard`` page.

Why this exists: Prometheus counters answer "how much so far"; the dashboard shows "how is it going
now" without a Prometheus server. It must show the same numbers as ``/metrics``, so ``Metrics``
owns one ``Series`` and feeds it from its own ``on_step`` / ``on_request_finished`` calls (one
data source). Memory is bounded: one ``_Point`` per second in a ring of ``window_s`` seconds
(default 600), each with at most one entry per drafter and per route label (``Metrics.route``
bounds those); per batch-size bucket a running tally since start (``bucket_of`` rounds batch sizes
up to powers of two, so there are few).

Cost: ``on_step`` runs in the engine thread after every step and does constant bookkeeping plus
one pass over the step's per-drafter outcomes (one entry per drafting sequence, as ``Metrics``
already walks ``spec_lens``); all derived numbers (rolling rates, ratios, the gaps of idle seconds)
are computed in ``snapshot``, when the page asks (every ~2 s per open page).

Worked example (hand-traced): two decode-only steps in second 100, batch 2, each emitting 4 tokens
in 0.5 s, drafter "ngram" drafting both sequences (outcomes (3, 3, 1) and (3, 3, 0)), profile with
``baseline_tokens_per_s(2) = 5``::

    point 100: emitted 8, decode_emitted 8, decode_time 1.0, plain_time 8 / 5 = 1.6,
               drafters {"ngram": [4 drafts, 2 accepted]}
    snapshot(smooth_s=1) at second 101: tokens/s served 8, decoding 8 / 1.0 = 8,
               plain estimate 8 / 1.6 = 5; acceptance ngram = (2 + 4) / 4 = 1.5 tokens per draft
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tidespec.speculative.policy.api import bucket_of
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import RequestStats, StepStats

MIXED = "mixed"  # several drafters in one step, with no per-drafter outcomes to tell them apart


@dataclass
class _Point:
    """Sums over one wall-clock second."""

    t: int
    emitted: int = 0  # tokens appended to outputs (every step)
    decode_emitted: int = 0  # ... by decode-only steps
    decode_time: float = 0.0  # wall time of the decode-only steps
    plain_time: float = 0.0  # what plain decoding would have taken for decode_emitted (profile)
    decode_steps: int = 0
    gamma_sum: int = 0  # sum over decode-only steps of the gamma that ran (max over sequences)
    version: float | None = None  # the drafter's version at the last step
    drafters: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafts, accepted]
    shadow: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafts, accepted], scored on the side
    routes: dict[str, list[int]] = field(default_factory=dict)  # label -> [requests, drafts, accepted, tokens]


@dataclass
class _Bucket:
    """Decode-only steps of one batch-size bucket since start."""

    steps: int = 0
    seqs: int = 0
    gamma_sum: int = 0
    last_gamma: int = 0
    time: float = 0.0
    plain_time: float = 0.0
    drafters: dict[str, int] = field(default_factory=dict)  # name -> sequence-steps it drafted
    last_drafter: str | None = None


def _add(acc: dict[str, list[int]], name: str, values: Iterable[int]) -> None:
    row = acc.get(name)
    if row is None:
        acc[name] = list(values)
        return
    for i, v in enumerate(values):
        row[i] += v


def _outcome_sums(outcomes: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(drafts, accepted) of ``(gamma, depth, accepted)`` outcomes; an empty draft is no draft."""
    drafts = accepted = 0
    for _gamma, depth, acc in outcomes:
        if depth:
            drafts += 1
            accepted += acc
    return drafts, accepted


class Series:
    """The ring of per-second points and the per-bucket tallies; see the module docstring."""

    def __init__(self, window_s: int = 600, clock: Callable[[], float] = time.time) -> None:
        if window_s < 2:
            raise ValueError(f"window_s must be >= 2, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self.profile: Profile | None = None  # set by Metrics.attach_policy
        self.default_drafter: str | None = None  # the engine drafter's name (steps that name none)
        self._points: deque[_Point] = deque(maxlen=window_s)  # closed seconds, oldest first
        self._open: _Point | None = None
        self._buckets: dict[int, _Bucket] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ feeds (engine thread)
    def _point(self) -> _Point:
        """The point of the current second (caller holds the lock); closes the previous one."""
        now = int(self.clock())
        p = self._open
        if p is None or now > p.t:  # a clock stepping back keeps filling the open point
            if p is not None:
                self._points.append(p)
            p = self._open = _Point(now)
        return p

    def on_step(self, stats: StepStats, version: float | None = None) -> None:
        """Account one engine step; ``version``: the drafter's version now (online training)."""
        decode_only = bool(stats.num_decode_seqs) and not stats.num_prefill_tokens
        per_drafter = self._per_drafter(stats)
        shadow = stats.shadow_outcomes
        gamma = stats.gamma if decode_only else 0
        plain = 0.0
        if decode_only and self.profile is not None:
            plain = stats.num_emitted_tokens / self.profile.baseline_tokens_per_s(stats.num_decode_seqs)
        with self._lock:
            p = self._point()
            p.emitted += stats.num_emitted_tokens
            if version is not None:
                p.version = version
            for name, (drafts, accepted, _seqs) in per_drafter.items():
                _add(p.drafters, name, (drafts, accepted))
            for name, outcomes in shadow.items():
                _add(p.shadow, name, _outcome_sums(outcomes))
            if not decode_only:
                return
            p.decode_emitted += stats.num_emitted_tokens
            p.decode_time += stats.total_time
            p.plain_time += plain
            p.decode_steps += 1
            p.gamma_sum += gamma
            b = self._buckets.setdefault(bucket_of(stats.num_decode_seqs), _Bucket())
            b.steps += 1
            b.seqs += stats.num_decode_seqs
            b.gamma_sum += gamma
            b.last_gamma = gamma
            b.time += stats.total_time
            b.plain_time += plain
            for name, (_drafts, _accepted, seqs) in per_drafter.items():
                b.drafters[name] = b.drafters.get(name, 0) + seqs
            if per_drafter:
                b.last_drafter = max(per_drafter, key=lambda n: per_drafter[n][2])

    def _per_drafter(self, stats: StepStats) -> dict[str, tuple[int, int, int]]:
        """name -> (drafts, accepted, sequences asked to draft) of one step."""
        outcomes = stats.drafter_outcomes
        if outcomes:  # engines with several drafters say which drafted what
            return {name: (*_outcome_sums(o), len(o)) for name, o in outcomes.items()}
        asked = len(stats.seq_outcomes) or stats.num_drafts
        if not asked:
            return {}
        names = set(stats.seq_drafters.values())
        if len(names) > 1:
            name = MIXED
        else:
            name = next(iter(names)) if names else (self.default_drafter or "drafter")
        return {name: (stats.num_drafts, stats.num_accepted_tokens, asked)}

    def on_request_finished(self, route: str, stats: RequestStats, num_tokens: int) -> None:
        """Account a finished request under its (bounded) route label."""
        with self._lock:
            _add(self._point().routes, route, (1, stats.num_drafts, stats.num_accepted_tokens, num_tokens))

    # ------------------------------------------------------------------ reads (any thread)
    def snapshot(self, smooth_s: int = 5) -> dict[str, Any]:
        """The closed seconds of the window as aligned arrays (rolling sums over ``smooth_s``
        seconds; idle seconds included: 0 tokens/s, no acceptance), and the bucket table."""
        now = int(self.clock())
        with self._lock:
            points = list(self._points)
            if self._open is not None and self._open.t < now:
                points.append(self._open)
            buckets = {k: _Bucket(b.steps, b.seqs, b.gamma_sum, b.last_gamma, b.time, b.plain_time,
                                  dict(b.drafters), b.last_drafter) for k, b in self._buckets.items()}
        start = max(now - self.window_s, points[0].t) if points else now
        by_t = {p.t: p for p in points if p.t >= start}
        ts = list(range(start, now)) if by_t else []
        series = _Rolling([by_t.get(t) for t in ts], max(1, smooth_s))
        return {
            "t": ts,
            "smooth_s": max(1, smooth_s),
            "window_s": self.window_s,
            "tokens_per_s": {
                "served": series.rate(lambda p: p.emitted),
                "decoding": series.ratio(lambda p: p.decode_emitted, lambda p: p.decode_time),
                "plain_estimate": series.ratio(lambda p: p.decode_emitted, lambda p: p.plain_time)
                if self.profile is not None else None,
            },
            "acceptance": {
                "drafters": series.acceptance(lambda p: p.drafters, 0, 1),
                "shadow": series.acceptance(lambda p: p.shadow, 0, 1),
                "routes": series.acceptance(lambda p: p.routes, 1, 2),
            },
            "gamma": series.ratio(lambda p: p.gamma_sum, lambda p: p.decode_steps),
            "drafter_version": series.last(lambda p: p.version),
            "requests": series.totals(lambda p: p.routes, 0),
            "buckets": [_bucket_row(k, b) for k, b in sorted(buckets.items())],
        }


def _bucket_row(key: int, b: _Bucket) -> dict[str, Any]:
    drafted = sum(b.drafters.values())
    return {
        "bucket": key,
        "steps": b.steps,
        "mean_batch": round(b.seqs / b.steps, 2) if b.steps else None,
        "last_gamma": b.last_gamma,
        "mean_gamma": round(b.gamma_sum / b.steps, 2) if b.steps else None,
        "last_drafter": b.last_drafter,
        "drafter_share": {n: round(c / drafted, 3) for n, c in sorted(b.drafters.items())} if drafted else {},
        "speedup_vs_plain": round(b.plain_time / b.time, 3) if b.time > 0 and b.plain_time > 0 else None,
    }


class _Rolling:
    """Rolling-window sums over a list of per-second points (None = an idle second)."""

    def __init__(self, points: list[_Point | None], window: int) -> None:
        self.points = points
        self.window = window

    def _rolled(self, value: Callable[[_Point], float]) -> list[float]:
        out: list[float] = []
        acc = 0.0
        vals = [value(p) if p is not None else 0.0 for p in self.points]
        for i, v in enumerate(vals):
            acc += v
            if i >= self.window:
                acc -= vals[i - self.window]
            out.append(acc)
        return out

    def rate(self, value: Callable[[_Point], float]) -> list[float]:
        """Per second over the window (over fewer seconds at the start of the series)."""
        return [round(s / min(self.window, i + 1), 3) for i, s in enumerate(self._rolled(value))]

    def ratio(self, num: Callable[[_Point], float], den: Callable[[_Point], float]) -> list[float | None]:
        return [round(n / d, 3) if d > 0 else None for n, d in zip(self._rolled(num), self._rolled(den))]

    def sums(self, table: Callable[[_Point], dict[str, list[int]]], col: int) -> dict[str, list[float]]:
        names = sorted({n for p in self.points if p is not None for n in table(p)})
        return {n: self._rolled(lambda p, n=n: table(p).get(n, [0] * (col + 1))[col]) for n in names}

    def totals(self, table: Callable[[_Point], dict[str, list[int]]], col: int) -> dict[str, int]:
        """Per name: the sum of column ``col`` over the whole series."""
        out: dict[str, int] = {}
        for p in self.points:
            for n, row in (table(p) if p is not None else {}).items():
                out[n] = out.get(n, 0) + row[col]
        return dict(sorted(out.items()))

    def acceptance(self, table: Callable[[_Point], dict[str, list[int]]], drafts_col: int,
                   accepted_col: int) -> dict[str, list[float | None]]:
        """Per name: accepted tokens per draft + 1 (tokens a drafting step emits); None without drafts."""
        drafts = self.sums(table, drafts_col)
        accepted = self.sums(table, accepted_col)
        return {n: [round((a + d) / d, 3) if d > 0 else None for d, a in zip(drafts[n], accepted[n])]
                for n in drafts if any(drafts[n])}

    def last(self, value: Callable[[_Point], float | None]) -> list[float | None]:
        """The last value seen up to each second (carried over idle seconds); all None when never set."""
        out: list[float | None] = []
        cur: float | None = None
        for p in self.points:
            v = value(p) if p is not None else None
            cur = v if v is not None else cur
            out.append(cur)
        return out
