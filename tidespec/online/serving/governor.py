"""Training that yields to serving: the trainer child gets the CPU only when serving leaves it free.

Why this exists: on a CPU host the trainer child and the engine share the same cores. With both
running, a 2-core machine served 0.26x plain decoding's throughput in ``make demo`` part 2, where a
fixed ``--trainer-nice`` could not help (the engine's threads spin in parallel regions; a niced
process still takes its share). TIDE's premise (§3.2) is that training uses resources
serving does not need; on a shared CPU that means: the trainer runs while serving is idle, and is
stopped (SIGSTOP, ``TrainerSupervisor.pause``) while the engine steps, except for a bounded share
of the busy time that the operator may grant (``share``: 0 = only while idle, 1 = never paused; a
trainer on another device than the engine is never paused). A stopped child keeps its memory and
its place in the round, and goes on where it was when it is continued (SIGCONT), so at idle a
round takes as long as a standalone ``train-drafter`` run, and at saturation training costs serving
nothing but the memory it holds.

Load is measured, not guessed: every engine step reports its start (``on_step_start``) and its
end (``on_step_end``: the governor is an engine observer), each recording the time and
nothing else; serving counts as busy while a step runs or ran within the last ``idle_s`` seconds
(a long prefill step is busy throughout). ``attach(engine)`` registers both. A daemon thread
re-decides every ``tick_s`` seconds.

Worked example (share 0.1, period 2 s, idle_s 0.3): the engine steps continuously from t = 10 s to
t = 20 s, then nothing arrives. The trainer runs in the first 0.2 s of every 2 s period while the
engine is busy (10.0-10.2, 12.0-12.2, ...: about 10 % of the busy time) and runs throughout from
t = 20.3 s on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tidespec.engine.observer import EngineObserver
from tidespec.errors import ConfigError
from tidespec.stats import StepStats
from tidespec.threads import start_helper

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine


class Pausable(Protocol):
    """What the governor steers (``TrainerSupervisor``)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass(frozen=True)
class GovernorConfig:
    """``share``: fraction of serving's busy time the trainer may run; the rest as above."""

    share: float = 0.0
    idle_s: float = 0.3
    period_s: float = 2.0
    tick_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ConfigError(f"trainer_share must be in [0, 1], got {self.share}")
        if self.idle_s <= 0 or self.period_s <= 0 or self.tick_s <= 0:
            raise ConfigError("idle_s, period_s and tick_s must be > 0")


class TrainingGovernor(EngineObserver):
    """Pauses and resumes a trainer from the engine's measured load (module docstring)."""

    def __init__(self, target: Pausable, config: GovernorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.config = config or GovernorConfig()
        self.clock = clock
        self._last_step = -float("inf")
        self._in_step = False
        self._running = True  # the trainer starts running
        self._since = clock()
        self._lock = threading.Lock()
        self._totals = {"run_idle_s": 0.0, "run_busy_s": 0.0, "paused_s": 0.0}
        self._busy = False
        self._held = False  # paused whatever the load (``hold``)
        self.num_pauses = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, engine: LLMEngine) -> TrainingGovernor:
        """Follow ``engine``'s steps (an observer: their starts and ends); returns self."""
        return engine.add_observer(self)

    def on_step_start(self, engine: object = None) -> None:
        """A step begins."""
        self._in_step = True
        self._last_step = self.clock()

    def on_step_end(self, stats: StepStats | None = None) -> None:
        """A step ended."""
        self._in_step = False
        self._last_step = self.clock()

    def busy(self, now: float) -> bool:
        return self._in_step or now - self._last_step < self.config.idle_s

    def should_run(self, now: float) -> bool:
        """Whether the trainer may run at ``now``: never while held, always while serving is idle,
        else during the first ``share`` of each ``period_s`` (never with share 0, always with share 1)."""
        cfg = self.config
        if self._held:
            return False
        if not self.busy(now) or cfg.share >= 1.0:
            return True
        return cfg.share > 0.0 and (now % cfg.period_s) < cfg.share * cfg.period_s

    def tick(self) -> None:
        """Decide now; pause or resume the trainer when the decision changed."""
        now = self.clock()
        run = self.should_run(now)
        with self._lock:
            key = "paused_s" if not self._running else ("run_busy_s" if self._busy else "run_idle_s")
            self._totals[key] += now - self._since
            self._since, self._busy = now, self.busy(now)
            if run == self._running:
                return
            self._running = run
            if not run:
                self.num_pauses += 1
        if run:
            self.target.resume()
        else:
            self.target.pause()

    def hold(self, held: bool = True) -> None:
        """Keep the trainer paused whatever the load (``held``), or go back to deciding from load;
        e.g. a benchmark whose other configurations must not share the CPU with this trainer."""
        self._held = held
        self.tick()

    def start(self) -> TrainingGovernor:
        if self._thread is None:
            self._thread = start_helper(self._loop, "tidespec-training-governor")
        return self

    def close(self) -> None:
        """Stop deciding and leave the trainer running (its owner stops it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            paused = not self._running
            self._running = True
        if paused:
            self.target.resume()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.tick_s):
            self.tick()

    def state(self) -> dict[str, Any]:
        """For ``/health``, the metrics and the dashboard: paused now, and seconds run/paused so far."""
        with self._lock:
            return {"paused": not self._running, "share": self.config.share, "pauses": self.num_pauses,
                    **{k: round(v, 1) for k, v in self._totals.items()}}
