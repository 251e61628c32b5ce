"""Continuous-batching scheduler with chunked prefill and worst-case admission.

Why this exists: requests join and leave between steps; a long prompt must not stall the
sequences that are decoding. Each step the scheduler (1) admits waiting requests FIFO while a
KV slot is free (``admit``; a slot holds ``max_model_len`` tokens and a request is only accepted
if its prompt + max_tokens fits, so an admitted request's worst case always fits), then — once
the policy has chosen each decoding sequence's gamma — (2) reserves ``1 + gamma`` tokens for
every decoding sequence and (3) hands the rest of the token budget to prefill chunks, oldest
first (``schedule``).

Worked example: budget 64, three decoding sequences with gammas 4, 4, 0 (5 + 5 + 1 = 11
reserved) and a 100-token prompt waiting -> this step prefills prompt tokens 0..52, the next
step the rest, while the three keep decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tidespec.engine.sequence import SeqStatus, Sequence
from tidespec.errors import UserError
from tidespec.models.kv_cache import KVCache


class QueueFullError(UserError, RuntimeError):
    """The bounded waiting queue is full (the server maps it to HTTP 429)."""


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk
    num_tokens: int

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == len(self.seq.prompt_ids)


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, kv: KVCache, max_num_batched_tokens: int, max_waiting: int = 0) -> None:
        self.kv = kv
        self.budget = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. ``max_waiting`` bounds the sequences that must wait for a KV slot:
        those that a free slot will take at the next admission do not count (a burst arriving
        between two steps is not refused while slots are free)."""
        if self.max_waiting and len(self.waiting) >= self.max_waiting + self.kv.num_free_slots:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and free its slot (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free KV slots, FIFO; returns those admitted."""
        admitted = []
        while self.waiting and self.kv.num_free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.kv.allocate()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def decoding(self) -> list[Sequence]:
        """Running sequences past their prompt: each decodes (and maybe speculates) this step."""
        return [seq for seq in self.running if not seq.in_prefill]

    def schedule(self, gammas: dict[int, int]) -> ScheduledBatch:
        """The step's batch: every decoding sequence with ``1 + gammas[seq_id]`` tokens reserved
        (a sequence missing from ``gammas`` decodes plainly), prefill chunks in what is left."""
        batch = ScheduledBatch()
        left = self.budget
        for seq in self.running:
            if not seq.in_prefill:
                batch.decode.append(seq)
                left -= 1 + gammas.get(seq.seq_id, 0)
        for seq in self.running:
            if seq.in_prefill and left > 0:
                n = min(len(seq.prompt_ids) - seq.num_cached, left)
                batch.prefill.append(PrefillChunk(seq, seq.num_cached, n))
                left -= n
        return batch
