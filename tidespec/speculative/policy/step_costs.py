"""What a speculating step really costs against a plain one, measured while serving (``StepCosts``).

Why this exists: the analytic policy prices a speculating step from the start-up profile, ``T(b, q)``
of the target forward and ``D0`` of each drafter (TIDE eq. 5). A step is more than that forward:
scheduling, the drafters' offers and shadow drafts, verification per sequence, commits, emitting the
tokens. Plain steps pay part of it too, but a speculating step pays more, and how much more depends
on the machine, the path and the batch size: measured on a 2-core EPYC at batch 4 the suffix drafter
alone ran at 0.88x plain while eq. 5 predicted a gain, and the controller chose it on 80 % of the
sequence-steps (docs/benchmarks/policies.md). Nightjar avoids this by rewarding measured throughput;
here the model keeps its shape and the measurements correct its scale.

Per batch-size bucket it keeps two geometric EMAs of measured over predicted step time: ``plain``
(steps where nobody drafted: measured / ``T(b, 1)``) and ``spec`` (measured / ``T(b, 1 + drafted / b)
+ sum of D0 x gamma of each drafter that drafted``), from decode-only steps (a prefill chunk changes
the step's cost and is left out). ``factor(b) = spec / plain`` is how much dearer a speculating step is
than the profile says, relative to a plain one; a predicted speedup ``s`` becomes ``s / factor``.
Until both are measured the factor is 1.0 (the profile alone). A policy that speculates all the time
never measures ``plain``, so ``wants_plain`` asks for a plain step when the bucket has fewer than
``min_plain`` samples or ``plain_every`` speculating steps have run since its last one (about 1 % of
the steps at the default, at the price of one step's speedup each).

Worked example (b = 4, T(4, 1) = 13.6 ms, T(4, 1.5) = 15.5 ms, suffix D0 0.2 ms, gamma 3): a plain
step measured at 15.0 ms gives plain = 15.0 / 13.6 = 1.10; a suffix step drafting 2 tokens in all
(1.5 tokens a sequence verified) measured at 21.0 ms gives spec = 21.0 / (15.5 + 0.6) = 1.30; factor
1.30 / 1.10 = 1.18: a choice predicted at 1.10x is worth 0.93x, so the policy decodes plain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tidespec.speculative.policy.api import bucket_of
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

RATIO_RANGE = (1 / 3, 3.0)  # one sample's measured / predicted kept in this range (a GC pause, a compile)
FACTOR_RANGE = (0.5, 3.0)


@dataclass
class StepCosts:
    """Measured / predicted step time per bucket, for plain and for speculating steps (module docstring)."""

    profile: Profile
    ema: float = 0.1
    min_plain: int = 3  # plain samples a bucket needs before its factor is trusted
    plain_every: int = 128  # speculating steps after which a bucket measures a plain step again (0: never)
    _plain: dict[int, float] = field(default_factory=dict)  # bucket -> EMA of log(measured / predicted)
    _spec: dict[int, float] = field(default_factory=dict)
    _plain_samples: dict[int, int] = field(default_factory=dict)
    _since_plain: dict[int, int] = field(default_factory=dict)  # bucket -> speculating steps since a plain one

    def predicted(self, step: StepStats) -> float:
        """The profile's seconds for ``step``: the forward over its decode rows plus each drafter's D0
        times the longest gamma it drafted for (the drafters' own work is one call per step)."""
        b = step.num_decode_seqs
        seconds = self.profile.verify(b, 1.0 + step.num_draft_tokens / b)
        longest: dict[str, int] = {}
        for sid, name in step.seq_drafters.items():
            longest[name] = max(longest.get(name, 0), step.spec_lens.get(sid, 0))
        return seconds + sum(self.profile.d0(name) * gamma for name, gamma in longest.items())

    def observe(self, step: StepStats) -> None:
        """Learn from a decode-only step (others are ignored)."""
        b = step.num_decode_seqs
        if b < 1 or step.num_prefill_tokens or step.batch_size != b or step.total_time <= 0:
            return
        key = bucket_of(b)
        lo, hi = RATIO_RANGE
        ratio = math.log(min(hi, max(lo, step.total_time / self.predicted(step))))
        drafted = bool(step.seq_drafters)  # asked to draft (its drafter's work paid even if it found nothing)
        table = self._spec if drafted else self._plain
        table[key] = ratio if key not in table else (1.0 - self.ema) * table[key] + self.ema * ratio
        if drafted:
            self._since_plain[key] = self._since_plain.get(key, 0) + 1
        else:
            self._plain_samples[key] = self._plain_samples.get(key, 0) + 1
            self._since_plain[key] = 0

    def factor(self, batch_size: int) -> float:
        """How much dearer than the profile a speculating step is, relative to a plain one (1.0 until
        both are measured at this bucket)."""
        key = bucket_of(batch_size)
        if key not in self._spec or self._plain_samples.get(key, 0) < self.min_plain:
            return 1.0
        lo, hi = FACTOR_RANGE
        return min(hi, max(lo, math.exp(self._spec[key] - self._plain[key])))

    def wants_plain(self, batch_size: int) -> bool:
        """Whether this bucket should run a plain step now to measure one (see the module docstring)."""
        key = bucket_of(batch_size)
        if key not in self._spec:
            return False
        if self._plain_samples.get(key, 0) < self.min_plain:
            return True
        return bool(self.plain_every) and self._since_plain.get(key, 0) >= self.plain_every

    def stats(self) -> dict[str, float]:
        """``cost_factor_b{bucket}`` for every bucket with a speculating step measured."""
        return {f"cost_factor_b{key}": self.factor(key) for key in sorted(self._spec)}
