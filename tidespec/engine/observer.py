"""``EngineObserver``: everything outside the engine that follows its steps, behind one protocol.

Why this exists: the server's metrics, the online-training machinery (signal capture, version swaps,
adapter merges, the rollback judgement), the trainer's governor, the exactness checker and the
benchmarks all hook into the step. Each implements the hooks it needs of one base class (every hook a
no-op by default) and registers with one call, ``LLMEngine.add_observer``; the engine calls every
observer's hooks in registration order.

The hooks, in the order a step calls them:

- ``on_step_start(engine)``: before the step, between steps: the place to swap in what a background
  thread prepared (a drafter version, merged adapters). Must return quickly.
- ``wants_taps()``: asked when no drafter needs the target's taps this step: whether something else
  does (signal capture while it collects). ``wants_hidden()``: whether the observations must carry the
  target's final hidden states too. Both must return quickly.
- ``on_observations(observations)``: the tokens that became final this step, with the taps when they
  were computed, after the drafter saw them (only when the engine has a drafter). Copy, never block.
- ``on_finish(seq)``: each sequence that finished (stopped, hit a limit, aborted), its slot freed;
  an exception here is logged and counted, never raised (the step's outputs are committed).
- ``on_step_end(stats)``: the step's ``StepStats`` (steps that ran a forward only).

Worked example::

    class StepCounter(EngineObserver):
        def __init__(self) -> None:
            self.steps = 0

        def on_step_end(self, stats: StepStats) -> None:
            self.steps += 1

    counter = engine.add_observer(StepCounter())
    engine.add_observer(Hooks(step_end=seen.append))   # plain functions instead of a class
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidespec.engine.sequence import Sequence
from tidespec.speculative.api import Observation
from tidespec.stats import StepStats

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine


class EngineObserver:
    """Follows the engine's steps; every hook is a no-op until a subclass overrides it."""

    def on_step_start(self, engine: LLMEngine) -> None:
        """Before a step (between steps)."""

    def wants_taps(self) -> bool:
        """Whether the target's taps are wanted this step although no drafter drafts with them."""
        return False

    def wants_hidden(self) -> bool:
        """Whether observations must carry the target's final hidden states with the taps."""
        return False

    def on_observations(self, observations: list[Observation]) -> None:
        """The tokens that became final this step (with the taps when computed)."""

    def on_finish(self, seq: Sequence) -> None:
        """A sequence finished; its slot is free."""

    def on_step_end(self, stats: StepStats) -> None:
        """The record of a step that ran."""


@dataclass(eq=False)
class Hooks(EngineObserver):
    """An observer made of plain functions, any of them omitted: ``Hooks(step_end=seen.append)``."""

    step_start: Callable[[LLMEngine], None] | None = None
    taps: Callable[[], bool] | None = None
    hidden: Callable[[], bool] | None = None
    observations: Callable[[list[Observation]], None] | None = None
    finish: Callable[[Sequence], None] | None = None
    step_end: Callable[[StepStats], None] | None = None

    def on_step_start(self, engine: LLMEngine) -> None:
        if self.step_start is not None:
            self.step_start(engine)

    def wants_taps(self) -> bool:
        return self.taps is not None and self.taps()

    def wants_hidden(self) -> bool:
        return self.hidden is not None and self.hidden()

    def on_observations(self, observations: list[Observation]) -> None:
        if self.observations is not None:
            self.observations(observations)

    def on_finish(self, seq: Sequence) -> None:
        if self.finish is not None:
            self.finish(seq)

    def on_step_end(self, stats: StepStats) -> None:
        if self.step_end is not None:
            self.step_end(stats)
