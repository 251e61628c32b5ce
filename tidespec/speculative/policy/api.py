"""Contracts of the speculation policies: ``SeqState``, ``PlanInput``, the ``SpeculationPolicy``
protocol and the batch-size buckets (``bucket_of``).

Why this exists: the engine asks one question per step (``plan``) and reports what happened
(``observe``, with the step's ``tidespec.stats.StepStats``, the record the metrics read too);
which controller answers is a configuration choice, so the engine, the server metrics and every
controller share these types and nothing else. Four controllers implement
``SpeculationPolicy``:

- ``StaticPolicy`` (``static``): a fixed gamma (the classic engine).
- ``AnalyticPolicy`` (``analytic``): TIDE eq. 5 on a profiled T(n)/D0 with alpha estimated
  online per batch-size bucket; picks the gamma with the best predicted speedup, 0 if none
  beats 1.0.
- ``BanditPolicy`` (``bandit_policies``): Nightjar's per-batch-size bandit rewarded by goodput
  (tokens/s).
- ``HybridPolicy`` (``bandit_policies``, ours): the bandit with the analytic model as its prior
  (see its docstring).

``Guards`` (``guards``) wraps any of them with the operational rules of the field guide (paper
004); ``make_policy`` (``factory``) builds one by name.

With several drafters loaded (``speculative.drafters.multi``) a ``DrafterPolicy`` (the analytic
policy) answers ``plan_drafters`` instead: a (drafter, gamma) per sequence; the outcomes per drafter
arrive in ``StepStats.drafter_outcomes`` (and, scored on the side, ``shadow_outcomes``).

Feedback convention: ``StepStats.gamma`` is the arm that ran, i.e. the largest per-sequence
gamma of the step (0 when nothing was drafted); the batch size a policy files the step under is
``StepStats.num_decode_seqs`` (the decode sequences it planned for, as ``PlanInput.batch_size``;
``StepStats.batch_size`` counts prefilling sequences too); which steps the bandits credit to the
arm is told in ``bandit_policies``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeGuard, runtime_checkable

from tidespec.stats import StepStats


@dataclass
class SeqState:
    """What a policy may know about one running sequence."""

    seq_id: int
    temperature: float
    remaining_tokens: int  # output tokens this sequence may still emit (max_tokens - emitted)
    override: int | None = None  # per-request gamma from the API: 0 = opt out, None = policy decides
    # model-free drafter -> (tokens it expects accepted, draft length) of its draft for this sequence now,
    # filled by the engine for a policy that ``wants_offers`` (per-sequence drafting: ``routing.py``)
    offers: dict[str, tuple[float, int]] = field(default_factory=dict)


@dataclass
class PlanInput:
    batch_size: int  # running decode sequences this step
    kv_usage: float  # fraction of KV slots/blocks in use, [0, 1]
    seqs: list[SeqState]
    drafters: tuple[str, ...] = ()  # the drafters loaded, the engine's default first (() = unknown)


@runtime_checkable
class SpeculationPolicy(Protocol):
    name: str

    def plan(self, inp: PlanInput) -> dict[int, int]:
        """seq_id -> gamma (0 = plain decode) for every sequence in ``inp.seqs``."""
        ...

    def observe(self, step: StepStats) -> None:
        """Learn from the step that ran (the engine's record of it)."""
        ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class DrafterPolicy(SpeculationPolicy, Protocol):
    """A policy that also chooses *which* drafter drafts (several loaded: ``PlanInput.drafters``)."""

    def plan_drafters(self, inp: PlanInput) -> dict[int, tuple[str, int]]:
        """seq_id -> (drafter name, gamma) for every sequence in ``inp.seqs`` (gamma 0 = plain decode)."""
        ...


def plans_drafters(policy: SpeculationPolicy) -> TypeGuard[DrafterPolicy]:
    """Whether ``policy`` also picks the drafter (a ``DrafterPolicy``). The check the runtime protocol
    makes, on the one member that tells them apart, without its cost: ``isinstance`` against a
    runtime-checkable protocol walks every member of it, ~13 us a call on Python 3.11, and the
    step asks twice (engine and guards) — a tenth of a GPU decode step's host time."""
    return callable(getattr(policy, "plan_drafters", None))


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket (rounding up): 1 -> 1, 2 -> 2, 3 -> 4, 5 -> 8, 33 -> 64."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def measures_decoding(step: StepStats) -> bool:
    """Whether ``step`` times decoding alone: decode sequences, no prompt tokens (their cost is the prompt's) and a
    time. What the meters that compare steps' speeds keep (``probes``, ``routing``, ``gate``)."""
    return step.num_decode_seqs >= 1 and not step.num_prefill_tokens and step.total_time > 0


def check_gamma_max(gamma_max: int) -> None:
    if not 1 <= gamma_max <= 64:
        raise ValueError(f"gamma_max must be in [1, 64], got {gamma_max}")


def priced_out(policy: SpeculationPolicy, drafter: str) -> bool:
    """Whether ``policy`` would not give ``drafter`` a sequence now (the per-sequence router priced it below
    decoding without a draft at the last plan, ``AnalyticPolicy.priced_out``); False for a policy that does
    not say. The engine then stops keeping a tap-reading drafter's context warm (``TAP_LINGER_STEPS``)."""
    check = getattr(policy, "priced_out", None)
    return bool(check(drafter)) if callable(check) else False


def probe_due(policy: SpeculationPolicy, drafter: str) -> bool:
    """Whether one of ``policy``'s next few plans will probe ``drafter`` (``AnalyticPolicy.probe_due``, its
    ``warm_steps``); False for a policy that does not say. The engine then computes the target's taps, so a
    tap-reading drafter that was off drafts from a context when the probe runs."""
    check = getattr(policy, "probe_due", None)
    return bool(check(drafter)) if callable(check) else False


def drafter_changed(policy: SpeculationPolicy | None, drafter: str) -> None:
    """Tell ``policy`` that ``drafter`` drafts with other weights from the next step on (a published head
    swapped in, a rollback, a merged adapter: ``AnalyticPolicy.drafter_changed``); nothing for a policy that
    does not ask (or no policy)."""
    hook = getattr(policy, "drafter_changed", None)
    if callable(hook):
        hook(drafter)


def wants_offers(policy: SpeculationPolicy) -> bool:
    """Whether ``policy`` prices each sequence's model-free drafts (``SeqState.offers``): per-sequence
    drafting (``routing.py``). A policy without the attribute (or a wrapper whose inner has none) does not."""
    return bool(getattr(policy, "wants_offers", False))
