"""Whether the model drafters may draft at all under per-sequence drafting (``ModelGate``), from paired epochs.

Why this exists: the per-sequence router (``routing.py``) prices a model drafter (EAGLE-3, Medusa, a draft model)
from the start-up profile and eq. 5, and its probes from the same table. What a model drafter really costs beside a
model-free one is what the profile cannot see: the two models evict each other's weights from the caches (a target
forward after an EAGLE-3 step measured ~0.45 ms slower on the 2-core Xeon, EAGLE-3's compiled step 1.1 ms in the
engine against 0.55 ms alone), its taps linger, its probes run whole batches. Measured on chat (w4a8 + compile,
2026-12-06) EAGLE-3's probes and routes cost 3.4 % at batch 1 and 3.8 % at batch 4 against the same router with the
model drafter never asked, and on code_unseen, where EAGLE-3 alone is 1.10x plain, routing it beside suffix still lost
4 %: every per-unit price was right enough, and the sum was a loss.

So the gate measures the sum, the way Nightjar measures a speculation length: by the goodput (tokens per second of
the decode steps) the engine achieves with the model drafters in and with them out. Per batch-size bucket, the steps
run in epochs of ``epoch_steps`` decode steps, each with one arm: *in* (the router and the policy's probes may use
the model drafters) or *out* (only the model-free drafters' offers, or no draft; the model drafters' taps stop).
An epoch's first ``washout`` steps still pay for the arm before (the caches, a drafter's catch-up) and its last
``warm`` steps, before an epoch in, hand the model drafters the target's taps so that epoch starts from a context:
neither is measured (measured, the taps' cost made out look slower than it is and kept EAGLE-3 in on code, where it
lost). Content drifts from one request to the next far more than the arms differ, so arms are compared in pairs
of adjacent epochs: when an epoch ends right after an epoch of the other arm, ``log(g_in / g_out)`` of the two is one
sample of the arms' difference, and the gate keeps an EMA of those samples (``ema``). It alternates arms until it
has ``min_pairs`` samples, then runs the arm the estimate prefers and explores the other for one epoch after
``wait`` epochs; an exploration that leaves the choice as it was doubles ``wait`` (up to ``max_wait``), one that
flips it starts over at 1. An exploration is thus one epoch in 2, 3, 5, ..., ``max_wait + 1``: at ``max_wait`` 8, a
drafter that loses 4 % costs about 0.4 % once the gate has settled, and one that gains is found again within nine
epochs after traffic changes. The defaults (epochs of 16 steps, 2 washed out, 3 warming, 6 pairs, EMA 0.1) settle
a bucket within about 110 steps.

A gate never decides the drafts' content, only which drafters may be asked, so it cannot change an output
(greedy stays bit-identical, sampling keeps the target's distribution: the verification does not know who drafted).

Worked example (``min_pairs`` 3, ``ema`` 0.3): epochs in / out / in / out run at 150, 160, 140, 155 tokens/s.
Samples: log(150/160) = -0.065, log(140/160) = -0.134, log(140/155) = -0.102; EMA -0.065 -> -0.085 -> -0.090:
out. After the alternation the preferred arm has had its one epoch (``wait`` 1), so in is explored at once; it
reads 145 against out's 155 before it, the sample -0.067 keeps the estimate below 0 (-0.083) and out resumes with
``wait`` 2. The epochs: in, out, in, out | in | out, out | in | out x 4 | in | out x 8 | in | ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tidespec.speculative.policy.api import bucket_of, measures_decoding
from tidespec.stats import StepStats


@dataclass
class _Epochs:
    """One bucket's epochs: the arm running, its tally, the paired estimate and the exploration schedule."""

    left: int
    arm: bool = True  # True: the model drafters are in
    tokens: float = 0.0
    seconds: float = 0.0
    last: tuple[bool, float] | None = None  # (arm, goodput) of the last finished epoch
    diff: float = 0.0  # EMA of log(g_in / g_out) over paired epochs
    pairs: int = 0
    since: int = 0  # epochs of the preferred arm since the last exploration
    wait: int = 1  # epochs of the preferred arm before the next exploration
    exploring: bool = False
    epochs: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})


