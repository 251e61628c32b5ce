"""TIDE's analytic speculation policy (``AnalyticPolicy``): the best eq.-5 (drafter, gamma) at this batch size.

Why this exists: TIDE eq. 5 on a profiled T(b, q) and each drafter's D0, with alpha estimated
online per drafter and batch-size bucket (``tracking.AlphaTracker``), predicts the speedup of every
(drafter, gamma); this policy picks the best, plain decoding if none beats 1.0, and probes the
choices it does not run at a bounded cost so it never deadlocks (worked examples in the class
docstring). With one drafter it is TIDE's adaptive gamma; with several (``MultiDrafter``) it is
the one controller that chooses drafter and gamma from one statistics source.
"""

from __future__ import annotations

from tidespec.speculative.policy.api import PlanInput, bucket_of, check_gamma_max
from tidespec.speculative.policy.gate import ModelGate
from tidespec.speculative.policy.probes import ProbeMeter
from tidespec.speculative.policy.routing import RouteMeter, SequenceRouter
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.tracking import CHANGED_WEIGHT, DrafterTrackers, predicted_speedups
from tidespec.stats import StepStats


def _argmax(speedups: list[float], start: int) -> int:
    """Index >= ``start`` of the highest speedup, ties to the smaller index (shorter gamma)."""
    return max(range(start, len(speedups)), key=lambda g: (speedups[g], -g))


