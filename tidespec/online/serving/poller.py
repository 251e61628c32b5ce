"""``RootPoller``: a daemon thread that calls ``poll_once`` every ``poll_s`` seconds until closed; ``RoundRelay``:
the trainer's rounds handed to the selective collector.

Why this exists: the engine takes new drafter versions (``attach.DrafterUpdater``) and new LoRA
adapters (``adapters.AdapterUpdater``) from the publish root without ever touching the disk on
the step; both poll the root in a thread of their own that must survive any error (serving goes
on) and stop promptly on close. This is that thread, once.

Worked example::

    class Updater(RootPoller):
        def poll_once(self) -> int | None: ...       # read, validate, park for on_step_start

    u = Updater(Path("runs/drafter"), poll_s=2.0, name="tidespec-drafter-updater").start()
    ...
    u.close()
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from tidespec.files import directory_fingerprint, latest_version
from tidespec.online.collection import SelectiveCollector
from tidespec.online.signals import read_trainer_rounds
from tidespec.threads import start_helper

logger = logging.getLogger(__name__)


class RootPoller:
    """Base of the publish-root pollers: ``start`` runs ``poll_once`` in a daemon thread."""

    def __init__(self, root: Path | str, poll_s: float, name: str) -> None:
        self.root = Path(root)
        self.poll_s = poll_s
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int | None:
        raise NotImplementedError

    def start(self) -> Self:
        if self._thread is None:
            self._thread = start_helper(self._run, self._name)
        return self

    def close(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the poller must survive anything (serving goes on)
                logger.exception("%s: polling %s failed", self._name, self.root)
            self._stop.wait(self.poll_s)


class VersionPoller(RootPoller):
    """A ``RootPoller`` of a publish root's numbered versions: which newer version to read next
    (``next_version``), the versions refused (``refuse``), each read again only once its files change, so an
    unchanged bad directory costs one stat per poll and one log line in all; ``loaded`` records a version
    read."""

    def __init__(self, root: Path | str, poll_s: float, name: str, loaded: int) -> None:
        super().__init__(root, poll_s, name)
        self.refused: dict[int, str] = {}  # version -> reason
        self._loaded = loaded  # newest version loaded (served or parked)
        self._refused_files: dict[int, tuple[tuple[str, int, int], ...]] = {}  # version -> files when refused

    def next_version(self) -> tuple[int, tuple[tuple[str, int, int], ...]] | None:
        """(the newest version, its files' fingerprint) when it is newer than the one loaded and not refused
        as it is now; else None."""
        newest = latest_version(self.root)
        if newest is None or newest <= self._loaded:
            return None
        files = directory_fingerprint(self.root / f"v{newest}")  # before reading: a later change is seen next poll
        return None if self._refused_files.get(newest) == files else (newest, files)

    def refuse(self, version: int, files: tuple[tuple[str, int, int], ...], reason: str) -> str:
        """Remember ``version`` as refused with these files; returns " again" when it was refused before (for the log)."""
        again = " again" if version in self.refused else ""
        self.refused[version] = reason
        self._refused_files[version] = files
        return again

    def loaded(self, version: int) -> None:
        self._loaded = version
        self.refused.pop(version, None)
        self._refused_files.pop(version, None)


@dataclass
class RoundRelay:
    """Relays each new trainer round of ``root`` (its ``trainer_state.json``) to the selective collector
    (TIDE's Algorithm 1: a round that does not improve switches collection off); the rounds recorded
    before it started are history. Called from a publish-root poller's thread (``relay``)."""

    root: Path
    selective: SelectiveCollector | None
    seen: int = field(default=-1)

    def __post_init__(self) -> None:
        if self.seen < 0:
            self.seen = len(read_trainer_rounds(self.root))

    def relay(self) -> None:
        if self.selective is None:
            return
        rounds = read_trainer_rounds(self.root)
        for r in rounds[self.seen:]:
            try:
                a_train = min(1.0, max(0.0, float(r["alpha_train"])))
                a_eval = min(1.0, max(0.0, float(r["alpha_eval"])))
            except (KeyError, TypeError, ValueError):
                continue
            decision = self.selective.report_training(a_train, a_eval)
            logger.info("trainer round %s: alpha %.3f -> %.3f, %s", r.get("round"), a_train, a_eval, decision.value)
        self.seen = max(self.seen, len(rounds))
