"""What the analytic policy's probes really cost (``ProbeMeter``), so a probe budget spends what it says.

Why this exists: a policy that decides not to speculate still probes now and then (a choice never run is
never measured again: ``analytic.AnalyticPolicy``), and it budgets them from eq. 5: a probe of a drafter
predicted at s is priced ``1 - s`` of a step. A model drafter's probe costs far more than that: the drafter
catches up on every token it missed while the policy was off, half the probes find it cold (it lost its
context in a step without the target's taps: no draft, and a second probe next step), and the step's
bookkeeping runs around it. Measured on the compiled w4a8 path (SmolLM2-135M, EAGLE-3 alone under the
analytic policy, 16 Arabic requests, batch 4, 2026-12-06): eq. 5 said s = 0.80 (a probe 0.2 of a step), the
31 probe steps took 13.6 ms against 9.3 ms for a plain step and gave 4.13 tokens for 4 (s = 0.71 at best,
0.6 with the cold ones); probes ran every 7.5 steps, and the policy that had decided to decode plainly ran
at 0.93x plain.

So the meter keeps, per (drafter, batch-size bucket), an EMA of each probe step's realised speedup: its
tokens per sequence over its time in plain steps, a plain step's time being an EMA of this engine's steps
where nobody drafted, relative to the profile's T(b, 1) (the profile's price until ``min_steps`` were
measured). After ``min_probes`` probes the policy prices its next probe of that drafter at the lower of
eq. 5 and the measured speedup.

Worked example (T(4, 1) = 9 ms in the profile; plain steps measured at 9.3 ms, so the ratio 1.033): a probe
step of 4 sequences emitting 4.13 tokens in 13.6 ms realises (4.13 / 4) / (13.6 / 9.3) = 0.706. With eq. 5
saying 0.80, the probe is priced 0.706: a probe every 15 steps at a budget of 0.02, not every 10.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidespec.speculative.policy.api import bucket_of, measures_decoding
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats


@dataclass
class ProbeMeter:
    """Realised speedups of probe steps per (drafter, bucket), against plain steps measured in the same engine."""

    profile: Profile
    ema: float = 0.2
    min_probes: int = 3
    min_steps: int = 8
    _plain: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [EMA seconds / T(b, 1), steps]
    _probes: dict[tuple[str | None, int], list[float]] = field(default_factory=dict)  # -> [EMA speedup, probes]

    def plain_seconds(self, batch_size: int) -> float:
        """A step without drafts at this batch size: the profile's T(b, 1) times the measured ratio."""
        t1 = self.profile.verify(batch_size, 1)
        m = self._plain.get(bucket_of(batch_size))
        return t1 * m[0] if m is not None and m[1] >= self.min_steps else t1

    def speedup(self, drafter: str | None, batch_size: int) -> float | None:
        """The measured speedup of this drafter's probes at this bucket, None until ``min_probes``."""
        m = self._probes.get((drafter, bucket_of(batch_size)))
        return m[0] if m is not None and m[1] >= self.min_probes else None

    def record(self, step: StepStats, probe: str | None, probed: bool) -> None:
        """One decode step (one with a prompt chunk teaches nothing): a probe of ``probe`` when
        ``probed``, else, when nobody drafted in it, a plain step."""
        if not measures_decoding(step):
            return
        b = step.num_decode_seqs
        if probed:
            speedup = (step.num_emitted_tokens / b) / (step.total_time / self.plain_seconds(b))
            _fold(self._probes, (probe, bucket_of(b)), speedup, self.ema)
        elif step.num_drafts == 0 and step.num_cold_drafts == 0:
            _fold(self._plain, bucket_of(b), step.total_time / self.profile.verify(b, 1), self.ema)

    def forget(self, drafter: str | None) -> None:
        """Drop what ``drafter``'s probes realised (its weights changed: they measured another head)."""
        self._probes = {k: m for k, m in self._probes.items() if k[0] != drafter}

    def measured(self) -> dict[str, float]:
        """``probe_speedup_<drafter>_b<bucket>`` for every measured pair (``stats``)."""
        return {f"probe_speedup_{d or 'default'}_b{key}": m[0] for (d, key), m in sorted(
            self._probes.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])) if m[1] >= self.min_probes}


def _fold(table: dict, key: object, value: float, ema: float) -> None:
    m = table.setdefault(key, [value, 0.0])
    if m[1] > 0:
        m[0] = (1.0 - ema) * m[0] + ema * value
    m[1] += 1
