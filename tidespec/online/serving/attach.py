"""Engine-side glue of online drafter training: capture signals while serving, swap in new drafters.

Why this exists: TIDE (Sec. 3, 4.2) reuses the hidden states the target already computed during
prefill and verification as training signals, trains an EAGLE-3 head in a separate process, and
deploys a new head only when it is measurably better (with ``--drafter medusa``: Medusa heads, from rows
of final hidden states without taps, swapped in by ``medusa_updates.MedusaUpdater``). The building blocks live elsewhere
(``capture``, ``store``, ``collection``, ``checkpoint``, ``eagle3_train``); this module plugs them
into a running ``LLMEngine`` as observers of its steps (``engine/observer.py``), without touching
the engine loop:

* ``SignalCollector`` — ``on_observations``: for every observation (the
  positions whose target KV became final this step, with their taps) it pushes rows
  ``(position i, token_i, label = token_{i+1}, taps_i)`` into a non-blocking ``CaptureBuffer``,
  but only while TIDE's ``SelectiveCollector`` says collection is on. Its ``on_finish``
  feeds the collector the acceptance rate of every finished request.
* ``DrafterUpdater`` — a background thread polls the publish root (``checkpoint.publish``) for a
  newer version, loads and validates it off the hot path and parks it in memory; its
  ``on_step_start`` swaps the parked weights in with ``Eagle3Drafter.load_state``.
  A version that fails validation (a half-copied or corrupt directory, the wrong target) is
  refused with one log line and serving continues on the current drafter; a refused version is
  tried again when its files change (names, sizes, modification times), so a directory refused
  while half-copied is taken once its weights arrive (a newer version supersedes it). It also
  relays the trainer's round outcomes (``trainer_state.json``) to the collector (Algorithm 1: a
  round that does not improve switches collection off).
* ``OnlineTraining.supervise_trainer`` — starts the trainer child under a ``TrainerSupervisor``
  (restarts with backoff; its state is in ``state()``, hence ``/health`` and the metrics). When the
  supervisor gives up for good, capture stops: nobody would train on the signals.

Worked example (rows of one decode step)::

    context t0..t6 (t6 just sampled), obs.start = 4, obs.num_new_cached = 2, taps [2, 3H]
    -> push positions [4, 5], tokens [t4, t5], labels [t5, t6], taps rows 0..1

    online = attach_online_training(engine, OnlineConfig(publish_root="runs/drafter",
                                                         signal_dir="runs/signals"))
    ... engine.step() as usual ...
    online.state()   # {"drafter_version": 3, "collection_enabled": True, "captured": 5120, ...}
    online.close()
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidespec.config import CollectionConfig, EngineConfig
from tidespec.engine.observer import EngineObserver
from tidespec.errors import ConfigError
from tidespec.files import latest_version
from tidespec.models.eagle3.checkpoint import (
    DrafterCheckpointError,
    PublishedDrafter,
    is_checkpoint_dir,
    is_seed,
    load_version,
)
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head
from tidespec.models.medusa.heads import CONFIG as MEDUSA_CONFIG
from tidespec.models.target import TargetConfig
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.online.serving.adapters import AdapterUpdater
from tidespec.online.serving.governor import GovernorConfig, TrainingGovernor
from tidespec.online.serving.medusa_updates import MedusaUpdater
from tidespec.online.serving.poller import RoundRelay, VersionPoller
from tidespec.online.serving.rollback import RollbackConfig, ServedCheck
from tidespec.online.serving.supervisor import RestartPolicy, TrainerSupervisor
from tidespec.online.signals import SignalCollector
from tidespec.online.store import TAPS_DTYPES, SignalStore
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter
from tidespec.speculative.drafters.eagle3_options import eagle3_options
from tidespec.speculative.drafters.medusa import MedusaDrafter, medusa_options
from tidespec.speculative.drafters.multi import find_member
from tidespec.speculative.policy.api import drafter_changed
from tidespec.speculative.policy.factory import policy_profile

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine

logger = logging.getLogger(__name__)



class OnlineConfigError(ConfigError):
    """An online-training setting is invalid; the message is one line."""


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class OnlineConfig:
    """Where drafters are published and signals stored, and how capture behaves."""

    publish_root: str
    signal_dir: str
    signal_budget_bytes: int = 2 << 30
    taps_dtype: str = "bfloat16"  # on-disk (and host-buffer) dtype of the taps
    capture_capacity_rows: int = 8192  # host ring; pushes that do not fit are dropped (counted)
    capture_flush_rows: int = 1024  # rows per shard
    max_shard_age_s: float = 5.0  # a partial shard is cut after this long
    capture_prompt: bool = False  # also capture prompt positions (labels = the prompt's next token)
    capture_idle_share: float = 0.0  # share of decode steps captured while no drafter pays (``SignalCollector``)
    poll_s: float = 2.0  # seconds between checks of the publish root
    collection: CollectionConfig = field(default_factory=CollectionConfig)
    rollback_min_drafts: int = 0  # drafts of a new version before the served check decides (0 = no check)
    lora: bool = False  # capture final hidden states and merge the trainer's LoRA adapters (EvoSpec path B)
    drafter: str = "eagle3"  # what is trained: "eagle3" (rows of taps) or "medusa" (rows of final hidden states)
    # the trainer's adapters also learn this many emitted tokens outside the head's vocabulary
    # (``--lora-extra-vocab``): the dynamic draft vocabulary's buffer, 0 without one
    lora_extra_vocab: int = 0

    def __post_init__(self) -> None:
        if not self.publish_root or not self.signal_dir:
            raise OnlineConfigError("publish_root and signal_dir must be set")
        if self.signal_budget_bytes <= 0:
            raise OnlineConfigError(f"signal_budget_bytes must be > 0, got {self.signal_budget_bytes}")
        if self.taps_dtype not in TAPS_DTYPES:
            raise OnlineConfigError(f"taps_dtype must be one of {', '.join(TAPS_DTYPES)}, got {self.taps_dtype!r}")
        if not 1 <= self.capture_flush_rows <= self.capture_capacity_rows:
            raise OnlineConfigError(f"need 1 <= capture_flush_rows ({self.capture_flush_rows}) <= "
                                    f"capture_capacity_rows ({self.capture_capacity_rows})")
        if self.max_shard_age_s <= 0 or self.poll_s <= 0:
            raise OnlineConfigError("max_shard_age_s and poll_s must be > 0")
        if self.drafter not in ("eagle3", "medusa"):
            raise OnlineConfigError(f"drafter must be eagle3 or medusa, got {self.drafter!r}")
        if self.rollback_min_drafts < 0 or self.lora_extra_vocab < 0:
            raise OnlineConfigError("rollback_min_drafts and lora_extra_vocab must be >= 0, got "
                                    f"{self.rollback_min_drafts} and {self.lora_extra_vocab}")

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> OnlineConfig:
        """From the ``--eagle3-dir`` / ``--signal-dir`` / ``--collect-*`` flags (``config.online``).

        Collection starts on (``bootstrap``) when nothing is published yet, or only a seeded head
        (``is_seed``: the embedded model's shipped head, published by ``llm.with_shipped_head``): with
        no drafter trained on this traffic there is no acceptance level to detect a shift against,
        and a server whose traffic is new from its first request would otherwise never collect.
        """
        oc, trained = config.online, config.spec.online_drafter or "eagle3"
        root = (eagle3_options(config.spec) if trained == "eagle3" else medusa_options(config.spec)).dir
        flag = f"--{trained}-dir"
        if not root:
            raise OnlineConfigError(f"online training needs {flag} (the drafter publish root)")
        if is_checkpoint_dir(root) or (Path(root) / MEDUSA_CONFIG).is_file():
            raise OnlineConfigError(f"{flag} {root} is one exported checkpoint; online training "
                                    "needs a publish root (a directory of v1/, v2/, ...)")
        bootstrap = oc.collect.bootstrap or latest_version(root) is None or is_seed(root)
        return cls(
            publish_root=str(root),
            signal_dir=oc.signal_dir or str(Path(root) / "signals"),
            signal_budget_bytes=oc.signal_budget_mb << 20,
            capture_prompt=oc.capture_prompt,
            capture_idle_share=oc.capture_idle_share,
            poll_s=oc.poll_s,
            collection=dataclasses.replace(oc.collect, bootstrap=bootstrap),
            rollback_min_drafts=oc.rollback_min_drafts,
            lora=oc.lora and trained == "eagle3",  # Medusa heads train on the target's tokens
            drafter=trained,
            lora_extra_vocab=config.spec.vocab.buffer if config.spec.vocab.mode == "dynamic" else 0,
        )


# ----------------------------------------------------------------------------------------------
# capture
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# drafter updates
# ----------------------------------------------------------------------------------------------


class DrafterUpdater(VersionPoller, EngineObserver):
    """Polls a publish root in a background thread and swaps new drafter versions in between steps.

    The thread does all I/O, validation and tensor conversion; ``on_step_start`` (the engine hook)
    only copies already-loaded weights into the head, and does nothing when nothing is pending.
    """

    def __init__(self, drafter: Eagle3Drafter, root: Path | str, target_cfg: TargetConfig, poll_s: float = 2.0,
                 selective: SelectiveCollector | None = None, capture: CaptureBuffer | None = None,
                 check: ServedCheck | None = None) -> None:
        if poll_s <= 0:
            raise OnlineConfigError(f"poll_s must be > 0, got {poll_s}")
        super().__init__(root, poll_s, "tidespec-drafter-updater", drafter.version)
        self.drafter = drafter
        self.target_cfg = target_cfg
        self.selective = selective
        self.capture = capture
        self.num_swaps = 0
        self.check = check  # the served check after each swap (rollback); None: swaps are final
        self.rounds = RoundRelay(self.root, selective)
        self._lock = threading.Lock()
        self._pending: PublishedDrafter | None = None
        self._pending_served: Eagle3Head | None = None  # its drafting copy (quantized here, off the step)

    def poll_once(self) -> int | None:
        """Check the root once; park a newer valid version for the next step. Returns the parked
        version, or None. A refused version is tried again only once its files changed, so an
        unchanged bad directory costs one stat per poll and one log line in all. Also relays new
        trainer rounds to the selective collector."""
        self.rounds.relay()
        found = self.next_version()
        if found is None:
            return None
        newest, files = found
        try:
            pub = load_version(self.root, newest, self.target_cfg)  # validates names, shapes, finiteness
            if pub.config.tap_layers != self.drafter.tap_layers:
                raise DrafterCheckpointError(
                    f"tap layers {pub.config.tap_layers} differ from the serving drafter's {self.drafter.tap_layers}")
        except (DrafterCheckpointError, Eagle3ConfigError) as exc:
            again = self.refuse(newest, files, str(exc))
            logger.warning("refusing EAGLE-3 drafter version %d under %s%s: %s; keeping version %d (tried again "
                           "when its files change)", newest, self.root, again, exc, self.drafter.version)
            return None
        self.loaded(newest)
        head = self.drafter.head
        pub.state_dict = {k: (v.to(device=head.device, dtype=head.dtype) if v.is_floating_point()
                              else v.to(device=head.device)) for k, v in pub.state_dict.items()}
        served = self.drafter.prepare(pub.state_dict, pub.config)
        with self._lock:
            self._pending, self._pending_served = pub, served
        logger.info("drafter version %d loaded from %s (metrics %s); swapping in at the next step",
                    pub.version, self.root, pub.metrics)
        return pub.version

    def on_step_start(self, engine: LLMEngine) -> None:
        """Between steps (an engine observer): act on the served check of the last swap (roll back a
        version that loses in service), then swap in a parked version (weights already in memory); the
        engine's policy hears of either (``policy.api.drafter_changed``: it measured the old weights)."""
        swaps = self.num_swaps
        self._swap_pending()
        if self.num_swaps != swaps:
            drafter_changed(engine.policy, self.drafter.name)

    def _swap_pending(self) -> None:
        if self.check is not None and self.check.previous is not None:
            self._settle(self.check)
        if self._pending is None:
            return
        with self._lock:
            pub, self._pending = self._pending, None
            served, self._pending_served = self._pending_served, None
        if pub is None:
            return
        # keep what serves now, to swap it back if the new one loses; a trainer's revert (a version
        # that lost the trainer's paired served judgement, published again) is final
        if pub.metrics.get("reverts"):
            logger.info("drafter version %d serves: version %s lost the trainer's served judgement, version %s's "
                        "head is back", pub.version, pub.metrics["reverts"], pub.metrics.get("restores"))
        if self.check is not None and pub.metrics.get("reverts"):
            self.check.settled()
        elif self.check is not None:
            head = self.drafter.head
            self.check.swapped(self.drafter.version, {k: v.clone() for k, v in head.state_dict().items()}, head.cfg)
        self._swap(pub.version, pub.state_dict, pub.config, served)

    def _swap(self, version: int, state_dict: dict[str, torch.Tensor], config: Eagle3Config,
              served: Eagle3Head | None = None) -> None:
        self.drafter.load_state(version, state_dict, config if config != self.drafter.head.cfg else None, served)
        if self.capture is not None:
            self.capture.set_drafter_version(version)
        self.num_swaps += 1

    def _settle(self, check: ServedCheck) -> None:
        """Keep the new version or swap the previous one back, once the check can tell."""
        verdict = check.verdict()
        if verdict is None:
            return
        kept, new = check.previous, self.drafter.version
        assert kept is not None
        if verdict == "rollback":
            self._swap(kept.version, kept.state_dict, kept.config)
            check.current = kept.record  # the restored version's record goes on
            check.rollbacks += 1
            self.refused[new] = f"lost in service ({check.last_verdict})"
            logger.warning("drafter version %d rolled back to version %d: %s", new, kept.version, check.last_verdict)
        else:
            logger.info("drafter version %d kept: %s", new, check.last_verdict)
        check.settled()


# ----------------------------------------------------------------------------------------------
# the bundle the runtime attaches
# ----------------------------------------------------------------------------------------------


@dataclass
class OnlineTraining:
    """Everything ``attach_online_training`` wired into an engine; ``state()`` feeds metrics."""

    config: OnlineConfig
    drafter: Eagle3Drafter | MedusaDrafter
    store: SignalStore
    capture: CaptureBuffer
    selective: SelectiveCollector
    collector: SignalCollector
    updater: DrafterUpdater | MedusaUpdater
    adapters: AdapterUpdater | None = None  # LoRA adapters of the served version (``--online-lora``)
    trainer: TrainerSupervisor | None = None  # set by ``supervise_trainer``
    governor: TrainingGovernor | None = None  # pauses the trainer while serving is busy (shared CPU)
    _closed: bool = field(default=False, init=False, repr=False)

    def supervise_trainer(self, start: Callable[[], subprocess.Popen[bytes]], policy: RestartPolicy | None = None,
                          log_path: Path | str | None = None, yield_to: GovernorConfig | None = None
                          ) -> TrainerSupervisor:
        """Start the trainer child (``start()``, e.g. ``start_trainer_process`` with its arguments
        bound) under a ``TrainerSupervisor``: restarted with backoff when it dies; when the
        supervisor gives up for good, capture stops. ``yield_to``: the child shares the engine's CPU
        and a ``TrainingGovernor`` pauses it while serving is busy (None: it always runs, e.g. on
        another device). Raises what the first start raises."""
        if self.trainer is not None:
            raise RuntimeError("a trainer child is already supervised")
        self.trainer = TrainerSupervisor(start, policy, log_path=log_path, on_give_up=self._trainer_gone)
        self.trainer.start()
        if yield_to is not None:
            self.governor = TrainingGovernor(self.trainer, yield_to)
            self.governor.attach(self.collector.engine)
            self.governor.start()
        return self.trainer

    def _trainer_gone(self, state: str) -> None:
        """The supervisor's ``on_give_up``: no trainer will read signals any more, so none are captured."""
        self.collector.enabled = False
        logger.warning("no trainer child any more (%s): signal capture stops; serving goes on with drafter "
                       "version %d", state, self.drafter.version)

    def state(self) -> dict[str, Any]:
        cap = self.capture.stats()
        sel = self.selective.state()
        return {
            "drafter_version": self.drafter.version,
            "collection_enabled": bool(sel["collection_enabled"]) and self.collector.enabled,
            "captured": cap["num_captured"],
            "dropped": cap["num_dropped"],
            "flushed": cap["num_flushed"],
            "flush_errors": cap["num_flush_errors"],
            "swaps": self.updater.num_swaps,
            "refused_versions": sorted(self.updater.refused),
            "trainer_running": self.trainer is not None and self.trainer.running,
            "trainer": self.trainer.state() if self.trainer is not None else None,
            "governor": self.governor.state() if self.governor is not None else None,
            "collector": sel,
            "lora": self.adapters.state() if self.adapters is not None else None,
        }

    def health(self) -> dict[str, Any]:
        """What ``/health`` shows (it answers without an API key): whether training goes on, not
        its data. Serving is healthy whatever this says."""
        return {
            "drafter_version": self.drafter.version,
            "collection_enabled": bool(self.selective.collection_enabled) and self.collector.enabled,
            "trainer": self.trainer.state() if self.trainer is not None else None,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop polling, flush captured rows to the store, stop the trainer child and its
        supervisor if any (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.updater.close()
        if self.adapters is not None:
            self.adapters.close()
        self.capture.close(timeout)
        if self.governor is not None:
            self.governor.close()
        if self.trainer is not None:
            self.trainer.close(timeout)


def budget_shortfall(config: OnlineConfig, taps_dim: int) -> str | None:
    """A one-line warning when the signal store's byte budget cannot hold the rows one training
    round needs (the oldest shards would be evicted before a round could start: training would
    silently never happen), else None.

    Example: SmolLM2-135M taps are 3 x 576 bfloat16 = 3,456 bytes (+ ~44 of ids, positions, alpha)
    per row; 16,384 rows need ~54 MiB, so a 32 MiB budget gets a warning.
    """
    row_bytes = taps_dim * TAPS_DTYPES[config.taps_dtype].itemsize + 5 * 8 + 4  # taps, 5 int64 ids, alpha
    need = config.collection.n_threshold * row_bytes
    if need <= config.signal_budget_bytes:
        return None
    return (f"the signal budget ({config.signal_budget_bytes >> 20} MiB) holds about "
            f"{config.signal_budget_bytes // row_bytes} rows, fewer than one training round needs "
            f"({config.collection.n_threshold} rows, ~{need / 2**20:.0f} MiB): training will never run; "
            f"raise --signal-budget-mb or lower --collect-n-threshold")


def attach_online_training(engine: LLMEngine, config: OnlineConfig, *, start: bool = True) -> OnlineTraining:
    """Wire capture, selective collection and drafter updates into ``engine`` (whose drafter must be an
    ``Eagle3Drafter``, or a ``MedusaDrafter`` when ``config.drafter`` is "medusa": rows of final hidden
    states, no taps, no LoRA, no served rollback check). ``start=False`` leaves the poller thread off
    (tests poll by hand)."""
    drafter = find_member(engine.drafter, config.drafter)
    if not isinstance(drafter, Eagle3Drafter | MedusaDrafter):
        raise OnlineConfigError(f"online training needs the {config.drafter} drafter (--drafter {config.drafter}, "
                                f"or e.g. suffix,{config.drafter})")
    medusa = isinstance(drafter, MedusaDrafter)
    taps_dim = 0 if medusa else drafter.head.cfg.tap_size
    hidden = engine.model.cfg.hidden_size
    shortfall = budget_shortfall(config, hidden if medusa else taps_dim)
    if shortfall is not None:
        logger.warning(shortfall)
    store = SignalStore(config.signal_dir, config.signal_budget_bytes, config.taps_dtype)
    capture = CaptureBuffer(store, config.capture_capacity_rows, config.capture_flush_rows,
                            taps_dim=taps_dim, max_shard_age_s=config.max_shard_age_s,
                            drafter_version=drafter.version, hidden_dim=hidden if config.lora or medusa else 0)
    selective = SelectiveCollector(config.collection)
    collector = SignalCollector(engine, capture, selective, capture_prompt=config.capture_prompt, taps=not medusa,
                                learned=drafter.name, idle_share=config.capture_idle_share)
    if medusa:
        medusa_updater = MedusaUpdater(drafter, config.publish_root, engine.model.cfg, config.poll_s, selective, capture)
        collector.hook_into(engine)
        engine.add_observer(medusa_updater)
        if start:
            medusa_updater.start()
        return OnlineTraining(config, drafter, store, capture, selective, collector, medusa_updater)
    check = None
    if config.rollback_min_drafts:
        policy = engine.policy
        check = ServedCheck(policy_profile(policy) if policy is not None else None,
                            RollbackConfig(min_drafts=config.rollback_min_drafts, gamma_max=max(1, engine.gamma_max)))
        engine.add_observer(check)
    updater = DrafterUpdater(drafter, config.publish_root, engine.model.cfg, config.poll_s, selective, capture, check)
    collector.hook_into(engine)
    engine.add_observer(updater)
    adapters = AdapterUpdater(drafter, config.publish_root, config.poll_s, check) if config.lora else None
    if adapters is not None:
        engine.add_observer(adapters)
    if start:
        updater.start()
        if adapters is not None:
            adapters.start()
    return OnlineTraining(config, drafter, store, capture, selective, collector, updater, adapters)