class AnalyticPolicy:
    """TIDE's adaptive drafter: the best eq.-5 (drafter, gamma) at this batch size and the bucket's
    estimates of each drafter.

    It starts from ``prior_alpha`` (optimistic by default so it speculates and measures), then
    follows each drafter's bucket estimates (``AlphaTracker``: alpha and the drafter's
    continuation rho), learnt from the steps it drafted in (``StepStats.drafter_outcomes``) and,
    for model-free drafters that a ``MultiDrafter`` scores on the side, from those shadow drafts
    (``StepStats.shadow_outcomes``, every step, whoever drafts).

    Probing. A choice the policy does not run is never measured again (the "decision deadlock"
    Nightjar points out; with every bucket off it stays off for good), so it probes: one step of
    the best (drafter, gamma >= 1) among the drafters that are neither running nor shadow-scored,
    which refreshes that drafter's estimates (our addition to TIDE). A probe is predicted to cost
    ``s_run - s_probe`` of a step (s_run = 1 when off), so the policy saves ``probe_budget`` of a
    step per step without a probe and probes once the savings cover that cost — and at the latest
    after ``probe_every`` steps (0 disables probing). Near break-even (s = 0.95 while off) it
    probes every 3rd step, so a noisy dip of the estimate below the threshold is corrected within a
    few steps; where a probe is hopeless (s = 0.3) every 35th step, spending about
    ``probe_budget`` of the time either way. A probe whose drafter could not draft (a cold
    feature drafter after steps without taps, ``StepStats.num_cold_drafts``) is repeated on the
    next step; a cold draft in a step that was not a probe (the per-sequence router sent a sequence
    to a drafter that had lost its context) is not. Measured on sql_help at batch 1 (w4a8 + compile),
    this and pricing a probe at the drafter's measured speed (``_probe_speedup``) together took EAGLE-3
    probes from 54 to 27 of about 660 steps.

    Probes that spend the budget they say (batch-level choices: one drafter, or one for the whole batch).
    EAGLE-3 alone on Arabic at batch 4, where eq. 5 rightly said off, ran at 0.93x plain: probes on 13 % of
    the steps, half of them cold. So (``probes.py``) a probe is priced at the lower of eq. 5 and what the
    drafter's probes realised (``ProbeMeter``); each probe after which the policy still does what it did
    before doubles the next one's price (up to ``probe_every``), and one that switches it to the probed
    drafter starts over; and the ``warm_steps`` steps before a probe hand its drafter the target's taps
    (``probe_due``), so it drafts from a context instead of coming back cold. Under per-sequence drafting
    the probes stay as they were: they are what keeps the router's model-drafter price and offers from
    settling on none (backed off, chat at batch 4 decoded 91 % of its sequence-steps without a draft, 0.93x
    plain). With ``gate`` (``gate.py``), per-sequence drafting asks the model drafters, routes and probes alike,
    only in the epochs where the measured goodput says they pay beside the model-free ones; the steps it keeps them
    out neither probe nor count towards a probe, and do not reset the count either: reset by every epoch out, the
    count never reached ``probe_every`` within the 16 steps of an epoch in, so a model drafter priced below none was
    never probed again, not even after a swap brought a better head in (Chinese under the per-sequence hybrid: EAGLE-3's
    alpha stayed at 0.14 from the 24th Chinese request to the 48th, through a swap to a head that walked 1.54 on
    held-out rows against its predecessor's 1.33, 2026-12-07).

    Depth probes (``_deepen``): a batch-level choice at a gamma below ``gamma_max`` asks for ``gamma_max`` now and
    then, at the same budget and backoff, so the deeper positions' estimates are measured again.

    Worked example of the backoff (alpha 0, a probe costs 0.048 as below): probes at steps 3, 8, 18, ...
    (0.048, then 0.096, then 0.19 of savings).

    Worked example, one drafter (probe_budget 0.02, probe_every 64; the model says off with the best
    gamma 1 predicted at s = 0.952, so a probe costs 0.048): gammas 0, 0, 1, 0, 0, 1, ... (savings
    0.02, 0.04, 0.06 >= 0.048 -> probe, start over). At s = 0.2: 0 x 39, then 1 (cost 0.8 = 40 x 0.02).

    Worked example, two drafters (suffix shadow-scored, eagle3 not): suffix at gamma 3 predicts
    1.30, eagle3 at gamma 2 1.10 -> ("suffix", 3), and every 10th step ("eagle3", 2) (cost 0.20 =
    10 x 0.02) until eagle3's estimates say it beats the suffix drafter.
    """

    def __init__(self, profile: Profile, gamma_max: int, ema: float = 0.1, prior_alpha: float = 0.7,
                 drafter: str | None = None, probe_every: int = 64, probe_budget: float = 0.02,
                 drafters: tuple[str, ...] = (), shadowed: frozenset[str] = frozenset(),
                 per_sequence: bool = False, measured_routes: bool = False, warm_steps: int = 8,
                 gate: bool = False) -> None:
        check_gamma_max(gamma_max)
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {probe_every}")
        if warm_steps < 0:
            raise ValueError(f"warm_steps must be >= 0, got {warm_steps}")
        if not 0.0 <= probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in [0, 1], got {probe_budget}")
        if drafter is not None and drafters:
            raise ValueError("give either drafter (one) or drafters (several), not both")
        if len(set(drafters)) != len(drafters):
            raise ValueError(f"drafter names must differ, got {drafters}")
        self.name = "analytic"
        self.probe_every = probe_every
        self.warm_steps = warm_steps  # steps before a probe in which its drafter gets the target's taps
        self.probe_budget = probe_budget
        self.num_probes = 0
        self._off_steps: dict[int, int] = {}  # bucket -> steps since its last probe
        self._reprobe: dict[int, bool] = {}  # bucket -> its last probe came back cold: probe again
        self._probed: dict[int, bool] = {}  # bucket -> whether its last plan was a probe
        self.probes = ProbeMeter(profile)  # what probes realise, against this engine's plain steps
        self._due: tuple[str | None, ...] = ()  # (the drafter the next plan will probe,) if the savings hold
        self._backoff: dict[int, int] = {}  # bucket -> 2^(probes in a row that left the choice as it was)
        self._model_prices: dict[str, float] = {}  # model drafter -> its measured price at the last routed plan
        self.num_depth_probes = 0
        self._deep_steps: dict[int, int] = {}  # bucket -> steps since its last depth probe
        self._deep_backoff: dict[int, int] = {}  # bucket -> 2^(depth probes in a row that left gamma as it was)
        self._deepened: dict[int, int] = {}  # bucket -> the gamma its last plan deepened to gamma_max (a depth probe)
        self.profile = profile
        self.gamma_max = gamma_max
        self.drafter = drafter
        self.drafters: tuple[str | None, ...] = drafters or (drafter,)
        self.shadowed = frozenset(shadowed)
        self.trackers = DrafterTrackers(self.drafters, prior_alpha, ema)
        self.alphas = self.trackers[self.drafters[0]]  # the (first) drafter's estimates
        self._chosen: dict[int, tuple[str | None, int]] = {}
        self._speedup: dict[int, float] = {}
        self._drafter_speedup: dict[str, float] = {}  # drafter -> predicted speedup at its best gamma, last plan
        # (drafter, batch size) -> (its tracker's revision, ``predicted``'s table then)
        self._tables: dict[tuple[str | None, int], tuple[int, list[float]]] = {}
        self.last_predicted_speedup = 1.0  # of the last plan (1.0 = off): read per step, keep it a field
        # per-sequence drafting (``routing.py``): with several drafters, a model-free one among them
        meter = RouteMeter(profile, ema) if measured_routes else None
        self.router = (SequenceRouter(profile, ema, meter) if per_sequence and len(drafters) > 1 and shadowed
                       else None)
        self.route_counts: dict[str, int] = {}  # drafter ("none") -> sequence-steps routed (or probed) to it
        self.mixed_steps = 0  # routed steps whose sequences went to more than one route ("none" is one)
        self.gate = ModelGate() if gate and self.router is not None else None  # model drafters in or out

    @property
    def wants_offers(self) -> bool:
        """Whether the engine should ask the model-free drafters for their drafts before planning
        (``SeqState.offers``): per-sequence drafting is on."""
        return self.router is not None

    @property
    def multi(self) -> bool:
        return len(self.drafters) > 1

    def predicted(self, batch_size: int, drafter: str | None = None) -> list[float]:
        """Eq.-5 speedup of every gamma 0..gamma_max at this batch size for ``drafter`` (the first
        when None), from its own estimates (``predicted_speedups``)."""
        name = drafter if drafter is not None else self.drafters[0]
        tracker = self.trackers[name]
        cached = self._tables.get((name, batch_size))
        if cached is not None and cached[0] == tracker.revision:
            return list(cached[1])  # every step plans, few steps change a drafter's estimates: ~0.1 ms a step
        table = predicted_speedups(tracker, batch_size, self.profile, self.gamma_max, name)
        self._tables[name, batch_size] = (tracker.revision, table)
        return table

    def decide(self, batch_size: int) -> tuple[int, float]:
        """(gamma, predicted speedup) of the first drafter at this batch size now: the best gamma, 0
        if none beats 1.0 (ties to the shorter gamma, as ``speedup.best_gamma``)."""
        s = self.predicted(batch_size)
        gamma = _argmax(s, 0)
        return gamma, s[gamma]

    def plan(self, inp: PlanInput) -> dict[int, int]:
        return {sid: gamma for sid, (_, gamma) in self.plan_drafters(inp).items()}

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        if not inp.seqs:
            return {}
        table = {d: self.predicted(inp.batch_size, d) for d in self.drafters}
        best = {d: _argmax(s, 1) for d, s in table.items()}  # each drafter's best gamma >= 1
        self._drafter_speedup = {d or "": table[d][best[d]] for d in self.drafters}
        drafter = max(self.drafters, key=lambda d: (table[d][best[d]], -best[d], -self.drafters.index(d)))
        gamma = best[drafter] if table[drafter][best[drafter]] > 1.0 else 0
        speedup = table[drafter][gamma]
        key = bucket_of(inp.batch_size)
        probed = False
        gated = self.gate is not None and not self.gate.allows(inp.batch_size)  # model drafters out: no probe
        unseen = [d for d in self.drafters if d not in self.shadowed and (gamma == 0 or d != drafter) and not gated]
        self._due = ()
        if self._probed.get(key, False) and self.router is None:  # the step after a probe: did it change the choice?
            last = self._chosen[key][0]
            self._backoff[key] = self._backed_off(self._backoff.get(key, 1), gamma > 0 and drafter == last)
        if self.probe_every and unseen:
            off = self._off_steps.get(key, 0) + 1
            probe = max(unseen, key=lambda d: (table[d][best[d]], -self.drafters.index(d)))
            cost = (speedup - self._probe_speedup(inp.batch_size, probe, table, best)) * self._backoff.get(key, 1)
            if self._reprobe.pop(key, False) or self._affordable(off, cost):
                drafter, gamma, off = probe, best[probe], 0
                self.num_probes += 1
                probed = True
            elif self.router is None and self._affordable(off + self.warm_steps, cost):
                self._due = (probe,)  # a plan within ``warm_steps`` probes it (unless the estimates move)
            self._off_steps[key] = off
        elif not gated:
            self._off_steps[key] = 0
        if self.router is None:
            gamma = self._deepen(key, gamma, probed, table[drafter])
        self._probed[key] = probed
        self._chosen[key] = (drafter, gamma)
        self._speedup[key] = speedup
        self.last_predicted_speedup = speedup
        default = inp.drafters[0] if inp.drafters else ""
        if self.router is not None:
            self.router.start_step()
            if not probed:
                return self._route(inp, table, best, default, gated)
            self.router.planned(drafter or "", table[drafter][gamma], len(inp.seqs))
            probed_route = drafter or "none"  # a probe's sequence-steps count as routed to what drafted them
            self.route_counts[probed_route] = self.route_counts.get(probed_route, 0) + len(inp.seqs)
        name = drafter if drafter is not None and gamma > 0 else default
        return {s.seq_id: (name or "", gamma) for s in inp.seqs}

    def _deepen(self, key: int, gamma: int, probed: bool, speedups: list[float]) -> int:
        """The gamma to run: ``gamma``, or ``gamma_max`` for a depth probe. The tracker learns what the
        positions past ``gamma`` deliver only from steps that ask for them, and a drafter kept at a short gamma
        keeps whatever those positions said when it was last asked for them (EAGLE-3 alone on code sat at
        gamma 1 on a second position measured during one chat-like request). So a drafted step may ask for
        ``gamma_max`` instead, priced like a drafter probe: ``s(gamma) - s(gamma_max)`` of a step, paid from
        ``probe_budget`` per step (at the latest after ``probe_every`` steps), the price doubling after each
        depth probe that left the choice as it was (up to ``probe_every``) and starting over after one that
        deepened it. Example (budget 0.02): s(1) = 1.39 against s(4) = 1.33 costs 0.06: a depth probe every
        3rd step, then every 6th, 12th, ... while gamma 1 stays the best."""
        last = self._deepened.pop(key, None)
        if last is not None:  # the plan after a depth probe: did it deepen the choice?
            self._deep_backoff[key] = self._backed_off(self._deep_backoff.get(key, 1), gamma > last)
        if probed or gamma < 1 or gamma >= self.gamma_max or not self.probe_every:
            self._deep_steps[key] = 0
            return gamma
        steps = self._deep_steps.get(key, 0) + 1
        cost = (speedups[gamma] - speedups[self.gamma_max]) * self._deep_backoff.get(key, 1)
        if self._affordable(steps, cost):
            self._deep_steps[key] = 0
            self._deepened[key] = gamma
            self.num_depth_probes += 1
            return self.gamma_max
        self._deep_steps[key] = steps
        return gamma

    def _affordable(self, steps: int, cost: float) -> bool:
        """Whether a probe priced ``cost`` of a step runs after ``steps`` steps without one: the savings of
        ``probe_budget`` a step cover it, or ``probe_every`` steps have passed (drafter and depth probes alike)."""
        return steps >= self.probe_every or steps * self.probe_budget >= cost

    def _backed_off(self, backoff: int, changed: bool) -> int:
        """A probe's price multiplier after a probe: 1 when it changed the choice, else doubled (up to
        ``probe_every``)."""
        return 1 if changed else min(backoff * 2, self.probe_every or 1)

    def probe_due(self, drafter: str) -> bool:
        """Whether one of the next ``warm_steps`` plans will probe ``drafter`` (as the last plan's savings
        stand): the engine then hands it the target's taps, so the probe finds it with a context of those
        steps. Without them a tap-reading drafter is cold at the probe (no draft, and a second probe next
        step) or, a step later, drafts from a context of one position, which measured it at 0.18 accepted
        tokens a probe where it accepts 0.48 drafting every step (EAGLE-3 alone, chat, batch 1)."""
        if self.gate is not None and drafter not in self.shadowed and self.gate.warming():
            return True  # the gate lets the model drafters in within a few steps
        return bool(self._due) and self._due[0] in (drafter, None)  # None: the engine's only drafter

    def priced_out(self, drafter: str) -> bool:
        """Whether the per-sequence router, measuring routes, priced ``drafter`` below no draft at the last
        plan (``routing.RouteMeter``): it gets no sequence until its estimates change or a probe runs, so
        keeping its context warm (the engine's lingering taps) buys nothing. So does a gate that has the model
        drafters out (``gate.ModelGate``)."""
        if self.gate is not None and drafter not in self.shadowed and self.gate.keeps_out():
            return True
        if self.router is None or self.router.meter is None:
            return False
        return self._model_prices.get(drafter, 1.0) < 1.0

    def _probe_speedup(self, batch_size: int, probe: str | None, table: dict[str | None, list[float]],
                       best: dict[str | None, int]) -> float:
        """What a probe of ``probe`` is priced at: its table's best, times its measured route speed when
        per-sequence drafting measures routes (``routing.RouteMeter``: a drafter whose steps were measured
        slower than the profile says is probed less often, at the same budget)."""
        speedup = table[probe][best[probe]]
        if self.router is not None and self.router.meter is not None and probe is not None:
            speedup *= self.router.meter.factor(batch_size, probe)
        measured = self.probes.speedup(probe, batch_size) if self.router is None else None
        return speedup if measured is None else min(speedup, measured)

    def _route(self, inp: PlanInput, table: dict[str | None, list[float]], best: dict[str | None, int],
               default: str, gated: bool = False) -> dict[int, tuple[str, int]]:
        """Per-sequence choices (``routing.SequenceRouter``): the model drafters priced from this
        batch size's table (none while ``gated``), each sequence's offers from the model-free drafters' own drafts."""
        assert self.router is not None
        models = {d: (best[d], table[d][best[d]]) for d in self.drafters
                  if d is not None and d not in self.shadowed and not gated}
        if self.router.meter is not None:
            self._model_prices = {d: price * self.router.meter.factor(inp.batch_size, d)
                                  for d, (_, price) in models.items()}
        out: dict[int, tuple[str, int]] = {}
        routes: set[str | None] = set()
        for s in inp.seqs:
            name, gamma = self.router.choose(inp.batch_size, models, s.offers, s.seq_id)
            self.route_counts[name or "none"] = self.route_counts.get(name or "none", 0) + 1
            out[s.seq_id] = (name or default, gamma)
            routes.add(name)
        self.mixed_steps += len(routes) > 1
        return out

    def observe(self, step: StepStats) -> None:
        if step.num_decode_seqs < 1:
            return
        key = bucket_of(step.num_decode_seqs)
        probed = self._probed.get(key, False)
        if step.num_cold_drafts and probed:  # a probe that drafted nothing: again
            self._reprobe[key] = True
        if self.router is None:  # per-sequence drafting keeps eq. 5's probe prices (class docstring)
            self.probes.record(step, self._chosen[key][0] if key in self._chosen else None, probed)
        self.trackers.update(key, step)
        if self.router is not None:
            self.router.observe(step.seq_accepted)
            self.router.measure(step)
        if self.gate is not None:
            self.gate.record(step)

    def drafter_changed(self, drafter: str) -> None:
        """``drafter`` now drafts with other weights (online training swapped a head in, or rolled one back):
        what the policy measured of the old weights stops holding it off. Its estimates keep their values but
        at most ``CHANGED_WEIGHT`` counts behind them (``AlphaTracker.discount``), its probes' realised
        speedups are forgotten (``ProbeMeter.forget``), the probe backoff starts over and a probe is due in
        every bucket ``warm_steps`` plans ahead (the engine hands the drafter the target's taps meanwhile).
        Why: a parked EAGLE-3 head published with a better held-out acceptance (Chinese, 1.02 -> 1.29) was
        probed at the backed-off rate of the old one and stayed parked for the rest of the phase
        (docs/benchmarks/learning.md, 2026-12-07). Example: alpha 0.2 on 300 counts, probes backed off to
        every 64 steps -> alpha 0.2 on 2 counts, a probe 8 plans on; if it accepts 3 of 4 the estimate is
        (0.4 + 3) / (2 + 4) = 0.57."""
        name: str | None = drafter if drafter in self.drafters else None
        if (name is None and self.drafters != (None,)) or name in self.shadowed:
            return  # not one of this policy's, or model-free (scored on the side every step)
        self.trackers[name].discount(CHANGED_WEIGHT)
        self.probes.forget(name)
        self._backoff = dict.fromkeys(self._backoff, 1)
        if self.probe_every:
            due = max(0, self.probe_every - self.warm_steps)
            self._off_steps = {key: max(off, due) for key, off in self._off_steps.items()}

    def choices(self) -> dict[int, tuple[str, int]]:
        """Bucket -> the (drafter, gamma) last chosen there (drafter "" = the engine's only one)."""
        return {key: (d or "", g) for key, (d, g) in sorted(self._chosen.items())}

    def drafter_speedups(self) -> dict[str, float]:
        """Drafter -> the speedup over plain decoding predicted for it at its best gamma (>= 1) at
        the last planned batch size ("" names the only drafter of a single-drafter policy)."""
        return dict(self._drafter_speedup)

    def stats(self) -> dict[str, float]:
        out = {"predicted_speedup": self.last_predicted_speedup, "alpha": self.alphas.global_alpha,
               "rho": self.alphas.overall.rho(), "probe_steps": float(self.num_probes),
               "depth_probe_steps": float(self.num_depth_probes)}
        for key in sorted(self._chosen):
            drafter, gamma = self._chosen[key]
            out[f"gamma_b{key}"] = float(gamma)
            out[f"speedup_b{key}"] = self._speedup[key]
            out[f"alpha_b{key}"] = self.alphas.alpha(key)
            out[f"rho_b{key}"] = self.alphas.rho(key)
            if self.multi:
                out[f"drafter_b{key}"] = float(self.drafters.index(drafter))
        out.update(self.probes.measured())
        for d, count in self.route_counts.items():
            out[f"routed_{d}"] = float(count)
        if self.router is not None:
            out["mixed_steps"] = float(self.mixed_steps)
        if self.gate is not None:
            out.update(self.gate.stats())
        if self.router is not None:
            for (d, band), calibration in sorted(self.router.calibration.items()):
                out[f"calibration_{d}_{band}"] = calibration
            if self.router.meter is not None:
                for (key, route), g in self.router.meter.measured().items():
                    out[f"route_speed_{route}_b{key}"] = g
        if self.multi:
            for d, tracker in self.trackers.trackers.items():
                out[f"alpha_{d}"] = tracker.global_alpha
                out[f"rho_{d}"] = tracker.overall.rho()
        return out
