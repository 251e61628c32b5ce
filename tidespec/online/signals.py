"""What the serving process and the trainer child share besides the signal store: the engine
observer that captures training signals, a drafter that only makes the engine tap, and the
trainer's round log.

Why this exists: capture runs in the server (signals from served traffic) and in the trainer child
(``train-drafter --from-workload`` decodes prompts plainly and captures the same rows), and the
server reads the round log the child writes; neither side may import the other's code
(``tidespec.online.serving`` / ``tidespec.online.training``), so what both use lives here.

Worked example (rows of one decode step)::

    context t0..t6 (t6 just sampled), obs.start = 4, obs.num_new_cached = 2, taps [2, 3H]
    -> push positions [4, 5], tokens [t4, t5], labels [t5, t6], taps rows 0..1
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidespec.engine.observer import EngineObserver
from tidespec.online.capture import CaptureBuffer
from tidespec.online.collection import SelectiveCollector
from tidespec.speculative.api import DrafterBase, DraftInput, DraftProposal, Observation
from tidespec.speculative.policy.api import SpeculationPolicy
from tidespec.speculative.policy.factory import predicted_speedup
from tidespec.stats import StepStats

if TYPE_CHECKING:
    from tidespec.engine.engine import LLMEngine
    from tidespec.engine.sequence import Sequence

TRAINER_STATE_NAME = "trainer_state.json"  # written by the trainer into the publish root
IDLE_BURST_STEPS = 16  # decode steps of one capture burst while no drafter pays: consecutive rows a round trains on
SEQ_SALT_SHIFT = 40  # store seq id = salt << 40 | engine seq id (engine ids restart per process)


class TapCaptureDrafter(DrafterBase):
    """A drafter that never drafts but makes the engine tap the target's hidden states.

    Used to capture signals from plain decoding (``train-drafter --from-workload``) without
    running any head: the engine only emits observations when its drafter has ``tap_layers``.
    """

    name = "taps"

    def __init__(self, tap_layers: tuple[int, ...], hidden: bool = False) -> None:
        self.tap_layers = tuple(tap_layers)
        self.wants_hidden = hidden  # the final hidden states too (or alone, with no tap layers: Medusa's rows)

    def propose(self, inputs: list[DraftInput]) -> DraftProposal:
        return DraftProposal()


def speculation_pays(policy: SpeculationPolicy | None) -> bool:
    """Whether ``policy`` last predicted a speedup over plain decoding for some drafter
    (``factory.predicted_speedup``; a policy that predicts nothing - static - always says yes)."""
    value = predicted_speedup(policy)
    return value is None or value > 1.0


class SignalCollector(EngineObserver):
    """Observation consumer: turns the engine's observations into capture pushes, gated by
    TIDE's selective collection. Runs on the engine thread; ``push`` never blocks.

    Store seq ids are ``salt << 40 | engine seq id`` with a random per-collector salt, so rows of
    two serving processes (whose engine ids both start at 0) never merge into one segment.
    """

    def __init__(self, engine: LLMEngine, buffer: CaptureBuffer, selective: SelectiveCollector, *,
                 capture_prompt: bool = True, salt: int | None = None, taps: bool = True,
                 learned: str | None = None, idle_share: float = 0.0) -> None:
        if not 0.0 <= idle_share <= 1.0:
            raise ValueError(f"idle_share must be in [0, 1], got {idle_share}")
        self.engine = engine
        self.buffer = buffer
        self.taps = taps  # False: rows of final hidden states only (Medusa), taps [n, 0]
        # the drafter being trained: its own acceptance per request, not the served one, drives Algorithm 1
        # and judges its rounds (beside the suffix drafter the served acceptance is mostly suffix's)
        self.learned = learned
        self.selective = selective
        self.capture_prompt = capture_prompt
        self.salt = (random.getrandbits(22) if salt is None else salt) << SEQ_SALT_SHIFT
        self.enabled = True  # off for good when no trainer will ever read the signals
        self.num_skipped_rows = 0  # rows seen while collection was off
        # decode steps per capture burst and pause while no drafter pays (``_idle_burst``); 0: no bursts
        self._burst_period = max(IDLE_BURST_STEPS, round(IDLE_BURST_STEPS / idle_share)) if idle_share > 0 else 0
        self.num_decode_steps = 0  # decode steps seen: where the idle bursts fall

    def store_seq_id(self, engine_seq_id: int) -> int:
        return self.salt | engine_seq_id

    def hook_into(self, engine: LLMEngine) -> SignalCollector:
        """Follow ``engine``'s steps as an observer (returns self)."""
        return engine.add_observer(self)

    def wants_hidden(self) -> bool:
        """The target's final hidden states, while collecting (with the taps, when LoRA alignment stores
        them; alone, for Medusa heads)."""
        return bool(self.buffer.hidden_dim) and self._collecting()

    def wants_taps(self) -> bool:
        """The target's taps are wanted while collection is on and the
        engine's policy predicts that speculating pays at the current load — also in steps where no
        drafter reads them (the drafter being trained may be parked). Where nothing pays (a large
        batch, a domain where no drafter helps yet) only ``idle_share`` of the decode steps capture
        (``_idle_burst``); the others stay plain decoding's, besides the steps that compute taps
        anyway (prefill, a drafter's probes and the steps around them)."""
        return self.taps and self._collecting()

    def _collecting(self) -> bool:
        return self.enabled and self.selective.collection_enabled and (speculation_pays(self.engine.policy)
                                                                       or self._idle_burst())

    def _idle_burst(self) -> bool:
        """Whether this step lies in a capture burst: the first ``IDLE_BURST_STEPS`` of every
        ``IDLE_BURST_STEPS / idle_share`` decode steps (``_burst_period``). Without them a learned drafter that the policy parks
        on traffic it drafts badly for gets no rows of that traffic, so it never learns what would make it pay:
        EAGLE-3 alone on 64 Chinese requests (``bench shift``, w4a8 + compile) captured 22 rows, no round ran.
        Bursts, not scattered steps: a round trains on runs of consecutive positions (``rounds.py``).

        Example (idle_share 0.25): a period of 64 decode steps, steps 0-15 of each captured, 16-63 not."""
        return self._burst_period > 0 and self.num_decode_steps % self._burst_period < IDLE_BURST_STEPS

    def on_step_end(self, stats: StepStats) -> None:
        if stats.num_decode_seqs:
            self.num_decode_steps += 1

    def on_observations(self, observations: list[Observation]) -> None:
        """Push the observed rows with their taps into the capture buffer while collection is on."""
        if not (self.enabled and self.selective.collection_enabled):
            self.num_skipped_rows += sum(max(0, o.num_new_cached) for o in observations)
            return
        seqs = {s.seq_id: s for s in self.engine.seqs.values()}
        for obs in observations:
            taps = obs.taps if self.taps or obs.hidden is None else obs.hidden.new_empty(obs.num_new_cached, 0)
            if taps is None or obs.num_new_cached <= 0 or obs.start < 0:
                continue
            start = obs.start
            n = min(obs.num_new_cached, len(obs.token_ids) - 1 - start)  # rows whose label is known
            seq = seqs.get(obs.seq_id)
            lo = 0
            if not self.capture_prompt and seq is not None:
                lo = max(0, len(seq.prompt_ids) - 1 - start)  # the last prompt position's label is generated
            if n - lo <= 0:
                continue
            alpha: float | None = None
            domain = ""
            if seq is not None:
                alpha = seq.stats.acceptance(self.learned)
                domain = seq.label or ""
            hidden = None
            if self.buffer.hidden_dim:
                if obs.hidden is None:
                    continue  # LoRA alignment needs the target's hidden states with every row
                hidden = obs.hidden[lo:n]
            ids = obs.token_ids
            self.buffer.push(self.store_seq_id(obs.seq_id), list(range(start + lo, start + n)),
                             ids[start + lo:start + n], ids[start + lo + 1:start + n + 1],
                             taps[lo:n], domain=domain, alpha=alpha, hidden=hidden)

    def on_finish(self, seq: Sequence) -> None:
        """Feed Algorithm 1 the acceptance rate of a finished request: the learned drafter's drafts' (every
        draft's when none is named); a request it drafted nothing for tells nothing about it."""
        alpha = seq.stats.acceptance(self.learned)
        if alpha is not None:
            self.selective.observe_request(min(1.0, alpha))


def read_trainer_rounds(root: Path | str) -> list[dict[str, Any]]:
    """The trainer's round log (``trainer_state.json`` ``rounds``); [] when absent or unreadable."""
    return read_trainer_log(root, "rounds")


def read_trainer_log(root: Path | str, key: str) -> list[dict[str, Any]]:
    """One of the trainer's logs in ``trainer_state.json``: ``rounds``, or ``judgements`` (each
    published version against the head it replaced, on the rows captured after it); [] when absent
    or unreadable."""
    try:
        doc = json.loads((Path(root) / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    entries = doc.get(key) if isinstance(doc, dict) else None
    return [r for r in entries if isinstance(r, dict)] if isinstance(entries, list) else []