@dataclass
class ModelGate:
    """Model drafters in or out, per bucket, from paired epochs of goodput (module docstring)."""

    epoch_steps: int = 16
    washout: int = 2  # an epoch's first steps: the arm before still shows (caches, taps, a drafter's catch-up)
    warm: int = 3  # its last steps: before an epoch in, the model drafters get the target's taps
    min_pairs: int = 6
    max_wait: int = 8
    ema: float = 0.1
    _buckets: dict[int, _Epochs] = field(default_factory=dict, init=False, repr=False)
    _key: int = field(default=1, init=False)  # the bucket of the last plan

    def __post_init__(self) -> None:
        if self.min_pairs < 1 or self.max_wait < 1 or not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ModelGate needs min_pairs, max_wait >= 1 and ema in (0, 1], got {self.min_pairs}, "
                             f"{self.max_wait}, {self.ema}")
        if min(self.washout, self.warm) < 0 or self.washout + self.warm >= self.epoch_steps:
            raise ValueError(f"ModelGate needs washout, warm >= 0 and washout + warm < epoch_steps (a step measured), "
                             f"got {self.washout}, {self.warm}, {self.epoch_steps}")

    def _state(self, key: int) -> _Epochs:
        state = self._buckets.get(key)
        if state is None:
            state = self._buckets[key] = _Epochs(self.epoch_steps)
        return state

    def allows(self, batch_size: int) -> bool:
        """Whether the model drafters are in at this batch size now (and remember it as the planned bucket)."""
        self._key = bucket_of(batch_size)
        return self._state(self._key).arm

    def keeps_out(self) -> bool:
        """Whether the planned bucket's model drafters are out (their context need not be kept warm)."""
        return not self._state(self._key).arm

    def warming(self) -> bool:
        """Whether the planned bucket's model drafters are out and come in within ``warm`` steps: the engine then
        hands them the target's taps, so the epoch in starts from a context (``AnalyticPolicy.probe_due``)."""
        state = self._state(self._key)
        return not state.arm and state.left <= self.warm and self._transition(state)[0]

    def record(self, step: StepStats) -> None:
        """A decode step's tokens and seconds go to its bucket's epoch, unless it is among the epoch's first
        ``washout`` or last ``warm`` steps (those pay for the arm before or after); a step with prompt tokens (its cost
        is the prompt's) or without a time teaches nothing."""
        if not measures_decoding(step):
            return
        state = self._state(bucket_of(step.num_decode_seqs))
        if self.warm < state.left <= self.epoch_steps - self.washout:
            state.tokens += step.num_emitted_tokens
            state.seconds += step.total_time
        state.left -= 1
        if state.left <= 0:
            self._close(state)

    def _close(self, state: _Epochs) -> None:
        goodput = state.tokens / state.seconds if state.seconds > 0 else 0.0
        state.epochs[state.arm] += 1
        if state.last is not None and state.last[0] != state.arm and goodput > 0 and state.last[1] > 0:
            sample = math.log(goodput / state.last[1]) * (1.0 if state.arm else -1.0)
            state.diff = sample if state.pairs == 0 else (1.0 - self.ema) * state.diff + self.ema * sample
            state.pairs += 1
        state.last = (state.arm, goodput)
        state.arm, state.since, state.wait, state.exploring = self._transition(state)
        state.tokens = state.seconds = 0.0
        state.left = self.epoch_steps

    def _transition(self, state: _Epochs) -> tuple[bool, int, int, bool]:
        """(arm, since, wait, exploring) of the epoch after the current one, as the estimate stands."""
        if state.pairs < self.min_pairs:
            return not state.arm, 0, 1, False  # alternate until the estimate has its pairs
        preferred = state.diff > 0
        if state.exploring:  # an exploration ended: back to (or on with) the preferred arm
            wait = 1 if preferred == state.arm else min(state.wait * 2, self.max_wait)
            return preferred, 0, wait, False
        if state.arm != preferred:  # the estimate flipped in an epoch of the arm it preferred
            return preferred, 0, 1, False
        since = state.since + 1
        if since >= state.wait:
            return not preferred, since, state.wait, True
        return preferred, since, state.wait, False

    def stats(self) -> dict[str, float]:
        """Per bucket: the arm running (1 = in), the paired estimate of log(g_in / g_out), epochs per arm."""
        out: dict[str, float] = {}
        for key, state in sorted(self._buckets.items()):
            out[f"gate_in_b{key}"] = float(state.arm)
            out[f"gate_diff_b{key}"] = state.diff
            out[f"gate_epochs_in_b{key}"] = float(state.epochs[True])
            out[f"gate_epochs_out_b{key}"] = float(state.epochs[False])
        return out
