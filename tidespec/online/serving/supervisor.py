"""The online-training child under supervision: reaped when it dies, said so, restarted, or given up.

Why this exists: ``tidespec serve --online-training`` trains in a child process. A bare ``Popen``
that died (``kill -9``, the OOM killer, a crash) stayed a zombie, logged nothing, left ``/health``
ok and no metric, and the engine went on capturing signals for nobody. ``TrainerSupervisor`` owns
the child: a named daemon thread waits on it, so a death is noticed at once and the child reaped;
the death is logged (exit code or signal, and the child's log file) and counted, and the child is
started again after an exponential backoff. A child that keeps dying soon after it starts is given
up on after ``max_restarts`` restarts (an ERROR line, state ``failed``) and ``on_give_up`` runs, so
the owner can stop capturing signals. A child that exits with status 0 finished on purpose (e.g.
``--trainer-args "--max-rounds 3"``): it is not restarted (state ``exited``, ``on_give_up`` runs).
``close()`` stops the child (SIGTERM, SIGKILL after a timeout) and interrupts a backoff wait; it
never restarts. ``state()`` is the snapshot ``/health`` and the metrics read.

Every child is started from the supervisor thread: Linux's ``PR_SET_PDEATHSIG`` (which
``start_trainer_process`` sets so a killed server never leaves its trainer behind) fires when the
*thread* that forked the child ends, so the thread that starts a child must live as long as it.

Worked example (``RestartPolicy()``: waits 1, 2, 4 ... s capped at 60 s; 5 restarts in a row of a
child that dies within 300 s of its start, then give up)::

    sup = TrainerSupervisor(lambda: start_trainer_process(online_cfg, model), log_path="runs/d/trainer.log")
    sup.start()                # the child runs: {"state": "running", "pid": 4242, "restarts": 0, ...}
    # kill -9 4242  -> WARNING "trainer child pid 4242 died (SIGKILL) after 12.0 s; restart 1 of 5 in
    #                  1.0 s (its log: runs/d/trainer.log)"; one second later a new child runs
    sup.state()                # {"state": "running", "pid": 4250, "restarts": 1, "deaths": 1,
                               #  "last_exit": "SIGKILL", "since_s": 0.4}
    sup.close()                # SIGTERM, SIGKILL after the timeout; state "stopped"
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tidespec.errors import ConfigError, check_at_least
from tidespec.threads import start_helper

logger = logging.getLogger(__name__)

SupervisorState = Literal["starting", "running", "restarting", "failed", "exited", "stopped"]
MAX_DOUBLINGS = 62  # 2 ** 62 s is beyond any cap; keeps the float power finite for any max_restarts


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead trainer child is started again, and when the supervisor gives up.

    A death within ``healthy_s`` of the child's start is a quick failure; the n-th quick failure in
    a row waits ``min(backoff_max_s, backoff_s * 2 ** (n - 1))`` before the restart, and the
    ``max_restarts + 1``-th gives up. A child that ran ``healthy_s`` or longer resets the count (and
    so the backoff). A child that could not be started at all counts as a quick failure too.
    """

    max_restarts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    healthy_s: float = 300.0

    def __post_init__(self) -> None:
        check_at_least(0, max_restarts=self.max_restarts)
        if min(self.backoff_s, self.backoff_max_s, self.healthy_s) <= 0:
            raise ConfigError(f"backoff_s, backoff_max_s and healthy_s must be > 0, got {self.backoff_s}, "
                              f"{self.backoff_max_s}, {self.healthy_s}")

    def delay(self, failures: int) -> float:
        """Seconds to wait before the restart that follows the ``failures``-th quick failure in a row."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(max(0, failures - 1), MAX_DOUBLINGS))


def describe_exit(returncode: int) -> str:
    """``"SIGKILL"`` for a child killed by a signal (``Popen`` reports ``-signum``), else ``"exit N"``."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class TrainerSupervisor:
    """Owns one trainer child at a time; see the module docstring.

    ``start`` is called with no arguments and returns the started child (``start_trainer_process``
    with its arguments bound; tests pass a cheap stand-in). ``log_path`` is only named in log lines.
    ``on_give_up(state)`` runs once, on the supervisor thread, when no child will run any more
    without ``close()``: ``state`` is ``"failed"`` or ``"exited"``.
    """

    def __init__(self, start: Callable[[], subprocess.Popen[bytes]], policy: RestartPolicy | None = None, *,
                 log_path: Path | str | None = None, on_give_up: Callable[[str], None] | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.log_path = Path(log_path) if log_path is not None else None
        self._start_child = start
        self._on_give_up = on_give_up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._state: SupervisorState = "starting"
        self._since = time.monotonic()
        self._restarts = 0
        self._deaths = 0
        self._failures = 0  # quick failures in a row
        self._last_exit: str | None = None
        self._paused = False  # SIGSTOPped on purpose (``pause``); a restarted child starts paused too

    # ------------------------------------------------------------------ public
    def start(self, timeout: float = 60.0) -> TrainerSupervisor:
        """Start the supervisor thread, which starts the first child; returns once it runs. An
        exception raised by the first start is raised here (nothing is retried then)."""
        if self._thread is not None:
            return self
        self._thread = start_helper(self._run, "tidespec-trainer-supervisor")
        if not self._started.wait(timeout):
            raise TimeoutError(f"the trainer child did not start within {timeout} s")
        if self._start_error is not None:
            raise self._start_error
        return self

    def pause(self) -> None:
        """Stop the child where it is (SIGSTOP): it keeps its memory and place and uses no CPU until
        ``resume``; a child restarted meanwhile starts paused too (``training governor``)."""
        with self._lock:
            self._paused = True
            self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused child go on (SIGCONT)."""
        with self._lock:
            self._paused = False
            self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the live child, if any (caller holds the lock)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass  # it died just now; the supervisor thread sees that

    def close(self, timeout: float = 10.0) -> None:
        """Stop supervising: SIGTERM the child, SIGKILL it after ``timeout`` s, never restart (idempotent)."""
        with self._lock:
            self._stop.set()  # under the lock: no child is started after this
            proc = self._proc
            self._paused = False
            self._signal(signal.SIGCONT)  # a stopped child would not act on SIGTERM
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout)
        self._set_state("stopped")

    @property
    def running(self) -> bool:
        """Whether a child is running now (as far as the supervisor thread has seen)."""
        return self._state == "running"

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None and self._state == "running" else None

    def state(self) -> dict[str, Any]:
        """Snapshot for ``/health`` and the metrics (JSON-ready)."""
        with self._lock:
            return {
                "state": self._state,
                "pid": self._proc.pid if self._proc is not None and self._state == "running" else None,
                "restarts": self._restarts,
                "deaths": self._deaths,
                "last_exit": self._last_exit,
                "since_s": round(time.monotonic() - self._since, 1),
                "paused": self._paused,
            }

    # ------------------------------------------------------------------ the supervisor thread
    def _run(self) -> None:
        try:
            proc = self._spawn()
        except Exception as exc:  # noqa: BLE001 - anything the first start raises is the caller's to see
            self._start_error = exc
            self._set_state("failed")
            self._started.set()
            return
        self._started.set()
        while proc is not None:
            started = time.monotonic()
            returncode = proc.wait()  # reaps the child: no zombie
            if self._stop.is_set():
                return  # close() ended it
            if not self._child_ended(proc.pid, returncode, time.monotonic() - started):
                return
            proc = self._restart()

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        """Start a child unless closing (the lock orders this against ``close``)."""
        with self._lock:
            if self._stop.is_set():
                return None
            proc = self._start_child()
            self._proc = proc
            if self._paused:
                self._signal(signal.SIGSTOP)
            self._state = "running"
            self._since = time.monotonic()
            return proc

    def _child_ended(self, pid: int, returncode: int, uptime: float) -> bool:
        """Log and count an exit nobody asked for; True when a restart should follow."""
        how = describe_exit(returncode)
        with self._lock:
            self._last_exit = how
        if returncode == 0:
            logger.info("trainer child pid %d exited normally after %.1f s; not restarting it%s", pid, uptime,
                        self._log_hint())
            self._give_up("exited")
            return False
        with self._lock:
            self._deaths += 1
            if uptime >= self.policy.healthy_s:
                self._failures = 0
        return self._failed(f"trainer child pid {pid} died ({how}) after {uptime:.1f} s")

    def _failed(self, what: str) -> bool:
        """Count one quick failure; log the restart to come, or give up. True when restarting."""
        with self._lock:
            self._failures += 1
            failures = self._failures
        if failures > self.policy.max_restarts:
            logger.error("%s; giving up after %d restarts in a row: online training stops, serving goes on%s",
                         what, failures - 1, self._log_hint())
            self._give_up("failed")
            return False
        logger.warning("%s; restart %d of %d in %.1f s%s", what, failures, self.policy.max_restarts,
                       self.policy.delay(failures), self._log_hint())
        self._set_state("restarting")
        return True

    def _restart(self) -> subprocess.Popen[bytes] | None:
        """Wait out the backoff (``close`` interrupts it) and start a new child; None when closing
        or giving up."""
        while not self._stop.wait(self.policy.delay(self._failures)):
            try:
                proc = self._spawn()
            except Exception as exc:  # noqa: BLE001 - an injected start may raise anything; supervision goes on
                if not self._failed(f"the trainer child could not be restarted: {exc}"):
                    return None
                continue
            if proc is not None:
                with self._lock:
                    self._restarts += 1
                logger.info("trainer child restarted: pid %d (restart %d)", proc.pid, self._restarts)
            return proc
        return None

    def _give_up(self, state: Literal["failed", "exited"]) -> None:
        self._set_state(state)
        if self._on_give_up is not None:
            self._on_give_up(state)

    def _set_state(self, state: SupervisorState) -> None:
        with self._lock:
            if self._state != state:
                self._state = state
                self._since = time.monotonic()

    def _log_hint(self) -> str:
        return f" (its log: {self.log_path})" if self.log_path is not None else ""
