"""Prometheus metrics fed from the engine's own statistics.

Why this exists: dashboards and the adaptive controllers must read the same numbers. So there is
one data source: ``StepStats`` (via ``Metrics.on_step_end``, an engine observer) feed the step-level counters and
gauges, finished ``RequestOutput``s (their ``RequestStats``) feed the latency histograms and the
per-route counters. Names follow vLLM's with a ``tidespec:`` prefix, so existing vLLM dashboards
need only a prefix change (prometheus-client appends ``_total`` to counters, as vLLM's do).

Per-route bucketing: a mean acceptance over mixed traffic hides the half of the traffic below
break-even, so requests may carry a route/domain label (the server takes it from the
``X-Tidespec-Route`` header) and the ``tidespec:request_spec_decode_*`` counters are labelled by
it. Labels come from clients, so they are bounded: at most ``max_routes`` distinct values, later
ones are counted as ``"other"``; requests without a label count as ``"default"``.

Every ``Metrics`` owns its ``CollectorRegistry`` (no global default registry), so several servers
or tests in one process never collide.

Worked example (hand-traced)::

    m = Metrics()
    m.on_step_end(StepStats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5,
                        accepted_per_pos=[2, 2, 1], spec_lens={0: 4, 1: 4, 2: 0}))
    # spec_decode_num_drafts_total 2, _num_draft_tokens_total 8, _num_accepted_tokens_total 5,
    # _num_accepted_tokens_per_pos_total{position="0"} 2, {"1"} 2, {"2"} 1,
    # spec_decode_current_num_speculative_tokens = mean(4, 4, 0) = 2.667
    m.render()   # text exposition format for GET /metrics

Per drafter (several drafters under one controller, ``--drafter suffix,eagle3 --policy analytic``;
one drafter is labelled with its own name): ``spec_decode_drafter_num_drafts{drafter}``,
``spec_decode_drafter_num_draft_tokens{drafter}`` (draft positions: the draft depth, draft tokens
for a chain) and ``spec_decode_drafter_num_accepted_tokens{drafter}`` — vLLM's three
``spec_decode_*`` counters split by drafter — plus ``spec_policy_choices{drafter}`` (decode
sequence-steps by the drafter the policy chose, ``"none"`` for no speculation) and, at scrape time,
``spec_policy_drafter_predicted_speedup{drafter}``: what the controller believes each drafter
would pay at its best gamma. Example: one step, suffix drafting 3 positions and 2 accepted for one
sequence, eagle3 4 positions and 1 accepted for another, a third sequence at gamma 0: drafts
{suffix: 1, eagle3: 1}, tokens {suffix: 3, eagle3: 4}, accepted {suffix: 2, eagle3: 1}, choices
{suffix: 1, eagle3: 1, none: 1}.

Policy metrics (``attach_policy``): the chosen speculation length per batch-size bucket
(``spec_policy_gamma{bucket}``, and ``spec_policy_steps_total{bucket, gamma}`` counting decode steps
by the gamma that ran), the policy's own counters mirrored at scrape time
(``spec_policy_decisions{kind="explore"|"exploit"}``, ``spec_policy_stat{stat}``), and — given the
profile — the analytic model checked against reality per bucket: ``spec_policy_measured_speedup``
(plain-decode time of the emitted tokens, ``sum(emitted * T(b, 1) / b)``, over the wall time of
the decode-only steps) next to ``spec_policy_predicted_speedup``: the same numerator over what
TIDE's cost model says those steps cost, ``sum(T(b, 1 + drafted / b) + D0)`` — eq. 5 with the
measured tokens per step in place of E[l](alpha), so the check isolates the cost side (profiled
forward times vs real steps, including everything a step does besides the forward). Example:
two decode steps at batch 4, 12 drafted and 8 emitted each, 0.2 s each, T(4, 1) = 0.1 s,
T(4, 4) = 0.16 s, D0 = 0: measured = 2 * 8 * 0.1 / 4 / 0.4 = 1.0, predicted = 0.4 / 0.32 = 1.25.
The per-step work is two profile lookups; the policy's ``stats()`` runs only on a scrape. Both
gauges take the *profiled* T(b, 1) as plain decoding's cost, so their ratio shows how far a served
step is from the profile (on the 2-core VM: 1.3-1.4x, mostly a slower forward), not the model's
error: for that, compare with a plain server's ``decode_step_*`` counters (``tidespec bench load``
does; docs/benchmarks/policies.md).

Where a decode step's time goes, per batch-size bucket, with or without a policy (plain servers
too, so a benchmark can compare a speculating server with a plain one bucket by bucket, as TIDE's
Figure 8 does): ``decode_steps_total{bucket}``, ``decode_step_seqs_total{bucket}`` (sum of batch
sizes), ``decode_step_seconds_total{bucket, part}`` with part ``total`` / ``forward`` (target
forward + verification) / ``draft`` / ``other`` (scheduling, bookkeeping, detokenization), and
``decode_step_tokens_total{bucket, kind}`` with kind ``emitted`` / ``drafted``. Counters, so a
client takes differences between two scrapes to isolate one run.

Online training (``attach_online``, servers with ``--online-training`` only), read from
``OnlineTraining.state()`` at scrape time: ``trainer_up`` (1 while the trainer child runs, 0 while
it waits for a restart, after the supervisor gave up, or after it exited), ``trainer_paused`` (1
while it yields the CPU to serving: ``online.serving.governor``), and the counters
``trainer_deaths_total`` (exits nobody asked for) and ``trainer_restarts_total``.

A draft vocabulary (``attach_vocab``, servers run with ``--draft-vocab-mode``): its counters as
``draft_vocab_stat{stat}`` at scrape time — |V_t|, coverage of the verified tokens, OOV events,
V_t swaps, retrievals and their seconds (off the step), ARC admissions and evictions.

The same feeds also fill ``series`` (``tidespec.server.series``): per-second points over the last
ten minutes for the ``/dashboard`` page, so the page and ``/metrics`` show one set of numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tidespec.engine.observer import EngineObserver
from tidespec.engine.output import RequestOutput
from tidespec.server.series import Series
from tidespec.speculative.api import Drafter
from tidespec.speculative.policy.api import SpeculationPolicy, bucket_of
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.vocab.dynamic import DynamicVocab
from tidespec.stats import StepStats

if TYPE_CHECKING:
    from tidespec.online.serving.attach import OnlineTraining

PREFIX = "tidespec:"
DEFAULT_ROUTE = "default"
OTHER_ROUTE = "other"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


@dataclass
class _BucketTally:
    """Running sums of the decode-only steps of one batch-size bucket."""

    time: float = 0.0  # measured step wall time
    plain_time: float = 0.0  # sum(emitted * T(b, 1) / b): what plain decoding would have taken
    model_time: float = 0.0  # sum(T(b, 1 + drafted / b) + D0 if drafted): eq. 5's cost of these steps


@dataclass
class _TrainerMetrics:
    """The online-training child's metrics; the supervisor's counts become counter increments."""

    online: OnlineTraining
    up: Gauge
    paused: Gauge
    deaths: Counter
    restarts: Counter
    exported: dict[str, int] = field(default_factory=lambda: {"deaths": 0, "restarts": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> None:
        trainer = self.online.state()["trainer"] or {}
        self.up.set(1 if trainer.get("state") == "running" else 0)
        self.paused.set(1 if trainer.get("paused") else 0)
        with self.lock:  # two concurrent scrapes must not both add the same deaths
            for key, counter in (("deaths", self.deaths), ("restarts", self.restarts)):
                now = int(trainer.get(key, 0))
                if now > self.exported[key]:
                    counter.inc(now - self.exported[key])
                    self.exported[key] = now


class Metrics(EngineObserver):
    """The server's Prometheus metrics (an observer of the engine's steps); see the module docstring."""

    def __init__(self, registry: CollectorRegistry | None = None, max_routes: int = 32) -> None:
        if max_routes < 1:
            raise ValueError(f"max_routes must be >= 1, got {max_routes}")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.max_routes = max_routes
        self._routes: set[str] = set()
        self._routes_lock = threading.Lock()
        r = self.registry
        p = PREFIX
        # step-level (StepStats)
        self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Sequence-steps that speculated.", registry=r)
        self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           registry=r)
        self.draft_errors = Counter(f"{p}spec_decode_draft_errors", "Sequence-steps whose drafter raised: they "
                                    "decoded without drafts (the server log has the traceback).", registry=r)
        self.num_trimmed = Counter(f"{p}spec_decode_num_trimmed_tokens", "Drafted tokens cut before verification: "
                                   "their rows cost more than they were expected to return (--trim-drafts).", registry=r)
        self.accepted_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0 = first).",
                                        ["position"], registry=r)
        # per drafter (several under one controller: which one pays), from StepStats.drafter_outcomes
        self.drafter_drafts = Counter(f"{p}spec_decode_drafter_num_drafts", "Sequence-steps that speculated "
                                      "with a draft of this drafter.", ["drafter"], registry=r)
        self.drafter_draft_tokens = Counter(f"{p}spec_decode_drafter_num_draft_tokens", "Draft positions this "
                                            "drafter proposed (the draft depth: draft tokens for a chain).",
                                            ["drafter"], registry=r)
        self.drafter_accepted = Counter(f"{p}spec_decode_drafter_num_accepted_tokens", "Draft tokens of this "
                                        "drafter the target accepted.", ["drafter"], registry=r)
        self.policy_choices = Counter(f"{p}spec_policy_choices", "Decode sequence-steps by the drafter the policy "
                                      "chose for them ('none': no speculation).", ["drafter"], registry=r)
        self.drafter_speedup = Gauge(f"{p}spec_policy_drafter_predicted_speedup", "Speedup over plain decoding the "
                                     "controller predicts for each drafter at its best gamma (last planned batch).",
                                     ["drafter"], registry=r)
        self._drafter_children: dict[str, tuple[Counter, ...]] = {}
        self._choice_children: dict[str, Counter] = {}
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated.", registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens reused from the prefix cache (not "
                                   "computed).", registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests holding a KV slot.", registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests queued for a KV slot.", registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Sequences preempted for lack of KV blocks (prefilled "
                                   "again later).", registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "KV cache usage, 0..1 (paged: fraction of the blocks in use "
                              "by sequences; slots: of the positions).", registry=r)
        self.current_spec = Gauge(f"{p}spec_decode_current_num_speculative_tokens",
                                  "Mean speculation length over the decode sequences of the last step.",
                                  registry=r)
        # request-level (finished RequestOutputs)
        self.request_success = Counter(f"{p}request_success", "Finished requests.", ["finish_reason"], registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram(f"{p}time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS,
                             registry=r)
        self.req_drafts = Counter(f"{p}request_spec_decode_num_drafts", "Speculating steps of finished requests.",
                                  ["route"], registry=r)
        self.req_draft_tokens = Counter(f"{p}request_spec_decode_num_draft_tokens",
                                        "Draft tokens of finished requests.", ["route"], registry=r)
        self.req_accepted_tokens = Counter(f"{p}request_spec_decode_num_accepted_tokens",
                                           "Accepted draft tokens of finished requests.", ["route"], registry=r)
        self.req_generation_tokens = Counter(f"{p}request_generation_tokens", "Output tokens of finished requests.",
                                             ["route"], registry=r)
        # speculation policy (attach_policy)
        self.policy: SpeculationPolicy | None = None
        self.profile: Profile | None = None
        self._tallies: dict[int, _BucketTally] = {}
        self.policy_info = Gauge(f"{p}spec_policy_info", "The speculation policy that runs (value 1).", ["policy"],
                                 registry=r)
        self.policy_gamma = Gauge(f"{p}spec_policy_gamma", "Speculation length of the last decode step, by batch-"
                                  "size bucket (power of two, rounding up).", ["bucket"], registry=r)
        self.policy_steps = Counter(f"{p}spec_policy_steps", "Decode steps by batch-size bucket and the gamma that ran.",
                                    ["bucket", "gamma"], registry=r)
        self.policy_decisions = Gauge(f"{p}spec_policy_decisions", "Bandit decisions so far, by kind.", ["kind"],
                                      registry=r)
        self.policy_stat = Gauge(f"{p}spec_policy_stat", "The policy's own statistics (SpeculationPolicy.stats()).",
                                 ["stat"], registry=r)
        self.policy_measured = Gauge(f"{p}spec_policy_measured_speedup", "Decode goodput over plain decoding's "
                                     "(profiled T(b, 1)), by batch-size bucket.", ["bucket"], registry=r)
        self.policy_predicted = Gauge(f"{p}spec_policy_predicted_speedup", "TIDE eq. 5 at the bucket's measured "
                                      "alpha and mean gamma, by batch-size bucket.", ["bucket"], registry=r)
        # decode-step breakdown per bucket (every server; see the module docstring)
        self.decode_steps = Counter(f"{p}decode_steps", "Decode-only steps, by batch-size bucket.", ["bucket"],
                                    registry=r)
        self.decode_seqs = Counter(f"{p}decode_step_seqs", "Sum of the batch sizes of the decode-only steps.",
                                   ["bucket"], registry=r)
        self.decode_seconds = Counter(f"{p}decode_step_seconds", "Wall time of the decode-only steps, by part: "
                                      "total, forward, draft, other.", ["bucket", "part"], registry=r)
        self.decode_tokens = Counter(f"{p}decode_step_tokens", "Tokens of the decode-only steps: emitted, drafted.",
                                     ["bucket", "kind"], registry=r)
        self._decode_children: dict[int, tuple[Counter, ...]] = {}
        self.drafter: Drafter | None = None
        self.drafter_version = Gauge(f"{p}spec_decode_drafter_version", "Version of the drafter in use (online "
                                     "training publishes new ones; read at scrape time).", registry=r)
        # server-level
        self.rejected = Counter(f"{p}request_rejected", "Requests refused before reaching the engine.",
                                ["reason"], registry=r)
        self.exactness_checks = Counter(
            f"{p}exactness_checks", "Finished greedy requests re-decoded plainly in idle time (--exactness-check), by "
            "result: match, mismatch (logged with the request id, position and top-2 logit gap), dropped (more "
            "pending than the bound), abandoned (stopped for a request that needed its KV slot; retried).",
            ["result"], registry=r)
        # online training (attach_online): created only for servers that train
        self.trainer: _TrainerMetrics | None = None
        # a draft vocabulary (attach_vocab): created only for servers that run one
        self.vocab: DynamicVocab | None = None
        self.vocab_stat: Gauge | None = None
        # per-second history for /dashboard (bounded ring), fed by the same calls
        self.series = Series()

    # ------------------------------------------------------------------ feeds
    def init_exactness_checks(self, results: tuple[str, ...]) -> None:
        """Create the ``exactness_checks_total`` series of every result at 0."""
        for result in results:
            self.exactness_checks.labels(result=result)

    def on_exactness_check(self, result: str, mismatch: object | None) -> None:
        """``ExactnessChecker`` result hook (the mismatch itself is logged by the checker)."""
        self.exactness_checks.labels(result=result).inc()

    def on_step_end(self, stats: StepStats) -> None:
        """The step's counters: ``engine.add_observer(metrics)``."""
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        self.draft_errors.inc(stats.num_draft_errors)
        self.num_trimmed.inc(stats.num_trimmed)
        for pos, n in enumerate(stats.accepted_per_pos):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        self.prompt_tokens.inc(stats.num_prefill_tokens)
        self.generation_tokens.inc(stats.num_emitted_tokens)
        self.prefix_queries.inc(stats.num_prefix_query_tokens)
        self.prefix_hits.inc(stats.num_prefix_hit_tokens)
        self.preemptions.inc(stats.num_preempted)
        self.set_load(stats.num_running, stats.num_waiting, stats.kv_usage)
        lens = list(stats.spec_lens.values())
        self.current_spec.set(sum(lens) / len(lens) if lens else 0.0)
        self._count_drafters(stats)
        if stats.num_decode_seqs and not stats.num_prefill_tokens:
            self._count_decode_step(stats)
            if self.policy is not None:
                self._tally_decode_step(stats, max(lens, default=0))
        self.series.on_step(stats, self.drafter.version if self.drafter is not None else None)

    def attach_policy(self, policy: SpeculationPolicy, profile: Profile | None = None) -> None:
        """Export ``policy``'s decisions; with ``profile`` also predicted vs measured speedup."""
        self.policy, self.profile = policy, profile
        self.series.profile = profile
        self.policy_info.labels(policy=policy.name).set(1)

    def _drafter(self, name: str) -> tuple[Counter, ...]:
        """The labelled children of one drafter name, looked up once (not every step)."""
        c = self._drafter_children.get(name)
        if c is None:
            c = self._drafter_children[name] = (
                self.drafter_drafts.labels(drafter=name), self.drafter_draft_tokens.labels(drafter=name),
                self.drafter_accepted.labels(drafter=name))
        return c

    def _choice(self, name: str) -> Counter:
        c = self._choice_children.get(name)
        if c is None:
            c = self._choice_children[name] = self.policy_choices.labels(drafter=name)
        return c

    def _count_drafters(self, stats: StepStats) -> None:
        """Per-drafter drafts, positions, accepted tokens and the policy's choices of one step (the
        engine's only drafter is named "" in its stats: it gets the drafter's own name here)."""
        default = self.series.default_drafter or "drafter"
        for name, outcomes in stats.drafter_outcomes.items():
            drafts, tokens, accepted = self._drafter(name or default)
            drafts.inc(sum(1 for _, depth, _ in outcomes if depth))  # as num_drafts: a draft with tokens
            tokens.inc(sum(depth for _, depth, _ in outcomes))
            accepted.inc(sum(acc for _, _, acc in outcomes))
        for sid, gamma in stats.spec_lens.items():
            name = (stats.seq_drafters.get(sid) or default) if gamma > 0 else "none"
            self._choice(name).inc()

    def _count_decode_step(self, stats: StepStats) -> None:
        key = bucket_of(stats.num_decode_seqs)
        c = self._decode_children.get(key)
        if c is None:  # labelled children looked up once per bucket, not every step
            k = str(key)
            c = self._decode_children[key] = (
                self.decode_steps.labels(bucket=k), self.decode_seqs.labels(bucket=k),
                *(self.decode_seconds.labels(bucket=k, part=part) for part in ("total", "forward", "draft", "other")),
                self.decode_tokens.labels(bucket=k, kind="emitted"),
                self.decode_tokens.labels(bucket=k, kind="drafted"))
        values = (1, stats.num_decode_seqs, stats.total_time, stats.verify_time, stats.draft_time, stats.other_time,
                  stats.num_emitted_tokens, stats.num_draft_tokens)
        for child, value in zip(c, values):
            child.inc(max(0.0, value))

    def _tally_decode_step(self, stats: StepStats, gamma: int) -> None:
        b = stats.num_decode_seqs
        key = bucket_of(b)
        self.policy_gamma.labels(bucket=str(key)).set(gamma)
        self.policy_steps.labels(bucket=str(key), gamma=str(gamma)).inc()
        t = self._tallies.setdefault(key, _BucketTally())
        t.time += stats.total_time
        if self.profile is not None:
            prof = self.profile
            t.plain_time += stats.num_emitted_tokens * prof.verify(b, 1) / b
            t.model_time += prof.verify(b, 1 + stats.num_draft_tokens / b) + (
                prof.d0(None, b) if stats.num_draft_tokens else 0.0)

    def attach_drafter(self, drafter: Drafter) -> None:
        """Export ``drafter.version`` (a ``versioned`` drafter's current version)."""
        self.drafter = drafter

    def attach_vocab(self, vocab: DynamicVocab) -> None:
        """Export the draft vocabulary's counters (read at scrape time) as
        ``draft_vocab_stat{stat}``: size, coverage, verified, covered, oov_events, published (V_t
        swaps), retrievals, retrieval_seconds, build_seconds (the worker's V_t builds), admitted /
        evicted (ARC churn), dropped, errors."""
        self.vocab = vocab
        self.vocab_stat = Gauge(f"{PREFIX}draft_vocab_stat", "The draft vocabulary (EvoSpec): |V_t|, coverage of "
                                "verified tokens, OOV events, swaps, retrievals and their seconds, V_t builds' "
                                "seconds, ARC churn.",
                                ["stat"], registry=self.registry)

    def _refresh_vocab(self) -> None:
        if self.vocab is None or self.vocab_stat is None:
            return
        st, arc = self.vocab.stats, self.vocab.arc.stats
        values = {"size": self.vocab.snapshot.size, "coverage": st.coverage, "verified": st.verified,
                  "covered": st.covered, "oov_events": st.oov_events, "published": st.published,
                  "retrievals": st.retrievals, "retrieval_seconds": st.retrieval_s,
                  "build_seconds": st.build_s, "admitted": arc.admitted,
                  "evicted": arc.evicted, "dropped": st.dropped, "errors": st.errors}
        for name, value in values.items():
            self.vocab_stat.labels(stat=name).set(value)

    def attach_online(self, online: OnlineTraining) -> None:
        """Export the state of ``online``'s trainer child (read at scrape time)."""
        if self.trainer is not None:
            raise ValueError("online training is already attached to these metrics")
        r, p = self.registry, PREFIX
        self.trainer = _TrainerMetrics(
            online,
            Gauge(f"{p}trainer_up", "1 while the online-training child process runs, else 0 (dead and waiting "
                  "for its restart, given up on, or exited).", registry=r),
            Gauge(f"{p}trainer_paused", "1 while the trainer child is paused because serving is busy on the "
                  "CPU it shares (--trainer-share), else 0.", registry=r),
            Counter(f"{p}trainer_deaths", "Exits of the online-training child nobody asked for.", registry=r),
            Counter(f"{p}trainer_restarts", "Restarts of the online-training child after it died.", registry=r))

    def _refresh_policy(self) -> None:
        """Scrape-time gauges: the policy's stats and the per-bucket speedup check."""
        if self.policy is None:
            return
        stats = self.policy.stats()
        for kind in ("explore", "exploit"):
            if f"{kind}_steps" in stats:
                self.policy_decisions.labels(kind=kind).set(stats[f"{kind}_steps"])
        for name, value in stats.items():
            self.policy_stat.labels(stat=name).set(value)
        drafter_speedups = getattr(self.policy, "drafter_speedups", None)  # a controller of several drafters
        if callable(drafter_speedups):
            default = self.series.default_drafter or "drafter"
            for name, value in drafter_speedups().items():
                self.drafter_speedup.labels(drafter=name or default).set(value)
        if self.profile is None:
            return
        for key, t in self._tallies.items():
            if t.time > 0:
                self.policy_measured.labels(bucket=str(key)).set(t.plain_time / t.time)
            if t.model_time > 0:
                self.policy_predicted.labels(bucket=str(key)).set(t.plain_time / t.model_time)

    def set_load(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Gauges of the engine's load (also set when the engine goes idle without a step)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def on_request_finished(self, output: RequestOutput, label: str | None = None) -> None:
        """Record a finished request (any finish reason, aborts included)."""
        s = output.stats
        self.request_success.labels(finish_reason=output.finish_reason or "unknown").inc()
        if s.first_token_time is not None:
            self.ttft.observe(max(0.0, s.first_token_time - s.arrival_time))
            n = len(output.token_ids)
            if s.finish_time is not None and n > 1:
                self.tpot.observe(max(0.0, (s.finish_time - s.first_token_time) / (n - 1)))
        if s.finish_time is not None:
            self.e2e.observe(max(0.0, s.finish_time - s.arrival_time))
        route = self.route(label)
        self.req_drafts.labels(route=route).inc(s.num_drafts)
        self.req_draft_tokens.labels(route=route).inc(s.num_draft_tokens)
        self.req_accepted_tokens.labels(route=route).inc(s.num_accepted_tokens)
        self.req_generation_tokens.labels(route=route).inc(len(output.token_ids))
        self.series.on_request_finished(route, s, len(output.token_ids))

    def on_rejected(self, reason: str) -> None:
        """A request the server refused (``queue_full``, ``invalid``, ``unauthorized``)."""
        self.rejected.labels(reason=reason).inc()

    # ------------------------------------------------------------------ helpers
    def route(self, label: str | None) -> str:
        """The bounded route label for a request label."""
        if not label:
            return DEFAULT_ROUTE
        with self._routes_lock:
            if label in self._routes:
                return label
            if len(self._routes) < self.max_routes:
                self._routes.add(label)
                return label
        return OTHER_ROUTE

    def render(self) -> bytes:
        """The text exposition format of this registry."""
        self._refresh_policy()
        self._refresh_vocab()
        if self.trainer is not None:
            self.trainer.refresh()
        if self.drafter is not None:
            self.drafter_version.set(self.drafter.version)
        return generate_latest(self.registry)
