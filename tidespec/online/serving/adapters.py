"""Engine-side glue of online LoRA alignment: find the trainer's adapters, merge them off the
step, swap the merged weights in between steps.

Why this exists: the trainer's LoRA path (``trainer.lora``, EvoSpec Algorithm 1 path B) publishes
small adapters under ``<publish_root>/lora/v{version}/a{N}`` every few dozen requests. Serving
must take them without ever running an adapter on the step and without waiting on disk: a poller
thread reads and validates the newest adapter of the version being served, merges it into that
version's weights (``eagle3_lora.merged_state``) and parks the result; its ``on_step_start`` hook
only copies the parked weights into the head (``Eagle3Drafter.load_state``, which marks every
sequence's head KV stale: lossless, like a version swap).

An adapter is relative to its base version: the base weights are copied once per version, on
the engine thread between steps (the head is only ever written there), the first time an adapter
for that version appears — before any adapter touched that version, so the copy is clean. The
bases of the served and the previous version are kept: a rollback returns to the previous
version, whose head may carry an adapter, and the newest adapter is then merged into the kept
clean base again. A new version (a full round, a rollback) supersedes the adapters served. No
adapter is applied while the served check of a version swap is still deciding (it compares
versions, not adapters). An adapter that fails validation is refused with one log line and
tried again only if its files change.

Worked example::

    root/v3/ (served)   root/lora/v3/a1/, a2/      -> poller parks a2 merged into v3's weights
    on_step_start -> head = v3 + a2; updates.applied == 2; drafter.version stays 3
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidespec.engine.observer import EngineObserver
from tidespec.files import directory_fingerprint
from tidespec.models.eagle3.lora import AdapterError, adapter_dir, list_adapters, load_adapter, merged_state
from tidespec.online.serving.poller import RootPoller
from tidespec.online.serving.rollback import ServedCheck
from tidespec.speculative.policy.api import drafter_changed

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine
    from tidespec.models.eagle3.head import Eagle3Head
    from tidespec.speculative.drafters.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)


@dataclass
class _Parked:
    version: int
    number: int
    state: dict[str, torch.Tensor]
    metrics: dict[str, Any]
    served: Eagle3Head | None = None  # the drafting copy of ``state`` (quantized in the poller, off the step)


class AdapterUpdater(RootPoller, EngineObserver):
    """Polls ``root/lora/v{served version}`` in a thread; swaps merged adapters in between steps."""

    def __init__(self, drafter: Eagle3Drafter, root: Path | str, poll_s: float = 2.0,
                 check: ServedCheck | None = None) -> None:
        super().__init__(root, poll_s, "tidespec-adapter-updater")
        self.drafter = drafter
        self.check = check
        self.applied = 0  # adapter number serving now on ``drafter.version`` (0 = none)
        self.num_swaps = 0
        self.refused: dict[tuple[int, int], str] = {}  # (version, adapter) -> reason
        self._refused_files: dict[tuple[int, int], tuple[tuple[str, int, int], ...]] = {}
        self._lock = threading.Lock()
        self._bases: dict[int, dict[str, torch.Tensor]] = {}  # version -> its clean weights (<= 2 kept)
        self._want_base = -1  # version whose weights the engine thread should copy
        self._served_version = drafter.version
        self._parked: _Parked | None = None
        self._loaded = (drafter.version, 0)  # newest (version, adapter) parked or served, of the served version

    def poll_once(self) -> int | None:
        """Park the newest valid adapter of the served version merged into its weights; returns
        its number, or None (nothing new, refused, or the base weights not copied yet)."""
        with self._lock:
            version = self._served_version
            base = self._bases.get(version)
            loaded = self._loaded
        numbers = list_adapters(self.root, version)
        if not numbers or (loaded[0] == version and numbers[-1] <= loaded[1]):
            return None
        number = numbers[-1]
        if base is None:
            with self._lock:
                self._want_base = version  # the engine thread copies the weights between steps
            return None
        d = adapter_dir(self.root, version, number)
        files = directory_fingerprint(d)
        if self._refused_files.get((version, number)) == files:
            return None
        try:
            adapter = load_adapter(d, self.drafter.head.cfg)
            if adapter.base_version != version:
                raise AdapterError(f"adapter {d} names base version {adapter.base_version}, not {version}")
            state = merged_state(base, adapter, self.drafter.head.cfg)
        except AdapterError as exc:
            self.refused[(version, number)] = str(exc)
            self._refused_files[(version, number)] = files
            logger.warning("refusing LoRA adapter %s: %s; serving goes on without it", d, exc)
            return None
        with self._lock:
            if version != self._served_version:  # the version changed while we merged: start over
                return None
            self._parked = _Parked(version, number, state, adapter.metrics, self.drafter.prepare(state))
            self._loaded = (version, number)
        logger.info("LoRA adapter v%d/a%d merged (metrics %s); swapping in at the next step",
                    version, number, adapter.metrics)
        return number

    def on_step_start(self, engine: LLMEngine) -> None:
        """Between steps (an engine observer): note a version change, copy base weights when the poller
        asked, swap in a parked merged adapter of the served version."""
        version = self.drafter.version
        if version != self._served_version:  # a full-round version (or a rollback) supersedes adapters
            with self._lock:
                previous, self._served_version, self._parked = self._served_version, version, None
                self._bases = {v: b for v, b in self._bases.items() if v in (version, previous)}
                self._loaded = (version, 0)  # a rolled-back-to version takes its newest adapter again
            self.applied = 0
        if self._want_base == version and version not in self._bases and self.applied == 0:
            clean = {k: v.detach().clone() for k, v in self.drafter.head.state_dict().items()}
            with self._lock:
                self._bases[version] = clean
                self._want_base = -1
        if self._parked is None or (self.check is not None and self.check.previous is not None):
            return
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is None or parked.version != version:
            return
        self.drafter.load_state(version, parked.state, served=parked.served)
        self.applied = parked.number
        self.num_swaps += 1
        drafter_changed(engine.policy, self.drafter.name)

    def state(self) -> dict[str, Any]:
        return {"adapter": self.applied, "adapter_swaps": self.num_swaps,
                "refused_adapters": [f"v{v}/a{n}" for v, n in sorted(self.refused)]}
