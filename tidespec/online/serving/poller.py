"""``RootPoller``: a daemon thread that calls ``poll_once`` every ``poll_s`` seconds until closed.

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
from pathlib import Path
from typing import Self

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
