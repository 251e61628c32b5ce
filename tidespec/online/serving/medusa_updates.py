"""``MedusaUpdater``: Medusa heads the trainer child publishes, swapped into a serving engine between steps.

Why this exists: the Medusa drafter's online loop needs what ``attach.DrafterUpdater`` does
for the EAGLE-3 head: a thread polls the publish root (``--medusa-dir``), reads and checks a newer version
off the hot path (``models/medusa/heads.py``: readable, finite, fits the target) and parks it; the engine's
step hook only swaps the parked heads in (``MedusaDrafter.swap``), so a step never waits on the disk. A
version that fails its checks (half copied, another target's) is refused with one log line and tried
again when its files change; serving goes on with the heads it has. The trainer's rounds are relayed to
the selective collector as for EAGLE-3 (``poller.RoundRelay``).

Worked example::

    updater = MedusaUpdater(drafter, "runs/medusa", engine.model.cfg, poll_s=2.0).start()
    engine.add_observer(updater)         # a trainer publishes runs/medusa/v2 -> drafts with v2 from a next step
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from tidespec.engine.observer import EngineObserver
from tidespec.models.medusa.heads import MedusaConfigError, MedusaHeads, check_fit, load_published
from tidespec.models.target import TargetConfig
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.serving.poller import RoundRelay, VersionPoller
from tidespec.speculative.drafters.medusa import MedusaDrafter
from tidespec.speculative.policy.api import drafter_changed

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class MedusaUpdater(VersionPoller, EngineObserver):
    """Polls a Medusa publish root in a background thread and swaps newer heads in between steps."""

    def __init__(self, drafter: MedusaDrafter, root: Path | str, target_cfg: TargetConfig, poll_s: float = 2.0,
                 selective: SelectiveCollector | None = None, capture: CaptureBuffer | None = None) -> None:
        super().__init__(root, poll_s, "tidespec-medusa-updater", drafter.version)
        self.drafter = drafter
        self.target_cfg = target_cfg
        self.capture = capture
        self.rounds = RoundRelay(self.root, selective)
        self.num_swaps = 0
        self._lock = threading.Lock()
        self._pending: tuple[int, MedusaHeads] | None = None

    def poll_once(self) -> int | None:
        """Check the root once; park a newer valid version for the next step. Returns the parked version, or
        None. A refused version is read again only once its files changed."""
        self.rounds.relay()
        found = self.next_version()
        if found is None:
            return None
        newest, files = found
        serving = self.drafter.heads
        try:
            heads, metrics = load_published(self.root, newest, serving.dtype, serving.blocks[0].weight.device)
            check_fit(heads.cfg, self.target_cfg.hidden_size, self.target_cfg.vocab_size)
        except MedusaConfigError as exc:
            again = self.refuse(newest, files, str(exc))
            logger.warning("refusing Medusa heads version %d under %s%s: %s; keeping version %d (tried again when its "
                           "files change)", newest, self.root, again, exc, self.drafter.version)
            return None
        self.loaded(newest)
        with self._lock:
            self._pending = (newest, heads)
        logger.info("Medusa heads version %d loaded from %s (metrics %s); swapping in at the next step", newest,
                    self.root, metrics)
        return newest

    def on_step_start(self, engine: LLMEngine) -> None:
        """Between steps (an engine observer): swap in the parked heads, if any (already in memory)."""
        if self._pending is None:
            return
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self.drafter.swap(*pending)
        if self.capture is not None:
            self.capture.set_drafter_version(pending[0])
        self.num_swaps += 1
        drafter_changed(engine.policy, self.drafter.name)
